"""Unit tests for torchtitan.config: defaults < TOML < CLI, one-line ConfigErrors, value checks, --help."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from torchtitan.config import validate
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import (
    ALIASES,
    field_docs,
    help_text,
    parse_args,
    read_args,
    section_classes,
    to_dict,
    to_json,
)

REPO = Path(__file__).resolve().parents[2]
TRAIN_CONFIGS = sorted((REPO / "train_configs").glob("*.toml"))


def _write(tmp_path: Path, text: str, name: str = "cfg.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _config_error(argv: list[str]) -> str:
    """parse_args(argv) must fail with a ConfigError whose message is one non-empty line; return it."""
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    msg = str(info.value)
    assert msg and "\n" not in msg and "\r" not in msg, repr(msg)
    return msg


def _toml_error(tmp_path: Path, text: str) -> tuple[str, Path]:
    p = _write(tmp_path, text)
    msg = _config_error(["--job.config_file", str(p)])
    assert str(p) in msg, f"TOML error does not name the file: {msg}"
    return msg, p


# --------------------------------------------------------------------------- defaults


def test_defaults_are_the_dataclass_defaults():
    cfg = parse_args([])
    assert isinstance(cfg, JobConfig)
    assert to_dict(cfg) == to_dict(JobConfig())
    assert cfg.model.name == "llama3"
    assert cfg.model.flavor == "debugmodel"
    assert cfg.training.steps == 10000
    assert cfg.training.global_batch_size == -1
    assert cfg.optimizer.lr == pytest.approx(8e-4)
    assert cfg.lr_scheduler.decay_ratio is None
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.model.converters == []
    assert cfg.compile.components == ["model", "loss"]
    assert cfg.debug.seed is None
    assert cfg.debug.deterministic is False


def test_list_defaults_are_not_shared_between_instances():
    a, b = JobConfig(), JobConfig()
    a.compile.components.append("x")
    assert b.compile.components == ["model", "loss"]


def test_to_json_round_trips():
    import json

    cfg = parse_args(["--training.steps", "7"])
    assert json.loads(to_json(cfg)) == to_dict(cfg)
    assert json.loads(to_json(cfg))["training"]["steps"] == 7


def test_parse_args_without_argv_reads_sys_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--training.steps", "11"])
    assert parse_args().training.steps == 11


# --------------------------------------------------------------------------- precedence


def test_toml_overrides_defaults(tmp_path):
    p = _write(
        tmp_path,
        """
