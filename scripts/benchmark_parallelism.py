"""Training throughput of parallel layouts at equal world size, and compile on/off, as ratios in one run; with
--pipeline, the bubble of every pipeline schedule against its textbook value, and PP's throughput against FSDP's;
with --context, context parallel's peak memory and throughput per device against FSDP's as the sequence grows.

    python scripts/benchmark_parallelism.py [--world 2] [--steps 30] [--seq-len 256] [--config ...] [-- overrides]
    python scripts/benchmark_parallelism.py --pipeline [--schedules GPipe,1F1B,...] [--microbatches 2,4,8]
        [--pp-steps 8] [--pp-warmup 2] [--throughput-schedules 1F1B,Interleaved1F1B] [--pp-split JSON] [-- overrides]
    python scripts/benchmark_parallelism.py --context [--world 2] [--seq-lens 2048,4096,8192] [--cp-degrees 1,2]
        [--context-steps 6] [--context-warmup 2] [-- overrides]

Each layout is a real `run_train.sh` launch of the same config and global batch; tokens/s per process is the
median of the logged steps after the first few (compilation and warm-up excluded). Layouts:
  fsdp            FSDP over all ranks (the baseline, ratio 1.00)
  tp              TP over all ranks (sequence + loss parallel)
  fsdp_x_tp       FSDP world/2 x TP 2 (world >= 4)
  ... + compile   the same with per-block torch.compile
On CPU the numbers say what the extra collectives of TP cost relative to FSDP's, and how much compile helps
on this machine; on GPUs run it with NGPU-sized worlds and a bigger model for real MFU.

--pipeline (pp = --world, so no data parallelism) prints one table:
  bubble    For each schedule and pipeline micro-batch count m (training.local_batch_size = m, one sequence per
            micro-batch), one torchrun job builds the Trainer in-process and wraps, on this process's stage
            instances only, forward_one_chunk / backward_one_chunk / backward_weight_one_chunk and the schedule's
            loss with timers, and schedule.step with a wall clock. A rank's bubble is 1 - (time inside those
            calls) / (wall time of schedule.step): idle time waiting for a neighbour plus everything the schedule
            does between compute (send/recv, bookkeeping). Median over the steps after --pp-warmup. `balance` is
            the least loaded rank's compute time over the most loaded one's: the textbook values assume 1.00.
            --pp-split sets module_fqns_per_model_part for the PP runs, e.g. a split balanced by measured cost
            (the default split weighs stages by the model's FLOPs; docs/performance.md).
  textbook  The idle fraction of a step for equal stages and free communication, with forward (F), input
            backward (B) and weight backward (W) of a stage chunk taking equal time where the schedule splits
            them; p = pp degree, v = stages per rank:
              GPipe, 1F1B                 (p-1)/(m+p-1)     (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2021)
              Interleaved1F1B, LoopedBFS  (p-1)/(v*m+p-1)   (Narayanan et al. 2021; Lamy-Poirier 2023, m >= p)
              ZBVZeroBubble               0                 (ZB-V, Qi et al. 2024, arXiv 2401.10241 section 6)
              DualPipeV                   (p-1)/(3m+p-1)    (DeepSeek-V3 report, table 2: (p-1)(F&B+B-3W) idle
                                                             with 2p chunks on p ranks; F&B = F+B here, as the
                                                             overlapped pair runs one after the other on a CPU)
              InterleavedZeroBubble       -                 (ZB1P has (p-1)/(3m+p-1) with one stage per rank;
                                                             the literature gives no closed form interleaved)
            The papers quote idle / useful time, e.g. (p-1)/m for 1F1B; as a fraction of the step that is
            (p-1)/(m+p-1).
  tokens/s  --throughput-schedules at m = --global-batch against FSDP over the same ranks and global batch, as
            `run_train.sh` launches like the layouts above (tokens/s per device), as ratios to FSDP.
Bubbles are timed on whatever else the machine runs: on a shared CPU, a rank descheduled inside a chunk counts as
compute, one descheduled between chunks as bubble. Read them as ratios of one run, not as absolute truths.

--context prints one table, a row per sequence length (--seq-lens) and cp degree (--cp-degrees), each a real
`run_train.sh` launch of --config (the debugmodel by default) on --world ranks for --context-steps steps:
  layout    cp ranks share every sequence (2 x cp chunks, two per rank; torchtitan/distributed/context_parallel.py),
            the other world / cp ranks are FSDP data parallel (dp_shard = world / cp, so cp = 1 is plain FSDP).
            Local batch 1 and global batch dp = world / cp: every data-parallel rank trains one sequence of
            seq_len tokens per step in every launch, split over its cp ranks. Validation and checkpoints are off,
            every step is logged (metrics.log_freq 1) and every rank writes its metrics (save_for_all_ranks).
  tokens/s  The trainer's `tps` (a rank's own tokens per second, cp ranks counting only their share: per device),
            rank 0's median over the steps after --context-warmup.
  peak mem  The largest peak of any rank over every logged step: `mem/max_active_gib` on CUDA (bytes held by live
            tensors), `mem/max_rss_gib` on CPU (the process's resident-set high-water mark, which includes the
            interpreter, torch and the data loader, about 0.5 GiB that no cp degree shrinks: on CPU the memory
            ratio understates what cp saves in activations).
  vs cp1    Peak memory and tokens/s over those of cp = 1 at the same seq_len (`-` when 1 is not in --cp-degrees).
            Ideally memory falls towards 1/cp at long sequences and tokens/s stays at 1.00; what is lost goes to
            the all-gather of keys and values (a reduce-scatter in the backward), to the explicit causal mask
            of each chunk's prefix (cp = 1's is_causal kernel needs none), and to recomputing the chunk
            attention in the backward (it is not kept, to keep the masks out of memory).
Combinations where seq_len is not divisible by 2 x cp or cp does not divide --world are reported as skipped; a
launch that fails is reported as failed, and the script exits 1 after the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

from torchtitan.tools import startup_gc  # noqa: E402

PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                      "DualPipeV")
SINGLE_STAGE = ("GPipe", "1F1B")
STAGE_METHODS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


def layouts(world: int) -> list[tuple[str, list[str]]]:
    tp = ["--parallelism.tensor_parallel_degree", str(world)]
    out = [("fsdp", []), ("tp", tp)]
    if world >= 4 and world % 2 == 0:
        out.append(("fsdp_x_tp", ["--parallelism.tensor_parallel_degree", "2"]))
    compiled = [(f"{name}+compile", [*args, "--compile.enable", "true"]) for name, args in out]
    return out + compiled


def pipeline_args(world: int, schedule: str, split: str = "") -> list[str]:
    """PP over all `world` ranks, one sequence per pipeline micro-batch; `split`: module_fqns_per_model_part."""
    return ["--parallelism.pipeline_parallel_degree", str(world), "--parallelism.pipeline_parallel_schedule",
            schedule, "--parallelism.pipeline_parallel_microbatch_size", "1",
            *(["--parallelism.module_fqns_per_model_part", split] if split else [])]


def run(name: str, world: int, args: list[str], workdir: Path, warmup: int, all_ranks: bool = False) -> dict:
    """One `run_train.sh` launch: rank 0's median tokens/s after `warmup` steps and final loss; with `all_ranks`
    every rank writes its metrics, and `ranks` holds each rank's logged records."""
    dump = workdir / name
    env = {**os.environ, "NGPU": str(world), "PYTHON": sys.executable, "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor")}
    cmd = [str(REPO / "run_train.sh"), "--job.dump_folder", str(dump), "--metrics.log_freq", "1",
           "--job.print_config", "false", *(["--metrics.save_for_all_ranks", "true"] if all_ranks else []), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    files = [dump / f"rank_{r}" / "metrics.jsonl" for r in range(world)] if all_ranks else [dump / "metrics.jsonl"]
    ranks = [[json.loads(line) for line in f.read_text().splitlines()] for f in files]
    records = ranks[0]
    steady = [r for r in records if r["step"] > warmup] or records[-1:]
    return {"tps": statistics.median(r["tps"] for r in steady), "loss": records[-1]["loss"], "ranks": ranks}


# ----------------------------------------------------------------------------------------------------------------
# Pipeline bubbles: inside each torchrun process (`--pp-worker`)
# ----------------------------------------------------------------------------------------------------------------

class StageTimer:
    """Wraps one schedule's compute calls on this rank's stage instances (never the classes) with timers."""

    def __init__(self, schedule):
        self.compute = dict.fromkeys(("F", "B", "W", "loss"), 0.0)
        self.steps: list[dict[str, float]] = []
        self._depth = 0
        stages = list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]
        for stage in stages:
            for method, kind in STAGE_METHODS.items():
                setattr(stage, method, self._timed(getattr(stage, method), kind))
        if schedule._loss_fn is not None:  # the loss runs in the schedule, between the last stage's F and B
            schedule._loss_fn = self._timed(schedule._loss_fn, "loss")
        step = schedule.step

        def timed_step(*args, **kwargs):
            for kind in self.compute:
                self.compute[kind] = 0.0
            start = time.perf_counter()
            result = step(*args, **kwargs)
            self.steps.append({"wall": time.perf_counter() - start, **self.compute})
            return result

        schedule.step = timed_step

    def _timed(self, fn, kind: str):
        def wrapper(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:  # a nested timed call is already inside its caller's time
                    self.compute[kind] += time.perf_counter() - start

        return wrapper


def bubble_run(opts: dict, schedule: str, m: int, world: int, device, dump: str) -> dict:
    """This rank's per-step wall and compute times of `schedule` at m micro-batches, or the config error."""
    from torchtitan.config.errors import ConfigError
    from torchtitan.config.manager import load_config
    from torchtitan.train import Trainer

    argv = ["--job.config_file", opts["config"], "--training.seq_len", str(opts["seq_len"]),
            "--training.local_batch_size", str(m), "--training.global_batch_size", str(m),
            "--training.steps", str(opts["pp_warmup"] + opts["pp_steps"]), "--job.dump_folder", dump,
            "--job.print_config", "false", "--checkpoint.enable", "false", "--validation.enable", "false",
            "--metrics.log_freq", "1000000", *pipeline_args(world, schedule, opts["split"]), *opts["overrides"]]
    try:
        cfg, resolved = load_config(argv, world)
    except ConfigError as e:  # decided from the config alone: the same on every rank
        return {"error": str(e)}
    trainer = Trainer(cfg, resolved, device)
    timer = StageTimer(trainer.pipeline.schedule)
    trainer.train()
    trainer.close()
    stages = len(trainer.pipeline.stage_ids)
    del trainer
    return {"steps": timer.steps[opts["pp_warmup"]:], "v": stages}


def pipeline_worker(opts: dict) -> None:
    import gc

    import torch.distributed as dist

    from torchtitan.distributed import utils as dist_utils

    rank, _, world = dist_utils.env_world()
    device = dist_utils.init_distributed(300)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in opts["schedules"]:
            for m in opts["microbatches"]:
                mine = bubble_run(opts, schedule, m, world, device, f"{tmp}/{schedule}_{m}")
                gathered: list = [None] * world
                dist.all_gather_object(gathered, mine)
                results.append({"schedule": schedule, "m": m, "ranks": gathered})
                gc.collect()
    if rank == 0:
        Path(opts["out"]).write_text(json.dumps(results))
    dist_utils.exit_process(0)


# ----------------------------------------------------------------------------------------------------------------
# Pipeline bubbles and throughput: the driver
# ----------------------------------------------------------------------------------------------------------------

def textbook_bubble(schedule: str, p: int, m: int, v: int) -> float | None:
    """Idle fraction of a step for balanced stages, free communication and T_F = T_B = T_W (module docstring)."""
    if schedule in SINGLE_STAGE:
        return (p - 1) / (m + p - 1)
    if schedule in ("Interleaved1F1B", "LoopedBFS"):
        return (p - 1) / (v * m + p - 1)
    if schedule == "ZBVZeroBubble":
        return 0.0
    if schedule == "DualPipeV":
        return (p - 1) / (3 * m + p - 1)
    return None


def launch_bubbles(opts: dict, world: int, tmp: Path) -> list[dict]:
    from benchmark_trainer import torchrun_job  # scripts/ is on sys.path when a script there runs

    return torchrun_job(__file__, "--pp-worker", opts, world, tmp / "bubbles.json", tmp, "pipeline bubble job")


def summarize(result: dict, world: int) -> dict:
    """Per-rank median bubble, median step time and compute balance of one (schedule, m) run."""
    ranks = result["ranks"]
    if "error" in ranks[0]:
        return {"error": ranks[0]["error"]}
    bubbles, computes, walls = [], [], []
    for r in ranks:
        steps = r["steps"]
        bubbles.append(statistics.median(1.0 - (s["F"] + s["B"] + s["W"] + s["loss"]) / s["wall"] for s in steps))
        computes.append(statistics.median(s["F"] + s["B"] + s["W"] + s["loss"] for s in steps))
        walls.append(statistics.median(s["wall"] for s in steps))
    v = ranks[0]["v"]
    return {"bubbles": bubbles, "heaviest": computes.index(max(computes)), "balance": min(computes) / max(computes),
            "step_ms": 1e3 * max(walls), "v": v, "textbook": textbook_bubble(result["schedule"], world, result["m"], v)}


def pipeline_main(a, common: list[str]) -> None:
    schedules = [s for s in a.schedules.split(",") if s]
    unknown = [s for s in schedules if s not in PIPELINE_SCHEDULES]
    if unknown:
        raise SystemExit(f"--schedules: unknown {unknown}; pick from {','.join(PIPELINE_SCHEDULES)}")
    if a.world < 2:
        raise SystemExit("--pipeline: the pp degree is --world, which must be at least 2")
    opts = {"schedules": schedules, "microbatches": [int(m) for m in a.microbatches.split(",") if m],
            "pp_steps": a.pp_steps, "pp_warmup": a.pp_warmup, "seq_len": a.seq_len, "config": a.config,
            "overrides": a.overrides, "split": a.pp_split}
    throughput = [s for s in a.throughput_schedules.split(",") if s]
    from benchmark_trainer import torch_version  # scripts/ is on sys.path when a script there runs

    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, torch {torch_version()}, pp {a.world}, "
          f"seq {a.seq_len}, overrides {' '.join(a.overrides) or '-'}, stages {a.pp_split or 'default split'}",
          flush=True)
    rows: dict[tuple[str, int], dict] = {}
    tps: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        for result in launch_bubbles(opts, a.world, Path(tmp)):
            rows[(result["schedule"], result["m"])] = summarize(result, a.world)
        print(f"bubbles: {len(rows)} runs in {time.perf_counter() - start:.0f} s", flush=True)
        if throughput:
            for name, args in [("fsdp", ["--training.local_batch_size", str(max(1, a.global_batch // a.world))]),
                               *((s, ["--training.local_batch_size", str(a.global_batch),
                                      *pipeline_args(a.world, s, a.pp_split)]) for s in throughput)]:
                start = time.perf_counter()
                tps[name] = run(f"tps_{name}", a.world, [*common, *args], Path(tmp), a.warmup)
                print(f"tokens/s {name}: {tps[name]['tps']:.1f} per device ({time.perf_counter() - start:.0f} s)",
                      flush=True)
    print_pipeline_table(a, rows, tps)


def print_pipeline_table(a, rows: dict[tuple[str, int], dict], tps: dict[str, dict]) -> None:
    for s in tps:
        if s != "fsdp" and (s, a.global_batch) not in rows:
            rows[(s, a.global_batch)] = {}
    base = tps.get("fsdp")
    print(f"\npp {a.world} (no data parallelism), seq {a.seq_len}, one sequence per micro-batch, bubble = median over "
          f"{a.pp_steps} steps after {a.pp_warmup}; tokens/s per device: global batch {a.global_batch}, "
          f"{a.steps} steps, median after {a.warmup}; config {a.config}")
    ranks = [f"bubble r{r}" for r in range(a.world)]
    print(f"{'schedule':22s} {'v':>2s} {'m':>3s} " + " ".join(f"{h:>9s}" for h in ranks)
          + f" {'textbook':>8s} {'balance':>7s} {'step ms':>8s} {'tokens/s/dev':>12s} {'vs fsdp':>7s}")
    order = {s: i for i, s in enumerate(PIPELINE_SCHEDULES)}
    notes = []
    for (schedule, m), r in sorted(rows.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        if "error" in r:
            notes.append(f"{schedule} m={m}: {r['error']}")
        measured = [f"{b:.3f}{'*' if i == r['heaviest'] else ' '}".rjust(9) for i, b in enumerate(r["bubbles"])] \
            if "bubbles" in r else [f"{'-':>9s}"] * a.world
        textbook = "-" if r.get("textbook") is None else f"{r['textbook']:.3f}"
        v = str(r.get("v", "-"))
        balance = f"{r['balance']:.2f}" if "balance" in r else "-"
        step = f"{r['step_ms']:.0f}" if "step_ms" in r else "-"
        t = tps.get(schedule) if m == a.global_batch else None
        rate = f"{t['tps']:.0f}" if t else "-"
        ratio = f"{t['tps'] / base['tps']:.2f}" if t and base else "-"
        print(f"{schedule:22s} {v:>2s} {m:>3d} " + " ".join(measured)
              + f" {textbook:>8s} {balance:>7s} {step:>8s} {rate:>12s} {ratio:>7s}")
    if base:
        dash = f"{'-':>9s}"
        print(f"{'FSDP (no PP)':22s} {'-':>2s} {'-':>3s} " + " ".join([dash] * a.world)
              + f" {'-':>8s} {'-':>7s} {'-':>8s} {base['tps']:12.0f} {'1.00':>7s}")
    print("* the rank with the most compute per step: it sets the pace, the others also wait for it (balance < 1)")
    for note in notes:
        print(f"  skipped {note}")


# ----------------------------------------------------------------------------------------------------------------
# Context parallel: peak memory and tokens/s per device against sequence length
# ----------------------------------------------------------------------------------------------------------------

CONTEXT_MEMORY_KEYS = ("mem/max_active_gib", "mem/max_rss_gib")  # CUDA's, then CPU's: the first one logged counts


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{flag}: positive integers, got {text!r}")
    return values


def context_skip(seq_len: int, cp: int, world: int) -> str:
    """Why (seq_len, cp) cannot run on `world` ranks, or ''."""
    if world % cp:
        return f"cp {cp} does not divide world {world}"
    if seq_len % (2 * cp):
        return f"seq_len {seq_len} is not divisible by 2 x cp = {2 * cp}"
    return ""


def context_args(a, seq_len: int, cp: int) -> list[str]:
    """The launch of (seq_len, cp): cp ranks per sequence, FSDP over the other world / cp, one sequence per
    data-parallel rank."""
    dp = a.world // cp
    return ["--job.config_file", a.config, "--training.steps", str(a.context_steps), "--training.seq_len", str(seq_len),
            "--training.local_batch_size", "1", "--training.global_batch_size", str(dp),
            "--parallelism.context_parallel_degree", str(cp), "--parallelism.data_parallel_shard_degree", str(dp),
            "--checkpoint.enable", "false", "--validation.enable", "false", *a.overrides]


def peak_memory(ranks: list[list[dict]]) -> tuple[float, str]:
    """The largest peak of any rank over every logged step, in GiB, and the metric it was read from."""
    logged = [r for records in ranks for r in records]
    for key in CONTEXT_MEMORY_KEYS:
        values = [r[key] for r in logged if r.get(key) is not None]
        if values:
            return max(values), key
    raise SystemExit(f"no memory metric ({', '.join(CONTEXT_MEMORY_KEYS)}) in the logged steps")


def context_main(a) -> None:
    seq_lens = _int_list(a.seq_lens, "--seq-lens")
    cps = _int_list(a.cp_degrees, "--cp-degrees")
    if a.context_steps <= a.context_warmup:
        raise SystemExit(f"--context-steps {a.context_steps} leaves no step after --context-warmup {a.context_warmup}")
    from benchmark_trainer import torch_version  # scripts/ is on sys.path when a script there runs

    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, torch {torch_version()}, world {a.world}, "
          f"config {a.config}, overrides {' '.join(a.overrides) or '-'}", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq_len in seq_lens:
            for cp in cps:
                row = {"seq_len": seq_len, "cp": cp, "dp": a.world // cp}
                rows.append(row)
                row["skipped"] = context_skip(seq_len, cp, a.world)
                if row["skipped"]:
                    continue
                start = time.perf_counter()
                try:
                    result = run(f"cp{cp}_seq{seq_len}", a.world, context_args(a, seq_len, cp), Path(tmp),
                                 a.context_warmup, all_ranks=True)
                except SystemExit as e:  # one failed launch (out of memory, say) must not lose the others' rows
                    print(e, flush=True)
                    row["failed"] = True
                    continue
                row["tps"] = result["tps"]
                row["mem"], row["mem_key"] = peak_memory(result["ranks"])
                print(f"seq_len {seq_len} cp {cp}: {row['tps']:.1f} tokens/s per device, peak {row['mem']:.3f} GiB "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
    print_context_table(a, rows)
    if any(r.get("failed") for r in rows):
        raise SystemExit(1)


def print_context_table(a, rows: list[dict]) -> None:
    keys = sorted({r["mem_key"] for r in rows if "mem_key" in r}) or ["mem/max_active_gib (CUDA) or mem/max_rss_gib"]
    print(f"\nworld {a.world}, cp ranks per sequence and FSDP over dp = world / cp, one sequence per data-parallel "
          f"rank, {a.context_steps} steps, tokens/s per device: rank 0's median after {a.context_warmup}; peak mem: "
          f"max of {', '.join(keys)} over every logged step of every rank; config {a.config}")
    print(f"{'seq_len':>7s} {'cp':>3s} {'dp':>3s} {'tokens/s/dev':>12s} {'peak mem GiB':>12s} {'mem vs cp1':>10s} "
          f"{'tokens/s vs cp1':>15s}")
    base = {r["seq_len"]: r for r in rows if r["cp"] == 1 and "tps" in r}
    for r in rows:
        head = f"{r['seq_len']:>7d} {r['cp']:>3d} "
        if r["skipped"] or r.get("failed"):
            print(head + f"{'-':>3s}  " + (f"skipped: {r['skipped']}" if r["skipped"] else "failed (output above)"))
            continue
        b = base.get(r["seq_len"])
        mem_ratio = f"{r['mem'] / b['mem']:.2f}" if b else "-"
        tps_ratio = f"{r['tps'] / b['tps']:.2f}" if b else "-"
        print(head + f"{r['dp']:>3d} {r['tps']:12.1f} {r['mem']:12.3f} {mem_ratio:>10s} {tps_ratio:>15s}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--pp-worker":
        pipeline_worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="processes per layout (the pp degree with --pipeline)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the median")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--config", default=str(REPO / "train_configs" / "debug_model.toml"))
    parser.add_argument("--only", default="", help="comma-separated layout names to run")
    parser.add_argument("--pipeline", action="store_true", help="pipeline bubbles and PP throughput instead")
    parser.add_argument("--schedules", default=",".join(PIPELINE_SCHEDULES), help="--pipeline: schedules to time")
    parser.add_argument("--microbatches", default="2,4,8", help="--pipeline: pipeline micro-batch counts m")
    parser.add_argument("--pp-steps", type=int, default=8, help="--pipeline: timed steps per schedule and m")
    parser.add_argument("--pp-warmup", type=int, default=2, help="--pipeline: untimed steps before them")
    parser.add_argument("--throughput-schedules", default="1F1B,Interleaved1F1B",
                        help="--pipeline: schedules whose tokens/s at m = --global-batch is compared with FSDP's "
                             "('' = none, and no FSDP run)")
    parser.add_argument("--pp-split", default="", help="--pipeline: parallelism.module_fqns_per_model_part (JSON) for "
                        "the PP runs only, e.g. a balanced split; schedules it does not fit are skipped")
    parser.add_argument("--context", action="store_true", help="context parallel's peak memory and tokens/s "
                        "against cp=1 per sequence length instead (--steps, --warmup, --seq-len and --global-batch "
                        "do not apply)")
    parser.add_argument("--seq-lens", default="2048,4096,8192", help="--context: sequence lengths")
    parser.add_argument("--cp-degrees", default="1,2", help="--context: cp degrees (each must divide --world; "
                        "1 is the baseline of the ratios)")
    parser.add_argument("--context-steps", type=int, default=6, help="--context: steps per launch")
    parser.add_argument("--context-warmup", type=int, default=2, help="--context: steps excluded from the median")
    parser.add_argument("overrides", nargs="*", help="extra --section.key value overrides (after --)")
    a = parser.parse_args()
    if a.pipeline and a.context:
        raise SystemExit("--pipeline and --context are separate runs: pick one")
    if a.context:
        context_main(a)
        return
    common = ["--job.config_file", a.config, "--training.steps", str(a.steps), "--training.seq_len", str(a.seq_len),
              "--training.global_batch_size", str(a.global_batch), "--checkpoint.enable", "false",
              "--validation.enable", "false", *a.overrides]
    if a.pipeline:
        pipeline_main(a, common)
        return
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
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    main()
