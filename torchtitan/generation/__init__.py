"""Generation with a KV cache: `generate(model, prompts, GenerationConfig(...)) -> GenerationResult`.

A reusable component (scripts/generate.py samples from checkpoints with it; RL will roll out with it), for every
decoder family of torchtitan/models. The cache is plain tensors handed to the model's forward (`cache=`); the model
code stays free of torch.distributed. docs/generation.md describes the API, what is cached and the limitations.
"""

from torchtitan.generation.generate import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationConfig,
    GenerationResult,
    generate,
    left_pad,
)
from torchtitan.generation.kv_cache import KVCache, LayerCache
from torchtitan.generation.sampling import choose_tokens, sample, sampling_logits, top_k_filter, top_p_filter

__all__ = [
    "FINISH_LENGTH", "FINISH_STOP", "GenerationConfig", "GenerationResult", "KVCache", "LayerCache", "choose_tokens",
    "generate", "left_pad", "sample", "sampling_logits", "top_k_filter", "top_p_filter",
]  # fmt: skip
