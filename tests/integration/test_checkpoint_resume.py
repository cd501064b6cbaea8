"""Checkpoints: exact and resharded resume and extending a finished run (in the rank pools, through the trainer's
own code), async saves with a Hugging Face export, and kill -9 / SIGTERM through run_train.sh."""

from __future__ import annotations

import datetime
import json
import os
import random
import shutil
import signal
import time

import pytest

from tests.integration.conftest import setup_error, train_layout
from tests.integration.launch import REPO, complete_steps, kill_tree, run_train, start_train
from tests.integration.layouts import COMMON, FOUR_BLOCKS, dp
from tests.integration.parity import assert_continues_bitwise, compare, from_step, run_layout

pytestmark = pytest.mark.slow

# Every resume test: a straight run of STEPS steps saves at SAVED and at the end; a run resumed from SAVED trains
# the STEPS - SAVED = 2 steps after it: the first resumed step shows the weights and the data position, the second
# the optimizer state (the first one's update), and AdamW's moments after the last step are compared directly
# (tests/integration/parity.py). A run that changes layout in between saves at MID too (AND_MID): the run that
# resumes from it trains step MID + 1, whose update and moments show the optimizer state it loaded. The LR factor
# of steps 1-4 is 1/3, 2/3 (warmup), 1, 0.1 (linear decay to min_lr_factor 0.1): no resumed step runs at the factor
# a restarted schedule would give it (1/3, then 2/3), and the last step still moves the weights. (6 steps saving at 3
# and 4 until 2026-11-27: a third of the CPU time more, and nothing the moments do not show.)
STEPS, SAVED, MID = 4, 2, 3
CKPT = ("--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", str(SAVED),
        "--checkpoint.keep_latest_k", "0", "--lr_scheduler.min_lr_factor", "0.1")
AND_MID = ("--checkpoint.interval", str(MID))
FSDP4 = dp(2, 4)
TP2 = (*dp(4, 2), "--parallelism.tensor_parallel_degree", "2")


def _resume_from(source, step: int, dest) -> None:
    """A fresh run folder holding only `source`'s checkpoint at `step`."""
    (dest / "checkpoint").mkdir(parents=True)
    shutil.copytree(source / "checkpoint" / f"step-{step}", dest / "checkpoint" / f"step-{step}")


