"""Hugging Face export and import by layer on every rank, without gathering the model anywhere.

`save_hf` / `load_hf` (hf_io.py) work on one full state dict: with FSDP/TP the trainer gathers the whole model on
rank 0 (export) or reads it on rank 0 and broadcasts it (import), so rank 0 needs host memory for the full model.
Here the work goes one *group* at a time: a group is one transformer block (every key under `layers.{i}.`) or the
rest (embeddings, final norm, output). Per rank the extra memory is one group's full tensors, about
1/n_layers of the model, whatever the model's size.

Export (`save_hf_sharded`), on every rank of the job, groups in a fixed order:

* every rank calls `full_tensor()` on each DTensor of the group, in the same order: it is an all-gather over the
  parameter's own mesh (FSDP, TP or both), a collective every rank of that mesh must join;
* the group's writer (group index modulo world size, so files spread over ranks) runs the model's adapter `to_hf`
  on the group and writes one file `model-0000k-of-0000N.safetensors`; the other ranks drop the tensors at once;
* at the end one `all_gather_object` on `group` brings every writer's key -> file map (or its error) to every
  rank; rank 0 writes `model.safetensors.index.json` and config.json and publishes the folder atomically.

The adapter needs no change: it is given the whole state dict, with the group's real tensors and, for every other
key, a stand-in of the right shape that holds no memory (a meta tensor; 1-D keys, norms and routing biases, are
real zeros because adapters look at their values). Only outputs whose key belongs to the group are kept, so
renames, rotary permutations inside heads and the splitting/stacking of experts all apply exactly as in `save_hf`.

Import (`load_hf_sharded`): every rank reads the group's Hugging Face tensors (safetensors `safe_open`, only those
keys; the other keys' shapes come from the file headers), runs `from_hf` the same way, and copies into each
parameter's local shard only the slice it owns (`distribute_tensor(..., src_data_rank=None)`: DTensor cuts its own
placements, _StridedShard included, without communication). Only a final all_gather_object reports errors. Each
rank reads the whole file set once, so disk reads are world-size times the model; memory stays one group.

Both need the same parameters on every rank: pipeline parallel (ranks holding different layers) uses hf_io.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.components import hf_io
from torchtitan.tools.fs import fsync_dir

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_TOP = -1  # group of every key outside the blocks


def group_of(key: str) -> int:
    """Block index of an our- or HF-side key (`layers.3.` / `model.layers.3.`), `_TOP` for the rest."""
    m = _LAYER.match(key)
    return int(m.group(1)) if m else _TOP


def _stand_in(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> Tensor:
    # Meta holds no memory; 1-D tensors are real zeros since adapters test values there (a nonzero routing bias).
    if len(shape) == 1:
        return torch.zeros(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype, device="meta")


def _convert(fn: Any, real: dict[str, Tensor], stand_ins: dict[str, Tensor], group: int) -> dict[str, Tensor]:
    """`fn` (an adapter's to_hf / from_hf) on the stand-ins overlaid with `real`; the outputs of `group` only."""
    out = fn({**stand_ins, **real})
    kept = {k: v for k, v in out.items() if group_of(k) == group}
    meta = [k for k, v in kept.items() if v.is_meta]
    if meta:  # a conversion mixing blocks would need a larger group: fail rather than write an empty tensor
        raise RuntimeError(f"'{meta[0]}' depends on keys outside its block; use save_hf / load_hf")
    return kept


def _groups(keys: list[str]) -> list[int]:
    """Group order: embeddings and the rest first (as HF's files do), then blocks in index order."""
    return sorted({group_of(k) for k in keys})


def _world(pg: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(pg), dist.get_world_size(pg)


def save_hf_sharded(
    folder: str | os.PathLike[str],
    state_dict: dict[str, Any],
    model_args: Any,
    dtype: str = "float32",
    bos_id: int | None = None,
    eos_id: int | None = None,
    *,
    model: str | type | None = None,
    pg: dist.ProcessGroup | None = None,
) -> Path:
    """Collective over `pg` (default: the world): write our sharded (DTensor) or plain state dict as an HF folder.

    Every rank passes its own `model_state_dict(parts)` (same keys everywhere, no pipeline parallel) and the same
    arguments; the folder must be on a filesystem every rank sees. Returns the folder on every rank; a failure on
    any rank raises on every rank and leaves no folder behind.
    """
    folder = Path(folder)
    if dtype not in hf_io._DTYPES:
        raise ValueError(f"dtype '{dtype}' is not supported; use one of {', '.join(hf_io._DTYPES)}")
    rank, world = _world(pg)
    adapter_cls = hf_io.adapter_for(model, model_args)
    adapter = adapter_cls(model_args)
    target = hf_io._DTYPES[dtype]
    fp32 = tuple(getattr(adapter_cls, "FLOAT32_HF_KEY_SUFFIXES", ()))
    # Stand-ins keep a tied model's aliasing (output.weight is tok_embeddings.weight): one stand-in per tensor.
    by_id: dict[int, Tensor] = {}
    stand_ins = {k: by_id.setdefault(id(v), _stand_in(v.shape, v.dtype)) for k, v in state_dict.items()}
    groups = _groups(list(state_dict))
    n = len(groups)

    # Rank 0 names the temporary folder (hidden sibling, so the final rename is atomic) and tells the others.
    box: list[Any] = [None]
    if rank == 0:
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            box[0] = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            box[0].mkdir()
        except OSError as e:  # sent instead of the name, so no rank waits in an all-gather rank 0 never joins
            box[0] = f"rank 0: {type(e).__name__}: {e}"
    if world > 1:
        dist.broadcast_object_list(box, src=0, group=pg)
    if isinstance(box[0], str):
        raise RuntimeError(f"Hugging Face export by shard to {folder} failed: {box[0]}")
    tmp: Path = box[0]

    weight_map: dict[str, str] = {}
    total = 0
    error: str | None = None
    for k, g in enumerate(groups, start=1):
        writer = (k - 1) % world
        real: dict[str, Tensor] = {}
        gathered: dict[int, Tensor] = {}
        for key, v in state_dict.items():
            if group_of(key) != g:
                continue
            if id(v) not in gathered:
                # All-gather over the parameter's mesh: every rank must call it, in this same order.
                full = v.full_tensor() if isinstance(v, DTensor) else v
                gathered[id(v)] = full.detach().cpu() if rank == writer else full.new_empty(0)
                del full  # a non-writer keeps nothing of the group
            real[key] = gathered[id(v)]
        if rank != writer or error is not None:
            continue
        try:
            hf_sd = _convert(adapter.to_hf, real, stand_ins, g)
            # Keys the adapter keeps in float32 whatever `dtype` (see save_hf).
            part = {key: t.detach().to(dtype=torch.float32 if key.endswith(fp32) else target).contiguous()
                    for key, t in hf_sd.items()}
            name = hf_io._shard_name(k, n)
            save_file(part, str(tmp / name), metadata={"format": "pt"})
            hf_io._fsync_file(tmp / name)
            for key, t in part.items():
                weight_map[key] = name
                total += t.numel() * t.element_size()
        except Exception as e:  # reported after the loop: leaving it early would hang the others' all-gathers
            error = f"rank {rank}: {type(e).__name__}: {e}"
        del real, gathered

    # Every rank learns every writer's files, and whether any rank failed.
    reports: list[Any] = [(weight_map, total, error)]
    if world > 1:
        reports = [None] * world
        dist.all_gather_object(reports, (weight_map, total, error), group=pg)
    errors = [e for _, _, e in reports if e]
    if rank == 0 and not errors:
        try:
            merged = {key: name for wm, _, _ in reports for key, name in wm.items()}
            hf_io._write_json(tmp / hf_io.INDEX_NAME, {"metadata": {"total_size": sum(t for _, t, _ in reports)},
                                                       "weight_map": merged})
            config = adapter_cls.hf_config(model_args, dtype, bos_id=bos_id, eos_id=eos_id)
            hf_io._write_json(tmp / hf_io.CONFIG_NAME, config)
            fsync_dir(tmp)
            hf_io._publish(tmp, folder)
        except Exception as e:
            errors.append(f"rank 0: {type(e).__name__}: {e}")
    if world > 1:  # rank 0's outcome (publishing) to everyone
        box = [errors]
        dist.broadcast_object_list(box, src=0, group=pg)
        errors = box[0]
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"Hugging Face export by shard to {folder} failed: {'; '.join(errors)}")
    return folder


def _key_files(folder: Path) -> dict[str, Path]:
    """HF key -> the safetensors file holding it, from the index or the single file."""
    single, index = folder / hf_io.SINGLE_NAME, folder / hf_io.INDEX_NAME
    if single.is_file() and index.is_file():
        raise ValueError(f"{folder}: has both {hf_io.SINGLE_NAME} and {hf_io.INDEX_NAME}; remove the stale one")
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {key: single for key in f.keys()}
    if not index.is_file():
        raise FileNotFoundError(f"{folder}: no {hf_io.SINGLE_NAME} or {hf_io.INDEX_NAME}")
    weight_map = hf_io._read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: missing or empty 'weight_map'")
    out: dict[str, Path] = {}
    for key, name in weight_map.items():
        # Names come from a possibly downloaded file: refuse anything outside the folder.
        if not isinstance(name, str) or Path(name).name != name:
            raise ValueError(f"{index}: shard name {name!r} is not a plain file name")
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name}: shard listed in {hf_io.INDEX_NAME} is missing")
        out[key] = folder / name
    return out


