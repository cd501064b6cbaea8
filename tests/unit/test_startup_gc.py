"""The garbage collector at a process's start (torchtitan/tools/startup_gc.py): paused for the imports of an entry
point run as a program, then what they built frozen and collection back on. Each case runs in a forked child, so
the pytest process keeps its own collector state."""

from __future__ import annotations

import ast
import gc
import os
import runpy
import sys
from pathlib import Path

from tests.unit.forked import in_child
from torchtitan.tools import startup_gc

REPO = Path(__file__).resolve().parents[2]


def _pause_then_resume(collector_on: bool) -> tuple:
    if not collector_on:
        gc.disable()
    frozen_before = gc.get_freeze_count()
    startup_gc.pause()
    startup_gc.pause()  # a second pause keeps the state the first one saw
    paused = not gc.isenabled()
    kept = [[i] for i in range(1000)]  # stands for the objects the imports build
    startup_gc.freeze_and_resume()
    frozen = gc.get_freeze_count() - frozen_before
    enabled = gc.isenabled()
    startup_gc.freeze_and_resume()  # not paused any more: nothing changes
    return paused, frozen >= len(kept), enabled, gc.get_freeze_count() - frozen_before == frozen


def test_pause_then_freeze_restores_the_collector_as_it_was():
    assert in_child(_pause_then_resume, True) == (True, True, True, True)
    assert in_child(_pause_then_resume, False) == (True, True, False, True)


def _entry_point_state(module: str) -> tuple:
    """Runs `module` as `python -m module` would (or a script's path as `python path` would; the imports are
    already loaded in the fork server, so this is quick), and records the collector's state where the entry point
    resumes it; then leaves without training."""
    seen = {}

    def spy():
        seen["paused_until_now"] = not gc.isenabled()
        real()
        seen["on_after"] = gc.isenabled()
        raise SystemExit(0)

    real = startup_gc.freeze_and_resume
    startup_gc.freeze_and_resume = spy
    sys.argv = [module, "--job.config_file", os.devnull]
    try:
        if module.endswith(".py"):
            runpy.run_path(module, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        startup_gc.freeze_and_resume = real
    return seen.get("paused_until_now"), seen.get("on_after")


def test_the_trainer_run_as_a_program_pauses_for_its_imports():
    assert in_child(_entry_point_state, "torchtitan.train") == (True, True)
    assert in_child(_entry_point_state, "torchtitan.rl.train") == (True, True)
    assert in_child(_entry_point_state, str(REPO / "scripts" / "dry_run.py")) == (True, True)


def _imported_as_a_module() -> bool:
    import torchtitan.train  # noqa: F401 - a library import, as tests and scripts do
    from tests.scripts import load_script

    load_script("dry_run")  # a script imported by a test: use_project_python() leaves collection alone
    return gc.isenabled()


def test_importing_the_trainer_leaves_the_collector_alone():
    assert in_child(_imported_as_a_module) is True


def _resumes_first_thing_when_run(path: Path) -> bool:
    """Whether the script's `if __name__ == "__main__":` block starts with startup_gc.freeze_and_resume()."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            first = node.body[0]
            return isinstance(first, ast.Expr) and ast.unparse(first.value) == "startup_gc.freeze_and_resume()"
    return False


def test_every_script_that_pauses_the_collector_resumes_it():
    # use_project_python() pauses collection when a script runs as a program (scripts/project_python.py); a script
    # that never resumed it would run with automatic collection off, FSDP's reference cycles never freed.
    scripts = [p for p in sorted(REPO.glob("scripts/*.py")) if "\nuse_project_python()" in p.read_text()]
    assert len(scripts) >= 10
    assert [p.name for p in scripts if not _resumes_first_thing_when_run(p)] == []
