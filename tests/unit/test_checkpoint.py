"""CheckpointManager: resharded resume (FSDP 2 ranks -> FSDP 2 ranks / 1 process), completion markers,
retention, async saves, exports, failure handling, and the conversion script.

Multi-rank cases fork gloo workers from a clean fork server (tests/unit/forked.py, about 1 s each; see
docs/architecture.md, 'CPU and gloo pitfalls'); every worker ends with
os._exit so gloo's exit-time abort cannot turn a pass into a failure.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from tests.unit.forked import run_ranks
from torchtitan.components import checkpoint_io as cio
from torchtitan.components.checkpoint import CheckpointError, CheckpointManager, TrainState, checkpoint_step_folders
from torchtitan.components.hf_io import load_hf, save_hf
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import Checkpoint
from torchtitan.config.job_config import LRScheduler as LRSchedulerConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.llama3.args import llama3_flavors
from torchtitan.models.llama3.model import Transformer


@pytest.fixture
def logs(caplog, monkeypatch):
    """caplog that also sees our logger after init_logger() turned propagation off (other tests may call it)."""
    from torchtitan.tools.logging import logger

    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.INFO, logger="torchtitan")
    return caplog


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
ARGS = dataclasses.replace(llama3_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           vocab_size=256, multiple_of=32, max_seq_len=16)
ROOT = Path(__file__).resolve().parents[2]


class FakeLoader:
    """The dataloader's checkpoint surface: four plain ints."""

    def __init__(self) -> None:
        self.state = {"sequences_consumed": 0, "next_doc": 0, "doc_token_offset": 0, "epoch": 0}

    def state_dict(self) -> dict[str, int]:
        return dict(self.state)

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.state = dict(sd)


class Run:
    """Model (FSDP over all ranks when distributed), AdamW, the real LR scheduler, loader, train state."""

    def __init__(self, tmp: Path, seed: int = 0, **cfg: Any) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        with torch.device("meta"):
            self.model = Transformer(ARGS)
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            from torchtitan.distributed.fsdp import apply_fsdp
            apply_fsdp(self.model, init_device_mesh("cpu", (world,)), param_dtype="float32",
                       reduce_dtype="float32", reshard_after_forward="default")
        self.model.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            self.model.init_weights(buffer_device=torch.device("cpu"), param_init=dist_utils.param_init)
        torch.manual_seed(1000 * seed + 7 + rank)  # per-rank data streams: each rank's RNG matters
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = build_lr_scheduler(self.opt, LRSchedulerConfig(warmup_steps=2), total_steps=10)
        self.loader, self.ts = FakeLoader(), TrainState()
        cfg.setdefault("enable", True)
        self.mgr = CheckpointManager(Checkpoint(**cfg), dump_folder=tmp, model_parts=[self.model],
                                     optimizer=OptimizersContainer([self.model], None, optimizers=[self.opt]),
                                     lr_scheduler=self.sched, dataloader=self.loader, train_state=self.ts,
                                     model_args=ARGS, world_size=world, rank=rank)

    def step(self) -> None:
        tokens = torch.randint(0, ARGS.vocab_size, (2, 9))  # drawn from the global generator
        logits = self.model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        self.ts.step += 1
        self.ts.tokens_seen += 16
        self.loader.state["sequences_consumed"] += 2
        self.loader.state["next_doc"] += 3

    def full(self) -> dict[str, Any]:
        """Full model and optimizer values (collective under FSDP)."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        out = {"model": get_model_state_dict(self.model, options=opts),
               "optim": get_optimizer_state_dict(self.model, self.opt, options=opts).get("state", {})}
        # Plain CPU tensors (Adam's step) come back as the live objects: snapshot them.
        return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert torch.equal(a, b)


def _train_and_save(rank: int, tmp: Path, mode: str) -> dict[str, Any]:
    run = Run(tmp, seed=1, interval=2, async_mode=mode)
    run.step()
    run.step()
    ref = run.full()
    run.mgr.maybe_save(2)
    draw = torch.rand(4)
    run.step()  # in async mode this overwrites parameters while the background write may still run
    run.mgr.close()
    after = run.full()
    if rank == 0:
        torch.save({"ref": ref, "after": after}, tmp / "ref.pt")
    return {"draw": draw, "sched": run.sched.state_dict()["last_epoch"]}


def _resume(rank: int, tmp: Path) -> dict[str, Any]:
    run = Run(tmp, seed=2)
    assert run.mgr.load()
    got = run.full()
    out = {"ts": run.ts.state_dict(), "loader": run.loader.state_dict(), "lr": run.opt.param_groups[0]["lr"],
           "last_epoch": run.sched.last_epoch, "draw": torch.rand(4)}
    run.step()
    after = run.full()
    run.mgr.close()
    if rank == 0:
        ref = torch.load(tmp / "ref.pt", weights_only=True)
        assert_same(got, ref["ref"])
        assert_same(after, ref["after"])  # the resumed step 3 is bitwise the original step 3
    return out


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_fsdp_resume_reshards_and_continues_bitwise(tmp_path: Path, mode: str, logs) -> None:
    saved = run_ranks(_train_and_save, tmp_path, mode)
    assert [(s, ok) for s, _, ok in checkpoint_step_folders(tmp_path / "checkpoint")] == [(2, True)]
    resumed = run_ranks(_resume, tmp_path)
    for before, after in zip(saved, resumed, strict=True):
        assert before["draw"] == after["draw"]  # each rank's generator restored
        assert after["ts"] == {"step": 2, "tokens_seen": 32, "skipped_steps": 0}
        assert after["loader"]["sequences_consumed"] == 4 and after["loader"]["next_doc"] == 6
        assert after["last_epoch"] == 2
    assert saved[0]["draw"] != saved[1]["draw"]
    # One process, no FSDP: same full values; RNG skipped (2 ranks saved it) with an info line.
    run = Run(tmp_path, seed=3)
    assert run.mgr.load()
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert_same(run.full(), ref["ref"])
    assert run.opt.param_groups[0]["lr"] == resumed[0]["lr"] and run.sched.last_epoch == 2
    assert "random generators are not restored" in logs.text


def _seed_then_export(rank: int, tmp: Path) -> None:
    run = Run(tmp, seed=5, last_save_in_hf=True)  # finds step-0, the seed checkpoint
    assert run.mgr.load() and run.ts.step == 0
    seed = run.full()["model"]
    run.step()
    run.mgr.maybe_save(1, last_step=True)
    final = run.full()["model"]
    run.mgr.close()
    if rank == 0:
        torch.save({"seed": seed, "final": final}, tmp / "ref.pt")


def _load_hf_initial(rank: int, tmp: Path, hf: Path, hf_bf16: Path) -> None:
    want = torch.load(tmp / "ref.pt", weights_only=True)["final"]
    for folder, rounding in ((hf, torch.float32), (hf_bf16, torch.bfloat16)):
        run = Run(tmp / "other", seed=6, initial_load_path=str(folder), initial_load_in_hf=True)
        assert run.mgr.load()
        got = run.full()["model"]
        run.mgr.close()
        if rank == 0:  # broadcast from rank 0 into the FSDP shards, cast to the model's float32
            assert_same(got, {k: v.to(rounding).float() for k, v in want.items()})


def test_seed_checkpoint_hf_export_and_hf_initial_load(tmp_path: Path) -> None:
    seed_run = Run(tmp_path, seed=4, create_seed_checkpoint=True)
    seed_run.mgr.save_seed_checkpoint()
    seed_values = seed_run.full()["model"]
    run_ranks(_seed_then_export, tmp_path)
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert_same(ref["seed"], seed_values)
    hf = tmp_path / "checkpoint" / "step-1-hf"
    sd, _ = load_hf(hf, ARGS)
    assert_same(sd, ref["final"])
    assert [s for s, _, ok in checkpoint_step_folders(tmp_path / "checkpoint") if ok] == [0, 1]
    save_hf(tmp_path / "hf-bf16", sd, ARGS, dtype="bfloat16")
    run_ranks(_load_hf_initial, tmp_path, hf, tmp_path / "hf-bf16")


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class DiskOnFire(BaseException):
    """Not an Exception, as DCP's own CheckpointException; module-level so that DCP can gather it."""


