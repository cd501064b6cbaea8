"""Process-group setup, determinism, reductions, gradient clipping, layout-invariant init and the exit path."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan.models.random_fill import Fill
from torchtitan.tools import device as device_tools
from torchtitan.tools.logging import logger


def env_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; a plain `python -m` run is one process."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
    )


def init_distributed(timeout_s: int, trace_buf_size: int = 0, trace_folder: str | os.PathLike | None = None
                     ) -> torch.device:
    """Pick the device (cuda or cpu) and create the default process group with the matching backend.

    trace_buf_size > 0 turns the flight recorder on (the last collectives of every group, for hang
    diagnosis): it must be set in the environment before the first process group exists. On NCCL the
    watchdog also dumps it by itself when a collective times out (`dump_comm_traces` covers gloo).
    """
    rank, local_rank, world_size = env_world()
    device_type = device_tools.device_type()
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"rank {rank}: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    os.environ.update(flight_recorder_env(trace_buf_size, trace_folder, device_type))
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


def flight_recorder_env(trace_buf_size: int, trace_folder: str | os.PathLike | None, device_type: str
                        ) -> dict[str, str]:
    """Environment that turns on torch's flight recorder (read when a process group is created)."""
    if trace_buf_size <= 0:
        return {}
    env = {"TORCH_FR_BUFFER_SIZE": str(trace_buf_size)}  # the old TORCH_NCCL_TRACE_BUFFER_SIZE only warns now
    if device_type == "cuda" and trace_folder is not None:
        # NCCL's watchdog writes `<prefix><rank>` when a collective times out, before it tears the process down
        # (the exception may never reach Python there).
        Path(trace_folder).mkdir(parents=True, exist_ok=True)
        env.update({"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": str(Path(trace_folder) / "rank")})
    return env


def dump_comm_traces(trace_folder: str | os.PathLike, rank: int) -> Path | None:
    """Write this rank's flight-recorder buffer (JSON) after a failed or timed-out collective; None if the
    recorder is off or this torch cannot dump it."""
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")) <= 0:
        return None
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return None
    try:
        data = dump(includeCollectives=True, onlyActive=False)  # everything recorded, finished or not
    except Exception as e:  # diagnosis must never mask the failure being diagnosed
        logger.warning(f"could not dump the flight recorder: {e}")
        return None
    path = Path(trace_folder) / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else str(data).encode())
    return path


def set_training_timeout(timeout_s: int, keep: Iterable[dist.ProcessGroup] = ()) -> int:
    """Give every process group (the default one, every mesh dimension's, every flattened view's) the training
    timeout, once the first step (compilation, first collectives) is behind us; groups in `keep` (e.g. the
    checkpoint group, which legitimately waits on the filesystem) keep theirs. Returns how many changed.

    A hang inside FSDP or TP runs on a mesh subgroup, not on the default group: shortening only the default
    group's timeout would leave real hangs waiting for the start-up timeout.
    """
    kept = {id(g) for g in keep if g is not None}
    changed = 0
    for group in list(dist.distributed_c10d._world.pg_map):
        if id(group) in kept or dist.distributed_c10d._rank_not_in_group(group):
            continue
        try:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
            changed += 1
        except (AttributeError, ValueError, RuntimeError) as e:  # private API: keep the initial timeout if it moves
            logger.warning(f"could not shorten the timeout of process group {group.group_name}: {e}")
    return changed


def set_determinism(seed: int, deterministic: bool) -> None:
    """The same seed on every rank: parameters are initialised layout-invariantly (see param_init).

    Both switches are set either way, so a process that builds several trainers (the parity tests) never
    inherits deterministic mode from an earlier one.
    """
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before the first cuBLAS call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False


def all_reduce(value: torch.Tensor, mesh, op: str = "sum") -> torch.Tensor:
    """Reduce a (scalar) tensor over a 1-D mesh view; returns a new tensor. op: sum | max."""
    out = value.detach().clone()
    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(out, op=red, group=mesh.get_group())
    return out


def mixed_precision_autocast(parallel_dims, param_dtype: str, device_type: str):
    """The context the forward runs in: bf16 autocast where nothing else casts the parameters, else a no-op.

    FSDP's mixed-precision policy casts parameters itself; DDP and unwrapped models (data-parallel degree 1)
    keep fp32 parameters, so bf16 training there comes from autocast. Shared by the trainer and the estimator.
    """
    if parallel_dims.autocast_enabled and param_dtype == "bfloat16":
        return torch.autocast(device_type, torch.bfloat16)
    return contextlib.nullcontext()


