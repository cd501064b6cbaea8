"""Mixture-of-experts building blocks (plain modules; parallelism is applied from torchtitan/distributed).

MoEArgs imports without torch (model flavors are read by the config checks before torch is imported, see
torchtitan/models/registry.py); the modules load on first access."""

import importlib

from torchtitan.models.moe.args import MoEArgs

_MODULE_OF = {"GroupedExperts": "experts", "MoE": "moe", "SharedExperts": "moe", "no_token_counting": "moe",
              "TopKRouter": "router"}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


__all__ = ["GroupedExperts", "MoE", "MoEArgs", "SharedExperts", "TopKRouter", "no_token_counting"]
