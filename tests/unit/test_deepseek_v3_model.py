"""DeepSeek-V3 model (torchtitan/models/deepseek_v3): structure, init, pipeline cutting, document masking, context
parallel's attention core, parameter and FLOP counts (active parameters, MLA attention), a short training run, and
FSDP over MoE blocks. Logit parity with transformers is in test_deepseek_v3_hf.py."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.deepseek_v3.args import (
    DeepSeekV3ModelArgs,
    YaRNScaling,
    deepseek_v3_flavors,
    get_pipeline_unit_flops,
)
from torchtitan.models.deepseek_v3.model import (
    DeepSeekV3Transformer,
    get_nparams_and_flops,
    precompute_rope_table,
)
from torchtitan.models.moe import MoE
from torchtitan.models.qwen3.model import get_active_nparams

MODEL_SOURCE = Path(__file__).resolve().parents[2] / "torchtitan" / "models" / "deepseek_v3" / "model.py"
FLAVORS = ["debugmodel", "debugmodel_qlora"]


def _args(flavor: str = "debugmodel", **overrides: object) -> DeepSeekV3ModelArgs:
    return dataclasses.replace(deepseek_v3_flavors[flavor], max_seq_len=64, **overrides)


def _build(args: DeepSeekV3ModelArgs, seed: int = 0) -> DeepSeekV3Transformer:
    torch.manual_seed(seed)
    model = DeepSeekV3Transformer(args)
    model.init_weights()
    return model


def _tokens(batch: int = 2, seq: int = 16, vocab: int = 8192, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model() -> DeepSeekV3Transformer:
    return _build(_args("debugmodel_qlora")).eval()


# ----------------------------------------------------------------------------- structure and init


def test_registered_spec() -> None:
    from torchtitan.models.registry import get_model_spec

    spec = get_model_spec("deepseek_v3")
    assert spec.model_cls is DeepSeekV3Transformer and spec.flavors is deepseek_v3_flavors
    assert spec.pipeline_input_fqns == ("tok_embeddings",) and spec.pipeline_output_fqns == ("norm", "output")
    assert spec.state_dict_adapter.__name__ == "DeepSeekV3StateDictAdapter" and spec.supports_tensor_parallel


def test_submodule_names_are_the_contract(model: DeepSeekV3Transformer) -> None:
    names = set(dict(model.named_parameters()))
    for sub in ("attention_norm", "attention.wq_a", "attention.q_norm", "attention.wq_b", "attention.wkv_a",
                "attention.kv_norm", "attention.wkv_b", "attention.wo", "ffn_norm"):
        assert f"layers.3.{sub}.weight" in names
    assert {"layers.0.feed_forward.w1.weight", "layers.1.moe.router.gate.weight", "layers.1.moe.experts.w1",
            "layers.1.moe.shared_experts.w3.weight"} <= names
    assert not any(n.endswith(".bias") for n in names) and "layers.0.attention.wq.weight" not in names
    plain = set(dict(_build(_args()).named_parameters()))
    assert "layers.0.attention.wq.weight" in plain and not any("wq_a" in n or "q_norm" in n for n in plain)
    assert model.layers["0"].moe is None and isinstance(model.layers["1"].moe, MoE)
    assert model.layers["1"].feed_forward is None and model.layers["1"].moe.expert_bias is not None
    assert "freqs_cis" not in model.state_dict() and "freqs_cis" in dict(model.named_buffers())
    attention = model.layers["0"].attention  # qk_head_dim 48 x 8 heads != dim 256; v_head_dim 32 != 48
    assert attention.wq_b.weight.shape == (8 * 48, 128) and attention.wo.weight.shape == (256, 8 * 32)
    assert attention.wkv_a.weight.shape == (64 + 16, 256) and attention.wkv_b.weight.shape == (8 * (32 + 32), 64)


def test_model_does_not_import_distributed() -> None:
    source = MODEL_SOURCE.read_text()
    assert "torch.distributed" not in source
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("torch.distributed")


def test_args_validation_and_generic_properties() -> None:
    args = _args()
    assert (args.head_dim, args.num_kv_heads, args.moe_layer_ids) == (48, 8, [1, 2, 3])
    assert args.softmax_scale == 48**-0.5
    yarn = _args(rope_scaling=YaRNScaling(factor=40.0, original_max_position_embeddings=4096))
    assert yarn.softmax_scale == pytest.approx(48**-0.5 * (0.1 * torch.tensor(40.0).log().item() + 1) ** 2)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        _args(qk_rope_head_dim=15)
    with pytest.raises(ValueError, match="n_dense_layers"):
        _args(n_dense_layers=-1)
    assert _args(n_dense_layers=5).moe_layer_ids == []  # as transformers' first_k_dense_replace: all dense
    with pytest.raises(ValueError, match="num_limited_groups"):
        _args(moe=dataclasses.replace(args.moe, num_limited_groups=1, top_k=3))


@pytest.mark.parametrize("flavor", FLAVORS)
def test_param_init_sees_every_parameter_once_in_order(flavor: str) -> None:
    with torch.device("meta"):
        model = DeepSeekV3Transformer(_args(flavor))
    model.to_empty(device="cpu")
    for buf in model.buffers():
        buf.fill_(float("nan"))  # to_empty leaves garbage: init must overwrite every buffer
    seen: list[torch.Tensor] = []

    def record(param: torch.Tensor, fill: object) -> None:
        seen.append(param)
        param.fill_(0.5)  # ignore `fill` on purpose: proves nothing bypasses param_init

    model.init_weights(param_init=record)
    assert [id(p) for p in seen] == [id(p) for p in model.parameters()]
    assert len({id(p) for p in seen}) == len(seen)
    assert all(p.eq(0.5).all() for p in model.parameters())
    for name, buf in model.named_buffers():
        assert torch.isfinite(buf).all(), name
    assert torch.equal(model.freqs_cis, precompute_rope_table(_args(flavor)))
    assert all(layer.moe.expert_bias.eq(0).all() for layer in model.layers.values() if layer.moe is not None)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_init_gives_finite_values_and_forward_shape(flavor: str) -> None:
    model = _build(_args(flavor))
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if not name.endswith("norm.weight"):
            assert p.std() > 0, name  # really drawn, not left at a constant
    with torch.no_grad():
        logits = model(_tokens())
    assert logits.shape == (2, 16, 8192) and torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 3.0  # the output init is dim**-0.5 on a unit-RMS input


# ----------------------------------------------------------------------------- forward semantics


def test_causality_and_explicit_positions(model: DeepSeekV3Transformer) -> None:
    tokens = _tokens(batch=1, seq=24)
    changed = tokens.clone()
    changed[0, 11] = (changed[0, 11] + 1) % 8192
    with torch.no_grad():
        a, b = model(tokens), model(changed)
        torch.testing.assert_close(a[:, :11], b[:, :11], rtol=0, atol=1e-5)
        assert not torch.allclose(a[:, 11:], b[:, 11:])
        torch.testing.assert_close(model(tokens, positions=torch.arange(24)), a, rtol=0, atol=0)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_documents_logits_do_not_depend_on_its_neighbours(flavor: str) -> None:
    model = _build(_args(flavor)).eval()
    first, second = _tokens(batch=1, seq=10, seed=2), _tokens(batch=1, seq=14, seed=3)
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(10), torch.arange(14)]).unsqueeze(0)
    document_ids = torch.tensor([[0] * 10 + [1] * 14])
    with torch.no_grad():
        out = model(packed, positions=positions, document_ids=document_ids)
        torch.testing.assert_close(out[:, 10:], model(second), rtol=0, atol=1e-5)
        torch.testing.assert_close(out[:, :10], model(first), rtol=0, atol=1e-5)
        assert not torch.allclose(model(packed)[:, 10:], model(second), atol=1e-3)  # plain causal: it does


@pytest.mark.parametrize("flavor", FLAVORS)
def test_pipeline_cut_model_runs_on_hidden_states(flavor: str) -> None:
    model = _build(_args(flavor)).eval()
    tokens = _tokens()
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    first.norm = None
    first.output = None
    del first.layers["2"], first.layers["3"]
    last.tok_embeddings = None
    del last.layers["0"], last.layers["1"]
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 16, 256)
        torch.testing.assert_close(last(hidden), model(tokens), rtol=0, atol=0)
    # A stage's re-initialisation uses the layers' own depth, not their position in the stage.
    last.init_weights()
    assert last.layers["3"].weight_init_std == model.layers["3"].weight_init_std
    assert last.freqs_cis.shape == model.freqs_cis.shape and torch.isfinite(last.output.weight).all()


def test_sequence_longer_than_table_is_rejected(model: DeepSeekV3Transformer) -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(batch=1, seq=65))


def _cp_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.context_parallel import apply_cp, sequence_positions

    model = _build(_args("debugmodel_qlora", rope_scaling=YaRNScaling(factor=4.0, original_max_position_embeddings=16)))
    apply_cp(model.eval(), init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)))
    index = sequence_positions(16, 2, rank)
    with torch.no_grad():
        return {"index": index, "logits": model(_tokens()[:, index])}


def test_context_parallel_attention_core_matches_one_process() -> None:
    """CP replaces each block's `attention.sdpa` (q/k 48 wide, v 32 wide) and feeds the global rotary rows: the
    ranks' logits are the whole model's rows at their positions."""
    from tests.unit.forked import run_ranks

    ref = _build(_args("debugmodel_qlora", rope_scaling=YaRNScaling(factor=4.0, original_max_position_embeddings=16)))
    with torch.no_grad():
        full = ref.eval()(_tokens())
    for out in run_ranks(_cp_rank, world=2):
        torch.testing.assert_close(torch.tensor(out["logits"]), full[:, out["index"]], rtol=0, atol=2e-5)


# ----------------------------------------------------------------------------- counts


def test_active_params_and_flops_by_hand() -> None:
    args = _args()
    with torch.device("meta"):
        model = DeepSeekV3Transformer(args)
    dim, h, vocab = 256, 8, 8192
    # wq, wkv_a, kv_norm, wkv_b, wo, two block norms
    attention = dim * h * 48 + dim * (64 + 16) + 64 + 64 * h * (32 + 32) + h * 32 * dim + 2 * dim
    dense, router, expert = 3 * dim * 768, 8 * dim, 3 * dim * 128
    embeddings = 2 * vocab * dim
    total = 4 * attention + dense + 3 * (router + 9 * expert) + embeddings + dim  # 8 routed + 1 shared
    active = 4 * attention + dense + 3 * (router + 3 * expert) + embeddings + dim  # top 2 + 1 shared
    assert (total, active) == (8_315_392, 6_545_920)
    n, flops = get_nparams_and_flops(model, args, 64)
    assert n == total and get_active_nparams(model) == active
    assert flops == 6 * (active - vocab * dim) + 4 * 6 * h * (48 + 32) * 64  # QK^T over 48, AV over 32 channels
    emb, block, out = get_pipeline_unit_flops(args, 64)
    norms = 4 * (64 + 2 * dim) + dim  # the units leave the (elementwise) norms out
    assert emb == 0.0 and out == 6 * vocab * dim
    assert emb + 4 * block + out == flops - 6 * norms


@pytest.mark.parametrize("flavor,total,active", [("16B", 15.96e9, 2.915e9), ("671B", 671.0e9, 37.55e9)])
def test_published_parameter_counts(flavor: str, total: float, active: float) -> None:
    """671B: 671B total and 37B activated (DeepSeek-V3 report; 37.55B here counting embedding and output). 16B:
    Moonlight's 16B / 3B (2.24B activated without embedding and output, as some model cards count)."""
    args = deepseek_v3_flavors[flavor]
    with torch.device("meta"):
        model = DeepSeekV3Transformer(args)
    n, _ = get_nparams_and_flops(model, args, 4096)
    assert n == pytest.approx(total, rel=0.002)
    assert get_active_nparams(model) == pytest.approx(active, rel=0.002)