@pytest.fixture(scope="module")
def straight_fsdp4(pools, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    run = train_layout(pools, 4, (*CKPT, *FSDP4), out)
    # The last step writes the full state too (a finished run can be extended), plus the model-only export.
    assert complete_steps(out) == [SAVED, STEPS]
    marker = json.loads((out / "checkpoint" / f"step-{STEPS}-model" / ".complete").read_text())
    assert marker["model_only"] and marker["step"] == STEPS
    return out, run


def test_resume_same_layout_is_bitwise_identical(straight_fsdp4, pools, tmp_path):
    folder, straight = straight_fsdp4
    _resume_from(folder, SAVED, tmp_path)
    resumed = train_layout(pools, 4, (*CKPT, *FSDP4), tmp_path)
    assert_continues_bitwise(resumed, straight, SAVED, STEPS)


def test_resume_on_hsdp_continues_the_curve(straight_fsdp4, pools, tmp_path):
    folder, straight = straight_fsdp4
    _resume_from(folder, SAVED, tmp_path)
    resumed = train_layout(pools, 4, (*CKPT, *dp(1, 4), "--parallelism.data_parallel_replicate_degree", "2"),
                           tmp_path)
    problems = compare(resumed, from_step(straight, SAVED + 1))
    assert not problems, problems[:5]


def test_resume_across_tensor_parallel_both_ways(straight_fsdp4, pools, tmp_path):
    # FSDP 4 step 2 -> FSDP 2 x TP 2 (saves step 3) -> FSDP 4 again: the TP-sharded checkpoint must load too.
    folder, straight = straight_fsdp4
    tp_run, back = tmp_path / "fsdp2_tp2", tmp_path / "fsdp4"
    _resume_from(folder, SAVED, tp_run)
    resumed = train_layout(pools, 4, (*CKPT, *TP2, *AND_MID), tp_run)
    assert not compare(resumed, from_step(straight, SAVED + 1))
    _resume_from(tp_run, MID, back)
    again = train_layout(pools, 4, (*CKPT, *FSDP4), back)
    problems = compare(again, from_step(straight, MID + 1))
    assert not problems, problems[:5]


def test_resume_on_one_unwrapped_process_both_ways(straight_fsdp4, pools, tmp_path):
    # FSDP 4 step 2 -> one process (no data-parallel wrapper: plain tensors, saves step 3) -> FSDP 4 again.
    folder, straight = straight_fsdp4
    single, back = tmp_path / "single", tmp_path / "fsdp4"
    _resume_from(folder, SAVED, single)
    resumed = train_layout(pools, 1, (*CKPT, *dp(8, 1), *AND_MID), single)
    assert not compare(resumed, from_step(straight, SAVED + 1))
    _resume_from(single, MID, back)
    again = train_layout(pools, 4, (*CKPT, *FSDP4), back)
    problems = compare(again, from_step(straight, MID + 1))
    assert not problems, problems[:5]


# 4 stages over 2 or 4 ranks need the flavor's 4 blocks (tests/integration/layouts.py): this test has its own
# straight run.
PP2_FSDP2 = (*dp(4, 2), "--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", *FOUR_BLOCKS)
PP4 = (*dp(8, 1), "--parallelism.pipeline_parallel_degree", "4", *FOUR_BLOCKS)


def test_resume_across_pipeline_layouts(pools, tmp_path):
    """FSDP 4 step 2 -> PP 2 x FSDP 2 with 2 stages per rank (saves step 3, exports Hugging Face at 4) -> both
    FSDP 4 and PP 4 (one block per stage) from its step 3: every change of the stage split continues the curve."""
    from torchtitan.components.hf_io import load_hf
    from torchtitan.models.llama3.model import Transformer

    folder = tmp_path / "straight"
    straight = train_layout(pools, 4, (*CKPT, *FSDP4, *FOUR_BLOCKS), folder)
    pp_run, back, pp4 = tmp_path / "pp2_fsdp2", tmp_path / "fsdp4", tmp_path / "pp4"
    _resume_from(folder, SAVED, pp_run)
    resumed = train_layout(pools, 4, (*CKPT, *PP2_FSDP2, *AND_MID, "--checkpoint.last_save_in_hf", "true"), pp_run)
    problems = compare(resumed, from_step(straight, SAVED + 1))
    assert not problems, problems[:5]
    # The export by shard (every rank its own rows, each stage's ranks their stages): a complete model that loads
    # strictly and holds exactly the weights of the same step's DCP checkpoint.
    import torch

    from torchtitan.components.checkpoint_io import load_full_model_state

    state, model_args = load_hf(pp_run / "checkpoint" / f"step-{STEPS}-hf")
    Transformer(model_args).load_state_dict(state, strict=True)
    dcp_state = load_full_model_state(pp_run / "checkpoint" / f"step-{STEPS}")
    saved = {k.removeprefix("model."): v for k, v in dcp_state.items()}
    assert set(saved) == set(state) and all(torch.equal(state[k], saved[k]) for k in state)
    for dest, nproc, layout in ((back, 4, (*FSDP4, *FOUR_BLOCKS)), (pp4, 4, PP4)):
        _resume_from(pp_run, MID, dest)
        again = train_layout(pools, nproc, (*CKPT, *layout), dest)
        problems = compare(again, from_step(straight, MID + 1))
        assert not problems, (dest.name, problems[:5])


FSDP2_CP2 = (*dp(4, 2), "--parallelism.context_parallel_degree", "2")


def test_resume_across_context_parallel_layouts(straight_fsdp4, pools, tmp_path):
    """FSDP 4 step 2 -> FSDP 2 x CP 2 (saves step 3) -> FSDP 4 from its step 3: a context-parallel run's checkpoint
    (FSDP over dp_shard x cp) reshards both ways and the curve continues."""
    folder, straight = straight_fsdp4
    cp_run, back = tmp_path / "fsdp2_cp2", tmp_path / "fsdp4"
    _resume_from(folder, SAVED, cp_run)
    resumed = train_layout(pools, 4, (*CKPT, *FSDP2_CP2, *AND_MID), cp_run)
    problems = compare(resumed, from_step(straight, SAVED + 1))
    assert not problems, problems[:5]
    _resume_from(cp_run, MID, back)
    again = train_layout(pools, 4, (*CKPT, *FSDP4), back)
    problems = compare(again, from_step(straight, MID + 1))
    assert not problems, problems[:5]


EXTEND = (*dp(4, 2), "--checkpoint.enable", "--checkpoint.interval", "100", "--lr_scheduler.decay_ratio", "0")


def test_extending_a_finished_run_continues_exactly(pools, tmp_path):
    """Regression: `--training.steps 6` on a finished 3-step run restarted the LR schedule, the data and the step
    count from the model-only final save, and overwrote step folders. (Constant LR after warmup here, so the
    schedule does not depend on training.steps and the extended run must equal a straight 6-step run; a restarted
    schedule would warm up again at step 4, a restarted data stream would read step 1's batch.)"""
    straight = train_layout(pools, 2, (*EXTEND, "--training.steps", "6"), tmp_path / "straight")
    run = tmp_path / "run"
    train_layout(pools, 2, (*EXTEND, "--training.steps", "3"), run)
    extended = train_layout(pools, 2, (*EXTEND, "--training.steps", "6"), run)
    assert [m["step"] for m in extended["metrics"]] == list(range(1, 7)), "the extension must start at step 4"
    extended = from_step(extended, 4)
    expected = from_step(straight, 4)
    assert [m["loss"] for m in extended["metrics"]] == [m["loss"] for m in expected["metrics"]]
    assert extended["params"] == expected["params"]
    assert complete_steps(run) == [3, 6]  # full states, beside the model-only exports
    assert (run / "checkpoint" / "step-3-model" / ".complete").exists()

    # Going back to step 3 would overwrite step-6 of the run that got further: refused before any step.
    error = setup_error(pools, 2, (*EXTEND, "--training.steps", "6", "--checkpoint.load_step", "3"), run)
    assert "step-6" in error and "overwrite" in error, error
    # Fewer steps than the checkpoint already has: refused with the key to change.
    error = setup_error(pools, 2, (*EXTEND, "--training.steps", "5"), run)
    assert "training.steps=5" in error, error


def test_extending_a_decaying_run_follows_the_new_schedule(pools, tmp_path):
    """A 3-step run (warmup 2, no room left to decay) extended to 6 steps with cosine decay: steps 4-6 run at the
    LR a straight 6-step run has there, from the first resumed step (the schedule is the running config's,
    evaluated at the step reached). Before, step 4 ran at the old schedule's LR left in the optimizer's state."""
    args = (*dp(4, 2), "--checkpoint.enable", "--checkpoint.interval", "100", "--lr_scheduler.decay_type", "cosine",
            "--lr_scheduler.min_lr_factor", "0.1")
    straight = train_layout(pools, 2, (*args, "--training.steps", "6"), tmp_path / "straight")
    run = tmp_path / "run"
    train_layout(pools, 2, (*args, "--training.steps", "3"), run)
    extended = train_layout(pools, 2, (*args, "--training.steps", "6"), run)
    got = {m["step"]: m["lr"] for m in extended["metrics"]}
    want = {m["step"]: m["lr"] for m in straight["metrics"]}
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([want[s] for s in (4, 5, 6)], rel=1e-9), (got, want)
    assert want[4] < want[3] and want[6] == pytest.approx(0.1 * want[3], rel=1e-9)  # it does decay, to the floor


def test_async_save_with_hugging_face_export_loads_in_transformers(pools, tmp_path):
    """Regression: with async saves, the final Hugging Face export's collectives interleaved with the pending
    background save on the checkpoint group: two-rank runs hung or died with 'Connection reset by peer'."""
    import torch
    import transformers

    from torchtitan.components.hf_io import load_hf
    from torchtitan.models.llama3.model import Transformer

    # The 7M-parameter debug model: its background save lasts long enough to overlap the export.
    args = (*dp(4, 2), "--model.flavor", "debugmodel", "--training.steps", "3", "--checkpoint.enable",
            "--checkpoint.interval", "1",
            "--checkpoint.async_mode", "async", "--checkpoint.last_save_model_only", "false",
            "--checkpoint.last_save_in_hf", "true")
    train_layout(pools, 2, args, tmp_path, timeout=90)
    assert complete_steps(tmp_path) == [1, 2, 3]
    hf_dir = tmp_path / "checkpoint" / "step-3-hf"
    hf_model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, local_files_only=True, torch_dtype=torch.float32)
    state, model_args = load_hf(hf_dir)
    ours = Transformer(model_args)
    ours.load_state_dict(state, strict=True)  # built on CPU, so the rotary buffer is already computed
    tokens = torch.randint(0, model_args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf_model(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-4, diff


# ---- through run_train.sh: the launcher's signals and an abrupt kill --------------------------------------------

LAUNCH = ("--model.flavor", "debugmodel_small", "--training.seq_len", "64", "--training.global_batch_size", "8",
          "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--job.print_config", "false",
          "--checkpoint.enable", "--checkpoint.keep_latest_k", "0")


# The killed run, the resumed one and their reference in the rank pool train one config: torchrun reads
# debug_model.toml, the pool reads no file but adds COMMON, so every run is given both. With decay_ratio 0
# the LR is constant after warmup: the 400-step run that is killed and the few-step runs that resume it or serve as
# reference follow the same schedule. No validation: the curve compared is the training loss and gradient norm.
KILL_RUN = (*COMMON, "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), *dp(4, 2),
            "--lr_scheduler.decay_ratio", "0", "--validation.enable", "false", "--checkpoint.enable",
            "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0")
KILL_LAUNCH = (*KILL_RUN, "--comm.init_timeout_seconds", "90")  # launch.py's own value, which COMMON would lower
KILL_FROM_STEP = 2  # the first save after a complete one (step 1's): every kill leaves a checkpoint to resume
# Where the kill is aimed, in the first save or step from KILL_FROM_STEP on that shows it: a save that has begun (its
# folder exists, no .metadata yet), a save whose shards and .metadata are all written but whose .complete rank 0 has
# not published yet (a folder that looks whole and is not), or the step after a complete save.
KILL_MOMENTS = ("save begun", "save unpublished", "step")
KILL_DELAYS = (0.0, 0.02, 0.1, 0.3)
# One moment and delay per run, drawn from KILL_SEED (default: today's date), so that the days go through all of
# them and a failure can be replayed with the seed its message names.
KILL_SEED = int(os.environ.get("KILL_SEED", datetime.date.today().toordinal()))


def _step_folders(run_dir) -> list[tuple[int, bool, bool]]:
    """(step, .metadata written, .complete written) of every step-N folder, oldest first."""
    found = []
    for p in (run_dir / "checkpoint").glob("step-*"):
        if p.is_dir() and p.name.count("-") == 1:
            found.append((int(p.name.split("-")[1]), (p / ".metadata").exists(), (p / ".complete").exists()))
    return sorted(found)


def _aimed_at(moment: str, folders: list[tuple[int, bool, bool]]) -> bool:
    late = [(meta, done) for step, meta, done in folders if step >= KILL_FROM_STEP]
    if any(done for step, _, done in folders if step >= KILL_FROM_STEP + 3):
        return True  # every save up to here slipped through the window (a fast disk): kill wherever the run is
    if moment == "save begun":
        return any(not meta and not done for meta, done in late)
    if moment == "save unpublished":
        return any(meta and not done for meta, done in late)
    return any(done for _, done in late)


def _landing(run_dir, logged: list[dict]) -> str:
    """Where the kill landed, read from what the run left behind."""
    folders = _step_folders(run_dir)
    last_logged = logged[-1]["step"] if logged else 0
    if folders and not folders[-1][2]:
        step, meta, _ = folders[-1]
        if meta:
            return f"mid-save of step {step}: every shard and .metadata written, no .complete"
        shards = sorted(p.name for p in (run_dir / "checkpoint" / f"step-{step}").glob("*.distcp"))
        return f"mid-save of step {step}: no .metadata, shard files {shards}"
    saved = folders[-1][0] if folders else 0
    if last_logged > saved:
        return f"after step {last_logged} was logged, before its save began"
    return f"mid-step {saved + 1} (step {saved} saved)"


def _load_whole(path) -> dict:
    """Every entry of a DCP folder (model, optimizer, schedule, data position, train state, RNG) on one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchtitan.components import checkpoint_io as cio

    md = cio.read_metadata(path)
    state = {key: torch.empty(item.size, dtype=item.properties.dtype)
             if isinstance(item, TensorStorageMetadata) else None for key, item in md.state_dict_metadata.items()}
    dcp.load(state, checkpoint_id=str(path), planner=cio.SafeLoadPlanner(flatten_state_dict=False), no_dist=True)
    return state


def _curve(metrics: list[dict], steps) -> dict:
    """Loss and gradient norm of `steps` in compare()'s form, without per-tensor fingerprints (torchrun has none)."""
    return {"metrics": [{"step": m["step"], "loss": m["loss"], "grad_norm": m["grad_norm"]}
                        for m in metrics if m["step"] in steps], "params": [], "grads": []}


def test_kill_9_at_any_moment_then_resume(pools, tmp_path, tt_cache_dir):
    rng = random.Random(KILL_SEED)
    moment = rng.choice(KILL_MOMENTS)
    delay = 0.0 if moment == "save unpublished" else rng.choice(KILL_DELAYS)
    proc = start_train(2, [*KILL_LAUNCH, "--training.steps", "400"], tmp_path, tt_cache_dir, tmp_path / "killed.log")
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            folders = _step_folders(tmp_path)
            if _aimed_at(moment, folders):
                break
            # Finely only near the target (the unpublished window can be a few milliseconds): the ranks share the cores.
            time.sleep(0.002 if folders and folders[-1][0] >= KILL_FROM_STEP - 1 else 0.05)
        assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(delay)
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=30)
    complete = complete_steps(tmp_path)
    assert complete, (tmp_path / "killed.log").read_text()[-3000:]
    killed_text = (tmp_path / "metrics.jsonl").read_text()
    killed = [json.loads(line) for line in killed_text.splitlines()]
    where = f"KILL_SEED={KILL_SEED} aimed at '{moment}' + {delay} s, landed {_landing(tmp_path, killed)}"
    for step in complete:  # a .complete marker vouches for the whole state, whenever the kill came
        state = _load_whole(tmp_path / "checkpoint" / f"step-{step}")
        assert state["train_state.step"] == step, f"{where}: step-{step} holds step {state['train_state.step']}"
    newest = complete[-1]
    partial = [step for step, _, done in _step_folders(tmp_path) if not done]
    assert all(step > newest for step in partial), f"{where}: incomplete {partial} before step {newest}"

    # Two steps: the first resumed step shows the weights and the data position, only the second the optimizer state.
    steps = newest + 2
    result = run_train(2, [*KILL_LAUNCH, "--training.steps", str(steps)], tmp_path, tt_cache_dir)
    assert result.returncode == 0, f"{where}\n{result.output[-4000:]}"
    loaded = f"from {tmp_path / 'checkpoint' / f'step-{newest}'} (step {newest})"
    assert loaded in result.output, f"{where}: must resume step {newest}\n{result.output[-4000:]}"
    for step in partial:
        assert f"step-{step} is incomplete" in result.output, f"{where}: step-{step} not reported incomplete"
    resumed = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text()[len(killed_text):].splitlines()]
    assert [m["step"] for m in resumed] == list(range(newest + 1, steps + 1)), f"{where}: resumed {resumed}"
    # The resumed run saved every step, over the incomplete folder too.
    assert complete_steps(tmp_path) == list(range(1, steps + 1)), f"{where}: {_step_folders(tmp_path)}"

    # Saves do not enter the arithmetic: the reference skips them.
    reference = train_layout(pools, 2, (*KILL_RUN, "--training.steps", str(steps), "--checkpoint.enable", "false"),
                             tmp_path / "reference")
    # The killed run's steps are a torchrun run of the same config: they check that the pool trains it the same way.
    before = range(1, min(killed[-1]["step"], steps) + 1)
    problems = compare(_curve(killed, before), _curve(reference["metrics"], before))
    assert not problems, f"{where}: torchrun and the pool differ: {problems[:5]}"
    after = range(newest + 1, steps + 1)
    problems = compare(_curve(resumed, after), _curve(reference["metrics"], after))
    assert not problems, f"{where}: resumed from step {newest}, the curve does not continue: {problems[:5]}"


