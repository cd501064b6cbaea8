"""DeepSeek-V3 hyper-parameters and the published model shapes ("flavors"): multi-head latent attention (MLA), a few
dense blocks first, then mixture-of-experts blocks with shared experts and sigmoid, group-limited, bias-balanced
routing."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torchtitan.models.moe.args import MoEArgs


@dataclass(frozen=True)
class YaRNScaling:
    """YaRN rotary scaling as Hugging Face's `rope_type: "yarn"` computes it (defaults: DeepSeek-V3's config.json).

    Frequencies are blended between the trained ones (fast rotations, kept: "extrapolation") and ones slowed by
    `factor` (slow rotations: "interpolation"), with a linear ramp between the rotation counts beta_fast and
    beta_slow over the original context. Two magnitude corrections come with it: cos/sin are scaled by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), and the attention softmax scale by
    mscale(factor, mscale_all_dim)^2, where mscale(s, m) = 0.1 * m * ln(s) + 1 (1 for s <= 1)."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class DeepSeekV3ModelArgs:
    """Shape and numerics of a DeepSeek-V3 decoder; defaults follow DeepSeek-V3 (671B)."""

    dim: int = 7168
    """Width of the residual stream (Hugging Face: hidden_size)."""
    n_layers: int = 61
    """Number of transformer blocks."""
    n_heads: int = 128
    """Number of attention heads (MLA expands its latent to full keys and values for every head)."""
    vocab_size: int = 129280
    """Rows of the embedding table and columns of the output projection."""
    ffn_hidden_dim: int = 18432
    """Hidden size of the dense SwiGLU MLP of the first `n_dense_layers` blocks (Hugging Face: intermediate_size)."""
    n_dense_layers: int = 3
    """The first this-many blocks have a dense MLP, the others a mixture of experts (HF: first_k_dense_replace)."""
    norm_eps: float = 1e-6
    """Epsilon of the block and final RMSNorms (HF: rms_norm_eps). The latent norms (q_norm, kv_norm) always use
    1e-6, as the reference and transformers' DeepseekV3Attention do whatever rms_norm_eps says."""
    max_seq_len: int = 4096
    """Length of the precomputed rotary table, i.e. the longest sequence the model accepts."""
    q_lora_rank: int = 1536
    """Rank of the low-rank query path (wq_a -> q_norm -> wq_b); 0 means one plain projection wq (HF: null)."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent (wkv_a's output besides the shared rotary key)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key channels without rotary positions (expanded from the latent by wkv_b)."""
    qk_rope_head_dim: int = 64
    """Per-head query channels with rotary positions; the key's are one vector shared by all heads."""
    v_head_dim: int = 128
    """Per-head value channels (may differ from the query/key width)."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""
    rope_scaling: YaRNScaling | None = YaRNScaling()
    """YaRN long-context scaling; None keeps plain RoPE."""
    moe: MoEArgs = MoEArgs(num_experts=256, top_k=8, hidden_dim=2048, num_shared_experts=1, score_func="sigmoid",
                           route_norm=True, route_scale=2.5, num_expert_groups=8, num_limited_groups=4,
                           load_balance_coeff=1e-3, aux_loss_coeff=1e-4, aux_loss_scope="sequence")
    """The MoE blocks' settings (frozen, hence a valid dataclass default)."""
    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection."""
    depth_init: bool = True
    """Scale output-projection init std by each layer's depth (True) or by the total layer count (False)."""

    def __post_init__(self) -> None:
        errors = list(self.moe.check())
        # More dense layers than layers is allowed (all dense, as in transformers): code that shrinks n_layers (the
        # memory estimator's depth samples) must not trip over it.
        if self.n_dense_layers < 0:
            errors.append(f"n_dense_layers ({self.n_dense_layers}) must be >= 0")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            errors.append(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be positive and even for rotary pairs")
        if self.q_lora_rank < 0 or self.kv_lora_rank <= 0:
            errors.append(f"q_lora_rank ({self.q_lora_rank}) must be >= 0 and kv_lora_rank ({self.kv_lora_rank}) > 0")
        if self.qk_nope_head_dim < 0 or self.v_head_dim <= 0:
            errors.append(f"qk_nope_head_dim ({self.qk_nope_head_dim}) must be >= 0 and v_head_dim "
                          f"({self.v_head_dim}) > 0")
        if errors:
            raise ValueError("; ".join(errors))

    # -- what generic code (estimation, tensor-parallel checks, the trainer) reads off any model args ----------

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key: the non-rotary then the rotary channels."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The query/key head width (generic code's name; values are v_head_dim wide)."""
        return self.qk_head_dim

    @property
    def num_kv_heads(self) -> int:
        """MLA expands the latent to keys and values for every head, so attention runs as plain multi-head."""
        return self.n_heads

    @property
    def softmax_scale(self) -> float:
        """The attention logits' scale: 1 / sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 (as
        transformers applies it: only when mscale_all_dim is nonzero)."""
        scale = self.qk_head_dim**-0.5
        s = self.rope_scaling
        if s is not None and s.mscale_all_dim:
            scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` holds a mixture of experts (HF: layer_idx >= first_k_dense_replace)."""
        return layer_id >= self.n_dense_layers

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]


deepseek_v3_flavors: dict[str, DeepSeekV3ModelArgs] = {
    # Small enough for CPU tests: 1 dense block then 3 MoE blocks of 8 experts (top 2 from the best 2 of 4 groups),
    # one shared expert, sigmoid scores, routing bias on. v_head_dim != qk_head_dim and qk_head_dim x n_heads !=
    # dim, as in the published models, so code assuming either fails here. Vocabulary: the project's default
    # byte-level BPE tokenizer (as the llama3 and qwen3 debug models).
    "debugmodel": DeepSeekV3ModelArgs(
        dim=256, n_layers=4, n_heads=8, vocab_size=8192, ffn_hidden_dim=768, n_dense_layers=1, norm_eps=1e-6,
        q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_theta=10000.0,
        rope_scaling=None, max_seq_len=2048,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=128, num_shared_experts=1, score_func="sigmoid",
                    route_norm=True, route_scale=2.5, num_expert_groups=4, num_limited_groups=2,
                    load_balance_coeff=1e-3, aux_loss_coeff=1e-4, aux_loss_scope="sequence"),
    ),
    # Moonlight-16B-A3B (moonshotai/Moonlight-16B-A3B config.json, as quoted by third-party test suites and the
    # NeMo / slime Moonlight recipes): DeepseekV3ForCausalLM with 27 layers (first_k_dense_replace 1), hidden 2048,
    # intermediate 11264, 16 heads, q_lora_rank null, kv_lora_rank 512, qk_nope/rope/v 128/64/128, 64 routed experts
    # (moe_intermediate_size 1408, top 6, n_group 1, topk_group 1), 2 shared experts, norm_topk_prob true,
    # routed_scaling_factor 2.446, rms_norm_eps 1e-5, rope_theta 50000 (no scaling), vocab 163840.
    # DeepSeek-V2-Lite has the same layer shapes (but softmax routing and 102400 tokens).
    "16B": DeepSeekV3ModelArgs(
        dim=2048, n_layers=27, n_heads=16, vocab_size=163840, ffn_hidden_dim=11264, n_dense_layers=1, norm_eps=1e-5,
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_theta=50000.0, rope_scaling=None, max_seq_len=8192,
        moe=MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, num_shared_experts=2, score_func="sigmoid",
                    route_norm=True, route_scale=2.446, num_expert_groups=1, num_limited_groups=1,
                    load_balance_coeff=1e-3, aux_loss_coeff=1e-4, aux_loss_scope="sequence"),
    ),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json, = transformers' DeepseekV3Config defaults): 61 layers
    # (first_k_dense_replace 3), hidden 7168, intermediate 18432, 128 heads, q_lora_rank 1536, kv_lora_rank 512,
    # 256 routed experts (moe_intermediate_size 2048, top 8 of the best 4 of 8 groups), 1 shared expert,
    # norm_topk_prob true, routed_scaling_factor 2.5, rms_norm_eps 1e-6, rope_theta 10000 with YaRN (factor 40,
    # original 4096, beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1), vocab 129280. Routing-bias step 1e-3:
    # the bias update speed of the DeepSeek-V3 report's auxiliary-loss-free balancing.
    "671B": DeepSeekV3ModelArgs(),
}
# The low-rank query path (wq_a -> q_norm -> wq_b) of the 671B model, at debug size.
deepseek_v3_flavors["debugmodel_qlora"] = replace(deepseek_v3_flavors["debugmodel"], q_lora_rank=128)
# The parity suite's DeepSeek-V3 (tests/integration/layouts.py; tensor parallel over 2 ranks): the parity corpus's
# 512-token vocabulary, 4 heads, one dense block then two MoE blocks (8 experts, top 2 from the best 2 of 4 groups,
# one shared expert), and MLA's odd widths kept (v_head_dim != qk_head_dim, n_heads x qk_head_dim != dim).
deepseek_v3_flavors["debugmodel_small"] = replace(
    deepseek_v3_flavors["debugmodel"], dim=64, n_layers=3, n_heads=4, vocab_size=512, ffn_hidden_dim=128,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, max_seq_len=256,
    moe=replace(deepseek_v3_flavors["debugmodel"].moe, hidden_dim=32),
)
# ... with the low-rank query path.
deepseek_v3_flavors["debugmodel_small_qlora"] = replace(deepseek_v3_flavors["debugmodel_small"], q_lora_rank=32)


def attention_flops(a: DeepSeekV3ModelArgs, seq_len: int) -> int:
    return 6 * a.n_heads * (a.qk_head_dim + a.v_head_dim) * seq_len


def _block_active_matmul_params(a: DeepSeekV3ModelArgs, layer_id: int) -> int:
    qk = a.n_heads * a.qk_head_dim
    q = a.dim * qk if a.q_lora_rank == 0 else a.dim * a.q_lora_rank + a.q_lora_rank * qk
    kv = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim
                                                                                       + a.v_head_dim)
    attention = q + kv + a.n_heads * a.v_head_dim * a.dim
    if not a.is_moe_layer(layer_id):
        return attention + 3 * a.dim * a.ffn_hidden_dim
    return attention + a.moe.active_matmul_params(a.dim)


def get_pipeline_unit_flops(model_args: DeepSeekV3ModelArgs, seq_len: int) -> tuple[float, float, float]:
    """Training FLOPs per token of (the embedding, one block, the final norm + output), counted as in
    `get_nparams_and_flops`; the automatic pipeline split balances stages by these. The block is the average over
    all blocks (dense and MoE blocks differ); norms are left out next to the matmuls."""
    a = model_args
    per_block = [_block_active_matmul_params(a, i) for i in range(a.n_layers)]
    block = 6 * sum(per_block) / max(len(per_block), 1) + attention_flops(a, seq_len)
    return 0.0, float(block), float(6 * a.dim * a.vocab_size)
