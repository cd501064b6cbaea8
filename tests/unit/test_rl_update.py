"""The policy update (torchtitan/rl/update.py) on a tiny Llama in one process: micro-batches and chunked
log-probabilities give the whole-batch loss, statistics and gradients; a second mini-batch trains off-policy with the
clipping the ratios call for; the step's metrics average its updates; the chunks never hold the whole logits.
The data-parallel and tensor-parallel layouts of the same code are in tests/unit/test_rl_loop.py."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from torchtitan.models.llama3.args import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.rl.buffer import Group
from torchtitan.rl.loss import grpo_loss, grpo_stats, stat_means, token_logprobs
from torchtitan.rl.update import (
    LossSettings,
    TokenTable,
    merge_updates,
    mini_batches,
    pack,
    policy_update,
    samples_of,
    scoring_with,
)
from torchtitan.tools.profiling import allocator_peak

CPU = torch.device("cpu")
SUMS = ("tokens", "clipped", "clipped_low", "clipped_high", "ratio", "pg", "kl", "entropy")


def _model(args=None, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args or llama3_flavors["debugmodel_small"])
    model.init_weights()
    return model


class Recorder:
    """An optimizer that keeps the gradients it is asked to apply, and applies nothing."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.grads = model, None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.grads = {name: p.grad.clone() for name, p in self.model.named_parameters()}


@torch.no_grad()
def _own_logprobs(model, prompt, completion) -> list[float]:
    tokens, targets, mask, _, _ = pack([(prompt, completion, [0.0] * len(completion), 0.0)], 1, CPU)
    return token_logprobs(model(tokens), targets)[0][mask].tolist()


