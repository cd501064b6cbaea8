"""torchtitan/launch.py: the one interpreter run_train.sh starts builds torchrun's command line from NGPU,
CONFIG_FILE, LOG_RANK and TORCHRUN_ARGS, and a missing package stops it with one line. And
scripts/multinode_trainer.slurm, run under a fake Slurm (scontrol and srun on PATH), turns the allocation into
those variables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import parse_args

from torchtitan import launch
from torchtitan.launch import DEFAULT_CONFIG_FILE, failure_line, main, torchrun_argv, world_size

REPO = Path(__file__).resolve().parents[2]
SLURM_SCRIPT = REPO / "scripts" / "multinode_trainer.slurm"


def _parsed(argv: list[str]):
    """What torchrun itself makes of the command line (its own parser, so a flag it renamed fails here)."""
    return parse_args(argv)


def test_defaults_two_cpu_processes_the_debug_config_and_rank_0_shown():
    args = _parsed(torchrun_argv(["--training.steps", "3"], {}, gpu_count=0))
    assert args.nproc_per_node == "2" and args.standalone and args.module
    assert args.training_script == "torchtitan.train"
    assert args.training_script_args == ["--job.config_file", DEFAULT_CONFIG_FILE, "--training.steps", "3"]
    assert args.local_ranks_filter == "0" and args.tee == "3" and args.role == "rank"


def test_all_gpus_by_default_and_ngpu_wins():
    assert _parsed(torchrun_argv([], {}, gpu_count=8)).nproc_per_node == "8"
    assert _parsed(torchrun_argv([], {"NGPU": "4"}, gpu_count=8)).nproc_per_node == "4"
    assert _parsed(torchrun_argv([], {"NGPU": "1"}, gpu_count=0)).nproc_per_node == "1"


@pytest.mark.parametrize("own", [["--job.config_file", "mine.toml"], ["--job.config_file=mine.toml"]])
def test_the_users_config_file_replaces_config_file(own):
    args = _parsed(torchrun_argv(own, {"CONFIG_FILE": "other.toml"}, gpu_count=0))
    assert args.training_script_args == own


def test_config_file_log_rank_and_multi_node_rendezvous():
    env = {"CONFIG_FILE": "train_configs/llama3_8b.toml", "LOG_RANK": "0,3",
           "TORCHRUN_ARGS": "--nnodes 4 --node_rank 1 --rdzv_backend c10d --rdzv_endpoint host:29500"}
    args = _parsed(torchrun_argv([], env, gpu_count=8))
    assert args.training_script_args == ["--job.config_file", "train_configs/llama3_8b.toml"]
    assert args.local_ranks_filter == "0,3" and not args.standalone
    assert (args.nnodes, args.node_rank, args.rdzv_backend, args.rdzv_endpoint) == ("4", 1, "c10d", "host:29500")


def test_a_missing_package_is_one_line_before_torchrun(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` raise ImportError
    with pytest.raises(SystemExit) as exit_info:
        main([])
    message = str(exit_info.value.code)
    assert message.startswith("[launch]") and "cannot import tiktoken" in message and "\n" not in message


@pytest.mark.parametrize(("env", "gpus", "world"), [
    ({}, 0, 2),  # two CPU processes
    ({"NGPU": "4"}, 8, 4),
    ({"TORCHRUN_ARGS": "--nnodes 4 --node_rank 1 --rdzv_backend c10d --rdzv_endpoint host:29500"}, 8, 32),
    ({"NGPU": "2", "TORCHRUN_ARGS": "--nnodes=3:3 --rdzv_backend c10d"}, 0, 6),
    ({"TORCHRUN_ARGS": "--nnodes 2:4 --rdzv_backend c10d"}, 8, None),  # elastic: unknown before rendezvous
    ({"NGPU": "many"}, 0, None),  # torchrun reports it
    ({}, None, None),  # GPUs not counted yet (before torch is imported on a machine with a GPU driver)
    ({"NGPU": "4", "TORCHRUN_ARGS": "--nnodes 2"}, None, 8),
])
def test_world_size_from_the_launch_variables(env, gpus, world):
    assert world_size(env, gpus) == world


def test_no_gpu_driver_means_no_gpu_without_importing_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "GPU_DRIVER_PATHS", (str(tmp_path / "nvidiactl"),))
    assert launch.gpu_count_without_torch() == 0
    (tmp_path / "nvidiactl").touch()
    assert launch.gpu_count_without_torch() is None  # torch counts them


@pytest.fixture
def torchrun_calls(monkeypatch) -> list[list[str]]:
    """main() as run_train.sh runs it (repository root, no launcher variables), with torchrun replaced by a
    recorder of its command lines."""
    import torch.distributed.run

    calls: list[list[str]] = []
    monkeypatch.setattr(torch.distributed.run, "main", calls.append)
    for key in ("NGPU", "CONFIG_FILE", "TORCHRUN_ARGS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(REPO)
    return calls


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--training.seq_len", "-4"], {}, "training.seq_len: must be > 0, got -4"),
    (["--training.stepz", "3"], {}, "unknown config key 'training.stepz'"),
    (["--parallelism.data_parallel_shard_degree", "4"], {"NGPU": "2"}, "but the world size is 2"),
    (["--parallelism.data_parallel_shard_degree", "4"], {"NGPU": "2", "TORCHRUN_ARGS": "--nnodes 3"},
     "but the world size is 6"),
    (["--model.flavor", "nope"], {"CONFIG_FILE": "train_configs/llama3_8b.toml"}, "model.flavor"),
])
def test_a_bad_config_is_one_line_and_exit_2_before_torchrun(args, env, message, torchrun_calls, monkeypatch,
                                                             capsys):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and not torchrun_calls
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error:") and message in err, err


@pytest.mark.parametrize(("args", "message"), [
    (["--model.tokenizer_path", "/nonexistent/tokenizer.json"], "model.tokenizer_path: tokenizer file not found"),
    (["--training.dataset_path", "/nonexistent/train.jsonl"], "training.dataset_path: no such file or directory"),
    (["--validation.enable", "--validation.dataset", "nope"], "validation.dataset: unknown dataset 'nope'"),
])
def test_a_missing_tokenizer_or_data_is_one_line_and_exit_2_before_torchrun(args, message, torchrun_calls, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and not torchrun_calls
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    # A memory estimate needs neither: the launch goes on to torchrun, whose ranks estimate.
    main([*args, "--memory_estimation.enable"])
    assert len(torchrun_calls) == 1


def test_a_valid_config_reaches_torchrun_unchanged(torchrun_calls):
    main(["--training.steps", "3"])
    assert torchrun_calls
    assert torchrun_calls[0][-4:] == ["--job.config_file", DEFAULT_CONFIG_FILE, "--training.steps", "3"]


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None, timestamp: int = 100):
    """torchrun's own ProcessFailure, reading an error file as record_failure writes it (None: no file)."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error{rank}.json"
    if message is not None:
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": "Traceback ...", "timestamp": str(timestamp)}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def test_failure_line_names_the_rank_that_recorded_its_error(tmp_path):
    # rank 0 was stopped by torchrun (SIGTERM, no error of its own), rank 1 recorded a setup error
    failures = {0: _failure(tmp_path, 0, -15, None), 1: _failure(tmp_path, 1, 2, "ValueError: data.x: bad file")}
    assert failure_line(failures) == ("[launch] rank 1 failed (exit code 2): data.x: bad file", 2)


