"""Qwen3 model (torchtitan/models/qwen3): structure, init, rotary layout, pipeline cutting, document masking,
parameter and FLOP counts (active parameters for MoE), a short MoE training run, and FSDP over MoE blocks."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.llama3.model import precompute_freqs_cis
from torchtitan.models.moe import MoE
from torchtitan.models.qwen3.args import Qwen3ModelArgs, get_pipeline_unit_flops, qwen3_flavors
from torchtitan.models.qwen3.model import (
    Qwen3Transformer,
    apply_rotary_emb,
    get_active_nparams,
    get_nparams_and_flops,
)

MODEL_SOURCE = Path(__file__).resolve().parents[2] / "torchtitan" / "models" / "qwen3" / "model.py"


def _args(flavor: str = "debugmodel", **overrides: object) -> Qwen3ModelArgs:
    return dataclasses.replace(qwen3_flavors[flavor], max_seq_len=64, **overrides)


def _build(args: Qwen3ModelArgs, seed: int = 0) -> Qwen3Transformer:
    torch.manual_seed(seed)
    model = Qwen3Transformer(args)
    model.init_weights()
    return model


def _tokens(batch: int = 2, seq: int = 16, vocab: int = 8192, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def moe_model() -> Qwen3Transformer:
    return _build(_args("debugmodel_moe")).eval()


# ----------------------------------------------------------------------------- structure and init


def test_registered_spec() -> None:
    from torchtitan.models.registry import get_model_spec

    spec = get_model_spec("qwen3")
    assert spec.model_cls is Qwen3Transformer and spec.flavors is qwen3_flavors
    assert spec.pipeline_input_fqns == ("tok_embeddings",) and spec.pipeline_output_fqns == ("norm", "output")
    assert spec.state_dict_adapter.__name__ == "Qwen3StateDictAdapter"


def test_submodule_names_are_the_contract(moe_model: Qwen3Transformer) -> None:
    dense = _build(_args())
    names = set(dict(dense.named_parameters()))
    for sub in ("attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo", "attention.q_norm",
                "attention.k_norm", "ffn_norm", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
        assert f"layers.3.{sub}.weight" in names
    assert not any(n.endswith(".bias") for n in names)
    moe_names = set(dict(moe_model.named_parameters()))
    assert {"layers.0.moe.router.gate.weight", "layers.0.moe.experts.w1"} <= moe_names
    assert not any("feed_forward" in n for n in moe_names)
    assert isinstance(moe_model.layers["2"].moe, MoE) and moe_model.layers["2"].feed_forward is None
    assert "freqs_cis" not in dense.state_dict() and "freqs_cis" in dict(dense.named_buffers())
    assert dense.layers["0"].attention.wq.weight.shape == (8 * 64, 256)  # head_dim is not dim / n_heads


def test_model_does_not_import_distributed() -> None:
    source = MODEL_SOURCE.read_text()
    assert "torch.distributed" not in source
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("torch.distributed")


def test_moe_layer_rule_follows_hugging_face() -> None:
    moe = qwen3_flavors["debugmodel_moe"].moe
    assert _args("debugmodel_moe").moe_layer_ids == [0, 1, 2, 3]
    assert _args(moe=moe, decoder_sparse_step=2).moe_layer_ids == [1, 3]
    assert _args(moe=moe, decoder_sparse_step=1, mlp_only_layers=[0, 3]).moe_layer_ids == [1, 2]
    assert _args().moe_layer_ids == []
    assert all(qwen3_flavors[f].moe_layer_ids == list(range(qwen3_flavors[f].n_layers)) for f in ("30B-A3B",
                                                                                                  "235B-A22B"))


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied", "debugmodel_moe"])
def test_param_init_sees_every_parameter_once_in_order(flavor: str) -> None:
    with torch.device("meta"):
        model = Qwen3Transformer(_args(flavor))
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
    assert torch.equal(model.freqs_cis, precompute_freqs_cis(64, 64, 1e6))


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied", "debugmodel_moe"])
def test_init_gives_finite_values_and_forward_shape(flavor: str) -> None:
    model = _build(_args(flavor))
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if not name.endswith("norm.weight"):
            assert p.std() > 0, name  # really drawn, not left at a constant
    if flavor == "debugmodel_tied":
        assert model.output.weight is model.tok_embeddings.weight
    with torch.no_grad():
        logits = model(_tokens())
    assert logits.shape == (2, 16, 8192) and torch.isfinite(logits).all()
    # unit-variance-ish initial logits: the output init is dim**-0.5 on a unit-RMS input
    assert 0.3 < logits.std().item() < 3.0


# ----------------------------------------------------------------------------- forward semantics


def test_rope_uses_rotate_half_layout() -> None:
    """Channel i pairs with channel i + head_dim / 2 (the Hugging Face checkpoints' layout)."""
    torch.manual_seed(0)
    head_dim, seq = 8, 5
    x = torch.randn(2, seq, 3, head_dim)
    freqs = precompute_freqs_cis(head_dim, seq, theta=100.0)
    cos = torch.cat([freqs[..., 0], freqs[..., 0]], dim=-1).view(1, seq, 1, head_dim)
    sin = torch.cat([freqs[..., 1], freqs[..., 1]], dim=-1).view(1, seq, 1, head_dim)
    rotate_half = torch.cat([-x[..., head_dim // 2:], x[..., : head_dim // 2]], dim=-1)
    torch.testing.assert_close(apply_rotary_emb(x, freqs), x * cos + rotate_half * sin, rtol=0, atol=1e-6)
    # per-token rows ([batch, seq, ...], document masking's positions) give the same as the table
    torch.testing.assert_close(apply_rotary_emb(x, freqs.expand(2, -1, -1, -1)), apply_rotary_emb(x, freqs))


def test_qk_norm_makes_attention_scale_invariant() -> None:
    model = _build(_args()).eval()
    tokens = _tokens()
    with torch.no_grad():
        ref = model(tokens)
        for layer in model.layers.values():
            # the per-head RMSNorm removes any scale of q and k (up to its eps: scale up, not down)
            layer.attention.wq.weight.mul_(8.0)
            layer.attention.wk.weight.mul_(2.0)
        torch.testing.assert_close(model(tokens), ref, rtol=0, atol=2e-5)


def test_causality_and_explicit_positions(moe_model: Qwen3Transformer) -> None:
    tokens = _tokens(batch=1, seq=24)
    changed = tokens.clone()
    changed[0, 11] = (changed[0, 11] + 1) % 8192
    with torch.no_grad():
        a, b = moe_model(tokens), moe_model(changed)
        torch.testing.assert_close(a[:, :11], b[:, :11], rtol=0, atol=1e-5)
        assert not torch.allclose(a[:, 11:], b[:, 11:])
        torch.testing.assert_close(moe_model(tokens, positions=torch.arange(24)), a, rtol=0, atol=0)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
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


@pytest.mark.parametrize("flavor", ["debugmodel_tied", "debugmodel_moe"])
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
    assert last.output.weight is not None and torch.isfinite(last.output.weight).all()


def test_sequence_longer_than_table_is_rejected(moe_model: Qwen3Transformer) -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        moe_model(_tokens(batch=1, seq=65))


# ----------------------------------------------------------------------------- counts


def test_moe_active_params_and_flops_by_hand() -> None:
    args = _args("debugmodel_moe")
    with torch.device("meta"):
        model = Qwen3Transformer(args)
    dim, hd, vocab = 256, 64, 8192
    attention = dim * 8 * hd * 2 + dim * 4 * hd * 2 + 2 * hd + 2 * dim  # wq, wo, wk, wv, q/k norm, two block norms
    router, expert = 8 * dim, 3 * 128 * dim
    embeddings = 2 * vocab * dim  # untied: embedding and output
    total = 4 * (attention + router + 8 * expert) + embeddings + dim
    active = 4 * (attention + router + 2 * expert) + embeddings + dim  # top_k = 2 of 8 experts
    assert (total, active) == (8_923_904, 6_564_608)
    n, flops = get_nparams_and_flops(model, args, 64)
    assert n == total and get_active_nparams(model) == active
    assert flops == 6 * (active - vocab * dim) + 12 * 4 * 8 * hd * 64
    emb, block, out = get_pipeline_unit_flops(args, 64)
    # the units add up to the model's FLOPs except the (elementwise) norms, which they leave out
    norms = 4 * (2 * hd + 2 * dim) + dim
    assert emb == 0.0 and out == 6 * vocab * dim
    assert emb + 4 * block + out == flops - 6 * norms


@pytest.mark.parametrize("flavor,total,active", [
    ("0.6B", 0.6e9, None), ("1.7B", 1.7e9, None), ("4B", 4.0e9, None), ("8B", 8.2e9, None),
    ("14B", 14.8e9, None), ("32B", 32.8e9, None), ("30B-A3B", 30.5e9, 3.3e9), ("235B-A22B", 235e9, 22e9),
])
def test_published_parameter_counts(flavor: str, total: float, active: float | None) -> None:
    """Totals (and activated parameters) as the Qwen3 model cards state them."""
    args = qwen3_flavors[flavor]
    with torch.device("meta"):
        model = Qwen3Transformer(args)
    n, _ = get_nparams_and_flops(model, args, 4096)
    assert n == pytest.approx(total, rel=0.02)
    assert get_active_nparams(model) == pytest.approx(active if active is not None else n, rel=0.02)
    assert (model.output.weight is model.tok_embeddings.weight) == args.tie_word_embeddings


# ----------------------------------------------------------------------------- training


def test_moe_trains_and_gradients_reach_router_and_experts() -> None:
    # the debug MoE flavor's blocks (8 experts, top 2, balancing on) with a smaller vocabulary: seconds on a CPU
    args = _args("debugmodel_moe", vocab_size=1024)
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
                for name, p in (("router.gate", layer.moe.router.gate.weight), ("experts.w1", layer.moe.experts.w1),
                                ("experts.w2", layer.moe.experts.w2), ("experts.w3", layer.moe.experts.w3)):
                    assert p.grad is not None and p.grad.abs().sum() > 0, f"layer {i} {name}"
                counts = layer.moe.tokens_per_expert
                assert counts.sum().item() == inputs.numel() * args.moe.top_k  # every (token, slot) counted once
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


# ----------------------------------------------------------------------------- parallelize


def test_moe_blocks_run_their_moe_layer_on_the_sequence_shard_under_tensor_parallel() -> None:
    """An MoE block's plan has no MLP entries and one for the MoE layer (its tokens stay split over tp, parity
    layouts moe_aux_tp2_accum and moe_fsdp2_tp2_ep2); a dense block's keeps the column/row-wise MLP."""
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    from torchtitan.models.qwen3.parallelize import qwen3_tp_block_plan

    with torch.device("meta"):
        moe_block = Qwen3Transformer(qwen3_flavors["debugmodel_moe"]).layers["0"]
        dense_block = Qwen3Transformer(qwen3_flavors["debugmodel"]).layers["0"]
    moe_plan, dense_plan = qwen3_tp_block_plan(moe_block), qwen3_tp_block_plan(dense_block)
    assert isinstance(moe_plan["moe"], PrepareModuleInputOutput)
    assert not any(k.startswith("feed_forward") for k in moe_plan)
    assert "feed_forward.w1" in dense_plan and "moe" not in dense_plan
    assert {"attention.q_norm", "attention.k_norm"} <= moe_plan.keys() & dense_plan.keys()


# Without the balance loss: its counts are summed over the ranks by the trainer (components/moe_balance.py), which
# these model-level tests leave out; the parity layouts cover it.
_FSDP_ARGS = dataclasses.replace(qwen3_flavors["debugmodel_moe"], dim=64, head_dim=16, n_heads=4, n_kv_heads=2,
                                 vocab_size=128, n_layers=2, max_seq_len=16,
                                 moe=dataclasses.replace(qwen3_flavors["debugmodel_moe"].moe, aux_loss_coeff=0.0))


def _materialized(model: torch.nn.Module) -> None:
    from torchtitan.components.model_parts import materialize
    from torchtitan.distributed.utils import param_init

    materialize([model], torch.device("cpu"), seed=0, param_init=param_init)


def _fsdp_rank(rank: int) -> dict:
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    pd = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2)
    pd.build_mesh("cpu")
    cfg = JobConfig()
    cfg.activation_checkpoint.mode = "full"  # the house order: AC wraps the MoE blocks before FSDP shards them
    with torch.device("meta"):
        model = Qwen3Transformer(_FSDP_ARGS)
    model = parallelize_qwen3(model, pd, cfg, "float32")
    _materialized(model)
    batch = _tokens(batch=2, seq=9, vocab=128, seed=11)[rank:rank + 1]
    F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").backward()
    w1 = model.layers["1"].moe.experts.w1
    return {"local_w1": list(w1.to_local().shape), "placements": str(w1.placements),
            "grad_w1": w1.grad.full_tensor(), "grad_gate": model.layers["1"].moe.router.gate.weight.grad.full_tensor()}


def test_fsdp_shards_moe_blocks_and_matches_one_process() -> None:
    from tests.unit.forked import run_ranks

    results = run_ranks(_fsdp_rank, world=2)
    with torch.device("meta"):
        ref = Qwen3Transformer(_FSDP_ARGS)
    _materialized(ref)
    batch = _tokens(batch=2, seq=9, vocab=128, seed=11)
    F.cross_entropy(ref(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").backward()
    experts = _FSDP_ARGS.moe.num_experts
    for out in results:
        assert out["local_w1"] == [experts // 2, 128, 64] and "Shard(dim=0)" in out["placements"]
        # gradients are summed over the ranks, each of which saw one row: the one-process gradient of both rows
        torch.testing.assert_close(torch.tensor(out["grad_w1"]), ref.layers["1"].moe.experts.w1.grad,
                                   rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.tensor(out["grad_gate"]), ref.layers["1"].moe.router.gate.weight.grad,
                                   rtol=1e-4, atol=1e-6)


def test_compile_leaves_the_moe_layer_eager_and_compiles_the_rest_of_its_block() -> None:
    """fullgraph tracing cannot take the routing's host reads: MoE blocks compile their norms and attention only, and
    the model computes what it computes eagerly (dynamo's eager backend: tracing without inductor's compile time)."""
    from torchtitan.distributed.compile import apply_compile

    torch.manual_seed(0)
    args = dataclasses.replace(qwen3_flavors["debugmodel_moe_small"], n_layers=2, max_seq_len=16)
    model = Qwen3Transformer(args)
    model.init_weights()
    reference = copy.deepcopy(model)
    apply_compile(model, "eager")
    block = model.layers["0"]
    assert block.attention._compiled_call_impl is not None and block.ffn_norm._compiled_call_impl is not None
    assert block.moe._compiled_call_impl is None and block._compiled_call_impl is None
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-6, atol=1e-6)
    model(tokens).sum().backward()  # the compiled attention's backward runs too
