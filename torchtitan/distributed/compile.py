"""Per-block torch.compile, applied after activation checkpointing and before FSDP (house order).

Compiling each transformer block separately (instead of the whole model) keeps compile time flat in the
depth: all blocks share one graph, so inductor compiles it once and reuses it. FSDP's hooks stay outside the
compiled region, so its all-gathers and reduce-scatters are unaffected. `nn.Module.compile` compiles in
place, so parameter names (and therefore checkpoints) are the same with and without compile.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torchtitan.tools.logging import logger


def apply_compile(model: nn.Module, backend: str) -> nn.Module:
    """Compile every block in place; a block with an MoE layer compiles its other parts (norms, attention) and leaves
    the MoE layer eager: its routing reads values on the host (expert parallel's all-to-all split sizes, the loop
    experts' counts) and a context variable (whether to count tokens), which fullgraph tracing cannot take."""
    for block in model.layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", block)  # under activation checkpointing
        if getattr(inner, "moe", None) is None:
            # fullgraph: a graph break inside a block would silently run part of it eagerly every step.
            block.compile(backend=backend, fullgraph=True)
            continue
        for name, child in inner.named_children():
            if name != "moe":
                child.compile(backend=backend, fullgraph=True)
    logger.info(f"compiled {len(model.layers)} transformer blocks with torch.compile (backend {backend})")
    return model


def compile_loss(loss_fn, backend: str):
    return torch.compile(loss_fn, backend=backend)
