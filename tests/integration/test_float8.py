"""Float8 training (torchao, `model.converters = ["float8"]`) across checkpoints and over a longer run, in the rank
pools through the trainer's own code.

Float8 keeps parameters, gradients, optimizer state and checkpoints in high precision under the Linear layers'
own names, so a checkpoint must not care whether the run that wrote it or the one that reads it used float8:
- a float8 run resumed with float8 continues its uninterrupted curve bitwise, on one process and on FSDP 2 with
  float8 weight all-gathers and precomputed scales (the straight run's step after the save uses the scales
  precomputed after the step before; the resumed one those precomputed from the loaded weights: they must be
  equal, with torchao's scales and with scales rounded to powers of 2);
- a float8 checkpoint (of one process, or of FSDP 2 with the float8 all-gather's wrapped weights) resumed without
  float8 loads (same names) and continues close to the float8 curve, and a plain checkpoint resumed with float8 on
  FSDP 2 continues close to the plain curve. Not bitwise: the matmuls change precision. The bound is measured, and
  far below what a checkpoint missing any part of its state shows.
Then float8 must learn: over 100 steps its loss curve stays within a measured bound of fp32's on the same data
(CPU trains in fp32, so fp32 is the high-precision reference) while the loss falls by more than a nat.

The debug model's layers are below torchao's size thresholds: `float8.skip_small_layers false` converts them
anyway (the 7 Linear layers of every block; the output projection stays in fp32).
"""

from __future__ import annotations

import shutil

import pytest

from tests.integration.conftest import mesh_shape, train_layout
from tests.integration.layouts import COMMON, dp
from tests.integration.parity import assert_continues_bitwise, from_step, run_layout

pytestmark = pytest.mark.slow

FLOAT8 = ("--model.converters", "float8", "--float8.skip_small_layers", "false")
FLOAT8_ALL_GATHER = ("--float8.enable_fsdp_float8_all_gather", "true",
                     "--float8.precompute_float8_dynamic_scale_for_fsdp", "true")
ONE_PROCESS = dp(8, 1)
FSDP2 = dp(4, 2)  # no accumulation: each rank's micro-batch is 4 rows

# The schedule of tests/integration/test_checkpoint_resume.py: a straight run of STEPS steps saves at SAVED and at
# the end; a resumed run trains steps SAVED + 1 .. STEPS (the first shows the weights and data position, the second
# the optimizer state), at LR factors a restarted schedule would not give them.
STEPS, SAVED = 6, 3
CKPT = ("--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", str(SAVED),
        "--checkpoint.keep_latest_k", "0", "--lr_scheduler.min_lr_factor", "0.1")

# Relative gap of a resumed step's loss (and validation loss) between a run that changed precision at the resume
# and the curve of the precision it left. Measured 2026-11-26: 6.4e-6 (1-process float8 checkpoint resumed without
# float8), 3.3e-6 (FSDP 2 float8 all-gather checkpoint resumed on one process without float8) and 9.5e-6 (plain
# checkpoint resumed with float8 on FSDP 2). The 1-process resume without float8 but with one part of the
# checkpoint left out (checkpoint.exclude_from_loading) is off by 7.2e-4 (lr_scheduler), 1.0e-3 (optimizer),
# 3.2e-3 (model), 1.4e-2 (dataloader). 5e-5 sits between both: 5x above the largest gap, 14x below the smallest
# miss.
CROSS_PRECISION_RESUME = 5e-5


def _resume_from(source, step: int, dest) -> None:
    """A fresh run folder holding only `source`'s checkpoint at `step`."""
    (dest / "checkpoint").mkdir(parents=True)
    shutil.copytree(source / "checkpoint" / f"step-{step}", dest / "checkpoint" / f"step-{step}")


def _losses(run: dict) -> list[float]:
    return [m["loss"] for m in run["metrics"]]


