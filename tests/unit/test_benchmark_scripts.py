"""The single-process benchmark scripts run end to end at tiny sizes and print every row (benchmark_checkpoint.py had
silently broken when CheckpointManager's arguments changed). Smoke tests only: no timing is asserted. (The
multi-process benchmarks have theirs in tests/integration/.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _script(name: str):
    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_checkpoint_prints_every_row(tmp_path: Path, capsys) -> None:
    _script("benchmark_checkpoint").main(["--dir", str(tmp_path), "--dim", "64", "--n-layers", "1", "--vocab", "256",
                                          "--repeats", "1"])
    out = capsys.readouterr().out
    for row in ("raw write + fsync", "DCP save (sync)", "DCP async: until complete", "DCP load",
                "save_hf (whole state dict)", "export by rows", "load_hf + load_state_dict", "import by rows"):
        assert row in out, (row, out)
    assert list(tmp_path.iterdir()) == []  # the benchmark's folder is removed


def test_benchmark_data_prints_its_ratio_row(capsys) -> None:
    _script("benchmark_data").main(["--seconds", "0.5", "--workers", "0", "--dp", "1", "--seq-len", "64",
                                    "--batch", "2", "--debug-tps", "1000"])
    out = capsys.readouterr().out
    assert "max dp (8B)" in out and "consumption:" in out, out
