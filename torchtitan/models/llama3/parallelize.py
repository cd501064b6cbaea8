"""Apply parallelisms to a Llama model (or one pipeline stage of it) in the house order: TP -> CP -> AC ->
compile -> FSDP/HSDP or DDP (or no data-parallel wrapper when the data-parallel degree is 1). Pipeline parallel
cuts the stages before this runs (torchtitan/components/model_parts.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.expert_parallel import apply_ep, expert_parameters
from torchtitan.distributed.fsdp import apply_ddp, apply_fsdp, apply_moe_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import apply_tp, enable_async_tp, moe_token_split


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig,
                      param_dtype: str, *, ddp: bool = True,
                      tp_plan: Callable[[nn.Module], dict] | None = None) -> nn.Module:
    """`model` is the whole model or one pipeline stage of it (modules outside the stage are None / absent).
    `ddp=False` leaves DDP out (the memory estimator accounts for its buckets itself). `tp_plan`: the block plan
    (a function of the block) of a family that shares this order but not Llama's block (default `tp_block_plan`)."""
    p = job_config.parallelism
    if parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.mesh("tp")
        apply_tp(model, tp_mesh, loss_parallel=parallel_dims.loss_parallel_enabled(p.disable_loss_parallel),
                 block_plan=tp_plan if tp_plan is not None else tp_block_plan)
        if p.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh)
    if parallel_dims.ep_enabled or parallel_dims.etp_enabled:
        apply_ep(model, parallel_dims.expert_weight_mesh(), job_config.memory_estimation.expert_load_factor)
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
            moe_mesh=parallel_dims.moe_fsdp_mesh(),
            **_expert_fsdp(model, parallel_dims),
        )
    if parallel_dims.tp_enabled and expert_parameters(model):
        # Tensor parallel alone (no data-parallel wrapper) still needs the MoE layers' gradients summed over tp.
        return apply_moe_fsdp(
            model,
            parallel_dims.moe_fsdp_mesh(),
            reduce_dtype=job_config.training.mixed_precision_reduce,
            reshard_after_forward=p.fsdp_reshard_after_forward,
            **_expert_fsdp(model, parallel_dims),
        )
    if parallel_dims.ddp_enabled and ddp:
        return apply_ddp(model, parallel_dims.mesh("dp_replicate"),
                         reduce_dtype=job_config.training.mixed_precision_reduce)
    return model


def tp_block_plan(block: nn.Module | None = None) -> dict:
    """Tensor parallel inside a block (torchtitan/distributed/tensor_parallel.py describes the layout): norms
    sequence parallel, attention and MLP inputs gathered on the sequence, q/k/v and w1/w3 column-wise, wo and w2
    row-wise with a reduce-scatter back to the sequence-sharded residual stream. A block with an MoE layer instead
    of the MLP (`block.moe`) runs it on its own sequence shard (`moe_token_split`)."""
    plan = {
        "attention_norm": SequenceParallel(),
        # freqs_cis and document_ids (the second and third inputs) are plain tensors of the whole sequence, the same
        # on every tp rank: leave them alone.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
    }
    if getattr(block, "moe", None) is not None:
        return {**plan, "moe": moe_token_split()}
    return {
        **plan,
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "feed_forward.w3": ColwiseParallel(),
    }


def _expert_fsdp(model: nn.Module, parallel_dims: ParallelDims) -> dict:
    """How FSDP treats expert parallel's weights (already sharded over ep): sharded again over the ranks EP leaves
    (efsdp, with dp_replicate), or, when there are none, left alone."""
    if not (parallel_dims.ep_enabled or parallel_dims.etp_enabled):
        return {}
    expert_mesh = parallel_dims.expert_fsdp_mesh()
    if expert_mesh is None:
        return {"ignored_params": set(expert_parameters(model))}
    return {"expert_mesh": expert_mesh}
