"""Every parallel layout reproduces the 1-process run: loss, gradient norm, validation loss, every parameter.

The layouts run in persistent pools of forked gloo ranks (tests/integration/pool.py) through the trainer's own
build and step code; tolerances and the noise floor they come from are in docs/testing.md.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import mesh_shape, train_parity
from tests.integration.layouts import ALL_LAYOUTS, BLOCKS, FLOAT8_LAYOUTS, LORA, REFERENCES, STEPS, dp
from tests.integration.parity import (
    REFERENCE_TOLERANCE,
    TENSOR_TOLERANCE,
    TOLERANCE,
    compare,
    max_relative_differences,
    tensor_difference,
    tensor_differences,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(REFERENCES))
def test_reference_learns(name, reference):
    # A parity test against a run that does not train would prove nothing. The validation loss is measured on the
    # same 8 sequences after steps 2 and 3, so its fall is the training's doing (measured 2026-11-26: 0.009 to 0.035
    # for the references); the training loss of steps 1 and 3 comes from different batches, whose own difficulty
    # moves it by +-0.1 in these few steps.
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
    no_z = train_parity(pools, 1, (*REFERENCES["single_process_moe_global"].overrides, "--moe.router_z_loss_coeff",
                                   "0"), tmp_path)
    for other in (per_sequence, no_z):
        for got, ref in zip(global_batch["metrics"], other["metrics"], strict=True):
            assert abs(got["grad_norm"] - ref["grad_norm"]) > 100 * TOLERANCE["grad_norm"] * ref["grad_norm"], (
                got, ref)
    assert all(m["moe_z_loss"] > 0 for m in global_batch["metrics"])
    assert all("moe_z_loss" not in m for m in no_z["metrics"])


# By world size, then mesh shape: one multi-rank pool lives at a time, so each size starts once, and a pool serves a
# few shapes before it is replaced (tests/integration/pool.py), so each shape's layouts run in one pool.
@pytest.mark.parametrize("layout", sorted(ALL_LAYOUTS, key=lambda layout: (layout.nproc, mesh_shape(layout.overrides))),
                         ids=lambda layout: layout.name)
def test_layout_matches_single_process(layout, reference, pools, tmp_path):
    run = train_parity(pools, layout.nproc, layout.overrides, tmp_path)
    assert [m.get("val_loss") is not None for m in run["metrics"]] == [True] * STEPS
    problems = compare(run, reference(layout.reference), REFERENCE_TOLERANCE.get(layout.reference, TOLERANCE),
                       tensors=TENSOR_TOLERANCE.get(layout.reference))
    assert not problems, f"{layout.name} differs from {layout.reference}:\n" + "\n".join(problems[:10])
    # Every block traces to one graph, so one compile serves them all (the first block once recompiled for its
    # input's AsyncCollectiveTensor, doubling compile time: torchtitan/distributed/tensor_parallel.py).
    assert run.get("compiled_graphs", 1) == 1, run["compiled_graphs"]


def test_noise_floor_is_far_below_the_tolerance(reference, pools, tmp_path):
    """The same 1-process run with 4 micro-batches of 2 instead of 1 of 8: mathematically equal, summed in another
    order. Its differences are the noise floor the tolerances were derived from (docs/testing.md); if they ever
    grow to within 10x of a tolerance, the tolerances must be derived again."""
    reordered = train_parity(pools, 1, dp(2, 1), tmp_path)
    floor = max_relative_differences(reordered, reference("single_process"))
    for key, value in floor.items():
        assert value * 10 <= TOLERANCE[key], (key, value, TOLERANCE[key], floor)
    # Per tensor, where the tolerances were derived at 10x the worst of floor and layouts, a margin of 3x: another
    # CPU may sum in another order (tests/integration/data/tensor_tolerances.json).
    tensors = TENSOR_TOLERANCE["single_process"]
    for (of, name), value in tensor_differences(reordered, reference("single_process")).items():
        assert value * 3 <= tensors[of][name], (of, name, value, tensors[of][name])


def test_validation_leaves_training_untouched(reference, pools, tmp_path):
    """Regression: a validation forward (no_grad) left FSDP's unresharded parameters gathered, and the next
    training step computed no gradient for them (grad norm 0.65 instead of 2.74 after step 5)."""
    no_validation = train_parity(pools, 1, (*dp(8, 1), "--validation.enable", "false"), tmp_path)
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
    run = train_parity(pools, nproc, args, tmp_path, faults=(("average_gradients",),))
    problems = compare(run, reference(reference_name))
    assert any("grad_norm" in p for p in problems), problems[:5]
    # Averaging over 2 ranks halves every gradient: the norm is off by a factor of 2 from the first step.
    first = run["metrics"][0]["grad_norm"] / reference(reference_name)["metrics"][0]["grad_norm"]
    assert abs(first - 0.5) < 1e-3, first


# ---- the harness's own detection power: planted bugs it must see, tensor by tensor ------------------------------

_NORMS = [*(f"layers.{i}.{kind}.weight" for i in range(BLOCKS) for kind in ("attention_norm", "ffn_norm")),
          "norm.weight"]
_PROJECTION = "layers.1.attention.wq.weight"


@pytest.mark.parametrize("norm_factor", [2.0, 0.5])
@pytest.mark.parametrize(("case", "nproc", "args"), [
    ("one_process", 1, dp(4, 1)),
    ("fsdp2_tp2", 4, (*dp(2, 2), "--parallelism.tensor_parallel_degree", "2")),
], ids=["one_process", "fsdp2_tp2"])
def test_the_harness_sees_one_wrong_gradient(case, nproc, args, norm_factor, reference, pools, tmp_path):
    """A constant-factor error on one small tensor's gradient (what a wrong reduction of a replicated parameter under
    TP, SP, FSDP, CP or EP gives) hides from the loss, the total gradient norm and whole-tensor parameter sums: AdamW
    barely changes its update, and a norm weight hardly moves the total. Every RMSNorm weight's gradient is scaled
    by `norm_factor` and one attention projection's by its inverse, all in one run: the gradients of step 1 come
    from the initial weights, so each mutated tensor's comparison is independent of the others there, and every
    one of them must fail on its own while no other tensor does."""
    factors = {**dict.fromkeys(_NORMS, norm_factor), _PROJECTION: 1 / norm_factor}
    run = train_parity(pools, nproc, args, tmp_path, faults=(("scale_gradients", factors),))
    ref = reference("single_process")
    flagged = {line.split(" ")[2] for line in compare(run, ref) if line.startswith("step 1:") and "gradient" in line}
    assert flagged == set(factors), sorted(flagged ^ set(factors))
    for step, (got, want) in enumerate(zip(run["grads"], ref["grads"], strict=True), start=1):
        for name, factor in factors.items():
            for copy in got[name]:
                rel = tensor_difference(copy, want[name][0])
                assert rel > 100 * TOLERANCE["grad"], (step, name, rel)
                if step == 1:  # the same weights, the gradient off by exactly the factor
                    assert rel == pytest.approx(abs(factor - 1), rel=1e-4), (name, rel)


def test_float8_scales_come_from_the_whole_tensor(pools, tmp_path):
    """Under TP each rank holds part of every weight and of the row-parallel layers' inputs: a float8 scale from
    this rank's part alone (the amax not reduced over the tp mesh) quantizes differently on each rank. With scales
    rounded to powers of 2 (the parity layouts) a rank's own amax mostly rounds to the same scale and the bug
    hides, so this runs torchao's unrounded tensorwise scales: TP 2 then matches its 1-process run in loss and
    gradient norm within the float32 tolerances (7e-8 and 4e-8 measured), and with the bug it must not."""
    (layout,) = [layout for layout in FLOAT8_LAYOUTS if layout.name == "float8_tp2"]

    def unrounded(args: tuple[str, ...]) -> tuple[str, ...]:
        return (*args, "--float8.round_scales_to_power_of_2", "false")

    ref = train_parity(pools, 1, unrounded(REFERENCES["single_process_float8"].overrides), tmp_path / "ref")
    runs = {fault: train_parity(pools, layout.nproc, unrounded(layout.overrides), tmp_path / str(fault),
                                faults=((fault,),) if fault else ()) for fault in (None, "local_float8_amax")}
    metric_problems = {fault: [line for line in compare(run, ref) if line.split(": ")[1].split()[0] in TOLERANCE]
                       for fault, run in runs.items()}
    assert metric_problems[None] == [], metric_problems[None][:5]
    assert any(line.startswith("step 1: ") for line in metric_problems["local_float8_amax"]), \
        metric_problems["local_float8_amax"][:5]


def test_the_harness_sees_values_in_the_wrong_place(reference, pools, tmp_path):
    """One weight's values rolled by one place after step 2: its norm and its whole-tensor sums stay equal, the
    position-dependent fingerprint (random projections) must not."""
    run = train_parity(pools, 1, dp(4, 1), tmp_path, faults=(("misplace_values", _PROJECTION, 2),))
    ref = reference("single_process")
    problems = compare(run, ref)
    assert any(line.startswith(f"step 2: {_PROJECTION} values") for line in problems), problems[:5]
    assert not any(line.startswith("step 1:") for line in problems), problems[:5]
    norm_then, norm_ref = run["params"][1][_PROJECTION][0][0], ref["params"][1][_PROJECTION][0][0]
    assert abs(norm_then - norm_ref) <= TOLERANCE["param"] * norm_ref


def test_the_harness_sees_a_wrong_optimizer_state(reference, pools, tmp_path):
    """Under FSDP 2 one rank's shard of one tensor's first moment doubled after the last update: the parameters were
    updated before it, so only the comparison of AdamW's state after the last step can see it, and must flag exactly
    that tensor's moment."""
    run = train_parity(pools, 2, dp(2, 2), tmp_path, faults=(("scale_moment", _PROJECTION, "exp_avg", 2.0, STEPS, 1),))
    problems = compare(run, reference("single_process"), tensors=TENSOR_TOLERANCE["single_process"])
    assert [line.split(" off by")[0] for line in problems] == [f"after step {STEPS}: {_PROJECTION} exp_avg"], \
        problems[:5]


