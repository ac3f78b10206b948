"""A small Trainer-free training loop on accelerate, shared by `distill` and `finetune`.

What it does: AdamW over the given parameter groups with warmup + cosine decay, a token budget, mixed
precision (bf16 autocast on CPU too), gradient accumulation, multi-process data parallelism through
`accelerate launch` with no code change, atomic resumable checkpoints (`checkpoints.py`), a stop on a
non-finite loss that keeps the last good checkpoint, a progress bar with loss, tokens/s and ETA, and
metrics as JSONL (plotted to PNG by `metrics.py`).

The data order is a pure function of the seed and the step, so a resumed run sees exactly the batches
the interrupted one would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from .checkpoints import latest_checkpoint, load_checkpoint, save_checkpoint


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; training stopped without writing anything after the last good checkpoint."""


@dataclasses.dataclass
class TrainingOptions:
    """How to train (shared by every stage); what to train, how long and how fast come with each call."""

    batch_size: int = dataclasses.field(
        default=4, metadata={"help": "blocks per optimizer step, over all processes and accumulation steps"}
    )
    gradient_accumulation_steps: int = dataclasses.field(default=1, metadata={"help": "micro-batches per step"})
    weight_decay: float = dataclasses.field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_ratio: float = dataclasses.field(default=0.05, metadata={"help": "share of steps of linear warmup"})
    max_grad_norm: float = dataclasses.field(default=1.0, metadata={"help": "gradient clipping (0 = off)"})
    mixed_precision: str = dataclasses.field(default="bf16", metadata={"help": "no, bf16 or fp16 (GPU)"})
    gradient_checkpointing: bool = dataclasses.field(default=False, metadata={"help": "recompute layer activations"})
    checkpoint_every_tokens: int = dataclasses.field(default=0, metadata={"help": "0 = only at the end"})
    eval_every_tokens: int = dataclasses.field(default=0, metadata={"help": "0 = only at the end"})
    resume: bool = dataclasses.field(default=False, metadata={"help": "continue from the latest checkpoints"})
    log_every_steps: int = dataclasses.field(default=1, metadata={"help": "metrics line every N steps"})


@dataclasses.dataclass
class TrainingResult:
    steps: int
    tokens: int
    seconds: float
    final_loss: float
    metrics_path: Path
    evaluations: list[dict]


def data_order(num_blocks: int, seed: int, start: int) -> Iterator[int]:
    """Block indices from position `start` of the endless sequence of seeded permutations (one per epoch)."""
    epoch, offset = divmod(start, num_blocks)
    while True:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        for index in torch.randperm(num_blocks, generator=generator)[offset:].tolist():
            yield index
        epoch, offset = epoch + 1, 0


def _map_batch(batch, fn):
    """Apply `fn` to a batch that is a tensor or a dict of tensors."""
    return {key: fn(value) for key, value in batch.items()} if isinstance(batch, dict) else fn(batch)


def _micro_batches(blocks, batch: int, seed: int, start_block: int) -> Iterator:
    """Micro-batches from position `start_block` of the seeded order.

    `blocks` is a `[N, L]` tensor, a dict of such tensors (e.g. input_ids and labels), or an iterable of
    dicts with `input_ids` (a streaming dataset, read in its own order, skipping what was consumed).
    """
    if isinstance(blocks, (torch.Tensor, dict)):
        first = blocks if isinstance(blocks, torch.Tensor) else next(iter(blocks.values()))
        order = data_order(len(first), seed, start_block)
        while True:
            index = [next(order) for _ in range(batch)]
            yield _map_batch(blocks, lambda tensor: tensor[index])
    else:
        def rows():
            while True:
                for row in blocks:
                    yield torch.as_tensor(row["input_ids"])

        stream = rows()
        for _ in range(start_block):
            next(stream)
        while True:
            yield torch.stack([next(stream) for _ in range(batch)])


