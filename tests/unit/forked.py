"""Run a function on N gloo ranks forked from the clean fork server (tests/forking.py; about 1 s for 2 ranks)
and collect the results. Every worker ends with os._exit so gloo's exit-time abort cannot turn a pass into a
failure (see docs/architecture.md).
"""

from __future__ import annotations

import os
import queue as _queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.forking import CTX as _CTX
from torchtitan.distributed.utils import wait_for_peers


def _worker(fn: Callable, rank: int, world: int, store: str, queue: Any, args: tuple) -> None:
    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        out = fn(rank, *args)
        wait_for_peers()  # no rank leaves while another still receives its last collective's data
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
    # A file rendezvous, not a TCP port: a port found free here can be taken by another pytest worker's ranks before
    # rank 0 listens on it (EADDRINUSE, seen on the 2-core CI machine). gloo's own connections take OS-given ports.
    store = os.path.join(tempfile.mkdtemp(prefix="run_ranks_"), "store")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, store, queue, args)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failed = True
    try:
        for rank, err, out in _collect(queue, procs, world, timeout):
            assert err is None, f"rank {rank} failed:\n{err}"
            results[rank] = out
        failed = False
    finally:
        _reap(procs, failed)
        shutil.rmtree(os.path.dirname(store), ignore_errors=True)
    return [results[r] for r in range(world)]


def _collect(queue: Any, procs: list, count: int, timeout: float) -> Any:
    """Yield `count` results from the queue, failing at once when a child dies without sending one.

    A child killed by a signal (a heap corruption abort, the OOM killer) never answers; waiting out `timeout` then
    costs minutes of a 2-core CI run and hides which process died.
    """
    deadline = time.monotonic() + timeout
    received = 0
    dead_since: float | None = None
    while received < count:
        try:
            item = queue.get(timeout=0.5)
        except _queue.Empty:
            item = None
        if item is None:
            now = time.monotonic()
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                # A child that failed normally put its traceback first; give the feeder a moment to deliver it.
                dead_since = dead_since or now
                if now - dead_since > 1.0:
                    raise AssertionError("; ".join(f"process {i} exited with {_describe(code)} without a result"
                                                   for i, code in dead))
            if now > deadline:
                raise TimeoutError(f"{count - received} of {count} results missing after {timeout:.0f} s")
            continue
        received += 1
        yield item


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"code {exitcode}"


def _reap(procs: list, kill_now: bool) -> None:
    for p in procs:
        if kill_now and p.is_alive():
            p.kill()
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


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
    failed = True
    try:
        ((err, out),) = list(_collect(queue, [proc], 1, timeout))
        failed = False
    finally:
        _reap([proc], failed)
    assert err is None, f"child failed:\n{err}"
    return out


def _main_child(fn: Callable, args: tuple, env: dict[str, str | None], cwd: str | None, out: str, err: str) -> None:
    code = 1
    try:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if cwd is not None:
            os.chdir(cwd)
        # At the file descriptors, not sys.stdout/sys.stderr: output from handlers that captured the stream objects
        # earlier (logging) and from C++ lands in the files too, as in a subprocess's pipes.
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        fn(*args)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_main(fn: Callable, *args: Any, env: dict[str, str | None] | None = None, cwd: str | os.PathLike | None = None,
             timeout: float = 120.0) -> tuple[int, str, str]:
    """fn(*args) as a command-line program in a child of the fork server: (exit code, stdout, stderr), as
    subprocess.run would give them for `python -m ...`, without a new interpreter importing torch (~5 s of CPU on
    2 cores). SystemExit and os._exit give the exit code, an exception 1 with its traceback on stderr. `env` sets
    variables in the child (None removes one); the child starts with the environment the fork server started with.
    """
    import tempfile

    ctx = _CTX
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")

        def read(path: str) -> str:
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()

        for path in (out, err):
            open(path, "w").close()  # there to read even if the child dies before redirecting
        proc = ctx.Process(target=_main_child, args=(fn, args, env or {}, None if cwd is None else str(cwd), out, err))
        proc.start()
        proc.join(timeout=timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
            raise TimeoutError(f"{getattr(fn, '__name__', fn)}{args} did not exit within {timeout} s; stderr:\n"
                               f"{read(err)[-3000:]}")
        return proc.exitcode, read(out), read(err)
