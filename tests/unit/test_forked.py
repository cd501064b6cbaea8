"""The forked-rank helpers report a child that dies without answering (a signal, a heap-corruption abort) at once,
naming it, instead of waiting out their timeout with the other ranks still alive."""

import os
import signal
import time

import pytest

from tests.unit.forked import in_child, run_ranks


def _rank_1_killed(rank: int) -> int:
    import torch.distributed as dist

    dist.barrier()  # both ranks past the rendezvous: rank 0 cannot fail on the closed connection instead
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # rank 0 never answers: only the dead rank can end this run early
    return rank


def test_a_rank_killed_by_a_signal_is_named_before_the_timeout():
    with pytest.raises(AssertionError, match="process 1 exited with signal SIGKILL without a result"):
        run_ranks(_rank_1_killed, timeout=90)


def test_a_child_exiting_without_a_result_is_named():
    with pytest.raises(AssertionError, match="process 0 exited with code 3 without a result"):
        in_child(os._exit, 3, timeout=90)


def test_results_come_back_by_rank():
    assert run_ranks(_double) == [0, 2]


def _double(rank: int) -> int:
    return rank * 2


def _server_state() -> tuple[int, int, bool, bool]:
    import gc
    import sys

    server = os.getppid()  # a child's parent is the fork server
    return (len(os.listdir(f"/proc/{server}/task")), gc.get_freeze_count(), "torch._inductor.compile_fx" in sys.modules,
            "datasets" in sys.modules)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_the_fork_server_is_single_threaded_with_its_heap_frozen():
    # A thread in the server at fork time (pyarrow's allocator thread, if `datasets` were preloaded) could hold a lock
    # that the child then waits on forever (tests/forking.py); the frozen heap keeps children's collections short.
    threads, frozen, preloaded, datasets = in_child(_server_state)
    assert threads == 1 and frozen > 100_000 and preloaded and not datasets, (threads, frozen, preloaded, datasets)
