"""Model registry: `model.name` -> ModelSpec, so a new architecture is a new folder, not a trainer edit.

Torch-free: a model package registers its flavors and config-time facts when imported, and its torch side (the
module, its parallelize function, its Hugging Face adapter) loads on first use. The launcher, --help and the
config checks therefore answer before torch is imported (~3 s on a 2-core machine)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn

# Packages under torchtitan.models that register a spec when imported.
_KNOWN_MODEL_PACKAGES = ("llama3", "qwen3", "deepseek_v3")

_REGISTRY: dict[str, ModelSpec] = {}


@dataclass(frozen=True)
class TorchSide:
    """The parts of an architecture that import torch."""

    model_cls: type[nn.Module]
    parallelize_fn: Callable[..., nn.Module]
    """(model or stage, parallel_dims, job_config, param_dtype, ddp=True) -> it with TP/AC/compile/FSDP/DDP"""
    nparams_and_flops_fn: Callable[[nn.Module, Any, int], tuple[int, int]]
    """(model, model_args, seq_len) -> (total parameters, training FLOPs per token)"""
    state_dict_adapter: type | None = None
    tp_block_plan: Callable[[nn.Module], dict] | None = None
    """block -> {module name: ParallelStyle}: tensor parallel inside a block, read by training's TP and by the
    tensor-parallel generator (torchtitan/distributed/generation_tp.py), so both split a weight alike"""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to know about one architecture."""

    name: str
    flavors: dict[str, Any]
    """flavor name -> model-args dataclass instance"""
    load_torch_side: Callable[[], TorchSide]
    """imports the model's torch side; called on first use of model_cls, parallelize_fn, nparams_and_flops_fn,
    state_dict_adapter or tp_block_plan"""
    pipeline_input_fqns: tuple[str, ...] = ()
    """modules before the blocks (`layers.<i>`), on the first pipeline stage"""
    pipeline_output_fqns: tuple[str, ...] = ()
    """modules after the blocks, on the last pipeline stage"""
    pipeline_unit_flops_fn: Callable[[Any, int], tuple[float, float, float]] | None = None
    """(model_args, seq_len) -> training FLOPs per token of the input modules, one block, the output modules; the
    automatic pipeline split balances these (None: each of the three weighs one block)"""
    supports_tensor_parallel: bool = True
    """False: parallelism.tensor_parallel_degree > 1 is refused at config time (no tensor-parallel plan yet)"""

    @property
    def model_cls(self) -> type[nn.Module]:
        return self.load_torch_side().model_cls

    @property
    def parallelize_fn(self) -> Callable[..., nn.Module]:
        return self.load_torch_side().parallelize_fn

    @property
    def nparams_and_flops_fn(self) -> Callable[[nn.Module, Any, int], tuple[int, int]]:
        return self.load_torch_side().nparams_and_flops_fn

    @property
    def state_dict_adapter(self) -> type | None:
        return self.load_torch_side().state_dict_adapter

    @property
    def tp_block_plan(self) -> Callable[[nn.Module], dict] | None:
        return self.load_torch_side().tp_block_plan


def register_model_spec(spec: ModelSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"model '{spec.name}' is registered twice")
    _REGISTRY[spec.name] = spec


def _import_known() -> None:
    for pkg in _KNOWN_MODEL_PACKAGES:
        importlib.import_module(f"torchtitan.models.{pkg}")


def model_names() -> list[str]:
    _import_known()
    return sorted(_REGISTRY)


def get_model_spec(name: str) -> ModelSpec:
    _import_known()
    if name not in _REGISTRY:
        raise KeyError(f"unknown model.name '{name}'; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]
