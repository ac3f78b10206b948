"""Benchmark report: the markdown tables, the target checks and the PNG plot, from the results dict."""

from __future__ import annotations


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def kernel_table(kernel: dict) -> list[str]:
    peak = kernel["matmul_peak_gflops"]
    lines = [
        f"Kernels, B=1, H={kernel['heads']}, d={kernel['dim']} (matmul peak measured: float32 "
        f"{peak['float32']:.0f} GFLOP/s, bf16 {peak['bfloat16']:.0f} GFLOP/s):",
        "",
        "| gate | inputs | pass | T | ours ms | GFLOP/s (% of peak) | transformers ms | speed-up |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in kernel["rows"]:
        theirs = f"{row['peer_ms']:,.1f}" if "peer_ms" in row else "skipped"
        speedup = f"{row['speedup']:.1f}x" if "speedup" in row else "-"
        lines.append(
            f"| {row['gate']} | {row['dtype']} | {row['pass']} | {row['T']} | {row['ours_ms']:,.2f} | "
            f"{row['ours_gflops']:.0f} ({100 * row['ours_peak_fraction']:.0f}%) | {theirs} | {speedup} |"
        )
    lines.append("")
    lines.append("transformers: `torch_chunk_gated_delta_rule` (Qwen3-Next) for the scalar gate, "
                 "`chunk_kimi_delta_attention` (KimiLinear) for the channel gate; both compute in float32.")
    return lines


def decode_table(decode: dict) -> list[str]:
    contexts = sorted({row["context"] for row in decode["rows"]})
    models = list(dict.fromkeys(row["model"] for row in decode["rows"]))
    cell = {(row["model"], row["context"]): row for row in decode["rows"]}
    head = "| model | " + " | ".join(f"{_tokens(c)} ms/token" for c in contexts) + " | " + " | ".join(
        f"{_tokens(c)} cache" for c in contexts) + " |"
    lines = [f"Decode, one token ({decode['cache']}):", "", head, "|---|" + "---:|" * (2 * len(contexts))]
    for model in models:
        times = " | ".join(f"{cell[(model, c)]['ms_per_token']:.2f}" if (model, c) in cell else "-" for c in contexts)
        sizes = " | ".join(_fmt_bytes(cell[(model, c)]["cache_bytes"]) if (model, c) in cell else "-" for c in contexts)
        lines.append(f"| {model} | {times} | {sizes} |")
    return lines


def prefill_table(prefill: dict) -> list[str]:
    lengths = sorted({row["tokens"] for row in prefill["rows"]})
    models = list(dict.fromkeys(row["model"] for row in prefill["rows"]))
    cell = {(row["model"], row["tokens"]): row["tokens_per_second"] for row in prefill["rows"]}
    lines = ["Prefill (logits of the last token only):", "",
             "| model | " + " | ".join(f"{_tokens(n)} tokens/s" for n in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for model in models:
        lines.append(f"| {model} | " + " | ".join(f"{cell[(model, n)]:,.0f}" for n in lengths) + " |")
    return lines


def long_table(long: dict) -> list[str]:
    shape = long["model"]
    lines = [
        f"Long prompt through a small all-delta model ({shape['num_hidden_layers']} layers, hidden "
        f"{shape['hidden_size']}, {shape['num_attention_heads']} heads of {shape['head_dim']}, vocab "
        f"{shape['vocab_size']}), pieces of {long['piece_size']} tokens:",
        "",
        "| prompt tokens | seconds | tokens/s | peak RSS (process) | RSS added during the call |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in long["rows"]:
        lines.append(f"| {row['tokens']:,} | {row['seconds']:.1f} | {row['tokens_per_second']:,.0f} | "
                     f"{_fmt_bytes(row['peak_rss_bytes'])} | {_fmt_bytes(row['rss_increase_bytes'])} |")
    return lines


def target_checks(results: dict) -> list[str]:
    """The issue's targets, met or not, from the measured figures."""
    checks = []

    def check(name, value, goal, ok):
        checks.append(f"- [{'x' if ok else ' '}] {name}: {value} (target {goal})")

    kernel = results.get("kernel")
    if kernel:
        rows = {(r["gate"], r["dtype"], r["pass"], r["T"]): r for r in kernel["rows"]}
        for gate, dtype, goal in (("scalar", "float32", 4), ("scalar", "bfloat16", 10), ("channel", "float32", 50),
                                  ("channel", "bfloat16", 50)):
            row = rows.get((gate, dtype, "fwd", 2048))
            if row and "speedup" in row:
                check(f"forward T=2048 {gate} {dtype} vs transformers", f"{row['speedup']:.1f}x", f">= {goal}x",
                      row["speedup"] >= goal)
        for gate in ("scalar", "channel"):
            for dtype in ("float32", "bfloat16"):
                row = rows.get((gate, dtype, "fwd+bwd", 2048))
                if row and "speedup" in row:
                    check(f"forward+backward T=2048 {gate} {dtype} vs autograd through transformers",
                          f"{row['speedup']:.1f}x", ">= 5x", row["speedup"] >= 5)
        for gate in ("scalar", "channel"):
            for dtype in ("float32", "bfloat16"):
                row = rows.get((gate, dtype, "fwd", 8192))
                if row:
                    check(f"forward T=8192 {gate} {dtype}: share of the matmul peak",
                          f"{100 * row['ours_peak_fraction']:.0f}%", ">= 25%", row["ours_peak_fraction"] >= 0.25)
    decode = results.get("decode")
    if decode:
        cell = {(r["model"], r["context"]): r for r in decode["rows"]}
        contexts = sorted({r["context"] for r in decode["rows"]})
        delta = [cell[("delta", c)] for c in contexts if ("delta", c) in cell]
        if len(delta) > 1:
            spread = max(r["ms_per_token"] for r in delta) / min(r["ms_per_token"] for r in delta) - 1
            check(f"all-delta decode flat from {_tokens(contexts[0])} to {_tokens(contexts[-1])}",
                  f"{100 * spread:.0f}% spread", "within 15%", spread <= 0.15)
            sizes = {r["cache_bytes"] for r in delta}
            check("all-delta cache bytes constant", _fmt_bytes(max(sizes)), "constant", len(sizes) == 1)
        first = contexts[0] if contexts else None
        static = cell.get(("llama+StaticCache", first))
        for model in dict.fromkeys(r["model"] for r in decode["rows"]):
            if static and (model.startswith("delta") or model.startswith("hybrid")) and "StaticCache" not in model:
                ratio = cell[(model, first)]["ms_per_token"] / static["ms_per_token"]
                goal = 1.1 if model.startswith("hybrid") else 1.0
                check(f"{model} decode at {_tokens(first)} vs llama+StaticCache", f"{ratio:.2f}x its time",
                      f"<= {goal}x", ratio <= goal)
        last = contexts[-1] if contexts else None
        for llama in ("llama", "llama+StaticCache"):
            if ("delta", last) in cell and (llama, last) in cell:
                ratio = cell[(llama, last)]["ms_per_token"] / cell[("delta", last)]["ms_per_token"]
                check(f"decode at {_tokens(last)} vs {llama}", f"{ratio:.1f}x faster", ">= 5x", ratio >= 5)
    long = results.get("long")
    if long:
        check(f"{long['rows'][1]['tokens']:,}-token prompt peak RSS vs {long['rows'][0]['tokens']:,}",
              f"{long['peak_rss_ratio']:.2f}x", "<= 1.2x", long["peak_rss_ratio"] <= 1.2)
    return checks


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        f"Machine: {env['cpu']}{f' ({vendor})' if (vendor := env.get('cpu_vendor')) else ''}, {env['cores']} cores, "
        f"torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['threads']} threads, load average before the run {env['load_before']}.",
        "",
    ]
    for part, table in (("kernel", kernel_table), ("decode", decode_table), ("prefill", prefill_table),
                        ("long", long_table)):
        if part in results:
            lines += table(results[part]) + [""]
    if "speculative" in results:
        from .bench_speculative import markdown_tables

        lines += markdown_tables(results["speculative"]) + [""]
    checks = target_checks(results)
    if checks:
        lines += ["Targets:", ""] + checks + [""]
    lines.append(f"Reproduce: `{results['command']}`")
    return "\n".join(lines)


def _label_x(ax, values) -> None:
    """Ticks of a log x axis at the measured values only, labelled 512, 1k, 4k... rather than 10^3."""
    from matplotlib.ticker import NullFormatter

    values = sorted(set(values))
    ax.set_xticks(values, [f"{v / 1024:g}k" if v >= 1024 else str(v) for v in values])
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot(results: dict, path: str) -> None:
    """One PNG with a panel per part that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [part for part in ("kernel", "decode", "prefill", "long") if part in results]
    if not panels:  # the speculative part alone: its own plot is speculative/speculative.png
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, part in zip(axes[0], panels):
        data = results[part]
        if part == "kernel":
            for gate, color in (("scalar", "tab:blue"), ("channel", "tab:red")):
                for dtype, style in (("float32", "-"), ("bfloat16", "--")):
                    rows = [r for r in data["rows"] if r["gate"] == gate and r["dtype"] == dtype and r["pass"] == "fwd"]
                    if rows:
                        ax.plot([r["T"] for r in rows], [r["ours_ms"] for r in rows], style, color=color, marker="o",
                                label=f"ours {gate} {dtype}")
                rows = [r for r in data["rows"] if r["gate"] == gate and r["dtype"] == "float32"
                        and r["pass"] == "fwd" and "peer_ms" in r]
                if rows:
                    ax.plot([r["T"] for r in rows], [r["peer_ms"] for r in rows], ":", color=color, marker="x",
                            label=f"transformers {'Qwen3-Next' if gate == 'scalar' else 'KimiLinear'}")
            ax.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel="forward ms", title="kernel forward")
            _label_x(ax, [r["T"] for r in data["rows"]])
        elif part == "decode":
            for model in dict.fromkeys(r["model"] for r in data["rows"]):
                rows = [r for r in data["rows"] if r["model"] == model]
                ax.plot([r["context"] for r in rows], [r["ms_per_token"] for r in rows], marker="o", label=model)
            ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms / token", title="decode")
            _label_x(ax, [r["context"] for r in data["rows"]])
        elif part == "prefill":
            for model in dict.fromkeys(r["model"] for r in data["rows"]):
                rows = [r for r in data["rows"] if r["model"] == model]
                ax.plot([r["tokens"] for r in rows], [r["tokens_per_second"] for r in rows], marker="o", label=model)
            ax.set(xscale="log", xlabel="prompt (tokens)", ylabel="tokens / s", title="prefill")
            _label_x(ax, [r["tokens"] for r in data["rows"]])
        else:
            rows = data["rows"]
            ax.bar([f"{r['tokens']:,}" for r in rows], [r["peak_rss_bytes"] / 2**20 for r in rows], color="tab:green")
            for i, r in enumerate(rows):
                ax.text(i, r["peak_rss_bytes"] / 2**20, f"{r['tokens_per_second']:,.0f} tok/s", ha="center",
                        va="bottom")
            ax.set(xlabel="prompt tokens", ylabel="peak RSS (MiB)", title="long prompt, all-delta")
        ax.grid(alpha=0.3)
        if part != "long":
            ax.legend(fontsize=7)
    env = results["environment"]
    fig.suptitle(f"delta-attention on {env['cpu']} ({env['threads']} threads)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
