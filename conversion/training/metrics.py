"""Training metrics: read the JSONL a run writes and plot loss and held-out perplexity against tokens seen."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a `metrics.jsonl` file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def speed_after_first_step(records: list[dict]) -> float:
    """Tokens/s of a run's steps after its first, from the records of a run started from step 0 (each record's
    `tokens_per_s` is the loop's running figure since the start, so `tokens / tokens_per_s` is the time taken up to
    it). The first step also pays one-time costs (compiling, allocations, first casts), which a probe of a few
    steps must leave out; a run of one step has only that step's speed."""
    if len(records) < 2:
        return records[-1]["tokens_per_s"]
    first, last = records[0], records[-1]
    seconds = last["tokens"] / last["tokens_per_s"] - first["tokens"] / first["tokens_per_s"]
    return (last["tokens"] - first["tokens"]) / seconds


def plot_metrics(runs: dict[str, str | Path], output: str | Path, title: str = "") -> Path:
    """One PNG: training loss (left) and held-out perplexity (right) against tokens, one line per named run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, ppl_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for name, path in runs.items():
        records = read_metrics(path)
        loss_axis.plot([r["tokens"] for r in records], [r["loss"] for r in records], label=name)
        evaluated = [r for r in records if "heldout_ppl" in r]
        if evaluated:
            ppl_axis.plot([r["tokens"] for r in evaluated], [r["heldout_ppl"] for r in evaluated], "o-", label=name)
    loss_axis.set(xlabel="tokens seen", ylabel="training loss", title="loss")
    ppl_axis.set(xlabel="tokens seen", ylabel="held-out perplexity", title="held-out perplexity", yscale="log")
    for axis in (loss_axis, ppl_axis):
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output
