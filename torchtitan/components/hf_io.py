"""Save and load Hugging Face checkpoint folders (safetensors + config.json) for any registered model.

Layout written by `save_hf` (what `transformers.AutoModelForCausalLM.from_pretrained` reads):

    folder/config.json
    folder/model.safetensors                              when everything fits in one shard, else
    folder/model-0000K-of-0000N.safetensors + folder/model.safetensors.index.json
    folder/generation_config.json                         when the BOS/EOS ids are known
    folder/tokenizer.json + tokenizer_config.json + special_tokens_map.json    with `tokenizer=`

With the run's tokenizer (`tokenizer=`, what `build_tokenizer` returned) the folder is self-contained:
`AutoTokenizer.from_pretrained(folder)` encodes text to the ids the model was trained on (BOS first, spelled-out
special tokens as plain text) and config.json / generation_config.json carry its BOS/EOS ids (`tokenizer_files`).

The model-specific part (key names, weight layouts, config.json) is the model's state-dict adapter, the
`state_dict_adapter` of its `ModelSpec` (torchtitan/models/registry.py): a class built from the model args with
`to_hf(sd)` / `from_hf(hf_sd)`, and static `hf_config(model_args, dtype, bos_id=, eos_id=)`,
`args_from_hf_config(cfg, source=)` and `check_args_match(expected, found, source)`. Everything in this file (file
layout, sharding, atomic publishing, safe reading) is the same for every model.

Which adapter: pass `model=` a registered model name (e.g. `cfg.model.name`) or an adapter class. Without it,
the model whose flavors have the type of `model_args` is used, and `load_hf` without args asks every registered
adapter which one reads config.json.

Only safetensors is read or written: no pickle, so loading a downloaded checkpoint cannot run code.
Both functions work on full, plain tensors; with FSDP/TP gather the state dict first (e.g. with
`get_model_state_dict(..., options=StateDictOptions(full_state_dict=True, cpu_offload=True))`) and
call `save_hf` on one rank only, or use hf_sharded.py, where every rank writes and reads only its own rows.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from torchtitan.components.hf_tokenizer import special_ids, tokenizer_files, write_files
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


# ---------------------------------------------------------------------------------------------
# Which model: the adapter class
# ---------------------------------------------------------------------------------------------


def _registered() -> list[tuple[str, Any]]:
    """(name, ModelSpec) of every registered model that has a state-dict adapter, in name order."""
    # Imported on use: the registry imports every model package, which this module need not load to be imported.
    from torchtitan.models.registry import get_model_spec, model_names

    specs = [(name, get_model_spec(name)) for name in model_names()]
    return [(name, spec) for name, spec in specs if spec.state_dict_adapter is not None]


def model_name_of(adapter: type) -> str:
    """The registered model name whose state-dict adapter is `adapter` (the inverse of adapter_for)."""
    for name, spec in _registered():
        if spec.state_dict_adapter is adapter:
            return name
    raise ValueError(f"no registered model uses the adapter {adapter.__name__}")


def adapter_for(model: str | type | None = None, model_args: Any = None) -> type:
    """The state-dict adapter class for `model`: a registered model name (`cfg.model.name`) or an adapter class,
    returned as is. With model=None, that of the registered model whose flavors have `model_args`' type."""
    if isinstance(model, type):
        return model
    if isinstance(model, str):
        from torchtitan.models.registry import get_model_spec

        adapter = get_model_spec(model).state_dict_adapter  # KeyError listing the known names
        if adapter is None:
            raise ValueError(f"model '{model}' has no Hugging Face state-dict adapter (ModelSpec.state_dict_adapter)")
        return adapter
    if model is not None:
        raise TypeError(f"model: expected a registered model name or an adapter class, got {type(model).__name__}")
    if model_args is None:
        raise ValueError("pass model= (a registered model name or an adapter class) or model_args")
    cls = type(model_args)
    # Models sharing one args class and one adapter are interchangeable here, so count adapters, not names.
    found = {spec.state_dict_adapter: name for name, spec in _registered()
             if any(type(f) is cls for f in spec.flavors.values())}
    if len(found) != 1:
        which = f"several models ({', '.join(sorted(found.values()))})" if found else "no model with an adapter"
        raise ValueError(f"{which} registered for model args of type {cls.__name__}: pass model= to choose")
    return next(iter(found))


