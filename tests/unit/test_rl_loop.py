"""GRPO end to end on a tiny Llama (torchtitan/rl/loop.py): metrics written, the loss consistent with the
advantages, an exact resume, FSDP, TP, FSDP x TP and DDP runs equal to one process, and several updates per step
(PPO epochs and mini-batches), on one process and FSDP."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.forking import free_port
from tests.integration.launch import complete_steps, read_metrics
from tests.unit.forked import run_ranks
from torchtitan.rl.loss import group_advantages

ARGS = ["--model.flavor", "debugmodel_small", "--model.n_layers", "2", "--training.seq_len", "64",
        "--training.steps", "4",
        "--rl.group_size", "4", "--rl.prompts_per_step", "4", "--rl.max_new_tokens", "8",
        "--rl.rewards", "tests.unit.rl_rewards:char_variety", "--rl.kl_coeff", "0.05", "--rl.clip_high", "0.28",
        "--lr_scheduler.warmup_steps", "0", "--optimizer.lr", "3e-3", "--debug.seed", "0", "--metrics.log_freq", "1",
        "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false",
        # Each rank's share in uneven micro-batches (16 completions: 5+5+5+1 on one rank, 5+3 on two), each scored
        # in chunks of positions recomputed in the backward: every layout below runs them.
        "--rl.micro_batch_size", "5", "--training.loss_chunks", "3"]
REPO = Path(__file__).resolve().parents[2]
# Timings and throughputs differ run to run; everything else must not.
NOISY = ("time/", "gen_tps", "train_tps")


def _train(rank: int, dump: str, extra: list[str], until: int | None, check: bool):
    import torch

    from torchtitan.config.preflight import check_job
    from torchtitan.rl.loop import GRPOTrainer
    from torchtitan.tools.device import device_type

    cfg, resolved = check_job(ARGS + ["--job.dump_folder", dump] + extra + ["--rl.enable", "true"],
                              torch.distributed.get_world_size(), rl=True)
    trainer = GRPOTrainer(cfg, resolved, torch.device(device_type()))
    checks = []
    if check:
        update = trainer.update

        def checked_update(batch, step):
            out = update(batch, step)
            for g in batch:  # the advantages are the group-normalised rewards
                want = group_advantages(torch.tensor([g.rewards]), True)[0].tolist()
                assert g.advantages == pytest.approx(want, abs=1e-6)
            lengths = [len(c) for g in batch for c in g.completions]
            advs = [a for g in batch for a in g.advantages]
            # On-policy, the training forward recomputes the generator's log-probabilities (ratio 1), so the policy
            # term is -sum(A_i * len_i) / tokens, and the loss adds kl_coeff * mean KL.
            pg = -sum(a * n for a, n in zip(advs, lengths, strict=True)) / sum(lengths)
            checks.append((out["loss"], pg + 0.05 * out["kl"] / out["tokens"], out["ratio"] / out["tokens"]))
            return out

        trainer.update = checked_update
    trainer.train(until)
    trainer.close()
    sharded = all(hasattr(p, "full_tensor") for p in trainer.model_parts[0].parameters())
    return checks, sharded


def run(dump, world=1, extra=(), until=None, check=False):
    return run_ranks(_train, str(dump), list(extra), until, check, world=world, timeout=180)


def comparable(lines):
    return [{k: v for k, v in line.items() if not k.startswith(NOISY)} for line in lines]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    dump = tmp_path_factory.mktemp("rl_straight")
    checks, sharded = run(dump, check=True)[0]
    assert not sharded
    return dump, checks


def test_metrics_are_written_and_consistent(straight):
    dump, checks = straight
    lines = read_metrics(dump)
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for key in ("reward_mean", "reward_std", "accuracy", "kl", "clip_frac", "entropy", "response_len", "gen_tps",
                "train_tps", "time/generate", "time/score", "time/train", "time/sync", "loss", "policy_version"):
        assert all(key in line for line in lines), key
    assert [line["policy_version"] for line in lines] == [1, 2, 3, 4]
    assert checks and len(checks) == 4
    for loss, want, ratio in checks:
        assert ratio == pytest.approx(1.0, abs=1e-4)
        assert loss == pytest.approx(want, abs=1e-5)
    assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert lines[-1]["kl"] > 0
    assert all(math.isfinite(line["entropy"]) and line["entropy"] > 0 for line in lines)


def test_kill_9_mid_run_then_resume_continues_identically(straight, tmp_path):
    """The entry point saving every step is killed (SIGKILL) once step 2 is logged, in step 3 or step 2's save; a
    fresh process resumes from the newest complete checkpoint (policy, optimizer, buffer, data cursor, RNG, policy
    version) and logs what the uninterrupted run logged."""
    dump, _ = straight
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": "", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "torchtitan.rl.train", *ARGS, "--job.dump_folder", str(tmp_path),
           "--checkpoint.interval", "1"]
    metrics = tmp_path / "metrics.jsonl"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 120
            while proc.poll() is None and time.time() < deadline and (
                    not metrics.exists() or metrics.read_text().count("\n") < 2):
                time.sleep(0.01)
        finally:
            proc.kill()
            proc.wait(timeout=30)
    killed_text = metrics.read_text()
    logged = [json.loads(line)["step"] for line in killed_text.splitlines()]
    assert logged in ([1, 2], [1, 2, 3]), (tmp_path / "killed.log").read_text()[-3000:]  # killed mid-run
    newest = complete_steps(tmp_path)[-1]
    assert newest >= 1
    resumed = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text()[len(killed_text):].splitlines()]
    assert [line["step"] for line in lines] == list(range(newest + 1, 5))
    assert comparable(lines) == comparable(read_metrics(dump))[newest:]


# 4 drawn groups, 2 per mini-batch, 2 epochs: 4 optimizer updates per step.
PPO = ["--rl.ppo_epochs", "2", "--rl.mini_batch_size", "2", "--checkpoint.enable", "false"]


@pytest.fixture(scope="module")
def ppo(tmp_path_factory):
    dump = tmp_path_factory.mktemp("rl_ppo")
    run(dump, extra=PPO, until=2)
    return dump


def test_ppo_epochs_and_mini_batches(straight, ppo, tmp_path):
    dump, _ = straight
    lines, base = read_metrics(ppo), read_metrics(dump)[:2]
    assert [line["updates"] for line in lines] == [4, 4] and [line["updates"] for line in base] == [1, 1]
    assert [line["policy_version"] for line in lines] == [1, 2]  # the generator syncs once per step
    assert [line["lr"] for line in lines] == [line["lr"] for line in base]  # the schedule counts RL steps
    assert lines[0]["reward_mean"] == base[0]["reward_mean"]  # the same rollouts, then other updates
    assert lines[0]["loss"] != base[0]["loss"]
    # Averaged over the updates: the first is on-policy (ratio 1), the three after it are not.
    assert abs(lines[0]["ratio_mean"] - 1.0) > 1e-4 and lines[0]["clip_frac"] > 0
    assert lines[0]["tokens_seen"] == base[0]["tokens_seen"]  # the drawn response tokens, once
    # Each pass reshuffles the groups into mini-batches (rl.shuffle_mini_batches): in drawn order, the same rollouts
    # make other updates.
    run(tmp_path, extra=[*PPO, "--rl.shuffle_mini_batches", "false"], until=1)
    drawn_order = read_metrics(tmp_path)[0]
    assert drawn_order["reward_mean"] == lines[0]["reward_mean"] and drawn_order["loss"] != lines[0]["loss"]


def test_ppo_on_fsdp_matches_one_process(ppo, tmp_path):
    """Each of the 4 updates per step splits its 2 groups (8 completions) over the ranks."""
    run(tmp_path, world=2, extra=PPO, until=2)
    assert_same(comparable(read_metrics(ppo)), comparable(read_metrics(tmp_path)), 2)


TP = ["--parallelism.tensor_parallel_degree", "2", "--checkpoint.enable", "false"]
# DDP all-reduces the accumulated gradient after each backward: only the last micro-batch may sync.
DDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
       "--checkpoint.enable", "false"]


# The TP and DDP layouts run 2 of the 4 steps (CI time): step 2 already samples from weights synchronised out of the
# shards.
@pytest.mark.parametrize(("world", "extra", "steps"), [(2, [], 4), (2, TP, 2), (4, TP, 2), (2, DDP, 2)],
                         ids=["fsdp2", "tp2", "fsdp2_tp2", "ddp2"])
def test_layouts_match_one_process(straight, tmp_path, world, extra, steps):
    """Every layout samples the same completions (per-prompt seeds, weights synchronised from the shards) and
    takes the same update (TP: loss parallel's vocab-sharded log-probabilities of the chosen tokens)."""
    dump, _ = straight
    results = run(tmp_path, world=world, extra=extra, until=steps)
    # FSDP and/or TP: every parameter is a DTensor; DDP keeps plain replicas
    assert all(sharded == (extra is not DDP) for _, sharded in results)
    assert_same(comparable(read_metrics(dump))[:steps], comparable(read_metrics(tmp_path)), steps)


def assert_same(one: list[dict], two: list[dict], steps: int) -> None:
    assert len(one) == len(two) == steps
    for a, b in zip(one, two, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)


def _entry_point(dump: str, port: int, extra: list[str]) -> tuple[int, str]:
    import os

    os.environ["MASTER_PORT"] = str(port)
    import torch

    torch.set_num_threads(1)
    from torchtitan.rl.train import run as rl_run

    code = rl_run(ARGS + ["--job.dump_folder", dump, "--training.steps", "1", "--checkpoint.enable", "false"] + extra)
    metrics = Path(dump) / "metrics.jsonl"
    return code, metrics.read_text() if metrics.exists() else ""


def test_entry_point_and_the_pretraining_trainer_refuses_rl(tmp_path):
    from tests.unit.forked import in_child
    from torchtitan.config.errors import ConfigError
    from torchtitan.config.preflight import check_job

    code, metrics = in_child(_entry_point, str(tmp_path), free_port(), [], timeout=120)
    assert code == 0 and '"step": 1' in metrics
    # The pre-flight check: the prompts (about 20 tokens) + 8 new ones cannot fit 16 positions; refused before step 1.
    code, metrics = in_child(_entry_point, str(tmp_path / "short"), free_port(), ["--training.seq_len", "16"],
                             timeout=120)
    assert code == 2 and not metrics
    with pytest.raises(ConfigError, match="rl.enable: RL post-training runs through"):
        check_job(["--rl.enable", "true"], 1)
    with pytest.raises(ConfigError, match="rl.group_size: set, but rl.enable is false"):
        check_job(["--rl.group_size", "8"], 1)
