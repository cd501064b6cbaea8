#!/usr/bin/env bash
# Launch training with torchrun.
#   NGPU         processes per node (default: the GPU count, or 2 CPU processes where there is no GPU)
#   CONFIG_FILE  TOML file (default train_configs/debug_model.toml; a --job.config_file argument replaces it)
#   LOG_RANK     ranks whose output is shown, comma-separated (default 0)
#   TORCHRUN_ARGS  replaces the single-node rendezvous arguments, e.g. for multi-node (the same on every node):
#                "--nnodes 4 --rdzv_backend c10d --rdzv_endpoint host:29500 --rdzv_id myjob"
#                (scripts/multinode_trainer.slurm sets it from a Slurm allocation; see docs/multinode.md)
# Extra arguments are config overrides: ./run_train.sh --training.steps 100
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh

for _arg in "$@"; do  # --help needs no processes: every config key, with the values CONFIG_FILE and the overrides set
    if [ "$_arg" = "--help" ] || [ "$_arg" = "-h" ]; then
        exec "$PYTHON" -m torchtitan.train --job.config_file "${CONFIG_FILE:-train_configs/debug_model.toml}" "$@"
    fi
done

# One interpreter from here on: torchtitan/launch.py picks NGPU, the config file and OMP_NUM_THREADS, then runs
# torchrun in the same process (exec: signals reach torchrun, which forwards them to the ranks).
exec "$PYTHON" -m torchtitan.launch "$@"
