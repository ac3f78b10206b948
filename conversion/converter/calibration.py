"""The data-driven parts of initialising a delta layer from its teacher's activations.

`copy` init: output RMSNorm weight = per-channel RMS of the teacher's attention output (before `o_proj`).

`calibrated` init, on top of that, per layer:

1. decay and beta per state (per head, or per KV head with a GQA-shared state). The teacher's attention gives
   a prior (half-life from the mean attention distance, `decay_from_distance`; beta from the attention entropy,
   `beta_from_entropy`; a shared state takes its group's mean distance and entropy); that pair and a small
   fixed grid of (beta, half-life) pairs are tried, and each state keeps the pair whose output, after the best
   per-head scale, is closest to the teacher head's output (relative least-squares error, averaged over the
   query heads reading a shared state; states are independent before `o_proj`, so all are searched at once);
2. a per-head output scale by least squares on the layer output (`fit_head_scales`): a head the delta
   rule cannot imitate well is turned down instead of adding noise;
3. optionally `steps` of Adam on the layer's new parameters (`fit_layer`, MSE to the teacher output).
"""

from __future__ import annotations

import dataclasses

import torch

from . import init_recipes as I
from .attention_transfer import LayerActivations, fit_head_scales, fit_layer, relative_error
from ..precision import autocast

CANDIDATE_BETAS = (0.05, 0.15, 0.35, 0.7, 0.95)
CANDIDATE_HALF_LIVES = (2.0, 8.0, 32.0, 128.0, 512.0, 2048.0)


@dataclasses.dataclass
class LayerCalibration:
    """What calibration chose for one layer, and the relative MSE to the teacher output it reached."""

    beta: list[float] | None = None
    half_life: list[float] | None = None
    head_scale: list[float] | None = None
    prior_beta: list[float] | None = None
    prior_half_life: list[float] | None = None
    error_before_steps: float | None = None
    error: float | None = None
    losses: list[float] = dataclasses.field(default_factory=list)


def half_life_of(decay: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.tensor(0.5)) / torch.log(decay.clamp(max=1 - 1e-7))


@torch.no_grad()
def _head_outputs(attn, inputs: torch.Tensor, bf16: bool) -> torch.Tensor:
    captured = {}
    handle = attn.o_proj.register_forward_pre_hook(lambda m, a: captured.__setitem__("x", a[0]))
    try:
        with autocast(bf16):
            attn(inputs.float())
    finally:
        handle.remove()
    return captured["x"].float()


@torch.no_grad()
def head_errors(attn, inputs: torch.Tensor, target_heads: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """Per head, 1 - cos^2 between the layer's head output and the teacher's: the relative error left after
    the best scale of that head (0 = a scaled copy, 1 = no use)."""
    heads, dim = attn.num_heads, attn.value_head_dim
    y = _head_outputs(attn, inputs, bf16).reshape(-1, heads, dim)
    t = target_heads.float().reshape(-1, heads, dim)
    yt = (y * t).sum((0, 2))
    yy = (y * y).sum((0, 2)).clamp(min=1e-20)
    tt = (t * t).sum((0, 2)).clamp(min=1e-20)
    return 1 - yt.clamp(min=0).pow(2) / (yy * tt)


def group_mean(per_head: torch.Tensor, states: int) -> torch.Tensor:
    """[H] values of the query heads -> [states] means over the heads reading each state (head h reads state
    h // (H / states)); the identity with one state per head."""
    return per_head.reshape(states, -1).mean(-1)


def search_decay_beta(attn, acts: LayerActivations, windows: int, bf16: bool = False):
    """Per state, the (beta, decay) among the prior and the grid with the lowest `head_errors` (averaged over the
    query heads reading it)."""
    states = attn.num_state_heads
    inputs = acts.inputs[:windows]
    target = acts.heads[:windows]
    candidates = []
    prior_beta = prior_decay = None
    if acts.entropy is not None:
        prior_beta = I.beta_from_entropy(group_mean(acts.entropy, states))
        prior_decay = I.decay_from_distance(group_mean(acts.mean_distance, states)) if attn.gate != "none" else None
        candidates.append((prior_beta, prior_decay))
    half_lives = CANDIDATE_HALF_LIVES if attn.gate != "none" else (None,)
    for beta in CANDIDATE_BETAS:
        for half_life in half_lives:
            decay = None if half_life is None else torch.full((states,), 0.5 ** (1.0 / half_life))
            candidates.append((torch.full((states,), beta), decay))
    best_err = torch.full((states,), float("inf"))
    best_beta = torch.full((states,), I.COPY_BETA)
    best_decay = torch.ones(states) if attn.gate != "none" else None
    for beta, decay in candidates:
        attn.set_beta_at_rest(beta)
        if decay is not None:
            attn.set_decay_at_rest(decay)
        err = group_mean(head_errors(attn, inputs, target, bf16), states)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_beta = torch.where(better, beta, best_beta)
        if decay is not None:
            best_decay = torch.where(better, decay.clamp(*attn.DECAY_AT_REST_RANGE), best_decay)
    attn.set_beta_at_rest(best_beta)
    if best_decay is not None:
        attn.set_decay_at_rest(best_decay)
    return best_beta, best_decay, prior_beta, prior_decay


def calibrate_layer(
    attn,
    acts: LayerActivations,
    init: str = "calibrated",
    steps: int = 0,
    lr: float = 3e-3,
    search_windows: int = 2,
    batch_size: int = 1,
    bf16: bool = False,
    seed: int = 0,
) -> LayerCalibration:
    """Data-driven init of one delta layer whose projections and defaults are already set (`init.py`)."""
    if init not in ("copy", "calibrated"):
        raise ValueError(f"init must be 'copy' or 'calibrated', got {init!r}")
    info = LayerCalibration()
    I.set_output_norm(attn, acts.channel_rms)
    if init == "calibrated":
        if acts.heads is None:
            raise ValueError("calibrated init needs the teacher's per-head outputs (collect with store_heads=True)")
        beta, decay, prior_beta, prior_decay = search_decay_beta(attn, acts, search_windows, bf16)
        info.beta = beta.tolist()
        info.half_life = half_life_of(decay).tolist() if decay is not None else None
        info.prior_beta = prior_beta.tolist() if prior_beta is not None else None
        info.prior_half_life = half_life_of(prior_decay).tolist() if prior_decay is not None else None
        scale = fit_head_scales(attn, acts.inputs[:search_windows], acts.outputs[:search_windows], bf16=bf16)
        I.scale_output_norm(attn, scale)
        info.head_scale = scale.tolist()
        if steps > 0:
            info.error_before_steps = relative_error(attn, acts.inputs, acts.outputs, bf16=bf16)
            info.losses = fit_layer(attn, acts.inputs, acts.outputs, steps, lr=lr, batch_size=batch_size,
                                    bf16=bf16, seed=seed)
    info.error = relative_error(attn, acts.inputs, acts.outputs, bf16=bf16)
    return info


__all__ = ["CANDIDATE_BETAS", "CANDIDATE_HALF_LIVES", "LayerCalibration", "calibrate_layer", "group_mean",
           "head_errors", "search_decay_beta"]
