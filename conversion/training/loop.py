"""A small Trainer-free training loop on accelerate, shared by `distill` and `finetune`.

What it does: AdamW over the given parameter groups with warmup + cosine decay, a token budget, mixed
precision (bf16 autocast on CPU too), gradient accumulation, multi-process data parallelism through
`accelerate launch` with no code change, atomic resumable checkpoints (`checkpoints.py`), a stop on a
non-finite loss that keeps the last good checkpoint, a progress bar with loss, tokens/s and ETA, and
metrics as JSONL (plotted to PNG by `metrics.py`).

Tested with one process and with DDP on CPU (`accelerate launch --multi_gpu --num_processes 2` on a machine
without CUDA: gloo; `--cpu` alone would start one process). Not FSDP or DeepSpeed:
checkpoints save the parameter objects captured before `prepare` and the bare optimizer's state dict, which
under FSDP are local shards, and evaluation runs on the unwrapped module. Supporting FSDP would need full state
dicts gathered for saving (`accelerator.get_state_dict` / torch.distributed.checkpoint), loading them back
into the sharded model and optimizer on resume, and evaluating through the wrapped model.

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
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from ..precision import resolve_mixed_precision
from ..saving import write_text_atomically
from .checkpoints import find_checkpoint, has_checkpoints, latest_checkpoint, load_checkpoint, load_rng_state, \
    parameter_mismatch, rng_state, save_checkpoint, set_rng_state

MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")


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
    mixed_precision: str = dataclasses.field(default="auto", metadata={
        "help": "auto (bf16 where the hardware multiplies bf16 natively: a GPU with bf16, a CPU with AMX or "
                "AVX512-BF16; float32 elsewhere), no (float32), bf16, or fp16 (GPU)"})
    gradient_checkpointing: bool = dataclasses.field(default=False, metadata={"help": "recompute layer activations"})
    checkpoint_every_tokens: int = dataclasses.field(default=0, metadata={"help": "0 = only at the end"})
    eval_every_tokens: int = dataclasses.field(default=0, metadata={"help": "0 = only at the end"})
    num_evaluations: int = dataclasses.field(default=0, metadata={
        "help": "evaluations spread evenly over each run (each distill stage: a long stage gets no more than a "
                "short one), the last at its end; 0 = by --eval_every_tokens"})
    resume: bool = dataclasses.field(default=False, metadata={"help": "continue from the latest checkpoints"})
    log_every_steps: int = dataclasses.field(default=1, metadata={"help": "metrics line every N steps"})

    def precision(self) -> str:
        """The mixed precision the loop runs: `mixed_precision`, with "auto" resolved for the device it trains on
        (bf16 where that has native bf16 matmuls, "no" elsewhere)."""
        return resolve_mixed_precision(self.mixed_precision, "cuda" if torch.cuda.is_available() else "cpu")

    def validate(self) -> None:
        """Raise ValueError naming the first option out of range and what it accepts."""
        whole = lambda value, least: isinstance(value, int) and value >= least  # noqa: E731
        number = lambda value: isinstance(value, (int, float)) and value >= 0  # noqa: E731 (NaN fails too)
        checks = [
            (whole(self.batch_size, 1), f"--batch_size must be a whole number >= 1, got {self.batch_size!r}"),
            (whole(self.gradient_accumulation_steps, 1),
             f"--gradient_accumulation_steps must be a whole number >= 1, got {self.gradient_accumulation_steps!r}"),
            (isinstance(self.warmup_ratio, (int, float)) and 0 <= self.warmup_ratio < 1,
             f"--warmup_ratio must be in [0, 1) (a share of the steps), got {self.warmup_ratio!r}"),
            (number(self.weight_decay), f"--weight_decay must be >= 0, got {self.weight_decay!r}"),
            (number(self.max_grad_norm), f"--max_grad_norm must be >= 0 (0 = no clipping), got {self.max_grad_norm!r}"),
            (whole(self.checkpoint_every_tokens, 0),
             f"--checkpoint_every_tokens must be a whole number >= 0 (0 = only at the end), "
             f"got {self.checkpoint_every_tokens!r}"),
            (whole(self.eval_every_tokens, 0),
             f"--eval_every_tokens must be a whole number >= 0 (0 = only at the end), got {self.eval_every_tokens!r}"),
            (whole(self.num_evaluations, 0),
             f"--num_evaluations must be a whole number >= 0 (0 = by --eval_every_tokens), "
             f"got {self.num_evaluations!r}"),
            (whole(self.log_every_steps, 1),
             f"--log_every_steps must be a whole number >= 1, got {self.log_every_steps!r}"),
            (self.mixed_precision in MIXED_PRECISIONS,
             f"--mixed_precision must be one of {', '.join(MIXED_PRECISIONS)}, got {self.mixed_precision!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.batch_size % self.gradient_accumulation_steps:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}); give a batch_size that is a multiple of it"
            )


@dataclasses.dataclass
class TrainingResult:
    """What a run did; `seconds` is the training time of the whole run, earlier sessions of a resumed run included."""

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


#: the columns of a streamed row that training reads (`position_ids` with packing "boundary")
_STREAM_KEYS = ("input_ids", "position_ids")


def _micro_batches(blocks, batch: int, seed: int, start_block: int) -> Iterator:
    """Micro-batches from position `start_block` of the seeded order.

    `blocks` is a `[N, L]` tensor, a dict of such tensors (e.g. input_ids and labels), or an iterable of
    dicts with `input_ids` and optionally `position_ids` (a streaming dataset, read in its own order, skipping
    what was consumed).
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
                    yield {key: torch.as_tensor(row[key]) for key in _STREAM_KEYS if key in row}

        stream = rows()
        for _ in range(start_block):
            next(stream)
        while True:
            drawn = [next(stream) for _ in range(batch)]
            stacked = {key: torch.stack([row[key] for row in drawn]) for key in drawn[0]}
            yield stacked if len(stacked) > 1 else stacked["input_ids"]


