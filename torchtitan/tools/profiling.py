"""Profiling: torch.profiler traces and CUDA memory snapshots of every `profiling.profile_freq`-th step.

The trainer wraps its loop and calls `step()` once after each training step:

    with maybe_profile(cfg.profiling, dump_folder, rank, device_type, first_step, last_step) as prof:
        for step in range(first_step, last_step + 1):
            ...train step...
            prof.step()

Files (every rank writes its own; how to read them: docs/performance.md):
    <dump_folder>/<save_traces_folder>/iteration_<N>/rank<r>_trace.json              Chrome trace of step N
    <dump_folder>/memory_snapshot/iteration_<N>/rank<r>_memory_snapshot.pickle        allocator state after step N
    <dump_folder>/memory_snapshot/iteration_<N>_oom/rank<r>_memory_snapshot.pickle    step N ran out of memory

Inside a trace, torch's own "ProfilerStep#k" labels count from the start of profiling (k = 0 is `first_step`);
the folder name is the training step.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from torchtitan.config.job_config import Profiling
from torchtitan.config.manager import ConfigError
from torchtitan.tools.logging import logger

# Steps run under the profiler, recording nothing, right before each traced step: the first steps of a profiler
# session pay its start-up (CUPTI initialisation on CUDA), which would otherwise land in the traced step.
WARMUP_STEPS = 2
MEMORY_SNAPSHOT_FOLDER = "memory_snapshot"
# The allocator history is a ring buffer of this many alloc/free events, so its memory stays bounded on long
# runs; the snapshot holds the newest events, i.e. the steps just before the dump.
MEMORY_HISTORY_MAX_ENTRIES = 100_000


def check_profiling_device(cfg: Profiling, device_type: str) -> None:
    """Fail fast (before any process group exists) on settings this device cannot honour."""
    if cfg.enable_memory_snapshot and device_type != "cuda":
        raise ConfigError("profiling.enable_memory_snapshot: needs a CUDA GPU (it records the CUDA caching "
                          f"allocator's history); this machine runs on {device_type}")


def trace_schedule(first_step: int, freq: int, warmup: int = WARMUP_STEPS,
                   last_step: int | None = None) -> Callable[[int], ProfilerAction]:
    """torch.profiler schedule: record exactly the training steps that are multiples of `freq`.

    The profiler numbers its steps from 0 at entry, and the trainer enters it right before `first_step`.
    Warmup is capped at freq - 1 so it never overlaps the previous traced step. With `last_step` given, there is
    no warmup for a traced step past it, so the profiler does not start up for a step that never runs.
    """
    warmup = max(0, min(warmup, freq - 1))

    def action(profiler_step: int) -> ProfilerAction:
        step = first_step + profiler_step
        to_next = -step % freq  # steps until the next multiple of freq (0: this one)
        if last_step is not None and step + to_next > last_step:
            return ProfilerAction.NONE
        if to_next == 0:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.WARMUP if to_next <= warmup else ProfilerAction.NONE

    return action


def _is_oom(exc: BaseException | None) -> bool:
    # Follow the cause/context chain: compile and distributed wrappers re-raise an OOM as their own error.
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class NullProfiler:
    """What maybe_profile returns when profiling is off: every call is an empty method."""

    def __enter__(self) -> NullProfiler:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def step(self) -> None:
        return None

    def save_oom_snapshot(self, exc: BaseException) -> Path | None:
        return None


class StepProfiler:
    """Traces and/or memory snapshots every `cfg.profile_freq` steps; use through maybe_profile()."""

    def __init__(self, cfg: Profiling, dump_folder: str | Path, rank: int, device_type: str, first_step: int,
                 last_step: int | None = None):
        self.freq, self.rank, self.device_type = cfg.profile_freq, rank, device_type
        self.trace_root = Path(dump_folder) / cfg.save_traces_folder
        self.snapshot_root = Path(dump_folder) / MEMORY_SNAPSHOT_FOLDER
        self.enable_trace, self.enable_memory = cfg.enable_profiling, cfg.enable_memory_snapshot
        self.last_done = first_step - 1  # the last training step that completed
        self._saving: int | None = None  # the step whose trace may be written right now
        self._profiler: torch.profiler.profile | None = None
        self._recording_memory = False
        self._oom_saved = False
        if self.enable_memory:
            check_profiling_device(cfg, device_type)
        if self.enable_trace:
            activities = [ProfilerActivity.CPU]
            if device_type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities, schedule=trace_schedule(first_step, self.freq, last_step=last_step),
                on_trace_ready=self._write_trace, record_shapes=True,
            )

    def __enter__(self) -> StepProfiler:
        if self.enable_memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_MAX_ENTRIES)
            self._recording_memory = True
        if self._profiler is not None:
            self._profiler.__enter__()
        return self

    def step(self) -> None:
        """Call once after every training step, the last one included (that is when its trace is written)."""
        self.last_done += 1
        if self._profiler is not None:
            self._saving = self.last_done
            try:
                with warnings.catch_warnings():
                    # Each trace is meant to hold one step, so torch's notice that a new cycle drops the
                    # previous cycle's events is expected here.
                    warnings.filterwarnings("ignore", message=".*Profiler clears events", category=UserWarning)
                    self._profiler.step()
            finally:
                self._saving = None
        if self._recording_memory and self.last_done % self.freq == 0:
            self._dump_snapshot(f"iteration_{self.last_done}")

    def save_oom_snapshot(self, exc: BaseException) -> Path | None:
        """If `exc` is (or wraps) a CUDA OOM and history is being recorded, dump it once; return the file."""
        if not (self._recording_memory and not self._oom_saved and _is_oom(exc)):
            return None
        self._oom_saved = True
        return self._dump_snapshot(f"iteration_{self.last_done + 1}_oom")

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            try:
                self.save_oom_snapshot(exc)  # before the history is switched off below
            except Exception as e:  # noqa: BLE001 - the training error, not this one, must reach the caller
                logger.warning(f"profiling: could not save the out-of-memory snapshot: {e}")
        if self._profiler is not None:
            # A step that had begun but not finished is not saved (see _write_trace).
            self._profiler.__exit__(exc_type, exc, tb)
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        # torch calls this when a recorded step ends: from step(), or from __exit__ for a step that never
        # completed (training stopped or failed inside it), which has no trace worth keeping.
        if self._saving is None:
            return
        folder = self.trace_root / f"iteration_{self._saving}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_trace.json"
        start = time.perf_counter()
        prof.export_chrome_trace(str(path))
        logger.info(f"profiling: trace of step {self._saving} saved to {path} "
                    f"({time.perf_counter() - start:.1f} s)")

    def _dump_snapshot(self, name: str) -> Path:
        folder = self.snapshot_root / name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_memory_snapshot.pickle"
        start = time.perf_counter()
        torch.cuda.memory._dump_snapshot(str(path))
        logger.info(f"profiling: memory snapshot saved to {path} ({time.perf_counter() - start:.1f} s); "
                    "open it at pytorch.org/memory_viz")
        return path


def maybe_profile(cfg: Profiling, dump_folder: str | Path, rank: int, device_type: str, first_step: int,
                  last_step: int | None = None) -> StepProfiler | NullProfiler:
    """The profiler context for a loop over steps first_step..last_step; a NullProfiler when both are off."""
    if not (cfg.enable_profiling or cfg.enable_memory_snapshot):
        return NullProfiler()
    return StepProfiler(cfg, dump_folder, rank, device_type, first_step, last_step)


def allocator_peak(prof, *, since_start: bool = False) -> int:
    """Highest sum of live CPU allocations during a `torch.profiler.profile(profile_memory=True)` run, replayed from
    its allocator events (every allocation and free, with its size and time): memory measured independently of
    the memory estimator, for its accuracy tests and the benchmarks.

    Two corrections make gloo runs repeatable (measured: a TP 2 run's peak varied by up to 8 MiB between identical
    runs, and is now within 2 MiB, mostly to the byte):
    - only allocations of the thread that made most of them (the program's) count: gloo's own threads allocate
      temporaries (8 MiB of an FSDP all-gather) at moments that move with scheduling, which NCCL keeps outside the
      allocator altogether;
    - a block whose address is handed out again was freed before that, even when no free was recorded: the profiler
      does not see a free on a thread it does not record, as when gloo's thread drops a finished collective's work
      and with it the collective's input.

    since_start: count only memory allocated while profiling. A free of older memory (in a process that measured
    another layout before) is then skipped rather than lowering the sum."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr, node.start_tid))
    return replay_peak(events, since_start=since_start)


def replay_peak(events: list[tuple[int, int, int, int]], *, since_start: bool = False) -> int:
    """allocator_peak's replay of (time, size: + allocated / - freed, address, thread) events."""
    allocations_by_thread = Counter(tid for _, size, _, tid in events if size > 0)
    program = allocations_by_thread.most_common(1)[0][0] if allocations_by_thread else None
    live = peak = 0
    alive: dict[int, int] = {}  # address -> size of the counted blocks allocated and not freed yet
    other_threads: set[int] = set()  # addresses of blocks another thread allocated (not counted)
    for _, size, ptr, tid in sorted(events):
        if size > 0:
            live -= alive.pop(ptr, 0)  # the earlier block at this address was freed unseen
            other_threads.discard(ptr)
            if tid != program:
                other_threads.add(ptr)
                continue
            alive[ptr] = size
            live += size
            peak = max(peak, live)
        elif ptr in alive:
            live -= alive.pop(ptr)
        elif ptr in other_threads:
            other_threads.discard(ptr)
        elif not since_start:
            live += size  # memory allocated before profiling
    return peak