def _groups(model, n_groups: int, group_size: int, noise: float, seed: int = 0) -> list[Group]:
    """Groups of random prompts and completions of different lengths; the behaviour log-probabilities are the
    model's own plus `noise` (0: on-policy, ratio 1)."""
    rng, vocab = random.Random(seed), model.model_args.vocab_size
    groups = []
    for index in range(n_groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 7))]
        completions = [[rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(group_size)]
        logprobs = [[lp + rng.uniform(-noise, noise) for lp in _own_logprobs(model, prompt, c)] for c in completions]
        advantages = [rng.uniform(-1.5, 1.5) for _ in completions]
        groups.append(Group(index=index, prompt=prompt, completions=completions, logprobs=logprobs,
                            rewards=[0.0] * group_size, advantages=advantages))
    return groups


def _whole_batch(model, reference, samples, settings: LossSettings):
    """The reference computation: every position's full logits at once, then the loss over the whole batch."""
    tokens, targets, mask, behaviour, adv = pack(samples, 1, CPU)
    model.zero_grad(set_to_none=True)
    logp, entropy = token_logprobs(model(tokens), targets, entropy=True)
    with torch.no_grad():
        ref = token_logprobs(reference(tokens), targets)[0]
    loss, stats = grpo_loss(logp, behaviour, adv, mask, clip_low=settings.clip_low, clip_high=settings.clip_high,
                            kl_coeff=settings.kl_coeff, ref_logp=ref, aggregation=settings.aggregation,
                            entropy=entropy)
    loss.backward()
    return loss.item(), {k: v.item() for k, v in stats.items()}, {n: p.grad.clone() for n, p in
                                                                   model.named_parameters()}


@pytest.fixture(scope="module")
def policy_and_reference():
    model = _model()
    reference = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():  # a reference apart from the policy, so the KL term and its gradient are not zero
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    # Off-policy by up to 0.3 nats: some ratios clip on both sides, others do not.
    return model, reference, samples_of(_groups(model, 3, 4, noise=0.3))


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize(("micro_batch_size", "chunks"), [(0, 1), (0, 5), (1, 1), (5, 3), (12, 1000)],
                         ids=["whole", "chunks5", "micro1", "micro5_chunks3", "chunk_per_position"])
def test_micro_batches_and_chunks_equal_the_whole_batch(policy_and_reference, aggregation, micro_batch_size,
                                                        chunks):
    model, reference, samples = policy_and_reference
    settings = LossSettings(clip_low=0.1, clip_high=0.15, kl_coeff=0.5, aggregation=aggregation)
    want_loss, want_stats, want_grads = _whole_batch(model, reference, samples, settings)
    assert 0 < want_stats["clipped_low"] and 0 < want_stats["clipped_high"]  # the case is not trivial
    model.output.loss_chunks = reference.output.loss_chunks = chunks
    recorder = Recorder(model)
    try:
        out = policy_update([model], recorder, samples, settings, device=CPU, micro_batch_size=micro_batch_size,
                            reference=reference)
    finally:
        model.output.loss_chunks = reference.output.loss_chunks = 1
    assert out["loss"] == pytest.approx(want_loss, rel=1e-5)
    for key in ("tokens", "clipped", "clipped_low", "clipped_high"):
        assert out[key] == want_stats[key], key
    for key in ("ratio", "pg", "kl", "entropy"):
        assert out[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-6), key
    # fp32 sums in other orders and matmuls of other shapes: measured at most 2.4e-6 of a norm (one chunk per
    # position), 9e-7 with one completion per micro-batch
    for name, grad in recorder.grads.items():
        assert (grad - want_grads[name]).norm() <= 1e-5 * want_grads[name].norm(), name


def test_a_second_mini_batch_trains_off_policy():
    model = _model()
    groups = _groups(model, 4, 4, noise=0.0)  # sampled by this very policy: the first update has ratio 1
    settings = LossSettings(clip_low=0.2, clip_high=0.2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.0)
    results, expected = [], []
    for mini in mini_batches(groups, 2, 2):  # 2 mini-batches of 2 groups, 2 epochs: 4 updates
        samples = samples_of(mini)
        tokens, targets, mask, behaviour, adv = pack(samples, 1, CPU)
        with torch.no_grad():  # what the update must see: this mini-batch's ratios under the current weights
            logp = token_logprobs(model(tokens), targets)[0]
            expected.append(grpo_stats(logp, behaviour, adv.unsqueeze(1), mask, clip_low=0.2, clip_high=0.2))
        results.append(policy_update([model], optimizer, samples, settings, device=CPU, micro_batch_size=3))
    assert len(results) == 4
    first = stat_means(results[0])
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and results[0]["clipped"] == 0
    for k, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert got["clipped"] == want["clipped"].item(), k
        assert got["ratio"] == pytest.approx(want["ratio"].item(), rel=1e-5), k
    for later in results[1:]:  # the behaviour log-probabilities stay the generator's: the ratio has moved
        means = stat_means(later)
        assert abs(means["ratio_mean"] - 1.0) > 1e-3 and means["clip_frac"] > 0.02, means
    merged = merge_updates(results)
    assert merged["updates"] == 4
    assert merged["loss"] == pytest.approx(sum(r["loss"] for r in results) / 4)
    assert merged["grad_norm"] == pytest.approx(sum(r["grad_norm"] for r in results) / 4)
    means = stat_means(merged)  # per-token means over every update's tokens
    assert means["clip_frac"] == pytest.approx(sum(r["clipped"] for r in results) / sum(r["tokens"] for r in results))
    assert min(stat_means(r)["clip_frac"] for r in results) < means["clip_frac"] < max(
        stat_means(r)["clip_frac"] for r in results)


def test_mini_batches_split_in_drawn_order_or_reshuffled_each_pass():
    assert list(mini_batches([1, 2, 3, 4], 2, 2)) == [[1, 2], [3, 4], [1, 2], [3, 4]]
    assert list(mini_batches([1, 2, 3], 2, 1)) == [[1, 2], [3]]  # a short draw: the last update is smaller
    assert list(mini_batches([1, 2, 3], 0, 1)) == [[1, 2, 3]]
    groups = list(range(8))
    shuffled = list(mini_batches(groups, 2, 3, shuffle_seed=5))
    passes = [sum(shuffled[k:k + 4], []) for k in (0, 4, 8)]
    assert all(sorted(p) == groups for p in passes)  # every pass trains each group once
    assert len({tuple(p) for p in passes} | {tuple(groups)}) == 4  # each in its own order
    assert shuffled == list(mini_batches(groups, 2, 3, shuffle_seed=5))  # every rank, and a resumed run, alike
    assert shuffled != list(mini_batches(groups, 2, 3, shuffle_seed=6))  # the seed includes the step
    assert list(mini_batches(groups, 0, 2, shuffle_seed=5)) == [groups, groups]  # one mini-batch: nothing to shuffle


# A model whose output layer dwarfs everything else: 4 x 127 positions x 8192 vocabulary x 4 bytes = 16 MiB of fp32
# logits, against 1 MiB for each of the embedding and the projection.
BIG_VOCAB = dataclasses.replace(llama3_flavors["debugmodel_small"], dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                vocab_size=8192, multiple_of=32)


def _allocator_peak(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return allocator_peak(prof)


@pytest.mark.parametrize("grad", [True, False], ids=["policy_update", "reference"])
def test_whole_logits_never_exist_at_once(grad):
    model = _model(BIG_VOCAB)
    rng = random.Random(0)
    samples = [([rng.randrange(8192) for _ in range(8)], [rng.randrange(8192) for _ in range(120)], [-9.0] * 120,
                1.0 - 2 * (i % 2)) for i in range(4)]
    logits_bytes, chunks = 4 * 127 * 8192 * 4, 8
    settings = LossSettings(clip_low=0.2, clip_high=0.2)

    def run(n: int) -> None:
        model.output.loss_chunks = n
        if grad:  # forward and backward of the policy
            policy_update([model], Recorder(model), samples, settings, device=CPU)
        else:  # the reference's log-probabilities
            table = TokenTable([samples], 1, settings, CPU)
            table.ref_logp = torch.zeros_like(table.logp)
            with torch.no_grad(), scoring_with(model, table.score_reference):
                model(table.micro[0].tokens, labels=table.micro[0].index)

    whole, chunked = _allocator_peak(lambda: run(1)), _allocator_peak(lambda: run(chunks))
    # Whole: the logits and their log-softmax (kept for the backward, or the entropy's) at least. Measured: 81 MiB
    # (policy update), 32 MiB (reference).
    assert whole >= 2 * logits_bytes, (whole, logits_bytes)
    # Chunked: a few copies of one chunk's logits, plus the weights' gradients and their recorded copies (4 MiB)
    # and small tensors; measured 7.5 and 4.1 MiB. Keeping every chunk's log-softmax for the backward (chunks
    # without the recompute) held 23 MiB.
    assert chunked <= 4 * logits_bytes / chunks + 6 * 2**20, (chunked, logits_bytes)
