"""Conversion between our Llama 3 state dict and the Hugging Face `LlamaForCausalLM` layout.

Two things differ between the layouts:

* key names (`layers.3.attention.wq.weight` vs `model.layers.3.self_attn.q_proj.weight`, ...);
* the order of the output rows of wq and wk inside each head. Our RoPE rotates interleaved channel
  pairs (0, 1), (2, 3), ... of a head; HF's "rotate_half" rotates (j, j + head_dim/2). Permuting
  the rows of wq/wk (once, at conversion) makes q and k come out in the other convention, and since
  attention scores only depend on q.k summed over all channels of a head, the output is unchanged.

Everything else (embeddings, norms, MLP, wv, wo) is copied as is: wv/wo never go through RoPE.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from torchtitan.models.hf_common import RowLink, check_state_dict, close, require, same_tensor
from torchtitan.models.llama3.args import RoPEScaling, TransformerModelArgs

_DTYPE_NAMES = ("float32", "bfloat16")

# Per-block renames, ours -> HF (without the "layers.{i}." / "model.layers.{i}." prefix).
_LAYER_KEYS: dict[str, str] = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # SwiGLU: w2(silu(w1 x) * w3 x); HF calls the silu branch "gate" and the linear one "up".
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_TOP_KEYS: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _permute_to_hf(w: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """Rows (h, pair i, re/im) -> (h, re/im, pair i): interleaved pairs become the two halves."""
    return w.reshape(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _permute_from_hf(w: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """Exact inverse of `_permute_to_hf`: rows (h, half, i) -> (h, i, half)."""
    return w.reshape(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


class Llama3StateDictAdapter:
    """Renames and permutes full (unsharded) Llama 3 state dicts to and from the HF layout."""

    def __init__(self, model_args: TransformerModelArgs) -> None:
        self.model_args = model_args
        a = model_args
        d, hd, n_q, n_kv = a.dim, a.head_dim, a.n_heads, a.num_kv_heads
        # Our key -> expected shape. Shapes are identical on both sides (the permutation keeps them).
        self.shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (a.vocab_size, d)}
        per_layer = {
            "attention.wq.weight": (n_q * hd, d),
            "attention.wk.weight": (n_kv * hd, d),
            "attention.wv.weight": (n_kv * hd, d),
            "attention.wo.weight": (d, n_q * hd),
            "attention_norm.weight": (d,),
            "ffn_norm.weight": (d,),
            "feed_forward.w1.weight": (a.ffn_hidden_dim, d),
            "feed_forward.w2.weight": (d, a.ffn_hidden_dim),
            "feed_forward.w3.weight": (a.ffn_hidden_dim, d),
        }
        self.to_hf_keys: dict[str, str] = {"tok_embeddings.weight": _TOP_KEYS["tok_embeddings.weight"]}
        for i in range(a.n_layers):
            for ours, hf in _LAYER_KEYS.items():
                self.shapes[f"layers.{i}.{ours}"] = per_layer[ours]
                self.to_hf_keys[f"layers.{i}.{ours}"] = f"model.layers.{i}.{hf}"
        self.shapes["norm.weight"] = (d,)
        self.to_hf_keys["norm.weight"] = _TOP_KEYS["norm.weight"]
        self.shapes["output.weight"] = (a.vocab_size, d)
        self.to_hf_keys["output.weight"] = _TOP_KEYS["output.weight"]
        self.from_hf_keys: dict[str, str] = {hf: ours for ours, hf in self.to_hf_keys.items()}

    # -- helpers ---------------------------------------------------------------------------------

    def _rope_heads(self, our_key: str) -> int | None:
        """Head count to permute with for wq (n_heads) / wk (n_kv_heads, GQA); None for other keys."""
        if our_key.endswith("attention.wq.weight"):
            return self.model_args.n_heads
        if our_key.endswith("attention.wk.weight"):
            return self.model_args.num_kv_heads
        return None

    def _check(self, side: str, got: dict[str, Any], expected: dict[str, str], optional: set[str]) -> None:
        """Raise on the first missing/unexpected key or wrong shape; `expected` maps key -> our key."""
        check_state_dict(side, got, {key: self.shapes[ours] for key, ours in expected.items()}, optional)

    # -- conversion ------------------------------------------------------------------------------

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Our full state dict -> HF `LlamaForCausalLM` state dict (no copies except wq/wk)."""
        tied = self.model_args.tie_word_embeddings
        # A tied model's own state_dict() carries output.weight as an alias; a hand-built one may not.
        self._check("our", state_dict, {k: k for k in self.to_hf_keys}, {"output.weight"} if tied else set())
        if tied and "output.weight" in state_dict:
            if not same_tensor(state_dict["output.weight"], state_dict["tok_embeddings.weight"]):
                raise ValueError(
                    "our state dict: 'output.weight' differs from 'tok_embeddings.weight' but "
                    "tie_word_embeddings=True; the HF checkpoint would silently drop it"
                )
        hd = self.model_args.head_dim
        out: dict[str, Tensor] = {}
        for ours, hf in self.to_hf_keys.items():
            if tied and ours == "output.weight":
                continue  # HF ties lm_head to embed_tokens itself when tie_word_embeddings is set
            w = state_dict[ours]
            heads = self._rope_heads(ours)
            out[hf] = w if heads is None else _permute_to_hf(w, heads, hd)
        return out

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """HF `LlamaForCausalLM` state dict -> ours; the exact inverse of `to_hf`.

        Tied models get `output.weight` as the same tensor as `tok_embeddings.weight`, matching what
        `Transformer.state_dict()` returns, so `load_state_dict(strict=True)` accepts it.
        """
        tied = self.model_args.tie_word_embeddings
        if not tied and "lm_head.weight" not in hf_state_dict:
            raise KeyError("HF state dict: missing key 'lm_head.weight' (config has tie_word_embeddings=false)")
        self._check("HF", hf_state_dict, self.from_hf_keys, {"lm_head.weight"} if tied else set())
        if tied and "lm_head.weight" in hf_state_dict:
            # Some tied checkpoints store lm_head anyway; accept it only if it really is the embedding.
            if not same_tensor(hf_state_dict["lm_head.weight"], hf_state_dict["model.embed_tokens.weight"]):
                raise ValueError(
                    "HF state dict: 'lm_head.weight' differs from 'model.embed_tokens.weight' but "
                    "tie_word_embeddings=true"
                )
        hd = self.model_args.head_dim
        out: dict[str, Tensor] = {}
        for hf, ours in self.from_hf_keys.items():
            if tied and ours == "output.weight":
                continue
            w = hf_state_dict[hf]
            heads = self._rope_heads(ours)
            out[ours] = w if heads is None else _permute_from_hf(w, heads, hd)
        if tied:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    def row_links(self, hf_keys: set[str] | None = None) -> list[RowLink]:
        """Which rows of which HF tensor each of our tensors is (for export and import by shard): renames, and wq/wk
        rows in `_permute_to_hf`'s order, found by permuting the row numbers themselves. One layout on disk, so
        `hf_keys` (the keys a checkpoint holds) changes nothing."""
        tied, hd = self.model_args.tie_word_embeddings, self.model_args.head_dim
        links = []
        for ours, hf in self.to_hf_keys.items():
            if tied and ours == "output.weight":
                continue
            heads = self._rope_heads(ours)
            rows = None if heads is None else \
                _permute_to_hf(torch.arange(self.shapes[ours][0])[:, None], heads, hd)[:, 0]
            links.append(RowLink(hf, ours, our_rows=rows))
        return links

    # -- config.json: the module functions below, on the class so model-independent code (hf_io) needs only
    # the adapter class from the model registry. The module functions stay for existing callers.

    @staticmethod
    def hf_config(
        model_args: TransformerModelArgs, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None
    ) -> dict[str, Any]:
        return hf_config(model_args, dtype, bos_id=bos_id, eos_id=eos_id)

    @staticmethod
    def args_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> TransformerModelArgs:
        return args_from_hf_config(cfg, source)

    @staticmethod
    def check_args_match(expected: TransformerModelArgs, found: TransformerModelArgs, source: str) -> None:
        check_args_match(expected, found, source)


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def hf_config(
    model_args: TransformerModelArgs,
    dtype: str = "float32",
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> dict[str, Any]:
    """The `config.json` contents that transformers' `LlamaConfig` reads for this model."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype '{dtype}' is not supported; use one of {', '.join(_DTYPE_NAMES)}")
    a = model_args
    rope_scaling: dict[str, Any] | None = None
    max_pos = a.max_seq_len
    if a.rope_scaling is not None:
        s = a.rope_scaling
        # Our model applies the scaling to its frequencies at every length (model.py, rope_frequencies), and so does
        # transformers' "llama3" rope, which reads only these fields: exported as is, the logits stay ours.
        # max_position_embeddings is then the context the scaling stretches to (factor x original, as DeepSeek's
        # YaRN export does), never below what we trained: transformers warns on every load when it is not above
        # original_max_position_embeddings (e.g. 256 against 8192 for a short-sequence run). The llama3 frequencies
        # do not depend on it, so the numerics do not change.
        max_pos = max(a.max_seq_len, math.ceil(s.factor * s.original_max_position_embeddings),
                      s.original_max_position_embeddings + 1)
        rope_scaling = {
            "rope_type": "llama3",
            "factor": float(s.factor),
            "low_freq_factor": float(s.low_freq_factor),
            "high_freq_factor": float(s.high_freq_factor),
            "original_max_position_embeddings": int(s.original_max_position_embeddings),
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": a.dim,
        "intermediate_size": a.ffn_hidden_dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": max_pos,
        "vocab_size": a.vocab_size,
        "tie_word_embeddings": a.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        # Explicit nulls: LlamaConfig would otherwise default to the Llama 2 ids 1 and 2.
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }


def _ffn_params(dim: int, intermediate_size: int, source: str) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) whose `ffn_hidden_dim` rounding gives intermediate_size."""
    # Prefer the published-style values so imported args read naturally; fall back to a pair that
    # reproduces any size exactly (one rounding step of the full size, multiplier ~ size / base).
    candidates: list[tuple[int, float | None]] = [(256, None), (1024, None)]
    base = int(2 * 4 * dim / 3)
    for multiple_of in (256, 1024, 4096):
        for mult in (1.0, 1.2, 1.3, 1.5):
            candidates.append((multiple_of, mult))
    candidates.append((intermediate_size, intermediate_size / base))
    for multiple_of, mult in candidates:
        hidden = base if mult is None else int(mult * base)
        if multiple_of * ((hidden + multiple_of - 1) // multiple_of) == intermediate_size:
            return multiple_of, mult
    raise ValueError(f"{source}: cannot express intermediate_size={intermediate_size} for hidden_size={dim}")


def _rope_from_cfg(cfg: dict[str, Any], source: str) -> tuple[float, RoPEScaling | None]:
    """(rope_theta, scaling) from either the legacy `rope_scaling` + `rope_theta` keys or the
    `rope_parameters` dict that transformers >= 5 writes."""
    params = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = legacy or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"{source}: rope type '{rope_type}' is not supported (only 'default' and 'llama3')")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise KeyError(f"{source}: rope scaling is missing key '{key}'")
    return float(theta), RoPEScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def args_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> TransformerModelArgs:
    """TransformerModelArgs equivalent to an HF Llama `config.json` dict; errors on unsupported features."""
    model_type = cfg.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"{source}: model_type '{model_type}' is not 'llama'")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act '{act}' is not supported (only 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key, False):
            raise ValueError(f"{source}: '{key}' = true is not supported (our Llama has no biases)")
    dim = int(require(cfg, "hidden_size", source))
    n_heads = int(require(cfg, "num_attention_heads", source))
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) * n_heads != dim:
        raise ValueError(f"{source}: head_dim={head_dim} != hidden_size / num_attention_heads ({dim}/{n_heads})")
    intermediate = int(require(cfg, "intermediate_size", source))
    multiple_of, ffn_mult = _ffn_params(dim, intermediate, source)
    theta, scaling = _rope_from_cfg(cfg, source)
    kv = cfg.get("num_key_value_heads")
    try:
        args = TransformerModelArgs(
            dim=dim,
            n_layers=int(require(cfg, "num_hidden_layers", source)),
            n_heads=n_heads,
            n_kv_heads=None if kv is None else int(kv),
            vocab_size=int(require(cfg, "vocab_size", source)),
            multiple_of=multiple_of,
            ffn_dim_multiplier=ffn_mult,
            norm_eps=float(require(cfg, "rms_norm_eps", source)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except ValueError as e:  # inconsistent head counts etc., reported against the file
        raise ValueError(f"{source}: {e}") from e
    if args.ffn_hidden_dim != intermediate:  # guards the _ffn_params search, never expected to fire
        raise ValueError(f"{source}: intermediate_size={intermediate} maps to ffn_hidden_dim={args.ffn_hidden_dim}")
    return args


def check_args_match(expected: TransformerModelArgs, found: TransformerModelArgs, source: str) -> None:
    """Raise if two configs would give different weight shapes or different numerics.

    max_seq_len and init settings are not compared: they do not change what the weights mean.
    """
    fields: list[tuple[str, Any, Any]] = [
        ("dim", expected.dim, found.dim),
        ("n_layers", expected.n_layers, found.n_layers),
        ("n_heads", expected.n_heads, found.n_heads),
        ("n_kv_heads", expected.num_kv_heads, found.num_kv_heads),
        ("vocab_size", expected.vocab_size, found.vocab_size),
        ("ffn_hidden_dim", expected.ffn_hidden_dim, found.ffn_hidden_dim),
        ("tie_word_embeddings", expected.tie_word_embeddings, found.tie_word_embeddings),
    ]
    for name, want, got in fields:
        if want != got:
            raise ValueError(f"{source}: {name}={got} does not match the model config ({want})")
    for name, want_f, got_f in (
        ("norm_eps", expected.norm_eps, found.norm_eps),
        ("rope_theta", expected.rope_theta, found.rope_theta),
    ):
        if not close(want_f, got_f):
            raise ValueError(f"{source}: {name}={got_f} does not match the model config ({want_f})")
    want_s, got_s = expected.rope_scaling, found.rope_scaling
    if (want_s is None) != (got_s is None) or (
        want_s is not None
        and got_s is not None
        and not (
            close(want_s.factor, got_s.factor)
            and close(want_s.low_freq_factor, got_s.low_freq_factor)
            and close(want_s.high_freq_factor, got_s.high_freq_factor)
            and want_s.original_max_position_embeddings == got_s.original_max_position_embeddings
        )
    ):
        raise ValueError(f"{source}: rope_scaling={got_s} does not match the model config ({want_s})")
