"""Compare a converted model with its source: held-out perplexity of both, and a few generated sentences each.

    python -m delta_attention.scripts.demo CONVERTED_DIR [--source SOURCE] [--eval-tokens 4096]

The source defaults to the one recorded in the converted folder (`conversion_source` in its config).
Perplexity is measured on the assets' held-out documents, which no calibration or training reads.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

DEFAULT_PROMPTS = (
    "Tell me about the ocean in two sentences.",
    "What should a good leader do for the people?",
)


@dataclasses.dataclass
class Options:
    converted: str = dataclasses.field(
        default=None, metadata={"positional": True, "help": "folder written by `delta-attention convert`"}
    )
    source: str | None = dataclasses.field(
        default=None, metadata={"help": "the original model (default: the source recorded in the converted folder)"}
    )
    eval_tokens: int = dataclasses.field(default=8192, metadata={"help": "held-out tokens for perplexity"})
    eval_seq_len: int = dataclasses.field(default=512, metadata={"help": "perplexity window length"})
    prompts: str = dataclasses.field(
        default="|".join(DEFAULT_PROMPTS), metadata={"help": "prompts separated by |"}
    )
    max_new_tokens: int = dataclasses.field(default=40, metadata={"help": "tokens generated per prompt"})
    bf16: bool = dataclasses.field(default=True, metadata={
        "help": "bf16 autocast for the perplexity runs, where the CPU multiplies bf16 natively (float32 elsewhere)"})


def _prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        return ids
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = _prompt_ids(tokenizer, prompt)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         repetition_penalty=1.2, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def run(options: Options) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import delta_attention  # noqa: F401  (registers the Auto classes)
    from delta_attention.conversion.data.assets import heldout_texts
    from delta_attention.conversion.converter.sources import SOURCE_ATTRIBUTE
    from delta_attention.conversion.converter.sources import load_source
    from delta_attention.conversion.data.windows import token_windows
    from delta_attention.conversion.evaluation.perplexity import perplexity

    if not options.converted:
        raise ValueError("give the converted model folder")
    start = time.time()
    student = AutoModelForCausalLM.from_pretrained(options.converted).eval()
    tokenizer = AutoTokenizer.from_pretrained(options.converted)
    spec = options.source or getattr(student.config, SOURCE_ATTRIBUTE, None)
    if not spec:
        raise ValueError(f"{options.converted} does not record its source; pass --source")
    teacher = load_source(spec, with_tokenizer=False).model.eval()

    count = max(1, options.eval_tokens // options.eval_seq_len)
    windows = token_windows(tokenizer, heldout_texts(), options.eval_seq_len, count)
    print(f"\nheld-out perplexity ({windows.numel():,} tokens of the training corpora's held-out documents):")
    teacher_ppl = perplexity(teacher, windows, bf16=options.bf16, desc="source perplexity")
    print(f"  original  : {teacher_ppl:10.2f}")
    student_ppl = perplexity(student, windows, bf16=options.bf16, desc="converted perplexity")
    kinds = student.config.layer_types
    print(f"  converted : {student_ppl:10.2f}   ({sum(k == 'linear_attention' for k in kinds)} of {len(kinds)} "
          "layers delta attention, untrained)")
    for prompt in options.prompts.split("|"):
        print(f"\nprompt: {prompt}")
        print(f"  original : {generate(teacher, tokenizer, prompt, options.max_new_tokens)}")
        print(f"  converted: {generate(student, tokenizer, prompt, options.max_new_tokens)}")
    print(f"\n(demo took {time.time() - start:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from delta_attention.scripts.cli import parse_options

    argv = list(sys.argv[1:] if argv is None else argv)
    return run(*parse_options(Options, argv, prog="python -m delta_attention.scripts.demo"))


if __name__ == "__main__":
    sys.exit(main())
