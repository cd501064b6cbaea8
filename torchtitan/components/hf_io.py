"""Save and load Hugging Face style Llama checkpoints (safetensors + config.json).

Layout written by `save_hf` (what `transformers.LlamaForCausalLM.from_pretrained` reads):

    folder/config.json
    folder/model.safetensors                              when everything fits in one shard, else
    folder/model-0000K-of-0000N.safetensors + folder/model.safetensors.index.json

Only safetensors is read or written: no pickle, so loading a downloaded checkpoint cannot run code.
Both functions work on full, plain tensors; with FSDP/TP gather the state dict first (e.g. with
`get_model_state_dict(..., options=StateDictOptions(full_state_dict=True, cpu_offload=True))`) and
call `save_hf` on one rank only.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.hf_adapter import (
    Llama3StateDictAdapter,
    args_from_hf_config,
    check_args_match,
    hf_config,
)
from torchtitan.tools.fs import fsync_dir

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def _plan_shards(hf_sd: dict[str, Tensor], itemsize: int, max_shard_bytes: int) -> list[list[str]]:
    """Greedy split in key order so each layer's tensors stay together and shards are contiguous.

    A tensor larger than the limit gets a shard of its own (it cannot be split).
    """
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in hf_sd.items():
        nbytes = t.numel() * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _fsync_file(path: Path) -> None:
    # Data must be on disk before the rename publishes the folder, or a power loss could leave a
    # complete-looking folder with empty files.
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_json(path: Path, obj: object) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, folder: Path) -> None:
    """Move the finished temp folder to `folder`, replacing an existing one.

    Each rename is atomic; if we crash between the two, the target name is simply absent and both
    the old and the new copy survive under hidden sibling names, so nothing half-written ever
    appears under the target name.
    """
    old: Path | None = None
    if folder.exists() or folder.is_symlink():
        if not folder.is_dir():
            raise FileExistsError(f"{folder} exists and is not a directory")
        old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(folder, old)
    os.replace(tmp, folder)
    fsync_dir(folder.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_hf(
    folder: str | os.PathLike[str],
    state_dict: dict[str, Tensor],
    model_args: TransformerModelArgs,
    dtype: str = "float32",
    max_shard_bytes: int = 5 * 1024**3,
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> Path:
    """Write our full state dict as an HF Llama checkpoint folder, atomically; returns the folder.

    An existing folder is replaced. Tensors are cast to `dtype` ("float32" or "bfloat16") one shard
    at a time, so the extra memory is about one shard plus the permuted wq/wk copies.
    """
    folder = Path(folder)
    config = hf_config(model_args, dtype, bos_id=bos_id, eos_id=eos_id)  # validates dtype first
    target = _DTYPES[dtype]
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    hf_sd = Llama3StateDictAdapter(model_args).to_hf(state_dict)
    itemsize = torch.empty((), dtype=target).element_size()
    shards = _plan_shards(hf_sd, itemsize, max_shard_bytes)

    folder.parent.mkdir(parents=True, exist_ok=True)
    # A hidden sibling on the same filesystem, so the final rename is atomic and the partial folder
    # never carries the target's name.
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for k, keys in enumerate(shards, start=1):
            name = SINGLE_NAME if len(shards) == 1 else _shard_name(k, len(shards))
            # contiguous(): safetensors needs dense tensors; .to() is a no-op for tensors already in dtype.
            part = {key: hf_sd[key].detach().to(device="cpu", dtype=target).contiguous() for key in keys}
            save_file(part, str(tmp / name), metadata={"format": "pt"})
            _fsync_file(tmp / name)
            for key, t in part.items():
                weight_map[key] = name
                total += t.numel() * itemsize
            del part
        if len(shards) > 1:
            _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(tmp / CONFIG_NAME, config)
        fsync_dir(tmp)
        _publish(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _load_sharded(folder: Path) -> dict[str, Tensor]:
    index_path = folder / INDEX_NAME
    index = _read_json(index_path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: missing or empty 'weight_map'")
    out: dict[str, Tensor] = {}
    for name in sorted(set(weight_map.values())):
        # Shard names come from a possibly downloaded file: refuse anything outside the folder.
        if not isinstance(name, str) or Path(name).name != name:
            raise ValueError(f"{index_path}: shard name {name!r} is not a plain file name")
        shard_path = folder / name
        if not shard_path.is_file():
            raise FileNotFoundError(f"{shard_path}: shard listed in {INDEX_NAME} is missing")
        for key, t in load_file(str(shard_path)).items():
            if weight_map.get(key) != name:
                raise ValueError(f"{shard_path}: tensor '{key}' is not assigned to this shard in {INDEX_NAME}")
            out[key] = t
    missing = [key for key in weight_map if key not in out]
    if missing:
        raise KeyError(f"{index_path}: tensor '{missing[0]}' is listed but not found in its shard")
    return out


def load_hf(
    folder: str | os.PathLike[str],
    model_args: TransformerModelArgs | None = None,
) -> tuple[dict[str, Tensor], TransformerModelArgs]:
    """Read an HF Llama checkpoint folder into (our state dict, model args).

    With `model_args`, config.json must describe the same shapes and numerics (else ValueError) and
    `model_args` is returned; without, the args are derived from config.json. Tensors keep the
    dtype they were stored in; `load_state_dict` casts them into the model's parameters.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a directory")
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: not found; not a Hugging Face model folder")
    config = _read_json(config_path)
    found = args_from_hf_config(config, source=str(config_path))
    if model_args is not None:
        check_args_match(model_args, found, str(config_path))
    args = model_args if model_args is not None else found

    single, index = folder / SINGLE_NAME, folder / INDEX_NAME
    if single.is_file() and index.is_file():
        raise ValueError(f"{folder}: has both {SINGLE_NAME} and {INDEX_NAME}; remove the stale one")
    if single.is_file():
        hf_sd = load_file(str(single))
    elif index.is_file():
        hf_sd = _load_sharded(folder)
    else:
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found {pickled[0]}: pickle checkpoints are not loaded, convert to safetensors)" if pickled else ""
        raise FileNotFoundError(f"{folder}: no {SINGLE_NAME} or {INDEX_NAME}{hint}")
    return Llama3StateDictAdapter(args).from_hf(hf_sd), args
