"""Multi-node launch on one machine: two "nodes" are two launchers (`./run_train.sh`, one rank each) that meet in a
c10d rendezvous, as the torchrun agents of a Slurm job do (scripts/multinode_trainer.slurm, docs/multinode.md). They
must train exactly like one node with the same world size, and both must exit 0."""

from __future__ import annotations

import math
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.launch import RunResult, kill_tree, start_train

pytestmark = pytest.mark.slow

STEPS = 5
# The smallest model and batch: this test is about the launch, the layouts have their own parity suite.
ARGS = ("--model.flavor", "debugmodel_small", "--training.steps", str(STEPS), "--training.seq_len", "64",
        "--training.local_batch_size", "4", "--training.mixed_precision_param", "float32",
        "--metrics.log_freq", "1", "--job.print_config", "false")
TIMEOUT_S = 240
# Once a launcher has failed, the others may wait for it (in the rendezvous or a collective) until their own
# timeouts: give them this long to notice, then kill them.
GRACE_AFTER_FAILURE_S = 30
RTOL = 1e-5


def _free_port() -> int:
    """A port nothing listens on now (the OS picks it); the rendezvous host binds it a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_all(procs: dict[str, subprocess.Popen], logs: dict[str, Path]) -> dict[str, int]:
    """Every launcher's exit code. A launcher still running at the deadline, or a while after another failed, is
    killed with its whole process tree (torchrun starts each rank in a session of its own) and the test fails."""
    deadline = time.monotonic() + TIMEOUT_S
    killed: list[str] = []
    try:
        while any(p.poll() is None for p in procs.values()):
            now = time.monotonic()
            if any(p.returncode not in (None, 0) for p in procs.values()):
                deadline = min(deadline, now + GRACE_AFTER_FAILURE_S)
            if now > deadline:
                break
            time.sleep(0.1)
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
                killed.append(name)
    if killed:
        pytest.fail(f"killed {killed}: still running {TIMEOUT_S} s after the start or {GRACE_AFTER_FAILURE_S} s after "
                    f"another launcher failed (exit codes {[p.returncode for p in procs.values()]}):\n"
                    + "\n".join(f"--- {n}\n{logs[n].read_text()[-3000:]}" for n in procs))
    return {name: p.returncode for name, p in procs.items()}


def _relative_gap(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def test_two_nodes_train_like_one_node(tmp_path, tt_cache_dir):
    port = _free_port()
    # Node ranks are left to the c10d rendezvous (torchrun ignores --node_rank there), as under Slurm.
    rendezvous = {"TORCHRUN_ARGS": f"--nnodes 2 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:{port} "
                                   f"--rdzv_id multinode-test-{port}"}
    one_node, two_nodes = tmp_path / "one_node", tmp_path / "two_nodes"
    logs = {name: tmp_path / f"{name}.log" for name in ("one_node", "node_a", "node_b")}
    # All three launchers at once: the single-node run (NGPU=2) and the two nodes (NGPU=1 each, sharing one dump
    # folder as nodes share a filesystem; global rank 0 writes the metrics).
    procs = {}
    try:
        procs["one_node"] = start_train(2, ARGS, one_node, tt_cache_dir, logs["one_node"])
        for name in ("node_a", "node_b"):
            procs[name] = start_train(1, ARGS, two_nodes, tt_cache_dir, logs[name], extra_env=rendezvous)
    finally:
        codes = _wait_all(procs, logs)
    output = {name: log.read_text() for name, log in logs.items()}
    for name, code in codes.items():
        assert code == 0, f"{name} exited with {code}:\n{output[name][-4000:]}"
    # Each node's rank is in one 2-rank world (not a 1-rank job of its own).
    for name in ("node_a", "node_b"):
        assert "layout: world 2 = " in output[name], output[name][-4000:]

    reference, multinode = RunResult(0, "", one_node).metrics(), RunResult(0, "", two_nodes).metrics()
    assert [m["step"] for m in reference] == [m["step"] for m in multinode] == list(range(1, STEPS + 1))
    for ref, got in zip(reference, multinode, strict=True):
        for key in ("loss", "grad_norm"):
            assert math.isfinite(got[key]), (ref["step"], key, got[key])
            assert _relative_gap(ref[key], got[key]) <= RTOL, (
                f"step {ref['step']}: {key} {got[key]!r} on two nodes, {ref[key]!r} on one node")
