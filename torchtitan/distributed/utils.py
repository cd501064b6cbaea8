"""Process-group setup, determinism, reductions, gradient clipping, layout-invariant init and the exit path."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.tools import device as device_tools
from torchtitan.tools.logging import logger


def env_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; a plain `python -m` run is one process."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
    )


def init_distributed(timeout_s: int) -> torch.device:
    """Pick the device (cuda or cpu) and create the default process group with the matching backend."""
    rank, local_rank, world_size = env_world()
    device_type = device_tools.device_type()
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"rank {rank}: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    kwargs = {"device_id": device} if device_type == "cuda" else {}
    dist.init_process_group(
        backend=device_tools.distributed_backend(),
        timeout=timedelta(seconds=timeout_s),
        rank=rank,
        world_size=world_size,
        **kwargs,
    )
    return device


def set_pg_timeout(timeout_s: int) -> None:
    """Shorten the timeout once the first step (compilation, first collectives) is behind us."""
    try:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
    except (AttributeError, ValueError, RuntimeError) as e:  # private API: keep the initial timeout if it moves
        logger.warning(f"could not shorten the process-group timeout: {e}")


def set_determinism(seed: int, deterministic: bool) -> None:
    """The same seed on every rank: parameters are initialised layout-invariantly (see param_init)."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before the first cuBLAS call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def all_reduce(value: torch.Tensor, mesh, op: str = "sum") -> torch.Tensor:
    """Reduce a (scalar) tensor over a 1-D mesh view; returns a new tensor. op: sum | max."""
    out = value.detach().clone()
    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(out, op=red, group=mesh.get_group())
    return out


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Total L2 norm of all gradients (DTensor or plain); clip to max_norm when max_norm > 0.

    For sharded (DTensor) gradients the per-rank norm is a partial value: `full_tensor()` reduces it over the
    mesh the gradients live on, so every rank gets the same global norm. Later issues add the PP-stage and
    expert/non-expert combinations (see docs/architecture.md, 'Gradient clipping').
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def param_init(param: torch.Tensor, init_fn: Callable[[torch.Tensor], object]) -> None:
    """Initialise a parameter so every layout holds the values one process would have drawn.

    A sharded DTensor initialised in place draws the same local random numbers on every rank (CPU
    generators have no per-shard offset), so layouts would start differently. Instead draw the full
    tensor with the shared generator state (every rank consumes the generator identically), then keep this
    rank's shard. Costs one full-size temporary per parameter.
    """
    if not isinstance(param, DTensor):
        init_fn(param)
        return
    full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
    init_fn(full)
    # src_data_rank=None: every rank already holds the identical full tensor, so slice locally, no comms.
    local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    param.to_local().copy_(local)


def record_failure(exc: BaseException) -> None:
    """Write the exception to torchrun's per-rank error file, so the launcher's failure summary shows this
    rank's message even when LOG_RANK hides the rank's own output."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
    except Exception as e:  # reporting must never mask the original failure
        logger.warning(f"could not record the failure for the launcher: {e}")


def exit_process(code: int) -> None:
    """Flush everything, leave the process group, then exit without the interpreter's shutdown.

    gloo's worker threads can abort the process (SIGABRT) while Python tears down modules even after all
    work succeeded (see docs/architecture.md, 'The exit path'): os._exit skips that teardown so the exit
    code tells the truth.
    """
    if dist.is_available() and dist.is_initialized() and code == 0:
        try:
            dist.destroy_process_group()
        except Exception as e:  # an exit path must not raise
            logger.warning(f"destroy_process_group failed: {e}")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