def _enable_activation_checkpointing(model: torch.nn.Module, description: str, say: Callable[[str], None]) -> list:
    """Turn on activation checkpointing (non-reentrant) in the outermost transformers models inside `model`: the
    model itself, the one a PEFT model wraps, or the student an objective module holds. Returns them (to turn it
    off after training); says so when there is none (stage 1 trains single layers, not a model)."""
    from transformers import PreTrainedModel

    found, inside = [], set()
    for module in model.modules():  # parents come before their children
        if isinstance(module, PreTrainedModel) and id(module) not in inside:
            found.append(module)
            inside.update(id(child) for child in module.modules())
    for transformer in found:
        transformer.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if not found:
        say(f"{description}: --gradient_checkpointing has nothing to recompute (no transformers model trains here)")
    return found


def _resume_point(checkpoint_dir: Path, resume: bool, description: str, say: Callable[[str], None]) -> Path | None:
    """The checkpoint to resume from, or None to start fresh; refuses to overwrite or guess."""
    if not resume:
        if has_checkpoints(checkpoint_dir):
            raise FileExistsError(
                f"{checkpoint_dir} holds checkpoints of an earlier run; resume it (--resume) or use a new output_dir"
            )
        return None
    path, skipped = find_checkpoint(checkpoint_dir)
    if path is None and skipped:
        raise ValueError(
            f"cannot resume {description}: no usable checkpoint in {checkpoint_dir} ({'; '.join(skipped)}); "
            f"delete {checkpoint_dir} to start this run over, or use a new output_dir"
        )
    if path is None:
        say(f"--resume: no checkpoint in {checkpoint_dir}; starting {description} from the beginning")
    elif skipped:
        say(f"--resume: {'; '.join(skipped)}; resuming from {path.name} instead")
    return path


_RUN_LABELS = {
    "batch_size": "batch_size (blocks per step)",
    "seq_len": "the block length (seq_len)",
    "tokens_per_step": "the tokens per step",
    "total_steps": "the token budget",
    "seed": "the data-order seed",
}


