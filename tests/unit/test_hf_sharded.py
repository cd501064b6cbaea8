"""Hugging Face export and import by shard (torchtitan/components/hf_sharded.py) on forked gloo ranks, FSDP 2, TP 2,
FSDP 2 x TP 2 (strided shards) and HSDP 2 x 2 (replicas): the folder loads in transformers with our logits, imports
back equal to the single-process `load_hf`, and what each rank allocates during the call is bounded by its own
largest shard; at 405B scale (one block, FSDP 8 x TP 8, rank 0 under a fake process group) by its shards and the
I/O chunk."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import traceback
import tracemalloc
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from tests.unit.forked import run_ranks  # noqa: E402
from torchtitan.components.hf_io import load_hf, save_hf  # noqa: E402
from torchtitan.components.hf_sharded import load_hf_sharded, save_hf_sharded  # noqa: E402
from torchtitan.models.llama3.args import llama3_flavors  # noqa: E402
from torchtitan.models.llama3.model import Transformer  # noqa: E402
from torchtitan.tools.profiling import allocator_peak  # noqa: E402

# 4 equal blocks (3.0 MiB each in float32) and a small vocabulary, so the model is dominated by its blocks (14.0 MiB
# in all) and one block is 1/4 of it. The bound checked is per rank (twice its largest shard, 0.5 or 1.0 MiB here),
# below one block whatever the block count, so a gathered block or tensor shows with 4 as with more; 4 keep the
# file layout (one file per block, one for the rest) at half the ranks' work of the 8 used before.
ARGS = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=4, vocab_size=1024)
TOL = 1e-4
_TP_PLAN = {f"layers.*.{name}": style for style, names in (
    (ColwiseParallel(), ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")),
    (RowwiseParallel(), ("attention.wo", "feed_forward.w2"))) for name in names}


def _model(seed: int) -> Transformer:
    """Sharpened attention (wq, wk x4) and random norms, so a wrong rotary permutation or a swapped norm shows."""
    torch.manual_seed(seed)
    model = Transformer(ARGS)
    model.init_weights()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("wq.weight", "wk.weight")):
                p.mul_(4.0)
            elif name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    return model.eval()


def _shard(model: Transformer, layout: str) -> Transformer:
    if layout == "fsdp_tp":
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh2d["tp"], _TP_PLAN)
        mesh = mesh2d["dp"]
    elif layout == "hsdp":  # FSDP 2 inside, 2 replicas: (Replicate, Shard(0)) placements, half the ranks write
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if layout in ("fsdp", "fsdp_tp", "hsdp"):
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        parallelize_module(model, mesh, _TP_PLAN)
    assert any(isinstance(p, DTensor) for p in model.parameters())
    return model


def _nan_sharded(layout: str) -> Transformer:
    """The import's destination, sharded as the export's model but built on meta as the trainer builds it, every
    local element NaN: one the import leaves unwritten cannot equal the reference."""
    with torch.device("meta"):
        model = _shard(Transformer(ARGS), layout)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).fill_(float("nan"))
    return model


def _full(model: Transformer) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _assert_equals_saved(got: dict[str, torch.Tensor], want: Path) -> None:
    ref = torch.load(want, weights_only=True)
    assert set(got) == set(ref)
    for key, t in ref.items():
        assert torch.equal(got[key], t), key


def _largest_shard(model: Transformer) -> int:
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return max(t.numel() * t.element_size() for t in local)


def _export(rank: int, folder: Path, layout: str, model: Transformer) -> tuple[int, int]:
    model = _shard(model, layout)
    sd = model.state_dict()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        save_hf_sharded(folder, sd, ARGS, model="llama3")
    return allocator_peak(prof, since_start=True), _largest_shard(model)


def _import(rank: int, folder: Path, layout: str, want: Path) -> tuple[int, int]:
    model = _nan_sharded(layout)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        load_hf_sharded(folder, [model], ARGS, model="llama3")
    peak = allocator_peak(prof, since_start=True), _largest_shard(model)
    got = _full(model)  # collective: every rank gathers
    if rank == 0:
        _assert_equals_saved(got, want)
    return peak


# Layouts of one world size share their forked ranks: one fork, process group and model build per world size instead
# of one per export and per import.
LAYOUTS = [("fsdp", 2), ("tp", 2), ("fsdp_tp", 4), ("hsdp", 4)]


def _export_import(rank: int, root: Path, layouts: list[str], want: Path) -> dict[str, dict]:
    """Each layout's export into root/<layout>/hf, then its import into a fresh model; a layout that raises reports
    its traceback and the next still runs."""
    out = {}
    model = _model(0)  # built once, a copy sharded per layout
    for layout in layouts:
        try:
            out[layout] = {"export": _export(rank, root / layout / "hf", layout, copy.deepcopy(model)),
                           "import": _import(rank, root / layout / "hf", layout, want), "error": None}
        except Exception:
            out[layout] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Transformer, dict[str, torch.Tensor]]:
    """The model every layout exports, its single-process export read back (what every import must equal, saved as
    want.pt for the ranks) and the folder the layouts write under."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf_sharded")
    ours = _model(0)
    ref, _ = load_hf(save_hf(root / "single", ours.state_dict(), ARGS, model="llama3"), ARGS)
    torch.save(ref, root / "want.pt")
    return root, ours, ref


