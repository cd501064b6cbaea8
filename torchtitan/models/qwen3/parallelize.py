"""Apply parallelisms to a Qwen3 model (or one pipeline stage of it): the Llama order and code
(torchtitan/models/llama3/parallelize.py: TP -> CP -> AC -> compile -> FSDP/HSDP or DDP), whose apply_* functions
work by module names the two families share. Pipeline parallel cuts the stages before this runs.

Tensor parallel: Llama's block plan plus the per-head q/k norms. Their input is this rank's heads
([batch, seq, local heads, head_dim], column-wise wq/wk), so they run as "sequence parallel" over the heads
dimension: the weight becomes a replicated DTensor whose gradient, a partial sum over each rank's heads, is
all-reduced over tp. MoE blocks run their MoE layer on each rank's own sequence shard (Llama's block plan decides by
the block; torchtitan/distributed/tensor_parallel.py describes it). FSDP needs nothing else MoE-specific: each block
is one FSDP unit, and its 3-D expert weights are sharded on their leading (expert) dimension like any other
parameter's first dimension.
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
    return parallelize_llama(model, parallel_dims, job_config, param_dtype, ddp=ddp, tp_plan=qwen3_tp_block_plan)


def qwen3_tp_block_plan(block: nn.Module | None = None) -> dict:
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)  # [batch, seq, heads, head_dim]: Shard(2)
    return {**tp_block_plan(block), "attention.q_norm": heads, "attention.k_norm": heads}