def _check_same_run(path: Path, saved: dict, run: dict, shapes: dict[str, list]) -> None:
    """Refuse to resume from `path` with options that change what a step is, or with other parameters."""
    old = saved.get("run")
    if not isinstance(old, dict):  # written before runs were recorded: only tokens per step can be told
        old = {"tokens_per_step": saved["tokens"] // saved["step"]} if saved.get("step") and "tokens" in saved else {}
    for key, label in _RUN_LABELS.items():
        if key in old and old[key] != run[key]:
            before, now = old[key], run[key]
            if key == "total_steps":
                before = f"{old.get('max_tokens')} tokens ({before} steps)"
                now = f"{run['max_tokens']} tokens ({now} steps)"
            raise ValueError(
                f"cannot resume from {path}: {label} was {before} in the interrupted run and is {now} now; "
                "resume with the same options, or start a new output_dir"
            )
    if isinstance(saved.get("trainable"), dict):
        mismatch = parameter_mismatch(saved["trainable"], shapes)
        if mismatch:
            raise ValueError(
                f"cannot resume from {path}: the parameters being trained differ: {mismatch}; resume with the "
                "same options, or start a new output_dir"
            )


def _restore_rng(path: Path, accelerator: Accelerator) -> None:
    """Set this process's random generators to those saved in checkpoint `path`; say so when it has none."""
    saved = load_rng_state(path, accelerator.process_index)
    if saved is None:
        print(f"--resume: {path.name} holds no random generator state for process {accelerator.process_index} "
              "(an older checkpoint, or fewer processes); dropout will not repeat the interrupted run exactly")
        return
    set_rng_state(saved)


def _metrics_up_to(metrics_path: Path, step: int) -> list[str]:
    """The lines of `metrics_path` up to `step`; a line cut short by a killed process is dropped."""
    kept = []
    for line in metrics_path.read_text().splitlines() if metrics_path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
    return kept


def _write_metrics(metrics_path: Path, lines: list[str]) -> None:
    write_text_atomically(metrics_path, "".join(line + "\n" for line in lines))


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
    checkpointed. `evaluate(model)` runs every `eval_every_tokens` (or `num_evaluations` times) and at the end,
    outside the training autocast
    (no autocast: float32 weights score in float32; a model prepared by accelerate may still autocast inside its
    own forward under bf16, so `distill` evaluates the bare student). Checkpoints go to `output_dir/checkpoints`, metrics to `output_dir/metrics.jsonl`. With
    `options.resume`, training continues from the newest usable checkpoint there (it must come from a run with
    the same batch, block length, token budget, seed and parameters); without it, existing checkpoints are refused.
    """
    options.validate()
    if not (isinstance(max_tokens, int) and max_tokens > 0):
        raise ValueError(f"the token budget of {description} must be a positive number of tokens, got {max_tokens!r}")
    output_dir = Path(output_dir)
    precision = options.precision()
    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision") != precision and "LOCAL_RANK" not in os.environ:
        # one process, a new precision (e.g. a second run in the same Python session): accelerate keeps its
        # state as a singleton, so start it afresh; under `accelerate launch` every run shares the launch's settings
        AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(
        mixed_precision=precision,
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
    accelerator.print(f"{description}: {world} process{'es' if world > 1 else ''}")
    first = next(_micro_batches(blocks, 1, seed, 0))
    seq_len = int((first["input_ids"] if isinstance(first, dict) else first).shape[1])
    tokens_per_step = options.batch_size * seq_len
    total_steps = max(1, max_tokens // tokens_per_step)
    run = {"batch_size": options.batch_size, "seq_len": seq_len, "tokens_per_step": tokens_per_step,
           "max_tokens": max_tokens, "total_steps": total_steps, "seed": seed}

    names = {id(p): n for n, p in model.named_parameters()}
    named_trainable = {names[id(p)]: p for group in parameter_groups for p in group["params"]}
    if not named_trainable:
        raise ValueError("nothing to train: every parameter group is empty")
    if any("lr" not in group for group in parameter_groups):
        raise ValueError("every parameter group needs its learning rate ('lr')")
    shapes = {name: list(p.shape) for name, p in named_trainable.items()}

    checkpoint_dir = output_dir / "checkpoints"
    metrics_path = output_dir / "metrics.jsonl"
    path = _resume_point(checkpoint_dir, options.resume, description, accelerator.print)
    if path is not None:  # everything is checked before the first step and before metrics.jsonl is touched
        _check_same_run(path, json.loads((path / "state.json").read_text()), run, shapes)

    optimizer = torch.optim.AdamW(parameter_groups, weight_decay=options.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(options.warmup_ratio * total_steps), total_steps)
    step, history, evaluations, loss_value, earlier_seconds = 0, [], [], float("nan"), 0.0
    if path is not None:
        state = load_checkpoint(path, named_trainable, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        step, evaluations = state["step"], state.get("evaluations", [])
        loss_value, earlier_seconds = state.get("loss", float("nan")), state.get("seconds", 0.0)
        accelerator.print(f"resuming {description} from {path.name} ({state['tokens']:,} tokens seen)")
    kept = _metrics_up_to(metrics_path, step) if path is not None else []
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        _write_metrics(metrics_path, kept)
    if step >= total_steps:
        if not math.isfinite(loss_value) and kept:  # a checkpoint from before "loss" was saved in it
            loss_value = json.loads(kept[-1]).get("loss", loss_value)
        accelerator.print(f"{description} is already complete (step {step} of {total_steps}); nothing left to train")
    recomputed = []  # the transformers models whose layer activations are recomputed in the backward pass
    if options.gradient_checkpointing:
        recomputed = _enable_activation_checkpointing(model, description, accelerator.print)

    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    # every process walks the same global order and takes its own slice of each micro-batch
    batches = _micro_batches(blocks, micro, seed, step * options.batch_size)
    rank_slice = slice(accelerator.process_index * micro // world, (accelerator.process_index + 1) * micro // world)
    start, started_at_step = time.perf_counter(), step

    if path is not None:  # the generators as they were after the checkpoint's step: dropout continues exactly
        _restore_rng(path, accelerator)

    def save(at_step: int, loss: float) -> None:
        rng_states = gather_object([rng_state()])  # every process's generators, by rank (main writes them)
        if accelerator.is_main_process:
            unwrapped = {n: p for n, p in named_trainable.items()}
            save_checkpoint(checkpoint_dir, at_step, unwrapped, optimizer.optimizer if hasattr(optimizer, "optimizer")
                            else optimizer, {"tokens": at_step * tokens_per_step, "scheduler": scheduler.state_dict(),
                                             "evaluations": evaluations, "loss": loss, "run": run,
                                             "trainable": shapes,
                                             "seconds": earlier_seconds + time.perf_counter() - start},
                            rng_states=rng_states)
        accelerator.wait_for_everyone()

    every = lambda tokens: max(1, tokens // tokens_per_step) if tokens else 0  # noqa: E731
    checkpoint_steps, eval_steps = every(options.checkpoint_every_tokens), every(options.eval_every_tokens)
    if options.num_evaluations:  # at most that many, the last at the end
        eval_steps = math.ceil(total_steps / options.num_evaluations)
    bar = tqdm(total=total_steps * tokens_per_step, initial=min(step, total_steps) * tokens_per_step, unit="tok",
               unit_scale=True, desc=description, disable=not accelerator.is_main_process, dynamic_ncols=True)
    while step < total_steps:
        losses, grad_norm = [], {}
        for _ in range(options.gradient_accumulation_steps):
            batch = _map_batch(next(batches), lambda tensor: tensor[rank_slice].to(accelerator.device))
            with accelerator.accumulate(model), accelerator.autocast():
                loss, extra = compute_loss(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and options.max_grad_norm > 0:
                    # the norm of the synchronised (averaged) gradient before clipping, the same on every process
                    grad_norm = {"grad_norm": float(accelerator.clip_grad_norm_(model.parameters(),
                                                                                options.max_grad_norm))}
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
                  "lr": scheduler.get_last_lr()[0], "tokens_per_s": speed, **grad_norm,
                  **{k: float(v) for k, v in extra.items()}}
        if evaluate is not None and (step == total_steps or (eval_steps and step % eval_steps == 0)):
            model.eval()
            # outside the training autocast: evaluations are scored in the weights' own precision (float32), like
            # the scores of models that were never trained here
            with torch.no_grad(), torch.autocast(accelerator.device.type, enabled=False):
                result = evaluate(accelerator.unwrap_model(model))
            model.train()
            evaluations.append({"step": step, "tokens": record["tokens"], **result})
            record.update(result)
        if accelerator.is_main_process and (step % options.log_every_steps == 0 or step == total_steps):
            with metrics_path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
        history.append(record)
        if step == total_steps or (checkpoint_steps and step % checkpoint_steps == 0):
            save(step, loss_value)
        if step_callback is not None:
            step_callback(step)
    bar.close()
    for transformer in recomputed:
        transformer.activation_checkpointing_disable()
        transformer.disable_input_require_grads()
    return TrainingResult(step, step * tokens_per_step, earlier_seconds + time.perf_counter() - start, loss_value,
                          metrics_path, evaluations)