def _save_then_fail_on_rank1(rank: int, tmp: Path, mode: str) -> int:
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    def write_data(self, plan, planner):
        raise DiskOnFire("disk on fire")

    run = Run(tmp, seed=1, interval=1, async_mode=mode)
    run.step()
    run.mgr.maybe_save(1)
    run.mgr.wait()
    needed = run.mgr._bytes_to_write(run.mgr._full_state())  # collective: what step 1's save was checked against
    if rank == 1:
        _FileSystemWriter.write_data = write_data
    run.step()
    with pytest.raises(CheckpointError, match="step-2 failed: .*disk on fire"):
        run.mgr.maybe_save(2)
        run.mgr.wait()  # async: the failure comes from the background write
    run.mgr.close()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    mixed = {"replicated": distribute_tensor(torch.ones(10), mesh, [Replicate()]),
             "sharded": distribute_tensor(torch.ones(10), mesh, [Shard(0)]), "plain": torch.ones(3)}
    return needed, cio.tensor_bytes(mixed)


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_failed_save_on_one_rank_removes_its_partial_folder(tmp_path: Path, mode: str) -> None:
    (needed, mixed0), (needed1, mixed1) = run_ranks(_save_then_fail_on_rank1, tmp_path, mode)
    # A replicated DTensor counts on one rank (DCP writes one copy), a sharded one on each, plain tensors by key.
    overhead = cio.BYTES_PER_WRITTEN_TENSOR
    assert mixed0 == (40 + 20 + 2 * overhead, {"/plain": 12 + overhead})
    assert mixed1 == (20 + overhead, {"/plain": 12 + overhead})
    root = tmp_path / "checkpoint"
    assert [(s, ok) for s, _, ok in checkpoint_step_folders(root)] == [(1, True)]  # step-2's partial folder is gone
    # The size the free-space check uses: every shard once (FSDP over 2 ranks), equal on both ranks, and what DCP
    # then wrote give or take its metadata and the pickled plain values.
    assert needed == needed1
    on_disk = _dir_bytes(root / "step-1")
    assert 0.9 * on_disk <= needed <= 1.1 * on_disk, (needed, on_disk)


