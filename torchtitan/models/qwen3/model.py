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

import math
from collections.abc import Callable

import torch
from torch import nn

from torchtitan.models.llama3.model import CausalAttention, FeedForward, ParamInit, RMSNorm, precompute_freqs_cis
from torchtitan.models.moe import MoE
from torchtitan.models.qwen3.args import Qwen3ModelArgs


def _default_param_init(param: torch.Tensor, fill: Callable[[torch.Tensor], object]) -> None:
    fill(param)


def _trunc_normal(std: float) -> Callable[[torch.Tensor], object]:
    # Cut at +-3 std so that no single weight starts as an outlier (the Llama model's rule).
    return lambda t: nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std)


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

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, document_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        # Head counts come from the tensors, not the config, as in the Llama model (a tensor-parallel rank holds a
        # slice of the heads).
        q = self.q_norm(self.wq(x).view(bsz, seq_len, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seq_len, -1, self.head_dim))
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))

    def init_weights(self, out_std: float, param_init: ParamInit) -> None:
        for lin in (self.wq, self.wk, self.wv):
            param_init(lin.weight, _trunc_normal(0.02))
        param_init(self.wo.weight, _trunc_normal(out_std))
        self.q_norm.init_weights(param_init)
        self.k_norm.init_weights(param_init)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then the dense SwiGLU MLP (`feed_forward`) or a mixture of experts
    (`moe`); exactly one of the two exists."""

    def __init__(self, layer_id: int, model_args: Qwen3ModelArgs) -> None:
        super().__init__()
        # Kept on the block (not derived from its key in `layers`) so a pipeline stage holding only some of the
        # layers still initialises each one as the full model would.
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.attention = Attention(model_args)
        self.ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.moe_enabled = model_args.is_moe_layer(layer_id)
        self.feed_forward: FeedForward | None = None
        self.moe: MoE | None = None
        if self.moe_enabled:
            assert model_args.moe is not None  # is_moe_layer checked it
            self.moe = MoE(model_args.dim, model_args.moe)
        else:
            self.feed_forward = FeedForward(model_args.dim, model_args.ffn_hidden_dim)
        # Residual-branch outputs add up over the depth; shrinking their init keeps the residual stream's variance
        # from growing with the number of layers.
        depth = (layer_id + 1) if model_args.depth_init else model_args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, document_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, document_ids)
        mlp = self.moe if self.moe is not None else self.feed_forward
        return h + mlp(self.ffn_norm(h))

    def init_weights(self, param_init: ParamInit) -> None:
        self.attention_norm.init_weights(param_init)
        self.attention.init_weights(self.weight_init_std, param_init)
        self.ffn_norm.init_weights(param_init)
        if self.moe is not None:
            self.moe.init_weights(self.weight_init_std, param_init)
        else:
            self.feed_forward.init_weights(self.weight_init_std, param_init)


class Qwen3Transformer(nn.Module):
    """Qwen3 decoder: tokens [B, S] -> logits [B, S, vocab].

    Pipeline stages are cut as for the Llama model: set `tok_embeddings`, `norm` or `output` to None and delete
    entries of `layers`; a stage without embeddings takes hidden states [B, S, dim] and one without output returns
    hidden states.
    """

    def __init__(self, model_args: Qwen3ModelArgs) -> None:
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, model_args) for i in range(model_args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        if model_args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: a pure function of the config. On the meta device it has no values; init_weights fills it.
        self.register_buffer("freqs_cis", self._compute_freqs_cis(None), persistent=False)

    def _compute_freqs_cis(self, device: torch.device | None) -> torch.Tensor:
        # The same (cos, sin) table as Llama's without frequency scaling: only the channel pairing differs, and
        # that lives in apply_rotary_emb.
        args = self.model_args
        return precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta, None, device)

    def _default_buffer_device(self) -> torch.device:
        if self.tok_embeddings is not None:
            return self.tok_embeddings.weight.device
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _restore_tie(self) -> None:
        # Module.to_empty() materialises each module's parameters separately, which silently turns a shared weight
        # into two (unless swap_module_params_on_conversion is enabled).
        emb, out = self.tok_embeddings, self.output
        if self.model_args.tie_word_embeddings and emb is not None and out is not None and out.weight is not emb.weight:
            out.weight = emb.weight

    def init_weights(self, buffer_device: torch.device | None = None, param_init: ParamInit | None = None) -> None:
        """Fill every parameter exactly once, in registration order, and rebuild `freqs_cis` (and zero the MoE
        balancing buffers).

        Order: tok_embeddings, then each block (attention_norm, wq, wk, wv, wo, q_norm, k_norm, ffn_norm, then
        w1, w2, w3 or router.gate, experts.w1, w2, w3), then norm, then output (skipped when tied). This equals
        the order of `self.parameters()`, so a seeded, order-dependent param_init is reproducible.
        """
        fill = param_init if param_init is not None else _default_param_init
        device = buffer_device if buffer_device is not None else self._default_buffer_device()
        dim = self.model_args.dim
        with torch.no_grad():
            self.freqs_cis = self._compute_freqs_cis(device)
            self._restore_tie()
            tied = (self.output is not None and self.tok_embeddings is not None
                    and self.output.weight is self.tok_embeddings.weight)
            if self.tok_embeddings is not None:
                # As in the Llama model: std 1.0 untied (the embedding feeds an RMSNorm straight away); tied, the
                # matrix is also the output projection, where std 1.0 would give initial logits of std ~sqrt(dim).
                if tied:
                    fill(self.tok_embeddings.weight, _trunc_normal(dim**-0.5))
                else:
                    fill(self.tok_embeddings.weight, lambda t: nn.init.normal_(t, mean=0.0, std=1.0))
            for layer in self.layers.values():
                layer.init_weights(fill)
            if self.norm is not None:
                self.norm.init_weights(fill)
            if self.output is not None and not tied:
                # std dim**-0.5 makes initial logits roughly unit variance given a unit-RMS input.
                fill(self.output.weight, _trunc_normal(dim**-0.5))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`tokens` [batch, seq] (or a pipeline stage's hidden states).
        `positions`: the tokens' rotary positions when they are not 0 .. seq - 1: [seq] (context parallel) or
        [batch, seq] (document masking restarts them in every document).
        `document_ids` [batch, seq]: attention stays within each document; under context parallel the whole
        sequence's ids."""
        # The whole table goes to the blocks, which take the rows they need from the sequence length inside
        # attention (a pipeline stage's input may be sharded on the sequence).
        if tokens.dim() == 2 and tokens.shape[1] > self.freqs_cis.shape[0]:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.freqs_cis.shape[0]}")
        rope = self.freqs_cis if positions is None else self.freqs_cis[positions]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, rope, document_ids)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


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


def _block_active_matmul_params(a: Qwen3ModelArgs, layer_id: int) -> int:
    attention = 2 * a.dim * a.n_heads * a.head_dim + 2 * a.dim * a.num_kv_heads * a.head_dim
    if not a.is_moe_layer(layer_id):
        return attention + 3 * a.dim * a.ffn_hidden_dim
    moe = a.moe
    expert = 3 * a.dim * moe.hidden_dim
    return attention + a.dim * moe.num_experts + expert * (moe.top_k + moe.num_shared_experts)


def get_pipeline_unit_flops(model_args: Qwen3ModelArgs, seq_len: int) -> tuple[float, float, float]:
    """Training FLOPs per token of (the embedding, one block, the final norm + output), counted as in
    `get_nparams_and_flops`; the automatic pipeline split balances stages by these. The block is the average over
    all blocks (dense and MoE blocks may differ); norms are left out next to the matmuls."""
    a = model_args
    per_block = [_block_active_matmul_params(a, i) for i in range(a.n_layers)]
    block = 6 * sum(per_block) / max(len(per_block), 1) + 12 * a.n_heads * a.head_dim * seq_len
    return 0.0, float(block), float(6 * a.dim * a.vocab_size)
