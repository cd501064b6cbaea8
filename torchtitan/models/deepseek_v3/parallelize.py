"""Apply parallelisms to a DeepSeek-V3 model (or one pipeline stage of it): the Llama order and code
(torchtitan/models/llama3/parallelize.py: TP -> CP -> AC -> compile -> FSDP/HSDP or DDP), whose apply_* functions
work by module names the families share. Pipeline parallel cuts the stages before this runs.

Context parallel replaces each block's `attention.sdpa`, which MLA calls with full per-head q, k, v (v of another
width than q and k, which the replacement's SDPA takes as it is). FSDP needs nothing MoE-specific: each block is one
FSDP unit, and its 3-D expert weights are sharded on their leading (expert) dimension like any other parameter's
first dimension.

Tensor parallel (the generic layout is torchtitan/distributed/tensor_parallel.py's: residual stream Shard(1) between
blocks; dense MLPs Llama's plan, MoE layers on each rank's own sequence shard) shards multi-head latent attention over
its heads, and runs the per-token low-rank projections on the sequence shard:
- `wkv_a` and `kv_norm` (and with q-LoRA `wq_a` and `q_norm`) are sequence parallel: replicated weights applied to
  this rank's S/tp tokens, whose weight gradients are partial sums that DTensor reduces over tp.
- Only their narrow outputs are all-gathered over the sequence: the normed kv latent and the shared rotary key k_pe
  (kv_lora_rank + qk_rope_head_dim wide, one all-gather at `kv_handoff`), and the q latent (q_lora_rank, at `wq_b`),
  instead of the dim-wide x. Without q-LoRA, `wq` is column-wise on the all-gathered x, as Llama's wq.
- `wq_b` / `wq` and `wkv_b` are column-wise (each rank expands its own heads), `wo` row-wise with a reduce-scatter
  back to Shard(1). One all-gather per gathered tensor and one reduce-scatter per block forward; in backward each
  all-gather's gradient is reduce-scattered.
k_pe leaves DTensor land at `kv_handoff` (the rotary uses complex views and the plain rotary table) as a plain
full-sequence tensor that every local head uses: its gradient there is this rank's heads' share, so the conversion
declares it Partial over tp, which makes the all-gather's backward a reduce-scatter that sums every rank's heads
(`GatherSharedKV`). The config needs n_heads divisible by tp (`tp_divisibility_errors` in
torchtitan/config/validate.py: MLA reports its heads as n_kv_heads too).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama3.parallelize import parallelize_llama, tp_block_plan


def parallelize_deepseek_v3(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig,
                            param_dtype: str, *, ddp: bool = True) -> nn.Module:
    """`model` is the whole model or one pipeline stage of it (modules outside the stage are None / absent)."""
    return parallelize_llama(model, parallel_dims, job_config, param_dtype, ddp=ddp, tp_plan=deepseek_tp_block_plan)


def deepseek_tp_block_plan(block: nn.Module) -> dict:
    """Llama's block plan (norms, the dense MLP or the MoE layer's token split) with MLA in place of its attention
    entries (the module doc describes the layout)."""
    plan = {name: style for name, style in tp_block_plan(block).items()
            if name != "attention" and not name.startswith("attention.")}
    attention = block.attention
    plan.update({
        # x stays this rank's sequence shard: the gathers happen later, on narrower tensors (or at wq).
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Shard(1), None, None)),
        "attention.wkv_a": SequenceParallel(),
        "attention.kv_norm": SequenceParallel(),
        "attention.kv_handoff": GatherSharedKV(),
        # the latent arrives as a Replicate DTensor from kv_handoff: no further communication here
        "attention.wkv_b": ColwiseParallel(input_layouts=Replicate()),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    })
    if attention.wq is not None:
        plan["attention.wq"] = ColwiseParallel(input_layouts=Shard(1))  # all-gathers x
    else:
        plan.update({
            "attention.wq_a": SequenceParallel(),
            "attention.q_norm": SequenceParallel(),
            "attention.wq_b": ColwiseParallel(input_layouts=Shard(1)),  # all-gathers the q latent
        })
    return plan


class GatherSharedKV(ParallelStyle):
    """For `kv_handoff(latent, k_pe)`, both Shard(1) DTensors on the tp mesh: one all-gather of the two (concatenated
    on the channels) over the sequence. The latent stays a Replicate DTensor for the column-wise wkv_b, whose backward
    hands it a Partial gradient (each rank's heads) as DTensor does by itself. k_pe becomes a plain full-sequence
    tensor whose gradient, this rank's heads' contribution, is declared Partial: the gather's backward is then one
    reduce-scatter of both gradients that sums the ranks' heads. (Declaring it Replicate would keep only this rank's
    heads' share of k_pe's gradient, silently.)"""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather(mod: nn.Module, inputs: tuple) -> tuple:
            latent, k_pe = inputs  # the sequence-parallel kv_norm and wkv_a hand over DTensors
            width = latent.shape[-1]
            both = torch.cat([latent, k_pe], dim=-1).redistribute(device_mesh, (Replicate(),))
            latent, k_pe = both.split([width, both.shape[-1] - width], dim=-1)
            return latent, k_pe.to_local(grad_placements=(Partial(),))

        module.register_forward_pre_hook(gather)
        return module
