#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
