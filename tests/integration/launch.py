"""Run ./run_train.sh the way a user does, with an outer timeout, and read back metrics.jsonl."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def read_metrics(dump_folder: str | Path) -> list[dict]:
    """A run's metrics.jsonl lines (rank 0's), in order."""
    path = Path(dump_folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def complete_steps(dump_folder: str | Path) -> list[int]:
    """The steps of the run's complete full checkpoints (their .complete marker written), in order."""
    folder = Path(dump_folder) / "checkpoint"
    if not folder.exists():
        return []
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*")
                  if p.is_dir() and p.name.count("-") == 1 and (p / ".complete").exists())


@dataclass
class RunResult:
    returncode: int
    output: str
    dump_folder: Path

    def metrics(self) -> list[dict]:
        return read_metrics(self.dump_folder)

    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics()]


def launch_env(nproc: int, cache_dir: Path, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launched run: this interpreter, CPU only, offline, one thread per rank."""
    env = dict(os.environ)
    env.update({
        "NGPU": str(nproc),
        "PYTHON": sys.executable,  # the interpreter running the tests already has everything
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TORCHTITAN_CACHE_DIR": str(cache_dir),
        # compiled kernels are shared by every compile test of the session
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
        "CUDA_VISIBLE_DEVICES": "",
    })
    env.update(extra_env or {})
    return env


def _command_and_env(nproc: int, args, dump_folder: Path, cache_dir: Path, extra_env: dict[str, str] | None):
    cmd = [str(REPO / "run_train.sh"), "--job.dump_folder", str(dump_folder),
           "--comm.init_timeout_seconds", "90", "--comm.train_timeout_seconds", "60", *args]
    return cmd, launch_env(nproc, cache_dir, extra_env)


def start_train(nproc: int, args, dump_folder: Path, cache_dir: Path, log_path: Path,
                extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Launch in the background (own process group, output to log_path) for signal and kill tests."""
    cmd, env = _command_and_env(nproc, args, dump_folder, cache_dir, extra_env)
    log = open(log_path, "w")  # noqa: SIM115 - the child owns it until it exits
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process and every descendant. torchrun starts each rank in a session of its own, so
    killing the launcher's process group alone would leave the ranks running as orphans."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def run_train(nproc: int, args: list[str] | tuple[str, ...], dump_folder: Path, cache_dir: Path,
              timeout: int = 240, extra_env: dict[str, str] | None = None) -> RunResult:
    cmd, env = _command_and_env(nproc, args, dump_folder, cache_dir, extra_env)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise AssertionError(f"run_train.sh timed out after {timeout}s: {' '.join(cmd)}\n{out[-4000:]}") from None
    return RunResult(proc.returncode, proc.stdout + proc.stderr, dump_folder)
