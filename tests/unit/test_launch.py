"""torchtitan/launch.py: the one interpreter run_train.sh starts builds torchrun's command line from NGPU,
CONFIG_FILE, LOG_RANK and TORCHRUN_ARGS, and a missing package stops it with one line."""

from __future__ import annotations

import sys

import pytest
from torch.distributed.run import parse_args

from torchtitan.launch import DEFAULT_CONFIG_FILE, main, torchrun_argv


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
