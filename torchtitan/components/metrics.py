"""Training metrics: one call per logged step fans out to jsonl, TensorBoard, W&B and console.

``<dump_folder>/metrics.jsonl`` (``<dump_folder>/rank_<r>/metrics.jsonl`` with
``save_for_all_ranks``) holds one flat JSON object per ``log()`` call. Keys:

===========================  ==============================================================
``step``                     optimizer step (int), always present
``loss``                     mean training loss over the logged step(s)
``loss_max``                 max loss across data-parallel ranks
``grad_norm``                global gradient norm before clipping
``lr``                       learning rate
``tps``                      tokens per second per device
``tflops``                   achieved model TFLOP/s per device
``mfu``                      model FLOPs utilization in percent (absent/null when the
                             device peak is unknown)
``data_wait_pct``            percent of step time spent waiting for data
``mem/max_active_gib``       CUDA: peak bytes held by live tensors, GiB
``mem/max_active_pct``       CUDA: the same as percent of device memory
``mem/max_reserved_gib``     CUDA: peak bytes held by the caching allocator, GiB
``mem/max_reserved_pct``     CUDA: the same as percent of device memory
``mem/num_alloc_retries``    CUDA: cumulative cudaMalloc retries (fragmentation signal)
``mem/num_ooms``             CUDA: cumulative out-of-memory errors
``mem/rss_gib``              CPU: current resident set size, GiB
``mem/max_rss_gib``          CPU: peak resident set size, GiB
===========================  ==============================================================

Only keys the trainer passes appear; a key passed as None is written as ``null``. Other
keys are passed through unchanged, so new metrics need no change here. Memory keys may be
passed bare (as ``MemoryMonitor.snapshot()`` returns them) or already prefixed. Non-finite
floats are written as ``NaN``/``Infinity`` (Python's json extension, which ``json.loads``
and pandas read back): a diverged loss must stay visible. A resumed run appends to the file
(so it may repeat the steps an interrupted run logged after its last checkpoint; the later
line of a step is the resumed run's). A run that starts from step 0 never appends to another
run's file: an existing non-empty ``metrics.jsonl`` is first renamed to
``metrics.<its last write time>.jsonl``, and the log says so.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    # Only imported for type checkers: typing.Self does not exist at runtime on 3.10.
    from typing import Self

Number = float | int

# Keys produced by MemoryMonitor.snapshot(); they get the "mem/" prefix on disk.
MEMORY_KEYS = frozenset(
    {
        "max_active_gib",
        "max_active_pct",
        "max_reserved_gib",
        "max_reserved_pct",
        "num_alloc_retries",
        "num_ooms",
        "rss_gib",
        "max_rss_gib",
    }
)
_MEM_PREFIX = "mem/"

# Indirection so tests can drive the ETA clock deterministically.
_now = time.monotonic


def _as_number(value: Any) -> Number | None:
    # Trainers sometimes hand over 0-d tensors or numpy scalars; .item() unwraps both
    # without importing either library here.
    if isinstance(value, bool):
        return int(value)
    if value is None or isinstance(value, (int, float)):
        return value
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    return float(value)


def _flat_key(key: str) -> str:
    return _MEM_PREFIX + key if key in MEMORY_KEYS else key


def _fmt_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def _sig3(x: float) -> str:
    """Three significant digits without an exponent: 45.1, 0.0342 (a CPU run's TFLOP/s), 1,234."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _count(n: float) -> str:
    """Tokens seen: 812, 12.3K, 4.50M, 1.20B, 15.0T."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{_sig3(n / size)}{unit}"
    return f"{n:.0f}"


def _keep_apart_from_earlier_run(path: Path, resumed_after: int) -> None:
    """A resumed run continues `path`; a fresh run (resumed_after 0) renames another run's file out of the way, so
    one file never holds two runs' step 1 (readers such as scripts/loss_compare.py take a file as one run)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    if resumed_after:
        logger.info(f"resumed after step {resumed_after}: appending to {path}")
        return
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    moved = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
    n = 1
    while moved.exists():  # two earlier runs within one second
        moved, n = path.with_name(f"{path.stem}.{stamp}-{n}{path.suffix}"), n + 1
    path.rename(moved)
    logger.info(f"{path} held an earlier run's metrics and this run starts at step 1: moved it to {moved.name}")


class MetricsLogger:
    """Writes per-step metrics; every backend is optional except jsonl and console.

    By default only rank 0 writes anything. With ``save_for_all_ranks`` every rank
    writes its jsonl and TensorBoard files into ``<dump_folder>/rank_<r>/`` (useful to
    spot a straggler or a rank-local loss spike); console and W&B stay rank 0 only so
    a run is one W&B run and one readable log.
    """

    def __init__(
        self,
        *,
        dump_folder: str | Path,
        rank: int,
        total_steps: int,
        enable_tensorboard: bool = False,
        save_tb_folder: str = "tb",
        enable_wandb: bool = False,
        save_for_all_ranks: bool = False,
        run_config: dict[str, Any] | None = None,
        resumed_after: int = 0,
        started_at: float | None = None,
    ) -> None:
        self.rank = rank
        self.total_steps = total_steps
        self.dump_folder = Path(dump_folder)
        self._is_main = rank == 0
        self._writes_files = self._is_main or save_for_all_ranks
        self.jsonl_path: Path | None = None
        self._jsonl = None
        self._tb = None
        self._wandb_run = None
        self._closed = False
        self._last_step: int | None = None
        self._last_time: float | None = None
        self._per_step: float | None = None  # seconds per step over the last logging interval
        # The console's elapsed time counts from the trainer's start (set-up included), by the same clock as _now.
        self._start = _now() if started_at is None else started_at

        if not self._writes_files:
            return

        out_dir = self.dump_folder / f"rank_{rank}" if save_for_all_ranks else self.dump_folder
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = out_dir / "metrics.jsonl"
        _keep_apart_from_earlier_run(self.jsonl_path, resumed_after)
        # Held open for the whole run (closed in close()), flushed line by line;
        # append mode so a resumed run keeps its history.
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115

        if enable_tensorboard:
            # Imported lazily: torch.utils.tensorboard fails to import without the
            # tensorboard package, which runs that disable it should not need.
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = out_dir / save_tb_folder
            tb_dir.mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(log_dir=str(tb_dir))
            if self._is_main:
                logger.info("TensorBoard logs in %s", tb_dir)

        if enable_wandb and self._is_main:
            self._wandb_run = self._init_wandb(run_config)

    def _init_wandb(self, run_config: dict[str, Any] | None) -> Any:
        try:
            import wandb
        except ImportError as e:
            raise ImportError("enable_wandb is set but the wandb package is not installed") from e
        # W&B creates its own "wandb/" subfolder under dir; keeping it in the run's
        # dump folder puts every artifact of a run in one place.
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "torchtitan"),
            dir=str(self.dump_folder),
            config=run_config or {},
        )
        logger.info("W&B run %s in %s", getattr(run, "name", "?"), self.dump_folder)
        return run

    # ------------------------------------------------------------------ logging

    def log_histograms(self, step: int, histograms: dict[str, Any]) -> None:
        """TensorBoard histograms (1-D tensors, e.g. tokens per expert); other backends skip them."""
        if self._tb is None or not self._writes_files:
            return
        for key, values in histograms.items():
            self._tb.add_histogram(key, values, step)

    def log(self, step: int, metrics: dict[str, float | int | None]) -> None:
        """Record one step's metrics in every enabled backend and print one console line."""
        if not self._writes_files:
            return
        eta = self._update_eta(step, _now())

        values = {k: _as_number(v) for k, v in metrics.items() if k != "step"}
        flat = {_flat_key(k): v for k, v in values.items()}

        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **flat}) + "\n")
            # Flush per line: a crash (OOM kill, NCCL timeout) must not eat the
            # last minutes of metrics, which are the ones needed to debug it.
            self._jsonl.flush()

        if self._tb is not None:
            for key, value in flat.items():
                if value is not None:
                    self._tb.add_scalar(key, value, step)

        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in flat.items() if v is not None}, step=step)

        if self._is_main:
            logger.info(self.format_line(step, values, eta))

    def _update_eta(self, step: int, now: float) -> float | None:
        # Use the most recent interval rather than the run average: the first steps
        # include compilation and warm-up, which would skew a cumulative rate.
        eta = None
        if self._last_step is not None and self._last_time is not None and step > self._last_step:
            per_step = (now - self._last_time) / (step - self._last_step)
            eta = max(self.total_steps - step, 0) * per_step
            self._per_step = per_step
        self._last_step, self._last_time = step, now
        return eta

    def format_line(self, step: int, values: dict[str, Number | None], eta: float | None) -> str:
        """The compact console line; only fields that are present and non-None appear."""

        def get(key: str) -> Number | None:
            v = values.get(key)
            if v is None:
                v = values.get(_MEM_PREFIX + key)
            return v

        if self.total_steps > 0:
            width = len(str(self.total_steps))
            parts = [f"step {step:>{width}}/{self.total_steps}"]
        else:
            parts = [f"step {step}"]

        loss, loss_max = get("loss"), get("loss_max")
        if loss is not None:
            parts.append(f"loss {loss:.4f}" + (f" (max {loss_max:.4f})" if loss_max is not None else ""))
        elif loss_max is not None:
            parts.append(f"loss_max {loss_max:.4f}")
        if (g := get("grad_norm")) is not None:
            parts.append(f"gnorm {g:.3g}")
        if (lr := get("lr")) is not None:
            parts.append(f"lr {lr:.1e}")
        if (tps := get("tps")) is not None:
            parts.append(f"tps {tps:,.0f}")
        if (tf := get("tflops")) is not None:
            parts.append(f"tflops {_sig3(tf)}")
        if (mfu := get("mfu")) is not None:
            parts.append(f"mfu {mfu:.1f}%")
        if (mem := self._format_memory(get)) is not None:
            parts.append(mem)
        if (data := get("data_wait_pct")) is not None:
            parts.append(f"data {data:.1f}%")
        if (load := get("moe_load_max_over_mean")) is not None:
            parts.append(f"moe load {load:.2f}")  # busiest expert over the mean, worst MoE layer (1.00 = balanced)
        if (idle := get("moe_idle_experts_max")) is not None:
            parts.append(f"idle {idle}")  # most experts of one layer that got no token this step
        if (aux := get("moe_aux_loss")) is not None:
            parts.append(f"moe aux {aux:.4f}")
        if (z := get("moe_z_loss")) is not None:
            parts.append(f"moe z {z:.4f}")
        if (tokens := get("tokens_seen")) is not None:
            parts.append(f"tokens {_count(tokens)}")
        if eta is not None and self._per_step is not None:
            parts.append(f"{_sig3(self._per_step)}s/step")
        if self._last_time is not None:  # the time of this log call (_update_eta ran first)
            parts.append(f"elapsed {_fmt_eta(max(self._last_time - self._start, 0.0))}")
        if eta is not None and math.isfinite(eta):
            parts.append(f"eta {_fmt_eta(eta)}")
        return "  ".join(parts)

    @staticmethod
    def _format_memory(get: Any) -> str | None:
        # Reserved is the headline on CUDA: it is what the allocator holds and thus
        # what runs out first. On CPU the current RSS is the closest equivalent.
        gib, pct = get("max_reserved_gib"), get("max_reserved_pct")
        if gib is None:
            gib, pct = get("rss_gib"), None
        if gib is None:
            return None
        text = f"mem {gib:.1f}GiB" + (f"({pct:.0f}%)" if pct is not None else "")
        # Allocator retries and OOMs are rare but important; show them only when they occur.
        for key, label in (("num_alloc_retries", "retries"), ("num_ooms", "ooms")):
            count = get(key)
            if count:
                text += f" {label} {int(count)}"
        return text

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Flush and close every backend; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
