"""Compare any logged metric (loss, grad_norm, tps, mem/..., any key of metrics.jsonl) of two or more runs.

    python scripts/loss_compare.py RUN RUN [RUN ...] [--metric NAME ...] [--rtol X] [--plot out.png]

RUN is a run's dump folder (job.dump_folder, which holds metrics.jsonl), a folder with exactly one metrics.jsonl
somewhere below it (e.g. outputs/), or a metrics.jsonl file. Runs are named by their folders. --metric picks a key
of the records (repeatable; default loss). For each metric a table shows every run's value at every step any run
logged ("-" where a run has none) and each run's relative difference to the first run, (run - first) / |first|.

Exit codes: 0 whatever the differences, unless --rtol X is given: then 1 when a relative difference is above X
(or NaN, or a run shares no step with the first run), naming the first step, metric and run over it. 2 for a bad
path, an empty file, an unknown metric or a missing matplotlib, in one line. --plot draws one panel per metric
with every run's whole curve (needs matplotlib: pip install -e .[plot]).

    python scripts/loss_compare.py outputs/ref outputs/new --rtol 2e-6
    python scripts/loss_compare.py outputs/a outputs/b outputs/c --metric loss --metric grad_norm --plot curves.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

Curve = dict[int, float]  # step -> value


class InputError(Exception):
    """A bad argument or input file: reported as one line on stderr with exit code 2."""


def find_metrics_file(arg: str) -> Path:
    path = Path(arg)
    if path.is_file():
        return path
    if not path.is_dir():
        raise InputError(f"no such file or folder: {arg}")
    if (path / "metrics.jsonl").is_file():
        return path / "metrics.jsonl"
    found = sorted(path.rglob("metrics.jsonl"))
    if not found:
        raise InputError(f"no metrics.jsonl in {arg}")
    if len(found) > 1:
        # Several runs under outputs/, or save_for_all_ranks's rank_<r>/ folders: a guess could compare the wrong run.
        names = ", ".join(str(p.relative_to(path)) for p in found[:3]) + (", ..." if len(found) > 3 else "")
        raise InputError(f"{arg} holds {len(found)} metrics.jsonl files ({names}); name one of them")
    return found[0]


def read_records(path: Path) -> dict[int, dict[str, Any]]:
    """The file's records merged by step."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    by_step: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, TypeError, KeyError):
            raise InputError(f"{path}:{n}: not a JSON record with a step") from None
        # Merged rather than replaced: a step may be logged in several calls (training, then validation). A resumed
        # run appends to the same file and repeats the steps after its checkpoint: the later value is the one its
        # training went on from, so it wins. A null (mfu without a known peak) never hides a value.
        merged = by_step.setdefault(step, {})
        for key, value in record.items():
            if value is not None or key not in merged:  # kept as None: the metric is known, just without a value
                merged[key] = value
    if not by_step:
        raise InputError(f"{path} is empty")
    return by_step


def run_labels(files: list[Path]) -> list[str]:
    """Each run's folder name; names shared by several runs take parent folders until they differ."""
    # A file not called metrics.jsonl (a.jsonl) is named by its stem, as two such files often share a folder.
    parts = [f.resolve().parent.parts[1:] + (() if f.name == "metrics.jsonl" else (f.stem,)) for f in files]
    depth = [1] * len(files)
    while True:
        labels = ["/".join(p[-d:]) for p, d in zip(parts, depth, strict=True)]
        clash = [i for i, label in enumerate(labels) if depth[i] < len(parts[i])
                 and any(other == label and parts[j] != parts[i] for j, other in enumerate(labels))]
        if not clash:
            break
        for i in clash:
            depth[i] += 1
    # Only the same file given twice is still ambiguous here: number its repeats.
    return [label if labels[:i].count(label) == 0 else f"{label}#{labels[:i].count(label) + 1}"
            for i, label in enumerate(labels)]


def curve_of(records: dict[int, dict[str, Any]], metric: str) -> Curve:
    # Only numbers make a curve; anything else under the key counts as no value at that step.
    return {step: float(r[metric]) for step, r in records.items() if isinstance(r.get(metric), (int, float))}


def rel_diff(value: float, first: float) -> float:
    if value == first:  # also inf == inf, and 0 == 0, which has no relative scale
        return 0.0
    if first == 0:
        return math.copysign(math.inf, value)
    return (value - first) / abs(first)  # NaN in either stays NaN, which no tolerance accepts


def over(rel: float, rtol: float | None) -> bool:
    return rtol is not None and not abs(rel) <= rtol  # written so that NaN is over


