"""Apply parallelisms to a Qwen3 model (or one pipeline stage of it) in the house order of
torchtitan/models/llama3/parallelize.py: CP -> AC -> compile -> FSDP/HSDP or DDP. Pipeline parallel cuts the stages
before this runs (torchtitan/components/model_parts.py).

Tensor parallel is not available yet: the Llama plan has no entries for the per-head q/k norms or the MoE experts.
FSDP needs nothing MoE-specific: each block is one FSDP unit, and its 3-D expert weights are sharded on their
leading (expert) dimension like any other parameter's first dimension.
"""

from __future__ import annotations

import torch.nn as nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.fsdp import apply_ddp, apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims


def parallelize_qwen3(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig,
                      param_dtype: str, *, ddp: bool = True) -> nn.Module:
    """`model` is the whole model or one pipeline stage of it (modules outside the stage are None / absent).
    `ddp=False` leaves DDP out (the memory estimator accounts for its buckets itself)."""
    p = job_config.parallelism
    if parallel_dims.tp_enabled:
        raise NotImplementedError("tensor parallel for qwen3 is not available yet")
    if parallel_dims.cp > 1:
        apply_cp(model, parallel_dims.mesh("cp"))
    ac = job_config.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_ac_option)
    if job_config.compile.enable and "model" in job_config.compile.components:
        apply_compile(model, job_config.compile.backend)
    if parallel_dims.fsdp_enabled:
        return apply_fsdp(
            model,
            parallel_dims.fsdp_mesh(),
            param_dtype=param_dtype,
            reduce_dtype=job_config.training.mixed_precision_reduce,
            reshard_after_forward=p.fsdp_reshard_after_forward,
        )
    if parallel_dims.ddp_enabled and ddp:
        return apply_ddp(model, parallel_dims.mesh("dp_replicate"),
                         reduce_dtype=job_config.training.mixed_precision_reduce)
    return model
