"""The few lines a run logs before step 1: the model, the layout actually applied, the training setup and the data.

Everything here is derived from the built objects (the mesh degrees, the pipeline plan, the data source), not
from the config alone: with expert parallel 2, the layout line says so. The whole resolved config is in
`<dump_folder>/job_config.json` (job.save_config_file) and printed only with `--job.print_config true`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims


def layout_line(dims: ParallelDims, loss_parallel: bool, pipeline: Any = None, local_batch_size: int = 1) -> str:
    """`world 8 = dp_replicate 1 x dp_shard 2 x cp 1 x tp 2 x pp 2; ep 2 x etp 1; ...`: every mesh dimension, then
    the expert mesh (MoE only sees it), loss parallel and the pipeline's schedule and this rank's stages."""
    degrees = " x ".join(f"{name} {getattr(dims, name)}" for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp"))
    line = f"layout: world {dims.world_size} = {degrees}; experts ep {dims.ep} x etp {dims.etp}"
    if dims.tp > 1:
        line += f"; loss parallel {'on' if loss_parallel else 'off'}"
    if pipeline is not None:
        plan = pipeline.plan
        stages = ", ".join(f"{s}: {plan.module_fqns[s][0]}..{plan.module_fqns[s][-1]}" for s in pipeline.stage_ids)
        line += (f"; pipeline {plan.schedule}, {plan.num_stages} stages, {plan.n_microbatches(local_batch_size)} "
                 f"micro-batches, this rank's stages {stages}")
    return line


def training_line(cfg: JobConfig, dims: ParallelDims, grad_accum_steps: int, param_dtype: str, device: Any) -> str:
    """Batch arithmetic, activation checkpointing, compile and dtypes as this run applies them."""
    t, ac = cfg.training, cfg.activation_checkpoint
    global_batch = t.local_batch_size * dims.dp_degree * grad_accum_steps
    ac_text = ac.mode if ac.mode != "selective" else f"selective ({ac.selective_ac_option})"
    compiled = ", ".join(cfg.compile.components) if cfg.compile.enable else "off"
    return (f"training: global batch {global_batch} sequences of {t.seq_len} tokens = local {t.local_batch_size} x "
            f"dp {dims.dp_degree} x {grad_accum_steps} accumulation steps; activation checkpointing {ac_text}; "
            f"compile {compiled}; params {param_dtype}, reduce {t.mixed_precision_reduce}; device {device}")


def data_line(cfg: JobConfig, source: Any) -> str:
    """Where training batches come from, in every case: the registry's corpus, a local or hub dataset, token shards
    written by scripts/pretokenize.py, or a mixture."""
    t = cfg.training
    if t.dataset_mixture:
        return f"data: mixture of {len(t.dataset_mixture)} sources: {', '.join(t.dataset_mixture)}"
    from torchtitan.data.pretokenized import PretokenizedSource

    if isinstance(source, PretokenizedSource):
        return f"data: pre-tokenized shards in {source.name}"
    documents = getattr(source, "num_documents", None)
    count = f", {documents:,} documents" if documents else ""
    if t.dataset_path:
        return f"data: {t.dataset_path} (column '{t.dataset_text_column}', split '{t.dataset_split}'{count})"
    return f"data: registry dataset '{t.dataset}'{count}"


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux's /proc; None elsewhere): the interpreter's start and the imports
    come before any code of ours can take the time."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Where the time from process start to the end of step 1 goes, one `mark(phase)` at the end of each phase;
    `line()` is the console's one-line breakdown (docs/performance.md reads GPU start-ups from it)."""

    def __init__(self) -> None:
        self.before = process_age_seconds()  # interpreter, imports and the process group, before the trainer
        self.last = time.monotonic()
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases.append((phase, now - self.last))
        self.last = now

    def line(self) -> str:
        # "process": the interpreter, the imports and the process group, before the trainer existed
        parts = [(f"process {self.before:.1f}", self.before)] if self.before is not None else []
        parts += [(f"{name} {seconds:.1f}", seconds) for name, seconds in self.phases]
        total = sum(seconds for _, seconds in parts)
        return f"start-up: {total:.1f} s to the end of step 1 = " + " + ".join(text for text, _ in parts) + " s"
