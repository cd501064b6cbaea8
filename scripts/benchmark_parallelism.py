"""Training throughput of parallel layouts at equal world size, and compile on/off, as ratios in one run.

    python scripts/benchmark_parallelism.py [--world 2] [--steps 30] [--seq-len 256] [--config ...] [-- overrides]

Each layout is a real `run_train.sh` launch of the same config and global batch; tokens/s per process is the
median of the logged steps after the first few (compilation and warm-up excluded). Layouts:
  fsdp            FSDP over all ranks (the baseline, ratio 1.00)
  tp              TP over all ranks (sequence + loss parallel)
  fsdp_x_tp       FSDP world/2 x TP 2 (world >= 4)
  ... + compile   the same with per-block torch.compile
On CPU the numbers say what the extra collectives of TP cost relative to FSDP's, and how much compile helps
on this machine; on GPUs run it with NGPU-sized worlds and a bigger model for real MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def layouts(world: int) -> list[tuple[str, list[str]]]:
    tp = ["--parallelism.tensor_parallel_degree", str(world)]
    out = [("fsdp", []), ("tp", tp)]
    if world >= 4 and world % 2 == 0:
        out.append(("fsdp_x_tp", ["--parallelism.tensor_parallel_degree", "2"]))
    compiled = [(f"{name}+compile", [*args, "--compile.enable", "true"]) for name, args in out]
    return out + compiled


def run(name: str, world: int, args: list[str], workdir: Path, warmup: int) -> dict:
    dump = workdir / name
    env = {**os.environ, "NGPU": str(world), "PYTHON": sys.executable, "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor")}
    cmd = [str(REPO / "run_train.sh"), "--job.dump_folder", str(dump), "--metrics.log_freq", "1",
           "--job.print_config", "false", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["step"] > warmup]
    return {"tps": statistics.median(r["tps"] for r in steady), "loss": records[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="processes per layout")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the median")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--config", default=str(REPO / "train_configs" / "debug_model.toml"))
    parser.add_argument("--only", default="", help="comma-separated layout names to run")
    parser.add_argument("overrides", nargs="*", help="extra --section.key value overrides (after --)")
    a = parser.parse_args()
    common = ["--job.config_file", a.config, "--training.steps", str(a.steps), "--training.seq_len", str(a.seq_len),
              "--training.global_batch_size", str(a.global_batch), "--checkpoint.enable", "false",
              "--validation.enable", "false", *a.overrides]
    chosen = [(n, args) for n, args in layouts(a.world) if not a.only or n in a.only.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in chosen:
            dp = a.world // (a.world if name.startswith("tp") else 2 if name.startswith("fsdp_x_tp") else 1)
            local_batch = max(1, a.global_batch // dp)
            results[name] = run(name, a.world, [*common, "--training.local_batch_size", str(local_batch), *args],
                                Path(tmp), a.warmup)
            print(f"{name:22s} {results[name]['tps']:10.1f} tokens/s per process", flush=True)
    base = results.get("fsdp")
    print(f"\nworld {a.world}, seq {a.seq_len}, global batch {a.global_batch}, {a.steps} steps, config {a.config}")
    print(f"{'layout':22s} {'tokens/s/proc':>14s} {'vs fsdp':>8s} {'final loss':>11s}")
    for name, r in results.items():
        ratio = f"{r['tps'] / base['tps']:.2f}" if base else "-"
        print(f"{name:22s} {r['tps']:14.1f} {ratio:>8s} {r['loss']:11.4f}")


if __name__ == "__main__":
    main()