def test_sigterm_saves_a_complete_checkpoint_and_exits(pools, tmp_path, tt_cache_dir):
    # No periodic saves (interval 1000, no first-step save): a checkpoint can only come from the signal.
    proc = start_train(2, [*LAUNCH, "--training.steps", "400", "--checkpoint.interval", "1000"], tmp_path,
                       tt_cache_dir, tmp_path / "term.log")
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None and not (metrics.exists() and metrics.read_text()):
            time.sleep(0.1)
        # After step 1 is logged: the ranks agree to stop in a later step's guard and save after it.
        os.kill(proc.pid, signal.SIGTERM)  # the launcher (torchrun) forwards it to every rank
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    log = (tmp_path / "term.log").read_text()
    saved = complete_steps(tmp_path)
    assert saved and saved[-1] >= 2, log[-3000:]
    assert "SIGTERM received" in log
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert logged == list(range(1, saved[-1] + 1)), f"the save must follow the last step trained: {logged}"
    # The checkpoint resumes at the next step: in the rank pool (the kill -9 test resumes through run_train.sh), given
    # the config file that torchrun read.
    config = ("--job.config_file", str(REPO / "train_configs" / "debug_model.toml"))
    resumed = pools.get(2).run(run_layout, [*config, *LAUNCH, "--training.steps", str(saved[-1] + 1)],
                               str(tmp_path))[0]
    assert [m["step"] for m in resumed["metrics"]] == [*logged, saved[-1] + 1], resumed["metrics"]


