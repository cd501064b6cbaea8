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
) -> nn.Module:
    """Shard each transformer block, the embedding, and norm+output as units; the root holds the rest.

    `mesh` is 1-D (FSDP) or 2-D (replicate, shard) for HSDP. Reductions are forced to plain SUM: gloo has
    no PREMUL_SUM, and with a divide factor of 1 FSDP would otherwise pick AVG on a 1-rank NCCL group,
    which torch documents as unreliable.
    """
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    common = {"mesh": mesh, "mp_policy": mp}
    tied = getattr(model, "output", None) is not None and getattr(model, "tok_embeddings", None) is not None \
        and model.output.weight is model.tok_embeddings.weight
    layers = list(model.layers.values()) if getattr(model, "layers", None) is not None else []
    if getattr(model, "tok_embeddings", None) is not None and not tied:
        fully_shard(model.tok_embeddings, reshard_after_forward=_reshard_policy(reshard_after_forward, False), **common)
    for i, block in enumerate(layers):
        fully_shard(block, reshard_after_forward=_reshard_policy(reshard_after_forward, i == len(layers) - 1), **common)
    tail = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    if tail and not tied:
        # norm and output run last in forward and first in backward: resharding them would be a wasted gather.
        fully_shard(tail, reshard_after_forward=reshard_after_forward == "always", **common)
    # Tied embedding/output (and anything left) live in the root unit.
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **common)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
            elif mesh.device_type == "cpu":
                # without the switch FSDP would issue PREMUL_SUM, which gloo rejects; NCCL supports it
                raise RuntimeError("this torch version cannot force SUM reductions in FSDP, which gloo needs")
    logger.info(f"applied {'HSDP' if mesh.ndim == 2 else 'FSDP'} over mesh {tuple(mesh.mesh.shape)}")
    return model


def _sum_allreduce_hook(group, bucket):
    """DDP communication hook: SUM (not the default average) of each gradient bucket.

    No annotations on purpose: DDP checks them against dist.GradBucket, and postponed (string) annotations
    from `from __future__ import annotations` fail that check."""
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def apply_ddp(model: nn.Module, mesh) -> nn.Module:
    """Replicate the whole model over the 1-D dp_replicate mesh (fully-qualified names stay unchanged)."""
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
    model.register_comm_hook(mesh.get_group(), _sum_allreduce_hook)
    logger.info(f"applied DDP over {mesh.size()} replicas")
    return model
