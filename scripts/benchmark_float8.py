"""bf16 against float8 (each torchao recipe) side by side in one run, through the trainer (one process, one GPU or
CPU): tokens/s, its ratio to the first variant, MFU (counted with bf16 FLOPs, as every run reports it), the loss
and the peak memory.

    python scripts/benchmark_float8.py --config train_configs/llama3_8b.toml --steps 30 --n-layers 8 \
        [--variants bf16,tensorwise,tensorwise_all_gather,rowwise,rowwise_with_gw_hp] [--all-layers] \
        [-- overrides for all]

The GPU workload of docs/float8.md: the 8B block shape cut to 8 blocks, seq 8192, `-- --compile.enable true
--training.local_batch_size 1 --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op`
with a local `--training.dataset_path`. Every variant converts torchao's default layers (`float8.skip_small_layers`),
starts from the same initialisation and data, and reports the median over the steps after `--warmup`.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import one_process  # noqa: E402
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

from torchtitan.tools import startup_gc  # noqa: E402

FLOAT8 = ["--model.converters", "float8"]
VARIANTS = {
    "bf16": [],
    "tensorwise": FLOAT8,
    "tensorwise_all_gather": [*FLOAT8, "--float8.enable_fsdp_float8_all_gather", "true",
                              "--float8.precompute_float8_dynamic_scale_for_fsdp", "true"],
    "rowwise": [*FLOAT8, "--float8.recipe_name", "rowwise"],
    "rowwise_with_gw_hp": [*FLOAT8, "--float8.recipe_name", "rowwise_with_gw_hp"],
}


def run_variant(argv: list[str], dump: str) -> list[dict]:
    """Train one variant; its logged metrics per step."""
    import torch

    from torchtitan.config.manager import load_config
    from torchtitan.train import Trainer

    cfg, resolved = load_config([*argv, "--job.dump_folder", dump], 1)
    trainer = Trainer(cfg, resolved, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    trainer.train()
    trainer.close()
    return [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines() if line]


def summarise(steps: list[dict], warmup: int) -> dict:
    timed = [s for s in steps[warmup:] if s.get("tps")] or steps[-1:]

    def median(key: str) -> float | None:
        values = [s[key] for s in timed if s.get(key) is not None]
        return statistics.median(values) if values else None

    memory = [s.get("mem/max_reserved_gib", s.get("mem/max_rss_gib")) for s in steps]
    return {"tps": median("tps"), "mfu": median("mfu"), "loss": steps[-1]["loss"],
            "max_mem_gib": max((m for m in memory if m is not None), default=None)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    common = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="train_configs/debug_model.toml", help="TOML file in train_configs/")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians (compile, allocator)")
    parser.add_argument("--n-layers", type=int, default=0, help="cut the flavor to its first N blocks")
    parser.add_argument("--all-layers", action="store_true",
                        help="float8 variants convert every layer with dimensions divisible by 16, however small "
                             "(float8.skip_small_layers false; the debug models' layers are all below the thresholds)")
    parser.add_argument("--json", default="", help="write every step of every variant here")
    opts = parser.parse_args(argv)
    unknown = [v for v in opts.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")

    base = one_process.start(opts.config, opts.steps, common, opts.n_layers)
    import torch
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in opts.variants.split(","):
            extra = ["--float8.skip_small_layers", "false"] if opts.all_layers and VARIANTS[name] else []
            results[name] = run_variant([*base, *VARIANTS[name], *extra], f"{tmp}/{name}")
            rows.append((name, summarise(results[name], opts.warmup)))
            gc.collect()  # the variant's trainer is gone: give its memory back before the next one
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if opts.json:  # after every variant: a run cut short keeps what it finished
                Path(opts.json).write_text(json.dumps({"summary": dict(rows), "steps": results}, indent=1))
    first = rows[0][1]["tps"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{device}, torch {torch.__version__}; medians of steps {opts.warmup + 1}-{opts.steps}")
    print("| variant | tokens/s | vs first | MFU | loss at the end | max memory GiB |")
    print("|---|---|---|---|---|---|")
    for name, row in rows:
        ratio = f"{row['tps'] / first:.2f}" if row["tps"] and first else "-"
        mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1f}%"
        mem = "-" if row["max_mem_gib"] is None else f"{row['max_mem_gib']:.2f}"
        print(f"| {name} | {row['tps']:.0f} | {ratio} | {mfu} | {row['loss']:.4f} | {mem} |")


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    main()
