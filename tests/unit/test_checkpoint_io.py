"""Checkpoints on one process: retention, model-only exports, failing writers, refused pickles, the pinned
staging path, config errors, and scripts/convert_checkpoint.py. Helpers live in test_checkpoint."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.unit.test_checkpoint import ARGS, Run, assert_same, read_all
from torchtitan.components import checkpoint_io as cio
from torchtitan.components.checkpoint import CheckpointError, CheckpointManager, TrainState, checkpoint_step_folders
from torchtitan.components.hf_io import load_hf
from torchtitan.config.job_config import Checkpoint
from torchtitan.models.llama3.args import llama3_flavors
from torchtitan.models.llama3.model import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
ROOT = Path(__file__).resolve().parents[2]


def test_keep_latest_k(tmp_path: Path) -> None:
    root = tmp_path / "checkpoint"
    (root / "step-1").mkdir(parents=True)  # a crashed save, superseded later: deleted
    (root / "step-9").mkdir()  # newer than every complete one: kept
    (root / "step-3-hf").mkdir()  # exports are never touched
    run = Run(tmp_path, seed=1, interval=1, keep_latest_k=2)
    for s in range(2, 7):
        run.step()
        run.mgr.maybe_save(s)
    run.mgr.close()
    assert [(s, ok) for s, _, ok in checkpoint_step_folders(root)] == [(5, True), (6, True), (9, False)]
    assert (root / "step-3-hf").is_dir()
    assert cio.purge(root, 1) == [root / "step-5"]
    assert cio.purge(root, 1) == []  # the newest complete one always stays
    assert [s for s, _, _ in checkpoint_step_folders(root)] == [6, 9]


def test_last_step_model_only_bf16(tmp_path: Path) -> None:
    run = Run(tmp_path, seed=1, interval=100, export_dtype="bfloat16", async_mode="async")
    run.step()
    run.mgr.maybe_save(3)  # not due
    run.mgr.maybe_save(3, last_step=True)
    run.mgr.close()
    # The last step keeps the full state (so the run can be extended) and adds the model-only export beside it.
    assert not cio.read_marker(tmp_path / "checkpoint" / "step-3")["model_only"]
    path = tmp_path / "checkpoint" / "step-3-model"
    md = cio.read_metadata(path)
    assert all(k.startswith("model.") for k in md.state_dict_metadata)
    assert {v.properties.dtype for v in md.state_dict_metadata.values()} == {torch.bfloat16}
    assert cio.read_marker(path)["model_only"] is True
    other = Run(tmp_path / "x", seed=3, initial_load_path=str(path), initial_load_model_only=True)
    assert other.mgr.load() and other.ts.step == 0
    want = {k: v.to(torch.bfloat16).float() for k, v in run.full()["model"].items()}
    assert_same(other.full()["model"], want)


class Boom(BaseException):
    pass


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_failing_writer_leaves_no_folder(tmp_path: Path, monkeypatch, mode: str) -> None:
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    def write_data(self, plan, planner):
        raise Boom("simulated I/O failure")

    monkeypatch.setattr(_FileSystemWriter, "write_data", write_data)
    run = Run(tmp_path, seed=1, interval=1, async_mode=mode)
    run.step()
    with pytest.raises(CheckpointError, match="simulated I/O failure"):
        run.mgr.maybe_save(1)
        run.mgr.wait()
    run.mgr.close()
    assert checkpoint_step_folders(tmp_path / "checkpoint") == []  # the failed save's partial folder is removed
    assert not Run(tmp_path, seed=1).mgr.load()


def test_pickled_objects_are_refused(tmp_path: Path) -> None:
    run = Run(tmp_path, seed=1, interval=1)
    run.step()
    run.mgr.maybe_save(1)
    run.mgr.close()
    path = tmp_path / "checkpoint" / "step-1"
    dcp.save({"train_state": {"step": Boom("x"), "tokens_seen": 0}}, checkpoint_id=str(tmp_path / "evil"),
             no_dist=True)
    shutil.copy(tmp_path / "evil" / ".metadata", path / ".metadata")
    for f in (tmp_path / "evil").glob("*.distcp"):
        shutil.copy(f, path / f.name)
    with pytest.raises(CheckpointError, match="loading"):
        Run(tmp_path, seed=2).mgr.load()

    class Sched:
        def state_dict(self) -> dict[str, Any]:
            return {"fn": Boom}

    run = Run(tmp_path / "y", seed=1, interval=1)
    run.mgr.lr_scheduler = Sched()
    with pytest.raises(TypeError, match="lr_scheduler.fn is a type"):
        run.mgr.maybe_save(1, force=True)


def test_convert_script(tmp_path: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "scripts" / "convert_checkpoint.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    flavor = "debugmodel"
    args = llama3_flavors[flavor]
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    step = tmp_path / "step-4"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    cio.write_marker(step, {"step": 4, "world_size": 1, "model_only": True})
    want = {k: v for k, v in model.state_dict().items()}

    assert conv.main(["dcp-to-hf", str(step), str(tmp_path / "hf"), "--flavor", flavor, "--dtype", "float32",
                      "--no-tokenizer"]) == 0
    sd, _ = load_hf(tmp_path / "hf", args)
    assert_same(sd, want)
    assert conv.main(["hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "back" / "step-0")]) == 0
    assert checkpoint_step_folders(tmp_path / "back")[0][2]
    assert conv.main(["dcp-to-pt", str(tmp_path / "back" / "step-0"), str(tmp_path / "m.pt")]) == 0
    assert_same(torch.load(tmp_path / "m.pt", weights_only=True), want)
    # The converted folder initialises a run (model only).
    other = Transformer(args)
    mgr = CheckpointManager(Checkpoint(initial_load_path=str(tmp_path / "back" / "step-0")), dump_folder=tmp_path,
                            model_parts=[other], optimizer=None, lr_scheduler=None, dataloader=None,
                            train_state=TrainState(),
                            model_args=args, world_size=1, rank=0)
    assert mgr.load()
    assert_same(other.state_dict(), want)
    assert conv.main(["dcp-to-hf", str(tmp_path / "nope"), str(tmp_path / "o"), "--flavor", flavor]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0]
    assert conv.main(["dcp-to-hf", str(step), str(tmp_path / "o"), "--flavor", "1B"]) == 2


def test_pinned_mode_reuses_its_staging_buffers(tmp_path: Path, monkeypatch) -> None:
    # No CUDA here: pretend, with pinning as a no-op, to run the cached-staging path end to end.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    run = Run(tmp_path, seed=1, interval=1, async_mode="async_with_pinned_mem")
    assert run.mgr._mode == "async_with_pinned_mem"
    for s in (1, 2):
        run.step()
        run.mgr.maybe_save(s)
        want = run.full()["model"]
        with torch.no_grad():
            for p in run.model.parameters():
                p.mul_(0.0)  # must not reach the checkpoint being written
        run.mgr.wait()
        got = read_all(tmp_path / "checkpoint" / f"step-{s}")
        assert_same({k[len("model."):]: v for k, v in got.items() if k.startswith("model.")}, want)
        assert got["train_state.step"] == s
        with torch.no_grad():
            for p, v in zip(run.model.parameters(), want.values(), strict=True):
                p.copy_(v)
    assert run.mgr._writer.state_dict_cache is not None  # one set of staging buffers, reused
    run.mgr.close()


def test_when_saves_happen_and_config_errors(tmp_path: Path) -> None:
    run = Run(tmp_path, seed=1, interval=5, enable_first_step_checkpoint=True, last_save_model_only=False)
    for s in range(1, 8):
        run.step()
        run.mgr.maybe_save(s, force=s == 3, last_step=s == 7)
    run.mgr.maybe_save(7, force=True)  # already saved at this step: nothing to do
    run.mgr.close()
    assert [(s, ok) for s, _, ok in checkpoint_step_folders(tmp_path / "checkpoint")] == \
        [(1, True), (3, True), (5, True), (7, True)]
    assert not Run(tmp_path / "off", seed=1, enable=False).mgr.load()
    for bad, key in (({"async_mode": "later"}, "checkpoint.async_mode"), ({"export_dtype": "fp8"}, "export_dtype"),
                     ({"interval": 0}, "checkpoint.interval"), ({"keep_latest_k": -1}, "keep_latest_k")):
        with pytest.raises(ValueError, match=key):
            Run(tmp_path, seed=1, **bad)
    mgr = CheckpointManager(Checkpoint(create_seed_checkpoint=True), dump_folder=tmp_path,
                            model_parts=[Transformer(ARGS)],
                            optimizer=None, lr_scheduler=None, dataloader=None, train_state=TrainState(),
                            model_args=ARGS, world_size=2, rank=0)
    with pytest.raises(ValueError, match="checkpoint.create_seed_checkpoint"):
        mgr.save_seed_checkpoint()
    with pytest.raises(FileNotFoundError, match="checkpoint.initial_load_path"):
        Run(tmp_path / "new", seed=1, initial_load_path=str(tmp_path / "absent")).mgr.load()


def test_a_finished_run_resumes_from_its_full_final_state(tmp_path: Path) -> None:
    run = Run(tmp_path, seed=1, interval=2)  # last_save_model_only is the default
    for s in range(1, 6):
        run.step()
        run.mgr.maybe_save(s, last_step=s == 5)
    run.mgr.close()
    assert not cio.read_marker(tmp_path / "checkpoint" / "step-5")["model_only"]
    assert cio.read_marker(tmp_path / "checkpoint" / "step-5-model")["model_only"]
    longer = Run(tmp_path, seed=2)
    assert longer.mgr.load() and longer.ts.step == 5 and longer.opt.state  # the full state, not the export
    longer.mgr.check_continuation(10)
    behind = Run(tmp_path, seed=2, load_step=4)
    assert behind.mgr.load() and behind.ts.step == 4
    with pytest.raises(ValueError, match="step-5, step-5-model from a run that got further than step 4"):
        behind.mgr.check_continuation(10)  # continuing would overwrite step-5 and its export
    with pytest.raises(ValueError, match="training.steps=3 is below step 5"):
        longer.mgr.check_continuation(3)


def test_a_model_only_newest_checkpoint_is_not_resumed_silently(tmp_path: Path) -> None:
    """Final saves of earlier versions were model-only `step-N` folders: resuming from one restarted the optimizer,
    the schedule and the data position with only a warning."""
    run = Run(tmp_path, seed=1, interval=2)
    for s in range(1, 5):
        run.step()
        run.mgr.maybe_save(s)
    run.mgr._save(5, model_only=True, dtype=None)  # what the final save used to write
    run.mgr.close()
    with pytest.raises(ValueError, match="step-5 holds model weights only.*initial_load_path.*step-4"):
        Run(tmp_path, seed=2).mgr.load()


def test_a_complete_checkpoint_is_never_overwritten(tmp_path: Path) -> None:
    run = Run(tmp_path, seed=1, interval=1)
    run.step()
    run.mgr.maybe_save(1)
    run.mgr.wait()
    run.mgr._last_saved = None
    with pytest.raises(CheckpointError, match="never overwrites"):
        run.mgr.maybe_save(1)


def test_purge_never_deletes_the_checkpoint_just_published(tmp_path: Path) -> None:
    for s in (2, 4, 6):
        (tmp_path / f"step-{s}").mkdir()
        (tmp_path / f"step-{s}" / ".metadata").touch()
        cio.write_marker(tmp_path / f"step-{s}", {"step": s})
    # A run resumed from step 1 just wrote step-2 beside the newer folders of the run it abandoned.
    assert cio.purge(tmp_path, 2, keep=tmp_path / "step-2") == []
    assert cio.purge(tmp_path, 2) == [tmp_path / "step-2"]
