"""scripts/loss_compare.py, run in-process through its main(): run folders and files, any number of runs, the union
of their steps, any metric, exit codes (0 without --rtol, 1 over it, 2 in one line for bad input) and the plot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("loss_compare", REPO / "scripts" / "loss_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lc = _load_script()


def _run(folder: Path, records: list[dict]) -> Path:
    """A dump folder with a metrics.jsonl as the trainer writes it (one JSON object per line)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def _rows(out: str, metric: str) -> dict[int, list[str]]:
    """The table of one metric: step -> the rest of its row, split on whitespace."""
    lines = out.split(f"\n{metric} (relative difference to", 1)[1].splitlines()[2:]
    rows = {}
    for line in lines:
        if not line.strip() or not line.split()[0].isdigit():
            break
        step, *cells = line.split()
        rows[int(step)] = cells
    return rows


@pytest.fixture
def runs(tmp_path):
    # ref and same log steps 1-3; other logs 2-4, differs by 10% at step 2 and has another grad_norm.
    ref = _run(tmp_path / "ref", [{"step": s, "loss": 4.0 - s, "grad_norm": 1.0, "mfu": None} for s in (1, 2, 3)])
    same = _run(tmp_path / "same", [{"step": s, "loss": 4.0 - s, "grad_norm": 1.0, "mfu": None} for s in (1, 2, 3)])
    other = _run(tmp_path / "other", [{"step": 2, "loss": 2.2, "grad_norm": 2.0}, {"step": 3, "loss": 1.0},
                                      {"step": 4, "loss": 0.5}])
    return ref, same, other


def test_three_runs_union_of_steps_with_dashes_and_relative_differences(runs, capsys):
    ref, same, other = runs
    # A folder, a metrics.jsonl file and a folder holding its metrics.jsonl one level down are all runs.
    parent = other.parent / "outputs"
    parent.mkdir()
    other.rename(parent / "other")
    assert lc.main([str(ref), str(same / "metrics.jsonl"), str(parent)]) == 0
    out = capsys.readouterr().out
    assert "loss (relative difference to ref)" in out
    header = out.split("loss (relative difference to ref)\n", 1)[1].splitlines()[0].split()
    assert header == ["step", "ref", "same", "other", "same", "rel", "other", "rel"]
    rows = _rows(out, "loss")
    assert sorted(rows) == [1, 2, 3, 4]  # the union: other alone logged step 4, ref and same alone step 1
    assert rows[1] == ["3", "3", "-", "+0.00e+00", "-"]
    assert rows[2] == ["2", "2", "2.2", "+0.00e+00", "+1.00e-01"]
    assert rows[4] == ["-", "-", "0.5", "-", "-"]
    assert "other 1.00e-01 (2 steps)" in out  # the summary: largest difference over the shared steps


def test_a_second_metric_gets_its_own_table(runs, capsys):
    ref, same, other = runs
    assert lc.main([str(ref), str(other), "--metric", "loss", "--metric", "grad_norm"]) == 0
    out = capsys.readouterr().out
    grad = _rows(out, "grad_norm")
    assert grad == {1: ["1", "-", "-"], 2: ["1", "2", "+1.00e+00"], 3: ["1", "-", "-"]}
    assert _rows(out, "loss")[4] == ["-", "0.5", "-"]
    # A key the records hold only as null (mfu on CPU) is known, and has no value to show.
    assert lc.main([str(ref), str(same), "--metric", "mfu"]) == 0
    assert "(no run logged a value)" in capsys.readouterr().out


def test_differences_fail_only_with_rtol_naming_the_first_one(runs, capsys):
    ref, same, other = runs
    assert lc.main([str(ref), str(same), str(other)]) == 0
    capsys.readouterr()
    assert lc.main([str(ref), str(same), str(other), "--rtol", "1e-5"]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip() == "over rtol: step 2: loss of other differs from ref by +1.00e-01 (rtol 1e-05)"
    rows = _rows(captured.out, "loss")
    assert rows[2][-3:] == ["<--", "above", "rtol"] and "<--" not in rows[3]
    assert lc.main([str(ref), str(same), str(other), "--rtol", "0.2"]) == 0
    assert lc.main([str(ref), str(same), "--metric", "grad_norm", "--rtol", "0"]) == 0
    # A diverged run logs NaN (metrics.jsonl keeps it): no tolerance accepts it.
    diverged = _run(ref.parent / "diverged", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": float("nan")}])
    capsys.readouterr()
    assert lc.main([str(ref), str(diverged), "--rtol", "1e9"]) == 1
    assert "step 2: loss of diverged differs from ref by +nan" in capsys.readouterr().err


def test_labels_of_runs_in_folders_of_the_same_name_are_told_apart(tmp_path):
    a = _run(tmp_path / "a" / "debug_model", [{"step": 1, "loss": 1.0}])
    b = _run(tmp_path / "b" / "debug_model", [{"step": 1, "loss": 1.0}])
    files = [a / "metrics.jsonl", b / "metrics.jsonl", a / "metrics.jsonl"]
    assert lc.run_labels(files) == ["a/debug_model", "b/debug_model", "a/debug_model#2"]
    assert lc.run_labels([tmp_path / "x.jsonl", tmp_path / "y.jsonl"]) == ["x", "y"]


@pytest.mark.parametrize("case", ["missing", "empty", "not_json", "two_runs_inside", "unknown_metric"])
def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, capsys, case):
    ref, same, _ = runs
    bad = {"missing": tmp_path / "nowhere", "empty": tmp_path / "empty.jsonl", "not_json": tmp_path / "bad.jsonl",
           "two_runs_inside": tmp_path, "unknown_metric": same}[case]
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "loss": 1.0}\nloss 2.0\n')
    argv = [str(ref), str(bad)] + (["--metric", "losss"] if case == "unknown_metric" else [])
    assert lc.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    expected = {"missing": "no such file or folder", "empty": "empty.jsonl is empty", "not_json": "bad.jsonl:2:",
                "two_runs_inside": "holds 3 metrics.jsonl files", "unknown_metric": "unknown metric 'losss'"}[case]
    assert expected in err, err


def test_plot_has_a_panel_per_metric_integer_steps_a_title_and_a_legend(runs, tmp_path, capsys):
    ref, same, other = runs
    png = tmp_path / "curves.png"
    assert lc.main([str(ref), str(same), str(other), "--metric", "loss", "--metric", "grad_norm",
                    "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The figure itself, as main() draws it before saving.
    curves = [[lc.curve_of(lc.read_records(r / "metrics.jsonl"), m) for r in runs] for m in ("loss", "grad_norm")]
    fig = lc.draw(["loss", "grad_norm"], ["ref", "same", "other"], curves)
    loss_ax, grad_ax = fig.axes
    assert loss_ax.get_title() == "ref vs same vs other"
    assert [t.get_text() for t in loss_ax.get_legend().get_texts()] == ["ref", "same", "other"]
    assert (loss_ax.get_ylabel(), grad_ax.get_ylabel()) == ("loss", "grad_norm")
    assert list(loss_ax.lines[2].get_xdata()) == [2, 3, 4]  # each run's whole range, not only the shared steps
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_plot_without_matplotlib_is_one_line(runs, capsys, monkeypatch):
    ref, same, _ = runs
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert lc.main([str(ref), str(same), "--plot", "x.png"]) == 2
    assert capsys.readouterr().err.strip() == "loss_compare: --plot needs matplotlib: pip install -e .[plot]"