def _read(files: dict[str, Path], keys: list[str]) -> dict[str, Tensor]:
    """Only `keys`, opening each file once (safe_open maps the file and copies out just these tensors)."""
    out: dict[str, Tensor] = {}
    for path in sorted({files[k] for k in keys}):
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            for key in keys:
                if files[key] == path:
                    if key not in present:
                        raise KeyError(f"{path}: tensor '{key}' is listed but not found in its shard")
                    out[key] = f.get_tensor(key)
    return out


def _headers(files: dict[str, Path]) -> dict[str, Tensor]:
    """A stand-in for every HF key, from the file headers only (no tensor data is read)."""
    out: dict[str, Tensor] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if files.get(key) == path:
                    sl = f.get_slice(key)
                    dtype = getattr(torch, {"F32": "float32", "BF16": "bfloat16", "F16": "float16",
                                            "I64": "int64"}.get(sl.get_dtype(), "float32"))
                    out[key] = _stand_in(tuple(sl.get_shape()), dtype)
    return out


def _copy_local(param: Tensor, full: Tensor) -> None:
    """Copy into `param` (DTensor or plain) the part of the full tensor `full` that this rank holds."""
    if not isinstance(param, DTensor):
        param.copy_(full)
        return
    # src_data_rank=None: every rank cuts its own piece from its own full tensor, no communication. DTensor's own
    # cutting, so any placement the parameter has (Shard, the _StridedShard of FSDP over TP) comes out right.
    piece = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    param.to_local().copy_(piece.to_local())


