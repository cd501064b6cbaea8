"""Hugging Face export and import by shard: every rank writes and reads only the rows it holds.

`save_hf` / `load_hf` (hf_io.py) work on one full state dict, which someone must hold. Here no rank ever holds
more than its own shards plus a bounded chunk (`CHUNK_BYTES`), whatever the model's size and layout (FSDP, TP,
HSDP, EP, pipeline stages, or one process).

What moves where is the model adapter's `row_links` (torchtitan/models/hf_common.py `RowLink`): rows of which HF
tensor each of our tensors' rows are (a rename, the rotary permutation of wq/wk rows, the split of stacked experts
into one matrix per expert). The adapter's `to_hf` / `from_hf` still run, on stand-ins that hold no memory (meta
tensors; 1-D ones real), for what they check and decide: keys and shapes, HF shapes and dtypes, values that come
from nowhere (a zero routing bias), warnings.

Export (`save_hf_sharded`), a collective over `pg`:
* every rank plans the same files from shapes alone (one file per block and one for the rest, as `save_hf`
  names them; safetensors_slices.py), and rank 0 creates them at full size with their headers;
* each rank writes, for each tensor it holds, the rows its placements give it (a DTensor's local box, found by
  DTensor's own placement logic, _StridedShard included), converted to the export dtype, by `pwrite` at their
  offsets. Of replicas (a Replicate mesh dim, or a plain tensor held by several ranks) only one writes;
* the elements written per HF tensor are summed over ranks (one all_reduce) and must equal its size: a hole or a
  double write fails the export. Rank 0 then writes the index, config.json and the tokenizer and generation files
  (hf_tokenizer.tokenizer_files) and publishes the folder atomically.

Import (`load_hf_sharded`): each rank maps the files read-only and copies into its local shards exactly their rows
and columns; one all_gather_object reports any rank's failure. Disk reads and memory are the rank's shards.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.components import hf_io, hf_tokenizer
from torchtitan.components.quantization import lora
from torchtitan.components.safetensors_slices import Entry, Reader, create_file, plan_file, read_entries, write_rows
from torchtitan.components.shard_rows import local_2d, local_rows_cols, match_rows, n_rows, row_chunks, shard_index
from torchtitan.models.hf_common import RowLink
from torchtitan.tools.fs import fsync_dir

CHUNK_BYTES = 32 << 20
"""Rows are converted and written (or read) this many bytes at a time: the only temporary besides the shards."""


def _group(key: str) -> int:
    """Block index of an HF key (`model.layers.3.`), -1 for the rest: the file it goes to."""
    parts = key.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


def _world(pg: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(pg), dist.get_world_size(pg)


def _stand_in(t: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A value for an adapter's to_hf/from_hf: a plain 1-D tensor itself (adapters test values there, e.g. a
    nonzero routing bias), other 1-D ones zeros, everything else meta (no memory)."""
    if len(shape) == 1:
        return t if t is not None and not isinstance(t, DTensor) else torch.zeros(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype, device="meta")


# ---------------------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------------------


def _plan(adapter: Any, state_dict: dict[str, Any], target: torch.dtype, fp32: tuple[str, ...]
          ) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], list[RowLink]]:
    """HF key -> (shape, dtype) of the export, from the adapter run on stand-ins (its checks included), and the
    links. Every HF tensor must be linked or be zeros that `to_hf` made from nothing (its rows stay unwritten)."""
    full = {k: _stand_in(None, tuple(shape), torch.float32) for k, shape in adapter.shapes.items()}
    by_id: dict[int, Tensor] = {}  # a tied model's alias stays one tensor (adapters compare identity)
    for k, v in state_dict.items():
        full[k] = by_id.setdefault(id(v), _stand_in(v, tuple(v.shape), v.dtype))
    hf_sd = adapter.to_hf(full)
    links = adapter.row_links(None)
    linked = {link.hf_key for link in links}
    for key in linked - set(hf_sd):
        raise ValueError(f"row link to '{key}', which to_hf does not produce")
    for key, v in hf_sd.items():
        if key not in linked and (v.is_meta or bool(v.ne(0).any())):
            raise ValueError(f"the adapter links no rows to HF tensor '{key}'")
    shapes = {k: (tuple(v.shape), torch.float32 if k.endswith(fp32) else target) for k, v in hf_sd.items()}
    return shapes, links


