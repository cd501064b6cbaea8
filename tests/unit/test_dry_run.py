"""Dry run (scripts/dry_run.py): a 405B job on 512 ranks in seconds, exact per-rank bytes on the debug model, the
pipeline stage split, and a bad config as the trainer's one-line error.

The 405B case runs the documented command (scripts/dry_run.sh) in a subprocess; the others run the script as
`python scripts/dry_run.py` would, in a child of the test fork server (tests/unit/forked.py run_main: the same
exit code, stdout and stderr, without a new interpreter importing torch, ~5 s of CPU per case on 2 cores). Either
way the script's children and fake process groups stay out of the pytest process, whose process-group state other
tests share."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.unit.forked import run_main

REPO = Path(__file__).resolve().parents[2]
DEBUG = ["--model.flavor", "debugmodel", "--training.seq_len", "256"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", **extra}


def _script(args: list[str]) -> None:
    import runpy

    sys.argv = ["scripts/dry_run.py", *args]
    runpy.run_path("scripts/dry_run.py", run_name="__main__")


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`python scripts/dry_run.py *args` from the repository root (as the fork server's child, see above)."""
    code, out, err = run_main(_script, args, env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                                                  "HF_HUB_OFFLINE": "1"}, cwd=REPO, timeout=timeout)
    return subprocess.CompletedProcess(["scripts/dry_run.py", *args], code, out, err)


def _model_params(flavor: str):
    from torchtitan.models.registry import get_model_spec

    spec = get_model_spec("llama3")
    with torch.device("meta"):
        return list(spec.model_cls(spec.flavors[flavor]).named_parameters())


