"""DeepSeek-V3 decoder (multi-head latent attention, dense then mixture-of-experts blocks) as a plain nn.Module.

The top-level names follow the Llama 3 model (torchtitan/models/llama3/model.py) so that pipeline splitting, context
parallel, activation checkpointing, compile and FSDP, which all work by submodule name, apply unchanged:
`tok_embeddings`, `layers` ("0", "1", ...), `norm`, `output`; per block `attention_norm`, `attention` (whose `sdpa`
is the replaceable attention core), `ffn_norm`, then `feed_forward.{w1,w2,w3}` (the first n_dense_layers blocks) or
`moe` (torchtitan.models.moe.MoE: `router.gate`, `experts.{w1,w2,w3}`, `shared_experts.{w1,w2,w3}`, `expert_bias`).

Multi-head latent attention (`attention`):
    q  = wq(x)  or  wq_b(q_norm(wq_a(x)))                          [heads x (qk_nope + qk_rope)]
    wkv_a(x) = (latent [kv_lora_rank], k_pe [qk_rope])             k_pe: one rotary key shared by every head
    wkv_b(kv_norm(latent)) = per head (k_nope [qk_nope], v [v_head_dim])
    k = (k_nope, rotate(k_pe)), q = (q_nope, rotate(q_pe)); softmax(q k^T * softmax_scale) v -> wo
`kv_handoff` (parameterless, returns its inputs) passes (kv_norm(latent), k_pe) on to the per-head part: where
tensor parallel gathers both over the sequence (torchtitan/models/deepseek_v3/parallelize.py).
Rotary positions pair channels (2i, 2i + 1) of the rope part (Llama's interleaved layout): transformers'
DeepseekV3Attention with rope_interleave=true (its default and the published checkpoints') rotates the same pairs
and only stores the result de-interleaved, which q.k does not see; so conversion is pure renaming.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.decoder import CausalAttention, Decoder, ParamInit, RMSNorm, trunc_normal
from torchtitan.models.decoder import TransformerBlock as _Block
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs, attention_flops, yarn_mscale
from torchtitan.models.llama3.model import apply_rotary_emb
from torchtitan.models.qwen3.model import get_active_nparams

if TYPE_CHECKING:  # annotations only: the models do not depend on the generation package
    from torchtitan.generation.kv_cache import LayerCache

LATENT_NORM_EPS = 1e-6
"""Epsilon of q_norm and kv_norm: fixed in the reference and in transformers, whatever rms_norm_eps is."""


# ---------------------------------------------------------------------------------------------
# Rotary table (plain or YaRN), in the (cos, sin) format of llama3's apply_rotary_emb
# ---------------------------------------------------------------------------------------------


def rope_frequencies(args: DeepSeekV3ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies [qk_rope_head_dim // 2] in fp32, computed as transformers does (fp32 powers,
    the same operation order) so that the tables agree to the last bit."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    s = args.rope_scaling
    if s is None:
        return 1.0 / pos_freqs

    # YaRN: pair i makes original_max / (2 pi / freq_i) rotations over the original context. Pairs with more than
    # beta_fast rotations keep their frequency, pairs with fewer than beta_slow are slowed by `factor`, and a linear
    # ramp over the pair index (its ends rounded outwards, as transformers' default truncate=True) blends between.
    def pair_index(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_index(s.beta_fast)), 0)
    high = min(math.ceil(pair_index(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the unscaled frequency
    return (1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_attention_factor(args: DeepSeekV3ModelArgs) -> float:
    """The factor transformers multiplies cos and sin by (YaRN's attention_factor; 1 without scaling)."""
    s = args.rope_scaling
    if s is None:
        return 1.0
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def precompute_rope_table(args: DeepSeekV3ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """[max_seq_len, qk_rope_head_dim // 2, 2] table of (cos, sin) of each position's angles, times YaRN's
    attention factor (a scaled rotation: q_pe and k_pe each grow by it, as in transformers)."""
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, rope_frequencies(args, device))
    table = torch.stack((torch.cos(angles), torch.sin(angles)), dim=-1)
    factor = rope_attention_factor(args)
    return table if factor == 1.0 else table * factor


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


class Handoff(nn.Module):
    """Returns its inputs unchanged. A module boundary that parallelisms can hook (a forward pre-hook may replace the
    inputs), for tensors that no parameterised module consumes as they are (MLA's shared rotary key k_pe)."""

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tensors


class MLAttention(nn.Module):
    """Causal multi-head latent attention with rotary positions on a part of each head; no biases."""

    def __init__(self, model_args: DeepSeekV3ModelArgs) -> None:
        super().__init__()
        a = model_args
        self.qk_nope_head_dim, self.qk_rope_head_dim = a.qk_nope_head_dim, a.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim, self.kv_lora_rank = a.qk_head_dim, a.v_head_dim, a.kv_lora_rank
        # Registration order = init order = parameters() order (the init contract).
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if a.q_lora_rank > 0:
            self.wq_a = nn.Linear(a.dim, a.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(a.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(a.q_lora_rank, a.n_heads * a.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(a.dim, a.n_heads * a.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(a.dim, a.kv_lora_rank + a.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(a.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(a.kv_lora_rank, a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.wo = nn.Linear(a.n_heads * a.v_head_dim, a.dim, bias=False)
        # Parameterless, so the state dict is unchanged: the point between the per-token kv path and the per-head
        # one where tensor parallel gathers the normed latent and k_pe over the sequence.
        self.kv_handoff = Handoff()
        self.sdpa = CausalAttention()
        # SDPA scales by 1 / sqrt(q's width); YaRN's extra mscale^2 (args.softmax_scale) goes onto q, which leaves
        # the attention core (and whatever context parallel puts in its place) free of any scale argument.
        s = a.rope_scaling
        self.q_scale = yarn_mscale(s.factor, s.mscale_all_dim) ** 2 if s is not None and s.mscale_all_dim else 1.0

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, document_ids: torch.Tensor | None = None, *,
                cache: LayerCache | None = None) -> torch.Tensor:
        """`cache`: generation's cache of this layer (torchtitan/generation/kv_cache.py). It holds the compressed
        form, (kv_norm(latent), rotated k_pe) per token; the prompt's forward attends as training does, later ones
        attend in the latent space (`_latent_attention`), never expanding the cached tokens to per-head keys."""
        bsz, seq_len, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # Head counts come from the tensors, not the config (as in the Llama model).
        q_nope, q_pe = q.view(bsz, seq_len, -1, self.qk_head_dim).split([self.qk_nope_head_dim,
                                                                          self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_handoff(self.kv_norm(latent), k_pe)
        # contiguous(): the rotation views channel pairs as complex numbers, which needs an even storage offset.
        q_pe = apply_rotary_emb(q_pe.contiguous(), freqs_cis)
        k_pe = apply_rotary_emb(k_pe.contiguous().unsqueeze(2), freqs_cis)  # [B, S, 1, rope]: shared by the heads
        if cache is not None:
            (cached,) = cache.update(torch.cat([latent, k_pe.squeeze(2)], dim=-1))  # [B, end, kv_lora + rope]
            if cache.start > 0:
                return self._latent_attention(q_nope, q_pe, cached, cache)
        kv = self.wkv_b(latent).view(bsz, seq_len, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        # v is narrower or wider than q and k: SDPA takes a different value width as it is.
        if cache is None:
            out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids)
        else:  # the prompt: nothing cached before it, so its own keys are all there is (masked for padding)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=cache.attn_mask, is_causal=cache.is_causal)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))

    def _latent_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cached: torch.Tensor,
                          cache: LayerCache) -> torch.Tensor:
        """Attention over the cached (latent, k_pe) of every earlier token, with wkv_b absorbed into the query and
        the output: head h's q_nope . k_nope = (q_nope W_k[h]) . latent and its output is (sum p latent) W_v[h]^T,
        where wkv_b = per head [W_k (qk_nope rows); W_v (v_head_dim rows)] over kv_lora_rank columns. So all heads
        share one key [latent, k_pe] and one value (latent) per token, as multi-query attention does.
        q_nope, q_pe: [B, S, heads, width]; cached: [B, end, kv_lora_rank + qk_rope_head_dim]."""
        bsz, seq_len, n_heads, _ = q_nope.shape
        w_k, w_v = self.wkv_b.weight.view(n_heads, -1, self.kv_lora_rank).split(
            [self.qk_nope_head_dim, self.v_head_dim], dim=1)
        q = torch.cat([torch.einsum("bshn,hnc->bhsc", q_nope, w_k), q_pe.transpose(1, 2)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        kv = cached.unsqueeze(1)  # [B, 1, end, kv_lora + rope]: one head, shared
        # The softmax scale of the expanded form (its q width is qk_head_dim), not of this q's width.
        out = F.scaled_dot_product_attention(q, kv, kv[..., :self.kv_lora_rank], attn_mask=cache.attn_mask,
                                             is_causal=cache.is_causal, scale=self.qk_head_dim**-0.5,
                                             enable_gqa=True)
        out = torch.einsum("bhsc,hvc->bshv", out, w_v)  # [B, S, heads, v_head_dim]
        return self.wo(out.reshape(bsz, seq_len, -1))

    def init_weights(self, out_std: float, param_init: ParamInit) -> None:
        if self.wq is not None:
            param_init(self.wq.weight, trunc_normal(0.02))
        else:
            param_init(self.wq_a.weight, trunc_normal(0.02))
            self.q_norm.init_weights(param_init)
            param_init(self.wq_b.weight, trunc_normal(0.02))
        param_init(self.wkv_a.weight, trunc_normal(0.02))
        self.kv_norm.init_weights(param_init)
        param_init(self.wkv_b.weight, trunc_normal(0.02))
        param_init(self.wo.weight, trunc_normal(out_std))


class TransformerBlock(_Block):
    """Pre-norm residual block: MLAttention, then the dense SwiGLU MLP or a mixture of experts
    (torchtitan/models/decoder.py)."""

    def __init__(self, layer_id: int, model_args: DeepSeekV3ModelArgs) -> None:
        super().__init__(layer_id, model_args, MLAttention(model_args))


class DeepSeekV3Transformer(Decoder):
    """DeepSeek-V3 decoder: tokens [B, S] -> logits [B, S, vocab] (the skeleton, pipeline cutting and init contract are
    torchtitan/models/decoder.py's)."""

    def __init__(self, model_args: DeepSeekV3ModelArgs) -> None:
        super().__init__(model_args, TransformerBlock)

    def rope_table(self, device: torch.device | None) -> torch.Tensor:
        return precompute_rope_table(self.model_args, device)


# ---------------------------------------------------------------------------------------------
# Parameter and FLOP counts
# ---------------------------------------------------------------------------------------------


def get_nparams_and_flops(model: nn.Module, model_args: DeepSeekV3ModelArgs, seq_len: int) -> tuple[int, int]:
    """(unique parameter count, training FLOPs per token). Works on meta and wrapped models.

    FLOPs: 6 per matmul weight a token goes through (2 forward, 4 backward), i.e. over the ACTIVE parameters
    (qwen3's `get_active_nparams`: routed experts count top_k / num_experts of their size) except the embedding
    lookup, plus the output projection even when tied, plus attention's products per head: QK^T over qk_head_dim
    and AV over v_head_dim channels, 2 FLOPs x 3 (forward + backward) x seq_len each, with no causal discount (the
    Llama model's convention: 12 x head_dim x seq_len when both widths are head_dim).
    """
    nparams = sum(p.numel() for p in model.parameters())  # a DTensor reports its global size
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    embedding_ids = {id(w) for w in embeddings}
    n_embedding = sum(w.numel() for w in embeddings)
    n_tied_output = sum(m.weight.numel() for m in model.modules()
                        if isinstance(m, nn.Linear) and id(m.weight) in embedding_ids)
    matmul_params = get_active_nparams(model) - n_embedding + n_tied_output
    return nparams, 6 * matmul_params + model_args.n_layers * attention_flops(model_args, seq_len)


