"""What the side-by-side variant scripts (benchmark_float8.py, moe_balance_study.py) share: one process (one GPU or
CPU) with its process group, and the base command line every variant extends, the flavor optionally cut to its first
N blocks (e.g. an 8B or 30B block shape on one GPU)."""

from __future__ import annotations

import dataclasses
import os
import socket


def start(config: str, steps: int, common: list[str], n_layers: int = 0) -> list[str]:
    """Set up logging and a 1-process group; return the base arguments: `config`, `steps` steps logged at every
    step, no config print, no checkpoints, then `common`, then the cut flavor if `n_layers`."""
    os.environ.setdefault("MASTER_ADDR", "localhost")
    with socket.socket() as s:
        s.bind(("localhost", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    from torchtitan.config.manager import read_args
    from torchtitan.distributed.utils import init_distributed
    from torchtitan.models.registry import get_model_spec
    from torchtitan.tools.logging import init_logger

    init_logger()
    base = ["--job.config_file", config, "--training.steps", str(steps), "--metrics.log_freq", "1",
            "--job.print_config", "false", "--checkpoint.enable", "false", *common]
    if n_layers:
        cfg = read_args(base)
        flavors = get_model_spec(cfg.model.name).flavors
        cut = f"{cfg.model.flavor}_{n_layers}blocks"
        flavors[cut] = dataclasses.replace(flavors[cfg.model.flavor], n_layers=n_layers)
        base += ["--model.flavor", cut]
    init_distributed(300)
    return base
