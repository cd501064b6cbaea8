"""AdamW / Adam over the model's parameters (plain or DTensor), one optimizer per model part."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

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


class OptimizersContainer:
    """One optimizer per model part (pipeline stages of this rank), stepped together.

    Its state dict is keyed by parameter name, flattened (`state.<fqn>.<key>`, `param_groups.<fqn>.<key>`), so a
    checkpoint loads under any split of the model into parts, any pipeline degree and any sharding."""

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, parts: list[nn.Module], cfg: OptimizerConfig | None, device_type: str = "cpu",
                 optimizers: list[torch.optim.Optimizer] | None = None):
        """One optimizer per part from `cfg`, or the given `optimizers` (one per part, for tests and tools)."""
        self.parts = parts
        self.optimizers = optimizers if optimizers is not None else \
            [build_optimizer(part, cfg, device_type) for part in parts]

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        merged: dict = {}
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            merged.update(get_optimizer_state_dict(part, opt, options=self._OPTIONS))
        return merged

    def load_state_dict(self, state: dict) -> None:
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            set_optimizer_state_dict(part, opt, state, options=self._OPTIONS)
