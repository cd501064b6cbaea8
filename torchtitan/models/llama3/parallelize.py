"""Apply parallelisms to a Llama model in the house order: TP -> CP -> AC -> compile -> FSDP/HSDP or DDP.

Only data parallelism exists so far; the other steps are rejected by config validation until their issues land.
"""

from __future__ import annotations

import torch.nn as nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.fsdp import apply_ddp, apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig,
                      param_dtype: str) -> nn.Module:
    if parallel_dims.fsdp_enabled:
        return apply_fsdp(
            model,
            parallel_dims.fsdp_mesh(),
            param_dtype=param_dtype,
            reduce_dtype=job_config.training.mixed_precision_reduce,
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
        )
    return apply_ddp(model, parallel_dims.mesh("dp_replicate"))
