"""AdamW / Adam over the model's parameters (plain or DTensor)."""

from __future__ import annotations

import torch
import torch.nn as nn

from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.tools.logging import logger


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    """One param group; weight decay on every parameter, as the Llama recipes do."""
    params = [p for p in model.parameters() if p.requires_grad]
    impl = cfg.implementation
    if impl == "fused" and device_type not in ("cuda", "cpu"):
        # fused kernels exist for cuda and cpu only; foreach is the next fastest and numerically equivalent
        logger.info(f"optimizer.implementation=fused has no kernel on {device_type}; using foreach")
        impl = "foreach"
    kwargs = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "fused": impl == "fused",
        "foreach": impl == "foreach",
    }
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    return cls(params, **kwargs)
