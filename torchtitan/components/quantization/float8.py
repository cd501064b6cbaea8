"""Float8 training through torchao (`model.converters = ["float8"]`, the [float8] section; docs/float8.md).

The converter swaps chosen `nn.Linear` modules for torchao's `Float8Linear` on the meta model, before any
parallelism is applied: their matmuls (forward, input gradient and, except with `rowwise_with_gw_hp`, weight
gradient) run in float8 with dynamic scales, while parameters, gradients, optimizer state and checkpoints stay in
high precision under the same names. What composes, and how:
- FSDP/HSDP: with `enable_fsdp_float8_all_gather` (tensorwise), a weight is cast to float8 before FSDP's
  all-gather, so half the bytes of bf16 cross the wire; its scale then needs the amax of the whole weight, one
  all-reduce per weight at each all-gather, or one for all of them after each optimizer step (and once before the
  first) with `precompute_float8_dynamic_scale_for_fsdp` (`post_optimizer_step`).
- Tensor parallel: on GPUs, tensorwise layers take torchao's float8 colwise/rowwise styles (`tp_style`); rowwise
  layers, and every layer on CPU (gloo has no float8 collectives), keep the plain styles. Either way the layer
  casts DTensors, whose amax is reduced over the tp mesh, so every rank scales alike. The blocks' sequence
  all-gathers before attention and the MLP stay in high precision.
- Pipeline, context parallel, activation checkpointing (per-op AC saves the amax results, so recomputing a block
  does not reduce them again: torchtitan/distributed/activation_checkpoint.py), compile, accumulation: unchanged.
Which layers convert (`plan`): not the output projection, not MoE routers, not the names in `filter_fqns`, only
dimensions divisible by 16 and, unless `skip_small_layers` is off, above torchao's size thresholds, below which
float8 is slower than bf16 on H100. MoE experts (grouped GEMMs, not Linear modules) stay in high precision.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from torchtitan.config.job_config import Float8 as Float8Config
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

# Module names never converted: the output projection (its logits feed the loss; float8 there costs accuracy and
# the vocabulary dimension is often not a multiple of 16) and MoE routers (expert choice is sensitive to rounding).
ALWAYS_SKIPPED = {"output": "output projection", "router": "MoE router"}


def import_torchao():
    """torchao.float8, imported quietly (torchao logs a warning per CUDA kernel library it cannot load, which on a
    CPU build or another GPU architecture is expected)."""
    # ... and torch's pytree warns that torchao registers an Enum it now supports natively (torch 2.13).
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
    return float8


def _below_size_threshold(recipe: str, out_features: int, in_features: int) -> bool:
    """torchao's published thresholds (measured on H100) under which a float8 matmul is slower than bf16: with
    tensorwise scaling K <= 4096 and N <= 1024; with rowwise N <= 2048, K <= 1024, or both N <= 4096 and K <= 2048
    (N = out_features, K = in_features). torchao gives none for rowwise_with_gw_hp: rowwise's are used."""
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


@dataclass(frozen=True)
class Plan:
    converted: list[str]
    """Linear module names that run in float8"""
    skipped: dict[str, str]
    """Linear module name -> why it stays in high precision"""


def plan(model: nn.Module, cfg: Float8Config) -> Plan:
    """Which Linear modules of `model` convert, and why the others do not."""
    converted, skipped = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parts = name.split(".")
        always = next((why for key, why in ALWAYS_SKIPPED.items() if key in parts), None)
        n, k = module.weight.shape
        if always is not None:
            skipped[name] = always
        elif any(fqn in name for fqn in cfg.filter_fqns):
            skipped[name] = "float8.filter_fqns"
        elif n % 16 or k % 16:
            skipped[name] = "dimensions not divisible by 16"
        elif cfg.skip_small_layers and _below_size_threshold(cfg.recipe_name, n, k):
            skipped[name] = "below torchao's size thresholds (float8.skip_small_layers)"
        else:
            converted.append(name)
    return Plan(converted, skipped)


def _grouped(names) -> str:
    """'layers.*.attention.wq' for the same module in every block: a short log line for any depth."""
    counts = Counter(re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", name) for name in names)
    return ", ".join(f"{name} (x{count})" if count > 1 else name for name, count in counts.items())


def convert(model: nn.Module, cfg: JobConfig) -> Plan:
    """Swap the planned Linear modules of `model` (on meta or materialised, before parallelisms) for Float8Linear,
    in place; log what converted and what did not, and why."""
    float8 = import_torchao()
    f8 = cfg.float8
    todo = plan(model, f8)
    if not todo.converted:
        raise ValueError(_nothing_converts(cfg, todo))
    config = float8.Float8LinearConfig.from_recipe_name(f8.recipe_name)
    if f8.enable_fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    if f8.round_scales_to_power_of_2 is not None:
        config = dataclasses.replace(config, round_scales_to_power_of_2=f8.round_scales_to_power_of_2)
    chosen = set(todo.converted)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _, name: name in chosen)
    logger.info(f"float8 ({f8.recipe_name}{', float8 all-gather' if f8.enable_fsdp_float8_all_gather else ''}): "
                f"{len(todo.converted)} of {len(todo.converted) + len(todo.skipped)} Linear layers converted: "
                f"{_grouped(todo.converted)}")
    for why in sorted(set(todo.skipped.values())):
        logger.info(f"float8: left in high precision ({why}): "
                    f"{_grouped(n for n, w in todo.skipped.items() if w == why)}")
    if any(type(m).__name__ == "GroupedExperts" for m in model.modules()):
        logger.info("float8: MoE experts (grouped GEMMs) stay in high precision")
    return todo


