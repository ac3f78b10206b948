"""Per-layer attention transfer: teacher activations collected with hooks, and fitting a delta layer to them.

One teacher forward (per batch of windows) gives, for every layer asked for:

* `inputs`: the attention module's input (the hidden states after `input_layernorm`);
* `outputs`: the attention module's output (after `o_proj`), the target of a converted layer;
* `channel_rms`: the per-channel RMS of the attention output before `o_proj` (`[H * d]`);
* with `attention_stats=True` (eager attention for that forward): per head, the mean attention distance and
  entropy, both measured on the queries of each window's second half with the first key (the attention
  sink) left out and the rest renormalised, and the mass on that sink.

Layers are independent given these activations, so `fit_layer` trains one delta layer at a time by MSE
against the teacher output; the conversion uses it for a few calibration steps and distillation (stage 1)
for a longer run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from tqdm.auto import tqdm

from ..precision import autocast


@dataclasses.dataclass
class LayerActivations:
    inputs: torch.Tensor  # [N, T, D]
    outputs: torch.Tensor  # [N, T, D]
    channel_rms: torch.Tensor | None  # [H * d]; None when not asked for (channel_stats=False)
    heads: torch.Tensor | None = None  # [N, T, H * d]: the attention output before o_proj (store_heads=True)
    mean_distance: torch.Tensor | None = None  # [H]
    entropy: torch.Tensor | None = None  # [H]
    sink_mass: torch.Tensor | None = None  # [H]


class _Accumulator:
    def __init__(self):
        self.inputs, self.outputs, self.heads = [], [], []
        self.sq_sum, self.count = None, 0
        self.dist = self.ent = self.sink = None
        self.stat_batches = 0

    def add_stats(self, weights: torch.Tensor) -> None:
        # weights: [B, H, T, T], rows sum to 1 (causal)
        seq = weights.shape[-1]
        start = seq // 2
        p = weights[:, :, start:, :].float()
        sink = p[..., 0]
        rest = p[..., 1:]
        rest = rest / rest.sum(-1, keepdim=True).clamp(min=1e-9)
        query_pos = torch.arange(start, seq, dtype=torch.float32)[:, None]
        key_pos = torch.arange(1, seq, dtype=torch.float32)[None, :]
        distance = (query_pos - key_pos).clamp(min=0)
        mean_distance = (rest * distance).sum(-1).mean(dim=(0, 2))
        entropy = -(rest * rest.clamp(min=1e-12).log()).sum(-1).mean(dim=(0, 2))
        sink = sink.mean(dim=(0, 2))
        if self.dist is None:
            self.dist, self.ent, self.sink = mean_distance, entropy, sink
        else:
            self.dist, self.ent, self.sink = self.dist + mean_distance, self.ent + entropy, self.sink + sink
        self.stat_batches += 1

    def result(self) -> LayerActivations:
        rms = None if self.sq_sum is None else (self.sq_sum / max(self.count, 1)).sqrt()
        stats = {}
        if self.stat_batches:
            n = self.stat_batches
            stats = {"mean_distance": self.dist / n, "entropy": self.ent / n, "sink_mass": self.sink / n}
        heads = _joined(self.heads) if self.heads else None
        return LayerActivations(_joined(self.inputs), _joined(self.outputs), rms, heads=heads, **stats)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)`, without the copy when there is one part (one batch, as in distillation's stage 1)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def attention_layers(model) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


class _LastLayerDone(Exception):
    """Raised by the hook of the last asked layer: nothing after it is needed (later layers, the LM head)."""


@torch.no_grad()
def collect_teacher_activations(
    teacher,
    windows: torch.Tensor,
    layers: Iterable[int],
    batch_size: int = 1,
    attention_stats: bool = False,
    bf16: bool = False,
    store_dtype: torch.dtype = torch.float32,
    store_heads: bool = False,
    progress: bool = True,
    channel_stats: bool = True,
) -> dict[int, LayerActivations]:
    """Run `teacher` over `windows` ([N, T] token ids) once and return each asked layer's activations.

    Only the decoder runs, and only up to the last asked layer's attention: the rest could not change them. With
    `channel_stats=False` (distillation's stage 1, which needs only inputs and outputs) no `channel_rms` is
    measured. Activations already in `store_dtype` on the CPU are kept as they are, not copied."""
    layers = sorted(set(layers))
    modules = attention_layers(teacher)
    acc = {i: _Accumulator() for i in layers}
    handles = []

    def pre_hook(i):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            acc[i].inputs.append(hidden.detach().to(store_dtype).cpu())

        return hook

    def post_hook(i):
        def hook(module, args, kwargs, output):
            out, weights = (output[0], output[1]) if isinstance(output, tuple) else (output, None)
            acc[i].outputs.append(out.detach().to(store_dtype).cpu())
            if attention_stats:
                if weights is None:
                    raise RuntimeError(f"layer {i} returned no attention weights; eager attention is needed")
                acc[i].add_stats(weights.detach())
            if i == layers[-1]:
                raise _LastLayerDone

        return hook

    def o_hook(i):
        def hook(module, args):
            if channel_stats:
                x = args[0].detach().float()
                sq = x.pow(2).flatten(0, -2).sum(0)
                acc[i].sq_sum = sq if acc[i].sq_sum is None else acc[i].sq_sum + sq
                acc[i].count += x.flatten(0, -2).shape[0]
            if store_heads:
                acc[i].heads.append(args[0].detach().to(store_dtype).cpu())

        return hook

    previous = teacher.config._attn_implementation
    if attention_stats and previous != "eager":
        teacher.set_attn_implementation("eager")
    try:
        for i in layers:
            handles.append(modules[i].register_forward_pre_hook(pre_hook(i), with_kwargs=True))
            handles.append(modules[i].register_forward_hook(post_hook(i), with_kwargs=True))
            if channel_stats or store_heads:
                handles.append(modules[i].o_proj.register_forward_pre_hook(o_hook(i)))
        device = next(teacher.parameters()).device
        for start in tqdm(range(0, len(windows), batch_size), desc="teacher activations", disable=not progress):
            ids = windows[start : start + batch_size].to(device)
            with autocast(bf16):
                try:
                    teacher.model(input_ids=ids, use_cache=False)
                except _LastLayerDone:
                    pass
    finally:
        for handle in handles:
            handle.remove()
        if attention_stats and previous != "eager":
            teacher.set_attn_implementation(previous)
    return {i: acc[i].result() for i in layers}


def relative_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The attention-transfer objective: sum ||output - target||^2 / sum ||target||^2 (float32, differentiable).

    Relative, so its scale does not depend on a layer's output norm and layers can be averaged."""
    output, target = output.float(), target.float()
    return (output - target).pow(2).sum() / target.pow(2).sum().clamp(min=1e-12)


def _attn_forward(attn, inputs: torch.Tensor) -> torch.Tensor:
    return attn(inputs)[0]


@torch.no_grad()
def relative_error(attn, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 4, bf16: bool = False) -> float:
    """`relative_mse` of `attn` over all the activations (summed over batches before dividing)."""
    err, ref = 0.0, 0.0
    device = next(attn.parameters()).device
    for start in range(0, len(inputs), batch_size):
        x = inputs[start : start + batch_size].to(device).float()
        y = targets[start : start + batch_size].to(device).float()
        with autocast(bf16):
            out = _attn_forward(attn, x)
        err += (out.float() - y).pow(2).sum().item()
        ref += y.pow(2).sum().item()
    return err / max(ref, 1e-30)


@torch.no_grad()
def fit_head_scales(attn, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 4,
                    bf16: bool = False, ridge: float = 1e-3) -> torch.Tensor:
    """Least-squares scale per head: the `alpha` minimising ||sum_h alpha_h O_h y_h - target||^2.

    `y_h` is head h's output entering `o_proj` and `O_h` its columns of `o_proj`; the normal equations are
    an H x H system (ridge-regularised towards alpha = 1). Returns `alpha` ([H]).
    """
    heads, head_dim = attn.num_heads, attn.value_head_dim
    captured = {}
    handle = attn.o_proj.register_forward_pre_hook(lambda m, a: captured.__setitem__("x", a[0]))
    weight = attn.o_proj.weight.detach().float().view(-1, heads, head_dim)  # [D, H, V]
    gram = torch.zeros(heads, heads, dtype=torch.float64)
    rhs = torch.zeros(heads, dtype=torch.float64)
    device = next(attn.parameters()).device
    try:
        for start in range(0, len(inputs), batch_size):
            x = inputs[start : start + batch_size].to(device).float()
            y = targets[start : start + batch_size].to(device).float()
            if attn.o_proj.bias is not None:
                y = y - attn.o_proj.bias.float()
            with autocast(bf16):
                _attn_forward(attn, x)
            heads_in = captured["x"].float().reshape(-1, heads, head_dim)
            contrib = torch.einsum("nhv,dhv->nhd", heads_in, weight)  # [N, H, D]
            gram += torch.einsum("nhd,nkd->hk", contrib, contrib).double().cpu()
            rhs += torch.einsum("nhd,nd->h", contrib, y.reshape(-1, y.shape[-1])).double().cpu()
    finally:
        handle.remove()
    reg = ridge * gram.diagonal().mean().clamp(min=1e-12)
    alpha = torch.linalg.solve(gram + reg * torch.eye(heads, dtype=torch.float64), rhs + reg)
    return alpha.float()


def fit_layer(
    attn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    steps: int,
    lr: float = 3e-3,
    batch_size: int = 2,
    params: list[torch.nn.Parameter] | None = None,
    bf16: bool = False,
    weight_decay: float = 0.0,
    seed: int = 0,
    progress: bool = False,
    desc: str | None = None,
) -> list[float]:
    """Train `params` of one attention layer (default: its new parameters) by `relative_mse` to `targets` on each
    batch; returns the losses. Batches are drawn from the activations in a fixed random order (seeded).
    """
    params = attn.new_parameters() if params is None else params
    if steps <= 0 or not params:
        return []
    frozen = [p for p in attn.parameters() if all(p is not q for q in params)]
    saved = [p.requires_grad for p in frozen]
    for p in frozen:
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, steps // 10)) * (0.1 + 0.9 * (1 - s / steps))
    )
    generator = torch.Generator().manual_seed(seed)
    device = next(attn.parameters()).device
    was_training = attn.training
    attn.train()
    losses = []
    try:
        order = torch.randperm(len(inputs), generator=generator)
        cursor = 0
        for _ in tqdm(range(steps), desc=desc, disable=not progress, leave=False):
            if cursor + batch_size > len(order):
                order, cursor = torch.randperm(len(inputs), generator=generator), 0
            index = order[cursor : cursor + batch_size]
            cursor += batch_size
            x = inputs[index].to(device).float()
            y = targets[index].to(device).float()
            with autocast(bf16):
                out = _attn_forward(attn, x)
            loss = relative_mse(out, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
    finally:
        attn.train(was_training)
        for p, flag in zip(frozen, saved):
            p.requires_grad_(flag)
    return losses


__all__ = [
    "LayerActivations",
    "attention_layers",
    "collect_teacher_activations",
    "fit_head_scales",
    "fit_layer",
    "relative_error",
    "relative_mse",
]