def load_hf_sharded(
    folder: str | os.PathLike[str],
    parts: list[nn.Module],
    model_args: Any,
    *,
    model: str | type | None = None,
    pg: dist.ProcessGroup | None = None,
) -> None:
    """Fill the (sharded) parameters and buffers of `parts` from an HF folder, each rank its own slices.

    Reading needs no communication; with `pg`, one all_gather_object at the end raises a failure of any rank on
    every rank of `pg` (without it, each rank may call this on its own). config.json must match `model_args`.
    """
    error: str | None = None
    try:
        _load_own(Path(folder), parts, model_args, model)
    except Exception as e:
        if pg is None:
            raise
        error = f"rank {dist.get_rank(pg)}: {type(e).__name__}: {e}"
    if pg is not None:
        errors: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(errors, error, group=pg)
        failed = [e for e in errors if e]
        if failed:
            raise RuntimeError(f"Hugging Face import by shard from {folder} failed: {'; '.join(failed)}")


def _load_own(folder: Path, parts: list[nn.Module], model_args: Any, model: str | type | None) -> None:
    from torchtitan.components.model_parts import model_state_dict

    adapter_cls, args = hf_io.resolve_folder(folder, model_args, model)
    adapter = adapter_cls(args)
    files = _key_files(folder)
    stand_ins = _headers(files)
    # The parts' own state dict: sharded DTensors viewing the parameters' storage, so copies land in the model.
    targets = model_state_dict(parts)
    filled: set[str] = set()
    with torch.no_grad():
        for g in _groups(list(stand_ins)):
            real = _read(files, [k for k in stand_ins if group_of(k) == g])
            ours = _convert(adapter.from_hf, real, stand_ins, g)
            del real
            for key, t in ours.items():
                if key in targets:
                    _copy_local(targets[key], t)
                    filled.add(key)
            del ours
    # As strict as load_state_dict on the gathered path: no parameter or persistent buffer may keep its old value.
    missing = sorted(set(targets) - filled)
    if missing:
        raise KeyError(f"{folder}: nothing in the checkpoint for '{missing[0]}' ({len(missing)} keys)")
