"""Distilling a converted delta model from its teacher, in two resumable stages on the shared training loop.

1. Attention transfer: one teacher forward per batch gives every converted layer its input hidden states and
   the teacher's attention output; each converted layer is trained by relative MSE against it. Only the
   delta layers' new parameters train (or all their parameters, `stage1_params="mixer"`); nothing per token
   is stored beyond the batch.
2. Logit distillation: KL(teacher || student) at a temperature (optionally plus cross-entropy), LoRA (PEFT)
   on the copied projections and the small new parameters (gates, beta, decay, conv, norms) in full at
   their own learning rate. The logits of both models are made a chunk of positions at a time, each chunk's
   KL gradient worked out from the softmaxes at once, so no `[batch, seq_len, vocab]` tensor is ever held whole
   and no logits are made twice.
3. Long-context distillation: stage 2's loss on long blocks (thousands of tokens).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from delta_attention.modeling.configuration_delta import delta_layer_indices as _delta_layer_indices

from ..converter.attention_transfer import collect_teacher_activations, relative_mse
from ..data.chat import IGNORE_INDEX
from ..evaluation.perplexity import perplexity
from .frozen_casts import FrozenLinearCasts
from .softmax_kl import fused_kl_rows_and_gradient, kl_rows_and_gradient

def delta_layer_indices(student) -> list[int]:
    """Indices of the student's delta layers."""
    return _delta_layer_indices(student.config.layer_types)


def stage1_parameters(student, layers: list[int], which: str = "new") -> list[nn.Parameter]:
    """Parameters stage 1 trains: the delta layers' new parameters ("new") or all their parameters ("mixer")."""
    if which not in ("new", "mixer"):
        raise ValueError(f"stage1_params must be 'new' or 'mixer', got {which!r}")
    mixers = [student.model.layers[i].self_attn for i in layers]
    if which == "new":
        return [p for attn in mixers for p in attn.new_parameters()]
    return [p for attn in mixers for p in attn.parameters()]


class AttentionTransfer(nn.Module):
    """Stage-1 objective as a module (so DDP wraps exactly what trains): mean relative MSE over delta layers.

    The teacher is held outside the module tree: frozen, never wrapped, never checkpointed.
    """

    def __init__(self, teacher: nn.Module, student: nn.Module, layers: list[int]):
        super().__init__()
        self.layers = list(layers)
        self.mixers = nn.ModuleDict({str(i): student.model.layers[i].self_attn for i in self.layers})
        object.__setattr__(self, "teacher", teacher)
        self._casts = FrozenLinearCasts()  # the frozen linear weights, cast once for the training autocast

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """`position_ids` (restarting per packed document) reach the teacher's forward and every delta layer."""
        with self._casts.cast_in(self.teacher, self.mixers, device_type=input_ids.device.type):
            return self._forward(input_ids, position_ids)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        with _forward_with(self.teacher.model, position_ids=position_ids):
            activations = collect_teacher_activations(
                self.teacher, input_ids, self.layers, batch_size=len(input_ids), progress=False, channel_stats=False
            )
        device = input_ids.device
        documents = _packed_documents(position_ids, len(input_ids))
        errors = {}
        for i in self.layers:
            inputs, targets = activations[i].inputs.to(device), activations[i].outputs.to(device).float()
            errors[i] = relative_mse(self.mixers[str(i)](inputs, documents=documents)[0], targets)
        loss = torch.stack(list(errors.values())).mean()
        worst = max(errors, key=lambda i: errors[i].item())
        return loss, {"worst_layer": worst, "worst_layer_mse": errors[worst].item()}