def _nothing_converts(cfg: JobConfig, todo: Plan) -> str:
    reasons = "; ".join(f"{count} {why}" for why, count in Counter(todo.skipped.values()).items())
    small = any(why.startswith("below") for why in todo.skipped.values())
    hint = "; --float8.skip_small_layers false converts the small ones anyway" if small else ""
    return (f"model.converters: float8 converts none of the {len(todo.skipped)} Linear layers of "
            f"{cfg.model.name}/{cfg.model.flavor} ({reasons}){hint}; see docs/float8.md")


def tp_style(module: nn.Module, style, tp_mesh):
    """The tensor-parallel style for `module`: on GPUs, torchao's float8 colwise/rowwise styles for a tensorwise
    Float8Linear (its input and output gradient cross the tp collectives in float8, scaled by the amax over the tp
    mesh); `style` itself otherwise. gloo (CPU) has no float8 collectives: there a tensorwise layer keeps the plain
    style, its collectives in high precision, and casts the DTensor input itself (the amax still reduced over the
    mesh)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if type(style) not in (ColwiseParallel, RowwiseParallel) or not _is_tensorwise_float8(module) or \
            tp_mesh.device_type == "cpu":
        return style
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    cls = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
    return cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
               use_local_output=style.use_local_output)


def _is_tensorwise_float8(module: nn.Module) -> bool:
    if type(module).__name__ != "Float8Linear":
        return False
    from torchao.float8.config import ScalingGranularity

    casts = (module.config.cast_config_input, module.config.cast_config_weight,
             module.config.cast_config_grad_output)
    return all(c.scaling_granularity is ScalingGranularity.TENSORWISE for c in casts)


def post_optimizer_step(cfg: JobConfig, parts: list[nn.Module]) -> Callable[[], None] | None:
    """With the float8 all-gather and precomputed scales: after each optimizer step, the scales of every float8
    weight of `parts` in one all-reduce (instead of one per weight at its next all-gather). None otherwise."""
    f8 = cfg.float8
    if "float8" not in cfg.model.converters or not f8.precompute_float8_dynamic_scale_for_fsdp:
        return None
    precompute = import_torchao().precompute_float8_dynamic_scale_for_fsdp
    round_to_power_of_2 = bool(f8.round_scales_to_power_of_2)  # tensorwise's own choice: not rounded

    def after_step() -> None:
        for part in parts:
            precompute(part)
            if round_to_power_of_2:
                _round_precomputed_scales(part)

    return after_step


def _round_precomputed_scales(part: nn.Module) -> None:
    """torchao's precompute ignores round_scales_to_power_of_2 (0.18), while the scale a weight computes for itself
    honours it: round the precomputed scales down to powers of 2 as that path does, or the float8 all-gather would
    quantize the weights differently from a run without it (the parity suite sees the difference)."""
    for module in part.modules():
        local = getattr(getattr(module, "weight", None), "_local_tensor", None)
        scale = getattr(local, "_precomputed_scale", None)
        if scale is not None:
            local._precomputed_scale = torch.exp2(torch.floor(torch.log2(scale)))


def check(cfg: JobConfig, model_cls: type[nn.Module], model_args, device_type: str) -> None:
    """The float8 checks that need torch, before any process group: torchao importable, a GPU with float8
    matmuls (SM89+), and at least one layer that converts (a meta model of the flavor). Raises ValueError."""
    try:
        import_torchao()
    except Exception as e:  # missing, or built for another torch
        raise ValueError(f"model.converters: float8 needs torchao, which does not import ({type(e).__name__}: "
                         f"{e}); ./run_train.sh installs it") from None
    # ROCm GPUs (also device type cuda) have their own float8 formats, which torchao chooses.
    if device_type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        raise ValueError(f"model.converters: float8 matmuls need a GPU of compute capability 8.9 or later (Ada, "
                         f"Hopper, Blackwell); this one is {major}.{minor}")
    with torch.device("meta"):
        model = model_cls(model_args)
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for fqn in cfg.float8.filter_fqns:
        if not any(fqn in name for name in linear):
            raise ValueError(f"float8.filter_fqns: '{fqn}' is in no Linear layer's name of {cfg.model.name}/"
                             f"{cfg.model.flavor} (e.g. {', '.join(linear[:3])})")
    todo = plan(model, cfg.float8)
    if not todo.converted:
        raise ValueError(_nothing_converts(cfg, todo))
