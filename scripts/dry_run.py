"""Dry run of a training job at its real size, on one CPU, in seconds: nothing is allocated, no process group.

    python scripts/dry_run.py --world-size 512 --job.config_file train_configs/llama3_405b.toml \
        [--section.key value ...] [--device h100] [--memory-gib 80] [--reserve-gib 3] [--no-verdict] [--json] \
        [--jobs N]

Takes the same TOML and overrides as training and prints (1) the resolved layout: mesh dimensions, derived views,
batch and accumulation; (2) the pipeline stage split and schedule; (3) for the first rank of every pipeline rank,
its parameters after the trainer's parallelize code ran (global and local shapes, placements, bytes of parameters,
gradients and optimizer state), built on meta under a fake process group; (4) the memory estimator's peak and a
FITS / DOES NOT FIT verdict and, when it does not fit, advice: the smallest changes that fit, cheapest for
throughput first, each estimated again and printed as overrides ready to paste (`--no-advice` skips the search;
torchtitan/estimation/advice.py). A config problem is the trainer's one-line error.

Exit codes: 0 the job fits (or --no-verdict), 3 it does not fit, 2 bad input (a config error naming its key, a bad
argument), 1 the estimate itself failed (traceback).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

from torchtitan.config.errors import ConfigError  # noqa: E402
from torchtitan.config.manager import load_config  # noqa: E402
from torchtitan.estimation import advice, dry_run  # noqa: E402
from torchtitan.estimation.engine import estimate  # noqa: E402
from torchtitan.estimation.forked import in_child  # noqa: E402
from torchtitan.estimation.report import (  # noqa: E402
    DEFAULT_GPU_RESERVE_GIB,
    add_target_arguments,
    device_capacity_gib,
)
from torchtitan.tools import startup_gc  # noqa: E402


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
    advice.add_advice_arguments(parser)
    parser.epilog = advice.EXIT_CODES
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
        gpus_per_node = advice.checked_gpus_per_node(opts.world_size, opts.gpus_per_node, opts.advice_estimates)
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
        return advice.EXIT_BAD_INPUT
    if result is None:
        adv, code = advice.not_given("--no-verdict"), advice.EXIT_FITS
    else:
        code = advice.exit_code(result["fits"])
        if result["fits"]:
            adv = advice.not_given("the job fits")
        elif opts.no_advice:
            adv = advice.not_given("--no-advice")
        else:
            # Each change's pipeline ranks one after another (the first that does not fit ends that change), each in
            # a forked child as above.
            adv = advice.advise(config_args, opts.world_size, gpus_per_node, capacity, reserve,
                                results[:len(ranks)], lambda c, w, r: in_child(estimate, c, w, r, target),
                                opts.advice_estimates)
    seconds = time.perf_counter() - start
    model = f"{cfg.model.name}/{cfg.model.flavor}"
    if opts.json:
        print(json.dumps({"model": model, "config_file": cfg.job.config_file, "layout": lay, "pipeline": split,
                          "parameters": [dataclasses.asdict(p) for p in params], "verdict": result,
                          "advice": adv, "device": opts.device, "seconds": seconds}))
        return code
    print(f"dry run: {model} ({cfg.job.config_file or 'defaults'}) on {opts.world_size} ranks; no process group, "
          "model built on meta under a fake process group, nothing allocated")
    lines = dry_run.render_layout(lay) + dry_run.render_stages(split)
    for p in params:
        lines += dry_run.render_params(p, resolved.parallel_dims.pp)
    if result is not None:
        lines += dry_run.render_verdict(result, opts.device)
        if not result["fits"]:
            lines += advice.render_advice(adv, "scripts/dry_run.py")
    print("\n".join(lines))
    print(f"done in {seconds:.1f} s, including imports ({len(ranks)} rank(s) built and estimated {opts.jobs} at a "
          "time)")
    return code


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    sys.exit(main())
