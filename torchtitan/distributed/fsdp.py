"""FSDP2 / HSDP (`fully_shard`) and DDP (composable `replicate`), keyed by module names.

Both are set up so gradients are *summed* over data-parallel ranks, never averaged: the loss is already
divided by the global token count (see docs/architecture.md, 'Loss normalisation'), so any averaging here
would divide twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from torchtitan.tools.logging import logger

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _reshard_policy(policy: str, is_last_block: bool) -> bool:
    if policy == "always":
        return True
    if policy == "never":
        return False
    # default: the last block's parameters are needed again right away by backward, keep them gathered.
    return not is_last_block


def apply_fsdp(
    model: nn.Module,
    mesh,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: str,
    ignored_params: set[nn.Parameter] | None = None,
    expert_mesh=None,
    moe_mesh=None,
) -> nn.Module:
    """Shard each transformer block, the embedding, and norm+output as units; the root holds the rest.

    `mesh` is 1-D (FSDP) or 2-D (replicate, shard) for HSDP; `expert_mesh` (expert parallel with ranks left over)
    is where each MoE layer's experts are sharded instead, and `moe_mesh` (tensor parallel) where the rest of each
    MoE layer is (see `_shard_moe`). Reductions are forced to plain SUM: gloo has no PREMUL_SUM, and with a divide
    factor of 1 FSDP would otherwise pick AVG on a 1-rank NCCL group, which torch documents as unreliable.
    """
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    common = {"mesh": mesh, "mp_policy": mp}
    if ignored_params:  # parameters another parallelism owns (expert parallel): FSDP neither shards nor casts them
        common["ignored_params"] = ignored_params
    tied = getattr(model, "output", None) is not None and getattr(model, "tok_embeddings", None) is not None \
        and model.output.weight is model.tok_embeddings.weight
    layers = list(model.layers.values()) if getattr(model, "layers", None) is not None else []
    if getattr(model, "tok_embeddings", None) is not None and not tied:
        fully_shard(model.tok_embeddings, reshard_after_forward=_reshard_policy(reshard_after_forward, False), **common)
    for i, block in enumerate(layers):
        reshard = _reshard_policy(reshard_after_forward, i == len(layers) - 1)
        _shard_moe(block, expert_mesh, moe_mesh, mp, reshard, ignored_params)
        fully_shard(block, reshard_after_forward=reshard, **common)
    tail = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    if tail and not tied:
        # norm and output run last in forward and first in backward: resharding them would be a wasted gather.
        fully_shard(tail, reshard_after_forward=reshard_after_forward == "always", **common)
    # Tied embedding/output (and anything left) live in the root unit.
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **common)
    _sum_reductions(model, mesh.device_type)
    logger.info(f"applied {'HSDP' if mesh.ndim == 2 else 'FSDP'} over mesh {tuple(mesh.mesh.shape)}")
    return model


def _shard_moe(block: nn.Module, expert_mesh, moe_mesh, mp: MixedPrecisionPolicy, reshard: bool,
               ignored_params: set[nn.Parameter] | None) -> None:
    """Units of their own, inside the block's, for a block's MoE layer when its ranks differ from the block's.

    Expert parallel's weights (sharded over ep) go on `expert_mesh`, the ranks that hold replicas of the same
    experts (efsdp, x tp, x dp_replicate): FSDP shards them further there and sums their gradients over them. Under
    tensor parallel every tp rank runs the MoE layer on its own tokens (torchtitan/distributed/tensor_parallel.py),
    so the layer's other parameters go on `moe_mesh` (dp_shard x cp x tp), whose reduce-scatter sums over tp too."""
    moe = getattr(block, "moe", None)
    if moe is None:
        return
    if expert_mesh is not None:
        fully_shard(moe.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard)
    if moe_mesh is not None:
        fully_shard(moe, mesh=moe_mesh, mp_policy=mp, reshard_after_forward=reshard,
                    **({"ignored_params": ignored_params} if ignored_params else {}))


def apply_moe_fsdp(model: nn.Module, moe_mesh, *, reduce_dtype: str, reshard_after_forward: str,
                   ignored_params: set[nn.Parameter] | None = None, expert_mesh=None) -> nn.Module:
    """Tensor parallel without data parallel: only the MoE layers get FSDP units (`_shard_moe`), for the sum of
    their gradients over tp. The rest of the model stays unwrapped, and so does its precision: parameters stay
    float32 here, as everywhere autocast does mixed precision."""
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=_DTYPES[reduce_dtype])
    layers = list(model.layers.values()) if getattr(model, "layers", None) is not None else []
    for i, block in enumerate(layers):
        _shard_moe(block, expert_mesh, moe_mesh, mp, _reshard_policy(reshard_after_forward, i == len(layers) - 1),
                   ignored_params)
    _sum_reductions(model, moe_mesh.device_type)
    logger.info(f"applied FSDP to the MoE layers over {moe_mesh.size()} tensor-parallel ranks")
    return model


def _sum_reductions(model: nn.Module, device_type: str) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
            elif device_type == "cpu":
                # without the switch FSDP would issue PREMUL_SUM, which gloo rejects; NCCL supports it
                raise RuntimeError("this torch version cannot force SUM reductions in FSDP, which gloo needs")


def _sum_allreduce_hook(state: tuple, bucket):
    """DDP communication hook: SUM (not the default average) of each gradient bucket, in the reduce dtype.

    `state` is (group, reduce dtype). No annotation on `bucket` on purpose: DDP checks it against
    dist.GradBucket, and postponed (string) annotations from `from __future__ import annotations` fail that
    check. A bfloat16 reduction halves the bytes on the wire; the sum is cast back into the float32 bucket.
    """
    group, reduce_dtype = state
    buffer = bucket.buffer()
    wire = buffer if buffer.dtype == reduce_dtype else buffer.to(reduce_dtype)
    fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

    def unpack(f):
        out = f.value()[0]
        return out if out.dtype == buffer.dtype else buffer.copy_(out)

    return fut.then(unpack)


def apply_ddp(model: nn.Module, mesh, *, reduce_dtype: str = "float32") -> nn.Module:
    """Replicate the whole model over the 1-D dp_replicate mesh (fully-qualified names stay unchanged)."""
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
    model.register_comm_hook((mesh.get_group(), _DTYPES[reduce_dtype]), _sum_allreduce_hook)
    logger.info(f"applied DDP over {mesh.size()} replicas (gradients reduced in {reduce_dtype})")
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn DDP's gradient all-reduce on (last micro-batch) or off (the others); call before the forward.

    DDP all-reduces the *accumulated* `.grad` after every backward, so with M micro-batches on W ranks
    micro-batch m would be counted W^(M-1-m) times: it must reduce once, after the last. FSDP2 needs nothing:
    it reduce-scatters each micro-batch's fresh gradient into the sharded `.grad`, which is correct (and
    keeps gradient memory sharded), so FSDP/HSDP models are left alone.
    """
    if not isinstance(model, FSDPModule) and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters that a no-grad forward (validation) left behind.

    Measured (torch 2.13): FSDP modules built with reshard_after_forward=False (the last block, norm and output,
    the root) keep their parameters gathered after a forward under no_grad, and the next training step then
    computes no gradient for them (with reshard "never" the whole gradient was zero). Resharding restores the
    state a training forward expects.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
