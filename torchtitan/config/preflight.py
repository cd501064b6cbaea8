"""The checks a job passes before any process group exists, in one place for both callers: the launcher runs them
once before torchrun starts any rank (torchtitan/launch.py), and every rank runs them again before
init_distributed (torchtitan/train.py main), for launches that do not go through run_train.sh."""

from __future__ import annotations

from collections.abc import Sequence

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import load_config
from torchtitan.config.resolve import Resolved


def check_job(argv: Sequence[str] | None, world_size: int) -> tuple[JobConfig, Resolved]:
    """load_config for `world_size` processes plus the checks that need the machine, not a process group.
    Raises ConfigError (one line naming the key and, if any, the TOML file)."""
    from torchtitan.tools import device as device_tools
    from torchtitan.tools.profiling import check_profiling_device

    # load_config fills in every derived value (dp_shard, global batch, validation shape) in cfg itself, so the
    # Trainer, the estimator and the saved job_config.json all see the numbers this run uses.
    cfg, resolved = load_config(None if argv is None else list(argv), world_size)
    device_type = device_tools.device_type()
    if cfg.parallelism.enable_async_tensor_parallel and device_type != "cuda":
        raise ConfigError("parallelism.enable_async_tensor_parallel: needs CUDA GPUs (symmetric memory); "
                          f"this machine runs on {device_type}")
    if cfg.checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint: run it on 1 process (NGPU=1), not {world_size}")
    check_profiling_device(cfg.profiling, device_type)
    return cfg, resolved