MOE = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe_small")


@pytest.fixture(scope="module")
def straight_moe_fsdp2(pools, tmp_path_factory):
    """The mixture-of-experts run every MoE resume test starts from: FSDP 2, saved at SAVED and at the end."""
    out = tmp_path_factory.mktemp("straight_moe")
    run = train_layout(pools, 2, (*CKPT, *MOE, *dp(4, 2)), out)
    assert complete_steps(out) == [SAVED, STEPS]
    return out, run


# The MoE tests run in the order of their pools (2 ranks, then 4): each change of world size starts a fresh pool.

def test_moe_resume_into_and_out_of_expert_parallel(straight_moe_fsdp2, pools, tmp_path):
    """FSDP 2 saved at step 2 -> FSDP 2 + EP 2 (each rank holds half of every layer's experts; saves step 3) ->
    FSDP 2 again from step 3: expert weights reshard between the expert mesh and FSDP and the curve continues."""
    straight_dir, straight = straight_moe_fsdp2
    ep_dir, back_dir = tmp_path / "ep2", tmp_path / "back"
    _resume_from(straight_dir, SAVED, ep_dir)
    ep = train_layout(pools, 2, (*CKPT, *MOE, *dp(4, 2), "--parallelism.expert_parallel_degree", "2", *AND_MID),
                      ep_dir)
    problems = compare(ep, from_step(straight, SAVED + 1))
    assert not problems, problems[:5]
    _resume_from(ep_dir, MID, back_dir)
    back = train_layout(pools, 2, (*CKPT, *MOE, *dp(4, 2)), back_dir)
    problems = compare(back, from_step(straight, MID + 1))
    assert not problems, problems[:5]


