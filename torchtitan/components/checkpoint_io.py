"""Checkpoint folders on disk: completion markers, discovery, retention, safe DCP reads, RNG state.

Layout of one run: `<dump_folder>/<checkpoint.folder>/step-<N>/` holds a DCP checkpoint (`.metadata`
plus per-rank `__<rank>_<k>.distcp` files) and, once everything is on disk, `.complete`: a small JSON
file {step, world_size, time, model_only, ...} written last by rank 0. A folder without a valid marker,
or whose `.metadata` is gone, is *incomplete*: never loaded.

Retention rule (`purge`), applied by rank 0 only while no save is in flight:
  * complete checkpoints: keep the newest `keep_latest_k` by step, delete the older ones; the newest
    complete one is always kept, whatever k is, and so is the one just published (a run resumed from an
    older step writes checkpoints older than those it left behind, until it overtakes them);
  * incomplete folders: deleted only when their step is older than the newest complete checkpoint (a
    crashed save that a later save superseded); an incomplete folder newer than every complete one is
    left alone, because it may be a save in progress or the evidence of a crash someone wants to inspect;
  * `step-<N>-model` and `step-<N>-hf` exports and anything else in the folder are never touched.
A folder is deleted marker first, so an interrupted deletion leaves an incomplete folder, never a
complete-looking partial one.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from torchtitan.tools.fs import fsync_dir
from torchtitan.tools.logging import logger

# DCP warns on every save/load without a process group (a 1-process run, the conversion script), also when
# told so with no_dist=True: that is the intended mode there, not a problem worth a line per checkpoint.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

MARKER = ".complete"
METADATA = ".metadata"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_EXPORT_DIR = re.compile(r"^step-(\d+)-(model|hf)$")
STATE_KEYS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")


class CheckpointError(RuntimeError):
    """A save failed. DCP raises `CheckpointException`, a BaseException; this turns it into an Exception."""


def one_line(e: BaseException) -> str:
    """The root cause on one line. DCP's CheckpointException carries each failed rank's exception in
    `failures` ({rank: (exception, traceback)}) and a multi-line traceback as its message."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = []
        for rank in sorted(failures):
            cause = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
            causes.append(f"rank {rank}: {type(cause).__name__}: {' '.join(str(cause).split())[:200]}")
        return "; ".join(causes)
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def write_marker(folder: Path, info: dict[str, Any]) -> None:
    """Publish `folder` as complete: temp file, fsync, atomic rename, fsync the directory."""
    tmp = folder / f"{MARKER}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(info, f)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MARKER)
    fsync_dir(folder)


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker's content if `folder` is a complete checkpoint, else None."""
    try:
        info = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    m = _STEP_DIR.match(folder.name)
    if not isinstance(info, dict) or (m is not None and info.get("step") != int(m.group(1))):
        return None  # a marker copied from another folder does not vouch for this one
    if not (folder / METADATA).is_file():
        return None  # DCP's own index is gone: the shards cannot be read
    return info


