"""Every parallel layout reproduces the 1-process run: loss, gradient norm, validation loss, every parameter.

The layouts run in persistent pools of forked gloo ranks (tests/integration/pool.py) through the trainer's own
build and step code; tolerances and the noise floor they come from are in docs/testing.md.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import train_layout
from tests.integration.layouts import ALL_LAYOUTS, REFERENCES, dp
from tests.integration.parity import TOLERANCE, compare, max_relative_differences

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(REFERENCES))
def test_reference_learns(name, reference):
    # A parity test against a run that does not train would prove nothing. The validation loss is measured on the
    # same 8 sequences after steps 3 and 6, so its fall is the training's doing; the training loss of steps 1 and 6
    # comes from different batches, whose own difficulty moves it by +-0.1 in these few steps.
    val = [m["val_loss"] for m in reference(name)["metrics"] if m.get("val_loss") is not None]
    assert len(val) == 2 and val[1] < val[0] - 1e-3, val


def test_document_masking_changes_training(reference):
    """The block-causal reference is not the causal one under another name: its rows pack several documents, and
    masking them changes every step's gradient norm by far more than its parity tolerance (measured 1.9e-3 relative
    to 2.9e-3), so a layout that lost the masks fails. The loss moves less in these first steps of a freshly
    initialised model (1.6e-5 to 3.8e-4 relative: its attention is still nearly uniform)."""
    causal, block = reference("single_process_short_documents"), reference("single_process_block_causal")
    for got, ref in zip(block["metrics"], causal["metrics"], strict=True):
        assert abs(got["grad_norm"] - ref["grad_norm"]) > 100 * TOLERANCE["grad_norm"] * ref["grad_norm"], (got, ref)
        assert got["loss"] != ref["loss"], (got, ref)


def test_moe_balance_loss_changes_training(reference):
    """The balance-loss reference differs from the plain MoE one at every step by far more than the tolerance, so
    its layouts test the loss's gradient (and its metric is reported)."""
    plain, aux = reference("single_process_moe"), reference("single_process_moe_aux")
    for got, ref in zip(aux["metrics"], plain["metrics"], strict=True):
        assert abs(got["grad_norm"] - ref["grad_norm"]) > 100 * TOLERANCE["grad_norm"] * ref["grad_norm"], (got, ref)
        assert got["moe_aux_loss"] > 0 and "moe_aux_loss" not in ref and ref["moe_load_max_over_mean"] >= 1


def test_global_batch_scope_and_z_loss_change_training(reference, pools, tmp_path):
    """The global-batch reference (balance loss over all 8 sequences at once, plus the router z-loss) differs from
    the sequence-scope one, and from itself without the z-loss, at every step by far more than the tolerance: its
    layouts test the counts' reduction over the data ranks and the z-loss's gradient."""
    per_sequence, global_batch = reference("single_process_moe_aux"), reference("single_process_moe_global")
    no_z = train_layout(pools, 1, (*REFERENCES["single_process_moe_global"].overrides, "--moe.router_z_loss_coeff",
                                   "0"), tmp_path)
    for other in (per_sequence, no_z):
        for got, ref in zip(global_batch["metrics"], other["metrics"], strict=True):
            assert abs(got["grad_norm"] - ref["grad_norm"]) > 100 * TOLERANCE["grad_norm"] * ref["grad_norm"], (
                got, ref)
    assert all(m["moe_z_loss"] > 0 for m in global_batch["metrics"])
    assert all("moe_z_loss" not in m for m in no_z["metrics"])


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda layout: layout.name)
def test_layout_matches_single_process(layout, reference, pools, tmp_path):
    run = train_layout(pools, layout.nproc, layout.overrides, tmp_path)
    assert [m.get("val_loss") is not None for m in run["metrics"]] == [False, False, True, False, False, True]
    problems = compare(run, reference(layout.reference))
    assert not problems, f"{layout.name} differs from {layout.reference}:\n" + "\n".join(problems[:10])


def test_noise_floor_is_far_below_the_tolerance(reference, pools, tmp_path):
    """The same 1-process run with 4 micro-batches of 2 instead of 1 of 8: mathematically equal, summed in another
    order. Its differences are the noise floor the tolerances were derived from (docs/testing.md); if they ever
    grow to within 10x of a tolerance, the tolerances must be derived again."""
    reordered = train_layout(pools, 1, dp(2, 1), tmp_path)
    floor = max_relative_differences(reordered, reference("single_process"))
    for key, value in floor.items():
        assert value * 10 <= TOLERANCE[key], (key, value, TOLERANCE[key], floor)


def test_validation_leaves_training_untouched(reference, pools, tmp_path):
    """Regression: a validation forward (no_grad) left FSDP's unresharded parameters gathered, and the next
    training step computed no gradient for them (grad norm 0.65 instead of 2.74 after step 5)."""
    no_validation = train_layout(pools, 1, (*dp(8, 1), "--validation.enable", "false"), tmp_path)
    with_validation = reference("single_process")
    for got, ref in zip(no_validation["metrics"], with_validation["metrics"], strict=True):
        assert (got["loss"], got["grad_norm"]) == (ref["loss"], ref["grad_norm"]), (got, ref)
    assert no_validation["params"] == with_validation["params"]


@pytest.mark.parametrize(("case", "nproc", "args", "reference_name"), [
    ("fsdp_clip_on", 2, dp(2, 2), "single_process"),
    ("fsdp_clip_off", 2, (*dp(2, 2), "--training.max_norm", "0"), "single_process_no_clip"),
    ("ddp_clip_on", 2, (*dp(2, 2), "--parallelism.data_parallel_replicate_degree", "2",
                        "--parallelism.data_parallel_shard_degree", "1"), "single_process"),
])
def test_the_suite_catches_averaged_gradients(case, nproc, args, reference_name, reference, pools, tmp_path):
    """The deliberate mutation the suite must fail on: data parallelism averaging gradients on top of the
    global-token normalisation. Under AdamW the loss barely moves (the update is nearly scale-free, and with
    clipping on every clipped step is identical), so it is the gradient norm that must expose it."""
    run = train_layout(pools, nproc, args, tmp_path, faults=(("average_gradients",),))
    problems = compare(run, reference(reference_name))
    assert any("grad_norm" in p for p in problems), problems[:5]
    # Averaging over 2 ranks halves every gradient: the norm is off by a factor of 2 from the first step.
    first = run["metrics"][0]["grad_norm"] / reference(reference_name)["metrics"][0]["grad_norm"]
    assert abs(first - 0.5) < 1e-3, first
