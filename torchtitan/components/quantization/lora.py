"""LoRA fine-tuning (`model.converters = ["lora"]`, the [lora] section; docs/finetuning.md, "LoRA").

The converter swaps chosen `nn.Linear` modules for `LoRALinear` on the meta model, before any parallelism is
applied, and freezes every other parameter (embeddings, norms and the output projection too, as PEFT does). A
LoRALinear keeps the base projection's `weight` under its own name, so checkpoints, Hugging Face import/export and
tensor-parallel plans keyed by name keep working; it adds `lora_a` [rank, in] and `lora_b` [out, rank]:

    y = x W^T + dropout(x) A^T B^T * alpha / rank

B starts at zero, so step 0 is the base model; A starts like PEFT's default (kaiming-uniform, a = sqrt(5), that is
U(-1/sqrt(in), 1/sqrt(in))), through the model's param_init contract: every layout draws the same values.
What composes, and how:
- FSDP/HSDP, DDP: frozen parameters are sharded like the others but get no gradient, hence no reduction.
- Tensor parallel (`tp_style`): a column-wise base keeps A whole and shards B on its output rows like W; a row-wise
  base shards A on its input columns like W and keeps B whole, so the adapter's partial output is reduced in the
  same collective as the base's.
- Pipeline, activation checkpointing, compile: plain modules inside the blocks, unchanged.
- The optimizer, gradient clipping and the memory estimator take only parameters with requires_grad.
Exports (lora_export.py): merged weights as a Hugging Face folder, and the adapters in PEFT's format.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from torchtitan.config.job_config import JobConfig
from torchtitan.models.random_fill import Constant, Fill
from torchtitan.tools.logging import logger

ADAPTER_NAMES = ("lora_a", "lora_b")
# Never wrapped: the output projection (PEFT's all-linear leaves it out too) and MoE routers (expert choice).
NEVER_WRAPPED = ("output", "router")


class Uniform(Fill):
    """U(-bound, bound), as a function of (seed, element) like the models' other fills (layout-invariant)."""

    def __init__(self, bound: float) -> None:
        self.bound = bound

    def values(self, u: torch.Tensor) -> torch.Tensor:
        return (2 * u - 1) * self.bound


class LoRALinear(nn.Linear):
    """A Linear layer with a low-rank adapter: `weight` (and `bias`) are the base projection's, frozen by the
    converter; `lora_a` and `lora_b` train. Its forward is plain torch (sharding is applied from outside)."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float = 0.0,
                 bias: bool = False, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @classmethod
    def wrap(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float) -> LoRALinear:
        """A LoRALinear holding `linear`'s own weight (and bias) Parameter: nothing is copied."""
        w = linear.weight
        new = cls(linear.in_features, linear.out_features, rank, alpha, dropout, bias=linear.bias is not None,
                  device=w.device, dtype=w.dtype)
        new.weight = w
        if linear.bias is not None:
            new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        # Two thin matmuls (x A^T, then B): never the [out, in] product B A, which costs as much as W.
        return base + F.linear(F.linear(self.lora_dropout(x), self.lora_a), self.lora_b) * self.scale

    def init_adapter_weights(self, param_init) -> None:
        """Called by the model's init_weights (torchtitan/models/decoder.py) with its param_init."""
        param_init(self.lora_a, Uniform(1.0 / math.sqrt(self.in_features)))
        param_init(self.lora_b, Constant(0.0))

    def merged_weight(self) -> torch.Tensor:
        """W + scale * B A, without autograd (DTensors too: the result is redistributed like W)."""
        with torch.no_grad():
            delta = (self.lora_b @ self.lora_a) * self.scale
            if hasattr(self.weight, "placements"):
                delta = delta.redistribute(self.weight.device_mesh, self.weight.placements)
            return self.weight.detach() + delta.to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def targets(model: nn.Module, target_modules: list[str]) -> list[str]:
    """Names of the Linear modules of `model` that get adapters: those whose last name part is in `target_modules`
    (or every one with ["all-linear"]), never the output projection or a router."""
    every = "all-linear" in target_modules
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or any(part in NEVER_WRAPPED for part in name.split(".")):
            continue
        if every or name.rsplit(".", 1)[-1] in target_modules:
            chosen.append(name)
    return chosen


