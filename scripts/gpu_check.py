"""Every GPU check in one command, one table: what docs/performance.md records whenever a GPU machine is available.

    scripts/gpu_check.sh [--only quickstart,eager,compiled,allocator,loss_chunks,float8,moe,checkpoint] [--steps 15]
        [--data FILE.jsonl]
    scripts/gpu_check.sh --smoke      # the same checks on CPU with the debug models (checks this script, not speed)

Checks, each a launch of the documented commands (a failure is a FAIL row with its last error line; the others run):
- quickstart: `./run_train.sh` as the README runs it, on one GPU;
- eager, compiled: the benchmark flavor (`llama3` `8B_8blocks`, seq 8192, local batch 1, per-op AC, AdamW) through
  `./run_train.sh`: median tokens/s and MFU after 5 steps, max active and reserved memory, launch to first step,
  and the memory estimator's verdict for the same job beside them;
- allocator: the eager run again with torch's default allocator settings (PYTORCH_CUDA_ALLOC_CONF empty; the
  launcher's default is expandable segments), for the reserved-over-active gap the estimator's verdict covers;
- loss_chunks: `scripts/benchmark_loss_chunks.py`, the 8B output layer and loss at seq 8192 in 1, 4, 16 and 32
  token chunks: time ratio and peak memory;
- float8: `scripts/benchmark_float8.py` on the same workload, compiled: bf16 and tensorwise (`--float8-variants`);
- moe: Qwen3-30B-A3B's block shape cut to 2 blocks (`scripts/moe_balance_study.py`, grouped GEMM in bf16);
- checkpoint: async saves with pinned memory, a resume, and the Hugging Face export loaded by `transformers` on the
  GPU, generating from it.
About 5-6 minutes expected on one H100/H200 (not yet run on a GPU: the launches to first step measured there were
35 s eager and 56 s compiled). The data is the embedded corpus unless `--data` names a local jsonl file.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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

CHECKS = ("quickstart", "eager", "compiled", "allocator", "loss_chunks", "float8", "moe", "checkpoint")
COMMON = ["--metrics.log_freq", "1", "--job.print_config", "false", "--validation.enable", "false"]


def workloads(smoke: bool, data: str) -> dict:
    """The benchmark job (config file and overrides) and the MoE one, full size or the CPU smoke test's."""
    source = ["--training.dataset_path", data] if data else ["--training.dataset", "python_stdlib"]
    if smoke:
        bench = ("train_configs/debug_model.toml", ["--model.flavor", "debugmodel_small", "--training.seq_len", "64",
                                                    "--training.local_batch_size", "2"])
        moe = ("train_configs/debug_moe.toml", ["--training.seq_len", "64", "--training.local_batch_size", "2"])
    else:
        bench = ("train_configs/llama3_8b.toml", ["--model.flavor", "8B_8blocks", "--training.seq_len", "8192",
                                                  "--training.local_batch_size", "1", "--activation_checkpoint.mode",
                                                  "selective", "--activation_checkpoint.selective_ac_option", "op",
                                                  "--lr_scheduler.warmup_steps", "2"])
        moe = ("train_configs/qwen3_30b_a3b.toml", ["--training.seq_len", "4096", "--training.local_batch_size", "2",
                                                    "--activation_checkpoint.mode", "full"])
    return {"bench": (bench[0], [*bench[1], *source]), "moe": (moe[0], [*moe[1], *source])}


def run(cmd: list[str], env: dict, timeout: float, watch: Path | None = None) -> tuple[int, str, float, float | None]:
    """(exit code, output, seconds, seconds until `watch` first had a line or None)."""
    start, first = time.perf_counter(), None
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            if first is None and watch is not None and watch.exists() and watch.stat().st_size > 0:
                first = time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                proc.kill()
            time.sleep(0.1)
        out.seek(0)
        return proc.returncode, out.read(), time.perf_counter() - start, first


def last_error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "Error" in line]
    return (errors or lines or ["no output"])[-1].strip()[:200]


def last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def metrics_of(folder: Path, warmup: int = 5) -> dict:
    steps = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]
    timed = steps[warmup:] or steps[-1:]

    def median(key: str):
        values = [s[key] for s in timed if s.get(key) is not None]
        return statistics.median(values) if values else None

    def peak(key: str):
        values = [s[key] for s in steps if s.get(key) is not None]
        return max(values) if values else None

    return {"tps": median("tps"), "mfu": median("mfu"), "loss": steps[-1]["loss"],
            "active_gib": peak("mem/max_active_gib"), "reserved_gib": peak("mem/max_reserved_gib")}