def test_failure_line_takes_the_earliest_recorded_error_and_points_to_unexpected_tracebacks(tmp_path):
    # Both recorded within the same second (torchrun's timestamp): the file written first wins, whatever the rank.
    failures = {1: _failure(tmp_path, 1, 1, "RuntimeError: shape mismatch in layers.3\nmore"),
                0: _failure(tmp_path, 0, 1, "RuntimeError: gloo: connection reset\nmore")}
    os.utime(tmp_path / "error1.json", ns=(10**18, 10**18))
    os.utime(tmp_path / "error0.json", ns=(10**18 + 1000, 10**18 + 1000))
    line, code = failure_line(failures)
    assert line == (f"[launch] rank 1 failed (exit code 1): RuntimeError: shape mismatch in layers.3 (traceback in "
                    f"{tmp_path / 'error1.json'})") and code == 1


def test_failure_line_without_any_recorded_error(tmp_path):
    assert failure_line({3: _failure(tmp_path, 3, -9, None)}) == (
        "[launch] rank 3 was stopped by SIGKILL before it recorded an error", 1)
    line, code = failure_line({2: _failure(tmp_path, 2, 7, None)})
    assert line.startswith("[launch] rank 2 exited with code 7 without recording an error") and code == 7


# A fake Slurm: scontrol expands only the node list the test gives it (into FAKE_HOSTS), srun records its argv and
# environment instead of starting anything.
_FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2 $3" = "show hostnames $EXPECTED_NODELIST" ] || { echo "unexpected: scontrol $*" >&2; exit 2; }
for h in $FAKE_HOSTS; do echo "$h"; done
"""
_FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$SRUN_RECORD.argv"
env -0 > "$SRUN_RECORD.env"
"""


