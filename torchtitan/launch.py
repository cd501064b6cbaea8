"""What `./run_train.sh` runs: one interpreter that checks the environment, settles the process count, the config
file and the thread count, then runs torchrun in this same process (`torch.distributed.run.main`).

A launch therefore imports torch once before the ranks start, not once per check (each import is ~1.4 s on a
2-core machine; see docs/performance.md). The environment variables are those run_train.sh documents:
NGPU, CONFIG_FILE, LOG_RANK, TORCHRUN_ARGS. Only the standard library is imported at module level, so a missing
package is reported as one line rather than a traceback.
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

DEFAULT_CONFIG_FILE = "train_configs/debug_model.toml"
CPU_PROCESSES = 2  # without a GPU: two gloo ranks, so the default run exercises FSDP
REQUIRED_MODULES = ("torch", "tokenizers", "torchdata", "tiktoken")


def torchrun_argv(train_args: Sequence[str], env: Mapping[str, str], gpu_count: int) -> list[str]:
    """torchrun's command line for `train_args` (config overrides), from run_train.sh's environment variables.

    The user's own --job.config_file replaces CONFIG_FILE: passing both would load one TOML and record the other.
    """
    nproc = env.get("NGPU") or str(gpu_count if gpu_count > 0 else CPU_PROCESSES)
    own_config = any(a == "--job.config_file" or a.startswith("--job.config_file=") for a in train_args)
    config = [] if own_config else ["--job.config_file", env.get("CONFIG_FILE") or DEFAULT_CONFIG_FILE]
    # Rendezvous on port 0 by default (--standalone): the OS picks a free port, so concurrent runs never collide.
    rendezvous = shlex.split(env.get("TORCHRUN_ARGS") or "--standalone")
    return [f"--nproc_per_node={nproc}", *rendezvous,
            "--local-ranks-filter", env.get("LOG_RANK") or "0", "--role", "rank", "--tee", "3",
            "-m", "torchtitan.train", *config, *train_args]


def _missing_module() -> str | None:
    """The first required module this interpreter cannot import, with the reason; None when all import."""
    for name in REQUIRED_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            return f"{name} ({e})"
    return None


def main(argv: Sequence[str] | None = None) -> None:
    train_args = list(sys.argv[1:] if argv is None else argv)
    missing = _missing_module()
    if missing is not None:
        sys.exit(f"[launch] {sys.executable} cannot import {missing}: remove .venv/.installed-pyproject and run "
                 "./run_train.sh again to reinstall")
    import torch
    from torch.distributed.run import main as torchrun

    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpu_count == 0:
        # CPU ranks share the cores: one OpenMP thread each avoids oversubscription (and fork deadlocks).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    torchrun(torchrun_argv(train_args, os.environ, gpu_count))


if __name__ == "__main__":
    main()
