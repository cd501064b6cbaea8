"""A persistent group of forked gloo ranks that runs one test layout after another.

Starting ranks costs seconds (torchrun: 6 s for 2 ranks, 20 s for 8 on 2 cores); a layout of the parity suite
trains for about as long. So each world size gets one pool per test session: its ranks are forked once from
the clean fork server (tests/forking.py), create the default process group once, through the trainer's own
`init_distributed`, and then run layouts on request. Each layout builds its own DeviceMesh (and subgroups) on
that default group; a rank logs its open file descriptors before each request, since subgroups stay alive
(see parity.run_layout for why).

A failure anywhere (an exception on one rank, a timeout) kills the whole pool: the other ranks may be blocked in
a collective that will never complete. The next request starts a fresh pool.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import time
import traceback
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from tests.forking import CTX, free_port


class PoolError(AssertionError):
    """A rank failed or the pool timed out; the message holds the traceback and every rank's log tail."""


def _serve(rank: int, world: int, port: int, conn, env: dict[str, str], log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        os.environ.update(env)
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        import torch

        from torchtitan.distributed.utils import init_distributed
        from torchtitan.tools.logging import init_logger

        torch.set_num_threads(1)
        init_logger()
        init_distributed(timeout_s=int(env.get("POOL_INIT_TIMEOUT", "60")),
                         trace_buf_size=int(env.get("POOL_TRACE_BUF_SIZE", "0")))
        _build_each_mesh_once()
        conn.send(("ready", None))
        while True:
            try:
                message = conn.recv()
            except EOFError:
                break
            if message is None:
                break
            fn, args = message
            fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1
            print(f"=== {getattr(fn, '__name__', fn)} (open fds {fds}) {args!r:.300}", flush=True)
            try:
                conn.send(("ok", fn(*args)))
            except BaseException:  # noqa: BLE001 - the parent decides; this rank reports and waits
                conn.send(("error", traceback.format_exc()))
    except BaseException:  # noqa: BLE001
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        os._exit(0)  # never run gloo's teardown (see docs/architecture.md, 'The exit path')


def _build_each_mesh_once() -> None:
    """Layouts of the same degrees share one world mesh (and its flattened views) in this rank.

    Each new gloo group brings its own transport device, whose event loop wakes every few milliseconds even when
    idle: measured 2026-11-26, after six layouts a 4-rank pool's ranks held 121 threads each and burnt 10% of a core
    each while waiting for the next request, time the 2-core machine lost for the rest of the suite. Equal meshes
    mean the same ranks in the same roles, so reusing them changes nothing a layout computes (DTensor already
    caches its sharding decisions per equal mesh, see parity.run_layout).
    """
    from torchtitan.distributed.parallel_dims import ParallelDims

    build = ParallelDims.build_mesh
    built: dict[tuple, tuple] = {}

    def build_once(self, device_type: str):
        key = (device_type, self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp, self.ep, self.efsdp,
               self.etp)
        if key not in built:
            built[key] = (build(self, device_type), dict(self._views))
        self._world_mesh, views = built[key]
        self._views = dict(views)
        return self._world_mesh

    ParallelDims.build_mesh = build_once


class RankPool:
    def __init__(self, world: int, log_dir: Path, env: dict[str, str] | None = None, start_timeout: float = 120.0):
        self.world = world
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self._conns, self._procs = [], []
        for rank in range(world):
            parent, child = CTX.Pipe()
            proc = CTX.Process(target=_serve, args=(rank, world, port, child, dict(env or {}),
                                                    str(self.log_dir / f"rank{rank}.log")))
            proc.start()  # not a daemon: a rank may start dataloader workers (it exits when its pipe closes)
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._gather(start_timeout, "starting the pool")

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args: Any, timeout: float = 180.0) -> list[Any]:
        """fn(*args) on every rank at once (a module-level function: it is pickled by name); the results by rank."""
        if not self.alive:
            raise PoolError("the pool is closed")
        for conn in self._conns:
            conn.send((fn, args))
        return self._gather(timeout, getattr(fn, "__name__", str(fn)))

    def _gather(self, timeout: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world:
            waiting = [c for r, c in enumerate(self._conns) if r not in results]
            ready = multiprocessing.connection.wait(waiting, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                missing = [r for r in range(self.world) if r not in results]
                self.close(kill=True)
                raise PoolError(f"{what}: ranks {missing} did not answer within {timeout:.0f} s\n{self.log_tails()}")
            for conn in ready:
                rank = self._conns.index(conn)
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    status, payload = "error", "the rank died (see its log)"
                if status == "error":
                    self.close(kill=True)
                    raise PoolError(f"{what}: rank {rank} failed:\n{payload}\n{self.log_tails()}")
                results[rank] = payload
        return [results[r] for r in range(self.world)]

    def log_tails(self, chars: int = 3000) -> str:
        parts = []
        for rank in range(self.world):
            path = self.log_dir / f"rank{rank}.log"
            text = path.read_text(errors="replace")[-chars:] if path.exists() else ""
            parts.append(f"--- rank {rank} log ({path}) ---\n{text}")
        return "\n".join(parts)

    def close(self, kill: bool = False) -> None:
        for conn in self._conns:
            try:
                if not kill:
                    conn.send(None)
                conn.close()
            except OSError:
                pass
        for proc in self._procs:
            if kill:
                proc.kill()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._conns, self._procs = [], []


# Distinct mesh shapes a pool serves before it is replaced by fresh processes. A job with a new mesh shape creates
# process groups, and gloo keeps threads for each (a TCP loop and run loops) until its process ends: measured
# 2026-11-24, a 4-rank pool's ranks held 1,033 threads each after ~30 layouts, and their polling took over half of the
# 2-core machine (57% system time, load average above 50) for the rest of the suite. Destroying a job's groups instead
# breaks the next job: DTensor caches flattened meshes by layout, with their (destroyed) groups. Equal meshes are
# reused (_build_each_mesh_once), so groups grow with the distinct shapes only, and jobs of a shape already served
# cost no new threads: a pool keeps serving them, with their sharding decisions already cached (a fresh 4-rank pool's
# first layout costs each rank ~4 s of CPU more than the next one, measured 2026-11-26). A job without a shape
# counts as a new one. MAX_JOBS_PER_POOL bounds what else a long-lived rank may accumulate.
SHAPES_PER_POOL = 6
MAX_JOBS_PER_POOL = 40


class Pools:
    """The 1-rank pool (the references) and one multi-rank pool, of the world size last asked for: created on first
    use, replaced after a failure, when it has served SHAPES_PER_POOL mesh shapes and another is asked for, and when
    another world size is asked for (an idle pool's gloo threads cost CPU the active one needs;
    tests/integration/test_parity.py orders its layouts by world size, then mesh shape)."""

    def __init__(self, log_dir: Path, env: dict[str, str]):
        self.log_dir, self.env = Path(log_dir), env
        self._pools: dict[int, RankPool] = {}
        self._jobs: dict[int, int] = {}
        self._shapes: dict[int, set] = {}
        self._generation = 0

    def get(self, world: int, shape: Hashable | None = None) -> RankPool:
        """The pool of `world` ranks for a job on mesh `shape` (any hashable naming the parallel degrees)."""
        for other in [w for w in self._pools if w not in (world, 1)]:
            self._pools.pop(other).close()
        pool = self._pools.get(world)
        shapes = self._shapes.setdefault(world, set())
        shape = object() if shape is None else shape
        if pool is not None and pool.alive and (self._jobs[world] >= MAX_JOBS_PER_POOL or
                                                (shape not in shapes and len(shapes) >= SHAPES_PER_POOL)):
            pool.close()
            pool = None
        if pool is None or not pool.alive:
            self._jobs[world] = 0
            shapes.clear()
            self._generation += 1
            pool = RankPool(world, self.log_dir / f"world{world}-{self._generation}", self.env)
            self._pools[world] = pool
        self._jobs[world] += 1
        shapes.add(shape)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