def print_table(metric: str, labels: list[str], curves: list[Curve], rtol: float | None) -> None:
    width = max(12, *(len(label) for label in labels))
    dwidth = max(10, *(len(label) + 4 for label in labels[1:]))
    print(f"\n{metric} (relative difference to {labels[0]})")
    print(f"{'step':>6} " + " ".join(f"{label:>{width}}" for label in labels) + " "
          + " ".join(f"{label + ' rel':>{dwidth}}" for label in labels[1:]))
    first = curves[0]
    steps = sorted(set().union(*curves))
    if not steps:
        print("    (no run logged a value)")  # the key exists but is always null, e.g. mfu on CPU
    for step in steps:
        values = " ".join(f"{c[step]:>{width}.8g}" if step in c else f"{'-':>{width}}" for c in curves)
        rels = [rel_diff(c[step], first[step]) if step in c and step in first else None for c in curves[1:]]
        diffs = " ".join(f"{'-':>{dwidth}}" if r is None else f"{r:>+{dwidth}.2e}" for r in rels)
        flag = "  <-- above rtol" if any(r is not None and over(r, rtol) for r in rels) else ""
        print(f"{step:>6} {values} {diffs}{flag}")
    summary = []
    for label, curve in zip(labels[1:], curves[1:], strict=True):
        shared = first.keys() & curve.keys()
        worst = max((abs(rel_diff(curve[s], first[s])) for s in shared), default=None)
        summary.append(f"{label} no shared step" if worst is None else f"{label} {worst:.2e} ({len(shared)} steps)")
    print(f"max |relative difference| to {labels[0]}: " + ", ".join(summary))


def first_failure(metric: str, labels: list[str], curves: list[Curve], rtol: float) -> str | None:
    first = curves[0]
    for label, curve in zip(labels[1:], curves[1:], strict=True):
        if not first.keys() & curve.keys():  # comparing nothing must not pass a tolerance check
            return f"{metric}: {label} shares no step with {labels[0]}"
    for step in sorted(first):
        for label, curve in zip(labels[1:], curves[1:], strict=True):
            if step in curve and over(rel := rel_diff(curve[step], first[step]), rtol):
                return f"step {step}: {metric} of {label} differs from {labels[0]} by {rel:+.2e} (rtol {rtol:g})"
    return None


def draw(metrics: list[str], labels: list[str], curves: list[list[Curve]]):
    """One panel per metric with every run's whole curve; returns the matplotlib figure."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(metrics), 1, sharex=True, squeeze=False, figsize=(9, 1.5 + 2.5 * len(metrics)))
    for ax, metric, metric_curves in zip(axes[:, 0], metrics, curves, strict=True):
        for n, (label, curve) in enumerate(zip(labels, metric_curves, strict=True)):
            steps = sorted(curve)
            # Matching runs draw on top of each other: the line styles keep each visible, the markers a lone step.
            ax.plot(steps, [curve[s] for s in steps], ("-", "--", ":", "-.")[n % 4], marker=".", label=label)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend()
        # Steps are whole numbers; the default locator puts ticks at 1.5, 2.5, ... on short runs.
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0, 0].set_title(" vs ".join(labels))
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    return fig


def compare(args: argparse.Namespace) -> int:
    if args.plot is not None:  # checked first: no point reading the runs for a plot that cannot be drawn
        try:
            import matplotlib
        except ImportError:
            raise InputError("--plot needs matplotlib: pip install -e .[plot]") from None
        matplotlib.use("Agg")  # writes files only; no display needed
    files = [find_metrics_file(arg) for arg in args.runs]
    runs = [read_records(f) for f in files]
    labels = run_labels(files)
    metrics = list(dict.fromkeys(args.metric or ["loss"]))  # repeated --metric once
    recorded = {key for records in runs for r in records.values() for key in r} - {"step"}
    for metric in metrics:
        if metric not in recorded:
            raise InputError(f"unknown metric {metric!r}; the runs record: {', '.join(sorted(recorded))}")
    curves = [[curve_of(records, metric) for records in runs] for metric in metrics]
    for metric, metric_curves in zip(metrics, curves, strict=True):
        print_table(metric, labels, metric_curves, args.rtol)
    if args.plot is not None:
        fig = draw(metrics, labels, curves)
        try:
            fig.savefig(args.plot, dpi=100)
        except OSError as e:
            raise InputError(f"cannot write {args.plot}: {e}") from None
        finally:
            import matplotlib.pyplot as plt

            plt.close(fig)
        print(f"wrote {args.plot}")
    if args.rtol is not None:
        for metric, metric_curves in zip(metrics, curves, strict=True):
            if (failure := first_failure(metric, labels, metric_curves, args.rtol)) is not None:
                print(f"over rtol: {failure}", file=sys.stderr)
                return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folder or metrics.jsonl (the first: reference)")
    parser.add_argument("--metric", action="append", metavar="NAME", help="record key to compare (default loss)")
    parser.add_argument("--rtol", type=float, default=None, help="exit 1 above this relative difference to run 1")
    parser.add_argument("--plot", type=Path, default=None, help="write one panel per metric to this PNG")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give at least two runs to compare")
    try:
        return compare(args)
    except InputError as e:
        print(f"loss_compare: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
