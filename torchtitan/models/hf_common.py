"""Helpers every model's Hugging Face adapter uses (torchtitan/models/*/hf_adapter.py): state-dict checks and
config.json reading."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def same_tensor(a: Tensor, b: Tensor) -> bool:
    # A tied model's state_dict holds one tensor twice; the identity checks avoid a full compare.
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a, b))


def check_state_dict(side: str, got: dict[str, Any], shapes: dict[str, tuple[int, ...]], optional: set[str]) -> None:
    """Raise on the first unexpected or missing key (keys in `optional` may be absent), non-Tensor value or wrong
    shape; `side` ("our" or "HF") names the state dict in the message."""
    for key in got:
        if key not in shapes and key not in optional:
            raise KeyError(f"{side} state dict: unexpected key '{key}' for this model config")
    for key, shape in shapes.items():
        if key not in got:
            if key in optional:
                continue
            raise KeyError(f"{side} state dict: missing key '{key}'")
        value = got[key]
        if not isinstance(value, Tensor):
            raise TypeError(f"{side} state dict: '{key}' is a {type(value).__name__}, expected a Tensor")
        if type(value) is not Tensor and type(value).__name__ == "DTensor":
            raise TypeError(f"{side} state dict: '{key}' is a DTensor; gather it with .full_tensor() first")
        if tuple(value.shape) != shape:
            raise ValueError(f"{side} state dict: '{key}' has shape {tuple(value.shape)}, expected {shape}")


def require(cfg: dict[str, Any], key: str, source: str) -> Any:
    """config.json's `key`, which must be present and not null."""
    if key not in cfg or cfg[key] is None:
        raise KeyError(f"{source}: missing key '{key}'")
    return cfg[key]


def close(a: float, b: float) -> bool:
    """Equal as config floats (rope theta, norm eps): a round trip through JSON may change the last digit."""
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


@dataclass(frozen=True)
class RowLink:
    """Rows `hf_rows` of the Hugging Face tensor `hf_key` are rows `our_rows` of our tensor `our_key`, in that order.

    A tensor's rows are its last dimension's vectors, every other dimension flattened (a 1-D tensor is one row);
    the two tensors' last dimensions are equal. `None` means all of the tensor's rows in order. An adapter's
    `row_links` lists them for every tensor that export and import by shard (torchtitan/components/hf_sharded.py)
    move: each rank then writes and reads only the rows it holds, and `to_hf` / `from_hf` run on stand-ins only."""

    hf_key: str
    our_key: str
    hf_rows: range | Tensor | None = None
    our_rows: range | Tensor | None = None


def expert_links(our_key: str, shape: tuple[int, ...], hf_prefix: str, name: str, fused: bool) -> list[RowLink]:
    """Links of one stacked expert tensor (w1/w3 [experts, hidden, dim] or w2 [experts, dim, hidden]) named `name`
    (gate_proj, up_proj, down_proj) on the HF side, under `hf_prefix` (`model.layers.{i}.mlp.experts.`).

    On disk each expert j is its own matrix `{prefix}{j}.{name}.weight`: our rows j*n .. (j+1)*n. In transformers'
    fused layout `gate_up_proj` [experts, 2 x hidden, dim] holds each expert's gate rows then its up rows, and
    `down_proj` is our w2 as is."""
    experts, n = shape[0], shape[1]
    if not fused:
        return [RowLink(f"{hf_prefix}{j}.{name}.weight", our_key, our_rows=range(j * n, (j + 1) * n))
                for j in range(experts)]
    if name == "down_proj":
        return [RowLink(hf_prefix + "down_proj", our_key)]
    first = 0 if name == "gate_proj" else n
    hf_rows = (torch.arange(experts)[:, None] * 2 * n + first + torch.arange(n)[None, :]).flatten()
    return [RowLink(hf_prefix + "gate_up_proj", our_key, hf_rows=hf_rows)]


def moe_model_links(shapes: dict[str, tuple[int, ...]], to_hf_keys: dict[str, str], expert_names: dict[str, str],
                    hf_keys: set[str] | None, skip: set[str] | None = None) -> list[RowLink]:
    """Row links of a model whose tensors are renames (`to_hf_keys`, ours -> HF) or stacked routed experts
    (`layers.{i}.moe.experts.w1/w2/w3`, named on the HF side by `expert_names`); keys in `skip` have none. With
    `hf_keys` (a checkpoint's keys), layers whose `gate_up_proj` is there get transformers' fused layout."""
    links = []
    for ours, shape in shapes.items():
        if skip and ours in skip:
            continue
        if ours in to_hf_keys:
            links.append(RowLink(to_hf_keys[ours], ours))
            continue
        layer, _, key = ours.removeprefix("layers.").partition(".")
        prefix = f"model.layers.{layer}.mlp.experts."
        fused = hf_keys is not None and prefix + "gate_up_proj" in hf_keys
        links += expert_links(ours, shape, prefix, expert_names[key], fused)
    return links
