from __future__ import annotations

import os

import pytest

from tests.integration.layouts import COMMON, PARITY, REFERENCES
from tests.integration.parity import run_layout
from tests.integration.pool import Pools


@pytest.fixture(scope="session")
def tt_cache_dir(tmp_path_factory):
    """One tokenizer, dataset and inductor cache for the session, shared by the pytest-xdist workers as one machine's
    ranks share ~/.cache/torchtitan: each default BPE is trained once (the first process takes the file lock, the
    others wait and load it, torchtitan/data/tokenizer.py), then loaded."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one pytest process: a folder of its own
        return tmp_path_factory.mktemp("torchtitan_cache")
    shared = tmp_path_factory.getbasetemp().parent / "torchtitan_cache"  # the workers' common base folder
    shared.mkdir(exist_ok=True)
    return shared


_OPEN_POOLS: list[Pools] = []  # the pools fixture's value while it lives


@pytest.fixture(scope="package")
def pools(tmp_path_factory, tt_cache_dir):
    """Persistent pools of 1, 2, 4 or 8 forked gloo ranks (tests/integration/pool.py), started on first use and
    closed when the integration tests end (idle gloo ranks would slow the rest of the session down)."""
    env = {"TORCHTITAN_CACHE_DIR": str(tt_cache_dir), "TORCHINDUCTOR_CACHE_DIR": str(tt_cache_dir / "inductor"),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    pools = Pools(tmp_path_factory.mktemp("pool_logs"), env)
    _OPEN_POOLS.append(pools)
    yield pools
    _OPEN_POOLS.remove(pools)
    pools.close()


@pytest.fixture(scope="module", autouse=True)
def _no_idle_pools_beside_a_module_without_them(request):
    """Before a module none of whose tests uses the pools (torchrun launches, benchmark scripts), the open pools
    close: an idle pool's gloo threads keep polling, about a quarter of a core for a 4-rank pool that has served a
    few meshes (measured 2026-11-28), while the module's own processes want both cores. The next module that uses
    pools starts them again."""
    tests = [item for item in request.session.items if item.module is request.module]
    if not any("pools" in item.fixturenames for item in tests):
        for pools in _OPEN_POOLS:
            pools.close()
    yield


def mesh_shape(args) -> tuple:
    """The parallel degrees `args` set: jobs of equal shapes share a pool's meshes (tests/integration/pool.py)."""
    return tuple(sorted((key, value) for key, value in zip(args, args[1:], strict=False)
                        if key.startswith("--parallelism.") and key.endswith("_degree")))


def train_layout(pools: Pools, nproc: int, args, dump_folder, faults: tuple = (), timeout: float = 180.0) -> dict:
    """Train `args` (on top of COMMON) on the pool of `nproc` ranks; rank 0's metrics and parameter checksums."""
    pool = pools.get(nproc, mesh_shape(args))
    return pool.run(run_layout, [*COMMON, *args], str(dump_folder), faults, timeout=timeout)[0]


def train_parity(pools: Pools, nproc: int, args, dump_folder, faults: tuple = (), timeout: float = 180.0) -> dict:
    """train_layout for the parity suite: STEPS steps with validation after each (tests/integration/layouts.py), as
    every reference and layout is run."""
    return train_layout(pools, nproc, (*PARITY, *args), dump_folder, faults, timeout)


def setup_error(pools: Pools, nproc: int, args, dump_folder) -> str:
    """The one-line error with which building the Trainer for `args` fails, the same on every rank."""
    errors = pools.get(nproc, mesh_shape(args)).run(run_layout, [*COMMON, *args], str(dump_folder), (), "setup_error")
    assert all(e == errors[0] for e in errors), errors
    return errors[0]["error"]


@pytest.fixture(scope="package")
def reference(pools, tmp_path_factory):
    """The 1-process runs of REFERENCES, each trained once per session when first asked for."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            ref = REFERENCES[name]
            cache[name] = train_parity(pools, 1, ref.overrides, tmp_path_factory.mktemp(name))
        return cache[name]

    return get
