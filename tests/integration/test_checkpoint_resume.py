"""Checkpoints through run_train.sh: exact resume, resharded resume, partial folders, kill -9, SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from tests.integration.launch import kill_tree, run_train, start_train

pytestmark = pytest.mark.slow

STEPS = 20
BASE = (
    "--training.steps", str(STEPS), "--training.seq_len", "64", "--training.global_batch_size", "8",
    "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2",
    "--debug.seed", "3", "--job.print_config", "false",
    "--checkpoint.enable", "--checkpoint.interval", "10", "--checkpoint.keep_latest_k", "0",
    "--checkpoint.last_save_model_only", "false",
)


def _layout(nproc: int) -> tuple[str, ...]:
    return ("--training.local_batch_size", str(8 // nproc))


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _complete_steps(run_dir) -> list[int]:
    folder = run_dir / "checkpoint"
    if not folder.exists():
        return []
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*")
                  if p.is_dir() and (p / ".complete").exists())


def _resume_from(straight, step: int, dest) -> None:
    """A fresh run folder holding only the straight run's checkpoint at `step`."""
    (dest / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight / "checkpoint" / f"step-{step}", dest / "checkpoint" / f"step-{step}")


@pytest.fixture(scope="module")
def straight_fsdp4(tmp_path_factory, tt_cache_dir):
    out = tmp_path_factory.mktemp("straight")
    result = run_train(4, [*BASE, *_layout(4)], out, tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]
    assert _complete_steps(out) == [10, 20]
    return out


def test_resume_same_layout_is_bitwise_identical(straight_fsdp4, tmp_path, tt_cache_dir):
    _resume_from(straight_fsdp4, 10, tmp_path)
    result = run_train(4, [*BASE, *_layout(4)], tmp_path, tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]
    resumed, straight = _losses(tmp_path), _losses(straight_fsdp4)
    assert sorted(resumed) == list(range(11, STEPS + 1)), "the resumed run must start at step 11"
    for step in resumed:
        assert resumed[step] == straight[step], f"step {step}: {resumed[step]!r} != {straight[step]!r}"


def _assert_continues(resumed_dir, straight_dir, first_step: int) -> None:
    resumed, straight = _losses(resumed_dir), _losses(straight_dir)
    assert sorted(resumed) == list(range(first_step, STEPS + 1))
    for step in resumed:  # same sequences in the same steps (global data cursor), same weights and moments
        assert abs(resumed[step] - straight[step]) <= 1e-5 * abs(straight[step]), (step, resumed[step], straight[step])


def test_resume_on_hsdp_continues_the_curve(straight_fsdp4, tmp_path, tt_cache_dir):
    # (FSDP 4 -> 1 process and FSDP 2 are resharding cases covered by the forked unit tests in test_checkpoint.py)
    _resume_from(straight_fsdp4, 10, tmp_path)
    result = run_train(4, [*BASE, *_layout(4), "--parallelism.data_parallel_replicate_degree", "2"], tmp_path,
                       tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]
    _assert_continues(tmp_path, straight_fsdp4, 11)


def test_resume_across_tensor_parallel_both_ways(straight_fsdp4, tmp_path, tt_cache_dir):
    # FSDP 4 step 10 -> FSDP 2 x TP 2 (saves step 15) -> FSDP 4 again: the TP-sharded checkpoint must load too.
    tp_run, back = tmp_path / "fsdp2_tp2", tmp_path / "fsdp4"
    _resume_from(straight_fsdp4, 10, tp_run)
    tp_layout = ("--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
                 "--checkpoint.interval", "5")
    result = run_train(4, [*BASE, *tp_layout], tp_run, tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]
    _assert_continues(tp_run, straight_fsdp4, 11)
    _resume_from(tp_run, 15, back)
    result = run_train(4, [*BASE, *_layout(4)], back, tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]
    _assert_continues(back, straight_fsdp4, 16)


def test_kill_9_at_any_moment_then_resume(tmp_path, tt_cache_dir):
    args = [*BASE, *_layout(2), "--training.steps", "400", "--checkpoint.interval", "1"]
    proc = start_train(2, args, tmp_path, tt_cache_dir, tmp_path / "killed.log")
    try:
        deadline = time.time() + 180
        while len(_complete_steps(tmp_path)) < 3 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert _complete_steps(tmp_path), (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(0.37)  # land somewhere inside a step or a save
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=30)
    newest = _complete_steps(tmp_path)[-1]
    result = run_train(2, [*BASE, *_layout(2), "--training.steps", str(newest + 2),
                           "--checkpoint.interval", "1"], tmp_path, tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]
    assert f"step-{newest}" in result.output, "the resumed run must name the checkpoint it loaded"
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == newest + 2


def test_sigterm_saves_a_complete_checkpoint_and_exits(tmp_path, tt_cache_dir):
    args = [*BASE, *_layout(2), "--training.steps", "400", "--checkpoint.interval", "1000"]
    proc = start_train(2, args, tmp_path, tt_cache_dir, tmp_path / "term.log")
    try:
        deadline = time.time() + 180
        metrics = tmp_path / "metrics.jsonl"
        while time.time() < deadline and proc.poll() is None and (
                not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)  # the launcher (torchrun) forwards it to every rank
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    log = (tmp_path / "term.log").read_text()
    saved = _complete_steps(tmp_path)
    assert saved and saved[-1] >= 3, log[-3000:]
    assert "SIGTERM received" in log
    result = run_train(2, [*BASE, *_layout(2), "--training.steps", str(saved[-1] + 1)], tmp_path, tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]


def test_final_hf_export_loads_in_transformers(tmp_path, tt_cache_dir):
    import torch
    import transformers

    from torchtitan.components.hf_io import load_hf
    from torchtitan.models.llama3 import Transformer

    args = [*BASE, *_layout(2), "--training.steps", "3", "--checkpoint.last_save_model_only", "true",
            "--checkpoint.last_save_in_hf", "true"]
    result = run_train(2, args, tmp_path, tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]
    hf_dir = tmp_path / "checkpoint" / "step-3-hf"
    hf_model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, local_files_only=True, torch_dtype=torch.float32)
    state, model_args = load_hf(hf_dir)
    ours = Transformer(model_args)
    ours.load_state_dict(state, strict=True)  # built on CPU, so the rotary buffer is already computed
    tokens = torch.randint(0, model_args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf_model(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-4, diff