def test_moe_resume_under_another_data_parallel_layout(straight_moe_fsdp2, pools, tmp_path):
    """A mixture-of-experts run saved under FSDP 2 at step 2 resumes under HSDP 2 x 2 and continues the curve: the
    routing biases of auxiliary-loss-free balancing (buffers, not parameters) are in the checkpoint and reshard
    like the rest (without them the resumed curve fails this test: checked by making the buffer non-persistent)."""
    straight_dir, straight = straight_moe_fsdp2
    _resume_from(straight_dir, SAVED, tmp_path)
    resumed = train_layout(pools, 4, (*CKPT, *MOE, *dp(2, 4), "--parallelism.data_parallel_replicate_degree", "2"),
                           tmp_path)
    assert [m["step"] for m in resumed["metrics"]] == list(range(SAVED + 1, STEPS + 1)), "must resume after SAVED"
    problems = compare(resumed, from_step(straight, SAVED + 1))
    assert not problems, problems[:5]


def test_moe_resume_across_expert_parallel_degrees_and_expert_tensor_parallel(straight_moe_fsdp2, pools, tmp_path):
    """FSDP 2 saved at step 2 -> FSDP 2 x TP 2 + EP 2 with tensor parallel inside the experts (each expert weight a
    2-D DTensor: experts over ep, hidden units over tp; saves step 3) -> FSDP 4 + EP 4 from step 3: the curve goes
    on through both reshardings."""
    straight_dir, straight = straight_moe_fsdp2
    etp_dir, ep4_dir = tmp_path / "tp2_ep2_etp2", tmp_path / "ep4"
    _resume_from(straight_dir, SAVED, etp_dir)
    etp_layout = (*MOE, *dp(4, 2), "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree",
                  "2", "--parallelism.expert_tensor_parallel_degree", "2")
    etp = train_layout(pools, 4, (*CKPT, *etp_layout, *AND_MID, "--checkpoint.last_save_in_hf", "true"), etp_dir)
    problems = compare(etp, from_step(straight, SAVED + 1))
    assert not problems, problems[:5]
    _hf_export_round_trip(pools, etp_dir, etp_layout, tmp_path / "import")
    _resume_from(etp_dir, MID, ep4_dir)
    ep4 = train_layout(pools, 4, (*CKPT, *MOE, *dp(2, 4), "--parallelism.expert_parallel_degree", "4"), ep4_dir)
    problems = compare(ep4, from_step(straight, MID + 1))
    assert not problems, problems[:5]


