"""DeepSeek-V3 <-> Hugging Face conversion (torchtitan/models/deepseek_v3/hf_adapter.py), checked against
transformers' `DeepseekV3ForCausalLM` logits in both directions (with and without the low-rank query path, with and
without YaRN, nonzero routing bias), its router and rotary tables; fully offline (models built from configs)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs, YaRNScaling, deepseek_v3_flavors  # noqa: E402
from torchtitan.models.deepseek_v3.hf_adapter import (  # noqa: E402
    DeepSeekV3StateDictAdapter,
    args_from_hf_config,
    check_args_match,
    hf_config,
)
from torchtitan.models.deepseek_v3.model import (  # noqa: E402
    DeepSeekV3Transformer,
    rope_attention_factor,
    rope_frequencies,
)
from torchtitan.models.moe import MoEArgs  # noqa: E402

# 1 dense + 2 MoE blocks; 8 experts in 4 groups, top 2 from the best 2 groups, 1 shared expert, routing bias on.
# v_head_dim (12) != qk_nope_head_dim (8); rms_norm_eps 1e-5 != the latent norms' fixed 1e-6.
MOE = MoEArgs(num_experts=8, top_k=2, hidden_dim=16, num_shared_experts=1, score_func="sigmoid", route_norm=True,
              route_scale=2.5, num_expert_groups=4, num_limited_groups=2, load_balance_coeff=1e-3)
BASE = DeepSeekV3ModelArgs(dim=48, n_layers=3, n_heads=4, vocab_size=128, ffn_hidden_dim=80, n_dense_layers=1,
                           norm_eps=1e-5, max_seq_len=64, q_lora_rank=0, kv_lora_rank=24, qk_nope_head_dim=8,
                           qk_rope_head_dim=16, v_head_dim=12, rope_theta=10000.0, rope_scaling=None, moe=MOE)
# Rotary dim 16 over an original context of 1024: pairs 0 (kept), 1-4 (blended), 5-7 (slowed); mscale != mscale_all_dim
# so that both the cos/sin factor and the softmax correction differ from 1.
YARN = YaRNScaling(factor=8.0, original_max_position_embeddings=1024, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                   mscale_all_dim=0.8)
CASES: dict[str, DeepSeekV3ModelArgs] = {
    "plain_q": BASE,
    "q_lora": dataclasses.replace(BASE, q_lora_rank=20),
    "yarn": dataclasses.replace(BASE, rope_scaling=YARN),
    # DeepSeek-V3's own YaRN settings (mscale = mscale_all_dim = 1: cos/sin unscaled, softmax x mscale^2)
    "q_lora_yarn_v3": dataclasses.replace(BASE, q_lora_rank=20, rope_scaling=YaRNScaling(
        factor=40.0, original_max_position_embeddings=1024)),
    # Moonlight-style routing (one group), unnormalised weights, 2 shared experts, no bias buffer, 2 dense blocks.
    "moonlight_style": dataclasses.replace(BASE, n_layers=4, n_dense_layers=2, moe=dataclasses.replace(
        MOE, num_expert_groups=1, num_limited_groups=1, route_norm=False, num_shared_experts=2, route_scale=2.446,
        load_balance_coeff=0.0)),
}
TOL = 1e-4
# attention's q/k projections and the routed experts (".experts.", not shared_experts), ours and transformers'
_SCALED = ("wq.", "wq_b.", "wkv_a.", "wkv_b.", "q_proj.", "q_b_proj.", "kv_a_proj_with_mqa.", "kv_b_proj.", ".experts.")


def _perturb(named: list[tuple[str, torch.Tensor]], seed: int) -> None:
    """Make the parity meaningful: random norm weights, sharper attention (at std 0.02 it is nearly uniform, and
    rotary or softmax-scale errors would hardly show), router logits and routing biases that decide something, and
    routed experts whose outputs weigh against the residual stream (so that a routing difference shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in named:
            if name.endswith("norm.weight"):
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
            elif name.endswith(("router.gate.weight", "mlp.gate.weight")):
                t.copy_(torch.randn(t.shape, generator=gen))
            elif name.endswith(("expert_bias", "e_score_correction_bias")):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
            elif any(k in name for k in _SCALED):
                t.mul_(10.0)


def _ours(args: DeepSeekV3ModelArgs, seed: int = 0) -> DeepSeekV3Transformer:
    torch.manual_seed(seed)
    model = DeepSeekV3Transformer(args)
    model.init_weights()
    _perturb([*model.named_parameters(), *model.named_buffers()], seed + 1)
    return model.eval()


def _tokens(args: DeepSeekV3ModelArgs, batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(7))


def _export(args: DeepSeekV3ModelArgs, model: DeepSeekV3Transformer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    hf_sd = DeepSeekV3StateDictAdapter(args).to_hf(model.state_dict())
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
    return pytest.importorskip("transformers")  # once per module: the import alone takes seconds


# ----------------------------------------------------------------------------- adapter without transformers


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_is_bitwise(name: str) -> None:
    args = CASES[name]
    model = _ours(args)
    ref = model.state_dict()
    adapter = DeepSeekV3StateDictAdapter(args)
    hf_sd = adapter.to_hf(ref)
    n_moe, e = len(args.moe_layer_ids), args.moe.num_experts
    attn = 2 + (3 if args.q_lora_rank else 1) + 4  # two block norms, q path, wkv_a, kv_norm, wkv_b, wo
    per_moe = attn + 1 + 1 + 3 + 3 * e  # router, correction bias, shared experts, routed experts
    assert len(hf_sd) == 3 + n_moe * per_moe + (args.n_layers - n_moe) * (attn + 3)
    assert all(f"model.layers.{i}.mlp.gate.e_score_correction_bias" in hf_sd for i in args.moe_layer_ids)
    back = adapter.from_hf(hf_sd)
    _assert_same(back, ref)
    DeepSeekV3Transformer(args).load_state_dict(back, strict=True)


def test_expert_shared_expert_and_bias_layout() -> None:
    args = CASES["q_lora"]
    model = _ours(args)
    sd = model.state_dict()
    hf_sd = DeepSeekV3StateDictAdapter(args).to_hf(sd)
    moe = model.layers["2"].moe
    for j in (0, 5):
        assert torch.equal(hf_sd[f"model.layers.2.mlp.experts.{j}.gate_proj.weight"], moe.experts.w1[j])
        assert torch.equal(hf_sd[f"model.layers.2.mlp.experts.{j}.up_proj.weight"], moe.experts.w3[j])
        assert torch.equal(hf_sd[f"model.layers.2.mlp.experts.{j}.down_proj.weight"], moe.experts.w2[j])
    for ours, hf in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
        shared = sd[f"layers.2.moe.shared_experts.{ours}.weight"]
        assert hf_sd[f"model.layers.2.mlp.shared_experts.{hf}.weight"] is shared
    bias = hf_sd["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias is sd["layers.2.moe.expert_bias"] and bias.abs().sum() > 0
    assert hf_sd["model.layers.0.self_attn.q_a_layernorm.weight"] is sd["layers.0.attention.q_norm.weight"]
    assert hf_sd["model.layers.0.mlp.gate_proj.weight"] is sd["layers.0.feed_forward.w1.weight"]
    # without the bias buffer: zeros exported, zeros accepted, a nonzero bias refused (it would route differently)
    plain = CASES["moonlight_style"]
    plain_sd = DeepSeekV3StateDictAdapter(plain).to_hf(_ours(plain).state_dict())
    assert torch.equal(plain_sd["model.layers.3.mlp.gate.e_score_correction_bias"], torch.zeros(8))
    DeepSeekV3StateDictAdapter(plain).from_hf(plain_sd)
    plain_sd["model.layers.3.mlp.gate.e_score_correction_bias"] = torch.ones(8)
    with pytest.raises(ValueError, match="no routing bias"):
        DeepSeekV3StateDictAdapter(plain).from_hf(plain_sd)


def test_adapter_rejects_bad_state_dicts_and_drops_mtp_layers() -> None:
    args = CASES["plain_q"]
    adapter = DeepSeekV3StateDictAdapter(args)
    hf_sd = adapter.to_hf(_ours(args).state_dict())
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    with pytest.raises(KeyError, match=f"missing key '{key}'"):
        adapter.from_hf({k: v for k, v in hf_sd.items() if k != key})
    with pytest.raises(KeyError, match="unexpected key"):
        adapter.from_hf({**hf_sd, "model.layers.1.mlp.experts.8.up_proj.weight": torch.zeros(16, 48)})
    with pytest.raises(ValueError, match="has shape"):
        adapter.from_hf({**hf_sd, "model.layers.1.mlp.gate.weight": torch.zeros(7, 48)})
    with pytest.raises(ValueError, match="FP8 block scale"):
        adapter.from_hf({**hf_sd, "model.layers.1.self_attn.q_proj.weight_scale_inv": torch.ones(1, 1)})
    # the published checkpoints' multi-token-prediction module (layer n_layers) is left out; other extra layers are not
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(48, 96), "model.layers.3.enorm.weight": torch.ones(48)}
    _assert_same(adapter.from_hf({**hf_sd, **mtp}), adapter.from_hf(hf_sd))
    with pytest.raises(KeyError, match="unexpected key 'model.layers.3.enorm.weight'"):
        adapter.from_hf({**hf_sd, "model.layers.3.enorm.weight": torch.ones(48)})
    with pytest.raises(ValueError, match="score_func"):
        DeepSeekV3StateDictAdapter(dataclasses.replace(args, moe=dataclasses.replace(MOE, score_func="softmax")))


# ----------------------------------------------------------------------------- config.json


def test_hf_config_builds_the_right_transformers_config(transformers_mod) -> None:
    v3 = transformers_mod.AutoConfig.for_model(**hf_config(deepseek_v3_flavors["671B"], "bfloat16"))
    assert type(v3).__name__ == "DeepseekV3Config"
    assert (v3.hidden_size, v3.num_hidden_layers, v3.first_k_dense_replace, v3.q_lora_rank) == (7168, 61, 3, 1536)
    assert (v3.n_routed_experts, v3.num_experts_per_tok, v3.n_group, v3.topk_group) == (256, 8, 8, 4)
    assert (v3.n_shared_experts, v3.moe_intermediate_size, v3.routed_scaling_factor) == (1, 2048, 2.5)
    assert v3.rope_parameters["rope_type"] == "yarn" and v3.rope_parameters["factor"] == 40.0
    assert v3.max_position_embeddings == 163840 and v3.num_mtp_layers == 0 and v3.rope_interleave
    moonlight = transformers_mod.AutoConfig.for_model(**hf_config(deepseek_v3_flavors["16B"]))
    assert moonlight.q_lora_rank is None and moonlight.rope_parameters["rope_type"] == "default"
    assert (moonlight.n_group, moonlight.topk_group, moonlight.routed_scaling_factor) == (1, 1, 2.446)


@pytest.mark.parametrize("flavor", list(deepseek_v3_flavors))
def test_config_round_trip(flavor: str) -> None:
    args = deepseek_v3_flavors[flavor]
    found = args_from_hf_config(json.loads(json.dumps(hf_config(args))))
    check_args_match(args, found, flavor)
    assert found.rope_scaling == args.rope_scaling and found.moe_layer_ids == args.moe_layer_ids


def test_args_from_published_configs() -> None:
    # The keys of deepseek-ai/DeepSeek-V3's config.json that matter (legacy rope keys, FP8 quantization left out).
    v3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
          "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
          "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
          "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
          "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
          "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
          "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096, "type": "yarn"},
          "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "vocab_size": 129280}
    check_args_match(deepseek_v3_flavors["671B"], args_from_hf_config(v3), "DeepSeek-V3")
    # moonshotai/Moonlight-16B-A3B (no rope scaling, one expert group)
    moonlight = {**v3, "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
                 "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
                 "n_routed_experts": 64, "routed_scaling_factor": 2.446, "q_lora_rank": None, "n_group": 1,
                 "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "max_position_embeddings": 8192,
                 "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": None, "num_nextn_predict_layers": 0,
                 "vocab_size": 163840}
    check_args_match(deepseek_v3_flavors["16B"], args_from_hf_config(moonlight), "Moonlight")
    # transformers 5's spelling, as save_pretrained writes it
    v5 = {k: v for k, v in v3.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**v3["rope_scaling"], "rope_type": "yarn", "rope_theta": 10000}
    check_args_match(deepseek_v3_flavors["671B"], args_from_hf_config(v5), "v5")
    with pytest.raises(ValueError, match="rope_scaling"):
        check_args_match(deepseek_v3_flavors["671B"], args_from_hf_config({**v3, "rope_scaling": None}), "x")
    with pytest.raises(ValueError, match="rope_interleave"):
        args_from_hf_config({**v3, "rope_interleave": False})
    with pytest.raises(ValueError, match="'truncate'"):
        args_from_hf_config({**v3, "rope_scaling": {**v3["rope_scaling"], "truncate": False}})
    with pytest.raises(ValueError, match="model_type 'deepseek_v2'"):
        args_from_hf_config({**v3, "model_type": "deepseek_v2"})


# ----------------------------------------------------------------------------- numerics against transformers


@pytest.mark.parametrize("args", [dataclasses.replace(deepseek_v3_flavors["671B"], max_seq_len=64),
                                  CASES["yarn"], BASE], ids=["671B", "tiny_yarn", "plain"])
def test_rope_and_softmax_scale_match_transformers(args: DeepSeekV3ModelArgs, transformers_mod) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    cfg = transformers_mod.AutoConfig.for_model(**hf_config(args))
    if args.rope_scaling is None:
        inv_freq, factor = DeepseekV3RotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    assert torch.equal(rope_frequencies(args), inv_freq)  # bit for bit
    assert rope_attention_factor(args) == pytest.approx(factor, rel=1e-12)
    with torch.device("meta"):
        attention = DeepseekV3Attention(cfg, layer_idx=0)
    assert args.softmax_scale == pytest.approx(attention.scaling, rel=1e-12)
    if args.rope_scaling is not None and args.rope_scaling.factor == 40.0:  # DeepSeek-V3: 1/sqrt(192) x 1.3689^2
        assert args.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)


def test_router_matches_transformers_gate(transformers_mod) -> None:
    """Group scores from the two best biased scores per group, selection on the biased scores, weights from the
    unbiased ones, normalised (sum + 1e-20) then scaled: our router against DeepseekV3TopkRouter directly."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from torchtitan.models.moe import TopKRouter

    for moe in (MOE, CASES["moonlight_style"].moe):
        cfg = transformers_mod.AutoConfig.for_model(**hf_config(dataclasses.replace(BASE, moe=moe)))
        gen = torch.Generator().manual_seed(5)
        theirs = DeepseekV3TopkRouter(cfg)
        ours = TopKRouter(48, moe)
        with torch.no_grad():
            theirs.weight.copy_(torch.randn(8, 48, generator=gen))
            theirs.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.3)
            ours.gate.weight.copy_(theirs.weight)
        x = torch.randn(256, 48, generator=gen)
        _, want_w, want_i = theirs(x)
        got_w, got_i = ours(x, theirs.e_score_correction_bias)[:2]
        order_w, order_g = want_i.argsort(dim=-1), got_i.argsort(dim=-1)  # transformers' top-k is unsorted
        assert torch.equal(want_i.gather(1, order_w), got_i.gather(1, order_g))
        torch.testing.assert_close(got_w.gather(1, order_g), want_w.gather(1, order_w), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_export_loads_in_transformers_with_same_logits(name: str, tmp_path: Path, transformers_mod) -> None:
    args = CASES[name]
    ours = _ours(args)
    _export(args, ours, tmp_path / "hf")
    hf, info = transformers_mod.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert hf.config.q_lora_rank == (args.q_lora_rank or None) and hf.config.v_head_dim != hf.config.qk_nope_head_dim
    tokens = _tokens(args)
    with torch.no_grad():
        logits = ours(tokens)
        diff = (hf.eval()(tokens).logits - logits).abs().max().item()
        assert diff <= TOL, f"max |logit diff| {diff:.3g}"
        # the comparison can fail: routing without the bias, or attention without YaRN, gives other logits
        if ours.layers["2"].moe.expert_bias is not None:
            for layer in ours.layers.values():
                if layer.moe is not None:
                    layer.moe.expert_bias.zero_()
            assert (ours(tokens) - logits).abs().max() > 100 * TOL
        if args.rope_scaling is not None:
            plain = _ours(dataclasses.replace(args, rope_scaling=None))
            assert (plain(tokens) - logits).abs().max() > 100 * TOL
    # transformers holds the experts fused (gate_up_proj) in memory: that layout imports to the same weights
    _assert_same(DeepSeekV3StateDictAdapter(args).from_hf(hf.state_dict()), _ours(args).state_dict())


@pytest.mark.parametrize("name", list(CASES))
def test_import_of_save_pretrained_matches_transformers(name: str, tmp_path: Path, transformers_mod) -> None:
    args = CASES[name]
    cfg = transformers_mod.AutoConfig.for_model(**hf_config(args))
    torch.manual_seed(3)
    hf = transformers_mod.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    named = [*hf.named_parameters(), *hf.named_buffers()]
    _perturb([(n, t) for n, t in named if args.moe.load_balance_coeff > 0 or "correction_bias" not in n], seed=4)
    hf.save_pretrained(tmp_path / "saved")
    on_disk = load_file(str(tmp_path / "saved" / "model.safetensors"))
    found = args_from_hf_config(json.loads((tmp_path / "saved" / "config.json").read_text()))
    check_args_match(args, found, "save_pretrained")
    ours = DeepSeekV3Transformer(args)
    ours.init_weights()
    ours.load_state_dict(DeepSeekV3StateDictAdapter(args).from_hf(on_disk), strict=True)
    tokens = _tokens(args)
    with torch.no_grad():
        diff = (hf.eval()(tokens).logits - ours.eval()(tokens)).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.3g}"
    # and back: what we export from the imported weights is what save_pretrained wrote (bias included)
    _assert_same(DeepSeekV3StateDictAdapter(args).to_hf(ours.state_dict()), on_disk)
