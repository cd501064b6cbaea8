"""Every model adapter's `row_links` (torchtitan/models/hf_common.py RowLink) says exactly what its `to_hf` and
`from_hf` do: moving rows by the links alone, on random state dicts, gives the same tensors, and covers every row
once. Export and import by shard (torchtitan/components/hf_sharded.py) move data by the links only, so a link that
drifted from the conversion would write wrong files; this test catches it on one process in well under a second."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from torchtitan.models.hf_common import RowLink


def _rows(rows, n: int) -> Tensor:
    if rows is None:
        return torch.arange(n)
    return torch.arange(rows.start, rows.stop, rows.step) if isinstance(rows, range) else rows


def _as2d(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _move(links: list[RowLink], src: dict[str, Tensor], dst_like: dict[str, Tensor], to_hf: bool) -> dict[str, Tensor]:
    """Destination tensors built by the links only (NaN where no link wrote); fails on a row written twice."""
    out = {k: torch.full_like(v, float("nan")) for k, v in dst_like.items()}
    hit = {k: torch.zeros(_as2d(v).shape[0], dtype=torch.int64) for k, v in dst_like.items()}
    for link in links:
        s_key, d_key = (link.our_key, link.hf_key) if to_hf else (link.hf_key, link.our_key)
        s_rows, d_rows = (link.our_rows, link.hf_rows) if to_hf else (link.hf_rows, link.our_rows)
        s2d, d2d = _as2d(src[s_key]), _as2d(out[d_key])
        s_idx, d_idx = _rows(s_rows, s2d.shape[0]), _rows(d_rows, d2d.shape[0])
        assert s_idx.numel() == d_idx.numel(), link
        d2d[d_idx] = s2d[s_idx]
        hit[d_key].index_add_(0, d_idx, torch.ones_like(d_idx))
    for k, h in hit.items():
        assert h.numel() == 0 or int(h.max()) <= 1, f"{k}: a row linked twice"
    return out


def _random_state_dict(adapter) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(shape, generator=gen) for k, shape in adapter.shapes.items()}
    if adapter.model_args.tie_word_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    for k in getattr(adapter, "bias_keys", []):  # Qwen3's routing bias, left out by HF
        sd[k] = torch.zeros(adapter.model_args.moe.num_experts)
    return sd


def _fused(hf: dict[str, Tensor], n_experts: int) -> dict[str, Tensor]:
    """transformers' in-memory expert layout (gate_up_proj, down_proj per layer) from the per-expert one."""
    out = {k: v for k, v in hf.items() if ".mlp.experts." not in k}
    prefixes = sorted({k.split("experts.")[0] + "experts." for k in hf if ".mlp.experts." in k})
    for p in prefixes:
        gate = [hf[f"{p}{j}.gate_proj.weight"] for j in range(n_experts)]
        up = [hf[f"{p}{j}.up_proj.weight"] for j in range(n_experts)]
        out[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
        out[p + "down_proj"] = torch.stack([hf[f"{p}{j}.down_proj.weight"] for j in range(n_experts)])
    return out


def _adapters():
    from torchtitan.models.deepseek_v3.args import deepseek_v3_flavors
    from torchtitan.models.deepseek_v3.hf_adapter import DeepSeekV3StateDictAdapter
    from torchtitan.models.llama3.args import llama3_flavors
    from torchtitan.models.llama3.hf_adapter import Llama3StateDictAdapter
    from torchtitan.models.qwen3.args import qwen3_flavors
    from torchtitan.models.qwen3.hf_adapter import Qwen3StateDictAdapter

    llama = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=2, vocab_size=300)
    qwen = dataclasses.replace(qwen3_flavors["debugmodel_moe"], n_layers=2, vocab_size=300)
    ds = deepseek_v3_flavors["debugmodel_small"]
    no_bias = dataclasses.replace(ds, moe=dataclasses.replace(ds.moe, load_balance_coeff=0.0))
    return {
        "llama3": (Llama3StateDictAdapter, llama),
        "llama3_tied": (Llama3StateDictAdapter, dataclasses.replace(llama, tie_word_embeddings=True)),
        "qwen3_moe": (Qwen3StateDictAdapter, qwen),
        "qwen3_tied": (Qwen3StateDictAdapter, dataclasses.replace(qwen, tie_word_embeddings=True)),
        "deepseek_v3": (DeepSeekV3StateDictAdapter, ds),
        "deepseek_v3_no_bias": (DeepSeekV3StateDictAdapter, no_bias),
    }


@pytest.mark.parametrize("name", list(_adapters()))
def test_links_reproduce_to_hf_and_from_hf(name: str) -> None:
    cls, args = _adapters()[name]
    adapter = cls(args)
    ours = _random_state_dict(adapter)
    if name.startswith("deepseek") and adapter.has_bias:
        for k in ours:
            if k.endswith("expert_bias"):
                ours[k] = torch.randn(ours[k].shape)
    hf = adapter.to_hf(ours)
    links = adapter.row_links(None)
    moved = _move(links, ours, hf, to_hf=True)
    linked = {link.hf_key for link in links}
    for k, want in hf.items():
        if k in linked:
            assert torch.equal(moved[k], want), k
        else:  # made from nothing by to_hf (a zero routing bias): export leaves its rows as zeros
            assert not bool(want.ne(0).any()), k

    layouts = {"on disk": hf}
    if hasattr(args, "moe") and any(".mlp.experts." in k for k in hf):
        layouts["fused"] = _fused(hf, args.moe.num_experts)
    for layout, hf_sd in layouts.items():
        want = adapter.from_hf(hf_sd)
        links = [link for link in adapter.row_links(set(hf_sd)) if link.hf_key in hf_sd]
        got = _move(links, hf_sd, want, to_hf=False)
        linked = {link.our_key for link in links}
        for k, v in want.items():
            if k in linked:
                assert torch.equal(got[k], v), (layout, k)
            else:  # values from_hf makes itself (zero bias) or an alias of a linked tensor (tied output)
                assert k.endswith("expert_bias") or v is want["tok_embeddings.weight"], (layout, k)


def test_a_drifted_link_is_caught() -> None:
    """The check above fails when a link is wrong: wq's rows unpermuted."""
    cls, args = _adapters()["llama3"]
    adapter = cls(args)
    ours = _random_state_dict(adapter)
    hf = adapter.to_hf(ours)
    links = [RowLink(link.hf_key, link.our_key) if link.our_key.endswith("wq.weight") else link
             for link in adapter.row_links(None)]
    moved = _move(links, ours, hf, to_hf=True)
    assert not torch.equal(moved["model.layers.0.self_attn.q_proj.weight"],
                           hf["model.layers.0.self_attn.q_proj.weight"])
