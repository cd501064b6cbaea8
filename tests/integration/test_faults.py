"""Failures mid-run: a non-finite loss or gradient (stop or skip), and a rank that stops taking part in a
collective (every rank must exit, non-zero, soon after the training timeout, naming the step)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from tests.integration.conftest import train_layout
from tests.integration.launch import REPO, kill_tree, launch_env
from tests.integration.layouts import COMMON, dp
from tests.integration.parity import run_layout

pytestmark = pytest.mark.slow

NAN_AT_STEP_3 = (("nan_gradient", "layers.1.feed_forward", 3, 0),)  # rank 0's backward, from block 1 down


def test_nonfinite_gradient_stops_naming_the_step_and_the_parameter(pools, tmp_path):
    results = pools.get(2).run(run_layout, [*COMMON, *dp(2, 2)], str(tmp_path), NAN_AT_STEP_3, "training_error")
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors  # every rank stops at the same step with the same message
    error = errors.pop()
    assert error.startswith("step 3: ") and "gradient norm is nan" in error, error
    # The NaN entered backward at block 1's feed-forward: the parameter closest to the output with a non-finite
    # gradient is in block 1 (the final norm and the output, nearer the loss, have finite gradients).
    culprit = error.split("first non-finite gradient in backward order: ")[1]
    assert culprit.startswith("layers.1."), error
    assert [m["step"] for m in results[0]["metrics"]] == [1, 2], "nothing may be logged or saved for step 3"


def test_nonfinite_gradient_skip_drops_the_update_and_counts_it(pools, tmp_path):
    run = train_layout(pools, 2, (*dp(2, 2), "--training.on_nonfinite", "skip", "--training.steps", "6"), tmp_path,
                       faults=NAN_AT_STEP_3)
    by_step = {m["step"]: m for m in run["metrics"]}
    assert math.isnan(by_step[3]["grad_norm"])
    assert [by_step[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1]
    assert run["params"][2] == run["params"][1], "the skipped step must leave every parameter as it was"
    assert run["params"][3] != run["params"][2]
    assert all(math.isfinite(by_step[s]["loss"]) and math.isfinite(by_step[s]["grad_norm"]) for s in (4, 5, 6))


def test_a_stuck_rank_ends_every_rank_soon_after_the_training_timeout(tmp_path, tt_cache_dir):
    """Regression: comm.train_timeout_seconds reached only the default group; FSDP's collectives run on a mesh
    subgroup, which kept the start-up timeout (here 120 s), so the healthy rank waited that long."""
    train_timeout = 5
    # HSDP 2x2, so that FSDP's all-gather runs on a 2-rank subgroup (a group spanning the world would be the
    # default group itself, which always had the training timeout).
    args = [*COMMON, *dp(2, 4), "--parallelism.data_parallel_replicate_degree", "2",
            "--training.steps", "20", "--job.dump_folder", str(tmp_path),
            "--comm.init_timeout_seconds", "120", "--comm.train_timeout_seconds", str(train_timeout),
            "--checkpoint.enable", "--checkpoint.interval", "1000"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--standalone",
           "--local-ranks-filter", "0,1", "--role", "rank", "--tee", "3", "-m", "tests.integration.stuck_rank", *args]
    log = tmp_path / "stuck.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(4, tt_cache_dir), stdout=out, stderr=subprocess.STDOUT)
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline and (
                not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
            time.sleep(0.05)
        stalled_at = time.time()  # step 2 is logged: rank 1 stalls in step 3 from now on
        try:
            code = proc.wait(timeout=train_timeout + 30)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            pytest.fail(f"the job was still running {train_timeout + 30} s after the stall:\n"
                        f"{log.read_text()[-3000:]}")
    text = log.read_text()
    assert code != 0, text[-3000:]
    assert time.time() - stalled_at <= train_timeout + 30
    assert "step 3 failed" in text, text[-3000:]
    # The healthy rank's flight recorder ends with the collective it waited in: FSDP's all-gather, on a subgroup.
    last = json.loads((tmp_path / "comm_traces" / "rank0.json").read_text())["entries"][-1]
    assert last["profiling_name"].endswith("all_gather") and last["process_group"][1] != "default_pg", last
