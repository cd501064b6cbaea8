"""The single-process benchmark scripts run end to end at tiny sizes and print every row (benchmark_checkpoint.py had
silently broken when CheckpointManager's arguments changed). Smoke tests only: no timing is asserted. (The
multi-process benchmarks have theirs in tests/integration/.)"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import pytest

from tests.scripts import load_script
from tests.unit.forked import in_child


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


def _benchmark_float8_output(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        load_script("benchmark_float8").main(argv)
    return out.getvalue()


def test_benchmark_float8_prints_a_row_per_variant() -> None:
    # In a child: the script creates its own (1-process) process group.
    out = in_child(_benchmark_float8_output, ["--variants", "bf16,tensorwise", "--steps", "2", "--warmup", "1",
                                              "--all-layers", "--", "--model.flavor", "debugmodel_small",
                                              "--training.seq_len", "32", "--training.local_batch_size", "2"])
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| variant")}
    assert set(rows) == {"bf16", "tensorwise"}, out
    assert rows["bf16"][1].strip() == "1.00" and float(rows["tensorwise"][1]) > 0, out


def test_benchmark_data_prints_its_ratio_row(capsys) -> None:
    _script("benchmark_data").main(["--seconds", "0.5", "--workers", "0", "--dp", "1", "--seq-len", "64",
                                    "--batch", "2", "--debug-tps", "1000"])
    out = capsys.readouterr().out
    assert "max dp (8B)" in out and "consumption:" in out, out


def test_gpu_check_smoke_trains_estimates_and_prints_its_table(capsys) -> None:
    # The CPU smoke mode of the one-command GPU check, one check of it (the others are the documented commands
    # other tests run): a launch through run_train.sh, its metrics, and the estimator's verdict for the same job.
    code = load_script("gpu_check").main(["--smoke", "--only", "eager,loss_chunks", "--steps", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    (row,) = [line for line in out.splitlines() if line.startswith("| eager |")]
    assert "| ok |" in row and "tokens/s" in row and "estimate peak" in row and "(fits)" in row, row
    (row,) = [line for line in out.splitlines() if line.startswith("| loss_chunks |")]
    assert "| ok |" in row and "1 chunks: 1.00 x time" in row and "32 chunks:" in row, row


def test_loss_chunk_benchmark_shows_the_peak_falling() -> None:
    rows = _script("benchmark_loss_chunks").main(["--tokens", "256", "--dim", "32", "--vocab", "4096", "--chunks",
                                                  "1,4", "--repeats", "1", "--dtype", "float32", "--device", "cpu"])
    assert [r["chunks"] for r in rows] == [1, 4] and rows[0]["peak_ratio"] == 1.0
    assert rows[1]["peak_ratio"] < 0.6, rows  # 4 MiB logits: whole, a quarter at a time


def test_gpu_check_names_an_unknown_check() -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_script("gpu_check").main(["--only", "eager,speed"])
    assert exit_info.value.code == 2
