#!/usr/bin/env bash
# Every GPU check in one command, one table (scripts/gpu_check.py): the quick start, the 8B block shape eager and
# compiled with the memory estimator beside it, float8, an MoE block shape, async checkpoints, resume and the
# Hugging Face export in transformers. About 5-6 minutes on one H100/H200; its table goes to docs/performance.md.
#   scripts/gpu_check.sh [--only quickstart,eager,compiled,float8,moe,checkpoint] [--steps 15] [--data FILE.jsonl]
#   scripts/gpu_check.sh --smoke    # on CPU with the debug models: checks the script, not the speed
set -euo pipefail
cd "$(dirname "$0")/.."
NEED_DEV=1 source scripts/bootstrap.sh  # transformers, for the export check
exec "$PYTHON" scripts/gpu_check.py "$@"
