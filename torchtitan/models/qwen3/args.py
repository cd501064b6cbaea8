"""Qwen3 hyper-parameters and the published model shapes ("flavors"), dense and mixture-of-experts."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchtitan.models.moe.args import MoEArgs


@dataclass
class Qwen3ModelArgs:
    """Shape and numerics of a Qwen3 decoder; defaults follow Qwen3-8B."""

    dim: int = 4096
    """Width of the residual stream (Hugging Face: hidden_size)."""
    n_layers: int = 36
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads."""
    n_kv_heads: int | None = 8
    """Number of key/value heads for grouped-query attention; None means n_heads (plain MHA)."""
    head_dim: int = 128
    """Width of one attention head. Explicit, not dim / n_heads: Qwen3 uses 128 everywhere, so e.g. the 0.6B model
    projects its 1024-wide stream to 16 x 128 = 2048 query channels."""
    vocab_size: int = 151936
    """Rows of the embedding table and columns of the output projection."""
    ffn_hidden_dim: int = 12288
    """Hidden size of the dense SwiGLU MLP (Hugging Face: intermediate_size), used by the blocks that are not MoE."""
    norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm (also the per-head q/k norms)."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary position frequencies."""
    max_seq_len: int = 2048
    """Length of the precomputed rotary table, i.e. the longest sequence the model accepts."""
    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection (the small published models do)."""
    depth_init: bool = True
    """Scale output-projection init std by each layer's depth (True) or by the total layer count (False)."""
    moe: MoEArgs | None = None
    """Mixture-of-experts layers' settings; None makes a dense model."""
    decoder_sparse_step: int = 1
    """With `moe`: layer i is MoE when (i + 1) % decoder_sparse_step == 0 (Hugging Face's rule, same name)."""
    mlp_only_layers: tuple[int, ...] = ()
    """With `moe`: layers that stay dense whatever decoder_sparse_step says (Hugging Face: mlp_only_layers)."""

    def __post_init__(self) -> None:
        # A list from a config file would make the dataclass unhashable and compare unequal to a tuple.
        self.mlp_only_layers = tuple(int(i) for i in self.mlp_only_layers)
        if self.n_heads % self.num_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step ({self.decoder_sparse_step}) must be >= 1")
        if self.moe is not None:
            errors = self.moe.check()
            if errors:
                raise ValueError("; ".join(errors))

    @property
    def num_kv_heads(self) -> int:
        """Key/value head count with the None default resolved."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` holds a mixture of experts instead of the dense MLP (Hugging Face's rule)."""
        if self.moe is None or self.moe.num_experts < 1:
            return False
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]


def _dense(dim: int, n_layers: int, n_heads: int, ffn: int, tie: bool) -> Qwen3ModelArgs:
    # Every released dense Qwen3 shares vocabulary, head_dim 128, 8 KV heads, theta 1e6 and eps 1e-6.
    return Qwen3ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128,
                          vocab_size=151936, ffn_hidden_dim=ffn, tie_word_embeddings=tie)


QWEN3_BALANCE = dict(load_balance_coeff=3e-4, aux_loss_coeff=3e-2, aux_loss_scope="global_batch",
                     router_z_loss_coeff=1e-3)
"""The Qwen3 MoE flavors' balance settings (a softmax router over 128 experts; docs/models.md, "Load balancing")"""


def _sparse(dim: int, n_layers: int, n_heads: int, ffn: int, expert_hidden: int) -> Qwen3ModelArgs:
    # The released MoE models: 128 routed experts, 8 per token, renormalised top-k weights (norm_topk_prob true),
    # no shared expert, every layer MoE (decoder_sparse_step 1, mlp_only_layers []), 4 KV heads, untied.
    # `ffn` (intermediate_size) is unused by these layouts but kept so that the exported config.json matches.
    # Balance (docs/models.md, "Load balancing"), measured on this block shape: the global-batch balance loss of the
    # released models' recipe at 3e-2 (their 1e-3 changed little in 50 steps), a routing-bias step of 3e-4 (about
    # 0.04 x the mean softmax score 1/128; 1e-3 overshoots) and ST-MoE's router z-loss at 1e-3. Together they held
    # the worst layer at 5.1 of 16 where nothing reached 12.7 with 84 idle experts.
    moe = MoEArgs(num_experts=128, top_k=8, hidden_dim=expert_hidden, num_shared_experts=0, score_func="softmax",
                  route_norm=True, route_scale=1.0, **QWEN3_BALANCE)
    return Qwen3ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, head_dim=128,
                          vocab_size=151936, ffn_hidden_dim=ffn, tie_word_embeddings=False, moe=moe)