# Under TP the row-wise layers' B (wo, w2) is replicated and each rank computes a partial sum of its gradient (over
# its shard of the hidden units), which a hook sums over tp; the column-wise layers' A likewise.
_ROW_WISE_B = {f"layers.{i}.{module}.lora_b" for i in range(BLOCKS) for module in ("attention.wo", "feed_forward.w2")}
_NORM = "layers.1.ffn_norm.weight"


def test_the_harness_sees_lora_bugs_under_tp(reference, pools, tmp_path):
    """Two planted LoRA bugs on TP 2, in one run (each one's symptoms are its own): a replicated adapter's partial
    gradient taken as whole, where exactly the row-wise layers' B gradients must be off at step 1 (A's gradient is
    zero there since B starts at zero, and nothing else has changed yet); and a norm left trainable, which the
    harness must report as trainable in only one run and with a gradient at every step."""
    run = train_parity(pools, 2, (*dp(8, 1), "--parallelism.tensor_parallel_degree", "2", *LORA), tmp_path,
                       faults=(("partial_adapter_grads",), ("unfreeze", _NORM)))
    problems = compare(run, reference("single_process_lora"), tensors=TENSOR_TOLERANCE["single_process_lora"])
    flagged = {line.split(" ")[2] for line in problems if line.startswith("step 1:") and "gradient norm" in line}
    assert flagged == _ROW_WISE_B, sorted(flagged ^ _ROW_WISE_B)
    assert f"frozen in only one of the runs: ['{_NORM}']" in problems, problems[:5]
    for step in range(1, STEPS + 1):
        assert f"step {step}: frozen parameters have gradients: ['{_NORM}']" in problems, problems[:5]
