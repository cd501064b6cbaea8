"""Profiling through the trainer: torch.profiler traces every profiling.profile_freq steps, one per rank."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import train_layout
from tests.integration.layouts import dp

pytestmark = pytest.mark.slow


def test_traces_every_profile_freq_steps_on_every_rank(pools, tmp_path):
    train_layout(pools, 2, (*dp(4, 2), "--training.steps", "6", "--profiling.enable_profiling",
                            "--profiling.profile_freq", "3", "--profiling.save_traces_folder", "traces"), tmp_path)
    folders = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert folders == ["iteration_3", "iteration_6"], folders
    for folder in folders:
        for rank in (0, 1):
            trace = json.loads((tmp_path / "traces" / folder / f"rank{rank}_trace.json").read_text())
            names = {e.get("name", "") for e in trace["traceEvents"]}
            assert any("aten::mm" in n or "aten::addmm" in n for n in names), sorted(names)[:20]
