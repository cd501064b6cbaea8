"""The model args a run builds: its flavor's, with the run's own overrides (model.n_layers, the [moe] keys).

Everything that reads the model's shapes from a config (the trainer, the pipeline plan, the memory estimator, the
checks before any process group) goes through flavor_args, so they all see the depth the run trains.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.config.job_config import JobConfig
from torchtitan.config.moe import with_moe_overrides
from torchtitan.models.registry import get_model_spec


def flavor_args(cfg: JobConfig) -> Any:
    """The flavor's args with model.n_layers (when set) and the [moe] keys that are set (the flavor must exist)."""
    args = get_model_spec(cfg.model.name).flavors[cfg.model.flavor]
    if cfg.model.n_layers:
        args = dataclasses.replace(args, n_layers=cfg.model.n_layers)
    return with_moe_overrides(args, cfg)
