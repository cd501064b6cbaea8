"""What `./run_train.sh` runs: one interpreter that checks the environment, settles the process count, the config
file and the thread count, checks the config, tokenizer and data as the ranks will (a bad one is one line, exit code
2, before torch is imported), then runs torchrun in this same process (`torch.distributed.run.main`).

A launch therefore imports torch once before the ranks start, not once per check (each import is ~3 s on a
2-core machine). The environment variables are those run_train.sh documents:
NGPU, CONFIG_FILE, LOG_RANK, TORCHRUN_ARGS. Only the standard library (and torchtitan/tools/startup_gc.py, which
needs nothing else) is imported at module level, so a missing package is reported as one line rather than a
traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shlex
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from torchtitan.tools import startup_gc

DEFAULT_CONFIG_FILE = "train_configs/debug_model.toml"
CPU_PROCESSES = 2  # without a GPU: two gloo ranks, so the default run exercises FSDP
REQUIRED_MODULES = ("torch", "tokenizers", "torchdata", "tiktoken")


def _nproc(env: Mapping[str, str], gpu_count: int) -> str:
    return env.get("NGPU") or str(gpu_count if gpu_count > 0 else CPU_PROCESSES)


def entry_point_argv(train_args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """What each rank's `torchtitan.train` receives: CONFIG_FILE's TOML, then the overrides.

    The user's own --job.config_file replaces CONFIG_FILE: passing both would load one TOML and record the other.
    """
    own_config = any(a == "--job.config_file" or a.startswith("--job.config_file=") for a in train_args)
    config = [] if own_config else ["--job.config_file", env.get("CONFIG_FILE") or DEFAULT_CONFIG_FILE]
    return [*config, *train_args]


def torchrun_argv(train_args: Sequence[str], env: Mapping[str, str], gpu_count: int) -> list[str]:
    """torchrun's command line for `train_args` (config overrides), from run_train.sh's environment variables."""
    # Rendezvous on port 0 by default (--standalone): the OS picks a free port, so concurrent runs never collide.
    rendezvous = shlex.split(env.get("TORCHRUN_ARGS") or "--standalone")
    return [f"--nproc_per_node={_nproc(env, gpu_count)}", *rendezvous,
            "--local-ranks-filter", env.get("LOG_RANK") or "0", "--role", "rank", "--tee", "3",
            "-m", "torchtitan.train", *entry_point_argv(train_args, env)]


def world_size(env: Mapping[str, str], gpu_count: int | None) -> int | None:
    """The job's process count (processes per node x nodes), or None where the launch does not fix it: an elastic
    node range (--nnodes 2:4), a value torchrun itself will reject, or an unknown GPU count without NGPU."""
    nnodes = "1"
    rendezvous = shlex.split(env.get("TORCHRUN_ARGS") or "")
    for i, arg in enumerate(rendezvous):
        if arg == "--nnodes" and i + 1 < len(rendezvous):
            nnodes = rendezvous[i + 1]
        elif arg.startswith("--nnodes="):
            nnodes = arg.split("=", 1)[1]
    low, _, high = nnodes.partition(":")
    if (high and high != low) or (gpu_count is None and not env.get("NGPU")):
        return None
    try:
        nodes, nproc = int(low), int(_nproc(env, gpu_count or 0))
    except ValueError:
        return None
    return nodes * nproc if nodes > 0 and nproc > 0 else None


# Where a GPU driver shows itself (NVIDIA, ROCm, WSL): with none of them, torch can see no GPU either.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpu_count_without_torch() -> int | None:
    """0 where this machine has no GPU driver, else None: only torch counts the GPUs it can use (visible devices,
    MIG), and importing it takes ~3 s on 2 cores."""
    return None if any(os.path.exists(path) for path in GPU_DRIVER_PATHS) else 0


def check_before_torch(train_args: Sequence[str], env: Mapping[str, str]) -> None:
    """The ranks' config checks (torchtitan/config/preflight.py) and their tokenizer and data sources, run once
    here before torch is imported or torchrun starts a rank: a bad key, value, flavor, degree, tokenizer or data
    path is one line on stderr and exit code 2 in well under 3 s, rather than every rank failing the same way
    inside torchrun's report (where LOG_RANK may hide the rank that printed it). Degrees against the world size
    are checked where the world size is known without torch (NGPU set, or no GPU)."""
    from torchtitan.config.errors import ConfigError
    from torchtitan.config.manager import load_config, parse_args
    from torchtitan.config.preflight import check_inputs

    argv = entry_point_argv(train_args, env)
    world = world_size(env, gpu_count_without_torch())
    try:
        cfg = parse_args(argv) if world is None else load_config(argv, world)[0]
        if not cfg.memory_estimation.enable:  # an estimate needs neither data nor tokenizer on this machine
            check_inputs(cfg)
    except ConfigError as e:
        _config_error(e)
    except (ValueError, FileNotFoundError) as e:  # data and tokenizer errors name their key and file
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def check_with_torch(train_args: Sequence[str], env: Mapping[str, str], gpu_count: int) -> None:
    """What needs torch: the degrees against the GPU count torch sees, and the device (check_job)."""
    from torchtitan.config.errors import ConfigError
    from torchtitan.config.preflight import check_job

    world = world_size(env, gpu_count)
    if world is None:  # an elastic node count: the ranks check the degrees once the rendezvous knows it
        return
    try:
        check_job(entry_point_argv(train_args, env), world)
    except ConfigError as e:
        _config_error(e)


def _config_error(e: Exception) -> None:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)


# Errors a rank reports as one line of its own (a bad setting, file or step): the summary drops the type name.
_ONE_LINE_ERRORS = ("ConfigError", "ValueError", "FileNotFoundError", "TrainingError")


def failure_line(failures: Mapping[int, Any]) -> tuple[str, int]:
    """One line and the exit code for a failed job, from torchrun's per-rank failures (ChildFailedError.failures:
    global rank -> ProcessFailure, which read each rank's error file, see torchtitan/distributed/utils.py
    record_failure). The rank named is the first that recorded an error of its own; ranks that torchrun stopped
    after it (SIGTERM) or that exited without recording one come only where none recorded. Whatever LOG_RANK
    shows, the user learns which rank failed and why."""
    def recorded(failure: Any) -> str | None:
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message")
        # a rank without an error file gets a made-up message (its signal, or a link to torch's docs)
        return message if isinstance(message, str) and os.path.isfile(failure.error_file) else None

    def order(rank: int) -> tuple:
        # The error file's write time, not its whole-second timestamp: a rank that failed alone and the rank
        # whose next collective then broke often record within the same second.
        failure = failures[rank]
        if recorded(failure) is None:
            return (True, failure.timestamp * 10**9, rank)
        return (False, os.stat(failure.error_file).st_mtime_ns, rank)

    rank = min(failures, key=order)
    failure = failures[rank]
    code = failure.exitcode if 0 < failure.exitcode < 256 else 1
    message = recorded(failure)
    if message is not None:
        kind, sep, text = message.partition(": ")
        first = (text if sep and kind in _ONE_LINE_ERRORS else message).strip().splitlines()
        where = "" if sep and kind in _ONE_LINE_ERRORS else f" (traceback in {failure.error_file})"
        return f"[launch] rank {rank} failed (exit code {failure.exitcode}): {first[0] if first else kind}{where}", code
    if failure.exitcode < 0:
        return f"[launch] rank {rank} was stopped by {failure.signal_name()} before it recorded an error", code
    return (f"[launch] rank {rank} exited with code {failure.exitcode} without recording an error (its output: "
            f"LOG_RANK={failure.local_rank})"), code


def _stop_if_a_module_is_missing(*, import_them: bool) -> None:
    """One line naming the first required module this interpreter lacks (found without importing it), or, with
    import_them, cannot import (a broken install)."""
    for name in REQUIRED_MODULES:
        try:
            if not import_them and importlib.util.find_spec(name) is None:
                raise ImportError("not installed")
            if import_them:
                importlib.import_module(name)
        except ImportError as e:
            sys.exit(f"[launch] {sys.executable} cannot import {name} ({e}): remove .venv/.installed-pyproject and "
                     "run ./run_train.sh again to reinstall")


def set_default_environment(env: MutableMapping[str, str], gpu_count: int) -> None:
    """What the ranks inherit unless the user set it. CPU ranks share the cores: one OpenMP thread each avoids
    oversubscription (and fork deadlocks). GPU ranks: the caching allocator in expandable segments, which grow in
    place instead of leaving gaps between fixed-size blocks (the reserved-over-active gap the memory estimator
    must otherwise cover, torchtitan/estimation/report.py); the reference trainers launch with it too."""
    if gpu_count == 0:
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def main(argv: Sequence[str] | None = None) -> None:
    train_args = list(sys.argv[1:] if argv is None else argv)
    _stop_if_a_module_is_missing(import_them=False)
    check_before_torch(train_args, os.environ)
    startup_gc.pause()  # for torch's import, which is then frozen for the job's lifetime (tools/startup_gc.py)
    _stop_if_a_module_is_missing(import_them=True)
    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    startup_gc.freeze_and_resume()

    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    set_default_environment(os.environ, gpu_count)
    check_with_torch(train_args, os.environ, gpu_count)
    try:
        torchrun(torchrun_argv(train_args, os.environ, gpu_count))
    except ChildFailedError as e:  # instead of its traceback and report: one line naming the rank and the reason
        line, code = failure_line(e.failures)
        print(line, file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    main()