# ----------------------------------------------------------------------------- training


def test_trains_and_gradients_reach_router_experts_and_mla() -> None:
    # the q-LoRA debug flavor with a smaller vocabulary: seconds on a CPU
    args = _args("debugmodel_qlora", vocab_size=1024)
    model = _build(args, seed=5).train()
    batch = _tokens(batch=4, seq=17, vocab=1024, seed=6)
    inputs, labels = batch[:, :-1], batch[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(20):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        if step == 0:
            for i, layer in model.layers.items():
                a = layer.attention
                params = {"wq_a": a.wq_a.weight, "q_norm": a.q_norm.weight, "wq_b": a.wq_b.weight,
                          "wkv_a": a.wkv_a.weight, "kv_norm": a.kv_norm.weight, "wkv_b": a.wkv_b.weight,
                          "wo": a.wo.weight}
                if layer.moe is not None:
                    m = layer.moe
                    params.update({"router.gate": m.router.gate.weight, "experts.w1": m.experts.w1,
                                   "experts.w2": m.experts.w2, "experts.w3": m.experts.w3,
                                   "shared.w1": m.shared_experts.w1.weight, "shared.w2": m.shared_experts.w2.weight})
                    assert m.tokens_per_expert.sum().item() == inputs.numel() * args.moe.top_k
                for name, p in params.items():
                    assert p.grad is not None and p.grad.abs().sum() > 0, f"layer {i} {name}"
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


# ----------------------------------------------------------------------------- parallelize


def _tp_rank(rank: int, flavor: str) -> dict:
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseek_v3

    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2)
    pd.build_mesh("cpu")
    cfg = JobConfig()
    cfg.parallelism.disable_loss_parallel = True  # plain logits, so the loss below is an ordinary cross-entropy
    with torch.device("meta"):
        model = DeepSeekV3Transformer(_tp_args(flavor))
    model = parallelize_deepseek_v3(model, pd, cfg, "float32")
    _materialized(model)
    batch = _tokens(batch=2, seq=9, vocab=128, seed=11)  # TP ranks read the same rows
    F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").backward()
    attention = model.layers["1"].attention
    return {"grads": {name: p.grad.full_tensor() for name, p in model.named_parameters()},
            "placements": {name: str(getattr(attention, name).weight.placements)
                           for name in ("wkv_a", "kv_norm", "wkv_b", "wo")}}


