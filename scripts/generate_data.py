"""`delta-attention generate-data TEACHER --output_dir OUT [--kind chat|text|both] [--num_samples N]`: teacher-written
training data (answers to the built-in prompt set through the chat template, a `--grounded_share` of them requests
about a passage of training text, and/or continued text openings) as parquet shards; continue a killed run with
`--resume`. Train on it with `distill --dataset generated:OUT`.
"""

from __future__ import annotations

import sys

from delta_attention.conversion.data.generated import GenerateOptions, generate_data

Options = GenerateOptions


def run(options: GenerateOptions) -> int:
    record = generate_data(options)
    last = record["last_run"]
    print(f"{options.output_dir}: {record['num_samples']} samples of each kind ({', '.join(record['kinds'])}); this run "
          f"wrote {last['samples']} samples, {last['new_tokens']:,} tokens in {last['seconds']:.1f} s "
          f"({last['samples_per_s']:.2f} samples/s, {last['tokens_per_s']:.1f} tokens/s); train on it with "
          f"--dataset generated:{options.output_dir}")
    return 0


if __name__ == "__main__":
    from delta_attention.scripts.cli import main

    sys.exit(main(["generate-data", *sys.argv[1:]]))
