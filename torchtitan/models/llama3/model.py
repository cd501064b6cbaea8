"""Llama 3 decoder as a plain nn.Module.

Parallelism (tensor/pipeline/data parallel, activation checkpointing, compile) is applied from the
outside by submodule name, so the attribute names below are a contract: `tok_embeddings`, `layers`
("0", "1", ...), `norm`, `output`, and per block `attention_norm`, `attention.{wq,wk,wv,wo}`,
`ffn_norm`, `feed_forward.{w1,w2,w3}`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.decoder import (  # noqa: F401  (RMSNorm, FeedForward, ParamInit: also imported from here)
    CausalAttention,
    Decoder,
    FeedForward,
    ParamInit,
    RMSNorm,
    trunc_normal,
)
from torchtitan.models.decoder import (
    TransformerBlock as _Block,
)
from torchtitan.models.llama3.args import RoPEScaling, TransformerModelArgs

if TYPE_CHECKING:  # annotations only: the models do not depend on the generation package
    from torchtitan.generation.kv_cache import LayerCache

# ---------------------------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------------------------


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: RoPEScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Per-pair rotation frequencies, shape [head_dim // 2], fp32, with optional Llama 3.1 scaling."""
    # fp32 (not fp64) on purpose: it reproduces the reference implementations bit for bit, which
    # matters when checking converted checkpoints against them.
    exponents = torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim
    freqs = 1.0 / (theta**exponents)
    if scaling is None:
        return freqs
    # Llama 3.1 rule: short wavelengths (local position detail) stay as trained, wavelengths longer
    # than the original context are slowed by `factor` so they keep covering the longer context,
    # and the band in between is blended linearly in 1/wavelength so there is no discontinuity.
    orig = scaling.original_max_position_embeddings
    low_freq_wavelen = orig / scaling.low_freq_factor
    high_freq_wavelen = orig / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def precompute_freqs_cis(
    head_dim: int,
    end: int,
    theta: float,
    scaling: RoPEScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Rotary table of shape [end, head_dim // 2, 2]; the last axis holds (cos, sin) of the angle.

    Real cos/sin instead of complex numbers so that dtype casts, `to_empty` and compilers treat
    the buffer like any other float tensor.
    """
    freqs = rope_frequencies(head_dim, theta, scaling, device=device)
    positions = torch.arange(end, device=device, dtype=torch.float32)
    angles = torch.outer(positions, freqs)
    return torch.stack((torch.cos(angles), torch.sin(angles)), dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape [B, S, H, head_dim] by the table rows freqs_cis[:S], or by freqs_cis itself when it holds
    one row per token of each sequence ([B, S, head_dim // 2, 2]: positions that restart in every document).

    Layout: Meta's interleaved-pair convention. Channels (0, 1), (2, 3), ... of each head form the
    (real, imaginary) parts of one complex number, and pair i rotates by position * freq[i].
    Hugging Face checkpoints instead rotate (i, i + head_dim/2) together ("rotate_half"), so the
    checkpoint converter must permute the output rows of wq and wk between the two layouts.
    """
    seq_len = x.shape[1]
    # One complex multiply per pair: measured 6x faster than the same rotation spelled out in real parts
    # (unbind, four multiplies, stack) for forward + backward on CPU, and bit-identical to it.
    # In fp32: with bf16 activations the rotation error would grow with the angle size.
    if freqs_cis.dim() == 4:
        rotation = torch.view_as_complex(freqs_cis.float()).unsqueeze(2)
    else:
        if seq_len > freqs_cis.shape[0]:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {freqs_cis.shape[0]}")
        rotation = torch.view_as_complex(freqs_cis[:seq_len].float()).view(1, seq_len, 1, -1)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


# ---------------------------------------------------------------------------------------------
# Building blocks (the shared ones are in torchtitan/models/decoder.py)
# ---------------------------------------------------------------------------------------------


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache) -> torch.Tensor:
    """Generation's attention: q [B, heads, S, head_dim] over the cached keys and values, extended first by k and v
    [B, kv_heads, S, head_dim] (stored in this layout: each step reads contiguous per-head slices). The cache's mask
    hides left padding (and adds causality where a plain causal flag does not express it)."""
    k, v = cache.update(k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=cache.attn_mask, is_causal=cache.is_causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions."""

    def __init__(self, model_args: TransformerModelArgs) -> None:
        super().__init__()
        self.head_dim = model_args.head_dim
        n_heads, n_kv_heads = model_args.n_heads, model_args.num_kv_heads
        self.wq = nn.Linear(model_args.dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, model_args.dim, bias=False)
        self.sdpa = CausalAttention()

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, document_ids: torch.Tensor | None = None, *,
                cache: LayerCache | None = None) -> torch.Tensor:
        """`cache`: generation's cache of this layer (torchtitan/generation/kv_cache.py): the rotated keys and the
        values of these tokens are added to it, and the queries attend to everything it holds."""
        bsz, seq_len, _ = x.shape
        # Head counts come from the tensors, not the config: under tensor parallelism each rank
        # only holds a slice of the heads, and q and kv heads are sliced in the same proportion.
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        if cache is None:
            out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids)
        else:
            out = cached_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))

    def init_weights(self, out_std: float, param_init: ParamInit) -> None:
        for lin in (self.wq, self.wk, self.wv):
            param_init(lin.weight, trunc_normal(0.02))
        param_init(self.wo.weight, trunc_normal(out_std))


# ---------------------------------------------------------------------------------------------
# Full model
# ---------------------------------------------------------------------------------------------


class TransformerBlock(_Block):
    """Pre-norm residual block: attention then SwiGLU MLP (torchtitan/models/decoder.py)."""

    def __init__(self, layer_id: int, model_args: TransformerModelArgs) -> None:
        super().__init__(layer_id, model_args, Attention(model_args))


class Transformer(Decoder):
    """Llama 3 decoder: tokens [B, S] -> logits [B, S, vocab] (the skeleton, pipeline cutting and init contract are
    torchtitan/models/decoder.py's)."""

    def __init__(self, model_args: TransformerModelArgs) -> None:
        super().__init__(model_args, TransformerBlock)

    def rope_table(self, device: torch.device | None) -> torch.Tensor:
        args = self.model_args
        return precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling, device)

def get_nparams_and_flops(model: nn.Module, model_args: TransformerModelArgs, seq_len: int) -> tuple[int, int]:
    """(unique parameter count, training FLOPs per token). Works on meta and wrapped models.

    FLOPs: 6 per matmul weight per token (2 forward, 4 backward) over every weight except the
    embedding lookup, plus the output projection even when tied (the lookup is free but the
    projection is a real matmul), plus attention's QK^T and AV products: 2 matmuls * 2 FLOPs *
    3 (forward + backward) * n_layers * n_heads * head_dim * seq_len, with no causal discount.
    """
    nparams = sum(p.numel() for p in model.parameters())
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    embedding_ids = {id(w) for w in embeddings}
    n_embedding = sum(w.numel() for w in embeddings)
    n_tied_output = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) in embedding_ids
    )
    matmul_params = nparams - n_embedding + n_tied_output
    attention = 12 * model_args.n_layers * model_args.n_heads * model_args.head_dim * seq_len
    return nparams, 6 * matmul_params + attention
