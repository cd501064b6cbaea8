#!/usr/bin/env bash
# The whole test suite (unit + multi-process integration on CPU). Installs what is missing (see bootstrap.sh).
# Extra arguments go to pytest, e.g. scripts/run_tests.sh tests/unit -k config
set -euo pipefail
cd "$(dirname "$0")/.."
NEED_DEV=1 source scripts/bootstrap.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
exec "$PYTHON" -m pytest -q "${@:-tests}"
