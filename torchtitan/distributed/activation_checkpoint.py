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


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ARG001 - policy signature
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_op_context():
    return create_selective_checkpoint_contexts(_op_policy)


def apply_ac(model: nn.Module, mode: str, selective_option: str) -> nn.Module:
    """mode: none | full | selective; selective_option: "op" or N (checkpoint every Nth block)."""
    if mode == "none":
        return model
    blocks = model.layers
    wrapped = 0
    for i, name in enumerate(list(blocks.keys())):
        if mode == "full":
            blocks[name] = checkpoint_wrapper(blocks[name], preserve_rng_state=False)
        elif selective_option == "op":
            blocks[name] = checkpoint_wrapper(blocks[name], context_fn=_selective_op_context,
                                              preserve_rng_state=False)
        elif i % int(selective_option) == 0:
            blocks[name] = checkpoint_wrapper(blocks[name], preserve_rng_state=False)
        else:
            continue
        wrapped += 1
    what = "per-op selective" if mode == "selective" and selective_option == "op" else mode
    logger.info(f"activation checkpointing ({what}) on {wrapped} of {len(blocks)} blocks")
    return model


