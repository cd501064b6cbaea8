"""Unit tests for torchtitan.components.loss: sum-then-divide-by-global-count is split invariant."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.components.loss import IGNORE_INDEX, count_target_tokens, cross_entropy_sum

VOCAB, DIM, BATCH, SEQ = 13, 6, 8, 5


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    inputs = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    # Uneven masking: some sequences lose many targets, one loses all of them.
    mask = torch.rand(BATCH, SEQ, generator=g) < 0.3
    mask[0, :] = True
    mask[3, 1:] = True
    labels[mask] = IGNORE_INDEX
    assert (labels != IGNORE_INDEX).any()
    return model, inputs, labels


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _reference_grads(model, inputs, labels):
    model.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="mean")
    loss.backward()
    return loss.detach(), _grads(model)


def _microbatch_grads(model, inputs, labels, n_micro: int):
    """What one rank's train_step does: global count first, then sum-loss / global count per micro-batch."""
    model.zero_grad(set_to_none=True)
    micro = list(zip(inputs.chunk(n_micro), labels.chunk(n_micro), strict=True))
    global_tokens = sum(count_target_tokens(lab) for _, lab in micro)
    total = torch.zeros((), dtype=torch.float32)
    for inp, lab in micro:
        loss_sum = cross_entropy_sum(model(inp), lab)
        (loss_sum / global_tokens).backward()
        total += loss_sum.detach()
    return total / global_tokens, _grads(model)


def _assert_close(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n_micro", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_microbatch_split_matches_full_batch_mean(n_micro, seed):
    model, inputs, labels = _setup(seed)
    ref_loss, ref = _reference_grads(model, inputs, labels)
    loss, got = _microbatch_grads(model, inputs, labels, n_micro)
    _assert_close(got, ref)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)


@pytest.mark.parametrize(("n_ranks", "n_micro"), [(2, 1), (2, 2), (4, 1), (2, 4)])
def test_simulated_ranks_summed_gradients_match_full_batch_mean(n_ranks, n_micro):
    model, inputs, labels = _setup(2)
    _, ref = _reference_grads(model, inputs, labels)
    shards = list(zip(inputs.chunk(n_ranks), labels.chunk(n_ranks), strict=True))
    # the all-reduce of the token count over the loss mesh
    global_tokens = sum(count_target_tokens(lab) for _, lab in shards)
    summed = None
    for inp_r, lab_r in shards:  # each "rank" runs its own micro-batches against the global count
        model.zero_grad(set_to_none=True)
        for inp, lab in zip(inp_r.chunk(n_micro), lab_r.chunk(n_micro), strict=True):
            (cross_entropy_sum(model(inp), lab) / global_tokens).backward()
        g = _grads(model)
        summed = g if summed is None else [a + b for a, b in zip(summed, g, strict=True)]  # the SUM gradient reduction
    _assert_close(summed, ref)


def test_dividing_by_the_local_count_would_be_wrong():
    # Guards the test itself: with uneven masking, per-micro-batch means do not reproduce the global mean.
    model, inputs, labels = _setup(0)
    _, ref = _reference_grads(model, inputs, labels)
    model.zero_grad(set_to_none=True)
    chunks = list(zip(inputs.chunk(2), labels.chunk(2), strict=True))
    for inp, lab in chunks:
        (cross_entropy_sum(model(inp), lab) / count_target_tokens(lab) / len(chunks)).backward()
    diff = max((g - r).abs().max().item() for g, r in zip(_grads(model), ref, strict=True))
    assert diff > 1e-4


def test_cross_entropy_sum_equals_sum_reduction():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (2, 4), generator=g)
    labels[0, 0] = IGNORE_INDEX
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
    got = cross_entropy_sum(logits, labels)
    assert got.shape == ()
    torch.testing.assert_close(got, expected)


def test_cross_entropy_sum_is_fp32_for_bf16_logits():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (2, 3), generator=g)
    got = cross_entropy_sum(logits.bfloat16(), labels)
    assert got.dtype == torch.float32
    expected = F.cross_entropy(logits.bfloat16().float().reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    torch.testing.assert_close(got, expected)


def test_cross_entropy_sum_all_ignored_is_zero():
    logits = torch.randn(1, 3, VOCAB, requires_grad=True)
    labels = torch.full((1, 3), IGNORE_INDEX)
    loss = cross_entropy_sum(logits, labels)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(logits.grad) == 0


def test_count_target_tokens_ignores_minus_100():
    assert IGNORE_INDEX == -100
    labels = torch.tensor([[1, -100, 3], [-100, -100, 0]])
    n = count_target_tokens(labels)
    assert isinstance(n, torch.Tensor)
    assert n.item() == 3
    assert count_target_tokens(torch.full((2, 4), -100)).item() == 0
    assert count_target_tokens(torch.zeros(2, 4, dtype=torch.long)).item() == 8
    # only -100 is ignored; other negative values are not special
    assert count_target_tokens(torch.tensor([[-1, -100]])).item() == 1


def _compiled_loss_vs_eager() -> None:
    from torchtitan.distributed.compile import compile_loss
    from torchtitan.models.decoder import OutputProjection

    # As the trainer runs it: each chunk's cross-entropy compiled, called again by the backward's recompute.
    torch.manual_seed(0)
    out = OutputProjection(16, 128)
    h = torch.randn(2, 16, 16, requires_grad=True)
    labels = torch.randint(0, 128, (2, 16))
    labels[0, :3] = IGNORE_INDEX
    eager = cross_entropy_sum(out(h), labels)
    eager_grads = torch.autograd.grad(eager, (h, out.weight))
    out.loss_fn, out.loss_chunks = compile_loss(cross_entropy_sum, "inductor"), 2
    compiled = out(h, labels=labels)
    compiled_grads = torch.autograd.grad(compiled, (h, out.weight))
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-5)
    for got, ref in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_compiled_loss_matches_eager():
    # compile.components = ["loss"] (without loss parallel) runs each chunk's loss through inductor. In a child process:
    # inductor leaves worker threads behind, and later tests fork gloo workers from this process.
    from tests.unit.forked import in_child

    in_child(_compiled_loss_vs_eager)