def _sbatch(tmp_path: Path, args=(), hosts="gpu-07 gpu-08", **env_vars: str):
    """Run the Slurm script as sbatch would on the first node (from the repository root): the completed process
    and what srun received (argv, environment), or None where srun was never reached."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", _FAKE_SCONTROL), ("srun", _FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "srun"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_RECORD": str(record), "FAKE_HOSTS": hosts,
           "EXPECTED_NODELIST": env_vars.get("SLURM_JOB_NODELIST", ""), **env_vars}
    proc = subprocess.run(["bash", str(SLURM_SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=30)
    if not record.with_suffix(".argv").exists():
        return proc, None, None
    argv = record.with_suffix(".argv").read_text().split("\0")[:-1]
    srun_env = dict(kv.split("=", 1) for kv in record.with_suffix(".env").read_text().split("\0") if "=" in kv)
    return proc, argv, srun_env


ALLOCATION = {"SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242"}


def test_slurm_script_takes_the_rendezvous_from_the_allocation(tmp_path):
    proc, argv, srun_env = _sbatch(tmp_path, ["--training.steps", "10"], **ALLOCATION, SLURM_GPUS_ON_NODE="8",
                                   CONFIG_FILE="train_configs/llama3_8b.toml", LOG_RANK="0,8")
    assert proc.returncode == 0, proc.stderr
    # one launcher per node, the config overrides passed through untouched
    assert argv == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "./run_train.sh", "--training.steps", "10"]
    # what each node's launcher then hands torchrun, read by torchrun's own parser
    args = _parsed(torchrun_argv(argv[3:], srun_env, gpu_count=8))
    assert not args.standalone
    assert (args.nnodes, args.rdzv_id, args.rdzv_backend, args.rdzv_endpoint) == ("2", "4242", "c10d",
                                                                                  "gpu-07:29500")
    assert args.nproc_per_node == "8" and args.local_ranks_filter == "0,8"
    assert args.training_script_args == ["--job.config_file", "train_configs/llama3_8b.toml", "--training.steps",
                                         "10"]
    assert "gpu-07:29500" in proc.stderr  # the job log says where the nodes meet


def test_slurm_script_overrides_port_host_ngpu_and_cpus(tmp_path):
    proc, argv, srun_env = _sbatch(tmp_path, **ALLOCATION, SLURM_GPUS_ON_NODE="8", NGPU="4", RDZV_PORT="31000",
                                   RDZV_HOST="10.0.0.7", SLURM_CPUS_PER_TASK="32",
                                   TORCHRUN_EXTRA_ARGS="--rdzv_conf join_timeout=1800 --max-restarts 2",
                                   TORCHRUN_ARGS="--standalone")  # an outside value is replaced
    assert proc.returncode == 0, proc.stderr
    assert argv == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=32", "./run_train.sh"]
    args = _parsed(torchrun_argv([], srun_env, gpu_count=8))
    assert not args.standalone and args.rdzv_endpoint == "10.0.0.7:31000" and args.nproc_per_node == "4"
    assert args.rdzv_conf == "join_timeout=1800" and args.max_restarts == 2


def test_slurm_script_without_gpu_count_lets_the_launcher_count(tmp_path):
    proc, _, srun_env = _sbatch(tmp_path, **ALLOCATION)
    assert proc.returncode == 0, proc.stderr
    assert srun_env["NGPU"] == ""
    assert _parsed(torchrun_argv([], srun_env, gpu_count=8)).nproc_per_node == "8"


@pytest.mark.parametrize("missing", ["SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_JOB_ID"])
def test_slurm_script_outside_an_allocation_stops_before_srun(tmp_path, missing):
    env = {k: v for k, v in ALLOCATION.items() if k != missing}
    proc, argv, _ = _sbatch(tmp_path, **env)
    assert proc.returncode != 0 and argv is None
    assert missing in proc.stderr and "Slurm allocation" in proc.stderr


def test_slurm_script_stops_when_scontrol_names_no_host(tmp_path):
    proc, argv, _ = _sbatch(tmp_path, hosts="", **ALLOCATION)
    assert proc.returncode != 0 and argv is None
    assert "gave no host name" in proc.stderr


def test_slurm_directives_come_before_the_first_command():
    # sbatch reads #SBATCH lines only up to the first line that is neither blank nor a comment.
    lines = SLURM_SCRIPT.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    directives = [line.split()[1] for line in lines[:first_command] if line.startswith("#SBATCH")]
    assert not any(line.startswith("#SBATCH") for line in lines[first_command:])
    assert "--ntasks-per-node=1" in directives
    assert any(d.startswith("--nodes=") for d in directives) and any(d.startswith("--gpus-per-node=") for d in
                                                                     directives)


@pytest.mark.parametrize(("args", "message"), [
    (["--training.stepz", "3"], "config error: --training.stepz: unknown config key 'training.stepz'"),
    (["--training.steps", "abc"], "config error: --training.steps: expected an integer, got 'abc'"),
    (["--training.steps", "-1"], "config error: training.steps: must be > 0, got -1"),
    (["--model.flavor", "nope"], "config error: model.flavor: unknown flavor 'nope' of llama3"),
    (["--parallelism.tensor_parallel_degree", "3"],
     "config error: parallelism.tensor_parallel_degree=3 with model llama3/debugmodel: n_heads=8 is not divisible"),
    (["--parallelism.tensor_parallel_degree", "4"],
     "config error: parallelism: dp_replicate=1 x cp=1 x tp=4 x pp=1 = 4 does not divide the world size 2"),
    (["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "4"],
     "config error: parallelism.expert_parallel_degree"),
    (["--training.dataset_path", "/nonexistent/train.jsonl"], "error: training.dataset_path: no such file"),
    (["--training.dataset_path", str(REPO / "tests/integration/data/short_documents.jsonl"),
      "--training.dataset_text_column", "body"], "error: training.dataset_text_column: no column 'body'"),
])
def test_config_data_and_tokenizer_errors_come_before_torch_is_imported(args, message):
    # Importing torch is most of a failed launch's time (~3 s on 2 cores): keys, values, flavors, degrees (the world
    # size is NGPU here) and local data are all checked without it.
    code = ("import sys\nfrom torchtitan import launch\ntry:\n    launch.main(sys.argv[1:])\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CONFIG_FILE", "TORCHRUN_ARGS")}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**env, "NGPU": "2"})
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(message.split(": ")[0] + ": ") and \
        message in proc.stderr, proc.stderr


def test_default_environment_for_cpu_and_gpu_ranks():
    cpu, gpu, own = {}, {}, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512", "OMP_NUM_THREADS": "4"}
    launch.set_default_environment(cpu, 0)
    launch.set_default_environment(gpu, 8)
    launch.set_default_environment(own, 0)
    launch.set_default_environment(own, 8)
    assert cpu == {"OMP_NUM_THREADS": "1"}
    assert gpu == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert own == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512", "OMP_NUM_THREADS": "4"}  # the user's stay
