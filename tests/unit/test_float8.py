"""Unit tests for float8 training through torchao (torchtitan/components/quantization/float8.py): which Linear
layers convert, the swap itself, a float8 training step on CPU, the tensor-parallel styles, the FSDP scale hook,
the activation-checkpoint policy and the preflight checks."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from torchtitan.components.quantization import float8
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Float8
from torchtitan.config.manager import parse_args
from torchtitan.config.preflight import check_job
from torchtitan.distributed import activation_checkpoint
from torchtitan.models.decoder import OutputProjection
from torchtitan.models.registry import get_model_spec

SIZE_REASON = "below torchao's size thresholds (float8.skip_small_layers)"
LLAMA = ["--model.name", "llama3", "--model.flavor", "debugmodel_small"]
ON = ["--model.converters", "float8"]
ALL_SIZES = ["--float8.skip_small_layers", "false"]

torchao_float8 = float8.import_torchao()
from torchao.float8.float8_linear import Float8Linear  # noqa: E402 - after the quiet import above
from torchao.float8.float8_linear_utils import (  # noqa: E402
    _auto_filter_for_rowwise,
    _auto_filter_for_tensorwise,
)
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel  # noqa: E402


def _meta_model(name: str = "llama3", flavor: str = "debugmodel_small") -> nn.Module:
    spec = get_model_spec(name)
    with torch.device("meta"):
        return spec.model_cls(spec.flavors[flavor])


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def _float8_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def _one(out_features: int, in_features: int) -> nn.Module:
    """A model with a single Linear named 'proj' (N = out_features, K = in_features), on meta: sizes are free."""
    with torch.device("meta"):
        return nn.ModuleDict({"proj": nn.Linear(in_features, out_features, bias=False)})


# --------------------------------------------------------------------------- plan()


def test_plan_debug_model_converts_every_block_linear_but_the_output_projection():
    model = _meta_model()
    todo = float8.plan(model, Float8(skip_small_layers=False))
    assert len(todo.converted) == 28  # 4 blocks x (wq, wk, wv, wo, w1, w2, w3)
    assert todo.skipped == {"output": "output projection"}
    assert sorted(todo.converted + list(todo.skipped)) == sorted(_linear_names(model))


def test_plan_default_skips_the_small_debug_layers():
    todo = float8.plan(_meta_model(), Float8())
    assert todo.converted == []
    assert len(todo.skipped) == 29
    assert todo.skipped.pop("output") == "output projection"
    assert set(todo.skipped.values()) == {SIZE_REASON}


# (recipe, N = out_features, K = in_features, converts): both sides of every edge of torchao's thresholds
# (tensorwise: skip when K <= 4096 and N <= 1024; rowwise: skip when N <= 2048 or K <= 1024 or
# (N <= 4096 and K <= 2048)); rowwise_with_gw_hp has no published thresholds of its own and uses rowwise's.
SIZE_EDGES = [
    ("tensorwise", 1024, 4096, False),
    ("tensorwise", 1040, 4096, True),
    ("tensorwise", 1024, 4112, True),
    ("tensorwise", 16, 16, False),
    ("tensorwise", 1040, 16, True),
    ("tensorwise", 16, 4112, True),
] + [
    (recipe, n, k, converts)
    for recipe in ("rowwise", "rowwise_with_gw_hp")
    for n, k, converts in [
        (2048, 8192, False),  # N <= 2048
        (2064, 8192, True),
        (8192, 1024, False),  # K <= 1024
        (8192, 1040, True),
        (4096, 2048, False),  # N <= 4096 and K <= 2048
        (4112, 2048, True),
        (4096, 2064, True),
        (2064, 2064, True),
        (4112, 1040, True),
    ]
]


@pytest.mark.parametrize(("recipe", "n", "k", "converts"), SIZE_EDGES)
def test_plan_size_thresholds_at_their_edges(recipe, n, k, converts):
    todo = float8.plan(_one(n, k), Float8(recipe_name=recipe))
    if converts:
        assert todo.converted == ["proj"] and todo.skipped == {}
    else:
        assert todo.converted == [] and todo.skipped == {"proj": SIZE_REASON}
    # skip_small_layers = false converts them all
    assert float8.plan(_one(n, k), Float8(recipe_name=recipe, skip_small_layers=False)).converted == ["proj"]


@pytest.mark.parametrize(("recipe", "torchao_filter"),
                         [("tensorwise", _auto_filter_for_tensorwise), ("rowwise", _auto_filter_for_rowwise)])
def test_plan_size_rule_agrees_with_torchao_auto_filter(recipe, torchao_filter):
    sizes = [16, 1008, 1024, 1040, 2048, 2064, 4096, 4112, 8192]
    for n in sizes:
        for k in sizes:
            model = _one(n, k)
            ours = float8.plan(model, Float8(recipe_name=recipe)).converted == ["proj"]
            assert ours == torchao_filter(model["proj"], "proj", filter_fqns=[]), (recipe, n, k)


@pytest.mark.parametrize(("n", "k"), [(8200, 8192), (8192, 8200), (24, 24)])
def test_plan_skips_dimensions_not_divisible_by_16(n, k):
    for skip_small in (True, False):
        todo = float8.plan(_one(n, k), Float8(skip_small_layers=skip_small))
        assert todo.converted == []
        assert todo.skipped == {"proj": "dimensions not divisible by 16"}


def test_plan_filter_fqns_skips_matching_names():
    todo = float8.plan(_meta_model(), Float8(skip_small_layers=False, filter_fqns=["feed_forward.w2", "wq"]))
    filtered = {name for name, why in todo.skipped.items() if why == "float8.filter_fqns"}
    assert filtered == {f"layers.{i}.{m}" for i in range(4) for m in ("feed_forward.w2", "attention.wq")}
    assert len(todo.converted) == 20
    assert not any("w2" in name or "wq" in name for name in todo.converted)
    # the output projection keeps its own reason even when a filter entry matches it too
    assert float8.plan(_meta_model(), Float8(filter_fqns=["output"])).skipped["output"] == "output projection"


def test_plan_moe_skips_routers_and_leaves_experts_alone():
    model = _meta_model("qwen3", "debugmodel_moe_small")
    todo = float8.plan(model, Float8(skip_small_layers=False))
    routers = {name for name in _linear_names(model) if "router" in name.split(".")}
    assert routers == {f"layers.{i}.moe.router.gate" for i in range(4)}
    assert {name: todo.skipped[name] for name in routers} == dict.fromkeys(routers, "MoE router")
    assert set(todo.skipped) == routers | {"output"}
    assert len(todo.converted) == 16  # attention only: the experts are grouped GEMMs, not Linear modules
    assert not any("moe" in name for name in todo.converted)
    experts = [m for m in model.modules() if type(m).__name__ == "GroupedExperts"]
    assert len(experts) == 4 and not any(isinstance(m, nn.Linear) for e in experts for m in e.modules())


# --------------------------------------------------------------------------- convert()


def test_convert_swaps_the_planned_linears_and_keeps_parameter_names_and_shapes():
    cfg = parse_args(LLAMA + ON + ALL_SIZES)
    plain, model = _meta_model(), _meta_model()
    todo = float8.convert(model, cfg)
    assert len(_float8_names(model)) == 28
    assert sorted(_float8_names(model)) == sorted(todo.converted)
    assert type(model.output) is OutputProjection  # the model's own projection, not a Float8Linear
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in plain.state_dict().items()}
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_convert_uses_the_recipe_and_the_float8_all_gather():
    from torchao.float8.config import ScalingGranularity

    model = _meta_model()
    float8.convert(model, parse_args(LLAMA + ON + ALL_SIZES + ["--float8.recipe_name", "rowwise"]))
    layer = model.get_submodule("layers.0.attention.wq")
    assert layer.config.cast_config_weight.scaling_granularity is ScalingGranularity.AXISWISE
    model = _meta_model()
    float8.convert(model, parse_args(LLAMA + ON + ALL_SIZES + ["--float8.enable_fsdp_float8_all_gather"]))
    layer = model.get_submodule("layers.0.attention.wq")
    assert layer.config.enable_fsdp_float8_all_gather
    assert layer.config.cast_config_weight.scaling_granularity is ScalingGranularity.TENSORWISE


def test_convert_moe_model_leaves_routers_and_experts_in_high_precision():
    cfg = parse_args(["--model.name", "qwen3", "--model.flavor", "debugmodel_moe_small"] + ON + ALL_SIZES)
    model = _meta_model("qwen3", "debugmodel_moe_small")
    float8.convert(model, cfg)
    assert len(_float8_names(model)) == 16
    assert all(type(model.get_submodule(f"layers.{i}.moe.router.gate")) is nn.Linear for i in range(4))
    assert sum(type(m).__name__ == "GroupedExperts" for m in model.modules()) == 4


def test_convert_with_nothing_to_convert_raises_one_line():
    model = _meta_model()
    with pytest.raises(ValueError, match="model.converters: float8 converts none of the 29 Linear layers") as info:
        float8.convert(model, parse_args(LLAMA + ON))
    msg = str(info.value)
    assert "\n" not in msg and "llama3/debugmodel_small" in msg
    assert "28 " + SIZE_REASON in msg and "1 output projection" in msg
    assert _float8_names(model) == []  # nothing was swapped


# --------------------------------------------------------------------------- training on CPU


def test_converted_model_trains_on_cpu_close_to_high_precision():
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel_small"], max_seq_len=32)
    with torch.device("meta"):
        ref = spec.model_cls(args)
    ref.to_empty(device="cpu")
    torch.manual_seed(0)
    ref.init_weights()
    model = copy.deepcopy(ref)
    float8.convert(model, parse_args(LLAMA + ON + ALL_SIZES))
    assert len(_float8_names(model)) == 28

    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, dims=1)
    with torch.no_grad():
        expected = ref(tokens)
    logits = model(tokens)
    rel = ((logits.detach() - expected).norm() / expected.norm()).item()
    assert 0 < rel < 0.1, rel  # float8 resolution: close, but not the high-precision matmuls

    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    assert torch.isfinite(loss)
    loss.backward()
    wq = model.get_submodule("layers.0.attention.wq")
    assert wq.weight.grad is not None and torch.isfinite(wq.weight.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    before = wq.weight.detach().clone()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert wq.weight.dtype == torch.float32 and not torch.equal(wq.weight.detach(), before)
    with torch.no_grad():
        loss2 = nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
    assert torch.isfinite(loss2)


# --------------------------------------------------------------------------- tp_style()


def _float8_linear(recipe: str = "tensorwise") -> nn.Module:
    with torch.device("meta"):
        linear = nn.Linear(64, 64, bias=False)
    return Float8Linear.from_float(linear, config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe))


def test_tp_style_on_cpu_mesh_keeps_the_plain_style():
    style = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1), use_local_output=False)
    assert float8.tp_style(_float8_linear(), style, SimpleNamespace(device_type="cpu")) is style


@pytest.mark.parametrize(
    ("plain", "expected"),
    [
        (ColwiseParallel(), Float8ColwiseParallel),
        (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1), use_local_output=False),
         Float8ColwiseParallel),
        (RowwiseParallel(), Float8RowwiseParallel),
        (RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate(), use_local_output=False),
         Float8RowwiseParallel),
    ],
)
def test_tp_style_on_gpu_mesh_takes_the_float8_style(plain, expected):
    style = float8.tp_style(_float8_linear(), plain, SimpleNamespace(device_type="cuda"))
    assert type(style) is expected
    assert style.input_layouts == plain.input_layouts
    assert style.output_layouts == plain.output_layouts
    assert style.use_local_output == plain.use_local_output


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_tp_style_rowwise_float8_keeps_the_plain_style(recipe):
    for style in (ColwiseParallel(), RowwiseParallel()):
        assert float8.tp_style(_float8_linear(recipe), style, SimpleNamespace(device_type="cuda")) is style


def test_tp_style_non_float8_module_or_other_style_is_unchanged():
    cuda = SimpleNamespace(device_type="cuda")
    with torch.device("meta"):
        linear = nn.Linear(64, 64)
    for style in (ColwiseParallel(), RowwiseParallel()):
        assert float8.tp_style(linear, style, cuda) is style
    style = SequenceParallel()
    assert float8.tp_style(_float8_linear(), style, cuda) is style


# --------------------------------------------------------------------------- post_optimizer_step()


def test_post_optimizer_step_none_without_precompute():
    assert float8.post_optimizer_step(parse_args([]), []) is None
    assert float8.post_optimizer_step(parse_args(LLAMA + ON + ALL_SIZES), []) is None
    cfg = parse_args(LLAMA + ON + ALL_SIZES + ["--float8.enable_fsdp_float8_all_gather"])
    assert float8.post_optimizer_step(cfg, []) is None


def test_post_optimizer_step_with_all_gather_and_precompute():
    cfg = parse_args(LLAMA + ON + ALL_SIZES + ["--float8.enable_fsdp_float8_all_gather",
                                              "--float8.precompute_float8_dynamic_scale_for_fsdp"])
    part = nn.Sequential(_float8_linear())
    hook = float8.post_optimizer_step(cfg, [part])
    assert callable(hook)
    hook()  # no FSDP-sharded float8 weights here: nothing to reduce, and no error


# --------------------------------------------------------------------------- activation checkpointing


def test_float8_amax_ops_are_saved_by_per_op_activation_checkpointing():
    for op in (torch.ops.aten.max.default, torch.ops.aten.amax.default, torch.ops.aten._scaled_mm.default):
        assert op in activation_checkpoint._SAVE_OPS, op


# --------------------------------------------------------------------------- preflight


def test_preflight_refuses_a_filter_entry_that_matches_no_linear():
    with pytest.raises(ConfigError) as info:
        check_job(LLAMA + ON + ALL_SIZES + ["--float8.filter_fqns", "attention.wq,nope"], 1)
    msg = str(info.value)
    assert msg.startswith("float8.filter_fqns: 'nope'") and "\n" not in msg


def test_preflight_refuses_a_model_where_nothing_converts():
    with pytest.raises(ConfigError) as info:
        check_job(LLAMA + ON, 1)
    msg = str(info.value)
    assert msg.startswith("model.converters:") and "converts none" in msg and "\n" not in msg


def test_preflight_accepts_a_model_that_converts():
    cfg, _ = check_job(LLAMA + ON + ALL_SIZES + ["--float8.filter_fqns", "attention.wq"], 1)
    assert cfg.model.converters == ["float8"]
