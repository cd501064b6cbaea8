"""Checkpoints: exact and resharded resume and extending a finished run (in the rank pools, through the trainer's
own code), async saves with a Hugging Face export, and kill -9 / SIGTERM through run_train.sh."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from tests.integration.conftest import setup_error, train_layout
from tests.integration.launch import kill_tree, run_train, start_train
from tests.integration.layouts import dp
from tests.integration.parity import compare

pytestmark = pytest.mark.slow

STEPS = 12
CKPT = ("--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "6",
        "--checkpoint.keep_latest_k", "0")
FSDP4 = dp(2, 4)
TP2 = (*dp(4, 2), "--parallelism.tensor_parallel_degree", "2")


def _complete_steps(run_dir) -> list[int]:
    folder = run_dir / "checkpoint"
    if not folder.exists():
        return []
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*")
                  if p.is_dir() and p.name.count("-") == 1 and (p / ".complete").exists())


def _resume_from(source, step: int, dest) -> None:
    """A fresh run folder holding only `source`'s checkpoint at `step`."""
    (dest / "checkpoint").mkdir(parents=True)
    shutil.copytree(source / "checkpoint" / f"step-{step}", dest / "checkpoint" / f"step-{step}")


def _from_step(run: dict, first: int) -> dict:
    """The steps >= first of a run (its metrics file may also hold the steps of the run it resumed)."""
    metrics = [m for m in run["metrics"] if m["step"] >= first]
    return {"metrics": metrics, "params": run["params"][-len(metrics):], "grads": run["grads"][-len(metrics):]}


