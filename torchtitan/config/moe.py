"""The [moe] section: balance settings that override the model flavor's MoEArgs, checked before any process group.

Unset keys (None) take the flavor's values; resolve writes those in, so job_config.json records the settings the
run used. A model without MoE layers refuses any of these keys: nothing would read them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, Moe
from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.registry import get_model_spec

OVERRIDES = ("load_balance_coeff", "aux_loss_coeff", "aux_loss_scope", "router_z_loss_coeff")
"""[moe] keys that are MoEArgs fields of the same name"""


def flavor_moe_args(cfg: JobConfig) -> Any:
    """The flavor's MoEArgs, or None for a dense model (the flavor must exist)."""
    return getattr(get_model_spec(cfg.model.name).flavors[cfg.model.flavor], "moe", None)


def _set_overrides(cfg: JobConfig) -> dict[str, Any]:
    """The override keys that are set, by MoEArgs field name."""
    return {key: getattr(cfg.moe, key) for key in OVERRIDES if getattr(cfg.moe, key) is not None}


def with_moe_overrides(model_args: Any, cfg: JobConfig) -> Any:
    """`model_args` with the [moe] keys that are set replacing the flavor's MoEArgs fields."""
    moe = getattr(model_args, "moe", None)
    changes = _set_overrides(cfg)
    if moe is None or not changes:
        return model_args
    return dataclasses.replace(model_args, moe=dataclasses.replace(moe, **changes))


def check_moe(cfg: JobConfig) -> None:
    """Each [moe] value on its own, then the flavor's MoEArgs with them (one line naming the first bad key)."""
    m, default = cfg.moe, Moe()
    # The override keys are MoEArgs fields: its own checks, on the values set here, name the key.
    errors = [e for e in dataclasses.replace(MoEArgs(), **_set_overrides(cfg)).check() if e.startswith("moe.")]
    if errors:
        raise ConfigError(errors[0])
    if not 0 <= m.collapse_load_fraction <= 1:
        raise ConfigError(f"moe.collapse_load_fraction: must be in [0, 1] (0 = never warn), got "
                          f"{m.collapse_load_fraction}")
    for key in ("collapse_warn_after_steps", "collapse_warn_every_steps"):
        if getattr(m, key) < 1:
            raise ConfigError(f"moe.{key}: must be >= 1, got {getattr(m, key)}")
    if flavor_moe_args(cfg) is None:
        for field in dataclasses.fields(Moe):
            if getattr(m, field.name) != getattr(default, field.name):
                raise ConfigError(f"moe.{field.name}: set, but {cfg.model.name}/{cfg.model.flavor} has no MoE layers")


def fill_moe(cfg: JobConfig) -> None:
    """Write the flavor's values into the unset [moe] keys of an MoE model (resolve's part)."""
    moe = flavor_moe_args(cfg)
    if moe is None:
        return
    for key in OVERRIDES:
        if getattr(cfg.moe, key) is None:
            setattr(cfg.moe, key, getattr(moe, key))
