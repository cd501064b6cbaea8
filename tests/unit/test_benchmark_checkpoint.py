"""scripts/benchmark_checkpoint.py runs end to end on a tiny model and prints every row (it had silently broken when
CheckpointManager's arguments changed). Smoke test only: no timing is asserted."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_benchmark_checkpoint_prints_every_row(tmp_path: Path, capsys) -> None:
    path = Path(__file__).resolve().parents[2] / "scripts" / "benchmark_checkpoint.py"
    spec = importlib.util.spec_from_file_location("benchmark_checkpoint", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--dir", str(tmp_path), "--dim", "64", "--n-layers", "1", "--vocab", "256", "--repeats", "1"])
    out = capsys.readouterr().out
    for row in ("raw write + fsync", "DCP save (sync)", "DCP async: until complete", "DCP load",
                "save_hf (whole state dict)", "export by rows", "load_hf + load_state_dict", "import by rows"):
        assert row in out, (row, out)
    assert list(tmp_path.iterdir()) == []  # the benchmark's folder is removed
