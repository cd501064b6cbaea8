"""Conversion between our DeepSeek-V3 state dict and the Hugging Face `DeepseekV3ForCausalLM` layout.

Pure renames: our rotary pairs channels (2i, 2i + 1) of each head's rope part, as transformers does with
rope_interleave=true (its default and the published checkpoints' meaning; false is refused on import).

Reshaping happens only for the routed experts: we hold each MoE layer's experts as three stacked tensors (w1, w3
[experts, hidden, dim], w2 [experts, dim, hidden]); the published checkpoints, and `save_pretrained` of
transformers 5.x, store one matrix per expert and projection (`mlp.experts.{j}.{gate,up,down}_proj.weight`:
gate = w1[j], up = w3[j], down = w2[j]). Transformers 5.x fuses them in memory (`mlp.experts.gate_up_proj`
[experts, 2 x hidden, dim], gate rows first, and `mlp.experts.down_proj`); `from_hf` accepts that layout too.

The routing bias of auxiliary-loss-free balancing (`moe.expert_bias`) is HF's `mlp.gate.e_score_correction_bias`:
exported and imported. A model without the bias (load_balance_coeff 0) exports zeros and refuses to import a
nonzero one (it would route differently from the checkpoint).

Published DeepSeek-V3 checkpoints also carry a multi-token-prediction module as layer `n_layers` (its `eh_proj`
marks it); `from_hf` leaves such layers out. Their FP8 weights (`*.weight_scale_inv`) must be dequantized first.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs, YaRNScaling
from torchtitan.models.hf_common import RowLink, check_state_dict, moe_model_links, require
from torchtitan.models.moe.args import MoEArgs
from torchtitan.tools.logging import logger

_DTYPE_NAMES = ("float32", "bfloat16")
IMPORT_LOAD_BALANCE_COEFF = 1e-3
"""load_balance_coeff of imported configs: nonzero so that the model has the bias buffer the checkpoint's
e_score_correction_bias goes into (1e-3: DeepSeek-V3's bias update speed)."""

# Per-block renames, ours -> HF (without the "layers.{i}." / "model.layers.{i}." prefix).
_ATTN_KEYS: dict[str, str] = {
    "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight", "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
}
# SwiGLU: w2(silu(w1 x) * w3 x); HF calls the silu branch "gate" and the linear one "up".
_DENSE_KEYS: dict[str, str] = {"feed_forward.w1.weight": "mlp.gate_proj.weight",
                               "feed_forward.w2.weight": "mlp.down_proj.weight",
                               "feed_forward.w3.weight": "mlp.up_proj.weight"}
_MOE_KEYS: dict[str, str] = {"moe.router.gate.weight": "mlp.gate.weight",
                             "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
                             "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
                             "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight"}
_BIAS_KEY, _HF_BIAS_KEY = "moe.expert_bias", "mlp.gate.e_score_correction_bias"
_EXPERT_KEYS = {"moe.experts.w1": "gate_proj", "moe.experts.w2": "down_proj", "moe.experts.w3": "up_proj"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _unsupported(a: DeepSeekV3ModelArgs) -> list[str]:
    """Our options that transformers' DeepseekV3 cannot express."""
    problems = []
    if a.moe.score_func != "sigmoid":
        problems.append(f"moe.score_func='{a.moe.score_func}' (DeepseekV3 routes with sigmoid)")
    if a.moe.num_shared_experts < 1 and a.moe_layer_ids:
        problems.append("moe.num_shared_experts=0 (DeepseekV3's MoE blocks always have shared experts)")
    if a.moe.num_experts // a.moe.num_expert_groups < 2:
        problems.append("expert groups of one expert (DeepseekV3 scores a group by its two best experts)")
    if a.tie_word_embeddings:
        problems.append("tie_word_embeddings=True (DeepSeek-V3 checkpoints are untied)")
    return problems


def _check(side: str, got: dict[str, Any], shapes: dict[str, tuple[int, ...]], optional: set[str]) -> None:
    """check_state_dict, with a hint for FP8 checkpoints (their block scales are extra keys)."""
    for key in got:
        if key not in shapes and key.endswith("weight_scale_inv"):
            raise ValueError(f"{side} state dict: '{key}' is an FP8 block scale; dequantize the checkpoint to "
                             "bf16 first (e.g. DeepSeek's inference/fp8_cast_bf16.py)")
    check_state_dict(side, got, shapes, optional)


class DeepSeekV3StateDictAdapter:
    """Renames full (unsharded) DeepSeek-V3 state dicts to and from the HF layout; same interface as
    `Qwen3StateDictAdapter` (`to_hf`, `from_hf`, plus the config.json functions below as static methods)."""

    # Saved in float32 whatever the export dtype (torchtitan/components/hf_io.py): the routing bias.
    FLOAT32_HF_KEY_SUFFIXES = ("e_score_correction_bias",)

    def __init__(self, model_args: DeepSeekV3ModelArgs) -> None:
        a = self.model_args = model_args
        if _unsupported(a):
            raise ValueError("no Hugging Face DeepseekV3 layout for " + "; ".join(_unsupported(a)))
        d, h, qk = a.dim, a.n_heads, a.n_heads * a.qk_head_dim
        attn = {"attention_norm.weight": (d,), "ffn_norm.weight": (d,),
                "attention.wkv_a.weight": (a.kv_lora_rank + a.qk_rope_head_dim, d),
                "attention.kv_norm.weight": (a.kv_lora_rank,),
                "attention.wkv_b.weight": (h * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
                "attention.wo.weight": (d, h * a.v_head_dim)}
        if a.q_lora_rank > 0:
            attn.update({"attention.wq_a.weight": (a.q_lora_rank, d), "attention.q_norm.weight": (a.q_lora_rank,),
                         "attention.wq_b.weight": (qk, a.q_lora_rank)})
        else:
            attn["attention.wq.weight"] = (qk, d)
        f, e, eh = a.ffn_hidden_dim, a.moe.num_experts, a.moe.hidden_dim
        sh = eh * a.moe.num_shared_experts
        dense = {"feed_forward.w1.weight": (f, d), "feed_forward.w2.weight": (d, f), "feed_forward.w3.weight": (f, d)}
        moe = {"moe.router.gate.weight": (e, d), "moe.shared_experts.w1.weight": (sh, d),
               "moe.shared_experts.w2.weight": (d, sh), "moe.shared_experts.w3.weight": (sh, d)}
        # Our key -> shape (model order), and the keys renamed one to one (ours -> HF); experts are handled apart.
        self.shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (a.vocab_size, d)}
        self.to_hf_keys: dict[str, str] = {"tok_embeddings.weight": "model.embed_tokens.weight"}
        self.moe_layers: list[int] = a.moe_layer_ids
        self.has_bias = a.moe.load_balance_coeff > 0
        for i in range(a.n_layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            renames = {k: v for k, v in _ATTN_KEYS.items() if k in attn}
            renames.update(_MOE_KEYS if a.is_moe_layer(i) else _DENSE_KEYS)
            for key, hf_key in renames.items():
                self.shapes[ours + key] = attn.get(key) or moe.get(key) or dense[key]
                self.to_hf_keys[ours + key] = hf + hf_key
            if a.is_moe_layer(i):
                self.shapes.update({ours + "moe.experts.w1": (e, eh, d), ours + "moe.experts.w2": (e, d, eh),
                                    ours + "moe.experts.w3": (e, eh, d)})
                if self.has_bias:
                    self.shapes[ours + _BIAS_KEY] = (e,)
                    self.to_hf_keys[ours + _BIAS_KEY] = hf + _HF_BIAS_KEY
        self.shapes["norm.weight"] = (d,)
        self.to_hf_keys["norm.weight"] = "model.norm.weight"
        self.shapes["output.weight"] = (a.vocab_size, d)
        self.to_hf_keys["output.weight"] = "lm_head.weight"

    def _hf_shapes(self, fused_layers: set[int]) -> dict[str, tuple[int, ...]]:
        """HF key -> shape, with the experts of `fused_layers` in transformers' in-memory (fused) layout and the
        others one matrix per expert (the on-disk layout); every MoE layer has its correction bias."""
        shapes = {hf: self.shapes[ours] for ours, hf in self.to_hf_keys.items()}
        a = self.model_args
        e, h, d = a.moe.num_experts, a.moe.hidden_dim, a.dim
        for i in self.moe_layers:
            prefix = f"model.layers.{i}.mlp."
            shapes[prefix + "gate.e_score_correction_bias"] = (e,)
            if i in fused_layers:
                shapes.update({prefix + "experts.gate_up_proj": (e, 2 * h, d), prefix + "experts.down_proj": (e, d, h)})
                continue
            for j in range(e):
                shapes.update({f"{prefix}experts.{j}.{name}.weight": (d, h) if name == "down_proj" else (h, d)
                               for name in _EXPERT_KEYS.values()})
        return shapes

    def row_links(self, hf_keys: set[str] | None = None) -> list[RowLink]:
        """Which rows of which HF tensor each of our tensors is (for export and import by shard): renames (the
        routing bias included), and the experts per expert, or fused for layers whose `gate_up_proj` is in
        `hf_keys`. Without our bias, HF's is zeros (export leaves its rows unwritten: zeros)."""
        return moe_model_links(self.shapes, self.to_hf_keys, _EXPERT_KEYS, hf_keys)

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Our full state dict -> HF state dict in the on-disk layout (one matrix per expert). No copies: expert
        matrices are views of our stacked tensors (safetensors writes non-overlapping views fine)."""
        bias_keys = {k for k in self.shapes if k.endswith(_BIAS_KEY)}
        _check("our", state_dict, self.shapes, bias_keys)  # a hand-built state dict may leave the bias out
        out: dict[str, Tensor] = {}
        for ours in self.shapes:  # model order: each layer's experts stay next to its other weights
            layer, _, key = ours.removeprefix("layers.").partition(".")
            if ours in self.to_hf_keys:  # only a bias can be absent (_check)
                value = state_dict.get(ours)
                out[self.to_hf_keys[ours]] = value if value is not None else self._zero_bias(state_dict, layer)
                continue
            stacked = state_dict[ours]
            for j in range(stacked.shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{j}.{_EXPERT_KEYS[key]}.weight"] = stacked[j]
            if key == "moe.experts.w3" and not self.has_bias:
                # no balancing bias: HF's is zero, and its routing then equals ours
                out[f"model.layers.{layer}.{_HF_BIAS_KEY}"] = self._zero_bias(state_dict, layer)
        return out

    def _zero_bias(self, state_dict: dict[str, Tensor], layer: str) -> Tensor:
        # fp32 like the bias buffers on both sides (transformers keeps e_score_correction_bias in fp32). On the CPU,
        # whatever the router's device: real zeros even when the others are stand-ins (export by shard checks them).
        return torch.zeros(self.model_args.moe.num_experts, dtype=torch.float32)

    def _drop_mtp_layers(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Without the multi-token-prediction layers (index >= n_layers, holding an `eh_proj`), which our model has
        no place for; any other key of a layer beyond the model stays and is reported as unexpected."""
        n = self.model_args.n_layers
        mtp = {int(m.group(1)) for k in hf_state_dict if (m := _LAYER.match(k)) and int(m.group(1)) >= n
               and k.endswith(".eh_proj.weight")}
        if not mtp:
            return hf_state_dict
        logger.info(f"DeepSeek-V3 import: leaving out the multi-token-prediction layers {sorted(mtp)}")
        return {k: v for k, v in hf_state_dict.items() if not ((m := _LAYER.match(k)) and int(m.group(1)) in mtp)}

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """HF state dict (per-expert on-disk layout or transformers' fused in-memory one) -> ours; the exact
        inverse of `to_hf`. A missing e_score_correction_bias counts as zeros (transformers' init)."""
        a = self.model_args
        hf_state_dict = self._drop_mtp_layers(hf_state_dict)
        fused = {i for i in self.moe_layers if f"model.layers.{i}.mlp.experts.gate_up_proj" in hf_state_dict}
        hf_bias = {i: f"model.layers.{i}.{_HF_BIAS_KEY}" for i in self.moe_layers}
        _check("HF", hf_state_dict, self._hf_shapes(fused), set(hf_bias.values()))
        out: dict[str, Tensor] = {}
        for ours in self.shapes:
            layer, _, key = ours.removeprefix("layers.").partition(".")
            if key == _BIAS_KEY:
                bias = hf_state_dict.get(hf_bias[int(layer)])
                out[ours] = bias if bias is not None else torch.zeros(a.moe.num_experts, dtype=torch.float32)
            elif ours in self.to_hf_keys:
                out[ours] = hf_state_dict[self.to_hf_keys[ours]]
            elif int(layer) in fused:
                prefix, h = f"model.layers.{layer}.mlp.experts.", a.moe.hidden_dim
                if key == "moe.experts.w2":
                    out[ours] = hf_state_dict[prefix + "down_proj"]
                else:  # gate rows first, then up rows
                    rows = slice(0, h) if key == "moe.experts.w1" else slice(h, 2 * h)
                    out[ours] = hf_state_dict[prefix + "gate_up_proj"][:, rows].contiguous()
            else:
                name = _EXPERT_KEYS[key]
                out[ours] = torch.stack([hf_state_dict[f"model.layers.{layer}.mlp.experts.{j}.{name}.weight"]
                                         for j in range(a.moe.num_experts)])
        if not self.has_bias:
            nonzero = [k for k in hf_bias.values() if k in hf_state_dict and bool(hf_state_dict[k].ne(0).any())]
            if nonzero:
                raise ValueError(f"HF state dict: '{nonzero[0]}' is nonzero but the model has no routing bias "
                                 "(moe.load_balance_coeff=0); it would route differently from the checkpoint")
        return out

    # -- config.json (the module functions, reachable from the adapter class for generic callers) --

    @staticmethod
    def hf_config(model_args: DeepSeekV3ModelArgs, dtype: str = "float32", bos_id: int | None = None,
                  eos_id: int | None = None) -> dict[str, Any]:
        return hf_config(model_args, dtype, bos_id=bos_id, eos_id=eos_id)

    @staticmethod
    def args_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> DeepSeekV3ModelArgs:
        return args_from_hf_config(cfg, source)

    @staticmethod
    def check_args_match(expected: DeepSeekV3ModelArgs, found: DeepSeekV3ModelArgs, source: str) -> None:
        check_args_match(expected, found, source)


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def hf_config(model_args: DeepSeekV3ModelArgs, dtype: str = "float32", bos_id: int | None = None,
              eos_id: int | None = None) -> dict[str, Any]:
    """The `config.json` contents from which transformers builds `DeepseekV3ForCausalLM`, in the key style of the
    published checkpoints (legacy rope_theta / rope_scaling keys, which transformers 5 converts)."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype '{dtype}' is not supported; use one of {', '.join(_DTYPE_NAMES)}")
    a, moe = model_args, model_args.moe
    if _unsupported(a):
        raise ValueError("no Hugging Face DeepseekV3 config for " + "; ".join(_unsupported(a)))
    s = a.rope_scaling
    rope_scaling = None if s is None else {"type": "yarn", **asdict(s)}
    # With YaRN, max_position_embeddings is the stretched context (DeepSeek-V3: 40 x 4096 = 163840), the value
    # transformers checks the factor against; it does not change the numerics.
    max_pos = a.max_seq_len if s is None else max(a.max_seq_len, round(s.factor * s.original_max_position_embeddings))
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": a.vocab_size, "hidden_size": a.dim, "intermediate_size": a.ffn_hidden_dim,
        "moe_intermediate_size": moe.hidden_dim, "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_heads,
        # MoE: HF's first_k_dense_replace is our n_dense_layers; scoring_func / topk_method / moe_layer_freq are
        # informative only (transformers always routes this way) but the published configs carry them.
        "n_shared_experts": moe.num_shared_experts, "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k, "n_group": moe.num_expert_groups, "topk_group": moe.num_limited_groups,
        "routed_scaling_factor": moe.route_scale, "norm_topk_prob": moe.route_norm, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "first_k_dense_replace": a.n_dense_layers, "moe_layer_freq": 1,
        # MLA: a plain query projection is q_lora_rank null
        "q_lora_rank": a.q_lora_rank or None, "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "hidden_act": "silu", "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta, "rope_scaling": rope_scaling, "rope_interleave": True,
        "max_position_embeddings": max_pos, "tie_word_embeddings": False,
        "attention_bias": False, "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0,  # no multi-token-prediction module
        "initializer_range": 0.02, "use_cache": True,
        # Explicit nulls rather than transformers' defaults, which are not this tokenizer's ids.
        "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": dtype,
    }


def _rope(cfg: dict[str, Any], source: str) -> tuple[float, YaRNScaling | None]:
    """(rope_theta, YaRN scaling) from the legacy `rope_theta` / `rope_scaling` keys or transformers 5's
    `rope_parameters`, read as transformers reads them (beta defaults 32 / 1, a missing mscale counts as 0)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"{source}: rope type '{rope_type}' is not supported (only 'default' and 'yarn')")
    for key, ok in (("attention_factor", None), ("truncate", True), ("partial_rotary_factor", 1.0)):
        if scaling.get(key, ok) != ok:
            raise ValueError(f"{source}: yarn '{key}' = {scaling[key]} is not supported")
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    original = int(scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or max_pos)
    factor = float(scaling.get("factor") or max_pos / original)
    return theta, YaRNScaling(factor=factor, original_max_position_embeddings=original,
                              beta_fast=float(scaling.get("beta_fast") or 32),
                              beta_slow=float(scaling.get("beta_slow") or 1),
                              mscale=float(scaling.get("mscale") or 0.0),
                              mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0))


def args_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> DeepSeekV3ModelArgs:
    """DeepSeekV3ModelArgs equivalent to an HF DeepSeek-V3 `config.json` dict; errors on unsupported features.
    Optional MoE keys take transformers' DeepseekV3Config defaults. The routing bias is on (see
    IMPORT_LOAD_BALANCE_COEFF) so that the checkpoint's e_score_correction_bias has a place."""
    if cfg.get("model_type") != "deepseek_v3":
        raise ValueError(f"{source}: model_type '{cfg.get('model_type')}' is not 'deepseek_v3'")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act '{cfg['hidden_act']}' is not supported (only 'silu')")
    if cfg.get("attention_bias", False):
        raise ValueError(f"{source}: 'attention_bias' = true is not supported (our DeepSeek-V3 has no biases)")
    if cfg.get("rope_interleave", True) is False:
        raise ValueError(f"{source}: rope_interleave=false is not supported (our rotary pairs channels 2i, 2i+1)")
    if "q_lora_rank" not in cfg:
        raise KeyError(f"{source}: missing key 'q_lora_rank' (null for a plain query projection)")
    n_heads = int(require(cfg, "num_attention_heads", source))
    if int(cfg.get("num_key_value_heads") or n_heads) != n_heads:
        raise ValueError(f"{source}: num_key_value_heads must equal num_attention_heads for MLA")
    if cfg.get("tie_word_embeddings", False):
        raise ValueError(f"{source}: tie_word_embeddings=true is not supported")
    theta, scaling = _rope(cfg, source)
    try:
        moe = MoEArgs(num_experts=int(cfg.get("n_routed_experts") or require(cfg, "num_local_experts", source)),
                      top_k=int(require(cfg, "num_experts_per_tok", source)),
                      hidden_dim=int(require(cfg, "moe_intermediate_size", source)),
                      num_shared_experts=int(cfg.get("n_shared_experts", 1)), score_func="sigmoid",
                      route_norm=bool(cfg.get("norm_topk_prob", True)),
                      route_scale=float(cfg.get("routed_scaling_factor", 2.5)),
                      num_expert_groups=int(cfg.get("n_group") or 8),
                      num_limited_groups=int(cfg.get("topk_group") or 4),
                      load_balance_coeff=IMPORT_LOAD_BALANCE_COEFF)
        return DeepSeekV3ModelArgs(
            dim=int(require(cfg, "hidden_size", source)),
            n_layers=int(require(cfg, "num_hidden_layers", source)),
            n_heads=n_heads,
            vocab_size=int(require(cfg, "vocab_size", source)),
            ffn_hidden_dim=int(require(cfg, "intermediate_size", source)),
            n_dense_layers=int(require(cfg, "first_k_dense_replace", source)),
            norm_eps=float(require(cfg, "rms_norm_eps", source)),
            max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
            q_lora_rank=int(cfg["q_lora_rank"] or 0),
            kv_lora_rank=int(require(cfg, "kv_lora_rank", source)),
            qk_nope_head_dim=int(require(cfg, "qk_nope_head_dim", source)),
            qk_rope_head_dim=int(require(cfg, "qk_rope_head_dim", source)),
            v_head_dim=int(require(cfg, "v_head_dim", source)),
            rope_theta=theta,
            rope_scaling=scaling,
            moe=moe,
        )
    except ValueError as e:  # inconsistent expert groups etc., reported against the file
        raise ValueError(f"{source}: {e}") from e


def check_args_match(expected: DeepSeekV3ModelArgs, found: DeepSeekV3ModelArgs, source: str) -> None:
    """Raise if two configs would give different weight shapes or different numerics.

    Not compared: max_seq_len and init settings (they do not change what the weights mean), the balancing step
    (load_balance_coeff) and the expert kernel choice; the dense hidden size only when some layer is dense."""
    e, f = expected, found
    fields: list[tuple[str, Any, Any]] = [(name, getattr(e, name), getattr(f, name)) for name in (
        "dim", "n_layers", "n_heads", "vocab_size", "n_dense_layers", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "tie_word_embeddings", "rope_scaling")]
    if e.n_dense_layers:
        fields.append(("ffn_hidden_dim", e.ffn_hidden_dim, f.ffn_hidden_dim))
    if e.moe_layer_ids:
        for name in ("num_experts", "top_k", "hidden_dim", "route_norm", "num_shared_experts", "score_func",
                     "num_expert_groups", "num_limited_groups"):
            fields.append((f"moe.{name}", getattr(e.moe, name), getattr(f.moe, name)))
    for name, want, got in fields:
        if want != got:
            raise ValueError(f"{source}: {name}={got} does not match the model config ({want})")
    floats = [("norm_eps", e.norm_eps, f.norm_eps), ("rope_theta", e.rope_theta, f.rope_theta)]
    if e.moe_layer_ids:
        floats.append(("moe.route_scale", e.moe.route_scale, f.moe.route_scale))
    for name, want_f, got_f in floats:
        if not math.isclose(want_f, got_f, rel_tol=1e-9, abs_tol=0.0):
            raise ValueError(f"{source}: {name}={got_f} does not match the model config ({want_f})")
