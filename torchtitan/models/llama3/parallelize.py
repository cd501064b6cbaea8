"""Apply parallelisms to a Llama model in the house order: TP -> CP -> AC -> compile -> FSDP/HSDP or DDP.

TP, CP and compile are rejected by config validation until their issues land.
"""

from __future__ import annotations

import torch.nn as nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.fsdp import apply_ddp, apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig,
                      param_dtype: str) -> nn.Module:
    ac = job_config.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_ac_option)
    if parallel_dims.fsdp_enabled:
        return apply_fsdp(
            model,
            parallel_dims.fsdp_mesh(),
            param_dtype=param_dtype,
            reduce_dtype=job_config.training.mixed_precision_reduce,
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
        )
    return apply_ddp(model, parallel_dims.mesh("dp_replicate"))
