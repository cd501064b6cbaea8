"""The one fork server every forked test process comes from (unit-test ranks, parity pools, children).

Forked, not spawned: a child of a server that has torch and torchtitan imported starts in about a second
instead of importing them again (~3 s each on 2 cores). Forked from a clean server, not from pytest's own
process: by the time most tests run, pytest's process has threads of its own (integration launches,
TensorBoard, W&B, data workers), and a child forked while one of them held a lock hung for 300 s in CI.
All users share one server (a process has one), so the preload list covers all of them.
"""

from __future__ import annotations

import socket

import torch.multiprocessing as mp

CTX = mp.get_context("forkserver")
# torch._dynamo too: DTensor imports it on its first op, about 1 s of CPU in every forked rank otherwise. torchao's
# float8 and what its conversion pulls in (functorch.compile: sympy, networkx), 0.5 s in every rank that first runs a
# float8 layout (2026-11-27). Then what children import lazily (2026-11-27, CPU-seconds in each child that needs it):
# pytest, which every test module a child's function lives in imports (0.08 s); the pipeline runtime; inductor, for
# the compiled layouts and float8's conversion (0.8 s). Not `datasets`: it starts pyarrow's allocator thread, and the
# server must stay single-threaded to fork safely (tests/unit/test_forked.py checks). forkserver_heap comes last (see
# there, and docs/testing.md).
CTX.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "torch.distributed.tensor",
                            "torchtitan.train", "torchao.float8", "functorch.compile", "pytest",
                            "torch.distributed.pipelining", "torch._inductor.compile_fx",
                            "torch._inductor.codegen.cpp", "torch._inductor.codegen.triton", "tests.forkserver_heap"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
