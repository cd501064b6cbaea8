#!/usr/bin/env bash
# Launch training with torchrun.
#   NGPU         processes per node (default: the GPU count, or 2 CPU processes where there is no GPU)
#   CONFIG_FILE  TOML file (default train_configs/debug_model.toml; a --job.config_file argument replaces it)
#   LOG_RANK     ranks whose output is shown, comma-separated (default 0)
#   TORCHRUN_ARGS  replaces the single-node rendezvous arguments, e.g. for multi-node:
#                "--nnodes 4 --node_rank 0 --rdzv_backend c10d --rdzv_endpoint host:29500"
# Extra arguments are config overrides: ./run_train.sh --training.steps 100
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh

for _arg in "$@"; do  # --help needs no processes: print every config key and stop
    if [ "$_arg" = "--help" ] || [ "$_arg" = "-h" ]; then exec "$PYTHON" -m torchtitan.train --help; fi
done

if [ -z "${NGPU:-}" ]; then
    NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
    [ "$NGPU" -gt 0 ] || NGPU=2
fi
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
# The user's own --job.config_file replaces CONFIG_FILE: passing both would load one TOML and record the other.
_config_args=(--job.config_file "$CONFIG_FILE")
for _arg in "$@"; do
    case "$_arg" in --job.config_file | --job.config_file=*) _config_args=() ;; esac
done
LOG_RANK=${LOG_RANK:-0}
# CPU ranks share the cores: one OpenMP thread each avoids oversubscription (and fork deadlocks).
if [ "$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))')" = "0" ]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
# rendezvous on port 0: the OS picks a free port, so concurrent runs on one machine never collide.
read -r -a _rdzv <<< "${TORCHRUN_ARGS:---standalone}"

exec "$PYTHON" -m torch.distributed.run --nproc_per_node="$NGPU" "${_rdzv[@]}" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m torchtitan.train ${_config_args[@]+"${_config_args[@]}"} "$@"
