#!/usr/bin/env bash
# Per-GPU peak memory of a training config and layout, estimated on this machine (CPU only, one process).
#   CONFIG_FILE  TOML file (default train_configs/debug_model.toml), as for run_train.sh
#   NGPU         processes per node (default 8)
#   NNODES       nodes (default 1); the estimate is for a world of NGPU x NNODES ranks
#   DEVICE       target GPU from the device table (default h100), or pass --memory-gib
# Extra arguments: estimator options (--device, --memory-gib, --reserve-gib, --rank, --json, --no-advice,
# --advice-estimates) and config overrides (--section.key value), e.g.
#   NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./scripts/estimate_memory.sh
# Exit codes (exec passes them through): 0 fits, 3 does not fit (advice printed), 2 bad input (config error,
# bad argument), 1 the estimate failed. NGPU is also the advice's GPUs per node (TP within a node, NNODES).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
NGPU=${NGPU:-8}
NNODES=${NNODES:-1}
exec "$PYTHON" scripts/estimate_memory.py --world-size "$((NGPU * NNODES))" --gpus-per-node "$NGPU" \
    --device "${DEVICE:-h100}" --job.config_file "${CONFIG_FILE:-train_configs/debug_model.toml}" "$@"