[job]
description = "from toml"
[training]
steps = 123
seq_len = 64
max_norm = 2
[optimizer]
lr = 1e-3
[lr_scheduler]
decay_ratio = 0.25
[model]
converters = []
[checkpoint]
exclude_from_loading = ["optimizer", "dataloader"]
[metrics]
enable_tensorboard = true
[debug]
seed = 5
""",
    )
    cfg = parse_args(["--job.config_file", str(p)])
    assert cfg.job.config_file == str(p)
    assert cfg.job.description == "from toml"
    assert cfg.training.steps == 123
    assert cfg.training.seq_len == 64
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.optimizer.lr == pytest.approx(1e-3)
    assert cfg.lr_scheduler.decay_ratio == pytest.approx(0.25)
    assert cfg.checkpoint.exclude_from_loading == ["optimizer", "dataloader"]
    assert cfg.metrics.enable_tensorboard is True
    assert cfg.debug.seed == 5
    # untouched keys keep their defaults
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size
    assert cfg.optimizer.beta2 == JobConfig().optimizer.beta2


def test_cli_overrides_toml(tmp_path):
    p = _write(tmp_path, "[training]\nsteps = 123\nseq_len = 64\n[optimizer]\nlr = 1e-3\n")
    cfg = parse_args(["--training.steps", "5", "--job.config_file", str(p), "--optimizer.lr=2e-3"])
    assert cfg.training.steps == 5  # CLI wins over TOML, wherever it appears on the line
    assert cfg.optimizer.lr == pytest.approx(2e-3)  # --a.b=v form
    assert cfg.training.seq_len == 64  # TOML wins over the default


def test_cli_config_file_with_equals_form(tmp_path):
    p = _write(tmp_path, "[training]\nsteps = 9\n")
    assert parse_args([f"--job.config_file={p}"]).training.steps == 9


@pytest.mark.parametrize("equals", [False, True])
def test_config_file_given_twice_loads_and_records_the_last(tmp_path, equals):
    # run_train.sh used to put its default --job.config_file first: the user's file must be the one loaded.
    first = _write(tmp_path, "[training]\nsteps = 1\nseq_len = 64\n", "first.toml")
    last = _write(tmp_path, "[training]\nsteps = 2\n", "last.toml")
    second = [f"--job.config_file={last}"] if equals else ["--job.config_file", str(last)]
    cfg = parse_args(["--job.config_file", str(first), *second])
    assert cfg.training.steps == 2
    assert cfg.training.seq_len == JobConfig().training.seq_len  # nothing from the first file
    assert cfg.job.config_file == str(last)  # what job_config.json records is the file loaded


def test_config_file_given_twice_only_the_last_must_exist(tmp_path):
    last = _write(tmp_path, "[training]\nsteps = 2\n", "last.toml")
    assert parse_args(["--job.config_file", str(tmp_path / "gone.toml"), "--job.config_file", str(last)]) \
        .training.steps == 2
    msg = _config_error(["--job.config_file", str(last), "--job.config_file", str(tmp_path / "gone.toml")])
    assert str(tmp_path / "gone.toml") in msg


def test_invalid_value_from_the_toml_names_the_file(tmp_path):
    p = _write(tmp_path, "[training]\nseq_len = -3\n")
    msg = _config_error(["--job.config_file", str(p)])
    assert msg.startswith(f"{p}: training.seq_len")
    # overridden on the command line, the value checked is not the file's: no file named
    msg = _config_error(["--job.config_file", str(p), "--training.seq_len", "-4"])
    assert msg.startswith("training.seq_len") and str(p) not in msg


def test_help_says_the_last_value_wins():
    assert "takes the last value" in help_text()


@pytest.mark.parametrize(
    ("argv", "section", "key", "expected"),
    [
        (["--training.steps", "3"], "training", "steps", 3),
        (["--training.steps=3"], "training", "steps", 3),
        (["--training.global_batch_size", "-1"], "training", "global_batch_size", -1),
        (["--optimizer.lr", "1e-2"], "optimizer", "lr", 1e-2),
        (["--optimizer.lr=3"], "optimizer", "lr", 3.0),
        (["--job.description", "hello world"], "job", "description", "hello world"),
        (["--job.description=a=b"], "job", "description", "a=b"),
        (["--job.save_config_file="], "job", "save_config_file", ""),
        (["--metrics.enable_tensorboard"], "metrics", "enable_tensorboard", True),
        (["--job.print_config", "false"], "job", "print_config", False),
        (["--job.print_config=False"], "job", "print_config", False),
        (["--job.print_config", "0"], "job", "print_config", False),
        (["--job.print_config", "off"], "job", "print_config", False),
        (["--metrics.enable_tensorboard", "yes"], "metrics", "enable_tensorboard", True),
        (["--metrics.enable_tensorboard=ON"], "metrics", "enable_tensorboard", True),
        (["--checkpoint.exclude_from_loading", "optimizer,dataloader"], "checkpoint", "exclude_from_loading",
         ["optimizer", "dataloader"]),
        (["--checkpoint.exclude_from_loading", " optimizer , dataloader ,"], "checkpoint", "exclude_from_loading",
         ["optimizer", "dataloader"]),
        (["--checkpoint.exclude_from_loading", '["optimizer", "lr_scheduler"]'], "checkpoint",
         "exclude_from_loading", ["optimizer", "lr_scheduler"]),
        (["--checkpoint.exclude_from_loading", "[]"], "checkpoint", "exclude_from_loading", []),
        (["--compile.components", "model"], "compile", "components", ["model"]),
        (["--parallelism.module_fqns_per_model_part", '[["tok_embeddings", "layers.0"], ["norm"]]'],
         "parallelism", "module_fqns_per_model_part", [["tok_embeddings", "layers.0"], ["norm"]]),
        (["--parallelism.module_fqns_per_model_part", "none"], "parallelism", "module_fqns_per_model_part",
         None),
        (["--debug.seed", "7"], "debug", "seed", 7),
        (["--debug.seed", "none"], "debug", "seed", None),
        (["--debug.seed=None"], "debug", "seed", None),
        (["--lr_scheduler.decay_ratio", "0.2"], "lr_scheduler", "decay_ratio", 0.2),
        (["--lr_scheduler.decay_ratio", "null"], "lr_scheduler", "decay_ratio", None),
        (["--parallelism.pipeline_parallel_layers_per_stage", "4"], "parallelism",
         "pipeline_parallel_layers_per_stage", 4),
    ],
)
def test_cli_value_forms(argv, section, key, expected):
    cfg = read_args(argv)  # value forms only: some of these keys are refused later, as not available yet
    value = getattr(getattr(cfg, section), key)
    if isinstance(expected, float):
        assert value == pytest.approx(expected) and isinstance(value, float)
    else:
        assert value == expected and type(value) is type(expected)


def test_bare_bool_flag_followed_by_another_override():
    cfg = parse_args(["--metrics.enable_tensorboard", "--training.steps", "4"])
    assert cfg.metrics.enable_tensorboard is True
    assert cfg.training.steps == 4


def test_none_for_optional_cli_overrides_toml(tmp_path):
    p = _write(tmp_path, "[lr_scheduler]\ndecay_ratio = 0.5\n[debug]\nseed = 3\n")
    cfg = parse_args(["--job.config_file", str(p), "--lr_scheduler.decay_ratio", "none", "--debug.seed", "none"])
    assert cfg.lr_scheduler.decay_ratio is None
    assert cfg.debug.seed is None


def test_none_is_a_plain_string_for_str_fields():
    # Only Optional fields treat "none" as None.
    assert parse_args(["--job.description", "none"]).job.description == "none"


def test_last_cli_override_wins():
    assert parse_args(["--training.steps", "3", "--training.steps", "4"]).training.steps == 4


# --------------------------------------------------------------------------- aliases


def test_alias_key_on_cli():
    assert ("model", "hf_assets_path") in ALIASES
    cfg = parse_args(["--model.hf_assets_path", "/some/tokenizer"])
    assert cfg.model.tokenizer_path == "/some/tokenizer"


def test_alias_key_in_toml(tmp_path):
    p = _write(tmp_path, '[model]\nhf_assets_path = "/from/toml"\n')
    assert parse_args(["--job.config_file", str(p)]).model.tokenizer_path == "/from/toml"


def test_every_alias_points_at_a_real_field():
    sections = section_classes()
    for (sec, key), (tsec, tkey) in ALIASES.items():
        assert tsec in sections
        assert tkey in {f.name for f in dataclasses.fields(sections[tsec])}
        if sec in sections:  # an alias must not shadow a real field
            assert key not in {f.name for f in dataclasses.fields(sections[sec])}


@pytest.mark.parametrize(
    ("argv", "seed", "deterministic"),
    [
        (["--training.seed", "5"], 5, False),
        (["--debug.seed", "5"], 5, False),
        (["--training.seed", "5", "--debug.seed", "5"], 5, False),
        (["--training.deterministic"], None, True),
        (["--debug.deterministic"], None, True),
        (["--training.deterministic", "true", "--debug.deterministic", "true"], None, True),
        (["--training.deterministic", "false"], None, False),
        (["--training.seed", "0"], 0, False),
    ],
)
def test_training_seed_and_deterministic_are_aliases_of_debug(argv, seed, deterministic):
    cfg = parse_args(argv)
    assert cfg.debug.seed == seed
    assert cfg.debug.deterministic is deterministic
    # the alias is folded into [debug] when read, so only one place holds the value
    assert not hasattr(cfg.training, "seed") and not hasattr(cfg.training, "deterministic")
    assert "seed" not in to_dict(cfg)["training"]


def test_training_seed_alias_from_toml(tmp_path):
    p = _write(tmp_path, "[training]\nseed = 11\ndeterministic = true\n")
    cfg = parse_args(["--job.config_file", str(p)])
    assert cfg.debug.seed == 11
    assert cfg.debug.deterministic is True


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--training.seed", "5", "--debug.seed", "6"], "seed"),
        (["--training.deterministic", "false", "--debug.deterministic", "true"], "deterministic"),
    ],
)
def test_conflicting_alias_and_debug_values(argv, key):
    msg = _config_error(argv)
    assert f"training.{key}" in msg and f"debug.{key}" in msg and "command line" in msg


def test_same_spelling_twice_on_the_command_line_takes_the_last():
    assert parse_args(["--training.seed", "5", "--training.seed", "6"]).debug.seed == 6


@pytest.mark.parametrize(
    ("toml", "argv", "seed", "deterministic"),
    [
        ("[debug]\nseed = 1\n", ["--training.seed", "2"], 2, False),
        ("[training]\nseed = 1\n", ["--debug.seed", "2"], 2, False),
        ("[training]\nseed = 1\n", ["--training.seed", "2"], 2, False),
        ("[debug]\nseed = 1\n", ["--debug.seed", "none"], None, False),
        ("[debug]\ndeterministic = true\n", ["--training.deterministic", "false"], None, False),
        ("[training]\ndeterministic = true\nseed = 3\n", ["--debug.deterministic", "false"], 3, False),
        ("[training]\nseed = 4\n[debug]\nseed = 4\n", [], 4, False),  # two spellings that agree
    ],
)
def test_command_line_wins_over_toml_for_either_spelling(tmp_path, toml, argv, seed, deterministic):
    p = _write(tmp_path, toml)
    cfg = parse_args(["--job.config_file", str(p), *argv])
    assert cfg.debug.seed == seed
    assert cfg.debug.deterministic is deterministic


def test_two_spellings_in_the_toml_conflict(tmp_path):
    msg, p = _toml_error(tmp_path, "[training]\nseed = 1\n[debug]\nseed = 2\n")
    assert "training.seed" in msg and "debug.seed" in msg
    # the command line settles what the file leaves open only by setting the key itself: the file still conflicts
    msg = _config_error(["--job.config_file", str(p), "--debug.seed", "3"])
    assert str(p) in msg


def test_help_lists_the_aliases():
    text = help_text()
    assert "Also accepted as --training.seed" in text
    assert "Also accepted as --training.deterministic" in text
    assert "Also accepted as --model.hf_assets_path" in text


# --------------------------------------------------------------------------- unknown names


def test_unknown_section_cli():
    msg = _config_error(["--trainig.steps", "3"])
    assert "trainig" in msg and "did you mean 'training'" in msg


def test_unknown_section_without_close_match_lists_known_sections():
    msg = _config_error(["--zzzz.steps", "3"])
    assert "zzzz" in msg and "training" in msg


def test_unknown_key_cli_with_did_you_mean():
    msg = _config_error(["--training.stepz", "3"])
    assert "training.stepz" in msg
    assert "did you mean 'training.steps'" in msg


def test_unknown_key_cli_equals_form():
    msg = _config_error(["--optimizer.lrr=0.1"])
    assert "optimizer.lrr" in msg and "optimizer.lr" in msg


def test_unknown_key_without_close_match():
    msg = _config_error(["--training.qqqqqqqq", "3"])
    assert "training.qqqqqqqq" in msg


def test_unknown_section_toml(tmp_path):
    msg, _ = _toml_error(tmp_path, "[trainig]\nsteps = 3\n")
    assert "trainig" in msg and "training" in msg


def test_unknown_key_toml(tmp_path):
    msg, _ = _toml_error(tmp_path, "[training]\nstepz = 3\n")
    assert "training.stepz" in msg and "did you mean 'training.steps'" in msg


def test_top_level_key_outside_a_section_toml(tmp_path):
    msg, _ = _toml_error(tmp_path, "steps = 3\n")
    assert "steps" in msg


def test_nested_table_toml(tmp_path):
    msg, _ = _toml_error(tmp_path, "[training.sub]\nx = 1\n")
    assert "training.sub" in msg


def test_override_without_section():
    msg = _config_error(["--steps", "3"])
    assert "--steps" in msg


def test_positional_argument_is_an_error():
    msg = _config_error(["steps"])
    assert "steps" in msg


# --------------------------------------------------------------------------- wrong types


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--training.steps", "three"], "training.steps"),
        (["--training.steps", "3.5"], "training.steps"),
        (["--training.steps"], "training.steps"),  # a bare flag is only for booleans
        (["--optimizer.lr", "fast"], "optimizer.lr"),
        (["--metrics.enable_tensorboard", "maybe"], "metrics.enable_tensorboard"),
        (["--job.print_config", "2"], "job.print_config"),
        (["--debug.seed", "abc"], "debug.seed"),
        (["--lr_scheduler.decay_ratio", "half"], "lr_scheduler.decay_ratio"),
        (["--checkpoint.exclude_from_loading", "[1, 2]"], "checkpoint.exclude_from_loading"),
        (["--checkpoint.exclude_from_loading", "[unterminated"], "checkpoint.exclude_from_loading"),
        (["--training.deterministic", "sometimes"], "training.deterministic"),
    ],
)
def test_wrong_type_cli(argv, key):
    msg = _config_error(argv)
    assert key in msg


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[training]\nsteps = "3"\n', "training.steps"),
        ("[training]\nsteps = 3.0\n", "training.steps"),
        ("[training]\nsteps = true\n", "training.steps"),  # bool is not an int
        ('[optimizer]\nlr = "1e-3"\n', "optimizer.lr"),
        ("[optimizer]\nlr = true\n", "optimizer.lr"),
        ("[metrics]\nenable_tensorboard = 1\n", "metrics.enable_tensorboard"),  # int is not a bool
        ("[metrics]\nenable_tensorboard = 0\n", "metrics.enable_tensorboard"),
        ('[metrics]\nenable_tensorboard = "true"\n', "metrics.enable_tensorboard"),
        ("[job]\ndescription = 5\n", "job.description"),
        ("[job]\ndescription = [\"a\"]\n", "job.description"),
        ('[checkpoint]\nexclude_from_loading = "optimizer"\n', "checkpoint.exclude_from_loading"),
        ("[checkpoint]\nexclude_from_loading = [1]\n", "checkpoint.exclude_from_loading"),
        ('[debug]\nseed = "x"\n', "debug.seed"),
        ('[lr_scheduler]\ndecay_ratio = "half"\n', "lr_scheduler.decay_ratio"),
        ('[model]\nhf_assets_path = 3\n', "model.tokenizer_path"),  # alias: names the real key
        ('[job]\ndescription = """multi\nline"""\nprint_config = "multi\\nline"\n', "job.print_config"),
    ],
)
def test_wrong_type_toml(tmp_path, text, key):
    msg, _ = _toml_error(tmp_path, text)
    assert key in msg


def test_int_is_accepted_for_float_in_toml(tmp_path):
    p = _write(tmp_path, "[optimizer]\nlr = 1\n[lr_scheduler]\ndecay_ratio = 1\n")
    cfg = parse_args(["--job.config_file", str(p)])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.lr_scheduler.decay_ratio == 1.0 and isinstance(cfg.lr_scheduler.decay_ratio, float)


def test_invalid_toml_syntax(tmp_path):
    msg, _ = _toml_error(tmp_path, "[training\nsteps = = 3\n")
    assert "invalid TOML" in msg


def test_invalid_toml_syntax_second_line(tmp_path):
    msg, _ = _toml_error(tmp_path, "[training]\nsteps 3\n")
    assert "invalid TOML" in msg


def test_toml_not_utf8(tmp_path):
    p = tmp_path / "bin.toml"
    p.write_bytes(b"[job]\ndescription = \"\xff\xfe\"\n")
    msg = _config_error(["--job.config_file", str(p)])
    assert str(p) in msg


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.toml"
    msg = _config_error(["--job.config_file", str(missing)])
    assert "job.config_file" in msg and str(missing) in msg


def test_config_file_is_a_directory(tmp_path):
    msg = _config_error(["--job.config_file", str(tmp_path)])
    assert "job.config_file" in msg and str(tmp_path) in msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --------------------------------------------------------------------------- value checks (validate.py)

# (argv, the key the message must name). Together these cover every _err / _one_of / _positive / _not_yet
# call in validate.py (test_every_validate_check_is_covered enforces that for the literal keys).
INVALID_VALUES = [
    # model
    (["--model.name", "gpt9"], "model.name"),
    (["--model.flavor", "13T"], "model.flavor"),
    (["--model.attn_mask_type", "block"], "model.attn_mask_type"),
    (["--model.n_layers", "-1"], "model.n_layers"),
    # optimizer
    (["--optimizer.name", "SGD"], "optimizer.name"),
    (["--optimizer.name", "adamw"], "optimizer.name"),
    (["--optimizer.implementation", "triton"], "optimizer.implementation"),
    (["--optimizer.lr", "0"], "optimizer.lr"),
    (["--optimizer.lr", "-1e-3"], "optimizer.lr"),
    (["--optimizer.eps", "0"], "optimizer.eps"),
    (["--optimizer.beta1", "1.0"], "optimizer.beta1"),
    (["--optimizer.beta1", "-0.1"], "optimizer.beta1"),
    (["--optimizer.beta2", "1.5"], "optimizer.beta2"),
    (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay"),
    # lr scheduler
    (["--lr_scheduler.decay_type", "exponential"], "lr_scheduler.decay_type"),
    (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps"),
    (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio"),
    (["--lr_scheduler.decay_ratio", "-0.1"], "lr_scheduler.decay_ratio"),
    (["--lr_scheduler.min_lr_factor", "1.1"], "lr_scheduler.min_lr_factor"),
    (["--lr_scheduler.min_lr_factor", "-0.5"], "lr_scheduler.min_lr_factor"),
    # training
    (["--training.local_batch_size", "0"], "training.local_batch_size"),
    (["--training.seq_len", "0"], "training.seq_len"),
    (["--training.steps", "0"], "training.steps"),
    (["--training.steps", "-5"], "training.steps"),
    (["--training.gc_freq", "0"], "training.gc_freq"),
    (["--training.global_batch_size", "0"], "training.global_batch_size"),
    (["--training.global_batch_size", "-2"], "training.global_batch_size"),
    (["--training.mixed_precision_param", "float16"], "training.mixed_precision_param"),
    (["--training.mixed_precision_reduce", "fp8"], "training.mixed_precision_reduce"),
    (["--training.dataset_streaming", "maybe"], "training.dataset_streaming"),
    (["--training.num_workers", "-2"], "training.num_workers"),
    (["--training.loss_chunks", "-1"], "training.loss_chunks"),
    (["--training.on_nonfinite", "ignore"], "training.on_nonfinite"),
    (["--training.dataset", "c4", "--training.dataset_mixture", "c4:1"], "training.dataset_mixture"),
    # chat data (docs/finetuning.md): its keys are refused on text data, checked on chat data
    (["--training.dataset_format", "sharegpt"], "training.dataset_format"),
    (["--training.chat_template", "chatml"], "training.chat_template"),
    (["--training.train_on", "all"], "training.train_on"),
    (["--training.sft_packing", "pack"], "training.sft_packing"),
    (["--training.truncation", "drop"], "training.truncation"),
    (["--training.dataset_format", "chat", "--training.dataset_path", "c.jsonl", "--training.chat_template", "vicuna"],
     "training.chat_template"),
    (["--training.dataset_format", "chat", "--training.dataset_path", "c.jsonl", "--training.train_on", "prompt"],
     "training.train_on"),
    (["--training.dataset_format", "chat", "--training.dataset_path", "c.jsonl", "--training.sft_packing", "greedy"],
     "training.sft_packing"),
    (["--training.dataset_format", "chat", "--training.dataset_path", "c.jsonl", "--training.truncation", "left"],
     "training.truncation"),
    (["--training.dataset_format", "chat", "--training.dataset_mixture", "c.jsonl:1"], "training.dataset_mixture"),
    (["--training.dataset_format", "alpaca"], "training.dataset_path"),
    # the embedded chat corpus (torchtitan/data/stdlib_chat.py): chat messages, so only for chat data
    (["--training.dataset", "python_stdlib_chat"], "training.dataset"),
    (["--validation.dataset", "python_stdlib_chat_val"], "validation.dataset"),
    (["--training.dataset_format", "alpaca", "--training.dataset", "python_stdlib_chat"], "training.dataset_format"),
    (["--training.dataset_format", "chat", "--training.dataset", "python_stdlib_chat", "--validation.enable", "true"],
     "validation.dataset_path"),
    (["--training.dataset_format", "chat", "--training.dataset_path", "c.jsonl", "--training.dataset_text_column",
      "body"], "training.dataset_text_column"),
    (["--training.dataset_format", "auto", "--training.dataset_path", "c.jsonl", "--training.sft_packing", "pack"],
     "training.sft_packing"),
    (["--training.dataset_format", "chat", "--training.dataset_path", "c.jsonl", "--validation.enable", "true"],
     "validation.dataset_path"),
    (["--training.dataset_format", "chat", "--training.dataset_path", "c.jsonl", "--validation.enable", "true",
      "--validation.dataset_path", "v.jsonl", "--validation.dataset_text_column", "body"],
     "validation.dataset_text_column"),
    # validation (checked only when enabled, except the streaming choice)
    (["--validation.dataset_streaming", "yes"], "validation.dataset_streaming"),
    (["--validation.enable", "--validation.freq", "0"], "validation.freq"),
    (["--validation.enable", "--validation.steps", "0"], "validation.steps"),
    (["--validation.enable", "--validation.steps", "-3"], "validation.steps"),
    (["--validation.enable", "--validation.local_batch_size", "0"], "validation.local_batch_size"),
    (["--validation.enable", "--validation.seq_len", "-2"], "validation.seq_len"),
    # parallelism
    (["--parallelism.fsdp_reshard_after_forward", "sometimes"], "parallelism.fsdp_reshard_after_forward"),
    (["--parallelism.context_parallel_rotate_method", "ring"], "parallelism.context_parallel_rotate_method"),
    (["--parallelism.pipeline_parallel_schedule", "Zigzag"], "parallelism.pipeline_parallel_schedule"),
    (["--parallelism.data_parallel_shard_degree", "0"], "parallelism.data_parallel_shard_degree"),
    (["--parallelism.data_parallel_shard_degree", "-2"], "parallelism.data_parallel_shard_degree"),
    (["--parallelism.data_parallel_replicate_degree", "0"], "parallelism.data_parallel_replicate_degree"),
    (["--parallelism.tensor_parallel_degree", "0"], "parallelism.tensor_parallel_degree"),
    (["--parallelism.pipeline_parallel_degree", "0"], "parallelism.pipeline_parallel_degree"),
    (["--parallelism.context_parallel_degree", "-1"], "parallelism.context_parallel_degree"),
    (["--parallelism.expert_parallel_degree", "0"], "parallelism.expert_parallel_degree"),
    (["--parallelism.expert_tensor_parallel_degree", "0"], "parallelism.expert_tensor_parallel_degree"),
    (["--parallelism.tensor_parallel_degree", "16"], "parallelism.tensor_parallel_degree"),
    (["--parallelism.enable_async_tensor_parallel"], "parallelism.enable_async_tensor_parallel"),
    (["--compile.components", "everything"], "compile.components"),
    # checkpoint
    (["--checkpoint.async_mode", "threads"], "checkpoint.async_mode"),
    (["--checkpoint.export_dtype", "float16"], "checkpoint.export_dtype"),
    (["--checkpoint.save_on_signal", "SIGKILL"], "checkpoint.save_on_signal"),
    (["--checkpoint.interval", "0"], "checkpoint.interval"),
    (["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k"),
    (["--checkpoint.load_step", "-2"], "checkpoint.load_step"),
    (["--checkpoint.exclude_from_loading", "optim"], "checkpoint.exclude_from_loading"),
    (["--checkpoint.initial_load_in_hf"], "checkpoint.initial_load_in_hf"),
    (["--checkpoint.create_seed_checkpoint"], "checkpoint.create_seed_checkpoint"),
    # activation checkpoint choice
    (["--activation_checkpoint.mode", "partial"], "activation_checkpoint.mode"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "every"],
     "activation_checkpoint.selective_ac_option"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"],
     "activation_checkpoint.selective_ac_option"),
    # metrics / comm
    (["--metrics.log_freq", "0"], "metrics.log_freq"),
    (["--comm.init_timeout_seconds", "0"], "comm.init_timeout_seconds"),
    (["--comm.train_timeout_seconds", "-1"], "comm.train_timeout_seconds"),
    # profiling (the CUDA-only memory snapshot check needs the device: tests/unit/test_profiling.py)
    (["--profiling.profile_freq", "0"], "profiling.profile_freq"),
    (["--profiling.save_traces_folder", ""], "profiling.save_traces_folder"),
    (["--profiling.save_traces_folder", "/tmp/traces"], "profiling.save_traces_folder"),
    (["--profiling.save_traces_folder", "../traces"], "profiling.save_traces_folder"),
    (["--model.name", "qwen3", "--model.flavor", "debugmodel_moe_small_aux", "--moe.aux_loss_scope", "batch"],
     "moe.aux_loss_scope"),
    # DeepSeek-V3's attention is split over its heads: n_heads (8 in debugmodel) must divide by tp
    (["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--parallelism.tensor_parallel_degree", "3"],
     "n_heads=8 is not divisible by tensor_parallel_degree=3"),
    (["--parallelism.expert_parallel_degree", "2"], "parallelism.expert_parallel_degree"),  # llama has no MoE
    (["--memory_estimation.expert_load_factor", "0.9"], "memory_estimation.expert_load_factor"),
    (["--memory_estimation.device_memory_gib", "-1"], "memory_estimation.device_memory_gib"),
    # expert tensor parallel needs MoE layers (its degree against tp: tests/unit/test_parallel_dims.py)
    (["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"],
     "parallelism.expert_tensor_parallel_degree"),
    (["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "3"],
     "parallelism.expert_parallel_degree"),
    # float8 (the checks that need a model or torchao: tests/unit/test_float8.py)
    (["--model.converters", "int8"], "model.converters"),
    (["--model.converters", "float8,float8"], "model.converters: ['float8', 'float8'] names a converter twice"),
    (["--float8.recipe_name", "rowwise"], "float8.recipe_name: set, but model.converters does not include"),
    (["--float8.enable_fsdp_float8_all_gather"], "float8.enable_fsdp_float8_all_gather: set, but model.converters"),
    (["--float8.precompute_float8_dynamic_scale_for_fsdp"], "float8.precompute_float8_dynamic_scale_for_fsdp: set"),
    (["--float8.filter_fqns", "output"], "float8.filter_fqns: set, but model.converters does not include"),
    (["--float8.skip_small_layers", "false"], "float8.skip_small_layers: set, but model.converters does not include"),
    (["--model.converters", "float8", "--float8.recipe_name", "mxfp8"], "float8.recipe_name"),
    (["--model.converters", "float8", "--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
     "float8.enable_fsdp_float8_all_gather"),
    (["--model.converters", "float8", "--float8.precompute_float8_dynamic_scale_for_fsdp"],
     "float8.precompute_float8_dynamic_scale_for_fsdp"),
    (["--float8.round_scales_to_power_of_2", "true"], "float8.round_scales_to_power_of_2: set, but model.converters"),
    (["--model.converters", "float8", "--float8.round_scales_to_power_of_2", "true",
      "--float8.enable_fsdp_float8_all_gather"], "float8.round_scales_to_power_of_2"),
    # lora (the check that needs a model, target names matching no layer: tests/unit/test_lora.py)
    (["--lora.rank", "4"], "lora.rank: set, but model.converters does not include"),
    (["--model.converters", "lora", "--lora.rank", "0"], "lora.rank"),
    (["--model.converters", "lora", "--lora.alpha", "0"], "lora.alpha"),
    (["--model.converters", "lora", "--lora.dropout", "1.0"], "lora.dropout"),
    (["--model.converters", "lora", "--lora.target_modules", "all-linear,wq"], "lora.target_modules"),
    (["--model.converters", "lora", "--lora.target_modules", "output"], "lora.target_modules"),
    (["--model.converters", "lora,float8"], "model.converters: lora with float8"),
    (["--lora.save_adapter_only", "true"], "lora.save_adapter_only: set, but model.converters does not include"),
    (["--model.converters", "lora", "--lora.save_adapter_only", "true", "--checkpoint.enable"],
     "lora.save_adapter_only"),
    # RL (python -m torchtitan.rl.train sets rl.enable; without it every [rl] key is refused)
    (["--rl.group_size", "8"], "rl.group_size: set, but rl.enable is false"),
    (["--rl.enable", "--parallelism.pipeline_parallel_degree", "2"], "pipeline_parallel_degree=2: RL has no pipeline"),
    (["--rl.enable", "--parallelism.context_parallel_degree", "2"], "context_parallel_degree=2: RL does not split"),
    (["--rl.enable", "--model.name", "qwen3", "--model.flavor", "debugmodel_moe",
      "--parallelism.expert_parallel_degree", "2"], "expert_parallel_degree=2: RL does not support expert parallel"),
    (["--rl.enable", "--rl.group_size", "1"], "rl.group_size"),
    (["--rl.enable", "--rl.prompts_per_step", "0"], "rl.prompts_per_step"),
    (["--rl.enable", "--rl.train_groups", "-1"], "rl.train_groups"),
    (["--rl.enable", "--rl.ppo_epochs", "0"], "rl.ppo_epochs"),
    (["--rl.enable", "--rl.mini_batch_size", "3"], "rl.mini_batch_size"),
    (["--rl.enable", "--rl.mini_batch_size", "-1"], "rl.mini_batch_size"),
    (["--rl.enable", "--rl.micro_batch_size", "-1"], "rl.micro_batch_size"),
    (["--rl.enable", "--rl.max_new_tokens", "0"], "rl.max_new_tokens"),
    (["--rl.enable", "--rl.temperature", "0"], "rl.temperature"),
    (["--rl.enable", "--rl.top_p", "0"], "rl.top_p"),
    (["--rl.enable", "--rl.clip_low", "1"], "rl.clip_low"),
    (["--rl.enable", "--rl.clip_high", "-0.1"], "rl.clip_high"),
    (["--rl.enable", "--rl.kl_coeff", "-1"], "rl.kl_coeff"),
    (["--rl.enable", "--rl.loss_aggregation", "batch"], "rl.loss_aggregation"),
    (["--rl.enable", "--rl.buffer_sampling", "lifo"], "rl.buffer_sampling"),
    (["--rl.enable", "--rl.buffer_capacity", "-1"], "rl.buffer_capacity"),
    (["--rl.enable", "--rl.buffer_max_lag", "-2"], "rl.buffer_max_lag"),
    (["--rl.enable", "--rl.rewards", "[]"], "rl.rewards"),
    (["--rl.enable", "--rl.reward_weights", "1,2"], "rl.reward_weights"),
    (["--rl.enable", "--rl.task", "math"], "rl.task"),
    (["--rl.enable", "--rl.task", "gsm8k"], "rl.dataset_path"),
    (["--rl.enable", "--rl.synthetic_digits", "0"], "rl.synthetic_digits"),
    (["--rl.enable", "--rl.synthetic_ops", "/"], "rl.synthetic_ops"),
]

NOT_AVAILABLE = [
    (["--optimizer.early_step_in_backward"], "optimizer.early_step_in_backward"),
    (["--training.enable_cpu_offload"], "training.enable_cpu_offload"),
    (["--memory_estimation.disable_fake_mode"], "memory_estimation.disable_fake_mode"),
    # keys of features still to come are refused at any non-default value, with the feature's degree at 1
    (["--parallelism.context_parallel_rotate_method", "alltoall"], "parallelism.context_parallel_rotate_method"),
]


@pytest.mark.parametrize(("argv", "key"), INVALID_VALUES, ids=[" ".join(a) for a, _ in INVALID_VALUES])
def test_invalid_value(argv, key):
    msg = _config_error(argv)
    assert key in msg
    assert "not available yet" not in msg


@pytest.mark.parametrize(("argv", "key"), NOT_AVAILABLE, ids=[" ".join(a) for a, _ in NOT_AVAILABLE])
def test_not_available_yet(argv, key):
    msg = _config_error(argv)
    assert key in msg
    assert "not available yet" in msg


@pytest.mark.parametrize(("argv", "key"), INVALID_VALUES[:6] + NOT_AVAILABLE[:1])
def test_invalid_value_from_toml_is_checked_too(tmp_path, argv, key):
    section, name = argv[0][2:].split(".")
    value = argv[1] if len(argv) > 1 else "true"
    tp = typing.get_type_hints(section_classes()[section])[name]
    literal = f'"{value}"' if tp is str else value
    p = _write(tmp_path, f"[{section}]\n{name} = {literal}\n")
    msg = _config_error(["--job.config_file", str(p)])
    assert key in msg


@pytest.mark.parametrize(
    "argv",
    [
        ["--optimizer.name", "Adam"],
        ["--optimizer.implementation", "foreach"],
        ["--optimizer.implementation", "for-loop"],
        ["--optimizer.beta1", "0"],
        ["--optimizer.weight_decay", "0"],
        ["--lr_scheduler.decay_type", "sqrt"],
        ["--lr_scheduler.decay_type", "cosine"],
        ["--lr_scheduler.warmup_steps", "0"],
        ["--lr_scheduler.decay_ratio", "0"],
        ["--lr_scheduler.decay_ratio", "1"],
        ["--lr_scheduler.min_lr_factor", "1"],
        ["--training.global_batch_size", "64"],
        ["--training.mixed_precision_param", "float32"],
        ["--training.mixed_precision_reduce", "bfloat16"],
        ["--parallelism.fsdp_reshard_after_forward", "never"],
        ["--parallelism.fsdp_reshard_after_forward", "always"],
        ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.data_parallel_replicate_degree", "2"],
        ["--activation_checkpoint.mode", "none"],
        ["--model.flavor", "8B"],
        ["--training.max_norm", "0"],
        ["--compile.components", "model"],
    ],
)
def test_boundary_values_are_accepted(argv):
    parse_args(argv)


def _checked_keys_in_validate() -> set[str]:
    """Keys named by literal first arguments of the check helpers in validate.py and validate_finetune.py."""
    from torchtitan.config import validate_finetune

    trees = [ast.parse(Path(module.__file__).read_text()) for module in (validate, validate_finetune)]
    keys: set[str] = set()
    for node in (n for tree in trees for n in ast.walk(tree)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("_err", "_one_of", "_positive", "_not_yet") or not node.args:
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            text = arg.value
        elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
            text = arg.values[0].value
        else:
            continue  # key held in a variable (loops below are covered explicitly)
        key = text.split(":")[0].split("=")[0].strip()
        if "." in key and not key.endswith("."):
            keys.add(key)
    return keys


def test_every_validate_check_is_covered():
    covered = {key for _, key in INVALID_VALUES + NOT_AVAILABLE}
    found = _checked_keys_in_validate()
    assert len(found) > 30, found  # the scan itself works
    missing = found - covered
    assert not missing, f"validate.py / validate_finetune.py checks without a test: {sorted(missing)}"


def test_check_values_runs_on_every_field_type_without_mutating_valid_config():
    cfg = parse_args([])
    before = to_dict(cfg)
    validate.check_values(cfg)
    assert to_dict(cfg) == before


# --------------------------------------------------------------------------- --help and docstrings


def test_every_field_has_a_docstring():
    for section, cls in section_classes().items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name, "").strip(), f"{section}.{f.name} has no docstring in job_config.py"


def test_every_section_is_a_dataclass_with_defaults():
    for section, cls in section_classes().items():
        assert dataclasses.is_dataclass(cls), section
        cls()  # every field has a default


def test_help_exits_zero_and_lists_every_field_with_its_docstring(capsys):
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as info:
            parse_args(["--training.steps", "3", flag])
        assert info.value.code in (0, None)
        out = capsys.readouterr().out
        assert out.strip() == help_text(["--training.steps", "3"]).strip()
    text = help_text()
    for section, cls in section_classes().items():
        assert f"[{section}]" in text
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert f"--{section}.{f.name} " in text, f"--help does not list {section}.{f.name}"
            doc = docs.get(f.name, "")
            assert doc and doc in text, f"--help does not show the docstring of {section}.{f.name}"


def test_help_shows_defaults():
    text = help_text()
    assert "--training.steps (int, default 10000)" in text
    assert '--model.name (str, default "llama3")' in text


def test_help_shows_what_the_config_file_and_overrides_set_the_launcher_variables_and_the_models(tmp_path):
    toml = tmp_path / "big.toml"
    toml.write_text('[model]\nflavor = "8B"\n[training]\nseq_len = 8192\n')
    text = help_text(["--job.config_file", str(toml), "--training.steps", "7"])
    assert f'--model.flavor (str, default "debugmodel", now "8B" from {toml})' in text
    assert "--training.steps (int, default 10000, now 7 from command line)" in text
    assert "--training.local_batch_size (int, default 8)" in text  # untouched keys show the default alone
    for variable in ("CONFIG_FILE", "NGPU", "LOG_RANK", "TORCHRUN_ARGS"):
        assert f"\n  {variable} " in text, variable
    from torchtitan.models.registry import get_model_spec, model_names

    assert {"llama3", "qwen3", "deepseek_v3"} <= set(model_names())
    for name in model_names():
        assert f"\n  {name}: {', '.join(get_model_spec(name).flavors)}\n" in text
    # a file that does not load still gives the help, with the defaults and why
    assert "(the values below are the defaults: " in help_text(["--job.config_file", str(tmp_path / "none.toml")])


def test_help_even_with_invalid_other_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--training.stepz", "3", "--help"])
    assert info.value.code in (0, None)
    assert "--training.steps" in capsys.readouterr().out


def test_field_docs_normalises_whitespace():
    @dataclasses.dataclass
    class Demo:
        a: int = 1
        """first
           line"""
        b: int = 2
        c: int = 3
        """third"""

    docs = field_docs(Demo)
    assert docs == {"a": "first line", "c": "third"}


# --------------------------------------------------------------------------- shipped TOML files


def test_train_configs_exist():
    assert TRAIN_CONFIGS, "no train_configs/*.toml found"


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=[p.name for p in TRAIN_CONFIGS])
def test_train_config_parses(path):
    cfg = parse_args(["--job.config_file", str(path)])
    assert cfg.job.config_file == str(path)
    assert cfg.training.steps > 0


def test_debug_model_toml_values():
    cfg = parse_args(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")])
    assert cfg.model.flavor == "debugmodel"
    assert cfg.debug.seed == 42
    assert cfg.training.local_batch_size == 4
    assert cfg.training.seq_len == 256


# --------------------------------------------------------------------------- the entry point


# The entry point run as `python -m` runs it (runpy, as __main__), with tripwires on the work that must not start
# before the config is checked: the process group (init_distributed and torch's own call) and the tokenizer (the
# default one is trained on first use). A tripwire ends the process with code 99, saying which one fired.
_TRIPWIRED_TRAIN = (
    "import os, runpy, sys\n"
    "import torch.distributed as dist\n"
    "import torchtitan.data.tokenizer as tokenizer\n"
    "import torchtitan.distributed.utils as dist_utils\n"
    "def _tripwire(name):\n"
    "    def fire(*a, **k):\n"
    "        sys.stderr.write(f'tripwire: {name} called\\n'); os._exit(99)\n"
    "    return fire\n"
    "dist.init_process_group = dist.distributed_c10d.init_process_group = _tripwire('init_process_group')\n"
    "dist_utils.init_distributed = _tripwire('init_distributed')\n"
    "tokenizer.build_tokenizer = _tripwire('build_tokenizer')\n"
    "runpy.run_module('torchtitan.train', run_name='__main__', alter_sys=True)\n"
)
# What the launcher must not pass on: the entry point would take this process for one rank of a larger job.
_LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def _run_train(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """The tripwired entry point in a new interpreter: what `python -m torchtitan.train` sees, imports included."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    # The timeout guards against a hang only; that the error comes before any expensive work is the tripwires' part.
    return subprocess.run([sys.executable, "-c", _TRIPWIRED_TRAIN, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)


def tripwired_train(argv: list[str]) -> None:
    """`python -m torchtitan.train *argv` in this (disposable) process, with the tripwires of _TRIPWIRED_TRAIN.

    For a child of the fork server (run_main), which has torchtitan.train and its imports loaded already: modules
    imported there may hold the real functions under their own names (`from ... import build_tokenizer`), so every
    loaded module's reference is replaced, not only the defining module's. A fresh interpreter patches before
    those imports run and gets the same effect (_run_train)."""
    import runpy

    import torch.distributed as dist

    import torchtitan.data.tokenizer as tokenizer
    import torchtitan.distributed.utils as dist_utils

    def tripwire(name: str):
        def fire(*args, **kwargs):
            sys.stderr.write(f"tripwire: {name} called\n")
            sys.stderr.flush()
            os._exit(99)
        return fire

    wired = {id(fn): tripwire(name) for fn, name in ((dist.distributed_c10d.init_process_group, "init_process_group"),
                                                      (dist_utils.init_distributed, "init_distributed"),
                                                      (tokenizer.build_tokenizer, "build_tokenizer"))}
    for module in list(sys.modules.values()):
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if id(value) in wired:
                setattr(module, attr, wired[id(value)])
    sys.argv = ["-m", *argv]
    # As under `python -m`, torchtitan.train is then __main__ only (runpy warns about a loaded copy otherwise).
    sys.modules.pop("torchtitan.train", None)
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


def run_train_in_child(args: list[str], tmp_path: Path, **env: str) -> tuple[int, str]:
    """(exit code, stderr) of the tripwired entry point in a child of the fork server: no new interpreter, so
    about 0.3 s of CPU instead of 5-8 (torch's import) per case."""
    from tests.unit.forked import run_main

    code, _, err = run_main(tripwired_train, args, env={**dict.fromkeys(_LAUNCHER_ENV), "OMP_NUM_THREADS": "1",
                                                         **env}, cwd=tmp_path, timeout=60)
    return code, err


def _assert_one_config_error_line(code: int, stderr: str, *needles: str) -> None:
    assert "tripwire" not in stderr, stderr
    assert code == 2, (code, stderr)
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("config error:"), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_train_entry_point_unknown_key_exits_2(tmp_path):
    _assert_one_config_error_line(*run_train_in_child(["--training.stepz", "3"], tmp_path), "training.stepz")
    assert not (tmp_path / "outputs").exists()


def test_train_entry_point_missing_toml_exits_2(tmp_path):
    missing = tmp_path / "missing.toml"
    _assert_one_config_error_line(*run_train_in_child(["--job.config_file", str(missing)], tmp_path), str(missing))


def test_train_entry_point_bad_toml_creates_no_process_group(tmp_path):
    p = _write(tmp_path, "[training]\nstepz = 3\n")
    _assert_one_config_error_line(*run_train_in_child(["--job.config_file", str(p)], tmp_path), str(p),
                                  "training.stepz")


def test_train_entry_point_tripwires_catch_a_run_that_starts(tmp_path):
    # The config error tests rely on the tripwires: a valid config must reach one, in the fork server's child as in
    # a new interpreter. The new interpreter also shows that the entry point imports on its own, which a child of
    # the fork server (everything imported already) cannot.
    code, err = run_train_in_child(["--job.dump_folder", str(tmp_path / "outputs")], tmp_path)
    assert code == 99 and "tripwire: init_distributed called" in err, err[-3000:]
    proc = _run_train(["--job.dump_folder", str(tmp_path / "outputs")], tmp_path)
    assert proc.returncode == 99 and "tripwire: init_distributed called" in proc.stderr, proc.stderr[-3000:]


def test_n_layers_reaches_the_model_and_the_pipeline_plan():
    """model.n_layers replaces the flavor's depth in the args the trainer builds from and in the pipeline split (the
    estimator's depth: test_depth_extrapolation_equals_the_full_run, tests/unit/test_memory_estimation.py)."""
    from torchtitan.components.model_parts import model_args_for
    from torchtitan.config.manager import load_config

    base = ["--model.flavor", "debugmodel_small"]
    assert model_args_for(load_config(base, 1)[0]).n_layers == 4
    cfg, _ = load_config([*base, "--model.n_layers", "2", "--model.name", "deepseek_v3"], 1)
    args = model_args_for(cfg)
    assert (args.n_layers, args.n_dense_layers, args.dim) == (2, 1, 64)  # the flavor's shapes, fewer blocks
    _, resolved = load_config([*base, "--model.n_layers", "3", "--parallelism.pipeline_parallel_degree", "2",
                               "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], 2)
    blocks = [[f for f in stage if f.startswith("layers.")] for stage in resolved.pipeline.module_fqns]
    assert sum(blocks, []) == ["layers.0", "layers.1", "layers.2"]
    with pytest.raises(ConfigError, match="4 pipeline stages but the model has only 2 transformer blocks"):
        load_config([*base, "--model.n_layers", "2", "--parallelism.pipeline_parallel_degree", "2",
                     "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], 2)
