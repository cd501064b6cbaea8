"""Apply parallelisms to a Qwen3 model (or one pipeline stage of it): the Llama order and code
(torchtitan/models/llama3/parallelize.py: TP -> CP -> AC -> compile -> FSDP/HSDP or DDP), whose apply_* functions
work by module names the two families share. Pipeline parallel cuts the stages before this runs.

Tensor parallel: Llama's block plan plus the per-head q/k norms. Their input is this rank's heads
([batch, seq, local heads, head_dim], column-wise wq/wk), so they run as "sequence parallel" over the heads
dimension: the weight becomes a replicated DTensor whose gradient, a partial sum over each rank's heads, is
all-reduced over tp. MoE blocks have no tensor-parallel plan yet (config validation refuses it). FSDP needs nothing
MoE-specific: each block is one FSDP unit, and its 3-D expert weights are sharded on their leading (expert)
dimension like any other parameter's first dimension.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import SequenceParallel

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama3.parallelize import parallelize_llama, tp_block_plan


def parallelize_qwen3(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig,
                      param_dtype: str, *, ddp: bool = True) -> nn.Module:
    """`model` is the whole model or one pipeline stage of it (modules outside the stage are None / absent)."""
    if parallel_dims.tp_enabled and any(getattr(block, "moe", None) is not None for block in model.layers.values()):
        raise NotImplementedError("tensor parallel for qwen3 MoE blocks is not available yet")
    return parallelize_llama(model, parallel_dims, job_config, param_dtype, ddp=ddp, tp_plan=qwen3_tp_block_plan())


def qwen3_tp_block_plan() -> dict:
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)  # [batch, seq, heads, head_dim]: Shard(2)
    return {**tp_block_plan(), "attention.q_norm": heads, "attention.k_norm": heads}
