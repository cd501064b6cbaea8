#!/usr/bin/env bash
# Dry run of a training job at its real size on this machine (CPU only, nothing allocated): the resolved layout,
# the pipeline stage split, each stage's per-rank parameters and the memory estimator's verdict.
#   CONFIG_FILE  TOML file (default train_configs/debug_model.toml), as for run_train.sh
#   NGPU         processes per node (default 8)
#   NNODES       nodes (default 1); the dry run is for a world of NGPU x NNODES ranks
#   DEVICE       target GPU for the verdict (default h100), or pass --memory-gib
# Extra arguments: dry-run options (--memory-gib, --reserve-gib, --no-verdict, --json, --no-advice,
# --advice-estimates) and config overrides (--section.key value), e.g.
#   NGPU=8 NNODES=64 CONFIG_FILE=train_configs/llama3_405b.toml ./scripts/dry_run.sh
# Exit codes (exec passes them through): 0 fits, 3 does not fit (advice printed), 2 bad input (config error,
# bad argument), 1 the estimate failed. NGPU is also the advice's GPUs per node (TP within a node, NNODES).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
NGPU=${NGPU:-8}
NNODES=${NNODES:-1}
exec "$PYTHON" scripts/dry_run.py --world-size "$((NGPU * NNODES))" --gpus-per-node "$NGPU" \
    --device "${DEVICE:-h100}" --job.config_file "${CONFIG_FILE:-train_configs/debug_model.toml}" "$@"
