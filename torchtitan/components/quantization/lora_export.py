"""Exports of a LoRA run (torchtitan/components/quantization/lora.py): merged weights and PEFT adapters.

- `merged_state_dict(parts)`: the model's state dict with every adapter folded into its base weight
  (W + alpha/rank * B A) and the adapter keys dropped: what the Hugging Face export (hf_sharded.py) writes, so the
  folder loads as a plain model. Works on DTensors (FSDP/TP): each merged weight keeps its base weight's layout.
- `save_peft(folder, parts, ...)`: the adapters in PEFT's format, `adapter_config.json` and
  `adapter_model.safetensors`, keyed by the Hugging Face module names (`base_model.model.<module>.lora_A.weight`),
  which `peft.PeftModel.from_pretrained` loads onto the Hugging Face model exported from the base weights. B's rows
  follow the base weight's rows into the Hugging Face layout (Llama's wq/wk rows are permuted there); A's columns
  are the input features, which no adapter reorders.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import save_file

from torchtitan.components.model_parts import canonical_name, model_state_dict
from torchtitan.components.quantization.lora import ADAPTER_NAMES, LoRALinear, is_adapter

__all__ = ["is_adapter", "lora_modules", "merged_state_dict", "save_peft"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def lora_modules(parts: list[nn.Module]) -> dict[str, LoRALinear]:
    """Canonical module name -> LoRALinear over all model parts."""
    return {canonical_name(n): m for part in parts for n, m in part.named_modules() if isinstance(m, LoRALinear)}


def merged_state_dict(parts: list[nn.Module]) -> dict[str, Any]:
    """model_state_dict(parts) with the adapters merged into their base weights (see the module doc)."""
    state = model_state_dict(parts)
    for name, module in lora_modules(parts).items():
        state[f"{name}.weight"] = module.merged_weight()
        for adapter in ADAPTER_NAMES:
            state.pop(f"{name}.{adapter}", None)
    return state


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).to("cpu", torch.float32)


def adapter_tensors(parts: list[nn.Module]) -> dict[str, tuple[torch.Tensor, torch.Tensor, LoRALinear]]:
    """Module name -> (A, B, module) as full fp32 CPU tensors, of this rank's parts. Collective over each
    DTensor's mesh (every rank of a stage holds the same modules)."""
    return {name: (_full(m.lora_a), _full(m.lora_b), m) for name, m in lora_modules(parts).items()}


def peft_state(parts: list[nn.Module], model_args: Any,
               model: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(PEFT's adapter_model tensors, the adapter_config fields that depend on the model) for this rank's parts."""
    from torchtitan.components.hf_io import adapter_for

    links = {link.our_key: link for link in adapter_for(model, model_args)(model_args).row_links()}
    tensors, targets, ranks, alphas, dropouts = {}, set(), set(), set(), set()
    for name, (a, b, module) in adapter_tensors(parts).items():
        link = links.get(f"{name}.weight")
        if link is None or link.hf_rows is not None or not link.hf_key.endswith(".weight"):
            raise ValueError(f"lora: {name} has no whole Hugging Face weight to attach a PEFT adapter to")
        hf_module = link.hf_key.removesuffix(".weight")
        if link.our_rows is not None:  # the base weight's rows are reordered in the HF layout: B's rows alike
            b = b[torch.as_tensor(link.our_rows)]
        tensors[f"base_model.model.{hf_module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{hf_module}.lora_B.weight"] = b.contiguous()
        targets.add(hf_module.rsplit(".", 1)[-1])
        ranks.add(module.rank)
        alphas.add(module.alpha)
        dropouts.add(module.lora_dropout.p if isinstance(module.lora_dropout, nn.Dropout) else 0.0)
    return tensors, {"targets": targets, "r": ranks, "alpha": alphas, "dropout": dropouts}


def save_peft(folder: str | os.PathLike[str], parts: list[nn.Module], model_args: Any, *, model: str | None = None,
              base_model_name_or_path: str = "", pg: dist.ProcessGroup | None = None) -> Path:
    """Collective over `pg` (default: the world, when initialised): write the adapters of every rank's parts as a
    PEFT folder; rank 0 writes (adapters are small: each rank's full copies are gathered there)."""
    folder = Path(folder)
    tensors, info = peft_state(parts, model_args, model)
    if dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(gathered, (tensors, info), group=pg)  # pipeline stages hold different adapters
        tensors, info = {}, {key: set() for key in info}
        for t, i in gathered:
            tensors.update(t)
            for key, values in i.items():
                info[key] |= values
        if dist.get_rank(pg) != 0:
            dist.barrier(group=pg)
            return folder
    if len(info["r"]) != 1 or len(info["alpha"]) != 1 or len(info["dropout"]) > 1:
        raise ValueError(f"lora: PEFT's format holds one rank and alpha; got {info['r']}, {info['alpha']}")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "r": info["r"].pop(),
        "lora_alpha": info["alpha"].pop(),
        "lora_dropout": info["dropout"].pop() if info["dropout"] else 0.0,
        "target_modules": sorted(info["targets"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "modules_to_save": None,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=pg)
    return folder
