"""Long-context evaluation: perplexity by position bucket over one long document, scored in a single left-to-right
pass through the model's cache (`long_ppl`), and the report's tables for it and for peak memory per task.

The long document is the evaluation texts joined with the EOS token (in their order) and cut at `max_tokens`.
Every token after the first is scored exactly once: the document runs through the model `piece_size` tokens at a
time, each piece continuing from the cache the previous one filled (`token_nlls`), which gives the same numbers
as one forward over the whole document (tested) while the activations stay those of one piece. A delta model's
cache is then its fixed states (plus the KV of any softmax layer); a softmax model's cache grows with the
document, and it keeps going past its `max_position_embeddings` (RoPE positions are computed, not looked up).

A bucket `[a, b)` holds the tokens at positions `a <= t < b` of the document, `t` being the token's index (the
number of tokens of context before it); position 0 is never scored. A bucket that starts at or beyond the
document's length is reported as absent (`tokens` 0, `nll`/`perplexity` None), never as zero.

A bucket's perplexity mixes two things: how well the model uses a long context, and how hard the text at those
positions is (the document is several documents joined). The reset reading (`reset_window`) separates them: the
same document read in independent windows of `reset_window` tokens, each from an empty cache, so no token sees more
than that much context. Per bucket, whole / reset below 1 says the longer context helps the model; above 1, that
it hurts it (a state that drifts past the lengths it was trained on, a softmax layer past its trained positions).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..memory import cache_bytes, human_bytes
from delta_attention.modeling.delta_prefill import release_freed_memory

DEFAULT_BUCKETS = "0,2048,8192,32768,65536"
DEFAULT_RESET_WINDOW = 2048
BUCKETS_HINT = "give increasing token positions, at least two, such as --long_buckets 0,2048,8192,32768,65536"


def parse_buckets(spec: str) -> list[int]:
    """Bucket edges from `"0,2048,8192"`: at least two strictly increasing non-negative integers.

    Anything else raises one `ValueError` naming the spec and the fix."""
    try:
        edges = [int(x) for x in str(spec).split(",")]
    except ValueError:
        raise ValueError(f"--long_buckets {spec!r} is not a list of integers; {BUCKETS_HINT}") from None
    if len(edges) < 2:
        raise ValueError(f"--long_buckets {spec!r} has fewer than two edges; {BUCKETS_HINT}")
    if edges[0] < 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"--long_buckets {spec!r} is not increasing from 0 or more; {BUCKETS_HINT}")
    return edges


def parse_depths(spec: str) -> list[float]:
    """Passkey needle depths from `"0.1,0.5,0.9"`: numbers from 0 (start of the filler) to 1 (its end)."""
    try:
        depths = [float(x) for x in str(spec).split(",") if x.strip()]
    except ValueError:
        depths = []
    if not depths or not all(0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"--passkey_depths {spec!r} must be numbers from 0 to 1, such as --passkey_depths 0.1,0.5,0.9")
    return depths


def check_long_context_options(options) -> None:
    """Raise one `ValueError` naming the flag when `evaluate`'s long-context options cannot work (before loading)."""
    parse_buckets(options.long_buckets)
    parse_depths(options.passkey_depths)
    if options.long_max_tokens < 2:
        raise ValueError(f"--long_max_tokens must be at least 2 (one token of context, one scored), "
                         f"got {options.long_max_tokens}")
    if options.long_piece < 1:
        raise ValueError(f"--long_piece must be at least 1 token, got {options.long_piece}")
    if options.long_reset_window < 0:
        raise ValueError(f"--long_reset_window must be 0 (off) or a number of tokens, got {options.long_reset_window}")


