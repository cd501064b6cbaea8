"""The 8B fine-tuning recipes (train_configs/{llama3,qwen3}_8b_{sft,lora}.toml; docs/finetuning.md, "Recipes for 8B
on one node") fit one node of 8 H100s by the memory estimator, and LoRA's frozen base holds no gradient and no AdamW
state.

Each recipe is estimated as scripts/estimate_memory.sh estimates it (NGPU=8, the h100 target): fake tensors on CPU, no
weights, data or network. The two recipes of a model share one forked child (the same 8-rank fake world, as
test_memory_estimation.py traces several depths in one child); the two models' children run side by side.

What LoRA must save follows from the states FSDP keeps per rank, each sharded over the 8 ranks. Full SFT: the fp32
parameter, its fp32 gradient and AdamW's two fp32 moments, 16 bytes per parameter. LoRA: the frozen base keeps only
its fp32 parameter (4 bytes), and each adapter parameter costs the full 16. Between steps that is 12 bytes per base
parameter less, less 16 per adapter parameter. At the peak, in backward for full SFT, the gradients are not there
yet (each appears as its block's backward runs), so only the two moments, 8 bytes per base parameter, are sure to be
saved; activations are another matter (the docs' table).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.unit.forked import in_child
from torchtitan.components.model_parts import model_args_for
from torchtitan.config.manager import load_config
from torchtitan.estimation.engine import estimate
from torchtitan.estimation.report import DEFAULT_GPU_RESERVE_GIB, DEVICE_MEMORY_GIB, fits, needed_gib
from torchtitan.models.registry import get_model_spec

REPO = Path(__file__).resolve().parents[2]
WORLD = 8  # one node: the layout every recipe's header states
MODELS = ("llama3", "qwen3")
RECIPES = [f"{model}_8b_{kind}" for model in MODELS for kind in ("sft", "lora")]
GIB = 2**30
# docs/finetuning.md quotes these (rank 16 on wq, wk, wv, wo, w1, w2, w3 of every block)
ADAPTER_PARAMETERS = {"llama3": 41_943_040, "qwen3": 43_646_976}
# AdamW's step counters: one scalar per parameter tensor, bytes next to the gigabytes of state
SCALARS_SLACK = 64 * 1024


def _argv(recipe: str) -> list[str]:
    return ["--job.config_file", str(REPO / "train_configs" / f"{recipe}.toml")]


def _estimate_recipes(recipes: list[str]) -> dict:
    out = {}
    for recipe in recipes:
        cfg, _ = load_config(_argv(recipe), WORLD)
        out[recipe] = estimate(cfg, WORLD, 0, "cuda")
    return out


@pytest.fixture(scope="module")
def estimates() -> dict:
    with ThreadPoolExecutor(len(MODELS)) as pool:
        jobs = [pool.submit(in_child, _estimate_recipes, [r for r in RECIPES if r.startswith(model)])
                for model in MODELS]
        return {recipe: est for job in jobs for recipe, est in job.result().items()}


def _shapes(recipe: str) -> tuple[int, int]:
    """(parameters of the model, LoRA parameters its recipe adds), counted on the meta model's shapes: rank r on a
    Linear of in x out adds A [r, in] and B [out, r]."""
    cfg, _ = load_config(_argv(recipe), WORLD)
    with torch.device("meta"):
        model = get_model_spec(cfg.model.name).model_cls(model_args_for(cfg))
    base = sum(p.numel() for p in model.parameters())
    # all-linear: every projection of the blocks; the output projection never gets one
    linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.startswith("layers.")]
    assert cfg.lora.target_modules == ["all-linear"]
    return base, sum(cfg.lora.rank * (m.in_features + m.out_features) for m in linears)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_fits_one_node_of_h100s(recipe, estimates):
    est = estimates[recipe]
    cfg, resolved = load_config(_argv(recipe), WORLD)
    dims = resolved.parallel_dims
    assert (dims.dp_shard, dims.dp_replicate, dims.tp, dims.pp, dims.cp) == (8, 1, 1, 1, 1)
    assert fits(est.peak_bytes, DEVICE_MEMORY_GIB["h100"], DEFAULT_GPU_RESERVE_GIB), est.peak_bytes / GIB
    # The header's numbers are the estimator's: a change of the recipe or of the estimator shows up here.
    header = (REPO / "train_configs" / f"{recipe}.toml").read_text()
    stated = float(re.search(r"^# Estimated peak ([\d.]+) GiB per GPU", header, re.M).group(1))
    assert stated == pytest.approx(est.peak_bytes / GIB, abs=0.05), (stated, est.peak_bytes / GIB)
    stated_need = float(re.search(r"it needs ([\d.]+) of an H100's", header).group(1))
    need = needed_gib(est.peak_bytes, DEFAULT_GPU_RESERVE_GIB)
    assert stated_need == pytest.approx(need, abs=0.05), (stated_need, need)


@pytest.mark.parametrize("model", MODELS)
def test_lora_frozen_base_has_no_gradient_or_optimizer_state(model, estimates):
    sft, lora = estimates[f"{model}_8b_sft"], estimates[f"{model}_8b_lora"]
    n, adapters = _shapes(f"{model}_8b_lora")
    assert adapters == ADAPTER_PARAMETERS[model]
    assert lora.counts["trainable_parameters"] * WORLD == adapters

    # Between steps, per rank: 16 bytes per parameter for full SFT; 4 per frozen one and 16 per adapter one for LoRA.
    s, lo = sft.steady_bytes, lora.steady_bytes
    assert s["parameters"] == s["gradients"] == 4 * n // WORLD
    assert 0 <= s["optimizer_state"] - 8 * n // WORLD < SCALARS_SLACK
    assert lo["parameters"] == 4 * (n + adapters) // WORLD
    assert lo["gradients"] == 4 * adapters // WORLD
    assert 0 <= lo["optimizer_state"] - 8 * adapters // WORLD < SCALARS_SLACK
    saved = sum(s.values()) - sum(lo.values())
    assert saved >= (12 * n - 16 * adapters) // WORLD - SCALARS_SLACK, saved / GIB

    # At each recipe's peak: the states alive then. Full SFT peaks in backward, before most gradients exist, so the
    # certain saving is AdamW's two moments of every base parameter.
    def states_at_peak(est) -> int:
        return sum(est.breakdown[k] for k in ("parameters", "gradients", "optimizer_state"))

    assert states_at_peak(sft) - states_at_peak(lora) >= (8 * n - 16 * adapters) // WORLD - SCALARS_SLACK
    # Both run per-op AC, which recomputes the adapters' wide B products (torchtitan/distributed/
    # activation_checkpoint.py): LoRA's activations stay near SFT's, and its whole peak is lower by at least that.
    assert sft.peak_bytes - lora.peak_bytes >= (8 * n - 16 * adapters) // WORLD, (sft.peak_bytes / GIB,
                                                                                 lora.peak_bytes / GIB)
