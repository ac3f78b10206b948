#!/usr/bin/env bash
# The main job, end to end on a fresh machine: set up (venv + offline assets), convert the real SmolLM2-135M
# GGUF to a constant-memory hybrid delta-attention model (a quarter of the layers keep softmax attention over a
# sliding window of 1024 tokens: layer 0, the induction layers, then those whose conversion costs most perplexity;
# calibrated init), then print held-out perplexity of the original and the converted model and a few generated
# sentences from each.
# About 7 minutes on 2 CPU cores after set-up. Usage: bash scripts/demo.sh [OUTPUT_DIR]
# DELTA_ATTENTION_VENV=path uses an existing environment instead of running scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${DELTA_ATTENTION_VENV:-}" ]; then
    BIN=$DELTA_ATTENTION_VENV/bin
    "$BIN/delta-attention" assets
else
    bash scripts/setup.sh
    BIN=.venv/bin
fi
CACHE=${DELTA_ATTENTION_HOME:-$HOME/.cache/delta_attention}
OUT=${1:-$CACHE/demo/smollm2-135m-delta-hybrid}
GGUF=$("$BIN/python" -c "from delta_attention.conversion.data.assets import smollm2_gguf_path; print(smollm2_gguf_path())")

"$BIN/delta-attention" convert "$GGUF" --out "$OUT" --overwrite \
    --keep-attention auto:0.25 --attention-window 1024 --init calibrated --calibration-steps 40
"$BIN/python" -m delta_attention.scripts.demo "$OUT"