qwen3_flavors: dict[str, Qwen3ModelArgs] = {
    # Small enough for CPU tests. head_dim 64 != dim / n_heads (32), as in the published models (e.g. 0.6B:
    # 16 heads x 128 over a 1024-wide stream), so code that assumes dim == n_heads * head_dim fails here.
    # vocab_size matches the project's default byte-level BPE tokenizer (as llama3's debugmodel).
    "debugmodel": Qwen3ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, vocab_size=8192,
                                 ffn_hidden_dim=768, tie_word_embeddings=False),
    # Values from the Hugging Face config.json of Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B} (hidden_size,
    # num_hidden_layers, num_attention_heads, intermediate_size, tie_word_embeddings).
    "0.6B": _dense(1024, 28, 16, 3072, tie=True),
    "1.7B": _dense(2048, 28, 16, 6144, tie=True),
    "4B": _dense(2560, 36, 32, 9728, tie=True),
    "8B": _dense(4096, 36, 32, 12288, tie=False),
    "14B": _dense(5120, 40, 40, 17408, tie=False),
    "32B": _dense(5120, 64, 64, 25600, tie=False),
    # Values from the Hugging Face config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (hidden_size,
    # num_hidden_layers, num_attention_heads, intermediate_size, moe_intermediate_size; num_experts 128,
    # num_experts_per_tok 8, num_key_value_heads 4, norm_topk_prob true).
    "30B-A3B": _sparse(2048, 48, 32, 6144, 768),
    "235B-A22B": _sparse(4096, 94, 64, 12288, 1536),
}

# Tied embedding/output, the layout of the 0.6B-4B flavors, for CPU tests.
qwen3_flavors["debugmodel_tied"] = replace(qwen3_flavors["debugmodel"], tie_word_embeddings=True)
# Every block a mixture of 8 experts (2 per token), balanced as the large flavors (QWEN3_BALANCE) with the bias step
# scaled to the scores: softmax scores over 8 experts are 16x those over 128, so 5e-3 (docs/models.md, "Load
# balancing": train_configs/debug_moe.toml's worst layer at 1.89 of 4 over steps 51-60).
qwen3_flavors["debugmodel_moe"] = replace(
    qwen3_flavors["debugmodel"],
    moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=128, route_norm=True,
                **{**QWEN3_BALANCE, "load_balance_coeff": 5e-3}),
)
# The memory estimator's MoE accuracy model: as llama3's debugmodel_vocab2k, a 2,048-token vocabulary.
qwen3_flavors["debugmodel_moe_vocab2k"] = replace(qwen3_flavors["debugmodel_moe"], vocab_size=2048)
# The parity suite's MoE model (tests/integration/layouts.py): small enough for 8 gloo ranks on 2 cores.
qwen3_flavors["debugmodel_moe_small"] = replace(
    qwen3_flavors["debugmodel"], dim=64, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=512, ffn_hidden_dim=128,
    moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=64, route_norm=True, load_balance_coeff=1e-3),
)
# ... and with the sequence-level balance loss (DeepSeek-V3's complementary loss) on top of the routing bias. Its
# coefficient is far above a real run's (DeepSeek-V3: 1e-4) so that the parity suite sees its gradient: at 0.01 it
# moved the step-1 gradient norm by only 2e-6 relative.
qwen3_flavors["debugmodel_moe_small_aux"] = replace(
    qwen3_flavors["debugmodel_moe_small"],
    moe=replace(qwen3_flavors["debugmodel_moe_small"].moe, aux_loss_coeff=1.0),
)
# The parity suite's dense Qwen3 (tensor parallel and the other layouts, tests/integration/layouts.py).
qwen3_flavors["debugmodel_small"] = replace(
    qwen3_flavors["debugmodel"], dim=64, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=512, ffn_hidden_dim=128,
)


def _block_active_matmul_params(a: Qwen3ModelArgs, layer_id: int) -> int:
    attention = 2 * a.dim * a.n_heads * a.head_dim + 2 * a.dim * a.num_kv_heads * a.head_dim
    if not a.is_moe_layer(layer_id):
        return attention + 3 * a.dim * a.ffn_hidden_dim
    return attention + a.moe.active_matmul_params(a.dim)


def get_pipeline_unit_flops(model_args: Qwen3ModelArgs, seq_len: int) -> tuple[float, float, float]:
    """Training FLOPs per token of (the embedding, one block, the final norm + output), counted as in
    `get_nparams_and_flops`; the automatic pipeline split balances stages by these. The block is the average over
    all blocks (dense and MoE blocks may differ); norms are left out next to the matmuls."""
    a = model_args
    per_block = [_block_active_matmul_params(a, i) for i in range(a.n_layers)]
    block = 6 * sum(per_block) / max(len(per_block), 1) + 12 * a.n_heads * a.head_dim * seq_len
    return 0.0, float(block), float(6 * a.dim * a.vocab_size)