def _files(folder: Path, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
           ) -> tuple[dict[str, tuple[bytes, dict[str, Entry]]], dict[str, Entry]]:
    """One file per group (the rest first, then blocks in order), named as save_hf names them."""
    groups: dict[int, list[str]] = defaultdict(list)
    for key in shapes:
        groups[_group(key)].append(key)
    order = sorted(groups)
    files, entries = {}, {}
    for k, g in enumerate(order, start=1):
        name = hf_io._shard_name(k, len(order))
        head, ents = plan_file(folder / name, [(key, *shapes[key]) for key in groups[g]], {"format": "pt"})
        files[name] = (head, ents)
        entries.update(ents)
    return files, entries


def _write_own(state_dict: dict[str, Any], links: list[RowLink], entries: dict[str, Entry],
               mine: set[str]) -> dict[str, int]:
    """Write this rank's rows of every linked tensor it writes; elements written per HF key."""
    by_ours: dict[str, list[RowLink]] = defaultdict(list)
    for link in links:
        by_ours[link.our_key].append(link)
    written: dict[str, int] = defaultdict(int)
    fds: dict[Path, int] = {}
    seen: set[int] = set()
    try:
        for key, t in state_dict.items():
            if key not in mine or id(t) in seen:
                continue
            seen.add(id(t))  # an alias (tied output) is written once, through its own links only
            rows, cols = local_rows_cols(t)
            local = local_2d(t, rows.numel(), cols.numel())
            n_ours = n_rows(t.shape)
            for link in by_ours[key]:
                entry = entries[link.hf_key]
                pos, hf_rows = match_rows(link, n_ours, entry.rows, rows)
                if entry.path not in fds:
                    fds[entry.path] = os.open(entry.path, os.O_WRONLY)
                for part in row_chunks(pos.numel(), cols.numel() * local.element_size(), CHUNK_BYTES):
                    written[link.hf_key] += write_rows(fds[entry.path], entry, hf_rows[part], cols, local[pos[part]])
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return written


def _elect_writers(state_dict: dict[str, Any], keys: list[str], pg: dist.ProcessGroup | None, rank: int,
                   world: int) -> set[str]:
    """The keys whose rows this rank writes: of the ranks holding the same shard of a tensor (a Replicate mesh
    dimension, a mesh that spans only part of the job, a plain tensor in every rank), the lowest. One MIN
    all_reduce over a keys x shards table; no rank needs to know the others' meshes."""
    table = torch.full((len(keys), world), world, dtype=torch.int32)
    slot = {k: i for i, k in enumerate(keys)}
    for key, t in state_dict.items():
        if key in slot:
            table[slot[key], shard_index(t)] = rank
    if world > 1:
        summed = table.to(_reduce_device(pg))
        dist.all_reduce(summed, op=dist.ReduceOp.MIN, group=pg)
        table = summed.cpu()
    return {key for key, t in state_dict.items() if key in slot and int(table[slot[key], shard_index(t)]) == rank}


