"""`delta-attention benchmark`: kernels, decode, prefill and a 1M-token prompt, side by side in one process.

Prints a markdown table and the target checks, writes `benchmark.json` and `benchmark.png` under `output_dir`.
Parts are selectable (`--parts kernel,decode`) and sizes configurable; `--quick` is a small smoke run.
Run it on an idle machine: with another busy process on the cores, threaded small kernels collapse; the load
average and the thread count are recorded with the results.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from delta_attention.modeling.few_rows_linear import cpu_vendor

from .bench_kernels import run_kernel_benchmark
from .bench_models import (DEFAULT_MODELS, MODELS, build_models, run_decode_benchmark, run_long_prompt_benchmark,
                           run_prefill_benchmark, with_compiled_decode, with_packed_weights)
from .bench_report import markdown, plot

PARTS = ("kernel", "decode", "prefill", "long", "speculative")  # speculative: bench_speculative.py, not by default
SMOKE_SHAPE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
)


@dataclass
class Options:
    parts: str = field(default="kernel,decode,prefill,long", metadata={"help": f"comma-separated subset of {PARTS}"})
    output_dir: str = field(default="results/benchmark", metadata={"help": "where benchmark.json/.md/.png go"})
    plot: str | None = field(default=None, metadata={"help": "also write the PNG here (e.g. docs/benchmark.png)"})
    kernel_lengths: str = field(default="512,2048,8192", metadata={"help": "kernel sequence lengths"})
    kernel_heads: int = field(default=9, metadata={"help": "kernel heads (head dim 64)"})
    peers: bool = field(default=True, metadata={"help": "time transformers' torch fallbacks too"})
    peer_budget_seconds: float = field(
        default=60.0, metadata={"help": "skip a peer's longer T once one call would take more than about this"}
    )
    models: str = field(default=",".join(DEFAULT_MODELS), metadata={
        "help": f"models for decode/prefill, a comma-separated subset of {MODELS} (delta-gqa: one state per KV "
                f"head; delta-gqa-ungated: that without the output gate)"})
    decode_contexts: str = field(default="1024,4096,16384,65536", metadata={"help": "decode context lengths"})
    decode_steps: int = field(default=8, metadata={"help": "timed decode steps per context, one step of each model in "
                                                            "turn (after one untimed step each)"})
    prefill_lengths: str = field(default="1024,4096,16384", metadata={"help": "prefill prompt lengths"})
    long_tokens: int = field(default=1 << 20, metadata={"help": "the long prompt"})
    long_reference_tokens: int = field(default=8192, metadata={"help": "the same model at this length, to compare"})
    dtype: str = field(default="float32", metadata={"help": "model weights for decode/prefill/long: float32|bfloat16"})
    threads: int = field(default=0, metadata={"help": "torch threads (0: torch's default)"})
    packed: bool = field(default=True, metadata={
        "help": "also time the delta models' decode with packed weights (pack_linear_weights; float32 only)"})
    compiled: bool = field(default=True, metadata={
        "help": "also time the delta models' decode with the compiled decode step (enable_compiled_decode) as "
                "NAME+compiled"})
    quick: bool = field(default=False, metadata={"help": "small sizes: a quick run of a few minutes"})
    smoke: bool = field(default=False, metadata={"help": "tiny models and sizes: checks the pipeline, measures nothing"})


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _environment() -> dict:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a",
        # the few-row float32 products follow the vendor's rules (modeling/few_rows_linear.py)
        "cpu_vendor": cpu_vendor() or "unknown",
    }


def run(options: Options) -> int:
    parts = [p.strip() for p in options.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    unknown = sorted(set(_names(options.models)) - set(MODELS))
    if unknown:
        raise ValueError(f"unknown model(s) {unknown} in --models; choose from {list(MODELS)}")
    if options.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {options.dtype!r}")
    threads_before = torch.get_num_threads()
    if options.threads:
        torch.set_num_threads(options.threads)
    elif options.smoke:  # a smoke run often shares the machine (tests): one thread cannot oversubscribe it
        torch.set_num_threads(1)
    try:
        return _run(options, parts)
    finally:
        torch.set_num_threads(threads_before)


def _run(options: Options, parts: list[str]) -> int:
    shape = long_shape = None
    if options.smoke:
        kernel_lengths, contexts, prefill_lengths = [130], [64, 256], [64]
        long_tokens, long_reference = 1024, 256
        shape, long_shape = SMOKE_SHAPE, SMOKE_SHAPE
    elif options.quick:
        kernel_lengths, contexts, prefill_lengths = [512], [1024, 4096], [1024]
        long_tokens, long_reference = 1 << 16, 8192
    else:
        kernel_lengths, contexts = _ints(options.kernel_lengths), _ints(options.decode_contexts)
        prefill_lengths, long_tokens, long_reference = (
            _ints(options.prefill_lengths), options.long_tokens, options.long_reference_tokens)
    dtype = getattr(torch, options.dtype)
    output = Path(options.output_dir)
    output.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, flush=True)

    results = {"environment": _environment(), "options": vars(options),
               "command": "delta-attention benchmark " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["benchmark"]
                                                                  else sys.argv[1:])}
    log(f"environment: {results['environment']}")
    start = time.perf_counter()
    if "kernel" in parts:
        results["kernel"] = run_kernel_benchmark(kernel_lengths, heads=2 if options.smoke else options.kernel_heads,
                                                 peers=options.peers, log=log,
                                                 peer_budget_seconds=options.peer_budget_seconds,
                                                 min_seconds=0.0 if options.smoke else 1.0)
    if "decode" in parts or "prefill" in parts:
        models = build_models(dtype, shape, which=_names(options.models))
        if "decode" in parts:
            decoded = with_packed_weights(models, log) if options.packed and dtype == torch.float32 else models
            decoded = with_compiled_decode(decoded) if options.compiled else decoded
            results["decode"] = run_decode_benchmark(decoded, contexts, options.decode_steps, log=log)
            del decoded
        if "prefill" in parts:
            results["prefill"] = run_prefill_benchmark(models, prefill_lengths, log=log)
        del models
    if "long" in parts:
        results["long"] = run_long_prompt_benchmark(long_tokens, long_reference, dtype, log=log, shape=long_shape,
                                                    piece_size=128 if options.smoke else None)
    if "speculative" in parts:  # converted SmolLM2 models; --quick/--smoke: a few short prompts, a 1k document
        from .bench_speculative import SpeculativeOptions, run_speculative

        small = dict(passages=1, passage_tokens=64, new_tokens=16, document_tokens=1024, answer_tokens=4)
        results["speculative"] = run_speculative(SpeculativeOptions(
            output_dir=str(output / "speculative"), dtype=options.dtype, **(small if options.quick or options.smoke
                                                                            else {})), log=log)
    results["seconds"] = time.perf_counter() - start
    results["environment"]["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(
        os, "getloadavg") else "n/a"

    report = markdown(results)
    (output / "benchmark.json").write_text(json.dumps(results, indent=2))
    (output / "benchmark.md").write_text(report + "\n")
    try:
        plot(results, str(output / "benchmark.png"))
        if options.plot:
            Path(options.plot).parent.mkdir(parents=True, exist_ok=True)
            plot(results, options.plot)
    except ImportError:
        log("matplotlib is not installed (pip install delta-attention[bench]): no plot written")
    print()
    print(report)
    log(f"\nwrote {output / 'benchmark.json'}, {output / 'benchmark.md'}, {output / 'benchmark.png'}"
        f" in {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    from delta_attention.scripts.cli import main

    sys.exit(main(["benchmark", *sys.argv[1:]]))
