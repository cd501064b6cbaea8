"""Compare the per-step loss of two runs from their metrics.jsonl files.

    python scripts/loss_compare.py outputs/a/metrics.jsonl outputs/b/metrics.jsonl [--rtol 1e-5] [--plot out.png]

Prints both curves side by side with the relative difference; exits 1 if any common step differs by more
than --rtol, 2 if the runs share no step. --plot writes both curves and the relative difference to a PNG
(needs matplotlib: pip install -e .[plot]).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_losses(path: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not JSON: {e}") from None
        if "loss" in record and record["loss"] is not None:
            out[int(record["step"])] = float(record["loss"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", type=Path, help="metrics.jsonl of the reference run")
    parser.add_argument("candidate", type=Path, help="metrics.jsonl of the run to check")
    parser.add_argument("--rtol", type=float, default=1e-5, help="largest allowed relative loss difference")
    parser.add_argument("--plot", type=Path, default=None, help="write the curves and their difference to this PNG")
    args = parser.parse_args(argv)
    base, cand = read_losses(args.baseline), read_losses(args.candidate)
    steps = sorted(set(base) & set(cand))
    if not steps:
        print("the two runs have no logged step in common", file=sys.stderr)
        return 2
    worst = 0.0
    print(f"{'step':>6} {'baseline':>12} {'candidate':>12} {'rel diff':>10}")
    for step in steps:
        rel = abs(cand[step] - base[step]) / max(abs(base[step]), 1e-12)
        worst = max(worst, rel)
        flag = "  <-- above rtol" if rel > args.rtol else ""
        print(f"{step:>6} {base[step]:>12.6f} {cand[step]:>12.6f} {rel:>10.2e}{flag}")
    print(f"max relative difference {worst:.2e} over {len(steps)} steps (rtol {args.rtol:.0e})")
    if args.plot is not None:
        plot(args.plot, steps, base, cand, args)
    return 0 if worst <= args.rtol else 1


def plot(path: Path, steps: list[int], base: dict[int, float], cand: dict[int, float], args) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e .[plot]") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=(3, 1))
    top.plot(steps, [base[s] for s in steps], label=f"baseline ({args.baseline.parent.name})")
    top.plot(steps, [cand[s] for s in steps], "--", label=f"candidate ({args.candidate.parent.name})")
    top.set_ylabel("loss")
    top.legend()
    rel = [abs(cand[s] - base[s]) / max(abs(base[s]), 1e-12) for s in steps]
    bottom.semilogy(steps, [max(r, 1e-12) for r in rel])
    bottom.axhline(args.rtol, color="red", linestyle=":", label=f"rtol {args.rtol:.0e}")
    bottom.set_xlabel("step")
    bottom.set_ylabel("relative difference")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