def total_grad_norm(parameters: Iterable[torch.nn.Parameter], pp_mesh=None) -> torch.Tensor:
    """Global L2 norm of all gradients (DTensor or plain), accumulated in float64, the same on every rank.

    Accumulated in float64 because the CPU float32 norm kernel sums one long sequential chain: on an
    8192 x 256 gradient it came out 3.9e-4 low, and differently for every shard count, so each layout would
    log (and clip by) a slightly different norm. Gradients living on different meshes (expert vs dense,
    pipeline stages later) are reduced per mesh and combined as a sum of squares: DTensor cannot stack
    values of different meshes. For a DTensor group the norm comes back reduced over every mesh dimension the
    gradients are sharded on (torch 2.13's vector_norm all-reduces the partial squares itself, in one all-reduce where
    a flattened group exists; `full_tensor()` then only unwraps it, and reduces it where a version leaves it
    partial; see docs/architecture.md, 'Gradient clipping'). tests/unit/test_critical_reductions.py checks the value
    against exact sums of the full gradients. With pipeline parallel each rank holds other stages'
    parameters: the squares are then summed over `pp_mesh` as well.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    squares = []
    for grads in groups.values():
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
        group_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        if isinstance(group_norm, DTensor):
            group_norm = group_norm.full_tensor()
        squares.append(group_norm.square())
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    if pp_mesh is not None and pp_mesh.size() > 1:
        total = total.to(pp_mesh.device_type)  # NCCL reduces device tensors only
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    return total.sqrt()


def clip_grads_(parameters: Iterable[torch.nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / total_norm); max_norm <= 0 leaves them alone.

    The scale multiplies each gradient's local tensor: one scalar commutes with every placement (a shard, a
    replica, a pending sum), so no collective is needed, and DTensor's dispatch of a foreach op over all gradients
    would propagate shardings per gradient (cold, 0.25 s of a 4-rank FSDP x TP parity layout's first step, every
    step hashing the whole list after). The factor is computed in the gradients' dtype, as
    `torch.nn.utils.clip_grads_with_norm_` does, so the foreach multiply takes its same-dtype path."""
    if max_norm <= 0:
        return
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            groups.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), grads in groups.items():
        norm = total_norm.to(device=device, dtype=dtype)
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Total gradient norm (see total_grad_norm), then clip to max_norm when max_norm > 0."""
    params = list(parameters)
    total = total_grad_norm(params)
    clip_grads_(params, max_norm, total)
    return total


def param_init(param: torch.Tensor, init_fn: Callable[[torch.Tensor], object]) -> None:
    """Initialise a parameter so every layout holds the values one process would have drawn.

    A sharded DTensor initialised in place by a torch generator would draw the same local random numbers on every
    rank (CPU generators have no per-shard offset). The models' fills (torchtitan/models/random_fill.py) are
    functions of (seed, element index) instead: each rank fills only its own shard, the box of the whole tensor
    that its placements give it, with the whole tensor's values there, and no full-size temporary (peak: the shard
    and a bounded chunk). Any other fill draws the full tensor with the shared generator state (every rank consumes
    it identically) and keeps this rank's shard, at the cost of one full-size temporary.
    """
    if not isinstance(param, DTensor):
        init_fn(param)
        return
    local = param.to_local()
    if isinstance(init_fn, Fill):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if tuple(shape) == tuple(local.shape):
            init_fn.fill_box(local, tuple(param.shape), tuple(offset))
            return
    full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
    init_fn(full)
    # src_data_rank=None: every rank already holds the identical full tensor, so slice locally, no comms.
    shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_(shard)


# What a collective raises on a rank whose peer died (gloo's TCP pairs, NCCL's abort): a consequence, not a cause.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def lost_a_peer(exc: BaseException) -> bool:
    """True when `exc` only says that another rank went away. That rank's own error is the evidence (the launcher
    names the first rank that failed); a traceback here would bury it in the log."""
    return any(text in str(exc) for text in _PEER_LOST)


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


EXIT_WAIT_SECONDS = 60.0
"""How long a rank that finished waits for the others before it leaves anyway (a peer failed or hangs)."""


def wait_for_peers(timeout_s: float = EXIT_WAIT_SECONDS) -> bool:
    """A rank that finished waits, on the rendezvous store (not a collective), until every rank has finished.

    gloo marks a collective complete on a rank once that rank has its result, possibly before a peer has the rank's
    own contribution; a rank that then leaves closes its connections under the peer, whose last collective fails
    with "Connection closed by peer" after a run that succeeded (docs/architecture.md, "The exit path"). Past this
    point every rank has returned from its last collective. False: some rank did not arrive in `timeout_s`."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    from torch.distributed.distributed_c10d import _get_default_store

    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = _get_default_store()
        store.set(f"torchtitan/finished/{rank}", "1")
        store.wait([f"torchtitan/finished/{r}" for r in range(world)], timedelta(seconds=timeout_s))
        return True
    except Exception as e:  # noqa: BLE001 - a timeout, or the store's host gone after everyone arrived
        logger.warning(f"rank {rank}: not every rank reached the end within {timeout_s:.0f} s: {e}")
        return False


def exit_process(code: int) -> None:
    """Flush everything, leave the process group, then exit without the interpreter's shutdown.

    gloo's worker threads can abort the process (SIGABRT) while Python tears down modules even after all
    work succeeded (see docs/architecture.md, 'The exit path'): os._exit skips that teardown so the exit
    code tells the truth.
    """
    if dist.is_available() and dist.is_initialized() and code == 0:
        wait_for_peers()
        try:
            dist.destroy_process_group()
        except Exception as e:  # an exit path must not raise
            logger.warning(f"destroy_process_group failed: {e}")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
