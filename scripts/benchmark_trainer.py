"""The trainer against a bare PyTorch loop over the same model, batches and optimizer, alternating in one run; or a
per-component profile of the trainer's step.

    python scripts/benchmark_trainer.py [--nproc 1,2] [--rounds 4] [--steps 14] [--warmup 4] [--compile] [-- overrides]
    python scripts/benchmark_trainer.py --profile [--nproc 2] [--steps 8] [-- overrides]

Workload by default (docs/performance.md): the debugmodel Llama (dim 256, 4 layers, 8 heads, 4 KV heads, vocab
8192), fp32, local batch 8 x seq 512, AdamW (fused), clipping at 1.0, no activation checkpointing. Each process
count runs under torchrun; inside it the trainer (`Trainer.train`, everything a user's run does: data loading,
logging every `metrics.log_freq` steps, the step guard) and the bare loop (the model class, `fully_shard` on each
block and the root when there is more than one process, cross-entropy, `clip_grad_norm_`, AdamW, batches taken
from the trainer's own loader beforehand) take turns, ABBA, `--rounds` times each. A step's time is wall clock
from the end of one step to the end of the next; tokens/s per process is the median over the steps after
`--warmup` of every round. With --compile both compile each block (the trainer also its loss).

--profile traces the trainer's steps after the warm-up with torch.profiler (Python stacks on) and attributes each
op's self time, forward and backward, to a component: backward ops through the forward op that recorded them
(the autograd sequence number). Shares are of the traced CPU time of rank 0's main thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import itertools
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

WORKLOAD = ["--model.flavor", "debugmodel", "--training.local_batch_size", "8", "--training.seq_len", "512",
            "--training.mixed_precision_param", "float32", "--training.max_norm", "1.0",
            "--optimizer.name", "AdamW", "--activation_checkpoint.mode", "none"]
COMPONENTS = ("attention", "rope", "mlp", "norms", "embedding+output", "loss", "optimizer", "fsdp", "data",
              "other")


# ----------------------------------------------------------------------------------------------------------------
# Inside each torchrun process
# ----------------------------------------------------------------------------------------------------------------

def _trainer_config(opts: dict, world: int, dump: str, steps: int):
    from torchtitan.config.manager import load_config

    argv = ["--job.config_file", opts["config"], *WORKLOAD, "--training.steps", str(steps),
            "--job.dump_folder", dump, "--job.print_config", "false", "--checkpoint.enable", "false",
            "--validation.enable", "false", "--lr_scheduler.warmup_steps", "2",
            *(["--compile.enable", "true"] if opts["compile"] else []), *opts["overrides"]]
    return load_config(argv, world)


def _step_end(device) -> float:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def run_trainer(opts: dict, world: int, device, dump: str, profiler=None) -> tuple[list[float], object]:
    """Step times of one trainer run, and the trainer (closed) for its config and loader."""
    from torchtitan.train import Trainer

    cfg, resolved = _trainer_config(opts, world, dump, opts["steps"])
    trainer = Trainer(cfg, resolved, device)
    ends = [_step_end(device)]

    def after_step(step: int) -> None:
        ends.append(_step_end(device))
        if profiler is not None:
            profiler.step()

    trainer.train(after_step=after_step)
    trainer.close()
    return [b - a for a, b in itertools.pairwise(ends)], trainer


def run_bare(opts: dict, cfg, world: int, device, batches: list) -> list[float]:
    """The same steps as a plain PyTorch loop: no config, no guard, no metrics, no data loading."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchtitan.config.flavor import flavor_args
    from torchtitan.models.registry import get_model_spec

    spec = get_model_spec(cfg.model.name)
    args = dataclasses.replace(flavor_args(cfg), max_seq_len=cfg.training.seq_len)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model_cls(args)
    mesh = init_device_mesh(device.type, (world,)) if world > 1 else None
    for block in model.layers.values():
        if opts["compile"]:
            block.compile(backend=cfg.compile.backend)
        if mesh is not None:
            fully_shard(block, mesh=mesh)
    if mesh is not None:
        fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    o = cfg.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=o.implementation == "fused",
                                  foreach=o.implementation == "foreach")
    ends = [_step_end(device)]
    for step in range(opts["steps"]):
        inputs, labels = batches[step % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        optimizer.step()
        ends.append(_step_end(device))
    return [b - a for a, b in itertools.pairwise(ends)]


def compare_worker(opts: dict, world: int, device, tmp: str) -> dict:
    times: dict[str, list[list[float]]] = {"trainer": [], "bare": []}
    cfg, batches = None, []
    for r in range(opts["rounds"]):
        for kind in (("trainer", "bare") if r % 2 == 0 else ("bare", "trainer")):  # round 0 starts with the trainer
            if kind == "trainer":
                step_times, trainer = run_trainer(opts, world, device, f"{tmp}/round{r}")
                times["trainer"].append(step_times)
                if not batches:  # the bare loop's batches: the same loader, read ahead of its timing
                    cfg, it = trainer.cfg, iter(trainer.dataloader)
                    batches = [(b["tokens"].to(device), b["labels"].to(device))
                               for b in (next(it) for _ in range(opts["steps"]))]
                    trainer.dataloader.close()
            else:
                times["bare"].append(run_bare(opts, cfg, world, device, batches))
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    return {"times": times, "tokens_per_step": tokens}


def _categorizer(model_classes: dict):
    """Maps a profiler event to a component by its innermost recognised frame or label (see module doc)."""
    frames = {}  # (line, function) -> (file, component); the profiler shortens file paths to the sys.path entry
    for component, functions in model_classes.items():
        for fn in functions:
            code = fn.__code__
            frames[(code.co_firstlineno, code.co_name)] = (code.co_filename, component)
    # Paths as the profiler prints them: relative to their sys.path entry (torch/optim/adam.py(214): step).
    path_rules = (("torch/distributed/fsdp/", "fsdp"), ("torch/optim/", "optimizer"),
                  ("torchtitan/distributed/utils.py", "optimizer"), ("torch/nn/utils/clip_grad", "optimizer"),
                  ("torchtitan/components/loss.py", "loss"), ("torchtitan/data/", "data"),
                  ("torch/utils/data/", "data"), ("torchdata/", "data"))

    def direct(name: str) -> str | None:
        if name.startswith("FSDP::"):
            return "fsdp"
        if name.startswith(("Optimizer.", "aten::_fused_adam")):  # under DTensor dispatch the frame is not a parent
            return "optimizer"
        if "): " in name:
            location, function = name.rsplit("): ", 1)
            path, _, line = location.rpartition("(")
            hit = frames.get((int(line), function)) if line.isdigit() else None
            if hit is not None and hit[0].endswith(path):
                return hit[1]
        if name.endswith(": cross_entropy"):
            return "loss"
        for fragment, component in path_rules:
            if fragment in name and "): " in name:
                return component
        return None

    return direct


def profile_worker(opts: dict, world: int, device, tmp: str) -> dict:
    import torch

    from torchtitan.models.llama3 import model as llama

    direct = _categorizer({
        "attention": [llama.Attention.forward], "rope": [llama.apply_rotary_emb], "mlp": [llama.FeedForward.forward],
        "norms": [llama.RMSNorm.forward], "embedding+output": [llama.Transformer.forward],
    })
    traced = opts["steps"] - opts["warmup"]
    schedule = torch.profiler.schedule(wait=opts["warmup"] - 1, warmup=1, active=traced, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True,
                                schedule=schedule) as prof:
        step_times, _ = run_trainer(opts, world, device, f"{tmp}/profile", profiler=prof)
    events = prof.events()
    thread_time: dict[int, float] = {}
    for e in events:
        thread_time[e.thread] = thread_time.get(e.thread, 0.0) + e.self_cpu_time_total
    main_thread = max(thread_time, key=thread_time.get)
    events = [e for e in events if e.thread == main_thread]

    def walk(e, seq_component: dict) -> str:
        node = e
        while node is not None:
            if node.name.startswith("autograd::engine::evaluate_function"):
                return seq_component.get(node.sequence_nr, "other")
            c = direct(node.name)
            if c is not None:
                return c
            node = node.cpu_parent
        return "other"

    # A forward op records the autograd sequence number current when it starts, and the op that creates the node
    # takes it, so several ops share a number and the node's creator is the last of them to start.
    def in_backward(e) -> bool:  # ops the autograd engine runs carry sequence numbers too
        node = e
        while node is not None:
            if node.name.startswith("autograd::engine::evaluate_function"):
                return True
            node = node.cpu_parent
        return False

    seq_component: dict[int, str] = {}
    forward = [e for e in events if e.sequence_nr >= 0 and not in_backward(e)]
    for e in sorted(forward, key=lambda e: e.time_range.start):
        seq_component[e.sequence_nr] = walk(e, {})
    shares = dict.fromkeys(COMPONENTS, 0.0)
    ops = dict.fromkeys(COMPONENTS, 0)  # events per component: what the program ran, whatever the machine's load
    for e in events:
        component = walk(e, seq_component)
        shares[component] += e.self_cpu_time_total
        ops[component] += 1
    total = sum(shares.values())
    return {"shares": {k: v / total for k, v in shares.items()}, "ops": ops, "traced_ms": total / 1e3 / traced,
            "step_ms": 1e3 * statistics.median(step_times[opts["warmup"]:])}


def worker(opts: dict) -> None:
    from torchtitan.distributed import utils as dist_utils

    rank, _, world = dist_utils.env_world()
    device = dist_utils.init_distributed(300)
    with tempfile.TemporaryDirectory() as tmp:
        result = (profile_worker if opts["profile"] else compare_worker)(opts, world, device, tmp)
    if rank == 0:
        Path(opts["out"]).write_text(json.dumps(result))
    dist_utils.exit_process(0)


# ----------------------------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------------------------

def torchrun_job(script: str, flag: str, opts: dict, nproc: int, out: Path, tmp: Path, what: str):
    """Run `script flag <opts as JSON>` as one torchrun job of `nproc` ranks (offline, one OpenMP thread each);
    the worker writes its result as JSON to opts["out"] = `out`, returned parsed. Shared by the benchmarks."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(REPO),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           "--local-ranks-filter", "0", script, flag, json.dumps({**opts, "out": str(out)})]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"{what} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def launch(opts: dict, nproc: int, tmp: Path) -> dict:
    return torchrun_job(__file__, "--worker", opts, nproc, tmp / f"result_{nproc}.json", tmp, f"{nproc} process(es)")


def _tps(rounds: list[list[float]], warmup: int, tokens: int) -> tuple[float, list[float]]:
    kept = [t for r in rounds for t in r[warmup:]]
    per_round = [tokens / statistics.median(r[warmup:]) for r in rounds]
    return tokens / statistics.median(kept), per_round


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", default="1,2", help="comma-separated process counts (FSDP beyond 1)")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each side, alternating ABBA")
    parser.add_argument("--steps", type=int, default=14, help="steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="steps of each run left out of the median")
    parser.add_argument("--compile", action="store_true", help="compile each block (both sides)")
    parser.add_argument("--profile", action="store_true", help="per-component shares of the trainer's step")
    parser.add_argument("--config", default=str(REPO / "train_configs" / "debug_model.toml"))
    parser.add_argument("overrides", nargs="*", help="extra --section.key value overrides for both (after --)")
    a = parser.parse_args()
    if a.warmup < 1 or a.steps <= a.warmup:
        parser.error("need 1 <= --warmup < --steps")
    opts = {"rounds": a.rounds, "steps": a.steps, "warmup": a.warmup, "compile": a.compile, "profile": a.profile,
            "config": a.config, "overrides": a.overrides}
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, torch {torch_version()}, "
          f"compile {'on' if a.compile else 'off'}, overrides {' '.join(a.overrides) or '-'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in (int(n) for n in a.nproc.split(",")):
            result = launch(opts, nproc, Path(tmp))
            if a.profile:
                print(f"\n{nproc} process(es): step {result['step_ms']:.0f} ms, traced CPU time "
                      f"{result['traced_ms']:.0f} ms/step (profiler on)")
                for name, share in sorted(result["shares"].items(), key=lambda kv: -kv[1]):
                    print(f"  {name:18s} {100 * share:5.1f}%  {result['ops'][name]:7d} ops")
                continue
            tokens = result["tokens_per_step"]
            trainer, trainer_rounds = _tps(result["times"]["trainer"], a.warmup, tokens)
            bare, bare_rounds = _tps(result["times"]["bare"], a.warmup, tokens)
            print(f"\n{nproc} process(es), {a.rounds} rounds x {a.steps - a.warmup} steps each side")
            print(f"  trainer   {trainer:9.1f} tokens/s per process   rounds: "
                  + " ".join(f"{t:.0f}" for t in trainer_rounds))
            print(f"  bare loop {bare:9.1f} tokens/s per process   rounds: "
                  + " ".join(f"{t:.0f}" for t in bare_rounds))
            print(f"  trainer / bare = {trainer / bare:.3f}", flush=True)


def torch_version() -> str:
    """From torch's package metadata: the driver only launches jobs, and importing torch here would cost it ~3 s
    of CPU (on 2 cores) that the launched ranks then wait for."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # torch from a source tree on sys.path
        import torch

        return torch.__version__


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    main()
