"""The GRPO objective: group-normalised advantages and a clipped, token-level policy-gradient loss.

Every response token t of sample i contributes

    -min(r * A_i, clip(r, 1 - clip_low, 1 + clip_high) * A_i) + kl_coeff * k3(ref, new)

with r = exp(logp_new - logp_behaviour), the behaviour log-probabilities being those recorded by the generator when
the token was sampled (so a sample replayed from the buffer after some updates is corrected by its ratio), and
k3 = exp(ref - new) - (ref - new) - 1, an unbiased, non-negative estimator of KL(new || ref) per sampled token.
Separate lower and upper epsilons let a run allow more room upwards (rare tokens gaining probability) than
downwards, as DAPO's "clip higher" does.

The loss is a sum divided by a normaliser the caller may pass: under data parallelism every rank divides its local
sum by the *global* count (tokens or sequences), so summed gradients equal the one-process gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

AGGREGATIONS = ("token", "sequence")


def group_advantages(rewards: torch.Tensor, std_normalize: bool, eps: float = 1e-6) -> torch.Tensor:
    """[groups, G] rewards -> advantages: reward minus its group's mean, divided by the group's standard deviation
    (unbiased, + eps) when `std_normalize`. A group whose rewards are all equal gets zero advantages either way."""
    rewards = rewards.double()
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if std_normalize:
        centered = centered / (rewards.std(dim=1, keepdim=True) + eps)
    return centered.float()


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(ref - new) - (ref - new) - 1 (>= 0)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T, vocab] logits and [B, T] targets -> ([B, T] log-probability of each target, differentiable; [B, T]
    entropy of the softmax in nats, without gradient (a metric), or None). The logits are a plain tensor, or under
    tensor parallel's loss parallel a DTensor sharded on the vocabulary: then the caller must hold torch's
    loss_parallel() context (forward and backward), whose vocab-sharded log-softmax and nll_loss reduce max and
    sum-exp over the tp ranks, so the [B, T, vocab] logits are never gathered and every tp rank gets the same
    (replicated) values."""
    batch, length = targets.shape
    # -cross_entropy(reduction="none") is log_softmax + a gather of the targets: the one form loss parallel shards.
    logp = -F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    if isinstance(logp, DTensor):
        logp = logp.to_local()  # replicated over tp: its backward hands each rank the same gradient, not a sum
    ent = None
    if entropy:
        with torch.no_grad():
            lsm = logits.float().log_softmax(dim=-1)
            ent = -(lsm.exp() * lsm).sum(dim=-1)  # vocab-sharded: partial sums over tp
            ent = ent.full_tensor() if isinstance(ent, DTensor) else ent
    return logp.view(batch, length), ent


def grpo_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    kl_coeff: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    aggregation: str = "token",
    normalizer: float | torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of a batch and its statistics.

    logp, behaviour_logp, ref_logp, entropy: [batch, T] per response token (padding anywhere `mask` is False);
    advantages: [batch], one per sample; mask: [batch, T] bool, the response tokens.
    aggregation "token": sum over every response token / normalizer (default: this batch's token count);
    "sequence": each sample's mean over its own tokens, summed / normalizer (default: this batch's sample count).
    Returns (loss, stats); stats hold local *sums* over response tokens ("tokens", "clipped", "clipped_low",
    "clipped_high", "ratio", "kl", "entropy", "pg") so the caller can reduce them over ranks before dividing.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if kl_coeff != 0.0 and ref_logp is None:
        raise ValueError("kl_coeff != 0 needs the reference model's log-probabilities (ref_logp)")
    maskf = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    # Padding positions may hold anything; zero their log-ratio so exp() cannot overflow into a NaN gradient.
    log_ratio = torch.where(mask, logp - behaviour_logp, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    pg = per_token
    kl = None
    if ref_logp is not None:
        kl = k3_kl(logp, torch.where(mask, ref_logp, logp))
        if kl_coeff != 0.0:
            per_token = per_token + kl_coeff * kl
    if aggregation == "token":
        total = (per_token * maskf).sum()
        default_norm = maskf.sum()
    else:
        lengths = maskf.sum(dim=1).clamp(min=1.0)
        total = ((per_token * maskf).sum(dim=1) / lengths).sum()
        default_norm = (maskf.sum(dim=1) > 0).to(logp.dtype).sum()
    norm = default_norm if normalizer is None else normalizer
    loss = total / torch.as_tensor(norm, dtype=logp.dtype, device=logp.device).clamp(min=1.0)

    with torch.no_grad():
        # The clipped term is the one the min() picked when it is strictly smaller: the gradient is then zero.
        active = (clipped < unclipped) & mask
        low = active & (ratio < 1.0 - clip_low)
        high = active & (ratio > 1.0 + clip_high)
        zero = torch.zeros((), dtype=torch.float32, device=logp.device)
        stats = {
            "tokens": maskf.sum().float(),
            "sequences": (maskf.sum(dim=1) > 0).float().sum(),
            "clipped": active.float().sum(),
            "clipped_low": low.float().sum(),
            "clipped_high": high.float().sum(),
            "ratio": (ratio * maskf).sum().float(),
            "pg": (pg * maskf).sum().float(),
            "kl": zero if kl is None else (kl * maskf).sum().float(),
            "entropy": zero if entropy is None else (entropy * maskf).sum().float(),
        }
    return loss, stats


def stat_means(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-token means of grpo_loss's summed statistics (after any reduction over ranks)."""
    tokens = max(float(stats["tokens"]), 1.0)
    return {
        "clip_frac": float(stats["clipped"]) / tokens,
        "clip_frac_low": float(stats["clipped_low"]) / tokens,
        "clip_frac_high": float(stats["clipped_high"]) / tokens,
        "ratio_mean": float(stats["ratio"]) / tokens,
        "kl": float(stats["kl"]) / tokens,
        "entropy": float(stats["entropy"]) / tokens,
    }