# --------------------------------------------------------------------------- one process
def read_all(path: Path) -> dict[str, Any]:
    """Every entry of a DCP folder, flat, without a model."""
    import torch.distributed.checkpoint as dcp

    md = cio.read_metadata(path)
    dest = {k: torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
            for k, v in md.state_dict_metadata.items()}
    dcp.load(dest, checkpoint_id=str(path), planner=cio.SafeLoadPlanner(flatten_state_dict=False), no_dist=True)
    return dest


def test_async_save_equals_sync_save(tmp_path: Path) -> None:
    results = []
    for mode in ("disabled", "async"):
        run = Run(tmp_path / mode, seed=1, interval=2, async_mode=mode)
        run.step()
        run.step()
        torch.manual_seed(11)
        run.mgr.maybe_save(2)
        with torch.no_grad():
            for p in run.model.parameters():
                p.add_(1.0)  # training goes on while the background write runs
        run.mgr.wait()
        results.append(read_all(tmp_path / mode / "checkpoint" / "step-2"))
        run.mgr.close()
    sync, async_ = results
    assert sync.keys() == async_.keys() and sync["train_state.step"] == 2
    assert sync["dataloader.sequences_consumed"] == 4 and sync["lr_scheduler.last_epoch"] == 2
    for k in sync:
        if isinstance(sync[k], torch.Tensor):
            assert torch.equal(sync[k], async_[k]), k
        else:
            assert sync[k] == async_[k], k


def test_checkpoint_that_does_not_fit_stops_before_writing(tmp_path: Path, monkeypatch) -> None:
    run = Run(tmp_path, seed=1, interval=1)
    run.step()
    run.mgr.maybe_save(1)
    run.mgr.wait()
    root = tmp_path / "checkpoint"
    on_disk = _dir_bytes(root / "step-1")
    needed = run.mgr._bytes_to_write(run.mgr._full_state())
    assert 0.9 * on_disk <= needed <= 1.1 * on_disk, (needed, on_disk)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(cio.shutil, "disk_usage", lambda path: usage._replace(free=on_disk // 2))
    run.step()
    with pytest.raises(CheckpointError, match=rf"cannot save step 2: no space left on {root}: checkpoint needs "
                                              r"\d\.\d MiB, \d\.\d MiB free$"):
        run.mgr.maybe_save(2)
    assert [s for s, _, _ in checkpoint_step_folders(root)] == [1]  # nothing written for step 2
    run.mgr.close()


def test_incomplete_folders_are_ignored(tmp_path: Path, logs) -> None:
    run = Run(tmp_path, seed=1, interval=1)
    for s in (1, 2):
        run.step()
        run.mgr.maybe_save(s)
    run.mgr.close()
    root = tmp_path / "checkpoint"
    shutil.copytree(root / "step-2", root / "step-3")  # copied marker names step 2: not valid here
    shutil.copytree(root / "step-2", root / "step-4")
    (root / "step-4" / ".complete").unlink()
    shutil.copytree(root / "step-2", root / "step-5")
    (root / "step-5" / ".complete").write_text('{"step": 5}')
    (root / "step-5" / ".metadata").unlink()
    assert [(s, ok) for s, _, ok in checkpoint_step_folders(root)] == [(1, True), (2, True), (3, False),
                                                                      (4, False), (5, False)]
    again = Run(tmp_path, seed=9)
    assert again.mgr.load()
    assert again.ts.step == 2
    warned = [r.getMessage() for r in logs.records if r.levelno == logging.WARNING]
    assert any("step-4 is incomplete" in m for m in warned) and any("step-5 is incomplete" in m for m in warned)
    with pytest.raises(ValueError, match=r"checkpoint.load_step=4: .*step-4 is incomplete"):
        Run(tmp_path, seed=9, load_step=4).mgr.load()
    with pytest.raises(ValueError, match=r"checkpoint.load_step=7: .*step-7 is missing"):
        Run(tmp_path, seed=9, load_step=7).mgr.load()
    one = Run(tmp_path, seed=9, load_step=1)
    assert one.mgr.load() and one.ts.step == 1


def test_exclude_from_loading(tmp_path: Path) -> None:
    run = Run(tmp_path, seed=1, interval=1)
    run.step()
    run.mgr.maybe_save(1)
    run.mgr.close()
    fresh = Run(tmp_path, seed=2, exclude_from_loading=["optimizer", "dataloader"])
    fresh.loader.state["epoch"] = 42
    assert fresh.mgr.load()
    assert fresh.opt.state_dict()["state"] == {}  # never touched, not even initialised
    assert fresh.loader.state["epoch"] == 42 and fresh.loader.state["next_doc"] == 0
    assert fresh.ts.step == 1 and fresh.sched.last_epoch == 1
    assert_same(fresh.full()["model"], run.full()["model"])
    with pytest.raises(ValueError, match="checkpoint.exclude_from_loading: unknown 'optim'"):
        Run(tmp_path, seed=2, exclude_from_loading=["optim"])
