"""MoE routing under several balance settings, side by side in one run (one process, CPU or one GPU).

    python scripts/moe_balance_study.py --config train_configs/debug_moe.toml --steps 60 \
        --variant default= --variant off="--moe.load_balance_coeff 0 --moe.aux_loss_coeff 0" [--n-layers 4] \
        [--json out.json] [-- overrides for every variant]

Each variant trains the config from the same initialisation and data with its own overrides (`name=overrides`;
`default=` is the config as shipped) through the trainer itself. Per variant it prints, over the last `--window`
steps: the worst layer's busiest expert over the mean load (mean and max over the steps), the most idle experts in a
layer, the expert-parallel load factor for EP degrees 2, 4, 8, 16, 64 (the busiest EP rank's routed rows over a balanced
share, from the global counts per expert, experts split over ranks in order as expert parallel does; what
memory_estimation.expert_load_factor must cover), the loss, and tokens/s and MFU (median after 3 steps).
`--n-layers N` cuts the flavor to its first N blocks (e.g. Qwen3-30B-A3B's block shape on one GPU). Results are
in docs/models.md and docs/performance.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import one_process  # noqa: E402
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

from torchtitan.tools import startup_gc  # noqa: E402

EP_DEGREES = (2, 4, 8, 16, 64)


def ep_load_factor(counts, degree: int) -> float:
    """The busiest of `degree` ranks' rows over the mean, experts split over the ranks in contiguous blocks."""
    per_rank = counts.view(degree, -1).sum(dim=1).double()
    return float(per_rank.max() / per_rank.mean().clamp_min(1e-9))


def run_variant(argv: list[str], dump: str) -> list[dict]:
    """Train one variant; per step its logged metrics plus the EP load factors of its worst layer."""
    import torch

    from torchtitan.config.manager import load_config
    from torchtitan.train import Trainer

    cfg, resolved = load_config([*argv, "--job.dump_folder", dump], 1)
    trainer = Trainer(cfg, resolved, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    experts = trainer.moe_args.num_experts
    factors: list[dict] = []

    def after_step(step: int) -> None:
        factors.append({f"ep{d}_load": max(ep_load_factor(c, d) for c in trainer.moe_counts.values())
                        for d in EP_DEGREES if experts % d == 0})

    trainer.train(after_step=after_step)
    trainer.close()
    metrics = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines() if line]
    return [{**m, **f} for m, f in zip(metrics, factors, strict=True)]


def summarise(steps: list[dict], window: int) -> dict:
    last = steps[-window:]

    def mean(key):
        values = [s[key] for s in last if s.get(key) is not None]
        return statistics.fmean(values) if values else None

    timed = [s for s in steps[3:] if s.get("tps")]
    out = {"load_mean": mean("moe_load_max_over_mean"), "load_max": max(s["moe_load_max_over_mean"] for s in last),
           "idle_max": max(s["moe_idle_experts_max"] for s in last), "loss": mean("loss"),
           "tps": statistics.median(s["tps"] for s in timed) if timed else None,
           "mfu": statistics.median(s["mfu"] for s in timed) if timed and timed[0].get("mfu") is not None else None}
    for key in last[0]:
        if key.startswith("ep") and key.endswith("_load"):
            out[key] = mean(key)
    return out


def main() -> None:
    argv = sys.argv[1:]
    common = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="TOML file in train_configs/")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--window", type=int, default=10, help="summarise the last this many steps")
    parser.add_argument("--variant", action="append", required=True, help='name=overrides, e.g. off="--moe..."')
    parser.add_argument("--n-layers", type=int, default=0, help="cut the flavor to its first N blocks")
    parser.add_argument("--json", default="", help="write every step of every variant here")
    opts = parser.parse_args(argv)

    base = one_process.start(opts.config, opts.steps, common, opts.n_layers)
    import torch
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for i, variant in enumerate(opts.variant):
            name, _, overrides = variant.partition("=")
            try:
                steps = run_variant([*base, *shlex.split(overrides)], f"{tmp}/{i}")
            except Exception:  # noqa: BLE001 - one failed variant must not lose the others' numbers
                traceback.print_exc()
                continue
            results[name] = steps
            gc.collect()  # the variant's trainer is gone: give its memory back before the next one
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            rows.append((name, summarise(steps, opts.window)))
            if opts.json:  # after every variant: a run cut short keeps what it finished
                Path(opts.json).write_text(json.dumps({"summary": dict(rows), "steps": results}, indent=1))
    if not rows:
        raise SystemExit("every variant failed")
    keys = list(rows[0][1])
    print(f"\nlast {opts.window} of {opts.steps} steps; load = worst layer's busiest expert over the mean")
    print("| variant | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, row in rows:
        print(f"| {name} | " + " | ".join("-" if row[k] is None else f"{row[k]:.3f}" if isinstance(row[k], float)
                                          else str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    main()
