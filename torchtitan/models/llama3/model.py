"""Llama 3 decoder as a plain nn.Module.

Parallelism (tensor/pipeline/data parallel, activation checkpointing, compile) is applied from the
outside by submodule name, so the attribute names below are a contract: `tok_embeddings`, `layers`
("0", "1", ...), `norm`, `output`, and per block `attention_norm`, `attention.{wq,wk,wv,wo}`,
`ffn_norm`, `feed_forward.{w1,w2,w3}`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.attention import document_causal_mask
from torchtitan.models.llama3.args import RoPEScaling, TransformerModelArgs

ParamInit = Callable[[torch.Tensor, Callable[[torch.Tensor], object]], None]
"""(parameter, fill_fn) -> None. The caller decides how fill_fn reaches the parameter's storage."""


def _default_param_init(param: torch.Tensor, fill: Callable[[torch.Tensor], object]) -> None:
    fill(param)


def _trunc_normal(std: float) -> Callable[[torch.Tensor], object]:
    # Cut at +-3 std so that no single weight starts as an outlier.
    return lambda t: nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std)


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
# Building blocks
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm, always computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm accumulates the mean of squares in fp32 for bf16 inputs and has fused kernels
        # (CPU and CUDA) when input and weight share a dtype. Under autocast the weight stays fp32 while x is
        # bf16: normalise in fp32 then, as the fused kernel would, rather than fall back to its slow path.
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)

    def init_weights(self, param_init: ParamInit) -> None:
        param_init(self.weight, nn.init.ones_)


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v over [batch, heads, seq, head_dim], causal, and within each document when
    `document_ids` ([batch, seq]) is given. Its own module so that context parallel can replace it by attention over
    the whole (sharded) sequence (torchtitan/distributed/context_parallel.py)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        # Grouped-query heads go to SDPA as they are (query head h reads kv head h // (q heads / kv heads)):
        # no expanded copies of K and V in memory, and the flash kernels take the grouping natively.
        gqa = q.shape[1] != k.shape[1]
        if document_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        # An explicit mask (flex attention has no CPU backward): SDPA keeps a float copy of it, batch x seq^2
        # elements per layer, for the backward (docs/parallelism.md, document masking).
        mask = document_causal_mask(document_ids, document_ids)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


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

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, document_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        # Head counts come from the tensors, not the config: under tensor parallelism each rank
        # only holds a slice of the heads, and q and kv heads are sliced in the same proportion.
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))

    def init_weights(self, out_std: float, param_init: ParamInit) -> None:
        for lin in (self.wq, self.wk, self.wv):
            param_init(lin.weight, _trunc_normal(0.02))
        param_init(self.wo.weight, _trunc_normal(out_std))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float, param_init: ParamInit) -> None:
        param_init(self.w1.weight, _trunc_normal(0.02))
        param_init(self.w2.weight, _trunc_normal(out_std))
        param_init(self.w3.weight, _trunc_normal(out_std))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then SwiGLU MLP."""

    def __init__(self, layer_id: int, model_args: TransformerModelArgs) -> None:
        super().__init__()
        # Kept on the block (not derived from its key in `layers`) so a pipeline stage holding
        # only some of the layers still initialises each one as the full model would.
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.attention = Attention(model_args)
        self.ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.feed_forward = FeedForward(model_args.dim, model_args.ffn_hidden_dim)
        # Residual-branch outputs add up over the depth; shrinking their init keeps the residual
        # stream's variance from growing with the number of layers.
        depth = (layer_id + 1) if model_args.depth_init else model_args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, document_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, document_ids)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, param_init: ParamInit) -> None:
        self.attention_norm.init_weights(param_init)
        self.attention.init_weights(self.weight_init_std, param_init)
        self.ffn_norm.init_weights(param_init)
        self.feed_forward.init_weights(self.weight_init_std, param_init)


# ---------------------------------------------------------------------------------------------
# Full model
# ---------------------------------------------------------------------------------------------


class Transformer(nn.Module):
    """Llama 3 decoder: tokens [B, S] -> logits [B, S, vocab].

    Pipeline stages are cut by setting `tok_embeddings`, `norm` or `output` to None and deleting
    entries of `layers`; a stage without embeddings takes hidden states [B, S, dim] as input and a
    stage without output returns hidden states.
    """

    def __init__(self, model_args: TransformerModelArgs) -> None:
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, model_args) for i in range(model_args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        if model_args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: it is a pure function of the config, so checkpoints need not carry it.
        # On the meta device this has no values; init_weights fills it in.
        self.register_buffer("freqs_cis", self._compute_freqs_cis(None), persistent=False)

    def _compute_freqs_cis(self, device: torch.device | None) -> torch.Tensor:
        args = self.model_args
        return precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling, device)

    def _default_buffer_device(self) -> torch.device:
        if self.tok_embeddings is not None:
            return self.tok_embeddings.weight.device
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _restore_tie(self) -> None:
        # Module.to_empty() materialises each module's parameters separately, which silently
        # turns a shared weight into two (unless swap_module_params_on_conversion is enabled).
        emb, out = self.tok_embeddings, self.output
        if self.model_args.tie_word_embeddings and emb is not None and out is not None and out.weight is not emb.weight:
            out.weight = emb.weight

    def init_weights(
        self,
        buffer_device: torch.device | None = None,
        param_init: ParamInit | None = None,
    ) -> None:
        """Fill every parameter exactly once, in registration order, and rebuild `freqs_cis`.

        Order: tok_embeddings, then each block (attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2,
        w3), then norm, then output (skipped when it is the tied embedding). This equals the order
        of `self.parameters()`, so a seeded, order-dependent param_init is reproducible.
        """
        fill = param_init if param_init is not None else _default_param_init
        device = buffer_device if buffer_device is not None else self._default_buffer_device()
        with torch.no_grad():
            self.freqs_cis = self._compute_freqs_cis(device)
            self._restore_tie()
            tied = (
                self.output is not None
                and self.tok_embeddings is not None
                and (self.output.weight is self.tok_embeddings.weight)
            )
            if self.tok_embeddings is not None:
                # Untied: std 1.0 like the Llama references. The embedding feeds an RMSNorm
                # straight away, so its scale only sets how strongly token identity dominates the
                # early residual stream relative to the small (std 0.02) block outputs.
                # Tied: the matrix is also the output projection, where std 1.0 would give initial
                # logits of std ~sqrt(dim); use the output rule instead.
                if tied:
                    fill(self.tok_embeddings.weight, _trunc_normal(self.model_args.dim**-0.5))
                else:
                    fill(self.tok_embeddings.weight, lambda t: nn.init.normal_(t, mean=0.0, std=1.0))
            for layer in self.layers.values():
                layer.init_weights(fill)
            if self.norm is not None:
                self.norm.init_weights(fill)
            if self.output is not None and not tied:
                # std dim**-0.5 makes initial logits roughly unit variance given a unit-RMS input.
                fill(self.output.weight, _trunc_normal(self.model_args.dim**-0.5))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`tokens` [batch, seq] (or a pipeline stage's hidden states).
        `positions`: the tokens' rotary positions when they are not 0 .. seq - 1: [seq] (context parallel holds two
        chunks of each sequence) or [batch, seq] (document masking restarts them in every document).
        `document_ids` [batch, seq]: attention stays within each document (packed sequences); under context
        parallel the whole sequence's ids, since its attention reads every rank's keys."""
        # The whole rotary table goes to the blocks, which take the rows they need from the sequence length inside
        # attention: a pipeline stage's input may be a sequence-sharded activation (tensor parallel), whose
        # length is not the sequence's.
        if tokens.dim() == 2 and tokens.shape[1] > self.freqs_cis.shape[0]:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.freqs_cis.shape[0]}")
        rope = self.freqs_cis if positions is None else self.freqs_cis[positions]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, rope, document_ids)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


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


def get_pipeline_unit_flops(model_args: TransformerModelArgs, seq_len: int) -> tuple[float, float, float]:
    """Training FLOPs per token of (the embedding, one block, the final norm + output), counted as in
    `get_nparams_and_flops`: the automatic pipeline split balances stages by these. The lookup counts as free (its
    backward is a scatter-add); the norms' elementwise work is left out next to the matmuls."""
    a = model_args
    attention_weights = 2 * a.dim * a.n_heads * a.head_dim + 2 * a.dim * a.num_kv_heads * a.head_dim
    block = 6 * (attention_weights + 3 * a.dim * a.ffn_hidden_dim) + 12 * a.n_heads * a.head_dim * seq_len
    return 0.0, float(block), float(6 * a.dim * a.vocab_size)