def long_document(tokenizer, texts, max_tokens: int) -> torch.Tensor:
    """Token ids `[T]` of `texts` joined with the EOS token (none if the tokenizer has none), cut at `max_tokens`.

    Documents are tokenised one at a time (without special tokens) until `max_tokens` ids are collected."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for text in texts:
        if len(ids) >= max_tokens:
            break
        ids += (eos if ids else []) + tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        raise ValueError("the texts for long_ppl hold fewer than two tokens; pass --dataset with more text")
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


@torch.no_grad()
def token_nlls(model, input_ids: torch.Tensor, piece_size: int = 1024, progress: bool = False,
               reset_every: int | None = None):
    """NLL (nats, float32) of every token after the first of `input_ids` `[T]`, in one left-to-right pass.

    The ids run through the model `piece_size` at a time with the cache carried between pieces; the last logits
    of a piece score the first token of the next. Returns `(nlls [T - 1], cache)`: `nlls[i]` is the NLL of token
    `i + 1`; the cache is the one the whole document filled. Equal to `full_forward_nlls` (one call, no cache).

    `reset_every=W` is the reset reading: the cache is emptied every `W` tokens (the pieces are cut so that none
    crosses such a boundary), so a token sees only the tokens before it in its own `W`-token window; the first
    token of a window is still scored by the previous window's last logits. The cache returned is the last window's.
    """
    if piece_size < 1:
        raise ValueError(f"--long_piece must be at least 1, got {piece_size}")
    device = next(model.parameters()).device
    length = int(input_ids.numel())
    nlls = torch.empty(length - 1, dtype=torch.float32)
    window = reset_every or length  # the cache is emptied at every multiple of `window`
    starts = [s for w in range(0, length, window) for s in range(w, min(w + window, length), piece_size)]
    cache, carried = None, None  # carried: [vocab] logits of the last token of the previous piece
    for start in tqdm(starts, desc="long_ppl", disable=not progress, leave=False):
        end = min(start + piece_size, (start // window + 1) * window, length)
        piece = input_ids[start:end].to(device)  # [P]
        if start % window == 0:
            cache = None
        out = model(input_ids=piece[None], cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[0].float()  # [P, vocab]; row j predicts token start + j + 1
        if carried is not None:  # the previous piece's last logits predict this piece's first token
            nlls[start - 1] = F.cross_entropy(carried[None], piece[:1]).cpu()
        nlls[start : start + len(piece) - 1] = F.cross_entropy(logits[:-1], piece[1:], reduction="none").cpu()
        carried = logits[-1].clone()  # not a view: the piece's logits are freed
        del out, logits
        if device.type == "cpu":
            release_freed_memory()
    return nlls, cache


@torch.no_grad()
def full_forward_nlls(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Reference for `token_nlls`: NLL of every token after the first from one forward over all of `input_ids`."""
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()  # [T - 1, vocab]
    return F.cross_entropy(logits, ids[1:], reduction="none").cpu()


def bucket_means(nlls: torch.Tensor, edges: list[int]) -> list[dict]:
    """Mean NLL and perplexity of the tokens at positions `edges[k] <= t < edges[k + 1]` (`nlls[t - 1]`).

    A bucket partly beyond the document covers the positions it has (`tokens` says how many); one that starts at
    or beyond the document's length is absent: `tokens` 0 and `nll`/`perplexity` None."""
    length = nlls.numel() + 1  # positions 0 .. length - 1; position t scored by nlls[t - 1]
    buckets = []
    for start, end in zip(edges, edges[1:]):
        first, last = max(start, 1), min(end, length)  # scored positions first .. last - 1
        tokens = max(0, last - first)
        nll = nlls[first - 1 : last - 1].double().mean().item() if tokens else None
        buckets.append({"start": start, "end": end, "tokens": tokens, "nll": nll,
                        "perplexity": math.exp(nll) if tokens else None})
    return buckets