@pytest.fixture(scope="module")
def by_shard(single_process):
    """layout -> every rank's (export, import) results, the ranks of a world size run on the first request."""
    root = single_process[0]
    runs: dict[int, list[dict]] = {}

    def results(layout: str) -> list[dict]:
        world = dict(LAYOUTS)[layout]
        if world not in runs:
            layouts = [name for name, w in LAYOUTS if w == world]
            for name in layouts:
                (root / name).mkdir()
            runs[world] = run_ranks(_export_import, root, layouts, root / "want.pt", world=world, timeout=300)
        return [r[layout] for r in runs[world]]

    return results


@pytest.mark.parametrize(("layout", "world"), LAYOUTS)
def test_export_and_import_by_shard(single_process, by_shard, layout: str, world: int) -> None:
    import transformers

    root, ours, ref = single_process
    per_rank = by_shard(layout)
    assert len(per_rank) == world
    for r in per_rank:
        assert r["error"] is None, r["error"]
    folder = root / layout / "hf"

    # HF's layout: one file per group (embeddings/norm/output, then each block), an index, config.json.
    files = sorted(p.name for p in folder.iterdir())
    n = ARGS.n_layers + 1
    assert files == sorted([f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
                           + ["model.safetensors.index.json", "config.json"])
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.3.self_attn.q_proj.weight"] == f"model-00005-of-{n:05d}.safetensors"

    # The same bytes as the single-process export, and transformers' logits equal ours.
    got, _ = load_hf(folder, ARGS)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf.eval()(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.3g}"

    # Import by shard into a fresh sharded model equals the single-process import (checked on rank 0 in _import).
    # Per rank, everything allocated during the call: the rows of one shard in flight (taken, then converted) and
    # index vectors, so at most twice the rank's largest shard, plus 64 KiB; never a gathered tensor or block.
    export_peaks = [r["export"] for r in per_rank]
    import_peaks = [r["import"] for r in per_rank]
    total = sum(p.numel() * p.element_size() for p in ours.parameters())
    block = sum(p.numel() * p.element_size() for p in ours.layers["0"].parameters())
    for peak, largest in export_peaks + import_peaks:
        assert peak <= 2 * largest + (64 << 10), (export_peaks, import_peaks, total, block)
    print(f"\n{layout}: model {total / 2**20:.1f} MiB, block {block / 2**20:.2f} MiB, largest shard "
          f"{export_peaks[0][1] / 2**20:.2f} MiB, export peaks {[round(p / 2**20, 2) for p, _ in export_peaks]} MiB, "
          f"import peaks {[round(p / 2**20, 2) for p, _ in import_peaks]} MiB")


# ---------------------------------------------------------------------------------------------
# MoE models: experts split per expert on export and stacked again on import, DeepSeek-V3's float32 routing bias
# ---------------------------------------------------------------------------------------------


def _moe_model(name: str, seed: int) -> torch.nn.Module:
    from torchtitan.models.deepseek_v3.args import deepseek_v3_flavors
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Transformer
    from torchtitan.models.qwen3.args import qwen3_flavors
    from torchtitan.models.qwen3.model import Qwen3Transformer

    torch.manual_seed(seed)
    if name == "qwen3":
        model = Qwen3Transformer(dataclasses.replace(qwen3_flavors["debugmodel_moe"], vocab_size=1024, n_layers=2))
    else:
        model = DeepSeekV3Transformer(deepseek_v3_flavors["debugmodel_small"])
    model.init_weights()
    with torch.no_grad():
        for key, buf in model.named_buffers():
            if key.endswith("expert_bias") and name == "deepseek_v3":  # Qwen3 has no routing bias on HF's side
                buf.copy_(torch.randn(buf.shape) * 0.3)
    return model


def _moe_export_import(rank: int, name: str, folder: Path, want: Path) -> None:
    model = _moe_model(name, 0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    save_hf_sharded(folder, model.state_dict(), model.model_args, dtype="bfloat16", model=name)
    fresh = _moe_model(name, 5)
    for block in fresh.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    load_hf_sharded(folder, [fresh], fresh.model_args, model=name)
    got = _full(fresh)
    if rank == 0:
        _assert_equals_saved(got, want)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_moe_export_and_import_by_shard_match_single_process(tmp_path: Path, name: str) -> None:
    model = _moe_model(name, 0)
    args = model.model_args
    single = save_hf(tmp_path / "single", model.state_dict(), args, dtype="bfloat16", model=name)
    ref, _ = load_hf(single, args, model=name)
    # What a single-process import leaves in the model (bfloat16 values cast into float32 parameters).
    model.load_state_dict(ref)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp_path / "want.pt")
    run_ranks(_moe_export_import, name, tmp_path / "hf", tmp_path / "want.pt")
    got, _ = load_hf(tmp_path / "hf", args, model=name)
    assert set(got) == set(ref)
    for key, t in ref.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key


# ---------------------------------------------------------------------------------------------------------------
# At 405B scale: rank 0 of one block under FSDP 8 x TP 8 (fake process group), export and import of its own rows
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _numpy_peak():
    """The peak of what tracemalloc sees in the block: numpy's buffers (the file maps' copies), which torch's
    allocator, and so the profiler, does not."""
    peak = [0]
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def _io_405b_block(folder: Path) -> dict:
    """Rank 0's rows of a 405B-shaped block (FSDP 8 x TP 8, 64 ranks, the others absent under a fake process
    group) written into the planned files and read back into a second model: the allocator's peak of each.

    What is measured is the I/O alone, so the shards' values need not be the trainer's initialisation (a hashed
    fill of 110M elements, 7 s of CPU, tested in test_init_by_shard.py): the exported shards are uniform draws (a
    misplaced row cannot round-trip equal) and the import's destination starts all NaN (a row it misses cannot)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.components import hf_io, hf_sharded
    from torchtitan.components.model_parts import model_state_dict
    from torchtitan.components.safetensors_slices import create_file
    from torchtitan.config.manager import load_config
    from torchtitan.estimation.engine import build_parallel_model

    cfg, resolved = load_config(["--job.config_file", "train_configs/llama3_405b.toml"], 64)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
    args = dataclasses.replace(llama3_flavors["405B"], n_layers=1)
    gen = torch.Generator().manual_seed(0)
    models = []
    for fill in ("uniform", "nan"):
        parts, _, _ = build_parallel_model(cfg, resolved.parallel_dims, "cpu", n_layers=1, ddp=False)
        for part in parts:
            part.to_empty(device="cpu")
        with torch.no_grad():
            for p in (p for part in parts for p in part.parameters()):
                if fill == "uniform":
                    p.to_local().uniform_(-1.0, 1.0, generator=gen)
                else:
                    p.to_local().fill_(float("nan"))
        models.append(parts)
    sd = model_state_dict(models[0])
    adapter = hf_io.adapter_for("llama3", args)(args)
    # The export's steps on this rank (the element count check would fail: 63 ranks write nothing here).
    shapes, links = hf_sharded._plan(adapter, sd, torch.float32, ())
    files, entries = hf_sharded._files(folder, shapes)
    for name, (head, ents) in files.items():
        create_file(folder / name, head, ents)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, _numpy_peak() as export_numpy:
        hf_sharded._write_own(sd, links, entries, set(sd))
    export_peak = allocator_peak(prof)
    hf_io._write_json(folder / hf_io.INDEX_NAME, {"metadata": {}, "weight_map": {k: e.path.name
                                                                                 for k, e in entries.items()}})
    hf_io._write_json(folder / hf_io.CONFIG_NAME, adapter.hf_config(args))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, _numpy_peak() as import_numpy:
        hf_sharded.load_hf_sharded(folder, models[1], args, model="llama3")
    local = [(a.to_local(), b.to_local()) for a, b in zip(sd.values(), model_state_dict(models[1]).values(),
                                                          strict=True)]
    return {"export_peak": export_peak, "import_peak": allocator_peak(prof), "export_numpy_peak": export_numpy[0],
            "import_numpy_peak": import_numpy[0],
            "local_bytes": sum(a.numel() * a.element_size() for a, _ in local),
            "largest_local": max(a.numel() * a.element_size() for a, _ in local),
            "round_trip": all(torch.equal(a, b) for a, b in local)}


def test_io_of_a_405b_block_is_bounded_by_the_chunk(tmp_path: Path) -> None:
    from tests.unit.forked import in_child
    from torchtitan.components.hf_sharded import CHUNK_BYTES

    got = in_child(_io_405b_block, tmp_path)
    assert got["round_trip"], got
    # One chunk of rows in flight (taken from the shard, or read from the file) plus index vectors (int64 per
    # local row): never a full tensor (w1 is 3.5 GB) nor the rank's shards (440 MiB).
    for peak in (got["export_peak"], got["import_peak"]):
        assert peak <= CHUNK_BYTES + (16 << 20), got
    # ... and nothing of that size outside torch's allocator (numpy copies the whole column slice of a row-wise TP
    # shard when asked to gather rows from a non-contiguous view: 436 MB here)
    for peak in (got["export_numpy_peak"], got["import_numpy_peak"]):
        assert peak <= 16 << 20, got
    print(f"\n405B block, FSDP 8 x TP 8, rank 0: shards {got['local_bytes'] / 2**20:.1f} MiB (largest "
          f"{got['largest_local'] / 2**20:.1f}), export peak {got['export_peak'] / 2**20:.1f} MiB, import peak "
          f"{got['import_peak'] / 2**20:.1f} MiB")


def test_an_export_with_unwritten_rows_fails_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    """The written-element check is what makes a hole impossible to publish: with no rank electing itself writer
    (a broken election), the export fails by name and neither the folder nor its temporary stays behind."""
    from torchtitan.components import hf_sharded

    monkeypatch.setattr(hf_sharded, "_elect_writers", lambda *args: set())
    with pytest.raises(RuntimeError, match="got 0 of .* elements"):
        save_hf_sharded(tmp_path / "hf", _model(0).state_dict(), ARGS, model="llama3")
    assert list(tmp_path.iterdir()) == []


def _convert_script():
    from tests.scripts import load_script

    return load_script("convert_checkpoint")


def _convert_on_rank(rank: int, step: Path, out: Path, back: Path) -> None:
    conv = _convert_script()
    # --no-tokenizer: the default one lives in the user's cache, outside tmp_path (test_hf_adapter.py covers it).
    assert conv.main(["dcp-to-hf", str(step), str(out), "--flavor", "debugmodel", "--dtype", "float32",
                      "--no-tokenizer"]) == 0
    assert conv.main(["hf-to-dcp", str(out), str(back), "--model", "llama3", "--flavor", "debugmodel"]) == 0


def test_convert_script_dcp_to_hf_by_shard_on_two_ranks(tmp_path: Path) -> None:
    """scripts/convert_checkpoint.py dcp-to-hf and back (hf-to-dcp) as under `torchrun --nproc_per_node 2`: each
    rank loads its FSDP shard (from the DCP folder, here saved in bfloat16 and cast on load, then from the
    Hugging Face files) and writes it; both folders hold the checkpoint's weights exactly, as the one-process
    conversion's does."""
    import torch.distributed.checkpoint as dcp

    from torchtitan.components import checkpoint_io as cio

    torch.manual_seed(0)
    model = Transformer(llama3_flavors["debugmodel"])
    model.init_weights()
    want = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    step = tmp_path / "step-5"
    dcp.save({"model": want}, checkpoint_id=str(step), no_dist=True)
    cio.write_marker(step, {"step": 5, "world_size": 1, "model_only": True})
    run_ranks(_convert_on_rank, step, tmp_path / "two", tmp_path / "back" / "step-5")
    assert _convert_script().main(["dcp-to-hf", str(step), str(tmp_path / "one"), "--flavor", "debugmodel",
                                   "--dtype", "float32", "--no-tokenizer"]) == 0
    for folder in ("two", "one"):
        got, _ = load_hf(tmp_path / folder, llama3_flavors["debugmodel"])
        assert set(got) == set(want) and all(torch.equal(got[k], want[k].float()) for k in want), folder
    back = {k.removeprefix("model."): v for k, v in cio.load_full_model_state(tmp_path / "back" / "step-5").items()}
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k].float()) for k in want)