def run_training(
    model: torch.nn.Module,
    compute_loss: Callable[[torch.nn.Module, torch.Tensor | dict], tuple[torch.Tensor, dict]],
    parameter_groups: list[dict],
    blocks,
    options: TrainingOptions,
    output_dir: str | Path,
    max_tokens: int,
    seed: int = 0,
    evaluate: Callable[[torch.nn.Module], dict] | None = None,
    step_callback: Callable[[int], None] | None = None,
    description: str = "training",
) -> TrainingResult:
    """Train `model` on `blocks` for `max_tokens` tokens.

    `blocks` is an `[N, seq_len]` LongTensor of token ids, a dict of such tensors (`input_ids`, `labels`,
    `attention_mask`, ...), or an iterable of `{"input_ids": ...}` rows (streaming).
    `compute_loss(model, batch)` returns `(loss, metrics)`, `batch` being a slice of `blocks`. `parameter_groups` are AdamW groups, each with
    its peak learning rate (`{"params": [...], "lr": ...}`); only their parameters train and are
    checkpointed. Checkpoints go to `output_dir/checkpoints`, metrics to `output_dir/metrics.jsonl`. With
    `options.resume`, training continues from the latest checkpoint there if one exists.
    """
    output_dir = Path(output_dir)
    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision") != options.mixed_precision and "LOCAL_RANK" not in os.environ:
        # one process, a new precision (e.g. a second run in the same Python session): accelerate keeps its
        # state as a singleton, so start it afresh; under `accelerate launch` every run shares the launch's settings
        AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(
        mixed_precision=options.mixed_precision,
        gradient_accumulation_steps=options.gradient_accumulation_steps,
        cpu=not torch.cuda.is_available(),
    )
    world = accelerator.num_processes
    micro = options.batch_size // options.gradient_accumulation_steps
    if micro * options.gradient_accumulation_steps != options.batch_size or micro % world:
        raise ValueError(
            f"batch_size ({options.batch_size}) must be divisible by gradient_accumulation_steps "
            f"({options.gradient_accumulation_steps}) times the number of processes ({world})"
        )
    first = next(_micro_batches(blocks, 1, seed, 0))
    seq_len = int((first["input_ids"] if isinstance(first, dict) else first).shape[1])
    tokens_per_step = options.batch_size * seq_len
    total_steps = max(1, max_tokens // tokens_per_step)

    names = {id(p): n for n, p in model.named_parameters()}
    named_trainable = {names[id(p)]: p for group in parameter_groups for p in group["params"]}
    if not named_trainable:
        raise ValueError("nothing to train: every parameter group is empty")
    if any("lr" not in group for group in parameter_groups):
        raise ValueError("every parameter group needs its learning rate ('lr')")
    optimizer = torch.optim.AdamW(parameter_groups, weight_decay=options.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(options.warmup_ratio * total_steps), total_steps)
    if options.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    checkpoint_dir = output_dir / "checkpoints"
    metrics_path = output_dir / "metrics.jsonl"
    step, history, evaluations = 0, [], []
    path = latest_checkpoint(checkpoint_dir) if options.resume else None
    if path is not None:
        state = load_checkpoint(path, named_trainable, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        step, evaluations = state["step"], state.get("evaluations", [])
        accelerator.print(f"resuming {description} from {path.name} ({state['tokens']:,} tokens seen)")
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        kept = [line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] <= step] \
            if path is not None and metrics_path.exists() else []
        metrics_path.write_text("".join(line + "\n" for line in kept))

    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    # every process walks the same global order and takes its own slice of each micro-batch
    batches = _micro_batches(blocks, micro, seed, step * options.batch_size)
    rank_slice = slice(accelerator.process_index * micro // world, (accelerator.process_index + 1) * micro // world)

    def save(at_step: int) -> None:
        if accelerator.is_main_process:
            unwrapped = {n: p for n, p in named_trainable.items()}
            save_checkpoint(checkpoint_dir, at_step, unwrapped, optimizer.optimizer if hasattr(optimizer, "optimizer")
                            else optimizer, {"tokens": at_step * tokens_per_step, "scheduler": scheduler.state_dict(),
                                             "evaluations": evaluations})
        accelerator.wait_for_everyone()

    every = lambda tokens: max(1, tokens // tokens_per_step) if tokens else 0  # noqa: E731
    checkpoint_steps, eval_steps = every(options.checkpoint_every_tokens), every(options.eval_every_tokens)
    bar = tqdm(total=total_steps * tokens_per_step, initial=step * tokens_per_step, unit="tok", unit_scale=True,
               desc=description, disable=not accelerator.is_main_process, dynamic_ncols=True)
    start, loss_value, started_at_step = time.perf_counter(), float("nan"), step
    while step < total_steps:
        losses = []
        for _ in range(options.gradient_accumulation_steps):
            batch = _map_batch(next(batches), lambda tensor: tensor[rank_slice].to(accelerator.device))
            with accelerator.accumulate(model), accelerator.autocast():
                loss, extra = compute_loss(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and options.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), options.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach().float())
        loss_value = accelerator.gather(torch.stack(losses).mean()[None]).mean().item()
        if not math.isfinite(loss_value):
            bar.close()
            last = latest_checkpoint(checkpoint_dir)
            raise NonFiniteLossError(
                f"{description}: the loss became {loss_value} at step {step + 1} "
                f"({step * tokens_per_step:,} tokens seen); nothing was saved after it. "
                + (f"The last good checkpoint is {last}; " if last else "There is no checkpoint yet; ")
                + "lower the learning rate (or use --mixed_precision no) and run again"
                + (" with --resume." if last else ".")
            )
        scheduler.step()
        step += 1
        bar.update(tokens_per_step)
        elapsed = time.perf_counter() - start
        speed = (step - started_at_step) * tokens_per_step / elapsed
        bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{speed:,.0f}")
        record = {"step": step, "tokens": step * tokens_per_step, "loss": loss_value,
                  "lr": scheduler.get_last_lr()[0], "tokens_per_s": speed, **{k: float(v) for k, v in extra.items()}}
        if evaluate is not None and (step == total_steps or (eval_steps and step % eval_steps == 0)):
            model.eval()
            with torch.no_grad(), accelerator.autocast():
                result = evaluate(accelerator.unwrap_model(model))
            model.train()
            evaluations.append({"step": step, "tokens": record["tokens"], **result})
            record.update(result)
        if accelerator.is_main_process and (step % options.log_every_steps == 0 or step == total_steps):
            with metrics_path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
        history.append(record)
        if step == total_steps or (checkpoint_steps and step % checkpoint_steps == 0):
            save(step)
        if step_callback is not None:
            step_callback(step)
    bar.close()
    if options.gradient_checkpointing:
        accelerator.unwrap_model(model).activation_checkpointing_disable()
    return TrainingResult(step, step * tokens_per_step, time.perf_counter() - start, loss_value, metrics_path,
                          evaluations)
