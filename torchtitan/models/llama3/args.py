"""Llama 3 hyper-parameters and the published model shapes ("flavors")."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class RoPEScaling:
    """Llama 3.1 rotary frequency scaling, used to stretch the trained context window."""

    factor: float = 8.0
    """How much the lowest frequencies are slowed down (divided by)."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_position_embeddings / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_position_embeddings / high_freq_factor are left alone."""
    original_max_position_embeddings: int = 8192
    """Context length the unscaled frequencies were trained for."""


@dataclass
class TransformerModelArgs:
    """Shape and numerics of a Llama 3 decoder; defaults follow the 8B model."""

    dim: int = 4096
    """Width of the residual stream."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads."""
    n_kv_heads: int | None = None
    """Number of key/value heads for grouped-query attention; None means n_heads (plain MHA)."""
    vocab_size: int = 128256
    """Rows of the embedding table and columns of the output projection."""
    multiple_of: int = 256
    """The feed-forward hidden size is rounded up to a multiple of this (hardware-friendly shapes)."""
    ffn_dim_multiplier: float | None = None
    """Optional extra scale on the feed-forward hidden size, applied before rounding."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm."""
    rope_theta: float = 500000.0
    """Base of the rotary position frequencies."""
    rope_scaling: RoPEScaling | None = None
    """Llama 3.1 long-context frequency scaling; None keeps plain RoPE."""
    max_seq_len: int = 2048
    """Length of the precomputed rotary table, i.e. the longest sequence the model accepts."""
    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection."""
    depth_init: bool = True
    """Scale output-projection init std by each layer's depth (True) or by the total layer count (False)."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.num_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    @property
    def num_kv_heads(self) -> int:
        """Key/value head count with the None default resolved."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: 2/3 of 4*dim keeps the parameter count of a 4*dim two-matrix MLP."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def _published(
    dim: int,
    n_layers: int,
    n_heads: int,
    ffn_dim_multiplier: float,
    multiple_of: int,
    rope_factor: float,
    tie: bool,
) -> TransformerModelArgs:
    # All released Llama 3.x models share vocabulary, theta, eps and 8 KV heads.
    return TransformerModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=multiple_of,
        ffn_dim_multiplier=ffn_dim_multiplier,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RoPEScaling(factor=rope_factor),
        tie_word_embeddings=tie,
    )


llama3_flavors: dict[str, TransformerModelArgs] = {
    # Small enough for CPU tests, but still exercises GQA (2 query heads per KV head) and RoPE scaling.
    # vocab_size matches the project's default byte-level BPE tokenizer.
    "debugmodel": TransformerModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=8192,
        multiple_of=256,
        rope_theta=500000.0,
        rope_scaling=RoPEScaling(),
        tie_word_embeddings=False,
    ),
    # Llama 3.2
    "1B": _published(2048, 16, 32, 1.5, 256, 32.0, tie=True),
    "3B": _published(3072, 28, 24, 1.0, 256, 32.0, tie=True),
    # Llama 3.1
    "8B": _published(4096, 32, 32, 1.3, 1024, 8.0, tie=False),
    "70B": _published(8192, 80, 64, 1.3, 4096, 8.0, tie=False),
    "405B": _published(16384, 126, 128, 1.2, 4096, 8.0, tie=False),
}

# The 8B block shape cut to 8 blocks (2.80B parameters with the 128K vocabulary): trains on one 80 GB GPU with AdamW
# state, for benchmarks of the 8B shape's kernels (scripts/benchmark_float8.py, docs/performance.md).
llama3_flavors["8B_8blocks"] = replace(llama3_flavors["8B"], n_layers=8)
# The debug model with tied embedding/output, the layout of the 1B and 3B flavors, for CPU tests.
llama3_flavors["debugmodel_tied"] = replace(llama3_flavors["debugmodel"], tie_word_embeddings=True)
# The parity tests' model: layouts of up to 8 ranks share 2 CPU cores, where every collective's latency and bytes
# count (an 8-rank gloo all-reduce of 256 KiB takes ~20 ms there), so it is small in every dimension. The default
# tokenizer follows its vocabulary (a 512-token BPE). 4 blocks for 4 pipeline stages over 2 ranks (the other parity
# layouts train 2 of them, model.n_layers), 2 KV heads for TP 2.
llama3_flavors["debugmodel_small"] = replace(llama3_flavors["debugmodel"], dim=64, n_heads=4, n_kv_heads=2,
                                             vocab_size=512, multiple_of=64)
llama3_flavors["debugmodel_small_tied"] = replace(llama3_flavors["debugmodel_small"], tie_word_embeddings=True)
# The memory estimator's accuracy model (tests/unit/test_memory_estimation.py): the debug model with a 2,048-token
# vocabulary. Its embedding and output layer are 1.0M of its 4.2M parameters (4.2M of 7.3M at 8,192): a token costs
# 70% of the compute, and the activations each accuracy case must see are a larger share of the peak, so fewer
# tokens show them (docs/memory_estimation.md, "Accuracy").
llama3_flavors["debugmodel_vocab2k"] = replace(llama3_flavors["debugmodel"], vocab_size=2048)


def get_pipeline_unit_flops(model_args: TransformerModelArgs, seq_len: int) -> tuple[float, float, float]:
    """Training FLOPs per token of (the embedding, one block, the final norm + output), counted as in
    `get_nparams_and_flops`: the automatic pipeline split balances stages by these. The lookup counts as free (its
    backward is a scatter-add); the norms' elementwise work is left out next to the matmuls."""
    a = model_args
    attention_weights = 2 * a.dim * a.n_heads * a.head_dim + 2 * a.dim * a.num_kv_heads * a.head_dim
    block = 6 * (attention_weights + 3 * a.dim * a.ffn_hidden_dim) + 12 * a.n_heads * a.head_dim * seq_len
    return 0.0, float(block), float(6 * a.dim * a.vocab_size)