@pytest.fixture(scope="module")
def straight_fsdp4(pools, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    run = train_layout(pools, 4, (*CKPT, *FSDP4), out)
    # The last step writes the full state too (a finished run can be extended), plus the model-only export.
    assert _complete_steps(out) == [6, 12]
    marker = json.loads((out / "checkpoint" / "step-12-model" / ".complete").read_text())
    assert marker["model_only"] and marker["step"] == 12
    return out, run


def test_resume_same_layout_is_bitwise_identical(straight_fsdp4, pools, tmp_path):
    folder, straight = straight_fsdp4
    _resume_from(folder, 6, tmp_path)
    resumed = train_layout(pools, 4, (*CKPT, *FSDP4), tmp_path)
    assert [m["step"] for m in resumed["metrics"]] == list(range(7, STEPS + 1)), "must resume at step 7"
    expected = _from_step(straight, 7)
    for got, ref in zip(resumed["metrics"], expected["metrics"], strict=True):
        assert (got["loss"], got["grad_norm"], got.get("val_loss")) == (ref["loss"], ref["grad_norm"],
                                                                         ref.get("val_loss")), (got, ref)
    assert resumed["params"] == expected["params"]


def test_resume_on_hsdp_continues_the_curve(straight_fsdp4, pools, tmp_path):
    folder, straight = straight_fsdp4
    _resume_from(folder, 6, tmp_path)
    resumed = train_layout(pools, 4, (*CKPT, *dp(1, 4), "--parallelism.data_parallel_replicate_degree", "2"),
                           tmp_path)
    problems = compare(resumed, _from_step(straight, 7))
    assert not problems, problems[:5]


def test_resume_across_tensor_parallel_both_ways(straight_fsdp4, pools, tmp_path):
    # FSDP 4 step 6 -> FSDP 2 x TP 2 (saves step 9) -> FSDP 4 again: the TP-sharded checkpoint must load too.
    folder, straight = straight_fsdp4
    tp_run, back = tmp_path / "fsdp2_tp2", tmp_path / "fsdp4"
    _resume_from(folder, 6, tp_run)
    resumed = train_layout(pools, 4, (*CKPT, *TP2, "--checkpoint.interval", "3"), tp_run)
    assert not compare(resumed, _from_step(straight, 7))
    _resume_from(tp_run, 9, back)
    again = train_layout(pools, 4, (*CKPT, *FSDP4), back)
    problems = compare(again, _from_step(straight, 10))
    assert not problems, problems[:5]


def test_resume_on_one_unwrapped_process_both_ways(straight_fsdp4, pools, tmp_path):
    # FSDP 4 step 6 -> one process (no data-parallel wrapper: plain tensors, saves step 9) -> FSDP 4 again.
    folder, straight = straight_fsdp4
    single, back = tmp_path / "single", tmp_path / "fsdp4"
    _resume_from(folder, 6, single)
    resumed = train_layout(pools, 1, (*CKPT, *dp(8, 1), "--checkpoint.interval", "3"), single)
    assert not compare(resumed, _from_step(straight, 7))
    _resume_from(single, 9, back)
    again = train_layout(pools, 4, (*CKPT, *FSDP4), back)
    problems = compare(again, _from_step(straight, 10))
    assert not problems, problems[:5]


PP2_FSDP2 = (*dp(4, 2), "--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")
PP4 = (*dp(8, 1), "--parallelism.pipeline_parallel_degree", "4")


def test_resume_across_pipeline_layouts(straight_fsdp4, pools, tmp_path):
    """FSDP 4 step 6 -> PP 2 x FSDP 2 with 2 stages per rank (saves step 9, exports Hugging Face at 12) -> both
    FSDP 4 and PP 4 (one block per stage) from its step 9: every change of the stage split continues the curve."""
    from torchtitan.components.hf_io import load_hf
    from torchtitan.models.llama3 import Transformer

    folder, straight = straight_fsdp4
    pp_run, back, pp4 = tmp_path / "pp2_fsdp2", tmp_path / "fsdp4", tmp_path / "pp4"
    _resume_from(folder, 6, pp_run)
    resumed = train_layout(pools, 4, (*CKPT, *PP2_FSDP2, "--checkpoint.interval", "3",
                                      "--checkpoint.last_save_in_hf", "true"), pp_run)
    problems = compare(resumed, _from_step(straight, 7))
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
    for dest, nproc, layout in ((back, 4, FSDP4), (pp4, 4, PP4)):
        _resume_from(pp_run, 9, dest)
        again = train_layout(pools, nproc, (*CKPT, *layout), dest)
        problems = compare(again, _from_step(straight, 10))
        assert not problems, (dest.name, problems[:5])


FSDP2_CP2 = (*dp(4, 2), "--parallelism.context_parallel_degree", "2")


def test_resume_across_context_parallel_layouts(straight_fsdp4, pools, tmp_path):
    """FSDP 4 step 6 -> FSDP 2 x CP 2 (saves step 9) -> FSDP 4 from its step 9: a context-parallel run's checkpoint
    (FSDP over dp_shard x cp) reshards both ways and the curve continues."""
    folder, straight = straight_fsdp4
    cp_run, back = tmp_path / "fsdp2_cp2", tmp_path / "fsdp4"
    _resume_from(folder, 6, cp_run)
    resumed = train_layout(pools, 4, (*CKPT, *FSDP2_CP2, "--checkpoint.interval", "3"), cp_run)
    problems = compare(resumed, _from_step(straight, 7))
    assert not problems, problems[:5]
    _resume_from(cp_run, 9, back)
    again = train_layout(pools, 4, (*CKPT, *FSDP4), back)
    problems = compare(again, _from_step(straight, 10))
    assert not problems, problems[:5]


EXTEND = (*dp(4, 2), "--checkpoint.enable", "--checkpoint.interval", "100", "--lr_scheduler.decay_ratio", "0")


def test_extending_a_finished_run_continues_exactly(pools, tmp_path):
    """Regression: `--training.steps 12` on a finished 6-step run restarted the LR schedule, the data and the step
    count from the model-only final save, and overwrote step folders. (Constant LR after warmup here, so the
    schedule does not depend on training.steps and the extended run must equal a straight 12-step run.)"""
    straight = train_layout(pools, 2, (*EXTEND, "--training.steps", "12"), tmp_path / "straight")
    run = tmp_path / "run"
    train_layout(pools, 2, (*EXTEND, "--training.steps", "6"), run)
    extended = train_layout(pools, 2, (*EXTEND, "--training.steps", "12"), run)
    assert [m["step"] for m in extended["metrics"]] == list(range(1, 13)), "the extension must start at step 7"
    extended = _from_step(extended, 7)
    expected = _from_step(straight, 7)
    assert [m["loss"] for m in extended["metrics"]] == [m["loss"] for m in expected["metrics"]]
    assert extended["params"] == expected["params"]
    assert _complete_steps(run) == [6, 12]  # full states, beside the model-only exports
    assert (run / "checkpoint" / "step-6-model" / ".complete").exists()

    # Going back to step 6 would overwrite step-12 of the run that got further: refused before any step.
    error = setup_error(pools, 2, (*EXTEND, "--training.steps", "12", "--checkpoint.load_step", "6"), run)
    assert "step-12" in error and "overwrite" in error, error
    # Fewer steps than the checkpoint already has: refused with the key to change.
    error = setup_error(pools, 2, (*EXTEND, "--training.steps", "10"), run)
    assert "training.steps=10" in error, error


def test_async_save_with_hugging_face_export_loads_in_transformers(pools, tmp_path):
    """Regression: with async saves, the final Hugging Face export's collectives interleaved with the pending
    background save on the checkpoint group: two-rank runs hung or died with 'Connection reset by peer'."""
    import torch
    import transformers

    from torchtitan.components.hf_io import load_hf
    from torchtitan.models.llama3 import Transformer

    # The 7M-parameter debug model: its background save lasts long enough to overlap the export.
    args = (*dp(4, 2), "--model.flavor", "debugmodel", "--training.steps", "3", "--checkpoint.enable",
            "--checkpoint.interval", "1",
            "--checkpoint.async_mode", "async", "--checkpoint.last_save_model_only", "false",
            "--checkpoint.last_save_in_hf", "true")
    train_layout(pools, 2, args, tmp_path, timeout=90)
    assert _complete_steps(tmp_path) == [1, 2, 3]
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


def test_kill_9_at_any_moment_then_resume(tmp_path, tt_cache_dir):
    proc = start_train(2, [*LAUNCH, "--training.steps", "400", "--checkpoint.interval", "1"], tmp_path, tt_cache_dir,
                       tmp_path / "killed.log")
    try:
        deadline = time.time() + 180
        while len(_complete_steps(tmp_path)) < 3 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert _complete_steps(tmp_path), (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(0.37)  # land somewhere inside a step or a save
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=30)
    newest = _complete_steps(tmp_path)[-1]
    result = run_train(2, [*LAUNCH, "--training.steps", str(newest + 2), "--checkpoint.interval", "1"], tmp_path,
                       tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]
    assert f"step-{newest}" in result.output, "the resumed run must name the checkpoint it loaded"
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == newest + 2


def test_sigterm_saves_a_complete_checkpoint_and_exits(tmp_path, tt_cache_dir):
    proc = start_train(2, [*LAUNCH, "--training.steps", "400", "--checkpoint.interval", "1000"], tmp_path,
                       tt_cache_dir, tmp_path / "term.log")
    try:
        deadline = time.time() + 180
        metrics = tmp_path / "metrics.jsonl"
        while time.time() < deadline and proc.poll() is None and (
                not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)  # the launcher (torchrun) forwards it to every rank
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    log = (tmp_path / "term.log").read_text()
    saved = _complete_steps(tmp_path)
    assert saved and saved[-1] >= 3, log[-3000:]
    assert "SIGTERM received" in log
    result = run_train(2, [*LAUNCH, "--training.steps", str(saved[-1] + 1)], tmp_path, tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]


MOE = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe_small")


def test_moe_resume_under_another_data_parallel_layout(pools, tmp_path):
    """A mixture-of-experts run saved under FSDP 2 at step 6 resumes under HSDP 2 x 2 and continues the curve: the
    routing biases of auxiliary-loss-free balancing (buffers, not parameters) are in the checkpoint and reshard
    like the rest (without them the resumed curve fails this test: checked by making the buffer non-persistent)."""
    straight_dir, resumed_dir = tmp_path / "fsdp2", tmp_path / "hsdp2x2"
    straight = train_layout(pools, 2, (*CKPT, *MOE, *dp(4, 2)), straight_dir)
    _resume_from(straight_dir, 6, resumed_dir)
    resumed = train_layout(pools, 4, (*CKPT, *MOE, *dp(2, 4), "--parallelism.data_parallel_replicate_degree", "2"),
                           resumed_dir)
    assert [m["step"] for m in resumed["metrics"]] == list(range(7, STEPS + 1)), "must resume at step 7"
    problems = compare(resumed, _from_step(straight, 7))
    assert not problems, problems[:5]


def test_moe_resume_into_and_out_of_expert_parallel(pools, tmp_path):
    """FSDP 2 saved at step 6 -> FSDP 2 + EP 2 (each rank holds half of every layer's experts; saves step 9) ->
    FSDP 2 again from step 9: expert weights reshard between the expert mesh and FSDP and the curve continues."""
    straight_dir, ep_dir, back_dir = tmp_path / "fsdp2", tmp_path / "ep2", tmp_path / "back"
    straight = train_layout(pools, 2, (*CKPT, *MOE, *dp(4, 2)), straight_dir)
    _resume_from(straight_dir, 6, ep_dir)
    ep = train_layout(pools, 2, (*CKPT, *MOE, *dp(4, 2), "--parallelism.expert_parallel_degree", "2",
                                 "--checkpoint.interval", "3"), ep_dir)
    problems = compare(ep, _from_step(straight, 7))
    assert not problems, problems[:5]
    _resume_from(ep_dir, 9, back_dir)
    back = train_layout(pools, 2, (*CKPT, *MOE, *dp(4, 2)), back_dir)
    problems = compare(back, _from_step(straight, 10))
    assert not problems, problems[:5]


def test_moe_resume_across_expert_parallel_degrees_and_expert_tensor_parallel(pools, tmp_path):
    """FSDP 2 saved at step 6 -> FSDP 2 x TP 2 + EP 2 with tensor parallel inside the experts (each expert weight a
    2-D DTensor: experts over ep, hidden units over tp; saves step 9) -> FSDP 4 + EP 4 from step 9: the curve goes
    on through both reshardings."""
    straight_dir, etp_dir, ep4_dir = tmp_path / "fsdp2", tmp_path / "tp2_ep2_etp2", tmp_path / "ep4"
    straight = train_layout(pools, 2, (*CKPT, *MOE, *dp(4, 2)), straight_dir)
    _resume_from(straight_dir, 6, etp_dir)
    etp_layout = (*MOE, *dp(4, 2), "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree",
                  "2", "--parallelism.expert_tensor_parallel_degree", "2")
    etp = train_layout(pools, 4, (*CKPT, *etp_layout, "--checkpoint.interval", "3", "--checkpoint.last_save_in_hf",
                                  "true"), etp_dir)
    problems = compare(etp, _from_step(straight, 7))
    assert not problems, problems[:5]
    _hf_export_round_trip(pools, etp_dir, etp_layout, tmp_path / "import")
    _resume_from(etp_dir, 9, ep4_dir)
    ep4 = train_layout(pools, 4, (*CKPT, *MOE, *dp(2, 4), "--parallelism.expert_parallel_degree", "4"), ep4_dir)
    problems = compare(ep4, _from_step(straight, 10))
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
