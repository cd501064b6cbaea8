"""Dry run of a training job at its real size, on one CPU, in seconds: nothing is allocated, no process group.

    python scripts/dry_run.py --world-size 512 --job.config_file train_configs/llama3_405b.toml \
        [--section.key value ...] [--device h100] [--memory-gib 80] [--reserve-gib 3] [--no-verdict] [--json] \
        [--jobs N]

Takes the same TOML and overrides as training and prints (1) the resolved layout: mesh dimensions, derived views,
batch and accumulation; (2) the pipeline stage split and schedule; (3) for the first rank of every pipeline rank,
its parameters after the trainer's parallelize code ran (global and local shapes, placements, bytes of parameters,
gradients and optimizer state), built on meta under a fake process group; (4) the memory estimator's peak and a
FITS / DOES NOT FIT verdict. A config problem is the trainer's one-line error, exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

_T0 = time.perf_counter()  # before torch's import, so the time printed is the whole run but the interpreter's start

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.config.errors import ConfigError  # noqa: E402
from torchtitan.config.manager import load_config  # noqa: E402
from torchtitan.estimation import dry_run  # noqa: E402
from torchtitan.estimation.report import (  # noqa: E402
    DEFAULT_GPU_RESERVE_GIB,
    add_target_arguments,
    device_capacity_gib,
)


def main(argv: list[str] | None = None) -> int:
    start = _T0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks (NGPU x NNODES)")
    add_target_arguments(parser)
    parser.add_argument("--no-verdict", action="store_true",
                        help="skip the memory estimate (layout, stages and parameters only)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="pipeline ranks built and estimated at once, each in its own process (default: CPUs)")
    opts, config_args = parser.parse_known_args(argv)
    target = "cpu" if opts.device.lower() == "cpu" else "cuda"
    try:
        if opts.world_size < 1:
            raise ConfigError(f"--world-size must be >= 1, got {opts.world_size}")
        cfg, resolved = load_config(config_args, opts.world_size)
        if target == "cpu" and opts.memory_gib is None:
            capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / dry_run.GIB
        else:
            capacity = device_capacity_gib(opts.device, opts.memory_gib)
        reserve = opts.reserve_gib if opts.reserve_gib is not None else \
            (0.0 if target == "cpu" else DEFAULT_GPU_RESERVE_GIB)
        lay = dry_run.layout(cfg, resolved, opts.world_size, target)
        split = dry_run.stage_split(resolved, opts.world_size)
        ranks = dry_run.representative_ranks(resolved, opts.world_size)
        # One child per pipeline rank's parameter table and per estimate, --jobs at a time, the estimates (the long
        # ones) first. Shapes that the config check cannot see (heads not divisible by tp, ...) fail in
        # parallelize: also ConfigErrors, raised here from the child.
        calls = [] if opts.no_verdict else dry_run.estimate_calls(cfg, opts.world_size, ranks, target)
        calls += [(dry_run.rank_params, (cfg, resolved, opts.world_size, r, target)) for r in ranks]
        results = dry_run.in_children(calls, opts.jobs)
        params = results[len(calls) - len(ranks):]
        result = None if opts.no_verdict else dry_run.verdict(results[:len(ranks)], capacity, reserve)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    model = f"{cfg.model.name}/{cfg.model.flavor}"
    if opts.json:
        print(json.dumps({"model": model, "config_file": cfg.job.config_file, "layout": lay, "pipeline": split,
                          "parameters": [dataclasses.asdict(p) for p in params], "verdict": result,
                          "device": opts.device, "seconds": seconds}))
        return 0
    print(f"dry run: {model} ({cfg.job.config_file or 'defaults'}) on {opts.world_size} ranks; no process group, "
          "model built on meta under a fake process group, nothing allocated")
    lines = dry_run.render_layout(lay) + dry_run.render_stages(split)
    for p in params:
        lines += dry_run.render_params(p, resolved.parallel_dims.pp)
    if result is not None:
        lines += dry_run.render_verdict(result, opts.device)
    print("\n".join(lines))
    print(f"done in {seconds:.1f} s, including imports ({len(ranks)} rank(s) built and estimated {opts.jobs} at a "
          "time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
