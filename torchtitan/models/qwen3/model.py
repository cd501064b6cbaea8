"""Qwen3 decoder (dense and mixture-of-experts) as a plain nn.Module.

The module names follow the Llama 3 model (torchtitan/models/llama3/model.py) so that pipeline splitting, context
parallel, activation checkpointing, compile and FSDP, which all work by submodule name, apply unchanged:
`tok_embeddings`, `layers` ("0", "1", ...), `norm`, `output`, and per block `attention_norm`,
`attention.{wq,wk,wv,wo,q_norm,k_norm,sdpa}`, `ffn_norm`, then `feed_forward.{w1,w2,w3}` (dense) or `moe` (a
torchtitan.models.moe.MoE: `router.gate`, `experts.{w1,w2,w3}`).

What differs from Llama 3: an explicit head_dim, RMSNorm over each head of q and k before the rotation (QK-norm),
rotary positions in the "rotate_half" layout of the Hugging Face checkpoints (so conversion is pure renaming),
and optional MoE blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchtitan.models.decoder import CausalAttention, Decoder, ParamInit, RMSNorm, trunc_normal
from torchtitan.models.decoder import TransformerBlock as _Block
from torchtitan.models.llama3.model import cached_attention, precompute_freqs_cis
from torchtitan.models.moe import MoE
from torchtitan.models.qwen3.args import Qwen3ModelArgs

if TYPE_CHECKING:  # annotations only: the models do not depend on the generation package
    from torchtitan.generation.kv_cache import LayerCache


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, head_dim] by the rows freqs_cis[:S] of the table from `precompute_freqs_cis`
    ([max_seq_len, head_dim // 2, 2], last axis (cos, sin)), or by freqs_cis itself when it holds one row per token
    ([B, S, head_dim // 2, 2]: positions that restart in every document).

    Layout: "rotate_half", as in the Qwen3 checkpoints. Channel i of a head pairs with channel i + head_dim / 2 and
    the pair rotates by position * freq[i]. Llama's model rotates interleaved pairs instead; using the checkpoint's
    own layout here means the q/k projection rows need no permutation when converting.
    """
    seq_len = x.shape[1]
    if freqs_cis.dim() == 4:
        table = freqs_cis.float().unsqueeze(2)  # [B, S, 1, head_dim // 2, 2]
    else:
        if seq_len > freqs_cis.shape[0]:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {freqs_cis.shape[0]}")
        table = freqs_cis[:seq_len].float().view(1, seq_len, 1, -1, 2)
    cos, sin = table[..., 0], table[..., 1]
    # In fp32 (as the Llama model does): with bf16 activations the rotation error would grow with the angle.
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with per-head q/k RMSNorm and rotary positions; no biases."""

    def __init__(self, model_args: Qwen3ModelArgs) -> None:
        super().__init__()
        self.head_dim = hd = model_args.head_dim
        n_heads, n_kv_heads, dim = model_args.n_heads, model_args.num_kv_heads, model_args.dim
        self.wq = nn.Linear(dim, n_heads * hd, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(n_heads * hd, dim, bias=False)
        # One weight of head_dim shared by all heads: the norm bounds each head's q.k logits (training stability).
        self.q_norm = RMSNorm(hd, eps=model_args.norm_eps)
        self.k_norm = RMSNorm(hd, eps=model_args.norm_eps)
        self.sdpa = CausalAttention()

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, document_ids: torch.Tensor | None = None, *,
                cache: LayerCache | None = None) -> torch.Tensor:
        """`cache`: generation's cache of this layer, as in the Llama model (rotated, normed keys and values)."""
        bsz, seq_len, _ = x.shape
        # Head counts come from the tensors, not the config, as in the Llama model (a tensor-parallel rank holds a
        # slice of the heads).
        q = self.q_norm(self.wq(x).view(bsz, seq_len, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seq_len, -1, self.head_dim))
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
        self.q_norm.init_weights(param_init)
        self.k_norm.init_weights(param_init)


class TransformerBlock(_Block):
    """Pre-norm residual block: Attention, then the dense SwiGLU MLP or a mixture of experts
    (torchtitan/models/decoder.py)."""

    def __init__(self, layer_id: int, model_args: Qwen3ModelArgs) -> None:
        super().__init__(layer_id, model_args, Attention(model_args))


class Qwen3Transformer(Decoder):
    """Qwen3 decoder: tokens [B, S] -> logits [B, S, vocab] (the skeleton, pipeline cutting and init contract are
    torchtitan/models/decoder.py's)."""

    def __init__(self, model_args: Qwen3ModelArgs) -> None:
        super().__init__(model_args, TransformerBlock)

    def rope_table(self, device: torch.device | None) -> torch.Tensor:
        # The same (cos, sin) table as Llama's without frequency scaling: only the channel pairing differs, and
        # that lives in apply_rotary_emb.
        args = self.model_args
        return precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta, None, device)


# ---------------------------------------------------------------------------------------------
# Parameter and FLOP counts
# ---------------------------------------------------------------------------------------------


def _numel(p: torch.Tensor) -> int:
    return p.numel()  # a DTensor (FSDP/TP) reports its global size, so wrapped models count like plain ones


def get_active_nparams(model: nn.Module) -> int:
    """Parameters one token goes through: every parameter, except that each MoE layer's routed experts count
    top_k / num_experts of their size (the router gate and shared experts count in full)."""
    total = sum(_numel(p) for p in model.parameters())
    for m in model.modules():
        if isinstance(m, MoE):
            routed = sum(_numel(p) for p in m.experts.parameters())
            total -= routed - routed * m.args.top_k // m.args.num_experts
    return total


def get_nparams_and_flops(model: nn.Module, model_args: Qwen3ModelArgs, seq_len: int) -> tuple[int, int]:
    """(unique parameter count, training FLOPs per token). Works on meta and wrapped models.

    FLOPs: 6 per matmul weight a token goes through (2 forward, 4 backward), i.e. over the ACTIVE parameters
    (`get_active_nparams`) except the embedding lookup, plus the output projection even when tied, plus attention's
    QK^T and AV products: 2 matmuls * 2 FLOPs * 3 (forward + backward) * n_layers * n_heads * head_dim * seq_len,
    with no causal discount (the Llama model's convention, so MFU numbers compare across families).
    """
    nparams = sum(_numel(p) for p in model.parameters())
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    embedding_ids = {id(w) for w in embeddings}
    n_embedding = sum(_numel(w) for w in embeddings)
    n_tied_output = sum(_numel(m.weight) for m in model.modules()
                        if isinstance(m, nn.Linear) and id(m.weight) in embedding_ids)
    matmul_params = get_active_nparams(model) - n_embedding + n_tied_output
    a = model_args
    attention = 12 * a.n_layers * a.n_heads * a.head_dim * seq_len
    return nparams, 6 * matmul_params + attention

