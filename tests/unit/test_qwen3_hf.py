"""Qwen3 <-> Hugging Face conversion (torchtitan/models/qwen3/hf_adapter.py), checked against transformers'
`Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` logits in both directions, fully offline (models built from configs)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from torchtitan.models.moe import MoEArgs  # noqa: E402
from torchtitan.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors  # noqa: E402
from torchtitan.models.qwen3.hf_adapter import (  # noqa: E402
    Qwen3StateDictAdapter,
    args_from_hf_config,
    check_args_match,
    hf_config,
)
from torchtitan.models.qwen3.model import Qwen3Transformer  # noqa: E402

# head_dim 16 != dim / n_heads (12), GQA with 2 query heads per KV head.
DENSE = Qwen3ModelArgs(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128, ffn_hidden_dim=80,
                       rope_theta=10000.0, max_seq_len=64)
MOE_ARGS = MoEArgs(num_experts=8, top_k=2, hidden_dim=24, route_norm=True, load_balance_coeff=1e-3)
CASES: dict[str, Qwen3ModelArgs] = {
    "dense": DENSE,
    "dense_tied": dataclasses.replace(DENSE, tie_word_embeddings=True),
    "moe": dataclasses.replace(DENSE, moe=MOE_ARGS),
    "moe_tied": dataclasses.replace(DENSE, moe=MOE_ARGS, tie_word_embeddings=True),
    # Layers 0 and 2 dense (mlp_only_layers, decoder_sparse_step 2 leaves 1 and 3), unnormalised top-k weights.
    "moe_mixed": dataclasses.replace(DENSE, n_layers=4, moe=dataclasses.replace(MOE_ARGS, route_norm=False),
                                     decoder_sparse_step=1, mlp_only_layers=(0, 2)),
    "moe_step2": dataclasses.replace(DENSE, n_layers=4, moe=MOE_ARGS, decoder_sparse_step=2),
}
TOL = 1e-4


def _perturb(named_params, seed: int) -> None:
    """Make the parity meaningful: random norm weights (a swapped or dropped norm shows), sharper attention (with
    QK-norm, scaling wq/wk does nothing; the per-head norm weights set the logits' scale) and a router whose
    logits decide something (at std 0.02 every expert would get about the same weight)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_params:
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
                if "q_norm" in name or "k_norm" in name:
                    p.mul_(3.0)
            elif name.endswith("gate.weight"):  # the MoE router (a dense MLP has gate_proj.weight)
                p.copy_(torch.randn(p.shape, generator=gen))


def _ours(args: Qwen3ModelArgs, seed: int = 0) -> Qwen3Transformer:
    torch.manual_seed(seed)
    model = Qwen3Transformer(args)
    model.init_weights()
    _perturb([(n, p) for n, p in model.named_parameters() if "router" in n or "norm" in n], seed + 1)
    return model.eval()


def _tokens(args: Qwen3ModelArgs, batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(7))


def _export(args: Qwen3ModelArgs, model: Qwen3Transformer, folder: Path) -> None:
    """The folder layout hf_io.save_hf writes for Llama: model.safetensors + config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    hf_sd = Qwen3StateDictAdapter(args).to_hf(model.state_dict())
    save_file({k: v.detach().contiguous() for k, v in hf_sd.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(args, "float32")))


def _assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(ref)
    for key, t in ref.items():
        assert got[key].dtype == t.dtype, key
        assert torch.equal(got[key], t), key


@pytest.fixture(scope="module")
def transformers_mod():
    # Imported once per module: the import alone takes several seconds.
    return pytest.importorskip("transformers")


# ---------------------------------------------------------------------------------------------
# Adapter without transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_is_bitwise(name: str) -> None:
    args = CASES[name]
    model = _ours(args)
    ref = model.state_dict()
    adapter = Qwen3StateDictAdapter(args)
    hf_sd = adapter.to_hf(ref)
    assert ("lm_head.weight" in hf_sd) != args.tie_word_embeddings
    assert not any("expert_bias" in k for k in hf_sd)
    n_moe = len(args.moe_layer_ids)
    per_layer_dense, per_layer_moe = 8 + 3, 8 + 1 + 3 * (args.moe.num_experts if args.moe else 0)
    expected = 2 + (0 if args.tie_word_embeddings else 1) + n_moe * per_layer_moe + (args.n_layers - n_moe) * \
        per_layer_dense
    assert len(hf_sd) == expected
    assert hf_sd["model.layers.0.self_attn.q_norm.weight"] is ref["layers.0.attention.q_norm.weight"]
    back = adapter.from_hf(hf_sd)
    _assert_same(back, ref)
    if args.tie_word_embeddings:
        assert back["output.weight"] is back["tok_embeddings.weight"]
    Qwen3Transformer(args).load_state_dict(back, strict=True)


def test_expert_layout_and_bias() -> None:
    args = CASES["moe"]
    model = _ours(args)
    with torch.no_grad():
        model.layers["1"].moe.expert_bias.copy_(torch.linspace(-1, 1, 8))
    sd = model.state_dict()
    hf_sd = Qwen3StateDictAdapter(args).to_hf(sd)
    experts = model.layers["1"].moe.experts
    for j in (0, 5):
        assert torch.equal(hf_sd[f"model.layers.1.mlp.experts.{j}.gate_proj.weight"], experts.w1[j])
        assert torch.equal(hf_sd[f"model.layers.1.mlp.experts.{j}.up_proj.weight"], experts.w3[j])
        assert torch.equal(hf_sd[f"model.layers.1.mlp.experts.{j}.down_proj.weight"], experts.w2[j])
    assert hf_sd["model.layers.1.mlp.gate.weight"] is sd["layers.1.moe.router.gate.weight"]
    back = Qwen3StateDictAdapter(args).from_hf(hf_sd)
    assert torch.equal(back["layers.1.moe.expert_bias"], torch.zeros(8))  # no HF equivalent: zero on import
    # without balancing there is no bias buffer, and the adapter neither expects nor produces one
    plain = dataclasses.replace(args, moe=dataclasses.replace(MOE_ARGS, load_balance_coeff=0.0))
    assert "layers.0.moe.expert_bias" not in Qwen3StateDictAdapter(plain).from_hf(hf_sd)


def test_adapter_rejects_bad_state_dicts() -> None:
    args = CASES["moe"]
    adapter = Qwen3StateDictAdapter(args)
    hf_sd = adapter.to_hf(_ours(args).state_dict())
    with pytest.raises(KeyError, match="missing key 'model.layers.0.mlp.experts.3.up_proj.weight'"):
        adapter.from_hf({k: v for k, v in hf_sd.items() if k != "model.layers.0.mlp.experts.3.up_proj.weight"})
    with pytest.raises(KeyError, match="unexpected key"):
        adapter.from_hf({**hf_sd, "model.layers.0.mlp.experts.8.up_proj.weight": torch.zeros(24, 48)})
    with pytest.raises(ValueError, match="has shape"):
        adapter.from_hf({**hf_sd, "model.layers.0.mlp.gate.weight": torch.zeros(7, 48)})
    with pytest.raises(ValueError, match="shared experts"):
        Qwen3StateDictAdapter(dataclasses.replace(args, moe=dataclasses.replace(MOE_ARGS, num_shared_experts=1)))


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def test_hf_config_builds_the_right_transformers_classes(transformers_mod) -> None:
    dense = transformers_mod.AutoConfig.for_model(**hf_config(qwen3_flavors["0.6B"], "bfloat16"))
    assert type(dense).__name__ == "Qwen3Config"
    assert (dense.head_dim, dense.num_key_value_heads, dense.tie_word_embeddings) == (128, 8, True)
    assert dense.rope_parameters["rope_theta"] == 1e6 and dense.rms_norm_eps == 1e-6
    moe = transformers_mod.AutoConfig.for_model(**hf_config(qwen3_flavors["30B-A3B"]))
    assert type(moe).__name__ == "Qwen3MoeConfig"
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert (moe.norm_topk_prob, moe.decoder_sparse_step, moe.mlp_only_layers, moe.head_dim) == (True, 1, [], 128)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe", "0.6B", "8B", "30B-A3B", "235B-A22B"])
def test_config_round_trip(flavor: str) -> None:
    args = qwen3_flavors[flavor]
    found = args_from_hf_config(json.loads(json.dumps(hf_config(args))))
    check_args_match(args, found, flavor)
    assert found.moe_layer_ids == args.moe_layer_ids


def test_args_from_published_style_config() -> None:
    # The keys of Qwen/Qwen3-30B-A3B's config.json that matter (legacy rope keys), and transformers 5's spelling
    # (num_local_experts, rope_parameters) as save_pretrained writes it.
    published = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
                 "use_sliding_window": False, "sliding_window": None}
    check_args_match(qwen3_flavors["30B-A3B"], args_from_hf_config(published), "published")
    v5 = {k: v for k, v in published.items() if k not in ("num_experts", "rope_theta", "rope_scaling")}
    v5.update(num_local_experts=128, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    check_args_match(qwen3_flavors["30B-A3B"], args_from_hf_config(v5), "v5")
    with pytest.raises(ValueError, match="top_k"):
        check_args_match(qwen3_flavors["30B-A3B"], args_from_hf_config({**published, "num_experts_per_tok": 4}), "x")
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        args_from_hf_config({**published, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="sliding-window"):
        args_from_hf_config({**published, "use_sliding_window": True})
    with pytest.raises(ValueError, match="model_type 'llama'"):
        args_from_hf_config({**published, "model_type": "llama"})


# ---------------------------------------------------------------------------------------------
# Parity with transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_export_loads_in_transformers_with_same_logits(name: str, tmp_path: Path, transformers_mod) -> None:
    args = CASES[name]
    ours = _ours(args)
    _export(args, ours, tmp_path / "hf")
    hf, info = transformers_mod.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    expected_cls = "Qwen3MoeForCausalLM" if args.moe_layer_ids else "Qwen3ForCausalLM"
    assert type(hf).__name__ == expected_cls
    assert hf.config.head_dim == args.head_dim != args.dim // args.n_heads
    tokens = _tokens(args)
    with torch.no_grad():
        diff = (hf.eval()(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.3g}"
    # transformers holds the experts fused (gate_up_proj) in memory: that layout imports to the same weights
    _assert_same(Qwen3StateDictAdapter(args).from_hf(hf.state_dict()), ours.state_dict())


@pytest.mark.parametrize("name", list(CASES))
def test_import_of_save_pretrained_matches_transformers(name: str, tmp_path: Path, transformers_mod) -> None:
    args = CASES[name]
    cfg = transformers_mod.AutoConfig.for_model(**hf_config(args))
    torch.manual_seed(3)
    hf = transformers_mod.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    _perturb(list(hf.named_parameters()), seed=4)
    hf.save_pretrained(tmp_path / "saved")
    on_disk = load_file(str(tmp_path / "saved" / "model.safetensors"))
    found = args_from_hf_config(json.loads((tmp_path / "saved" / "config.json").read_text()))
    check_args_match(args, found, "save_pretrained")
    ours = Qwen3Transformer(args)
    ours.init_weights()
    ours.load_state_dict(Qwen3StateDictAdapter(args).from_hf(on_disk), strict=True)
    tokens = _tokens(args)
    with torch.no_grad():
        diff = (hf.eval()(tokens).logits - ours.eval()(tokens)).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.3g}"
    # and back: what we export from the imported weights is what save_pretrained wrote
    _assert_same({k: v for k, v in Qwen3StateDictAdapter(args).to_hf(ours.state_dict()).items()}, on_disk)
