"""`delta-attention evaluate MODEL [--teacher SOURCE] [--tasks perplexity,long_ppl,passkey,speed]`: one JSON + markdown
report. `long_ppl` is perplexity by position bucket over one long document (`--long_max_tokens`, `--long_buckets`).

The model also loads in lm-evaluation-harness's HF backend:
    lm_eval --model hf --model_args pretrained=MODEL_DIR,trust_remote_code=True --tasks hellaswag
"""

from __future__ import annotations

import sys

from delta_attention.conversion.evaluation.report import EvaluateOptions, markdown_report, run_evaluate

Options = EvaluateOptions


def run(options: EvaluateOptions) -> int:
    report = run_evaluate(options)
    print(markdown_report(report))
    print(f"\nreport written to {options.output_dir}/report.json and report.md")
    return 0


if __name__ == "__main__":
    from delta_attention.scripts.cli import main

    sys.exit(main(["evaluate", *sys.argv[1:]]))