@contextlib.contextmanager
def _forward_with(module: nn.Module, **kwargs):
    """Within the block, calls of `module` get `kwargs` added (None values are left out): the teacher's decoder is
    run by `collect_teacher_activations`, which passes only token ids."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if not kwargs:
        yield
        return
    own = vars(module).get("forward")  # an instance attribute already there (e.g. set by accelerate), if any
    module.forward = functools.partial(module.forward, **kwargs)
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _packed_documents(position_ids: torch.Tensor | None, batch: int):
    """The packed documents a delta layer runs one by one (from a zero state), as the student's decoder finds them
    in `position_ids` that restart inside a row; None when there are none."""
    if position_ids is None:
        return None
    from delta_attention.modeling.modeling_delta import DeltaModel

    return DeltaModel._packed_documents(position_ids, None, None, batch)


def batch_inputs(batch) -> dict:
    """A training batch (token ids, or a dict with `input_ids` and perhaps `position_ids`) as forward arguments."""
    if isinstance(batch, dict):
        return {key: batch[key] for key in ("input_ids", "position_ids") if key in batch}
    return {"input_ids": batch}


def _summed_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the distributions softened at `temperature`, summed over every position."""
    teacher_logp = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    student_logp = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return F.kl_div(student_logp.flatten(0, -2), teacher_logp.flatten(0, -2), log_target=True, reduction="sum")


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean per-token KL(teacher || student) of the softened distributions, times T^2 (Hinton et al.)."""
    positions = student_logits.shape[:-1].numel()
    return _summed_kl(student_logits, teacher_logits, temperature) / positions * temperature**2


class LogitDistillation(nn.Module):
    """Stage-2 objective as a module: KL(teacher || student) at `temperature`, plus `ce_weight` x cross-entropy.

    With `chunk_tokens` (stage 2 of `distill` and stage 3), both models run their decoders once and the logits are
    made `chunk_tokens` positions at a time (`chunked_distillation_loss`): only `[batch, seq_len, hidden]` hidden
    states are kept, never `[batch, seq_len, vocab]` logits. Without it (None) the whole logits of both models are
    made at once and scored by `distillation_kl`, the plain reference."""

    def __init__(self, teacher: nn.Module, student: nn.Module, temperature: float = 1.0, ce_weight: float = 0.0,
                 chunk_tokens: int | None = None, compiled_kl: bool = False):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.student, self.temperature, self.ce_weight = student, temperature, ce_weight
        self.chunk_tokens, self.compiled_kl = chunk_tokens, compiled_kl
        object.__setattr__(self, "teacher", teacher)
        self._casts = FrozenLinearCasts()  # the frozen linear weights, cast once for the training autocast

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """Teacher and student see the same `position_ids` (the same document boundaries when packed). With
        `labels` (chat rows: -100 outside the answers, as `data.chat.chat_rows` makes them) only the positions that
        predict a labelled token count, in the KL and the cross-entropy alike. Under autocast the frozen linear
        weights of both models take copies cast once (`FrozenLinearCasts`): the same products, fewer casts."""
        with self._casts.cast_in(self.teacher, self.student, device_type=input_ids.device.type):
            return self._forward(input_ids, position_ids, labels)

    def _forward(self, input_ids, position_ids, labels) -> tuple[torch.Tensor, dict]:
        if self.chunk_tokens is not None:
            return self._chunked_forward(input_ids, position_ids, labels)
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        student_logits = self.student(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        ce_logits, ce_targets = student_logits[:, :-1], input_ids[:, 1:]  # [B, L-1, V], [B, L-1]
        if labels is not None:
            counted = labels[:, 1:] != IGNORE_INDEX  # [B, L-1]: position t predicts answer token t + 1
            student_logits, teacher_logits = student_logits[:, :-1][counted], teacher_logits[:, :-1][counted]  # [n, V]
            ce_logits, ce_targets = student_logits, labels[:, 1:][counted]
        kl = distillation_kl(student_logits, teacher_logits, self.temperature)
        metrics = {"kl": kl.item()}
        loss = kl
        if self.ce_weight:
            ce = F.cross_entropy(ce_logits.float().flatten(0, -2), ce_targets.flatten())
            loss = loss + self.ce_weight * ce
            metrics["ce"] = ce.item()
        return loss, metrics

    def _chunked_forward(self, input_ids, position_ids, labels) -> tuple[torch.Tensor, dict]:
        """`forward` with the logits made `chunk_tokens` positions at a time (the same positions count)."""
        teacher_decoder, teacher_head = decoder_and_head(self.teacher)
        student_decoder, student_head = decoder_and_head(self.student)
        with torch.no_grad():
            teacher_hidden = teacher_decoder(input_ids=input_ids, position_ids=position_ids,
                                             use_cache=False).last_hidden_state  # [batch, seq_len, hidden]
        student_hidden = student_decoder(input_ids=input_ids, position_ids=position_ids,
                                         use_cache=False).last_hidden_state  # [batch, seq_len, hidden]
        last = input_ids.new_full((len(input_ids), 1), IGNORE_INDEX)  # the last position predicts nothing
        next_tokens = torch.cat([(input_ids if labels is None else labels)[:, 1:], last], dim=1)  # [batch, seq_len]
        counted = None if labels is None else next_tokens != IGNORE_INDEX
        kl, ce = chunked_distillation_loss(student_hidden, teacher_hidden, student_head, teacher_head,
                                           self.temperature, self.chunk_tokens,
                                           next_tokens if self.ce_weight else None, counted, self.compiled_kl)
        if ce is None:
            return kl, {"kl": kl.item()}
        return kl + self.ce_weight * ce, {"kl": kl.item(), "ce": ce.item()}


def decoder_and_head(model) -> tuple[nn.Module, nn.Module]:
    """A causal LM's decoder (giving the hidden states after the final norm) and its LM head; a PEFT model is
    looked into (its LoRA layers sit inside the decoder and stay in use)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def _ce_rows_and_gradient(student_logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy against `targets` (`[n]`, 0 where the target is `IGNORE_INDEX`) and its gradient with
    respect to the logits, `softmax(s) - onehot(target)` (zero rows where ignored)."""
    scored = targets != IGNORE_INDEX  # [n]
    logp = F.log_softmax(student_logits.float(), dim=-1)  # [n, vocab]
    safe_targets = targets.clamp(min=0)[:, None]  # [n, 1]
    rows = -logp.gather(-1, safe_targets).squeeze(-1) * scored
    gradient = logp.exp_()
    gradient.scatter_add_(-1, safe_targets, -torch.ones_like(safe_targets, dtype=gradient.dtype))
    return rows, gradient.mul_(scored[:, None])


class _HeadLossesByChunk(torch.autograd.Function):
    """The summed KL and cross-entropy of `student_head(student_rows)` against `teacher_head(teacher_rows)`, made
    `chunk` rows at a time, with their gradients (with respect to the student's rows and to the head's trainable
    parameters) worked out chunk by chunk in the forward pass from the softmaxes, so that no logits are kept for the
    backward pass and none are made again. The backward pass only scales the stored gradients."""

    @staticmethod
    def forward(ctx, student_rows, teacher_rows, kl_rows, targets, student_head, teacher_head, temperature, chunk,
                kl_function, *head_params):
        # student_rows, teacher_rows: [n, hidden]; kl_rows: [n] booleans or None; targets: [n] or None
        kl_sum = ce_sum = student_rows.new_zeros((), dtype=torch.float32)
        kl_grad_rows, ce_grad_rows = torch.zeros_like(student_rows), torch.zeros_like(student_rows)
        kl_grad_params = [torch.zeros_like(p) for p in head_params]
        ce_grad_params = [torch.zeros_like(p) for p in head_params]
        for start in range(0, len(student_rows), chunk):
            part = slice(start, start + chunk)
            rows = student_rows[part].detach().requires_grad_()
            with torch.enable_grad():
                student_logits = student_head(rows)  # [chunk, vocab]
            with torch.no_grad():
                teacher_logits = teacher_head(teacher_rows[part])  # [chunk, vocab]
            kl, kl_grad = kl_function(student_logits.detach(), teacher_logits, temperature,
                                      None if kl_rows is None else kl_rows[part])  # [chunk], [chunk, vocab]
            del teacher_logits
            kl_sum = kl_sum + kl.sum()
            inputs = (rows, *head_params)
            grads = torch.autograd.grad(student_logits, inputs, kl_grad, retain_graph=targets is not None)
            del kl_grad
            kl_grad_rows[part] = grads[0]
            for total, grad in zip(kl_grad_params, grads[1:]):
                total += grad
            if targets is not None:
                ce, ce_grad = _ce_rows_and_gradient(student_logits.detach(), targets[part])
                ce_sum = ce_sum + ce.sum()
                grads = torch.autograd.grad(student_logits, inputs, ce_grad.to(student_logits.dtype))
                ce_grad_rows[part] = grads[0]
                for total, grad in zip(ce_grad_params, grads[1:]):
                    total += grad
        ctx.save_for_backward(kl_grad_rows, ce_grad_rows, *kl_grad_params, *ce_grad_params)
        ctx.params = len(head_params)
        return kl_sum, ce_sum

    @staticmethod
    def backward(ctx, kl_scale, ce_scale):
        kl_grad_rows, ce_grad_rows, *param_grads = ctx.saved_tensors
        kl_params, ce_params = param_grads[: ctx.params], param_grads[ctx.params :]
        rows = kl_grad_rows * kl_scale + ce_grad_rows * ce_scale
        params = [kl * kl_scale + ce * ce_scale for kl, ce in zip(kl_params, ce_params)]
        return rows, None, None, None, None, None, None, None, None, *params


def chunked_distillation_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, student_head: nn.Module,
                              teacher_head: nn.Module, temperature: float, chunk_tokens: int,
                              next_tokens: torch.Tensor | None = None, counted: torch.Tensor | None = None,
                              compiled_kl: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`distillation_kl` of `head(hidden)` over the positions `counted` marks (every position when None) and, given
    `next_tokens`, the student's mean cross-entropy against them, computed `chunk_tokens` positions at a time.

    `student_hidden`, `teacher_hidden`: `[batch, seq_len, hidden]`; `next_tokens`: `[batch, seq_len]`, the token
    each position predicts (`IGNORE_INDEX` where none is scored); `counted`: `[batch, seq_len]` booleans. Only the
    positions scored by either term are put through the heads, `chunk_tokens` of them (over the whole batch) at a
    time: each chunk's logits (`[chunk, vocab]`) give the loss and, from the softmaxes, its gradient straight away
    (`_HeadLossesByChunk`), so at most one chunk of logits is alive and none is made twice; the teacher's head runs
    without gradients. Each chunk's KL and gradient come from `softmax_kl.kl_rows_and_gradient`, or its compiled
    form with `compiled_kl` (falls back to the eager one, logged once, where inductor cannot compile). Returns
    `(kl, ce)`, `ce` None without `next_tokens`. The plain reference is `distillation_kl` of the whole logits."""
    scored = None if next_tokens is None else next_tokens != IGNORE_INDEX  # [batch, seq_len]
    kept = counted if scored is None or counted is None else counted | scored  # [batch, seq_len] or None
    student_rows, teacher_rows = student_hidden.flatten(0, 1), teacher_hidden.flatten(0, 1)  # [batch * seq_len, D]
    kl_rows = targets = None
    if next_tokens is not None:
        targets = next_tokens.flatten()
    if kept is not None:
        kept = kept.flatten()
        student_rows, teacher_rows = student_rows[kept], teacher_rows[kept]  # [n, hidden]
        kl_rows = counted.flatten()[kept] if scored is not None else None  # [n]: with no CE every kept row counts
        targets = None if targets is None else targets[kept]
    head_params = [p for p in student_head.parameters() if p.requires_grad]
    # a frozen head is cast to the autocast dtype once here, not at every chunk (a no-op inside the objectives,
    # whose frozen weights are cast already)
    with FrozenLinearCasts().cast_in(student_head, teacher_head, device_type=student_rows.device.type):
        kl_sum, ce_sum = _HeadLossesByChunk.apply(
            student_rows, teacher_rows, kl_rows, targets, student_head, teacher_head, temperature, chunk_tokens,
            fused_kl_rows_and_gradient if compiled_kl else kl_rows_and_gradient, *head_params)
    positions = student_hidden.shape[:2].numel() if counted is None else int(counted.sum())
    kl = kl_sum / max(positions, 1) * temperature**2
    if next_tokens is None:
        return kl, None
    return kl, ce_sum / max(int(scored.sum()), 1)


class ChunkedLogitDistillation(LogitDistillation):
    """Stage-3 objective (long blocks): `LogitDistillation` with its logits always made `chunk_tokens` positions at a
    time (`chunked_distillation_loss`)."""

    def __init__(self, teacher: nn.Module, student: nn.Module, temperature: float = 1.0, ce_weight: float = 0.0,
                 chunk_tokens: int = 512, compiled_kl: bool = False):
        if chunk_tokens is None or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        super().__init__(teacher, student, temperature, ce_weight, chunk_tokens, compiled_kl)


def add_lora(student, config):
    """Wrap `student` with PEFT LoRA (`config`, a `peft.LoraConfig`); also unfreezes the delta layers' new parameters.

    Returns `(peft_model, new_params)`; `new_params` are the small new parameters trained in full.
    """
    from peft import get_peft_model

    # taken before PEFT wraps anything: LoRA targets such as all-linear also wrap the delta layers' new projections
    # (their weights stay, as `base_layer`), and those LoRA weights belong to the LoRA group only
    new_params = [p for i in delta_layer_indices(student) for p in student.model.layers[i].self_attn.new_parameters()]
    model = get_peft_model(student, config)
    for p in new_params:
        p.requires_grad_(True)
    return model, new_params


@dataclasses.dataclass
class HeldoutEvaluator:
    """Held-out perplexity of a model on fixed windows (callable as the training loop's `evaluate`)."""

    windows: torch.Tensor
    batch_size: int = 2

    def __call__(self, model) -> dict:
        return {"heldout_ppl": perplexity(model, self.windows, batch_size=self.batch_size)}


def freeze_all(model: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(False)
