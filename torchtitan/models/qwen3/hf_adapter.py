"""Conversion between our Qwen3 state dict and the Hugging Face `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` layouts.

Pure renames: our rotary layout already is the checkpoints' "rotate_half" (torchtitan/models/qwen3/model.py), so
no rows move. The only reshaping is of the routed experts: we hold each MoE layer's experts as three stacked
tensors (w1, w3 [experts, hidden, dim], w2 [experts, dim, hidden]); the published checkpoints, and what
`save_pretrained` of transformers 5.x writes, store one matrix per expert and projection
(`mlp.experts.{j}.{gate,up,down}_proj.weight`; gate = w1[j], up = w3[j], down = w2[j]). Transformers 5.x fuses
them in memory (`mlp.experts.gate_up_proj` [experts, 2 * hidden, dim] = gate rows then up rows, and
`mlp.experts.down_proj`); `from_hf` accepts that layout too, e.g. a live model's `state_dict()`.

The routing bias of aux-loss-free balancing (`moe.expert_bias`) has no Hugging Face equivalent: `to_hf` leaves it
out (warning when it is not zero, since the HF model then routes differently) and `from_hf` gives zeros.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchtitan.models.hf_common import RowLink, check_state_dict, close, moe_model_links, require, same_tensor
from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.qwen3.args import Qwen3ModelArgs
from torchtitan.tools.logging import logger

_DTYPE_NAMES = ("float32", "bfloat16")

# Per-block renames, ours -> HF (without the "layers.{i}." / "model.layers.{i}." prefix).
_ATTN_KEYS: dict[str, str] = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# SwiGLU: w2(silu(w1 x) * w3 x); HF calls the silu branch "gate" and the linear one "up".
_DENSE_KEYS: dict[str, str] = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_ROUTER_KEY = ("moe.router.gate.weight", "mlp.gate.weight")
_EXPERT_KEYS: dict[str, str] = {"moe.experts.w1": "gate_proj", "moe.experts.w2": "down_proj",
                                "moe.experts.w3": "up_proj"}


def _unsupported_moe(moe: MoEArgs) -> list[str]:
    """Our MoE options that Qwen3-MoE in transformers cannot express."""
    problems = []
    if moe.num_shared_experts:
        problems.append(f"num_shared_experts={moe.num_shared_experts} (Qwen3-MoE has no shared experts)")
    if moe.score_func != "softmax":
        problems.append(f"score_func='{moe.score_func}' (Qwen3-MoE routes with softmax)")
    if moe.route_scale != 1.0:
        problems.append(f"route_scale={moe.route_scale} (Qwen3-MoE has no routed scaling factor)")
    if moe.num_expert_groups != 1:
        problems.append(f"num_expert_groups={moe.num_expert_groups} (Qwen3-MoE has no group-limited routing)")
    return problems


class Qwen3StateDictAdapter:
    """Renames full (unsharded) Qwen3 state dicts to and from the HF layout; same interface as
    `Llama3StateDictAdapter` (`to_hf`, `from_hf`, plus the config.json functions below as static methods)."""

    def __init__(self, model_args: Qwen3ModelArgs) -> None:
        a = self.model_args = model_args
        if a.moe is not None and _unsupported_moe(a.moe):
            raise ValueError("no Hugging Face Qwen3 layout for " + "; ".join(_unsupported_moe(a.moe)))
        d, hd, n_q, n_kv = a.dim, a.head_dim, a.n_heads, a.num_kv_heads
        attn_shapes = {
            "attention.wq.weight": (n_q * hd, d), "attention.wk.weight": (n_kv * hd, d),
            "attention.wv.weight": (n_kv * hd, d), "attention.wo.weight": (d, n_q * hd),
            "attention.q_norm.weight": (hd,), "attention.k_norm.weight": (hd,),
            "attention_norm.weight": (d,), "ffn_norm.weight": (d,),
        }
        f = a.ffn_hidden_dim
        dense_shapes = {"feed_forward.w1.weight": (f, d), "feed_forward.w2.weight": (d, f),
                        "feed_forward.w3.weight": (f, d)}
        # Our key -> shape, and the keys renamed one to one (ours -> HF); expert weights are handled apart.
        self.shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (a.vocab_size, d)}
        self.to_hf_keys: dict[str, str] = {"tok_embeddings.weight": "model.embed_tokens.weight"}
        self.moe_layers: list[int] = a.moe_layer_ids
        for i in range(a.n_layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            for key, hf_key in _ATTN_KEYS.items():
                self.shapes[ours + key] = attn_shapes[key]
                self.to_hf_keys[ours + key] = hf + hf_key
            if a.is_moe_layer(i):
                e, h = a.moe.num_experts, a.moe.hidden_dim
                self.shapes[ours + _ROUTER_KEY[0]] = (e, d)
                self.to_hf_keys[ours + _ROUTER_KEY[0]] = hf + _ROUTER_KEY[1]
                self.shapes.update({ours + "moe.experts.w1": (e, h, d), ours + "moe.experts.w2": (e, d, h),
                                    ours + "moe.experts.w3": (e, h, d)})
            else:
                for key, hf_key in _DENSE_KEYS.items():
                    self.shapes[ours + key] = dense_shapes[key]
                    self.to_hf_keys[ours + key] = hf + hf_key
        self.shapes["norm.weight"] = (d,)
        self.to_hf_keys["norm.weight"] = "model.norm.weight"
        self.shapes["output.weight"] = (a.vocab_size, d)
        self.to_hf_keys["output.weight"] = "lm_head.weight"
        self.from_hf_keys: dict[str, str] = {hf: ours for ours, hf in self.to_hf_keys.items()}
        # Buffers of the aux-loss-free balancing: in our state dict (persistent), never in HF's.
        self.bias_keys: list[str] = []
        if a.moe is not None and a.moe.load_balance_coeff > 0:
            self.bias_keys = [f"layers.{i}.moe.expert_bias" for i in self.moe_layers]

    # -- HF layout of the experts ----------------------------------------------------------------

    def _hf_shapes(self, fused_layers: set[int]) -> dict[str, tuple[int, ...]]:
        """HF key -> shape, with the experts of `fused_layers` in transformers' in-memory (fused) layout and the
        others one matrix per expert (the on-disk layout)."""
        shapes = {hf: self.shapes[ours] for ours, hf in self.to_hf_keys.items()}
        a = self.model_args
        for i in self.moe_layers:
            e, h, d, prefix = a.moe.num_experts, a.moe.hidden_dim, a.dim, f"model.layers.{i}.mlp.experts."
            if i in fused_layers:
                shapes[prefix + "gate_up_proj"] = (e, 2 * h, d)
                shapes[prefix + "down_proj"] = (e, d, h)
                continue
            for j in range(e):
                shapes.update({f"{prefix}{j}.gate_proj.weight": (h, d), f"{prefix}{j}.up_proj.weight": (h, d),
                               f"{prefix}{j}.down_proj.weight": (d, h)})
        return shapes

    def row_links(self, hf_keys: set[str] | None = None) -> list[RowLink]:
        """Which rows of which HF tensor each of our tensors is (for export and import by shard): renames, and the
        experts per expert, or in transformers' fused layout for layers whose `gate_up_proj` is in `hf_keys`.
        The routing bias has none: export leaves it out and import takes `from_hf`'s zeros."""
        skip = {"output.weight"} if self.model_args.tie_word_embeddings else set()  # HF ties lm_head itself
        return moe_model_links(self.shapes, self.to_hf_keys, _EXPERT_KEYS, hf_keys, skip)

    # -- conversion ------------------------------------------------------------------------------

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Our full state dict -> HF state dict in the on-disk layout (one matrix per expert). No copies: expert
        matrices are views of our stacked tensors (safetensors writes non-overlapping views fine)."""
        tied = self.model_args.tie_word_embeddings
        # A tied model's own state_dict() carries output.weight as an alias; a hand-built one may not.
        optional = set(self.bias_keys) | ({"output.weight"} if tied else set())
        check_state_dict("our", state_dict, self.shapes, optional)
        if tied and "output.weight" in state_dict:
            if not same_tensor(state_dict["output.weight"], state_dict["tok_embeddings.weight"]):
                raise ValueError("our state dict: 'output.weight' differs from 'tok_embeddings.weight' but "
                                 "tie_word_embeddings=True; the HF checkpoint would silently drop it")
        nonzero_bias = [k for k in self.bias_keys if k in state_dict and bool(state_dict[k].ne(0).any())]
        if nonzero_bias:
            logger.warning(f"Qwen3 export: {len(nonzero_bias)} MoE layers have a nonzero routing bias (expert_bias), "
                           "which Hugging Face Qwen3-MoE cannot hold; the exported model routes without it")
        out: dict[str, Tensor] = {}
        for ours in self.shapes:  # model order: each layer's experts stay next to its other weights
            if ours in self.to_hf_keys:
                if not (tied and ours == "output.weight"):  # HF ties lm_head to embed_tokens itself
                    out[self.to_hf_keys[ours]] = state_dict[ours]
                continue
            layer, _, key = ours.removeprefix("layers.").partition(".")
            stacked = state_dict[ours]
            for j in range(stacked.shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{j}.{_EXPERT_KEYS[key]}.weight"] = stacked[j]
        return out

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """HF state dict (per-expert on-disk layout or transformers' fused in-memory one) -> ours; the exact
        inverse of `to_hf`. Tied models get `output.weight` as the same tensor as `tok_embeddings.weight`, and
        balancing models a zero `expert_bias` per MoE layer, so `load_state_dict(strict=True)` accepts it."""
        a = self.model_args
        tied = a.tie_word_embeddings
        if not tied and "lm_head.weight" not in hf_state_dict:
            raise KeyError("HF state dict: missing key 'lm_head.weight' (config has tie_word_embeddings=false)")
        fused = {i for i in self.moe_layers if f"model.layers.{i}.mlp.experts.gate_up_proj" in hf_state_dict}
        check_state_dict("HF", hf_state_dict, self._hf_shapes(fused), {"lm_head.weight"} if tied else set())
        if tied and "lm_head.weight" in hf_state_dict:
            # Some tied checkpoints store lm_head anyway; accept it only if it really is the embedding.
            if not same_tensor(hf_state_dict["lm_head.weight"], hf_state_dict["model.embed_tokens.weight"]):
                raise ValueError("HF state dict: 'lm_head.weight' differs from 'model.embed_tokens.weight' but "
                                 "tie_word_embeddings=true")
        out: dict[str, Tensor] = {}
        for ours in self.shapes:
            if ours in self.to_hf_keys:
                if not (tied and ours == "output.weight"):
                    out[ours] = hf_state_dict[self.to_hf_keys[ours]]
                continue
            layer, _, key = ours.removeprefix("layers.").partition(".")
            prefix = f"model.layers.{layer}.mlp.experts."
            if int(layer) in fused:
                h = a.moe.hidden_dim
                if key == "moe.experts.w2":
                    out[ours] = hf_state_dict[prefix + "down_proj"]
                else:  # gate rows first, then up rows (transformers' Concatenate(dim=1) of gate, up)
                    rows = slice(0, h) if key == "moe.experts.w1" else slice(h, 2 * h)
                    out[ours] = hf_state_dict[prefix + "gate_up_proj"][:, rows].contiguous()
            else:
                name = _EXPERT_KEYS[key]
                out[ours] = torch.stack([hf_state_dict[f"{prefix}{j}.{name}.weight"]
                                         for j in range(a.moe.num_experts)])
        for key in self.bias_keys:
            # On the CPU, as read checkpoints are: real zeros even when the experts are stand-ins (hf_sharded.py).
            out[key] = torch.zeros(a.moe.num_experts, dtype=torch.float32)
        if tied:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    # -- config.json (the module functions, reachable from the adapter class for generic callers) --

    @staticmethod
    def hf_config(model_args: Qwen3ModelArgs, dtype: str = "float32", bos_id: int | None = None,
                  eos_id: int | None = None) -> dict[str, Any]:
        return hf_config(model_args, dtype, bos_id=bos_id, eos_id=eos_id)

    @staticmethod
    def args_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> Qwen3ModelArgs:
        return args_from_hf_config(cfg, source)

    @staticmethod
    def check_args_match(expected: Qwen3ModelArgs, found: Qwen3ModelArgs, source: str) -> None:
        check_args_match(expected, found, source)


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def hf_config(model_args: Qwen3ModelArgs, dtype: str = "float32", bos_id: int | None = None,
              eos_id: int | None = None) -> dict[str, Any]:
    """The `config.json` contents from which transformers builds `Qwen3ForCausalLM` (dense) or
    `Qwen3MoeForCausalLM` (with MoE layers), in the key style of the published checkpoints."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype '{dtype}' is not supported; use one of {', '.join(_DTYPE_NAMES)}")
    a = model_args
    moe = a.moe if a.moe_layer_ids else None
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if moe is not None else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe is not None else "qwen3",
        "hidden_size": a.dim,
        "intermediate_size": a.ffn_hidden_dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": a.max_seq_len,
        "vocab_size": a.vocab_size,
        "tie_word_embeddings": a.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": a.n_layers,
        "initializer_range": 0.02,
        "use_cache": True,
        # Explicit nulls rather than transformers' defaults, which are not this tokenizer's ids.
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }
    if moe is not None:
        problems = _unsupported_moe(moe)
        if problems:
            raise ValueError("no Hugging Face Qwen3-MoE config for " + "; ".join(problems))
        cfg.update({
            "decoder_sparse_step": a.decoder_sparse_step,
            "mlp_only_layers": list(a.mlp_only_layers),
            "moe_intermediate_size": moe.hidden_dim,
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "norm_topk_prob": moe.route_norm,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        })
    return cfg


