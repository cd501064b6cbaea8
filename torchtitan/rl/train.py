"""Entry point of GRPO post-training: `python -m torchtitan.rl.train [--job.config_file F] [--section.key value ...]`
(under torchrun for several ranks). The same config language as pretraining, with the [rl] section (docs/rl.md);
rl.enable is set here, and the pretraining trainer refuses it.
"""

from __future__ import annotations

from torchtitan.tools import startup_gc

# A rank's own process: collection paused for the imports below, frozen in main() (torchtitan/tools/startup_gc.py).
if __name__ == "__main__":
    startup_gc.pause()

import sys
from pathlib import Path

from torchtitan.config.errors import ConfigError
from torchtitan.config.preflight import check_job
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import init_logger, logger


def run(argv: list[str] | None) -> int:
    """Check the config, create the process group, train, close. Returns the exit code (0, 1 failed, 2 config)."""
    rank, _, world_size = dist_utils.env_world()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, resolved = check_job(argv + ["--rl.enable", "true"], world_size, rl=True)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        dist_utils.record_failure(e)
        return 2
    from torchtitan.rl.loop import GRPOTrainer

    try:
        device = dist_utils.init_distributed(cfg.comm.init_timeout_seconds, cfg.comm.trace_buf_size,
                                             Path(cfg.job.dump_folder) / "comm_traces")
        trainer = GRPOTrainer(cfg, resolved, device)
    except (ValueError, FileNotFoundError) as e:
        print(f"[rank{rank}] error: {e}", file=sys.stderr)
        dist_utils.record_failure(e)
        return 2
    try:
        trainer.train()
        trainer.close()
    except BaseException as e:  # noqa: BLE001 - any failure must reach the launcher as a non-zero exit
        logger.exception(f"rank {rank}: RL training failed")
        dist_utils.record_failure(e)
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    startup_gc.freeze_and_resume()
    init_logger()
    dist_utils.exit_process(run(argv))


if __name__ == "__main__":
    main()
