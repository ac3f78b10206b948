"""`delta-attention push FOLDER --repo_id OWNER/NAME [--private] [--revision BRANCH] [--create_pr]`.

Publishes a model folder (weights, custom code, tokenizer, the project's card) or a LoRA adapter.
"""

from __future__ import annotations

import sys

from delta_attention.conversion.publishing.hub import PushOptions, push

Options = PushOptions


def run(options: PushOptions) -> int:
    url = push(options)
    print(f"pushed {options.folder} to {options.repo_id}: {url}")
    return 0


if __name__ == "__main__":
    from delta_attention.scripts.cli import main

    sys.exit(main(["push", *sys.argv[1:]]))
