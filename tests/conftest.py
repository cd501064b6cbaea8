"""Session-wide settings of the test run.

The garbage collector of each pytest process that collects tests, as a training rank has it
(torchtitan/tools/startup_gc.py): paused while collection imports every test module (torch, transformers, the
whole package), then that heap frozen, so neither the tests' full collections nor the exit-time one walk it again.
The pytest-xdist controller collects nothing and keeps the default.

The order of the files: the longest first. scripts/run_tests.sh hands whole files to two workers (--dist loadfile),
and pytest-xdist would start with the files that hold the most tests; the longest files by time hold few (the
multi-node launch is one test of 13 s), so they came last and one worker often ran alone for their last seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchtitan.tools import startup_gc

TESTS = Path(__file__).resolve().parent
# Files by their measured test-seconds on the CI machine's kind, longest first (2026-11-28, four fresh-clone runs:
# 175, 170, 75, 28 ... 9 s); the rest, each under 9 s, follow in collection order.
LONGEST_FIRST = (
    "unit/test_memory_estimation.py", "integration/test_parity.py", "integration/test_checkpoint_resume.py",
    "integration/test_moe_routing.py", "integration/test_faults.py", "unit/test_rl_loop.py",
    "integration/test_quickstart.py", "unit/test_rl_learns.py", "integration/test_benchmark_parallelism.py",
    "integration/test_data_pipeline.py", "integration/test_benchmark_trainer.py", "integration/test_float8.py",
    "integration/test_multinode.py", "unit/test_hf_sharded.py", "unit/test_dry_run.py",
    "unit/test_benchmark_scripts.py", "unit/test_finetune_recipes.py", "unit/test_tokenizers.py",
    "unit/test_debug_finetune_recipes.py",
)


def pytest_configure(config):
    is_xdist_controller = bool(getattr(config.option, "numprocesses", None)) and not os.environ.get(
        "PYTEST_XDIST_WORKER")
    if not is_xdist_controller:
        startup_gc.pause()
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: schedule files in the order collected
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    missing = [name for name in LONGEST_FIRST if not (TESTS / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST names files that do not exist: {missing}")
    rank = {TESTS / name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path), len(rank)))  # stable: the rest keep their order


def pytest_collection_finish(session):
    startup_gc.freeze_and_resume()
