"""run_train.sh with the user's own --job.config_file: that file is the one loaded (and recorded), not CONFIG_FILE.

Every launch here stops at the config check, before any training, or never starts torchrun at all: each costs a
few seconds. Should a regression load the default TOML instead, --training.steps 1 keeps the mistaken run short.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.integration.launch import REPO, run_train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("equals", [False, True], ids=["space", "equals"])
def test_users_config_file_is_the_one_loaded(tmp_path, tt_cache_dir, equals):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nseq_len = -3\n")  # invalid: only this file can make the run fail
    flag = [f"--job.config_file={bad}"] if equals else ["--job.config_file", str(bad)]
    result = run_train(1, [*flag, "--training.steps", "1"], tmp_path / "out", tt_cache_dir, timeout=120)
    assert result.returncode != 0, result.output[-3000:]
    assert "training.seq_len" in result.output and str(bad) in result.output, result.output[-3000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_missing_config_file_fails_naming_it(tmp_path, tt_cache_dir):
    missing = tmp_path / "no_such.toml"
    result = run_train(1, ["--job.config_file", str(missing), "--training.steps", "1"], tmp_path / "out",
                       tt_cache_dir, timeout=120)
    assert result.returncode != 0, result.output[-3000:]
    assert str(missing) in result.output and "job.config_file" in result.output, result.output[-3000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("form", ["none", "space", "equals"])
def test_run_train_passes_exactly_one_config_file(tmp_path, tt_cache_dir, form):
    # PYTHON is a wrapper that prints the launcher's torchrun command line instead of starting torchrun.
    wrapper = tmp_path / "python"
    show = ("import os, sys; from torchtitan.launch import torchrun_argv; "
            "print(*torchrun_argv(sys.argv[1:], os.environ, 0), sep=chr(10))")
    wrapper.write_text(f'#!/usr/bin/env bash\nif [ "$1 $2" = "-m torchtitan.launch" ]; then shift 2; '
                       f'exec {sys.executable} -c "{show}" "$@"; fi\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    user = {"none": [], "space": ["--job.config_file", "mine.toml"], "equals": ["--job.config_file=mine.toml"]}[form]
    result = run_train(1, user, tmp_path / "out", tt_cache_dir, timeout=60,
                       extra_env={"PYTHON": str(wrapper), "CONFIG_FILE": "default.toml"})
    assert result.returncode == 0, result.output[-3000:]
    args = result.output.splitlines()
    given = [a for a in args if a.startswith("--job.config_file")]
    expected = {"none": ["--job.config_file"], "space": ["--job.config_file"],
                "equals": ["--job.config_file=mine.toml"]}[form]
    assert given == expected, args
    assert ("default.toml" in args) == (form == "none"), args


def test_job_config_json_records_the_file_loaded_and_resolved_numbers(tmp_path, tt_cache_dir):
    # The rank stops at its tokenizer, right after it saved job_config.json: no model, no training. (A
    # sitecustomize on PYTHONPATH fails the rank's tokenizer builder; the launcher's own check, before torchrun,
    # runs without RANK and passes.)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('RANK') is not None:\n    import torchtitan.data.tokenizer as t\n"
        "    def stop(*args, **kwargs):\n        raise ValueError('model.tokenizer_path: stopped by the test')\n"
        "    t.build_tokenizer = stop\n")
    other = tmp_path / "other.toml"
    other.write_text("[training]\nlocal_batch_size = 3\nseq_len = 64\n[validation]\nenable = true\n")
    result = run_train(1, ["--job.config_file", str(other)], tmp_path / "out", tt_cache_dir, timeout=120,
                       extra_env={"PYTHONPATH": f"{site}:{REPO}"})
    assert result.returncode == 2 and "stopped by the test" in result.output, result.output[-3000:]
    saved = json.loads((tmp_path / "out" / "job_config.json").read_text())
    assert saved["job"]["config_file"] == str(other)
    assert saved["training"]["local_batch_size"] == 3  # from other.toml, not the default TOML's 4
    # derived values are recorded as the numbers the run used, not -1
    assert saved["parallelism"]["data_parallel_shard_degree"] == 1
    assert saved["training"]["global_batch_size"] == 3
    assert (saved["validation"]["local_batch_size"], saved["validation"]["seq_len"]) == (3, 64)
