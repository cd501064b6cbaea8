"""Run a function on N gloo ranks forked from the clean fork server (tests/forking.py; about 1 s for 2 ranks)
and collect the results. Every worker ends with os._exit so gloo's exit-time abort cannot turn a pass into a
failure (see docs/architecture.md).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.forking import CTX as _CTX
from tests.forking import free_port


def _worker(fn: Callable, rank: int, world: int, port: int, queue: Any, args: tuple) -> None:
    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        out = fn(rank, *args)
        # Tensors would cross as shared-memory handles that die with this process: send plain lists.
        queue.put((rank, None, torch.utils._pytree.tree_map(
            lambda t: t.tolist() if isinstance(t, torch.Tensor) else t, out)))
        code = 0
    except BaseException:
        queue.put((rank, traceback.format_exc(), None))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        queue.close()
        queue.join_thread()  # the result must be out of this process before os._exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_ranks(fn: Callable, *args: Any, world: int = 2, timeout: float = 120.0) -> list[Any]:
    ctx = _CTX
    port = free_port()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, queue, args)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, err, out = queue.get(timeout=timeout)
            assert err is None, f"rank {rank} failed:\n{err}"
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def _child(fn: Callable, queue: Any, args: tuple) -> None:
    code = 1
    try:
        queue.put((None, fn(*args)))
        code = 0
    except BaseException:
        queue.put((traceback.format_exc(), None))
    finally:
        queue.close()
        queue.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def in_child(fn: Callable, *args: Any, timeout: float = 300.0) -> Any:
    """fn(*args) in a child of the fork server (no process group); returns its picklable result.

    For work that leaves process-wide state behind (a fake process group registers group names that later
    process groups of forked test workers would resolve to): the pytest process itself stays clean.
    """
    ctx = _CTX
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, queue, args))
    proc.start()
    try:
        err, out = queue.get(timeout=timeout)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    assert err is None, f"child failed:\n{err}"
    return out
