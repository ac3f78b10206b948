"""The KL of one chunk of logits and its gradient: the eager reference and a `torch.compile`d fast path.

Stage 2 and stage 3 of `distill` score the logits `chunk_tokens` positions at a time (`objectives.
chunked_distillation_loss`). For each chunk, `kl_rows_and_gradient` gives the per-row KL(teacher || student) of
the softened distributions and its gradient with respect to the student's logits. Eagerly that is about a dozen
float32 passes over `[chunk, vocab]` tensors (two casts, two log-softmaxes, exps, products, the cast back);
inductor fuses them into a few loops over the 16-bit logits: for SmolLM2's 49,152-word vocabulary and chunks of
128 bf16 positions, 7-8 ms instead of 49 ms on two CPU cores (16 chunks a step: 0.65 s of a 10-11 s stage-2 step).

`fused_kl_rows_and_gradient` runs the compiled form, compiled at its first call (a few seconds) with dynamic
shapes, so that other chunk sizes and vocabularies reuse it. Where inductor cannot compile (no working C++ compiler, an
unsupported platform) it logs one line (logger `__name__`, WARNING) and runs the eager reference from then on.
The compiled graph is the reference's own code, so the two differ only by the order of float32 sums
(`tests/test_softmax_kl.py`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F


logger = logging.getLogger(__name__)


def kl_rows_and_gradient(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float,
                         row_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(teacher || student) of the distributions softened at `temperature` (`[n]`, float32) and its
    gradient with respect to the student's logits, `(softmax(s / T) - softmax(t / T)) / T` (`[n, vocab]`, in the
    student's logits' dtype), both times `row_weights` (`[n]`, e.g. booleans marking the rows that count) when
    given. `student_logits`, `teacher_logits`: `[n, vocab]`. The eager reference of the fast path; the sum of its
    rows is `objectives._summed_kl`."""
    softened = (lambda logits: logits.float()) if temperature == 1 else (lambda logits: logits.float() / temperature)
    # new [n, vocab] float32 tensors, changed in place below: three, not five
    student_logp = F.log_softmax(softened(student_logits), dim=-1)
    teacher_logp = F.log_softmax(softened(teacher_logits), dim=-1)
    teacher_p = teacher_logp.exp()
    rows = teacher_logp.sub_(student_logp).mul_(teacher_p).sum(-1)  # [n]: sum p_t (log p_t - log p_s)
    gradient = student_logp.exp_().sub_(teacher_p)  # [n, vocab]
    if temperature != 1:
        gradient = gradient.div_(temperature)
    if row_weights is not None:
        rows, gradient = rows * row_weights, gradient.mul_(row_weights[:, None])
    return rows, gradient.to(student_logits.dtype)


_compiled = None  # the compiled `kl_rows_and_gradient`, made at the first call
_compile_failed = False  # set once inductor has failed to compile: the eager form runs from then on


def fused_kl_rows_and_gradient(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float,
                               row_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`kl_rows_and_gradient`, compiled by `torch.compile` (inductor) into a few fused loops; the eager form where
    it cannot be compiled (logged once) or while an outer `torch.compile` traces the caller."""
    global _compiled, _compile_failed
    if _compile_failed or torch.compiler.is_compiling():
        return kl_rows_and_gradient(student_logits, teacher_logits, temperature, row_weights)
    if _compiled is None:
        # dynamic shapes from the start: one graph for every chunk size and vocabulary (dtype, temperature and
        # whether rows are weighted still make their own); past dynamo's recompile limit it runs eagerly
        _compiled = torch.compile(kl_rows_and_gradient, dynamic=True)
    try:
        return _compiled(student_logits, teacher_logits, temperature, row_weights)
    except torch._dynamo.exc.BackendCompilerFailed as error:
        _compile_failed = True
        reason = str(error).strip().splitlines()[0]
        logger.warning("softmax KL: torch.compile failed (%s); using the eager form (slower, the same maths)", reason)
        return kl_rows_and_gradient(student_logits, teacher_logits, temperature, row_weights)


def reset_compiled() -> None:
    """Forget the compiled function and any failure, so that the next call compiles again (tests, or after
    changing inductor's settings)."""
    global _compiled, _compile_failed
    _compiled, _compile_failed = None, False
