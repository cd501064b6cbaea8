"""Unit tests for torchtitan/config/resolve.py: every derived value is filled in once, in the config itself."""

from __future__ import annotations

import pytest

from torchtitan.components.validate import validation_shape
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import load_config, parse_args, to_dict
from torchtitan.config.resolve import resolve


def _resolved(argv: list[str], world_size: int):
    cfg = parse_args(argv)
    return cfg, resolve(cfg, world_size)


def _one_line_error(argv: list[str], world_size: int, *needles: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv, world_size)
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


# --------------------------------------------------------------------------- what is filled in


def test_defaults_resolve_to_numbers():
    cfg, r = _resolved([], 4)
    assert cfg.parallelism.data_parallel_shard_degree == 4
    assert cfg.training.global_batch_size == 4 * cfg.training.local_batch_size
    assert cfg.validation.local_batch_size == cfg.training.local_batch_size
    assert cfg.validation.seq_len == cfg.training.seq_len
    assert r.grad_accum_steps == 1
    assert (r.parallel_dims.dp_shard, r.parallel_dims.world_size) == (4, 4)
    assert -1 not in (cfg.parallelism.data_parallel_shard_degree, cfg.training.global_batch_size,
                      cfg.validation.local_batch_size, cfg.validation.seq_len)


def test_explicit_values_are_kept():
    argv = ["--validation.local_batch_size", "3", "--validation.seq_len", "128", "--training.local_batch_size", "2",
            "--training.global_batch_size", "16", "--parallelism.data_parallel_replicate_degree", "2"]
    cfg, r = _resolved(argv, 4)
    assert (cfg.validation.local_batch_size, cfg.validation.seq_len) == (3, 128)
    assert cfg.parallelism.data_parallel_shard_degree == 2
    assert cfg.training.global_batch_size == 16
    assert r.grad_accum_steps == 2  # 16 / (2 x dp 4)
    assert validation_shape(cfg) == (3, 128)


def test_dp_shard_takes_the_ranks_the_other_dimensions_leave():
    cfg, r = _resolved(["--parallelism.tensor_parallel_degree", "2"], 8)
    assert cfg.parallelism.data_parallel_shard_degree == 4 == r.parallel_dims.dp_shard
    assert r.parallel_dims.dp_degree == 4
    assert cfg.training.global_batch_size == 4 * cfg.training.local_batch_size  # TP ranks share data


def test_resolving_again_for_the_same_world_changes_nothing():
    cfg, first = _resolved(["--training.global_batch_size", "64"], 2)
    before = to_dict(cfg)
    again = resolve(cfg, 2)
    assert to_dict(cfg) == before
    assert again.grad_accum_steps == first.grad_accum_steps == 4
    # the numbers are explicit now: another world size no longer fits them
    with pytest.raises(ConfigError, match="world size is 4"):
        resolve(cfg, 4)


def test_validation_shape_refuses_an_unresolved_config():
    with pytest.raises(ValueError, match="resolve"):
        validation_shape(JobConfig())


# --------------------------------------------------------------------------- batch arithmetic


@pytest.mark.parametrize(("local", "dp"), [(8, 1), (4, 2), (2, 8), (1, 3)])
def test_global_batch_default_is_one_step(local, dp):
    cfg, r = _resolved(["--training.local_batch_size", str(local)], dp)
    assert (cfg.training.global_batch_size, r.grad_accum_steps) == (local * dp, 1)


@pytest.mark.parametrize(
    ("local", "dp", "global_bs", "accum"),
    [(8, 1, 8, 1), (8, 1, 32, 4), (4, 2, 8, 1), (4, 2, 16, 2), (2, 4, 64, 8), (1, 3, 9, 3)],
)
def test_global_batch_accumulation(local, dp, global_bs, accum):
    argv = ["--training.local_batch_size", str(local), "--training.global_batch_size", str(global_bs)]
    cfg, r = _resolved(argv, dp)
    assert (cfg.training.global_batch_size, r.grad_accum_steps) == (global_bs, accum)


@pytest.mark.parametrize(
    ("local", "dp", "global_bs"),
    [(8, 1, 12), (4, 2, 12), (4, 2, 4), (2, 3, 8)],  # (4, 2, 4): smaller than one micro-step over all ranks
)
def test_global_batch_not_a_multiple(local, dp, global_bs):
    argv = ["--training.local_batch_size", str(local), "--training.global_batch_size", str(global_bs)]
    msg = _one_line_error(argv, dp, "training.global_batch_size")
    assert str(global_bs) in msg


# --------------------------------------------------------------------------- errors


def test_layout_that_does_not_fit_the_world():
    _one_line_error(["--parallelism.data_parallel_shard_degree", "4"], 2, "world size is 2")


def test_error_of_a_toml_value_names_the_file(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text("[training]\nlocal_batch_size = 4\nglobal_batch_size = 12\n")
    msg = _one_line_error(["--job.config_file", str(p)], 2, "training.global_batch_size")
    assert msg.startswith(f"{p}: ")


def test_tp_check_reads_the_resolved_validation_seq_len():
    # -1 resolves to training.seq_len (64, divisible by 2); an explicit 33 is not
    cfg, _ = _resolved(["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "64",
                        "--validation.enable"], 2)
    assert cfg.validation.seq_len == 64
    _one_line_error(["--parallelism.tensor_parallel_degree", "2", "--validation.enable", "--validation.seq_len",
                     "33"], 2, "validation.seq_len=33")