def _tp_args(flavor: str) -> DeepSeekV3ModelArgs:
    return dataclasses.replace(_FSDP_ARGS, q_lora_rank=32 if flavor == "qlora" else 0, n_layers=3)


@pytest.mark.parametrize("flavor", ["plain", "qlora"])
def test_tensor_parallel_matches_one_process(flavor: str) -> None:
    """TP 2 over every block kind (a dense block, then MoE blocks on each rank's sequence shard): MLA's heads split
    over the ranks, its low-rank projections sequence parallel. Every parameter's gradient must be the one-process
    gradient; k_pe's and the latent's, which every rank's heads use, only are if the gather hands back their sum
    over the ranks (wkv_a and kv_norm would carry one rank's heads' share otherwise)."""
    from tests.unit.forked import run_ranks

    results = run_ranks(_tp_rank, flavor, world=2)
    with torch.device("meta"):
        ref = DeepSeekV3Transformer(_tp_args(flavor))
    _materialized(ref)
    batch = _tokens(batch=2, seq=9, vocab=128, seed=11)
    F.cross_entropy(ref(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").backward()
    want = {name: p.grad for name, p in ref.named_parameters()}
    for out in results:
        assert out["placements"] == {"wkv_a": "(Replicate(),)", "kv_norm": "(Replicate(),)",
                                     "wkv_b": "(Shard(dim=0),)", "wo": "(Shard(dim=1),)"}
        assert out["grads"].keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(torch.tensor(out["grads"][name]), grad, rtol=1e-4, atol=1e-6, msg=name)


# Without the balance loss: its counts are summed over the ranks by the trainer (components/moe_balance.py), which
# these model-level tests leave out; the parity layouts cover it.
_FSDP_ARGS = dataclasses.replace(deepseek_v3_flavors["debugmodel_qlora"], dim=64, n_heads=4, vocab_size=128,
                                 n_layers=2, max_seq_len=16, q_lora_rank=32, kv_lora_rank=32, ffn_hidden_dim=96,
                                 moe=dataclasses.replace(deepseek_v3_flavors["debugmodel_qlora"].moe,
                                                         aux_loss_coeff=0.0))


def _materialized(model: torch.nn.Module) -> None:
    from torchtitan.components.model_parts import materialize
    from torchtitan.distributed.utils import param_init

    materialize([model], torch.device("cpu"), seed=0, param_init=param_init)


def _fsdp_rank(rank: int) -> dict:
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseek_v3

    pd = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2)
    pd.build_mesh("cpu")
    cfg = JobConfig()
    cfg.activation_checkpoint.mode = "full"  # the house order: AC wraps the blocks before FSDP shards them
    with torch.device("meta"):
        model = DeepSeekV3Transformer(_FSDP_ARGS)
    model = parallelize_deepseek_v3(model, pd, cfg, "float32")
    _materialized(model)
    batch = _tokens(batch=2, seq=9, vocab=128, seed=11)[rank:rank + 1]
    F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").backward()
    moe, attention = model.layers["1"].moe, model.layers["1"].attention
    return {"local_w1": list(moe.experts.w1.to_local().shape), "placements": str(moe.experts.w1.placements),
            "grad_w1": moe.experts.w1.grad.full_tensor(), "grad_gate": moe.router.gate.weight.grad.full_tensor(),
            "grad_wkv_b": attention.wkv_b.weight.grad.full_tensor()}


def test_fsdp_shards_moe_blocks_and_matches_one_process() -> None:
    from tests.unit.forked import run_ranks

    results = run_ranks(_fsdp_rank, world=2)
    with torch.device("meta"):
        ref = DeepSeekV3Transformer(_FSDP_ARGS)
    _materialized(ref)
    batch = _tokens(batch=2, seq=9, vocab=128, seed=11)
    F.cross_entropy(ref(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").backward()
    moe, attention = ref.layers["1"].moe, ref.layers["1"].attention
    for out in results:
        assert out["local_w1"] == [_FSDP_ARGS.moe.num_experts // 2, 128, 64] and "Shard(dim=0)" in out["placements"]
        # gradients are summed over the ranks, each of which saw one row: the one-process gradient of both rows
        for key, want in (("grad_w1", moe.experts.w1.grad), ("grad_gate", moe.router.gate.weight.grad),
                          ("grad_wkv_b", attention.wkv_b.weight.grad)):
            torch.testing.assert_close(torch.tensor(out[key]), want, rtol=1e-4, atol=1e-6, msg=key)
