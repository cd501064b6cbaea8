"""Helpers every model's Hugging Face adapter uses (torchtitan/models/*/hf_adapter.py): state-dict checks and
config.json reading."""

from __future__ import annotations

import math
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