def _detect(config: dict[str, Any], source: str) -> tuple[type, Any]:
    """(adapter class, model args) of the one registered model whose adapter reads this config.json."""
    found: dict[type, tuple[str, Any]] = {}
    reasons: list[str] = []
    for name, spec in _registered():
        adapter = spec.state_dict_adapter
        try:
            found.setdefault(adapter, (name, adapter.args_from_hf_config(config, source=source)))
        except (KeyError, TypeError, ValueError) as e:
            # Every adapter refuses the others' configs (their model_type); its reason is kept for the message,
            # since one of them is usually the real problem (a missing key, an unsupported feature).
            reason = str(e.args[0]) if e.args else str(e)
            reasons.append(f"{name}: {reason.removeprefix(source + ': ')}")
    if len(found) == 1:
        adapter, (_, args) = next(iter(found.items()))
        return adapter, args
    if found:
        names = ", ".join(sorted(name for name, _ in found.values()))
        raise ValueError(f"{source}: readable as several models ({names}): pass model= to choose")
    raise ValueError(f"{source}: no registered model reads this config ({'; '.join(reasons)})")


# ---------------------------------------------------------------------------------------------
# Saving and loading
# ---------------------------------------------------------------------------------------------


def save_hf(
    folder: str | os.PathLike[str],
    state_dict: dict[str, Tensor],
    model_args: Any,
    dtype: str = "float32",
    max_shard_bytes: int = 5 * 1024**3,
    bos_id: int | None = None,
    eos_id: int | None = None,
    *,
    model: str | type | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write our full state dict as a Hugging Face checkpoint folder, atomically; returns the folder.

    `model` picks the adapter (see `adapter_for`). An existing folder is replaced. Tensors are cast to `dtype`
    ("float32" or "bfloat16") one shard at a time, so the extra memory is about one shard plus whatever new
    tensors the adapter makes (e.g. permuted copies). `tokenizer`, the run's (`build_tokenizer`), adds its files and
    BOS/EOS ids (`tokenizer_files`); bos_id/eos_id then default to its own.
    """
    folder = Path(folder)
    # Checked here, before the adapter runs, so every model refuses the same dtypes the same way.
    if dtype not in _DTYPES:
        raise ValueError(f"dtype '{dtype}' is not supported; use one of {', '.join(_DTYPES)}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    adapter = adapter_for(model, model_args)
    bos_id, eos_id = special_ids(tokenizer, bos_id, eos_id)
    config = adapter.hf_config(model_args, dtype, bos_id=bos_id, eos_id=eos_id)
    extra = tokenizer_files(tokenizer, config)
    target = _DTYPES[dtype]
    hf_sd = adapter(model_args).to_hf(state_dict)
    fp32_suffixes = tuple(getattr(adapter, "FLOAT32_HF_KEY_SUFFIXES", ()))
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
            # Keys the adapter keeps in float32 whatever `dtype` (DeepSeek-V3's routing bias moves in steps of 1e-3,
            # below bfloat16's resolution; the published checkpoints store it in float32 too).
            part = {key: hf_sd[key].detach().to(device="cpu", dtype=torch.float32 if key.endswith(fp32_suffixes)
                                                else target).contiguous() for key in keys}
            save_file(part, str(tmp / name), metadata={"format": "pt"})
            _fsync_file(tmp / name)
            for key, t in part.items():
                weight_map[key] = name
                total += t.numel() * t.element_size()
            del part
        if len(shards) > 1:
            _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(tmp / CONFIG_NAME, config)
        write_files(tmp, extra)
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


def resolve_folder(folder: Path, model_args: Any = None, model: str | type | None = None) -> tuple[type, Any]:
    """(adapter class, model args) for an HF folder: config.json read and checked as `load_hf` describes."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a directory")
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: not found; not a Hugging Face model folder")
    config = _read_json(config_path)
    source = str(config_path)
    if model is None and model_args is None:
        adapter, found = _detect(config, source)
    else:
        adapter = adapter_for(model, model_args)
        found = adapter.args_from_hf_config(config, source=source)
    if model_args is not None:
        # Args of another model's class (a wrong `model=`) would fail obscurely inside check_args_match.
        if type(found) is not type(model_args):
            raise TypeError(f"model_args is a {type(model_args).__name__}, but {adapter.__name__} reads "
                            f"{type(found).__name__}")
        adapter.check_args_match(model_args, found, source)
    args = model_args if model_args is not None else found
    return adapter, args


def load_hf(
    folder: str | os.PathLike[str],
    model_args: Any = None,
    *,
    model: str | type | None = None,
) -> tuple[dict[str, Tensor], Any]:
    """Read a Hugging Face checkpoint folder into (our state dict, model args).

    `model` picks the adapter (see `adapter_for`); with neither `model` nor `model_args`, the registered model
    whose adapter reads config.json. With `model_args`, config.json must describe the same shapes and numerics
    (else ValueError) and `model_args` is returned; without, the args are derived from config.json. Tensors keep
    the dtype they were stored in; `load_state_dict` casts them into the model's parameters.
    """
    folder = Path(folder)
    adapter, args = resolve_folder(folder, model_args, model)

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
    return adapter(args).from_hf(hf_sd), args
