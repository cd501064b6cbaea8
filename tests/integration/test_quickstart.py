"""The README's quick start, the launcher's exit codes and the run's outputs, through run_train.sh."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.integration.launch import REPO, run_train

pytestmark = pytest.mark.slow


def test_readme_quick_start_is_the_two_commands():
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Quick start.*?```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert block, "README.md has no quick-start code block"
    commands = [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]
    assert commands == ["./run_train.sh", "./scripts/run_tests.sh"]
    ci = (REPO / ".ci" / "run").read_text()
    assert "./scripts/run_tests.sh" in ci


def test_default_config_trains_and_writes_its_record(tmp_path, tt_cache_dir):
    # The README's first command with the default config (NGPU defaults to 2 CPU processes), shortened.
    result = run_train(2, ["--training.steps", "3", "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
                           "--metrics.enable_wandb"], tmp_path, tt_cache_dir,
                       extra_env={"NGPU": "", "WANDB_SILENT": "true", "WANDB_CACHE_DIR": str(tmp_path / "wb"),
                                  "WANDB_CONFIG_DIR": str(tmp_path / "wb"), "WANDB_DATA_DIR": str(tmp_path / "wb")})
    assert result.returncode == 0, result.output[-4000:]
    records = result.metrics()
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("loss", "loss_max", "grad_norm", "lr", "tps", "tflops", "mfu", "data_wait_pct", "mem/rss_gib"):
        assert key in records[0], key
    assert records[0]["mfu"] is None  # CPU: no peak FLOPS known, so no guess
    assert records[0]["loss_max"] >= records[0]["loss"]
    saved = json.loads((tmp_path / "job_config.json").read_text())
    assert saved["model"]["flavor"] == "debugmodel" and saved["training"]["steps"] == 3
    assert "Traceback" not in result.output
    # where launch to step 1 went, one line per rank shown (docs/performance.md)
    assert "start-up: " in result.output and " s to the end of step 1 = process " in result.output, result.output
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "TensorBoard wrote no event file"
    assert list((tmp_path / "wandb").glob("offline-run-*")), "W&B wrote no offline run"


def test_config_error_fails_fast_with_one_line(tmp_path, tt_cache_dir):
    # The launcher checks the config before torchrun starts any rank: one line, exit code 2, no torchrun report.
    result = run_train(2, ["--training.seq_len", "-4"], tmp_path, tt_cache_dir, timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert result.output.strip().splitlines() == ["config error: training.seq_len: must be > 0, got -4"], \
        result.output[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_missing_tokenizer_or_data_fails_in_the_launcher_with_one_line(tmp_path, tt_cache_dir):
    # The launcher opens the tokenizer and local data as the ranks would, before torchrun starts any of them.
    missing = tmp_path / "no_such_tokenizer.json"
    result = run_train(2, ["--model.tokenizer_path", str(missing)], tmp_path / "out", tt_cache_dir, timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert result.output.strip().splitlines() == [f"error: model.tokenizer_path: tokenizer file not found: {missing}"]
    missing = tmp_path / "no_such_data.jsonl"
    result = run_train(2, ["--validation.enable", "--validation.dataset_path", str(missing)], tmp_path / "out",
                       tt_cache_dir, timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert result.output.strip().splitlines() == [f"error: validation.dataset_path: no such file or directory: "
                                                   f"{missing}"]


# Rank 1 alone fails during setup (a sitecustomize on PYTHONPATH replaces its tokenizer builder before the entry
# point imports it); rank 0 gets on with its setup until torchrun stops it.
_RANK1_FAILS = """
import os
if os.environ.get("RANK") == "1":
    import torchtitan.data.tokenizer as tokenizer

    def build_tokenizer(*args, **kwargs):
        raise ValueError("model.tokenizer_path: planted failure on rank 1 only")

    tokenizer.build_tokenizer = build_tokenizer
"""


def test_a_rank_failing_alone_is_named_in_one_line_whatever_log_rank_shows(tmp_path, tt_cache_dir):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_RANK1_FAILS)
    result = run_train(2, ["--training.steps", "1"], tmp_path / "out", tt_cache_dir, timeout=120,
                       extra_env={"LOG_RANK": "0", "PYTHONPATH": f"{site}:{REPO}"})
    assert result.returncode == 2, result.output[-3000:]
    last = result.output.strip().splitlines()[-1]
    assert last == "[launch] rank 1 failed (exit code 2): model.tokenizer_path: planted failure on rank 1 only", \
        result.output[-3000:]
    assert "planted failure" not in result.output.replace(last, "")  # rank 1's own output is hidden by LOG_RANK
    assert "Traceback" not in result.output and "ChildFailedError" not in result.output, result.output[-3000:]


def test_layout_that_does_not_fit_the_world_is_rejected(tmp_path, tt_cache_dir):
    result = run_train(2, ["--parallelism.data_parallel_shard_degree", "4"], tmp_path, tt_cache_dir, timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error:") and "world size is 2" in lines[0], lines


def test_loss_compare_script(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    b.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.6}\n')
    script = str(REPO / "scripts" / "loss_compare.py")
    same = subprocess.run([sys.executable, script, str(a), str(a), "--rtol", "1e-5"], capture_output=True, text=True)
    differ = subprocess.run([sys.executable, script, str(a), str(b), "--rtol", "1e-5"], capture_output=True, text=True)
    assert same.returncode == 0, same.stdout + same.stderr
    assert differ.returncode == 1 and "above rtol" in differ.stdout
    assert differ.stderr == "over rtol: step 2: loss of b differs from a by +6.67e-02 (rtol 1e-05)\n"
    shown = subprocess.run([sys.executable, script, str(a), str(b)], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stdout + shown.stderr  # differences alone do not fail without --rtol
    png = tmp_path / "curves.png"
    plotted = subprocess.run([sys.executable, script, str(a), str(b), "--rtol", "0.1", "--plot", str(png)],
                             capture_output=True, text=True)
    assert plotted.returncode == 0, plotted.stdout + plotted.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tokenizer_larger_than_the_model_vocab_is_rejected_before_training(tmp_path, tt_cache_dir):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {f"w{i}": i for i in range(9000)}
    vocab["<|begin_of_text|>"], vocab["<|end_of_text|>"], vocab["<unk>"] = 9000, 9001, 9002
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    path = tmp_path / "big" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    result = run_train(1, ["--model.tokenizer_path", str(path)], tmp_path / "out", tt_cache_dir, timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert result.output.strip().splitlines() == [
        "config error: model.tokenizer_path: the tokenizer has 9003 tokens but llama3/debugmodel has vocab_size 8192"]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
