"""Run one estimation in a forked child process: each rank's fake process group, and the DTensor caches keyed by
mesh shape (which would keep the previous rank's groups), die with the child. Used by scripts/estimate_memory.py
and the dry run (torchtitan/estimation/dry_run.py)."""

from __future__ import annotations

import traceback

from torchtitan.config.errors import ConfigError


def in_child(fn, *args):
    """fn(*args) in a forked child; its ConfigError comes back as a ConfigError, anything else as a RuntimeError
    carrying the child's traceback."""
    import multiprocessing as mp

    def child(queue) -> None:
        try:
            queue.put(("ok", fn(*args)))
        except ConfigError as e:
            queue.put(("config", str(e)))
        except BaseException:  # noqa: BLE001  (reported by the parent)
            queue.put(("error", traceback.format_exc()))

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    kind, value = queue.get()
    proc.join()
    if kind == "config":
        raise ConfigError(value)
    if kind == "error":
        raise RuntimeError(value)
    return value
