#!/usr/bin/env bash
# The whole test suite (unit + multi-process integration on CPU). Installs what is missing (see bootstrap.sh).
# Extra arguments go to pytest, e.g. scripts/run_tests.sh tests/unit -k config
# Two pytest workers (TEST_WORKERS, 0 for one process), each taking whole files: most unit tests use one core, so
# one worker's unit tests run beside the other's multi-process tests (docs/testing.md, "Where the time goes").
set -euo pipefail
cd "$(dirname "$0")/.."
NEED_DEV=1 source scripts/bootstrap.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
# Byte-code is cached for this run even where PYTHONDONTWRITEBYTECODE is set: otherwise every process compiles the
# checkout's own modules (torchtitan, the tests, as pytest rewrites their asserts) and the packages' lazily imported
# ones from source again, about 3% of the suite's CPU. The __pycache__ folders are ignored by git.
unset PYTHONDONTWRITEBYTECODE
workers="${TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != "0" ]; then parallel=(-n "$workers" --dist loadfile); fi
exec "$PYTHON" -m pytest -q ${parallel[@]+"${parallel[@]}"} "${@:-tests}"