def _hf_export_round_trip(pools, run_dir, layout, import_dir) -> None:
    """The run's final Hugging Face export (written by rows under `layout`) holds its DCP checkpoint's weights, and
    a run of the same layout that imports it and takes one step at learning rate 1e-30 (far below one ulp of any
    weight, so none moves) exports the same weights again:
    export and import by shard through every placement of the layout (here 2-D expert DTensors, TP-sharded
    attention, MoE layers sharded over dp x tp)."""
    import torch

    from torchtitan.components.checkpoint_io import load_full_model_state
    from torchtitan.components.hf_io import load_hf

    hf_dir = run_dir / "checkpoint" / f"step-{STEPS}-hf"
    exported, _ = load_hf(hf_dir, model="qwen3")
    dcp_state = load_full_model_state(run_dir / "checkpoint" / f"step-{STEPS}")
    saved = {k.removeprefix("model."): v for k, v in dcp_state.items()}
    # Qwen3's routing bias has no Hugging Face counterpart: the export leaves it out, the import gives zeros.
    weights = [k for k in saved if not k.endswith("expert_bias")]
    assert set(weights) <= set(exported) and all(torch.equal(exported[k], saved[k]) for k in weights)
    train_layout(pools, 4, (*layout, "--training.steps", "1", "--optimizer.lr", "1e-30", "--checkpoint.enable",
                            "--checkpoint.initial_load_path", str(hf_dir), "--checkpoint.initial_load_in_hf", "true",
                            "--checkpoint.last_save_in_hf", "true"), import_dir)
    again, _ = load_hf(import_dir / "checkpoint" / "step-1-hf", model="qwen3")
    assert all(torch.equal(again[k], exported[k]) for k in weights)
