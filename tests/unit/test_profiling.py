"""Unit tests for torchtitan.tools.profiling (CPU): which steps are traced, where files go, what is checked.

The CUDA memory-snapshot path cannot run here; its cadence and OOM handling are tested with the two
torch.cuda.memory calls replaced by fakes that write a file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from torchtitan.config.job_config import Profiling
from torchtitan.config.manager import ConfigError, parse_args
from torchtitan.tools import profiling
from torchtitan.tools.profiling import NullProfiler, StepProfiler, maybe_profile, trace_schedule


def _train(prof, steps: int, fail_at: int | None = None, error: type[BaseException] = RuntimeError) -> None:
    """A tiny model's training loop (first step 1) with the profiler around it, as the trainer does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    with prof:
        for step in range(1, steps + 1):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if step == fail_at:
                raise error("out of memory (simulated)")
            opt.step()
            opt.zero_grad()
            prof.step()


def _iterations(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_traces_exactly_the_multiples_of_profile_freq(tmp_path: Path) -> None:
    cfg = Profiling(enable_profiling=True, profile_freq=3, save_traces_folder="traces")
    _train(maybe_profile(cfg, tmp_path, rank=1, device_type="cpu", first_step=1), steps=7)
    root = tmp_path / "traces"
    assert _iterations(root) == ["iteration_3", "iteration_6"]
    for it in ("iteration_3", "iteration_6"):
        assert [p.name for p in (root / it).iterdir()] == ["rank1_trace.json"]
        trace = json.loads((root / it / "rank1_trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        # One training step's work: forward matmuls and the optimizer, in exactly one profiler step.
        assert any("addmm" in n for n in names)
        assert len([n for n in names if n.startswith("ProfilerStep#")]) == 1
    assert not (tmp_path / profiling.MEMORY_SNAPSHOT_FOLDER).exists()


def test_resumed_run_and_last_step_traced(tmp_path: Path) -> None:
    # Resumed at step 5, stops after step 9: steps 6 and 9 are traced, 9 because step() runs after the last step.
    cfg = Profiling(enable_profiling=True, profile_freq=3)
    prof = maybe_profile(cfg, tmp_path, rank=0, device_type="cpu", first_step=5, last_step=9)
    with prof:
        for _ in range(5, 10):
            torch.randn(32, 32) @ torch.randn(32, 32)
            prof.step()
    assert _iterations(tmp_path / "profile_traces") == ["iteration_6", "iteration_9"]


def test_failed_step_is_not_saved(tmp_path: Path) -> None:
    cfg = Profiling(enable_profiling=True, profile_freq=2)
    with pytest.raises(RuntimeError):
        _train(maybe_profile(cfg, tmp_path, rank=0, device_type="cpu", first_step=1), steps=5, fail_at=4)
    # Step 2 completed; step 4 was being recorded when it failed, so it leaves no partial trace behind.
    assert _iterations(tmp_path / "profile_traces") == ["iteration_2"]
    assert not torch.autograd.profiler._is_profiler_enabled


@pytest.mark.parametrize(("first", "freq", "last", "expected"), [
    (1, 1, None, "RRRRRR"),
    (1, 2, None, "WRWRWR"),
    (1, 3, None, "WWRWWR"),
    (2, 5, None, "NWWRNN"),  # steps 2-7: 5 is traced, 10 is outside the range
    (1, 3, 4, "WWRNNN"),  # no warmup for step 6 after the last step (4)
])
def test_schedule(first: int, freq: int, last: int | None, expected: str) -> None:
    letter = {torch.profiler.ProfilerAction.NONE: "N", torch.profiler.ProfilerAction.WARMUP: "W",
              torch.profiler.ProfilerAction.RECORD_AND_SAVE: "R"}
    schedule = trace_schedule(first, freq, last_step=last)
    assert "".join(letter[schedule(i)] for i in range(6)) == expected


def test_disabled_profiling_writes_nothing_and_costs_nothing(tmp_path: Path) -> None:
    prof = maybe_profile(Profiling(), tmp_path, rank=0, device_type="cpu", first_step=1)
    assert isinstance(prof, NullProfiler)
    _train(prof, steps=4)
    assert list(tmp_path.iterdir()) == []
    assert not torch.autograd.profiler._is_profiler_enabled


class _FakeCudaMemory:
    """Stands in for torch.cuda.memory's history calls, which need a CUDA build."""

    def __init__(self) -> None:
        self.recording: list[object] = []

    def record(self, enabled="all", **kwargs) -> None:
        self.recording.append(enabled)

    def dump(self, filename: str) -> None:
        assert self.recording and self.recording[-1] == "all", "snapshot dumped while history was off"
        Path(filename).write_bytes(b"snapshot")


@pytest.fixture
def fake_cuda_memory(monkeypatch: pytest.MonkeyPatch) -> _FakeCudaMemory:
    fake = _FakeCudaMemory()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", fake.dump)
    return fake


def test_memory_snapshot_cadence(tmp_path: Path, fake_cuda_memory: _FakeCudaMemory) -> None:
    cfg = Profiling(enable_memory_snapshot=True, profile_freq=3)
    prof = maybe_profile(cfg, tmp_path, rank=2, device_type="cuda", first_step=1)
    assert isinstance(prof, StepProfiler)
    _train(prof, steps=7)
    root = tmp_path / "memory_snapshot"
    assert _iterations(root) == ["iteration_3", "iteration_6"]
    assert (root / "iteration_6" / "rank2_memory_snapshot.pickle").read_bytes() == b"snapshot"
    assert fake_cuda_memory.recording == ["all", None]  # history switched off at the end
    assert not (tmp_path / "profile_traces").exists()


def test_memory_snapshot_on_oom(tmp_path: Path, fake_cuda_memory: _FakeCudaMemory) -> None:
    cfg = Profiling(enable_memory_snapshot=True, profile_freq=10)
    prof = maybe_profile(cfg, tmp_path, rank=0, device_type="cuda", first_step=1)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _train(prof, steps=5, fail_at=4, error=torch.cuda.OutOfMemoryError)
    assert _iterations(tmp_path / "memory_snapshot") == ["iteration_4_oom"]
    assert fake_cuda_memory.recording == ["all", None]
    # Any other error leaves no snapshot, and a wrapped OOM counts as one.
    assert prof.save_oom_snapshot(ValueError("bad")) is None
    wrapped = RuntimeError("compiled region failed")
    wrapped.__cause__ = torch.cuda.OutOfMemoryError("out of memory")
    assert profiling._is_oom(wrapped) and not profiling._is_oom(ValueError("x"))


def test_memory_snapshot_needs_cuda(tmp_path: Path) -> None:
    cfg = Profiling(enable_memory_snapshot=True)
    with pytest.raises(ConfigError) as info:
        profiling.check_profiling_device(cfg, "cpu")
    msg = str(info.value)
    assert "profiling.enable_memory_snapshot" in msg and "\n" not in msg
    profiling.check_profiling_device(cfg, "cuda")
    profiling.check_profiling_device(Profiling(enable_profiling=True), "cpu")  # traces work on CPU
    with pytest.raises(ConfigError):
        maybe_profile(cfg, tmp_path, rank=0, device_type="cpu", first_step=1)


def test_profiling_keys_are_accepted() -> None:
    # They used to be rejected as "not available yet"; bad values: INVALID_VALUES in tests/unit/test_config.py.
    cfg = parse_args(["--profiling.enable_profiling", "--profiling.enable_memory_snapshot",
                      "--profiling.profile_freq", "5", "--profiling.save_traces_folder", "prof/traces"])
    assert cfg.profiling.enable_profiling and cfg.profiling.enable_memory_snapshot
    assert cfg.profiling.profile_freq == 5


# allocator_peak's replay (torchtitan/tools/profiling.py), on events as the profiler reports them: (time, size, address,
# thread), sizes negative for frees. Thread 1 is the program's (it allocates most).
MAIN, GLOO = 1, 2


def test_replay_counts_only_the_programs_allocations():
    # gloo's thread allocates an 8-byte temporary while the program's peak is 10: it moves with scheduling, and NCCL
    # keeps such buffers outside the allocator
    events = [(1, 4, 0xA, MAIN), (2, 6, 0xB, MAIN), (3, 8, 0xC, GLOO), (4, -8, 0xC, GLOO), (5, -6, 0xB, MAIN),
              (6, -4, 0xA, MAIN)]
    assert profiling.replay_peak(events) == 10
    # ... including when the program's thread frees it
    events[3] = (4, -8, 0xC, MAIN)
    assert profiling.replay_peak(events) == 10


def test_replay_ends_a_block_whose_free_was_not_recorded_when_its_address_is_reused():
    # A collective's 4-byte input freed unseen by gloo's thread; the program reuses the address for 4 bytes, then
    # allocates 5 more: the peak is 9, not 13 (the unseen block counted alive for good).
    events = [(1, 4, 0xA, MAIN), (2, 4, 0xA, MAIN), (3, 5, 0xB, MAIN), (4, -5, 0xB, MAIN)]
    assert profiling.replay_peak(events) == 9


def test_replay_since_start_skips_frees_of_older_memory():
    events = [(1, -100, 0xF, MAIN), (2, 4, 0xA, MAIN), (3, 2, 0xB, MAIN)]
    assert profiling.replay_peak(events, since_start=True) == 6
    assert profiling.replay_peak(events) == 0  # all of it counted from before: the older free lowers the sum