def _rope_theta(cfg: dict[str, Any], source: str) -> float:
    """rope_theta from the legacy `rope_theta` / `rope_scaling` keys or the `rope_parameters` dict that
    transformers >= 5 writes; only plain RoPE is supported (Qwen3's long-context YaRN is not)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{source}: rope type '{rope_type}' is not supported (only 'default')")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def args_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> Qwen3ModelArgs:
    """Qwen3ModelArgs equivalent to an HF Qwen3 or Qwen3-MoE `config.json` dict; errors on unsupported features."""
    model_type = cfg.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"{source}: model_type '{model_type}' is not 'qwen3' or 'qwen3_moe'")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act '{cfg['hidden_act']}' is not supported (only 'silu')")
    if cfg.get("attention_bias", False):
        raise ValueError(f"{source}: 'attention_bias' = true is not supported (our Qwen3 has no biases)")
    if cfg.get("use_sliding_window", False):
        raise ValueError(f"{source}: sliding-window attention is not supported")
    dim = int(require(cfg, "hidden_size", source))
    n_heads = int(require(cfg, "num_attention_heads", source))
    moe = None
    if model_type == "qwen3_moe":
        # transformers 5 writes num_local_experts; the published configs say num_experts
        num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
        if num_experts > 0:
            moe = MoEArgs(num_experts=num_experts, top_k=int(require(cfg, "num_experts_per_tok", source)),
                          hidden_dim=int(require(cfg, "moe_intermediate_size", source)),
                          route_norm=bool(cfg.get("norm_topk_prob", False)))
    kv = cfg.get("num_key_value_heads")
    try:
        return Qwen3ModelArgs(
            dim=dim,
            n_layers=int(require(cfg, "num_hidden_layers", source)),
            n_heads=n_heads,
            n_kv_heads=None if kv is None else int(kv),
            head_dim=int(cfg.get("head_dim") or dim // n_heads),
            vocab_size=int(require(cfg, "vocab_size", source)),
            ffn_hidden_dim=int(require(cfg, "intermediate_size", source)),
            norm_eps=float(require(cfg, "rms_norm_eps", source)),
            rope_theta=_rope_theta(cfg, source),
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            moe=moe,
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )
    except ValueError as e:  # inconsistent head counts etc., reported against the file
        raise ValueError(f"{source}: {e}") from e


def check_args_match(expected: Qwen3ModelArgs, found: Qwen3ModelArgs, source: str) -> None:
    """Raise if two configs would give different weight shapes or different numerics.

    Not compared: max_seq_len and init settings (they do not change what the weights mean), MoE balancing
    (load_balance_coeff: the bias starts at zero on import) and the expert kernel choice; the dense hidden size
    only when some layer is dense."""
    fields: list[tuple[str, Any, Any]] = [
        ("dim", expected.dim, found.dim),
        ("n_layers", expected.n_layers, found.n_layers),
        ("n_heads", expected.n_heads, found.n_heads),
        ("n_kv_heads", expected.num_kv_heads, found.num_kv_heads),
        ("head_dim", expected.head_dim, found.head_dim),
        ("vocab_size", expected.vocab_size, found.vocab_size),
        ("tie_word_embeddings", expected.tie_word_embeddings, found.tie_word_embeddings),
        ("moe layers", expected.moe_layer_ids, found.moe_layer_ids),
    ]
    if len(expected.moe_layer_ids) < expected.n_layers:
        fields.append(("ffn_hidden_dim", expected.ffn_hidden_dim, found.ffn_hidden_dim))
    if expected.moe_layer_ids and found.moe is not None and expected.moe is not None:
        for name in ("num_experts", "top_k", "hidden_dim", "route_norm", "num_shared_experts", "score_func",
                     "route_scale", "num_expert_groups"):
            fields.append((f"moe.{name}", getattr(expected.moe, name), getattr(found.moe, name)))
    for name, want, got in fields:
        if want != got:
            raise ValueError(f"{source}: {name}={got} does not match the model config ({want})")
    for name, want_f, got_f in (("norm_eps", expected.norm_eps, found.norm_eps),
                                ("rope_theta", expected.rope_theta, found.rope_theta)):
        if not close(want_f, got_f):
            raise ValueError(f"{source}: {name}={got_f} does not match the model config ({want_f})")
