"""What `./run_train.sh` runs: one interpreter that checks the environment, settles the process count, the config
file and the thread count, checks the config as the ranks will (a bad one is one line, exit code 2), then runs
torchrun in this same process (`torch.distributed.run.main`).

A launch therefore imports torch once before the ranks start, not once per check (each import is ~1.4 s on a
2-core machine; see docs/performance.md). The environment variables are those run_train.sh documents:
NGPU, CONFIG_FILE, LOG_RANK, TORCHRUN_ARGS. Only the standard library is imported at module level, so a missing
package is reported as one line rather than a traceback.
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

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


def world_size(env: Mapping[str, str], gpu_count: int) -> int | None:
    """The job's process count (processes per node x nodes), or None where the launch does not fix it: an elastic
    node range (--nnodes 2:4) or a value torchrun itself will reject."""
    nnodes = "1"
    rendezvous = shlex.split(env.get("TORCHRUN_ARGS") or "")
    for i, arg in enumerate(rendezvous):
        if arg == "--nnodes" and i + 1 < len(rendezvous):
            nnodes = rendezvous[i + 1]
        elif arg.startswith("--nnodes="):
            nnodes = arg.split("=", 1)[1]
    low, _, high = nnodes.partition(":")
    if high and high != low:
        return None
    try:
        nodes, nproc = int(low), int(_nproc(env, gpu_count))
    except ValueError:
        return None
    return nodes * nproc if nodes > 0 and nproc > 0 else None


def check_spelling(train_args: Sequence[str], env: Mapping[str, str]) -> None:
    """The config's file, keys and value types, before torch is imported (~2-3 s on 2 cores): the mistakes users
    make most (a misspelt key, a value of the wrong type, a missing TOML file) come back well within a second.
    What needs torch (flavors, degrees against the GPU count, data) follows in check_before_launch."""
    from torchtitan.config.errors import ConfigError
    from torchtitan.config.manager import read_args

    try:
        read_args(entry_point_argv(train_args, env))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)


def check_before_launch(train_args: Sequence[str], env: Mapping[str, str], gpu_count: int) -> None:
    """The ranks' own checks (torchtitan/config/preflight.py), run once here before torchrun starts them: a bad key,
    value, flavor, degree, tokenizer or data path is then one line on stderr and exit code 2, rather than every rank
    failing the same way inside torchrun's report (where LOG_RANK may hide the rank that printed it)."""
    from torchtitan.config.errors import ConfigError
    from torchtitan.config.manager import parse_args
    from torchtitan.config.preflight import check_inputs, check_job

    argv = entry_point_argv(train_args, env)
    world = world_size(env, gpu_count)
    try:
        # the degrees need the world size: with an elastic node count the ranks check them once it is known
        cfg = parse_args(argv) if world is None else check_job(argv, world)[0]
        if not cfg.memory_estimation.enable:  # an estimate needs neither data nor tokenizer on this machine
            check_inputs(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, FileNotFoundError) as e:  # data and tokenizer errors name their key and file
        print(f"error: {e}", file=sys.stderr)
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


def _missing_module() -> str | None:
    """The first required module this interpreter cannot import, with the reason; None when all import."""
    for name in REQUIRED_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            return f"{name} ({e})"
    return None


def main(argv: Sequence[str] | None = None) -> None:
    train_args = list(sys.argv[1:] if argv is None else argv)
    check_spelling(train_args, os.environ)
    missing = _missing_module()
    if missing is not None:
        sys.exit(f"[launch] {sys.executable} cannot import {missing}: remove .venv/.installed-pyproject and run "
                 "./run_train.sh again to reinstall")
    import torch
    from torch.distributed.run import main as torchrun

    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpu_count == 0:
        # CPU ranks share the cores: one OpenMP thread each avoids oversubscription (and fork deadlocks).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    check_before_launch(train_args, os.environ, gpu_count)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun(torchrun_argv(train_args, os.environ, gpu_count))
    except ChildFailedError as e:  # instead of its traceback and report: one line naming the rank and the reason
        line, code = failure_line(e.failures)
        print(line, file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    main()