def _grouped(names) -> str:
    counts = Counter(re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", name) for name in names)
    return ", ".join(f"{name} (x{count})" if count > 1 else name for name, count in counts.items())


def convert(model: nn.Module, cfg: JobConfig) -> list[str]:
    """Wrap the target Linear modules of `model` (meta or materialised, before parallelisms) in LoRALinear, in
    place, and freeze every parameter that is not an adapter; returns the wrapped module names."""
    lo = cfg.lora
    names = targets(model, lo.target_modules)
    if not names:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"lora.target_modules: {lo.target_modules} matches no Linear layer of {cfg.model.name}/"
                         f"{cfg.model.flavor} (its Linear layers: {', '.join(linear)}; or \"all-linear\")")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        parent.register_module(child, LoRALinear.wrap(getattr(parent, child), lo.rank, lo.alpha, lo.dropout))
    trainable = frozen = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    logger.info(f"lora (rank {lo.rank}, alpha {lo.alpha:g}, dropout {lo.dropout:g}): adapters on {len(names)} Linear "
                f"layers: {_grouped(names)}; training {trainable:,} parameters (lora_a, lora_b), "
                f"{frozen:,} frozen ({100 * trainable / max(1, trainable + frozen):.2f}% trainable)")
    return names


def tp_style(module: nn.Module, style, tp_mesh):
    """The tensor-parallel style for `module`: for a LoRALinear under torch's column-/row-wise style, the same style
    with each of its parameters placed as its role needs (torch's styles give every parameter one placement);
    `style` itself otherwise."""
    if not isinstance(module, LoRALinear) or type(style) not in (ColwiseParallel, RowwiseParallel):
        return style
    cls = LoRAColwiseParallel if type(style) is ColwiseParallel else LoRARowwiseParallel
    return cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
               use_local_output=style.use_local_output)


def _distribute(style, module: nn.Module, device_mesh, placements: dict) -> None:
    if not isinstance(module, LoRALinear):  # distribute_module calls this for every submodule (the dropout too)
        return
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, device_mesh, [placements[name]], src_data_rank=style.src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
    module.register_forward_pre_hook(_hook_replicated_grads)


def _hook_replicated_grads(module: nn.Module, args) -> None:
    """A replicated adapter's gradient comes out Partial (each rank's sum over its shard of the other dimension):
    norms and the optimizer need the whole one. The hook goes on the parameter the forward uses, at its first
    forward: materialising (to_empty) replaces the parameters of the meta model. Under FSDP, which reduces such
    gradients itself, the redistribution below is then a no-op."""
    for param in (module.lora_a, module.lora_b):
        if param.requires_grad and all(p == Replicate() for p in param.placements) and \
                not getattr(param, "_lora_grad_hooked", False):
            param.register_hook(_replicated_grad)
            param._lora_grad_hooked = True


def _replicated_grad(grad: torch.Tensor) -> torch.Tensor:
    if any(p.is_partial() for p in grad.placements):
        return grad.redistribute(placements=[Replicate()] * len(grad.placements))
    return grad


class LoRAColwiseParallel(ColwiseParallel):
    """W [out/tp, in]: every rank needs all of x A^T (A whole) and computes its own output rows with its rows of B."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute(self, module, device_mesh,
                    {"weight": Shard(0), "bias": Shard(0), "lora_a": Replicate(), "lora_b": Shard(0)})


class LoRARowwiseParallel(RowwiseParallel):
    """W [out, in/tp]: A takes the input columns this rank holds, so x A^T is a partial sum like x W^T; B is whole,
    and the adapter's partial output is reduced in the same collective as the base's."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute(self, module, device_mesh,
                    {"weight": Shard(1), "bias": Replicate(), "lora_a": Shard(1), "lora_b": Replicate()})
