"""Activation checkpointing: same gradients, fewer saved activations, in the expected order."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.args import llama3_flavors
from torchtitan.models.llama3.model import Transformer


def _model() -> Transformer:
    torch.manual_seed(0)
    args = dataclasses.replace(llama3_flavors["debugmodel"], max_seq_len=64)
    model = Transformer(args)
    model.init_weights()
    return model


def _saved_bytes_and_grads(model: Transformer, tokens: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    saved = 0

    def pack(t: torch.Tensor):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()}
    return saved, grads


@pytest.fixture(scope="module")
def baseline():
    tokens = torch.randint(0, 8192, (2, 64), generator=torch.Generator().manual_seed(1))
    return tokens, _model(), _saved_bytes_and_grads(_model(), tokens)


@pytest.mark.parametrize(("mode", "option", "wrapped"), [
    ("full", "2", 4), ("selective", "2", 2), ("selective", "1", 4), ("selective", "op", 4),
])
def test_ac_keeps_gradients_and_saves_less(baseline, mode, option, wrapped):
    tokens, reference_model, (base_saved, base_grads) = baseline
    model = apply_ac(copy.deepcopy(reference_model), mode, option)
    n_wrapped = sum("CheckpointWrapper" in type(b).__name__ for b in model.layers.values())
    assert n_wrapped == wrapped
    saved, grads = _saved_bytes_and_grads(model, tokens)
    assert saved < base_saved, (mode, option, saved, base_saved)
    for name, g in base_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _backward_matmuls(model: Transformer, tokens: torch.Tensor) -> int:
    loss = model(tokens).float().logsumexp(-1).mean()
    with _CountMatmuls() as counter:
        loss.backward()
    return counter.count


def test_op_policy_recomputes_no_matmul_and_full_recomputes_all(baseline):
    # Selective-op AC keeps matmul outputs, so backward runs exactly the matmuls of a run without AC;
    # full AC re-runs the block's forward matmuls too: q, k, v, o, w1, w3 per block (w2's output is needed by
    # no backward op, and torch's recomputation stops as soon as every needed tensor is back).
    tokens, reference_model, _ = baseline
    none = _backward_matmuls(copy.deepcopy(reference_model), tokens)
    op = _backward_matmuls(apply_ac(copy.deepcopy(reference_model), "selective", "op"), tokens)
    full = _backward_matmuls(apply_ac(copy.deepcopy(reference_model), "full", "1"), tokens)
    n_blocks = len(reference_model.layers)
    assert op == none
    assert full == none + 6 * n_blocks


def test_none_is_a_no_op():
    model = _model()
    assert apply_ac(model, "none", "2") is model
    assert not any("CheckpointWrapper" in type(b).__name__ for b in model.layers.values())


# --------------------------------------------------------------------------- LoRA under activation checkpointing


def _lora_model(dropout: float) -> Transformer:
    from types import SimpleNamespace

    from torchtitan.components.quantization import lora

    model = _model()
    cfg = SimpleNamespace(lora=SimpleNamespace(rank=4, alpha=8.0, dropout=dropout, target_modules=["all-linear"]),
                          model=SimpleNamespace(name="llama3", flavor="debugmodel"))
    lora.convert(model, cfg)
    for m in model.modules():
        if isinstance(m, lora.LoRALinear):
            m.init_adapter_weights(lambda p, fill: torch.nn.init.normal_(p, std=0.02))  # B != 0: gradients reach A
    return model


def _adapter_grads(model: Transformer, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(123)  # the dropout masks of the forward
    model(tokens).float().logsumexp(-1).mean().backward()
    return {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize(("mode", "option"), [("full", "1"), ("selective", "op"), ("selective", "2")])
def test_lora_dropout_draws_the_same_mask_when_a_block_is_recomputed(baseline, mode, option):
    # A recompute that drew fresh dropout masks would give the adapters the gradient of another forward than the
    # one that made the loss (measured before the fix: lora_a's gradients off by O(1) under full and per-op AC).
    tokens = baseline[0]
    reference = _lora_model(dropout=0.5)
    want = _adapter_grads(copy.deepcopy(reference), tokens)
    got = _adapter_grads(apply_ac(copy.deepcopy(reference), mode, option), tokens)
    assert want and set(got) == set(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_op_policy_recomputes_the_adapters_wide_products_instead_of_keeping_them(baseline, monkeypatch):
    # Per-op AC keeps every matmul's output; LoRA's B product ([tokens, r] x [r, out]) is as wide as its base's output
    # and costs r multiply-adds per element to recompute, so it is recomputed: the peak falls by about those outputs.
    from torch.profiler import ProfilerActivity, profile

    from torchtitan.distributed import activation_checkpoint
    from torchtitan.tools.profiling import allocator_peak

    tokens = baseline[0]
    reference = _lora_model(dropout=0.0)

    def peak(model: Transformer) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model(tokens).float().logsumexp(-1).mean().backward()
        return allocator_peak(prof)

    with_rule = apply_ac(copy.deepcopy(reference), "selective", "op")
    monkeypatch.setattr(activation_checkpoint, "_low_ranks", lambda block: frozenset())
    keeping_all = apply_ac(copy.deepcopy(reference), "selective", "op")
    args = reference.model_args
    hidden = reference.layers["0"].feed_forward.w1.out_features
    kv = args.n_kv_heads * (args.dim // args.n_heads)
    b_outputs = tokens.numel() * 4 * len(reference.layers) * (2 * args.dim + 2 * kv + 2 * hidden + args.dim)
    saved = peak(keeping_all) - peak(with_rule)
    assert 0.9 * b_outputs <= saved <= 1.1 * b_outputs, (saved, b_outputs)
    want, got = _adapter_grads(keeping_all, tokens), _adapter_grads(with_rule, tokens)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=name)