def checkpoint_step_folders(folder: str | os.PathLike[str]) -> list[tuple[int, Path, bool]]:
    """(step, path, complete) for every `step-<N>` folder in `folder`, oldest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m is not None and p.is_dir():
            found.append((int(m.group(1)), p, read_marker(p) is not None))
    return sorted(found)


def resume_target(folder: Path, load_step: int) -> Path | None:
    """The folder to resume from: `load_step` (>= 0, must be complete) or the newest complete checkpoint;
    incomplete folders are reported and skipped."""
    entries = checkpoint_step_folders(folder)
    for _, path, ok in entries:
        if not ok:
            logger.warning(f"checkpoint: {path} is incomplete (no valid {MARKER} marker or no {METADATA}); ignored")
    complete = {step: path for step, path, ok in entries if ok}
    if load_step >= 0:
        if load_step not in complete:
            what = "incomplete" if any(s == load_step for s, _, _ in entries) else "missing"
            raise ValueError(f"checkpoint.load_step={load_step}: {folder / f'step-{load_step}'} is {what}")
        return complete[load_step]
    if not complete:
        return None
    newest = max(complete)
    if newest > 0 and (read_marker(complete[newest]) or {}).get("model_only"):
        # Written by an earlier version as the final save: weights without optimizer, schedule or data position.
        full = [s for s in complete if not (read_marker(complete[s]) or {}).get("model_only")]
        older = f"; or move it away and resume step-{max(full)} (the newest full one)" if full else ""
        raise ValueError(f"checkpoint: {complete[newest]} holds model weights only, so training cannot continue "
                         f"exactly from it: start a new run from those weights with checkpoint.initial_load_path "
                         f"= {complete[newest]} and another job.dump_folder{older}")
    return complete[newest]


def saved_step_folders(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of everything a save would refuse to overwrite: complete checkpoints and the
    `step-<N>-model` / `step-<N>-hf` exports, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _STEP_DIR.match(p.name) or _EXPORT_DIR.match(p.name)
        if m is not None and p.is_dir() and (p.name.endswith("-hf") or read_marker(p) is not None):
            found.append((int(m.group(1)), p))
    return sorted(found)


def remove_checkpoint(path: Path) -> None:
    # Marker first: a deletion cut short must not leave a folder that still claims to be complete.
    try:
        (path / MARKER).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


# What DCP's default writer adds per tensor (each is its own torch.save record: zip headers, pickle, alignment) and
# for the .metadata file, per tensor: measured with torch 2.13 (3.3 KiB and 0.65 KiB on a 2-block model).
BYTES_PER_WRITTEN_TENSOR = 4096


def tensor_bytes(state: Any, prefix: str = "") -> tuple[int, dict[str, int]]:
    """(bytes of this rank's DTensor shards that it alone writes, {key: bytes} of its plain tensors) in a nested
    state, each with the writer's per-tensor overhead: a shard counts where the rank sits at coordinate 0 of every
    mesh dimension that does not shard it (Replicate or Partial), the one copy DCP writes; plain tensors are
    returned by key for the caller to count each key once over the ranks."""
    from torch.distributed.tensor import DTensor

    sharded, plain = 0, {}
    if isinstance(state, DTensor):
        coordinate = state.device_mesh.get_coordinate()
        if coordinate is not None and all(c == 0 for c, p in zip(coordinate, state.placements, strict=True)
                                          if not p.is_shard()):
            sharded += state.to_local().nbytes + BYTES_PER_WRITTEN_TENSOR
    elif isinstance(state, torch.Tensor):
        plain[prefix] = state.nbytes + BYTES_PER_WRITTEN_TENSOR
    elif isinstance(state, (dict, list, tuple)):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        for key, value in items:
            more, more_plain = tensor_bytes(value, f"{prefix}/{key}")
            sharded += more
            plain.update(more_plain)
    return sharded, plain


def check_free_space(folder: Path, needed: int) -> None:
    """Raise before writing a checkpoint of `needed` bytes that the filesystem of `folder` cannot hold: a save
    that runs out of space midway fails deep inside DCP's writer (and its partial folder would then go)."""
    existing = Path(folder)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise CheckpointError(f"no space left on {existing}: checkpoint needs {_size(needed)}, {_size(free)} free")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def purge(folder: Path, keep_latest_k: int, keep: Path | None = None) -> list[Path]:
    """Apply the retention rule of this module's docstring; `keep` (the checkpoint just published) is
    never deleted either. Returns the deleted folders."""
    if keep_latest_k <= 0:
        return []
    entries = checkpoint_step_folders(folder)
    complete = [(s, p) for s, p, ok in entries if ok]
    if not complete:
        return []
    newest = complete[-1][0]
    doomed = [p for _, p in complete[:-max(keep_latest_k, 1)] if p != keep]
    doomed += [p for s, p, ok in entries if not ok and s < newest and p != keep]
    for p in doomed:
        logger.info(f"checkpoint: deleting {p} (checkpoint.keep_latest_k={keep_latest_k})")
        remove_checkpoint(p)
    return doomed


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor entries are unpickled with `weights_only=True`.

    We only ever store plain data (ints, floats, strings, lists, dicts) besides tensors, so the
    restricted unpickler reads everything we write and refuses code-carrying objects in a tampered
    or foreign checkpoint (the default planner uses `weights_only=False`).
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            target = self.original_state_dict
            path = self.mappings[read_item.dest_index.fqn]
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = obj
        else:
            # The caller's dict: self.state_dict is a copy made while flattening sharded tensors.
            self.original_state_dict[read_item.dest_index.fqn] = obj


_PLAIN = (bool, int, float, str, type(None))


def check_plain(obj: Any, where: str) -> None:
    """Raise if `obj` holds anything but tensors and plain data: those would be pickled as objects."""
    if isinstance(obj, (torch.Tensor, *_PLAIN)):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"checkpoint: {where} has a non-plain key {k!r} ({type(k).__name__})")
            check_plain(v, f"{where}.{k}")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"checkpoint: {where} is a {type(obj).__name__}; only tensors and plain data are stored")


def rng_state() -> dict[str, torch.Tensor]:
    """This process's torch generators: CPU always, the current CUDA device's when CUDA is in use."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def read_metadata(path: Path) -> Metadata:
    return dcp.FileSystemReader(str(path)).read_metadata()


def model_prefix(md: Metadata) -> str:
    """"model." for our checkpoints; "" for a flat model-only DCP folder written by other tools."""
    return "model." if any(k.startswith("model.") for k in md.state_dict_metadata) else ""


def load_full_model_state(path: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a DCP folder as plain full CPU tensors, on one process without a model.

    The empty destination tensors are built from the checkpoint's own metadata (shape, dtype), so this
    reads any layout and any dtype a checkpoint was written with.
    """
    md = read_metadata(path)
    prefix = model_prefix(md)
    dest: dict[str, Any] = {}
    for key, item in md.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        if isinstance(item, TensorStorageMetadata):  # plain entries a flat folder may carry are not weights
            dest[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if not dest:
        raise ValueError(f"{path}: the checkpoint holds no model tensors")
    # flatten_state_dict=False: keys already are the flattened names DCP stored.
    dcp.load(dest, checkpoint_id=str(path), planner=SafeLoadPlanner(flatten_state_dict=False), no_dist=True)
    return {k[len(prefix):]: v for k, v in dest.items()}
