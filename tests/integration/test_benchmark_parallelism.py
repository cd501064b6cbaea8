"""scripts/benchmark_parallelism.py --pipeline runs end to end on a tiny workload and prints one table: a row per
schedule with each rank's measured bubble, a fraction of the step, and the textbook value; PP's tokens/s next to
FSDP's (the table from given rates: its throughput launches are `run_train.sh` launches like --context's, which
the second test makes). --context prints a row per cp degree with tokens/s per device, peak memory and their ratios
to cp 1. Nothing timed is checked (benchmarks print ratios, tests never time). Each launch trains the parity suite's
small model for a step or two after the one left out of the medians: the launches (torchrun, imports, building the
Trainer) are what these tests cost."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "benchmark_parallelism.py"
WORLD = 2


def _table(out: str) -> dict[str, list[list[str]]]:
    """Rows of the printed table by their first column (the FSDP baseline as 'FSDP'), in order: the cells after it."""
    rows: dict[str, list[list[str]]] = {}
    for line in out.splitlines():
        words = line.replace("FSDP (no PP)", "FSDP", 1).split()
        if words and words[0] in ("GPipe", "1F1B", "Interleaved1F1B", "FSDP"):
            rows.setdefault(words[0], []).append(words[1:])
    return rows


def test_pipeline_section_prints_a_bubble_row_per_schedule(tt_cache_dir):
    env = {**os.environ, "TORCHTITAN_CACHE_DIR": str(tt_cache_dir), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    # the bubble job alone: no throughput launches (test_pipeline_table_puts_tokens_per_second_on_its_rows)
    args = ["--pipeline", "--world", str(WORLD), "--schedules", "GPipe,1F1B", "--microbatches", "2", "--pp-steps", "1",
            "--pp-warmup", "1", "--seq-len", "64", "--throughput-schedules", "", "--", "--model.flavor",
            "debugmodel_small"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    rows = _table(out)
    assert set(rows) == {"GPipe", "1F1B"}, out  # no FSDP row: nothing was launched to compare with
    for schedule in ("GPipe", "1F1B"):
        [row] = rows[schedule]
        v, m, *cells = row
        assert (v, m) == ("1", "2"), out
        bubbles = [float(c.rstrip("*")) for c in cells[:WORLD]]
        assert all(0.0 <= b <= 1.0 for b in bubbles), (schedule, out)
        assert sum(c.endswith("*") for c in cells[:WORLD]) == 1, out  # the most loaded rank is marked
        textbook, balance = float(cells[WORLD]), float(cells[WORLD + 1])
        assert textbook == pytest.approx(1 / 3, abs=1e-3), out  # (p-1)/(m+p-1) at p = m = 2
        assert 0.0 < balance <= 1.0, out
        assert row[-2:] == ["-", "-"], out


def test_pipeline_table_puts_tokens_per_second_on_its_rows(capsys):
    bench = load_script("benchmark_parallelism")
    a = argparse.Namespace(world=WORLD, global_batch=4, seq_len=64, pp_steps=1, pp_warmup=1, steps=2, warmup=1,
                           config="debug_model.toml")
    measured = {"bubbles": [0.25, 0.5], "heaviest": 1, "balance": 0.9, "step_ms": 12.0, "v": 1, "textbook": 0.2}
    # bubbles of GPipe at m = 2 and 4 and 1F1B at 4; throughput runs (at m = global batch 4) of 1F1B, FSDP and a
    # schedule whose bubble was not measured
    rows = {("GPipe", 2): dict(measured), ("GPipe", 4): dict(measured), ("1F1B", 4): dict(measured)}
    tps = {"fsdp": {"tps": 200.0}, "1F1B": {"tps": 150.0}, "Interleaved1F1B": {"tps": 170.0}}
    bench.print_pipeline_table(a, rows, tps)
    out = capsys.readouterr().out
    cells = _table(out)
    assert [c[1] for c in cells["GPipe"]] == ["2", "4"] and all(c[-2:] == ["-", "-"] for c in cells["GPipe"]), out
    [one_f_one_b] = cells["1F1B"]
    assert one_f_one_b[:4] == ["1", "4", "0.250", "0.500*"] and one_f_one_b[-2:] == ["150", "0.75"], out
    [interleaved] = cells["Interleaved1F1B"]  # its own row, nothing measured but the throughput
    assert interleaved[:2] == ["-", "4"] and interleaved[-2:] == ["170", "0.85"], out
    assert cells["FSDP"] == [["-", "-", "-", "-", "-", "-", "-", "200", "1.00"]], out


def _context_rows(out: str) -> dict[int, list[str]]:
    """--context's table rows at seq_len 64 by cp degree; the cells after seq_len and cp."""
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if len(cells) >= 3 and cells[0] == "64" and cells[1].isdigit():
            rows[int(cells[1])] = cells[2:]
    return rows


def test_context_section_prints_a_row_per_cp_degree(tt_cache_dir):
    env = {**os.environ, "TORCHTITAN_CACHE_DIR": str(tt_cache_dir), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    # cp 3 does not divide the world: reported as skipped, never launched
    args = ["--context", "--world", str(WORLD), "--seq-lens", "64", "--cp-degrees", "1,2,3", "--context-steps", "2",
            "--context-warmup", "1", "--", "--model.flavor", "debugmodel_small"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert f"world {WORLD}" in out.splitlines()[0] and "torch" in out.splitlines()[0], out
    rows = _context_rows(out)
    assert set(rows) == {1, 2, 3}, out
    for cp in (1, 2):
        dp, tps, mem, mem_ratio, tps_ratio = rows[cp]
        assert int(dp) == WORLD // cp, out
        assert float(tps) > 0 and float(mem) > 0, out
        assert float(mem_ratio) > 0 and float(tps_ratio) > 0, out
    assert rows[1][-2:] == ["1.00", "1.00"], out  # cp 1 is the baseline of the ratios
    # skipped for the world (64 is not divisible by 2 x 3 either: the world is checked first)
    assert " ".join(rows[3]) == f"- skipped: cp 3 does not divide world {WORLD}", out
    assert "max of mem/max_rss_gib" in out, out  # CPU: the peak resident set of every rank
