"""Gradient norm accuracy, DDP's reduction dtype and gradient sync, training timeouts, the flight recorder's
environment and the preemption watchdog."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch

from tests.unit.forked import run_ranks
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.utils import flight_recorder_env, total_grad_norm


def _grad_of(shape, seed: int) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return p


def test_grad_norm_is_exact_where_float32_summation_is_not():
    """Regression: the CPU float32 norm of an 8192 x 256 gradient came out ~1e-4 relative off (one long
    sequential sum); every layout then logged, and clipped by, a slightly different norm."""
    params = [_grad_of((8192, 256), 0), _grad_of((256,), 1)]
    exact = torch.sqrt(sum(p.grad.double().square().sum() for p in params)).item()
    assert abs(total_grad_norm(params).item() - exact) <= 1e-12 * exact
    float32 = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True).item()
    assert abs(float32 - exact) > 1e-6 * exact, "the float32 reference no longer shows the error this guards"


def _sharded_norm(rank: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    params = []
    for full, placement in ((_grad_of((8192, 256), 0).grad, Shard(0)), (_grad_of((256,), 1).grad, Replicate())):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, [placement]))
        p.grad = distribute_tensor(full, mesh, [placement])
        params.append(p)
    return total_grad_norm(params).item()


def test_grad_norm_of_sharded_gradients_equals_the_single_process_norm():
    params = [_grad_of((8192, 256), 0), _grad_of((256,), 1)]
    single = total_grad_norm(params).item()
    for norm in run_ranks(_sharded_norm, world=2):
        assert abs(norm - single) <= 1e-12 * single, (norm, single)


def _ddp_grads(rank: int, reduce_dtype: str, micro_batches: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.fsdp import apply_ddp, set_gradient_sync

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    apply_ddp(model, init_device_mesh("cpu", (2,)), reduce_dtype=reduce_dtype)
    inputs = torch.randn(2, micro_batches, 3, 4, generator=torch.Generator().manual_seed(1))
    for micro in range(micro_batches):
        set_gradient_sync(model, micro == micro_batches - 1)
        model(inputs[rank, micro]).sum().backward()
    return model.weight.grad.flatten().tolist()


def test_ddp_sums_each_micro_batch_once_in_the_reduce_dtype():
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 1, bias=False)
    inputs = torch.randn(2, 3, 3, 4, generator=torch.Generator().manual_seed(1))
    reference(inputs.flatten(0, 2)).sum().backward()
    expected = reference.weight.grad.flatten()
    for got in run_ranks(_ddp_grads, "float32", 3, world=2):
        assert torch.allclose(torch.tensor(got), expected, rtol=1e-6), (got, expected)
    # bfloat16 on the wire: the sum of the two ranks' bfloat16-rounded gradients, returned in float32
    for got in run_ranks(_ddp_grads, "bfloat16", 3, world=2):
        assert torch.allclose(torch.tensor(got), expected, rtol=1e-2) and got != expected.tolist(), (got, expected)


def test_flight_recorder_environment():
    assert flight_recorder_env(0, "/tmp/x", "cuda") == {}
    cpu = flight_recorder_env(100, "/tmp/x", "cpu")
    assert cpu == {"TORCH_FR_BUFFER_SIZE": "100"}
    cuda = flight_recorder_env(100, "/tmp/fr_test_traces", "cuda")
    assert cuda["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and cuda["TORCH_FR_DUMP_TEMP_FILE"].endswith("/rank")


def test_a_rank_stuck_after_sigterm_exits_after_the_grace_period(tmp_path):
    """A preempted rank that never reaches the end of its step (a hung read, a dead peer) must not wait for the
    launcher's SIGKILL: it exits with code 1 once the grace period has passed."""
    # The rank sleeps forever, so only the watchdog can end it; the watchdog's wait for the acknowledgement is
    # recorded, so the test sees that it waits the grace period (not 0, not the 300 s default) without a clock.
    code = textwrap.dedent("""
        import time
        from torchtitan.distributed.preemption import PreemptionFlag
        flag = PreemptionFlag("SIGTERM", grace_s=1.0)
        wait = flag._acknowledged.wait
        def recorded_wait(timeout=None):
            print(f"watchdog waits {timeout}", flush=True)
            return wait(timeout)
        flag._acknowledged.wait = recorded_wait
        print("ready", flush=True)
        while True:
            time.sleep(3600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)  # guards against a hang only: the exit cannot come from the sleep
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and out.splitlines() == ["watchdog waits 1.0"], (out, err)
    assert "did not reach the end of its step within 1 s" in err


def test_an_acknowledged_signal_does_not_exit():
    code = textwrap.dedent("""
        import os, signal, time
        from torchtitan.distributed.preemption import PreemptionFlag
        flag = PreemptionFlag("SIGTERM", grace_s=0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        flag.acknowledge()
        time.sleep(1.0)
        print("still here", flag.received)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "still here True" in out.stdout, out.stderr


def _collective_after_rank1_left(rank: int, folder: str):
    import time

    import torch.distributed as dist

    connected = os.path.join(folder, "rank0_connected")
    if rank == 1:
        # Only once rank 0's process group is up: leaving while rank 0 is still in gloo's connection handshake fails
        # its init_process_group instead ("Connection closed by peer" in connectFullMesh, seen once in 12 full runs).
        while not os.path.exists(connected):
            time.sleep(0.01)
        # as a rank that failed and left: its gloo connections close (a rank that succeeded would first wait for the
        # others at the end, dist_utils.wait_for_peers)
        dist.destroy_process_group()
        return "left"
    open(connected, "w").close()
    try:
        dist.all_reduce(torch.ones(1))
        result = "the collective succeeded without rank 1"
    except Exception as e:
        result = dist_utils.lost_a_peer(e), str(e)[:300]
    dist.destroy_process_group()  # its peer is gone: no one to wait for at the end
    return result


def test_a_collective_that_lost_its_peer_is_told_apart_from_a_real_error(tmp_path):
    # What a rank sees when another one failed first: the launcher names that one, this one logs no traceback.
    (lost, message), left = run_ranks(_collective_after_rank1_left, str(tmp_path))
    assert left == "left" and lost, message
    assert not dist_utils.lost_a_peer(ValueError("model.tokenizer_path: no such file"))


def _finish_unevenly(rank: int, folder: str):
    import time

    go, done = os.path.join(folder, "go"), os.path.join(folder, "rank1_done")
    if rank == 1:
        while not os.path.exists(go):  # still at work until rank 0 has tried to leave
            time.sleep(0.01)
        open(done, "w").close()
        return None  # its worker then says it finished (tests/unit/forked.py)
    early = dist_utils.wait_for_peers(timeout_s=0.2)  # rank 1 cannot have finished: the wait gives up, says so
    open(go, "w").close()
    arrived = dist_utils.wait_for_peers(timeout_s=60)
    return early, arrived, os.path.exists(done)  # past the wait only once rank 1 had finished


def test_a_finished_rank_waits_for_the_others_before_it_leaves(tmp_path):
    # gloo completes a collective on a rank once it has the result, possibly before its peer has this rank's part:
    # a rank that left then would fail the peer's last collective ("Connection closed by peer", seen on CI).
    (early, arrived, rank1_done), _ = run_ranks(_finish_unevenly, str(tmp_path))
    assert not early and arrived and rank1_done