def _resume_gaps(resumed: dict, straight: dict) -> dict[str, float]:
    """The largest relative gap of loss and validation loss over the resumed steps."""
    assert [m["step"] for m in resumed["metrics"]] == list(range(SAVED + 1, STEPS + 1)), "must resume after SAVED"
    gaps = dict.fromkeys(("loss", "val_loss"), 0.0)
    for got, ref in zip(resumed["metrics"], from_step(straight, SAVED + 1)["metrics"], strict=True):
        for key in gaps:
            assert (key in got) == (key in ref), (got, ref)
            if key in ref:
                gaps[key] = max(gaps[key], abs(got[key] - ref[key]) / abs(ref[key]))
    return gaps


@pytest.fixture(scope="module")
def float8_one_process(pools, tmp_path_factory):
    out = tmp_path_factory.mktemp("float8")
    return out, train_layout(pools, 1, (*CKPT, *ONE_PROCESS, *FLOAT8), out)


@pytest.fixture(scope="module")
def plain_one_process(pools, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    return out, train_layout(pools, 1, (*CKPT, *ONE_PROCESS), out)


def test_float8_changes_the_curve(float8_one_process, plain_one_process):
    # Every other test here would pass if float8 silently converted nothing. (Step 1 may agree: at init the blocks
    # add ~1% to the residual stream, and the float8 rounding of that moved the fp32 loss by less than its last bit.)
    float8, plain = _losses(float8_one_process[1]), _losses(plain_one_process[1])
    assert all(f != p for f, p in zip(float8[1:], plain[1:], strict=True)), (float8, plain)


def test_float8_resume_continues_the_float8_curve_bitwise(float8_one_process, pools, tmp_path):
    folder, straight = float8_one_process
    _resume_from(folder, SAVED, tmp_path)
    assert_continues_bitwise(train_layout(pools, 1, (*CKPT, *ONE_PROCESS, *FLOAT8), tmp_path), straight, SAVED,
                             STEPS)


def test_float8_checkpoint_resumes_without_float8_near_the_float8_curve(float8_one_process, pools, tmp_path):
    folder, straight = float8_one_process
    _resume_from(folder, SAVED, tmp_path)
    # DCP refuses a checkpoint that lacks any key the loading model asks for: float8 names that differed from
    # nn.Linear's would fail here.
    resumed = train_layout(pools, 1, (*CKPT, *ONE_PROCESS), tmp_path)
    gaps = _resume_gaps(resumed, straight)
    assert max(gaps.values()) <= CROSS_PRECISION_RESUME, gaps


def test_plain_checkpoint_resumes_with_float8_on_fsdp2_near_the_plain_curve(plain_one_process, pools, tmp_path):
    folder, straight = plain_one_process
    _resume_from(folder, SAVED, tmp_path)
    resumed = train_layout(pools, 2, (*CKPT, *FSDP2, *FLOAT8, *FLOAT8_ALL_GATHER), tmp_path)
    gaps = _resume_gaps(resumed, straight)
    assert max(gaps.values()) <= CROSS_PRECISION_RESUME, gaps


@pytest.fixture(scope="module")
def float8_fsdp2(pools, tmp_path_factory):
    """The straight FSDP 2 runs with float8 all-gathers and precomputed scales, per scale rounding (extra args),
    each trained once when first asked for."""
    cache: dict[tuple[str, ...], tuple] = {}

    def get(rounding: tuple[str, ...]) -> tuple:
        if rounding not in cache:
            out = tmp_path_factory.mktemp("float8_fsdp2")
            cache[rounding] = out, train_layout(pools, 2, (*CKPT, *FSDP2, *FLOAT8, *FLOAT8_ALL_GATHER, *rounding), out)
        return cache[rounding]

    return get


TORCHAO_SCALES = ()
POWER_OF_2_SCALES = ("--float8.round_scales_to_power_of_2", "true")


# torchao's own scales, and scales rounded down to powers of 2 (the parity layouts' setting), where the trainer
# rounds the precomputed ones itself: torchao's all-gather does not round a scale it computes, so a resumed first
# step without scales precomputed from the loaded weights quantizes them differently from the straight run's step
# (seen 2026-11-26: with the trainer's precompute before its first step skipped, step 4's loss differs).
@pytest.mark.parametrize("rounding", [TORCHAO_SCALES, POWER_OF_2_SCALES], ids=["torchao_scales", "power_of_2_scales"])
def test_float8_all_gather_resume_on_fsdp2_is_bitwise_identical(rounding, float8_fsdp2, pools, tmp_path):
    # Against its own FSDP 2 straight run, not the 1-process one: float8 scales each micro-batch's activations by
    # its own amax, so 4 rows per rank do not compute what 8 rows on one process do (measured 2026-11-26: step 1's
    # gradients 1.9e-2 apart, exactly as a 1-process run with micro-batches of 4 is).
    folder, straight = float8_fsdp2(rounding)
    _resume_from(folder, SAVED, tmp_path)
    resumed = train_layout(pools, 2, (*CKPT, *FSDP2, *FLOAT8, *FLOAT8_ALL_GATHER, *rounding), tmp_path)
    assert_continues_bitwise(resumed, straight, SAVED, STEPS)


def test_float8_all_gather_checkpoint_resumes_on_one_process_without_float8(float8_fsdp2, pools, tmp_path):
    # With the float8 all-gather, FSDP's shards are torchao's weight wrappers (a tensor subclass): what they save
    # must still be a plain checkpoint under nn.Linear's names, which a run without float8 nor FSDP loads.
    folder, straight = float8_fsdp2(TORCHAO_SCALES)
    _resume_from(folder, SAVED, tmp_path)
    resumed = train_layout(pools, 1, (*CKPT, *ONE_PROCESS), tmp_path)
    gaps = _resume_gaps(resumed, straight)
    assert max(gaps.values()) <= CROSS_PRECISION_RESUME, gaps


# LEARN_STEPS steps of 8 sequences of 32 tokens, LR 3e-3 and clipping at 1 (COMMON's 0.2 binds at every step and slows
# learning): about 10 s with float8 and 3 s without on the 2-core machine, measured 2026-11-26. No validation: the
# curve compared is the training loss, on the same batches in both runs.
LEARN_STEPS = 100
LEARN = ("--training.steps", str(LEARN_STEPS), "--training.seq_len", "32", "--training.global_batch_size", "8",
         "--training.local_batch_size", "8", "--optimizer.lr", "3e-3", "--training.max_norm", "1",
         "--validation.enable", "false")
# Largest relative gap between the float8 and the fp32 loss at any step. Measured 2026-11-26: 1.54e-3 (at step 75;
# ~1e-5 over the first steps, a few 1e-4 later, peaks of 1e-3). Other settings gave 1.07e-3 to 3.9e-3 (120 steps:
# seq 32 1.87e-3, seq 64 2.97e-3, 4 sequences of 64 3.93e-3, seq 64 at LR 8e-4 and clip 0.2 1.07e-3). Bound: 2.6x
# the measured gap of this setting.
FLOAT8_VS_FP32 = 4e-3
# The float8 loss falls from 6.67 at step 1 to a mean of 5.24 over the last 10 steps (measured 2026-11-26).
MIN_LEARNED = 1.0


def _train_metrics_only(pools, args, folder) -> dict:
    """Train `args` (on top of COMMON) on one process without the per-step tensor fingerprints: only the logged
    metrics of the long run are compared."""
    return pools.get(1, mesh_shape(args)).run(run_layout, [*COMMON, *args], str(folder), (), "success", False,
                                              timeout=180)[0]


def test_float8_learns_within_a_measured_bound_of_fp32(pools, tmp_path):
    float8 = _losses(_train_metrics_only(pools, (*LEARN, *FLOAT8), tmp_path / "float8"))
    fp32 = _losses(_train_metrics_only(pools, LEARN, tmp_path / "fp32"))
    assert len(float8) == len(fp32) == LEARN_STEPS
    gaps = [abs(f - p) / p for f, p in zip(float8, fp32, strict=True)]
    worst = max(gaps)
    print(f"float8 vs fp32: largest relative loss gap {worst:.3e} at step {gaps.index(worst) + 1}; loss "
          f"{float8[0]:.4f} -> {sum(float8[-10:]) / 10:.4f} (mean of the last 10 steps)")
    assert worst > 0, "float8 changed nothing: no layer converted?"
    assert worst <= FLOAT8_VS_FP32, (worst, gaps.index(worst) + 1)
    learned = float8[0] - sum(float8[-10:]) / 10
    assert learned >= MIN_LEARNED, (float8[0], float8[-10:])
