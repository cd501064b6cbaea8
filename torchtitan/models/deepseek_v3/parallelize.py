"""Apply parallelisms to a DeepSeek-V3 model (or one pipeline stage of it): the Llama order and code
(torchtitan/models/llama3/parallelize.py: CP -> AC -> compile -> FSDP/HSDP or DDP), whose apply_* functions work by
module names the families share. Pipeline parallel cuts the stages before this runs.

Context parallel replaces each block's `attention.sdpa`, which MLA calls with full per-head q, k, v (v of another
width than q and k, which the replacement's SDPA takes as it is). Tensor parallel is not available yet (config
validation refuses it): the Llama plan has no entries for MLA's low-rank projections or the MoE experts. FSDP needs
nothing MoE-specific: each block is one FSDP unit, and its 3-D expert weights are sharded on their leading
(expert) dimension like any other parameter's first dimension.
"""

from __future__ import annotations

import torch.nn as nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama3.parallelize import parallelize_llama


def parallelize_deepseek_v3(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig,
                            param_dtype: str, *, ddp: bool = True) -> nn.Module:
    """`model` is the whole model or one pipeline stage of it (modules outside the stage are None / absent)."""
    if parallel_dims.tp_enabled:
        raise NotImplementedError("tensor parallel for deepseek_v3 is not available yet")
    return parallelize_llama(model, parallel_dims, job_config, param_dtype, ddp=ddp)