def trained_context(model) -> int | None:
    """The model config's `max_position_embeddings` (the longest context it was trained for), if it says."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "max_position_embeddings", None)


def long_perplexity(model, tokenizer, texts, max_tokens: int = 65536, edges: list[int] | None = None,
                    piece_size: int = 1024, progress: bool = True, reset_window: int = 0) -> dict:
    """Perplexity per position bucket over `texts` joined into one document of at most `max_tokens` tokens.

    Also the overall NLL and the cache bytes the model holds at the end of the pass. With `reset_window > 0`,
    `reset` holds the same figures for the reset reading (windows of `reset_window` tokens, each from an empty
    cache, read in pieces of `piece_size`) and every bucket its `reset_perplexity` and `context_ratio` (whole / reset
    perplexity)."""
    edges = parse_buckets(DEFAULT_BUCKETS) if edges is None else edges
    ids = long_document(tokenizer, texts, max_tokens)
    nlls, cache = token_nlls(model, ids, piece_size, progress)
    nll = nlls.double().mean().item()
    result = {"tokens": ids.numel(), "nll": nll, "perplexity": math.exp(nll), "buckets": bucket_means(nlls, edges),
              "cache_bytes": cache_bytes(cache), "piece_size": piece_size}
    del cache
    if reset_window:
        reset_nlls = token_nlls(model, ids, piece_size, progress, reset_every=reset_window)[0]
        reset_nll = reset_nlls.double().mean().item()
        result["reset"] = {"window": reset_window, "nll": reset_nll, "perplexity": math.exp(reset_nll),
                           "buckets": bucket_means(reset_nlls, edges)}
        for bucket, reset_bucket in zip(result["buckets"], result["reset"]["buckets"]):
            present = bucket["tokens"] > 0
            bucket["reset_perplexity"] = reset_bucket["perplexity"]
            bucket["context_ratio"] = math.exp(bucket["nll"] - reset_bucket["nll"]) if present else None
    return result


def _position(n: int) -> str:
    return f"{n // 1024}k" if n and n % 1024 == 0 else f"{n:,}"


def _bucket_cell(bucket: dict, trained: int | None) -> str:
    if not bucket["tokens"]:
        return "absent"
    cell = f"{bucket['perplexity']:.2f}"
    if bucket["tokens"] < bucket["end"] - max(bucket["start"], 1):
        cell += f" ({bucket['tokens']:,} tokens)"
    return cell + (" *" if trained is not None and bucket["end"] > trained else "")


def _context_cell(bucket: dict) -> str:
    if not bucket["tokens"]:
        return "absent"
    return f"{bucket['reset_perplexity']:.2f} ({bucket['context_ratio']:.2f}x)"


def context_effect_markdown(names: list[str], runs: list[dict]) -> list[str]:
    """Markdown lines: per bucket, each model's reset-reading perplexity and whole / reset (`long_ppl` with
    `reset_window`)."""
    window = runs[0]["reset"]["window"]
    head = "| | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    rows = "".join(
        f"| {_position(b['start'])}-{_position(b['end'])} | "
        + " | ".join(_context_cell(run["buckets"][k]) for run in runs) + " |\n"
        for k, b in enumerate(runs[0]["buckets"]))
    rows += "| all | " + " | ".join(
        f"{run['reset']['perplexity']:.2f} ({run['perplexity'] / run['reset']['perplexity']:.2f}x)"
        for run in runs) + " |\n"
    return ["## Does the long context help?", "",
            f"the same document read in independent windows of {window:,} tokens, each from an empty cache: perplexity "
            f"per bucket, and in brackets the whole reading's over it (below 1x: the context beyond {window:,} tokens "
            "helps the model; above 1x: it hurts it). The reset reading also shows how hard the text of each bucket "
            "is, whatever the model's context.", "", head + rows]


def long_context_markdown(names: list[str], results: list[dict]) -> list[str]:
    """Markdown lines, one column per model: perplexity by position (`long_ppl`), passkey accuracy by needle depth
    (`passkey_by_depth`) and peak memory per task. `*` marks a bucket or length past a model's trained context."""
    head = "| | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    trained = [r.get("max_position_embeddings") for r in results]
    trained_row = "| trained context (max_position_embeddings) | " + " | ".join(
        "-" if t is None else f"{t:,}" for t in trained) + " |\n"
    lines = []
    if all("long_ppl" in r for r in results):
        runs = [r["long_ppl"] for r in results]
        rows = "".join(
            f"| {_position(b['start'])}-{_position(b['end'])} | "
            + " | ".join(_bucket_cell(run["buckets"][k], t) for run, t in zip(runs, trained)) + " |\n"
            for k, b in enumerate(runs[0]["buckets"]))
        rows += "| all | " + " | ".join(f"{run['perplexity']:.2f}" for run in runs) + " |\n"
        rows += "| tokens | " + " | ".join(f"{run['tokens']:,}" for run in runs) + " |\n"
        rows += "| cache at the end | " + " | ".join(human_bytes(run["cache_bytes"]) for run in runs) + " |\n"
        lines += ["## Perplexity by position", "",
                  f"one document of the texts joined with EOS, scored in one pass in pieces of "
                  f"{runs[0]['piece_size']:,} tokens through the cache; a bucket holds the tokens at those positions; "
                  "absent: the document ends before the bucket; * the bucket reaches past the model's trained context",
                  "", head + rows + trained_row]
        if all("reset" in run for run in runs):
            lines += context_effect_markdown(names, runs)
    if all("passkey_by_depth" in r for r in results):
        grids = [r["passkey_by_depth"] for r in results]
        rows = "".join(
            f"| {length} tokens, depth {depth} | " + " | ".join(
                f"{grid[length][depth]:.0%}" + (" *" if t is not None and int(length) > t else "")
                for grid, t in zip(grids, trained)) + " |\n"
            for length, row in grids[0].items() for depth in row)
        lines += ["## Passkey retrieval by needle depth", "",
                  "depth: where the needle starts among the filler tokens (0 first, 1 last); "
                  "* longer than the model's trained context", "", head + rows + trained_row]
    if all("peak_memory" in r for r in results):
        tasks = list(results[0]["peak_memory"])
        rows = "".join(f"| {task} | " + " | ".join(
            human_bytes(r["peak_memory"][task]["bytes"]) if task in r["peak_memory"] else "-" for r in results)
            + " |\n" for task in tasks)
        measure = results[0]["peak_memory"][tasks[0]]["measure"] if tasks else ""
        lines += ["## Peak memory per task", "", measure, "", head + rows]
    return lines


__all__ = ["DEFAULT_BUCKETS", "DEFAULT_RESET_WINDOW", "bucket_means", "check_long_context_options",
           "context_effect_markdown", "full_forward_nlls",
           "long_context_markdown", "long_document", "long_perplexity", "parse_buckets", "parse_depths", "token_nlls",
           "trained_context"]
