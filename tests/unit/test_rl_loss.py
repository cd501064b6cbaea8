"""The GRPO loss and advantages against hand computation on a tiny batch (torchtitan/rl/loss.py)."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan.rl.loss import group_advantages, grpo_loss, k3_kl, stat_means

CLIP_LOW, CLIP_HIGH = 0.1, 0.3  # different on purpose: swapping them changes every clipped case below

# Two samples, three token slots; sample 1 has two response tokens (its last slot is padding).
LOGP = [[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]]
BEHAVIOUR = [[-1.5, -1.8, -0.5], [-1.0, -0.6, 9.0]]  # ratios e^0.5, e^-0.2, 1 | e^-0.5, e^0.4, (pad)
REF = [[-1.2, -2.1, -0.4], [-1.4, -0.3, 0.0]]
MASK = [[True, True, True], [True, True, False]]
ADV = [1.0, -2.0]


def by_hand(aggregation: str, kl_coeff: float) -> tuple[float, dict]:
    per_seq, flat, clipped = [], [], 0
    for i in range(2):
        terms = []
        for t in range(3):
            if not MASK[i][t]:
                continue
            r = math.exp(LOGP[i][t] - BEHAVIOUR[i][t])
            a = ADV[i]
            bounded = min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH)
            term = -min(r * a, bounded * a)
            clipped += bounded * a < r * a
            d = REF[i][t] - LOGP[i][t]
            term += kl_coeff * (math.exp(d) - d - 1)
            terms.append(term)
        per_seq.append(sum(terms) / len(terms))
        flat += terms
    loss = sum(flat) / len(flat) if aggregation == "token" else sum(per_seq) / len(per_seq)
    return loss, {"clipped": clipped, "tokens": len(flat)}


def compute(aggregation: str, kl_coeff: float, **kw):
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return grpo_loss(t(LOGP), t(BEHAVIOUR), t(ADV), torch.tensor(MASK), clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                     kl_coeff=kl_coeff, ref_logp=t(REF), aggregation=aggregation, **kw)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("kl_coeff", [0.0, 0.5])
def test_loss_matches_hand_computation(aggregation, kl_coeff):
    loss, stats = compute(aggregation, kl_coeff)
    want, counts = by_hand(aggregation, kl_coeff)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert stats["tokens"].item() == counts["tokens"] == 5
    assert stats["clipped"].item() == counts["clipped"]


def test_clipping_on_both_sides():
    _, stats = compute("token", 0.0)
    # Sample 0 (A > 0): ratio e^0.5 = 1.65 > 1.3 is clipped above. Sample 1 (A < 0): ratio e^-0.5 = 0.61 < 0.9 is
    # clipped below; e^0.4 = 1.49 is above 1.3 but with A < 0 the unclipped term is the smaller: not clipped.
    assert stats["clipped_high"].item() == 1 and stats["clipped_low"].item() == 1
    means = stat_means(stats)
    assert means["clip_frac"] == pytest.approx(2 / 5)
    rows = zip(LOGP, BEHAVIOUR, MASK, strict=True)
    ratios = [math.exp(a - b) for ra, rb, rm in rows for a, b, m in zip(ra, rb, rm, strict=True) if m]
    assert means["ratio_mean"] == pytest.approx(sum(ratios) / 5)


def test_clipped_tokens_get_no_gradient():
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    loss, _ = grpo_loss(logp, torch.tensor(BEHAVIOUR, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64),
                        torch.tensor(MASK), clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[1, 0] == 0  # the two clipped tokens
    assert logp.grad[1, 2] == 0  # padding
    assert logp.grad[0, 1] != 0 and logp.grad[1, 1] != 0


def test_kl_term_and_its_mean():
    _, stats = compute("token", 0.5)
    rows = zip(LOGP, REF, MASK, strict=True)
    kls = [math.exp(r - a) - (r - a) - 1 for ra, rr, rm in rows for a, r, m in zip(ra, rr, rm, strict=True) if m]
    assert stat_means(stats)["kl"] == pytest.approx(sum(kls) / 5)
    assert k3_kl(torch.tensor([0.3]), torch.tensor([0.3])).item() == 0.0  # zero at equality, >= 0 elsewhere
    assert (k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


def test_normalizer_divides_the_local_sum():
    full, _ = compute("token", 0.0)
    part, _ = compute("token", 0.0, normalizer=10)
    assert part.item() == pytest.approx(full.item() * 5 / 10)


def test_kl_needs_reference():
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1, dtype=torch.bool),
                  clip_low=0.2, clip_high=0.2, kl_coeff=0.1)


def test_advantages_with_and_without_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 2.0]])
    centred = group_advantages(rewards, std_normalize=False)
    assert centred.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [1.0, -1.0, 0.0, 0.0]]
    scaled = group_advantages(rewards, std_normalize=True)
    std0 = math.sqrt(4 * 0.25 / 3)  # unbiased
    std2 = math.sqrt(2 / 3)
    assert scaled[0].tolist() == pytest.approx([0.5 / (std0 + 1e-6), -0.5 / (std0 + 1e-6)] * 1 + [
        -0.5 / (std0 + 1e-6), 0.5 / (std0 + 1e-6)])
    assert scaled[1].tolist() == [0.0] * 4  # equal rewards: zero, not NaN
    assert scaled[2].tolist() == pytest.approx([1 / (std2 + 1e-6), -1 / (std2 + 1e-6), 0.0, 0.0])