def _reduce_device(pg: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(pg))
    return torch.device("cpu") if ("gloo" in backend or "fake" in backend) else torch.device("cuda")


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
    tokenizer: Any = None,
    chat_template: str | None = None,
) -> Path:
    """Collective over `pg` (default: the world): write the model as an HF folder, each rank its own rows.

    Every rank passes its own `model_state_dict(parts)` (DTensors or plain tensors; with pipeline parallel, its
    stages' keys) and the same arguments; the folder must be on a filesystem every rank sees. Returns the folder
    on every rank; a failure on any rank raises on every rank and leaves no folder behind. `tokenizer` (the run's)
    adds the same tokenizer and generation files as hf_io.save_hf (rank 0 writes them), with `chat_template` (the
    run's, for chat data) in its tokenizer_config.json.
    """
    folder = Path(folder)
    if dtype not in hf_io._DTYPES:
        raise ValueError(f"dtype '{dtype}' is not supported; use one of {', '.join(hf_io._DTYPES)}")
    rank, world = _world(pg)
    bos_id, eos_id = hf_tokenizer.special_ids(tokenizer, bos_id, eos_id)  # a contradiction fails on every rank, here
    adapter_cls = hf_io.adapter_for(model, model_args)
    adapter = adapter_cls(model_args)
    shapes, links = _plan(adapter, state_dict, hf_io._DTYPES[dtype],
                          tuple(getattr(adapter_cls, "FLOAT32_HF_KEY_SUFFIXES", ())))
    mine = _elect_writers(state_dict, sorted({link.our_key for link in links}), pg, rank, world)

    # Rank 0 creates the temporary folder (hidden sibling, so the final rename is atomic) and every file at its
    # full size; the broadcast that tells the others the folder's name also tells them the files exist.
    files, entries = _files(Path("."), shapes)
    box: list[Any] = [None]
    if rank == 0:
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            box[0] = tmp
            for name, (head, ents) in files.items():
                create_file(tmp / name, head, ents)
        except OSError as e:  # sent instead of the name, so no rank waits in a collective rank 0 never joins
            box[0] = f"rank 0: {type(e).__name__}: {e}"
    if world > 1:
        dist.broadcast_object_list(box, src=0, group=pg)
    if isinstance(box[0], str):
        raise RuntimeError(f"Hugging Face export by shard to {folder} failed: {box[0]}")
    tmp = box[0]
    entries = {k: Entry(tmp / e.path, e.offset, e.shape, e.dtype) for k, e in entries.items()}

    keys = list(shapes)
    counts = torch.zeros(len(keys) + 1, dtype=torch.float64)  # the last slot counts failed ranks
    error: str | None = None
    try:
        written = _write_own(state_dict, links, entries, mine)
        counts[:-1] = torch.tensor([float(written.get(k, 0)) for k in keys], dtype=torch.float64)
    except Exception as e:  # reported through the sum below: leaving early would hang the others
        error = f"rank {rank}: {type(e).__name__}: {e}"
        counts[-1] = 1
    if world > 1:
        device = _reduce_device(pg)
        summed = counts.to(device)
        dist.all_reduce(summed, group=pg)  # exact in float64 up to 2**53 elements per tensor
        counts = summed.cpu()
    errors: list[str] = []
    if counts[-1] > 0:
        errors.append(error or f"{int(counts[-1])} other rank(s) failed to write their rows")
    else:
        linked = {link.hf_key for link in links}
        for k, n in zip(keys, counts[:-1].tolist(), strict=True):
            want = entries[k].rows * entries[k].cols
            if k in linked and int(n) != want:
                errors.append(f"'{k}' got {int(n)} of {want} elements from the ranks (a shard written twice or "
                              "not at all)")
                break
    if rank == 0 and not errors:
        try:
            weight_map = {key: e.path.name for key, e in entries.items()}
            total = sum(e.nbytes for e in entries.values())
            hf_io._write_json(tmp / hf_io.INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
            config = adapter_cls.hf_config(model_args, dtype, bos_id=bos_id, eos_id=eos_id)
            hf_io._write_json(tmp / hf_io.CONFIG_NAME, config)
            hf_tokenizer.write_files(tmp, hf_tokenizer.tokenizer_files(tokenizer, config, chat_template))
            for name in files:
                hf_io._fsync_file(tmp / name)
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


# ---------------------------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------------------------


def _key_files(folder: Path) -> dict[str, Path]:
    """HF key -> the safetensors file holding it, from the index or the single file."""
    single, index = folder / hf_io.SINGLE_NAME, folder / hf_io.INDEX_NAME
    if single.is_file() and index.is_file():
        raise ValueError(f"{folder}: has both {hf_io.SINGLE_NAME} and {hf_io.INDEX_NAME}; remove the stale one")
    if single.is_file():
        return {key: single for key in read_entries(single)}
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


def _entries(folder: Path) -> dict[str, Entry]:
    files = _key_files(folder)
    out: dict[str, Entry] = {}
    for path in sorted(set(files.values())):
        for key, entry in read_entries(path).items():
            if files.get(key) == path:
                out[key] = entry
    missing = sorted(set(files) - set(out))
    if missing:
        raise KeyError(f"{files[missing[0]]}: tensor '{missing[0]}' is listed but not found in its shard")
    return out


def _copy_local(param: Tensor, full: Tensor) -> None:
    """Copy into `param` (DTensor or plain) the part of the small full tensor `full` that this rank holds."""
    if not isinstance(param, DTensor):
        param.copy_(full)
        return
    piece = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    param.to_local().copy_(piece.to_local())


def _read_own(t: Tensor, key: str, links: list[RowLink], entries: dict[str, Entry], n_ours: int,
              reader: Reader) -> None:
    """Fill the local rows of `t` from the files; every local row exactly once."""
    rows, cols = local_rows_cols(t)
    local = t.to_local() if isinstance(t, DTensor) else t
    target = local.view(rows.numel(), cols.numel()) if local.is_contiguous() else local.reshape(rows.numel(), -1)
    filled = torch.zeros(rows.numel(), dtype=torch.bool)
    for link in links:
        entry = entries[link.hf_key]
        pos, hf_rows = match_rows(link, n_ours, entry.rows, rows)
        if bool(filled[pos].any()):
            raise ValueError(f"'{key}': rows linked twice (adapter row_links)")
        filled[pos] = True
        for part in row_chunks(pos.numel(), cols.numel() * entry.itemsize, CHUNK_BYTES):
            # Read on the CPU, into the shard's device (a GPU's on GPU jobs); one chunk alive at a time.
            target[pos[part].to(target.device)] = reader.read_rows(entry, hf_rows[part], cols).to(
                device=target.device, dtype=target.dtype)
    if not bool(filled.all()):
        raise KeyError(f"'{key}': {int((~filled).sum())} of its rows have no source in the checkpoint")
    if target.data_ptr() != local.data_ptr():
        local.copy_(target.view(local.shape))


def load_hf_sharded(
    folder: str | os.PathLike[str],
    parts: list[nn.Module],
    model_args: Any,
    *,
    model: str | type | None = None,
    pg: dist.ProcessGroup | None = None,
) -> None:
    """Fill the (sharded) parameters and buffers of `parts` from an HF folder, each rank its own rows.

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
    entries = _entries(folder)
    reader = Reader()
    # from_hf on stand-ins: its key and shape checks, and the values it makes itself (zero routing biases).
    stand_ins = {k: reader.read_rows(e, torch.zeros(1, dtype=torch.long), torch.arange(e.cols))[0]
                 if len(e.shape) == 1 else _stand_in(None, e.shape, e.dtype) for k, e in entries.items()}
    ours = adapter.from_hf(stand_ins)
    by_ours: dict[str, list[RowLink]] = defaultdict(list)
    for link in adapter.row_links(set(entries)):
        if link.hf_key in entries:  # an optional key the checkpoint leaves out: from_hf supplies the value
            by_ours[link.our_key].append(link)
    targets = model_state_dict(parts)  # sharded DTensors viewing the parameters' storage
    done: set[int] = set()
    with torch.no_grad():
        for key, t in targets.items():
            if id(t) in done:  # a tied alias, filled through the tensor it aliases
                continue
            if key in by_ours:
                _read_own(t, key, by_ours[key], entries, n_rows(t.shape), reader)
            elif key in ours and not ours[key].is_meta:
                _copy_local(t, ours[key])
            elif key in ours and any(other != key and ours.get(other) is ours[key] for other in by_ours):
                continue  # an alias whose source is filled under its own name
            elif lora.is_adapter(key):
                continue  # LoRA adapters (quantization/lora.py) keep their initial values: a base model has none
            else:
                raise KeyError(f"{folder}: nothing in the checkpoint for '{key}'")
            done.add(id(t))
    reader.close()
