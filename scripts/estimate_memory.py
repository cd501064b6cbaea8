"""Estimate the per-GPU peak memory of a training config and layout on a CPU-only machine.

    python scripts/estimate_memory.py --world-size 8 --device h100 --job.config_file train_configs/llama3_8b.toml \
        [--section.key value ...] [--rank 0] [--memory-gib 80] [--reserve-gib 3] [--json]

Takes the same TOML and overrides as training. Runs the trainer's own model build and parallelize code for one
rank on fake tensors with a fake process group (nothing is materialised), two training steps, and prints the
peak with a breakdown, the phase of the peak, an analytic cross-check and a fits / does-not-fit verdict.
`--device cpu` estimates a CPU (gloo) run as the trainer does it there: fp32 whatever the config says.

When the job does not fit it prints advice: the smallest changes that fit (activation checkpointing, more FSDP ranks
or nodes, tensor or pipeline parallel, a smaller local batch, a shorter sequence), cheapest for throughput first, each
estimated again by the same engine and printed as overrides ready to paste (`--no-advice` skips the search,
`--advice-estimates N` bounds it; torchtitan/estimation/advice.py).

Exit codes: 0 the job fits, 3 it does not fit, 2 bad input (a config error naming its key, a bad argument), 1 the
estimate itself failed (traceback).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

from torchtitan.config.errors import ConfigError  # noqa: E402
from torchtitan.config.manager import load_config  # noqa: E402
from torchtitan.estimation import advice  # noqa: E402
from torchtitan.estimation.engine import estimate  # noqa: E402
from torchtitan.estimation.forked import in_child  # noqa: E402
from torchtitan.estimation.report import (  # noqa: E402
    DEFAULT_GPU_RESERVE_GIB,
    add_target_arguments,
    analytic,
    as_json,
    device_capacity_gib,
    fits,
    render,
)
from torchtitan.tools import startup_gc  # noqa: E402
from torchtitan.tools.device import host_memory_bytes  # noqa: E402


def _estimate_in_child(cfg, world_size: int, rank: int, target: str, exact: bool):
    try:
        return in_child(functools.partial(estimate, exact=exact), cfg, world_size, rank, target)
    except RuntimeError as e:
        raise RuntimeError(f"estimating rank {rank} failed:\n{e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks (NGPU x NNODES)")
    parser.add_argument("--rank", type=int, default=None,
                        help="which rank to estimate (default 0; with pipeline parallel, one rank of every stage, "
                             "the worst reported)")
    add_target_arguments(parser)
    parser.add_argument("--exact", action="store_true",
                        help="run every transformer block instead of extrapolating from two shallower models")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    advice.add_advice_arguments(parser)
    parser.epilog = advice.EXIT_CODES
    opts, config_args = parser.parse_known_args(argv)
    try:
        if opts.world_size < 1:
            raise ConfigError(f"--world-size must be >= 1, got {opts.world_size}")
        if opts.rank is not None and not 0 <= opts.rank < opts.world_size:
            raise ConfigError(f"--rank {opts.rank} is outside the world of {opts.world_size} ranks")
        # Resolved as the trainer resolves it, so the layout and batch printed are the ones estimated.
        cfg, resolved = load_config(config_args, opts.world_size)
        parallel_dims = resolved.parallel_dims
        target = "cpu" if opts.device.lower() == "cpu" else "cuda"
        capacity = host_memory_bytes() / 1024**3 if target == "cpu" and opts.memory_gib is None else \
            device_capacity_gib(opts.device, opts.memory_gib)
        gpus_per_node = advice.checked_gpus_per_node(opts.world_size, opts.gpus_per_node, opts.advice_estimates)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return advice.EXIT_BAD_INPUT
    reserve = opts.reserve_gib
    if reserve is None:
        reserve = 0.0 if target == "cpu" else DEFAULT_GPU_RESERVE_GIB
    ranks = [opts.rank or 0]
    if opts.rank is None and resolved.pipeline is not None:
        # pp is the outermost mesh dimension: pipeline rank r's first rank is r x (world / pp).
        ranks = [r * (opts.world_size // parallel_dims.pp) for r in range(parallel_dims.pp)]
    # Every rank in a forked child, also a single one: the advice's estimates fork from this process, and must not
    # inherit a fake process group's leftovers (DTensor's mesh-keyed caches) from an estimate made in it.
    def estimate_fn(c, world_size, rank):
        return _estimate_in_child(c, world_size, rank, target, opts.exact)

    try:
        per_rank = [estimate_fn(cfg, opts.world_size, rank) for rank in ranks]
    except ConfigError as e:  # shapes only the parallelize code checks (heads not divisible by tp, ...)
        print(f"error: {e}", file=sys.stderr)
        return advice.EXIT_BAD_INPUT
    est = max(per_rank, key=lambda e: e.peak_bytes)
    fit = fits(est.peak_bytes, capacity, reserve)
    if fit:
        adv = advice.not_given("the job fits")
    elif opts.no_advice:
        adv = advice.not_given("--no-advice")
    else:
        adv = advice.advise(config_args, opts.world_size, gpus_per_node, capacity, reserve, per_rank, estimate_fn,
                            opts.advice_estimates)
    stages = []
    if resolved.pipeline is not None:
        plan = resolved.pipeline
        for e in per_rank:
            pp_rank = e.rank // (opts.world_size // parallel_dims.pp)
            names = [f"{s} ({plan.module_fqns[s][0]}..{plan.module_fqns[s][-1]})" for s in plan.stage_ids(pp_rank)]
            stages.append({"pp_rank": pp_rank, "rank": e.rank, "stages": names, "peak_bytes": e.peak_bytes,
                           "peak_phase": e.peak_phase})
    dtype = cfg.training.mixed_precision_param if target == "cuda" else "float32"
    closed_form = analytic(cfg, parallel_dims, est, 2 if dtype == "bfloat16" else 4)
    pd = parallel_dims
    layout = (f"dp_replicate {pd.dp_replicate} x dp_shard {pd.dp_shard} x tp {pd.tp}, "
              f"{cfg.model.name}/{cfg.model.flavor}, batch {cfg.training.local_batch_size} x seq "
              f"{cfg.training.seq_len} x {resolved.grad_accum_steps} accumulation steps, "
              f"AC {cfg.activation_checkpoint.mode}, {dtype}")
    if resolved.pipeline is not None:
        layout += f", pp {parallel_dims.pp} ({resolved.pipeline.schedule})"
    if opts.json:
        print(json.dumps({**as_json(est, closed_form, capacity, reserve, opts.device, layout),
                          "pipeline_stages": stages, "advice": adv}))
    else:
        if stages:
            print("peak per pipeline rank (its stages):")
            for st in stages:
                worst = "  <- worst, reported below" if st["rank"] == est.rank else ""
                print(f"  pp rank {st['pp_rank']} (rank {st['rank']}), stages {', '.join(st['stages'])}: "
                      f"{st['peak_bytes'] / 2**30:.2f} GiB during {st['peak_phase']}{worst}")
        print(render(est, closed_form, capacity, reserve, opts.device, layout))
        if not fit:
            print("\n".join(advice.render_advice(adv, "scripts/estimate_memory.py")))
    return advice.exit_code(fit)


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    sys.exit(main())
