"""Does GRPO raise the reward? SFT then GRPO on the synthetic arithmetic task over several seeds, on CPU (docs/rl.md,
"Does it learn? The measured reward curve"; the recipe is tests/unit/rl_learning.py's, which
tests/unit/test_rl_learns.py runs for seed 0).

    python scripts/rl_learning_study.py --seeds 0 1 2 3 4 5 [--fsdp] [--sft-seed 0] [--flip-advantages]
        [--json out.json] [-- overrides for every GRPO run, e.g. --optimizer.lr 1e-9]

Per seed: the SFT stage (torchtitan/train.py's Trainer, one process) with --debug.seed <seed> and its own data,
then GRPO from its checkpoint with the same seed, one process (and, with --fsdp, on 2 gloo ranks, FSDP 2). Prints
per seed the SFT stage's last loss and the accuracy of the SFT policy's samples (GRPO's step 1, before its
update), the mean reward over the first and the last 5 GRPO steps, their difference, the mean response length
(about 3 tokens for a bare answer, 6 for "#### 7"), the FSDP run's gain and how many of its steps' rewards equal the
one-process run's exactly; then the mean and standard deviation of each over the seeds, and the first seed's
per-step curve. --sft-seed N fine-tunes once, with seed N, and varies only GRPO's seed. --flip-advantages negates
every advantage (a planted bug: the reward should fall).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

from tests.unit import rl_learning as recipe  # noqa: E402
from tests.unit.forked import run_ranks  # noqa: E402
from torchtitan.tools import startup_gc  # noqa: E402


def flipped_grpo_rank(rank: int, argv: list[str]) -> list[dict]:
    """grpo_rank with every advantage negated: the policy is pushed away from rewarded answers."""
    import torchtitan.rl.loop as loop

    original = loop.group_advantages
    loop.group_advantages = lambda rewards, std_normalize: -original(rewards, std_normalize)
    return recipe.grpo_rank(rank, argv)


def sft(folder: Path, seed: int) -> tuple[Path, float]:
    """The SFT checkpoint's step folder, and the last logged training loss (on the replies and EOS)."""
    metrics = run_ranks(recipe.sft_rank, recipe.sft_args(folder, seed), world=1, timeout=900)[0]
    return folder / "sft" / "checkpoint" / f"step-{recipe.SFT_STEPS}", metrics[-1]["loss"]


def grpo(checkpoint: Path, dump: Path, seed: int, world: int, flip: bool, overrides: list[str]) -> list[dict]:
    rank_fn = flipped_grpo_rank if flip else recipe.grpo_rank
    return run_ranks(rank_fn, recipe.grpo_args(checkpoint, dump, seed) + overrides, world=world, timeout=900)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--fsdp", action="store_true", help="also run each GRPO stage on 2 ranks (FSDP 2)")
    parser.add_argument("--sft-seed", type=int, default=None, help="one SFT run with this seed for every GRPO seed")
    parser.add_argument("--flip-advantages", action="store_true", help="planted bug: negate the advantages")
    parser.add_argument("--json", default="", help="write every run's per-step metrics here")
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    opts = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    rows, runs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        shared = sft(Path(tmp) / "sft_shared", opts.sft_seed) if opts.sft_seed is not None else None
        for seed in opts.seeds:
            checkpoint, sft_loss = shared or sft(Path(tmp) / f"sft{seed}", seed)
            one = grpo(checkpoint, Path(tmp) / f"grpo{seed}", seed, 1, opts.flip_advantages, overrides)
            start, end = recipe.start_end(one)
            len_start, len_end = recipe.start_end(one, "response_len")
            # Step 1 samples from the SFT policy itself (its update comes after): the fine-tuned model's accuracy.
            row = {"seed": seed, "sft_loss": sft_loss, "sft_acc": one[0]["accuracy"], "start": start, "end": end,
                   "gain": end - start, "len_start": len_start, "len_end": len_end}
            runs[seed] = {"one_process": one}
            if opts.fsdp:
                two = grpo(checkpoint, Path(tmp) / f"grpo{seed}_fsdp", seed, 2, opts.flip_advantages,
                           overrides)
                fsdp_start, fsdp_end = recipe.start_end(two)
                same = next((i for i, (a, b) in enumerate(zip(one, two, strict=True))
                             if a["reward_mean"] != b["reward_mean"]), len(one))
                row.update(fsdp_gain=fsdp_end - fsdp_start, fsdp_same_steps=same)
                runs[seed]["fsdp2"] = two
            rows.append(row)
            print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
            if opts.json:  # after every seed: a study cut short keeps what it finished
                Path(opts.json).write_text(json.dumps({"summary": rows, "runs": runs}, indent=1))

    keys = [k for k in rows[0] if k != "seed"]
    print(f"\nGRPO {recipe.GRPO_STEPS} steps; start/end: mean reward over the first/last {recipe.WINDOW} steps")
    print("| seed | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for row in rows:
        print(f"| {row['seed']} | " + " | ".join(f"{row[k]:.3f}" if isinstance(row[k], float) else str(row[k])
                                                 for k in keys) + " |")
    if len(rows) > 1:
        for name, agg in (("mean", statistics.fmean), ("std", statistics.stdev)):
            print(f"| {name} | " + " | ".join(f"{agg([r[k] for r in rows]):.3f}" for k in keys) + " |")
        print(f"smallest gain {min(r['gain'] for r in rows):.3f}")
    first = runs[rows[0]["seed"]]["one_process"]
    print(f"\nseed {rows[0]['seed']}, per step: reward_mean accuracy response_len groups_dropped")
    for m in first:
        print(f"{m['step']:3d} {m['reward_mean']:.3f} {m['accuracy']:.3f} {m['response_len']:.2f} "
              f"{m['groups_dropped']}")


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    main()