def test_405b_on_512_ranks():
    # The documented command (NGPU=8 NNODES=64); the config's own layout is FSDP over nodes x TP 8 in a node. Its wall
    # time is measured in docs/memory_estimation.md, not asserted here (a loaded CI machine is slower).
    proc = subprocess.run(["./scripts/dry_run.sh", "--json"], cwd=REPO, capture_output=True, text=True, timeout=180,
                          env=_env(NGPU="8", NNODES="64", CONFIG_FILE="train_configs/llama3_405b.toml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    lay = out["layout"]
    assert out["model"] == "llama3/405B" and lay["world_size"] == 512
    assert lay["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 64, "cp": 1, "tp": 8}
    assert lay["views"]["dp_shard_cp"] == 64 and lay["views"]["dp_shard_cp_tp"] == 512
    assert (lay["global_batch_size"], lay["grad_accum_steps"]) == (64, 1) and out["pipeline"] is None
    [rank0] = out["parameters"]
    n_params = sum(p.numel() for _, p in _model_params("405B"))
    assert rank0["global_elements"] == n_params
    # fp32 master weights split over tp 8 x fsdp 64; FSDP rounds each shard up, so rank 0 holds a little more.
    assert rank0["bytes"]["parameters"] == rank0["bytes"]["gradients"]
    assert 0 <= rank0["bytes"]["parameters"] / (4 * n_params / 512) - 1 < 0.002
    rows = {r["name"]: r for r in rank0["rows"]}
    wq = rows["layers.0-125.attention.wq.weight"]
    assert wq["count"] == 126 and wq["global_shape"] == [16384, 16384] and wq["local_shape"] == [32, 16384]
    assert "tp:S(0)" in wq["placements"] and sum(r["count"] for r in rank0["rows"]) == rank0["tensors"]
    verdict = out["verdict"]
    # The default target: an H100's 79.1 GiB, 3 GiB of it reserved for memory outside tensors.
    assert (out["device"], verdict["capacity_gib"], verdict["reserve_gib"]) == ("h100", 79.1, 3.0)
    [worst] = verdict["per_rank"]
    assert verdict["peak_gib"] == worst["peak_bytes"] / 2**30
    assert verdict["needed_gib"] == pytest.approx(verdict["peak_gib"] * 1.161 + 3.0)  # the allocator's overhead
    assert verdict["headroom_gib"] == pytest.approx(79.1 - verdict["needed_gib"])
    # The documented job fits, with room (docs/memory_estimation.md: peak 18.18 GiB + 3 GiB of 79.1): rank 0's
    # states between steps (parameters, gradients, AdamW, 11.8 GiB) plus one 8192-token sequence's activations under
    # full AC, split over tp 8.
    states = sum(worst["steady_bytes"].values()) / 2**30
    assert states < verdict["peak_gib"] < 79.1 - 3.0 and verdict["fits"] is True
    assert verdict["per_rank"][0]["extrapolated_from"] == [4, 8]
    # The tracked steady state of the estimator equals the table's bytes for the states it holds between steps.
    steady = verdict["per_rank"][0]["steady_bytes"]
    assert steady["parameters"] == rank0["bytes"]["parameters"]
    assert steady["optimizer_state"] == rank0["bytes"]["optimizer_state"]


def test_debug_model_bytes_per_rank_exact():
    # 0.25 GiB of memory: less than the debug model's peak (about 0.41 GiB), so the verdict must say it does not fit
    # (exit code 3); the advice's extra estimates are left to test_does_not_fit_with_advice.
    proc = _run(["--world-size", "2", "--device", "cpu", "--memory-gib", "0.25", "--json", "--no-advice", *DEBUG])
    assert proc.returncode == 3, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["advice"] == {"given": False, "reason": "--no-advice", "suggestions": [], "others": []}
    [rank0] = out["parameters"]
    params = _model_params("debugmodel")
    # FSDP 2 shards every parameter's dim 0; rank 0 holds ceil(rows / 2) of each, in float32 (CPU target).
    by_hand = sum(math.ceil(p.shape[0] / 2) * p[0].numel() * 4 for _, p in params)
    b = rank0["bytes"]
    assert b["parameters"] == by_hand == b["gradients"]
    assert b["optimizer_state"] == 2 * by_hand + 4 * len(params)  # AdamW's two moments and a step per tensor
    # ... and the estimator, which traces the real optimizer creating its state, holds exactly as much.
    assert out["verdict"]["per_rank"][0]["steady_bytes"] == b
    assert out["layout"]["param_dtype"] == "float32"
    verdict = out["verdict"]
    assert (verdict["capacity_gib"], verdict["reserve_gib"]) == (0.25, 0.0)  # no reserve on the CPU target
    assert verdict["peak_gib"] > sum(b.values()) / 2**30 and verdict["peak_gib"] > 0.25
    assert verdict["fits"] is False and verdict["headroom_gib"] == pytest.approx(0.25 - verdict["peak_gib"])


def test_pipeline_stage_split_and_a_rank_per_stage():
    # without a verdict the exit code is 0, whatever the memory
    proc = _run(["--world-size", "4", "--device", "cpu", *DEBUG, "--parallelism.pipeline_parallel_degree", "2",
                 "--training.local_batch_size", "4", "--no-verdict", "--memory-gib", "0.001"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "mesh (outer -> inner): pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 1 = 4 ranks" in out
    assert "pipeline micro-batches: 4 of 1 sequence(s) per local batch" in out
    assert "pipeline: 2 stages, schedule 1F1B" in out
    assert "pp rank 0 (ranks 0-1): stage 0: tok_embeddings, layers.0-" in out
    assert "pp rank 1 (ranks 2-3): stage 1: layers." in out and ", norm, output" in out
    assert "parameters of rank 0, pp rank 0, stage(s) 0:" in out and "parameters of rank 2, pp rank 1" in out
    # The per-stage verdict is the estimator's own (tests/unit/test_memory_estimation.py); skipped here for time.
    assert "verdict" not in out and "done in" in out


def test_pipeline_verdict_per_rank_two_at_a_time():
    # The verdict of every pipeline rank, estimated two at a time (--jobs 2). The debug model's stages hold 2 blocks,
    # too few to cut: each rank is traced at full depth and says why (the extrapolation of deeper stages is checked
    # against full depth in tests/unit/test_memory_estimation.py).
    proc = _run(["--world-size", "2", "--device", "cpu", "--json", "--jobs", "2", "--model.flavor", "debugmodel",
                 "--training.seq_len", "64", "--parallelism.pipeline_parallel_degree", "2",
                 "--training.local_batch_size", "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    per_rank = out["verdict"]["per_rank"]
    assert [e["rank"] for e in per_rank] == [0, 1] and [p["rank"] for p in out["parameters"]] == [0, 1]
    for e, p in zip(per_rank, out["parameters"], strict=True):
        assert e["extrapolated_from"] is None and "tracing every block is cheaper" in e["full_depth_reason"]
        assert e["steady_bytes"] == p["bytes"] and e["peak_bytes"] > sum(p["bytes"].values())


@pytest.mark.parametrize(("args", "message"), [
    (["--world-size", "6", *DEBUG, "--parallelism.tensor_parallel_degree", "4"], "does not divide the world size 6"),
    (["--world-size", "2", *DEBUG, "--training.seq_lenn", "64"], "training.seq_lenn"),
    (["--world-size", "6", *DEBUG, "--gpus-per-node", "4"], "--gpus-per-node 4 does not divide the world of 6"),
])
def test_bad_config_is_one_line_error_with_exit_2(args, message):
    proc = _run(args, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
    assert message in proc.stderr and proc.stdout == ""


def test_does_not_fit_with_advice():
    # The debug model at 8 x 64 tokens peaks at 0.141 GiB; per-op activation checkpointing, the cheapest change, fits
    # 0.125 GiB at 0.124 (re-estimating each suggestion: tests/unit/test_estimation_advice.py). One estimate allowed.
    proc = _run(["--world-size", "2", "--device", "cpu", "--memory-gib", "0.125", "--advice-estimates", "1",
                 "--model.flavor", "debugmodel", "--training.seq_len", "64"])
    assert proc.returncode == 3, proc.stderr[-3000:]
    out = proc.stdout
    assert "verdict: DOES NOT FIT" in out and "advice: changes that fit" in out and "(1 of at most 1 estimates" in out
    assert "1. activation checkpointing none -> selective (op): peak 0.12 GiB (rank 0)" in out
    assert "paste: --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op\n" in out
    assert "tensor parallel 1 -> 2: not estimated" in out