def cell(value, fmt: str = "{:.3g}") -> str:
    return "-" if value is None else fmt.format(value)


class GpuCheck:
    def __init__(self, opts, tmp: Path):
        self.opts, self.tmp, self.rows = opts, tmp, []
        self.env = {**os.environ, "NGPU": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        self.work = workloads(opts.smoke, opts.data)

    def row(self, check: str, ok: bool, detail: str, seconds: float) -> None:
        self.rows.append((check, "ok" if ok else "FAIL", detail, f"{seconds:.0f}"))
        print(f"[gpu_check] {check}: {'ok' if ok else 'FAIL'} {detail} ({seconds:.0f} s)", flush=True)

    def train(self, name: str, config: str, args: list[str], timeout: float = 300, env: dict | None = None):
        dump = self.tmp / name
        env = {**self.env, **(env or {}), "CONFIG_FILE": config}
        cmd = ["./run_train.sh", *COMMON, "--job.dump_folder", str(dump), *args]
        return (*run(cmd, env, timeout, watch=dump / "metrics.jsonl"), dump)

    def quickstart(self) -> None:
        code, out, seconds, _, dump = self.train("quickstart", "train_configs/debug_model.toml", [])
        detail = (f"loss {metrics_of(dump)['loss']:.3f}, {metrics_of(dump)['tps']:.0f} tokens/s" if code == 0
                  else last_error(out))
        self.row("quickstart", code == 0, detail, seconds)

    def bench(self, compiled: bool, default_allocator: bool = False) -> None:
        config, args = self.work["bench"]
        args = [*args, "--training.steps", str(self.opts.steps), "--checkpoint.enable", "false",
                *(["--compile.enable", "true"] if compiled else [])]
        name = "allocator" if default_allocator else "compiled" if compiled else "eager"
        env = {"PYTORCH_CUDA_ALLOC_CONF": ""} if default_allocator else None
        # The estimate runs on the CPU cores while the GPU trains (about a minute for the 8B block shape).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            estimate = pool.submit(self.estimate, config, args)
            code, out, seconds, first, dump = self.train(name, config, args, timeout=600, env=env)
            estimate = estimate.result()
        if code != 0:
            return self.row(name, False, last_error(out), seconds)
        m = metrics_of(dump)
        self.row(name, True, f"{cell(m['tps'], '{:.0f}')} tokens/s, MFU {cell(m['mfu'], '{:.1f}%')}, active "
                 f"{cell(m['active_gib'], '{:.2f}')} / reserved {cell(m['reserved_gib'], '{:.2f}')} GiB, estimate "
                 f"{estimate}, launch to first step {cell(first, '{:.0f}')} s", seconds)

    def estimate(self, config: str, args: list[str]) -> str:
        import torch

        # this GPU's memory, not the estimator's default device
        memory = ["--memory-gib", f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}"] \
            if torch.cuda.is_available() else []
        cmd = [sys.executable, "scripts/estimate_memory.py", "--json", "--world-size", "1", *memory,
               "--job.config_file", config, *args]
        code, out, _, _ = run(cmd, self.env, 300)
        try:
            report = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return f"failed ({last_error(out)})"
        verdict = "fits" if report["fits"] else "does not fit"
        return f"peak {report['peak_gib']:.2f}, needed {report['needed_gib']:.2f} GiB ({verdict})"

    def loss_chunks(self) -> None:
        # The 8B output layer at seq 8192 (scripts/benchmark_loss_chunks.py's default shape), bf16 autocast
        shape = ["--tokens", "512", "--dim", "64", "--vocab", "4096", "--repeats", "2"] if self.opts.smoke else []
        cmd = [sys.executable, "scripts/benchmark_loss_chunks.py", "--chunks", "1,4,16,32", *shape]
        code, out, seconds, _ = run(cmd, self.env, 300)
        rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
        detail = "; ".join(f"{r[0]} chunks: {r[2]} x time, {float(r[3]) / 1024:.2f} GiB" for r in rows)
        self.row("loss_chunks", code == 0 and bool(rows), detail if code == 0 else last_error(out), seconds)

    def float8(self) -> None:
        config, args = self.work["bench"]
        extra = ["--all-layers"] if self.opts.smoke else []
        compile_args = [] if self.opts.smoke else ["--compile.enable", "true"]
        cmd = [sys.executable, "scripts/benchmark_float8.py", "--config", config, "--variants",
               self.opts.float8_variants, "--steps", str(self.opts.steps), "--warmup", "5", *extra, "--", *args,
               *compile_args]
        code, out, seconds, _ = run(cmd, self.env, 600)
        table = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
        detail = "; ".join(" ".join(c.strip() for c in line.strip("|").split("|")[:4]) for line in table)
        self.row("float8", code == 0, detail if code == 0 else last_error(out), seconds)

    def moe(self) -> None:
        config, args = self.work["moe"]
        cmd = [sys.executable, "scripts/moe_balance_study.py", "--config", config, "--n-layers", "2", "--steps",
               str(self.opts.steps), "--window", "5", "--variant", "default=", "--", *args]
        code, out, seconds, _ = run(cmd, self.env, 300)
        lines = [line for line in out.splitlines() if line.startswith(("| variant", "| default"))]
        if code != 0 or len(lines) < 2:
            return self.row("moe", False, last_error(out), seconds)
        header, row = ([c.strip() for c in line.strip("|").split("|")] for line in lines[-2:])
        got = dict(zip(header, row, strict=True))
        self.row("moe", True, f"{got['tps']} tokens/s, MFU {got['mfu']}, loss {got['loss']}, busiest expert "
                 f"{got['load_max']} x the mean load", seconds)

    def checkpoint(self) -> None:
        save = ["--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2",
                "--checkpoint.async_mode", "async_with_pinned_mem", "--checkpoint.last_save_in_hf", "true"]
        code, out, seconds, _, dump = self.train("checkpoint", "train_configs/debug_model.toml", save)
        if code != 0:
            return self.row("checkpoint", False, f"save: {last_error(out)}", seconds)
        (dump / "metrics.jsonl").rename(dump / "metrics.first.jsonl")
        resume = [*save[:-2], "--training.steps", "6"]
        code, out, more, _, _ = self.train("checkpoint", "train_configs/debug_model.toml", resume)
        seconds += more
        if code != 0:
            return self.row("checkpoint", False, f"resume: {last_error(out)}", seconds)
        first = json.loads((dump / "metrics.jsonl").read_text().splitlines()[0])["step"]
        if first != 5:
            return self.row("checkpoint", False, f"resume: started at step {first}, not 5", seconds)
        export = sorted((dump / "checkpoint").glob("step-*-hf"), key=lambda path: int(path.name.split("-")[1]))
        if not export:
            return self.row("checkpoint", False, "no Hugging Face export", seconds)
        code, out, more, _ = run([sys.executable, "-c", _GENERATE, str(export[-1])], self.env, 300)
        self.row("checkpoint", code == 0, f"async save, resume, export {export[-1].name}: {last_line(out)}"
                 if code == 0 else f"transformers: {last_error(out)}", seconds + more)

    def table(self) -> str:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        lines = [f"{device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", "",
                 "| check | result | detail | seconds |", "|---|---|---|---|"]
        return "\n".join([*lines, *(f"| {' | '.join(row)} |" for row in self.rows)])


# The export loads in transformers on the GPU (or CPU) and generates.
_GENERATE = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
device = "cuda" if torch.cuda.is_available() else "cpu"
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).to(device)
ids = tok("def main(", return_tensors="pt").input_ids.to(device)
out = model.generate(ids, max_new_tokens=8, do_sample=False)
print(f"transformers generated {out.shape[1] - ids.shape[1]} tokens on {device}")
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    parser.add_argument("--steps", type=int, default=15, help="steps of the benchmark runs (medians after 5)")
    parser.add_argument("--data", default="", help="a local jsonl file instead of the embedded corpus")
    parser.add_argument("--float8-variants", default="bf16,tensorwise",
                        help="scripts/benchmark_float8.py's variants, compiled (each adds about a minute)")
    parser.add_argument("--smoke", action="store_true", help="CPU, debug models: checks this script, not speed")
    opts = parser.parse_args(argv)
    unknown = set(opts.only.split(",")) - set(CHECKS)
    if unknown:
        parser.error(f"--only: unknown {', '.join(sorted(unknown))}; known: {', '.join(CHECKS)}")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        check = GpuCheck(opts, Path(tmp))
        if opts.smoke:
            check.env["CUDA_VISIBLE_DEVICES"] = ""
        steps = {"quickstart": check.quickstart, "eager": lambda: check.bench(False),
                 "compiled": lambda: check.bench(True), "allocator": lambda: check.bench(False, default_allocator=True),
                 "loss_chunks": check.loss_chunks, "float8": check.float8,
                 "moe": check.moe, "checkpoint": check.checkpoint}
        for name in opts.only.split(","):
            try:
                steps[name]()
            except Exception as e:  # noqa: BLE001 - one broken check must not lose the others' rows
                check.row(name, False, f"{type(e).__name__}: {e}"[:200], 0)
        print("\n" + check.table())
    return 0 if all(row[1] == "ok" for row in check.rows) else 1


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    sys.exit(main())
