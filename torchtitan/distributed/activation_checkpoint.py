"""Activation checkpointing per transformer block: full, every Nth block, or per-op selective.

Applied after TP/CP and before compile and FSDP (house order), by wrapping each entry of `model.layers`.
checkpoint_wrapper inserts `_checkpoint_wrapped_module` into parameter names; the state-dict helpers used
for checkpoints strip it, so saved names stay the same in every layout.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.tools.logging import logger

# Per-op policy, explicit: keep the outputs of the expensive ops (matmuls and attention), whose recomputation
# would cost most of a forward pass; recompute everything else (norms, activations, rotary, elementwise),
# which is cheap in FLOPs but holds most of the activation memory.
_SAVE_OPS = {
    # float8 (torchtitan/components/quantization/float8.py): the amax a scale comes from, so that recomputing a block
    # neither computes it again nor, under TP, reduces it again over the tp mesh
    torch.ops.aten.max.default,
    torch.ops.aten.amax.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
# Under tensor parallel, also keep what the reduce-scatters after wo/w2 return: recomputing them would repeat
# the communication in backward, and their outputs are only 1/TP of the sequence.
_SAVE_OPS.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
    _SAVE_OPS.add(torch.ops.aten._scaled_dot_product_cudnn_attention.default)


def _op_policy(low_ranks: frozenset[int]):
    """The per-op policy. A matmul that contracts over a LoRA rank (the adapter's B: [tokens, r] x [r, out]) is
    recomputed: it costs r multiply-adds per output element, next to nothing, while keeping its output would hold a
    tensor as wide as the base projection's for every adapter (docs/finetuning.md, "What LoRA saves at 8B")."""

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ARG001 - policy signature
        if op not in _SAVE_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if low_ranks and op in _MATMULS:
            left = args[1] if op is torch.ops.aten.addmm.default else args[0]
            if left.shape[-1] in low_ranks:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _low_ranks(block: nn.Module) -> frozenset[int]:
    """The ranks of the LoRA adapters in `block` (lora_a is [r, in_features]), never a base projection's width."""
    return frozenset(int(m.lora_a.shape[0]) for m in block.modules() if isinstance(getattr(m, "lora_a", None),
                                                                                 torch.Tensor))


def _draws_random_numbers(block: nn.Module) -> bool:
    # Dropout (LoRA's, lora.dropout) must draw the same mask when the block is recomputed, or the gradient belongs to
    # another forward than the loss's: the RNG state is then saved and restored around the recompute. Blocks without
    # randomness skip that cost.
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in block.modules())


def apply_ac(model: nn.Module, mode: str, selective_option: str) -> nn.Module:
    """mode: none | full | selective; selective_option: "op" or N (checkpoint every Nth block)."""
    if mode == "none":
        return model
    blocks = model.layers
    wrapped = 0
    for i, name in enumerate(list(blocks.keys())):
        rng = _draws_random_numbers(blocks[name])
        if mode == "full":
            blocks[name] = checkpoint_wrapper(blocks[name], preserve_rng_state=rng)
        elif selective_option == "op":
            policy = _op_policy(_low_ranks(blocks[name]))
            blocks[name] = checkpoint_wrapper(blocks[name], context_fn=lambda p=policy: (
                create_selective_checkpoint_contexts(p)), preserve_rng_state=rng)
        elif i % int(selective_option) == 0:
            blocks[name] = checkpoint_wrapper(blocks[name], preserve_rng_state=rng)
        else:
            continue
        wrapped += 1
    what = "per-op selective" if mode == "selective" and selective_option == "op" else mode
    logger.info(f"activation checkpointing ({what}) on {wrapped} of {len(blocks)} blocks")
    return model


