"""The GRPO objective: group-normalised advantages and a clipped, token-level policy-gradient loss.

Every response token t of sample i contributes

    -min(r * A_i, clip(r, 1 - clip_low, 1 + clip_high) * A_i) + kl_coeff * k3(ref, new)

with r = exp(logp_new - logp_behaviour), the behaviour log-probabilities being those recorded by the generator when
the token was sampled (so a sample replayed from the buffer after some updates is corrected by its ratio), and
k3 = exp(ref - new) - (ref - new) - 1, an unbiased, non-negative estimator of KL(new || ref) per sampled token.
Separate lower and upper epsilons let a run allow more room upwards (rare tokens gaining probability) than
downwards, as DAPO's "clip higher" does.

The loss is a weighted sum of per-token terms (grpo_token_loss, aggregation_weights) divided by a normaliser the
caller may pass: under data parallelism every rank divides its local sum by the *global* count (tokens or sequences)
of the update, so summed gradients equal the one-process gradient; and since the terms are per token, the policy
update (torchtitan/rl/update.py) sums them chunk by chunk and micro-batch by micro-batch with the same result.
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
    """[..., vocab] logits and targets [...] -> (log-probability of each target, differentiable; entropy of the
    softmax in nats, without gradient (a metric), or None), both shaped like `targets`. The policy update calls this
    on one chunk of tokens at a time (torchtitan/rl/update.py). The logits are a plain tensor, or under tensor
    parallel's loss parallel a DTensor sharded on the vocabulary: then the caller must hold torch's loss_parallel()
    context (forward and backward), whose vocab-sharded log-softmax and nll_loss reduce max and sum-exp over the tp
    ranks, so the logits are never gathered and every tp rank gets the same (replicated) values."""
    # -cross_entropy(reduction="none") is log_softmax + a gather of the targets: the one form loss parallel shards.
    logp = -F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="none")
    if isinstance(logp, DTensor):
        logp = logp.to_local()  # replicated over tp: its backward hands each rank the same gradient, not a sum
    ent = None
    if entropy:
        with torch.no_grad():
            lsm = logits.float().log_softmax(dim=-1)
            ent = -(lsm.exp() * lsm).sum(dim=-1)  # vocab-sharded: partial sums over tp
            ent = (ent.full_tensor() if isinstance(ent, DTensor) else ent).view(targets.shape)
    return logp.view(targets.shape), ent


def grpo_token_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    *, clip_low: float, clip_high: float, kl_coeff: float = 0.0,
                    ref_logp: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's loss term (any shape; `advantages` broadcast to it): the clipped policy-gradient term, plus
    kl_coeff * k3 when kl_coeff != 0. Padding (mask False) gets a finite value the caller's weights zero."""
    # Padding positions may hold anything; zero their log-ratio so exp() cannot overflow into a NaN gradient.
    ratio = torch.exp(torch.where(mask, logp - behaviour_logp, torch.zeros_like(logp)))
    adv = advantages.to(logp.dtype)
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv)
    if kl_coeff != 0.0:
        per_token = per_token + kl_coeff * k3_kl(logp, torch.where(mask, ref_logp, logp))
    return per_token


def aggregation_weights(mask: torch.Tensor, aggregation: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[batch, T] mask -> each token's weight in the loss sum: 1 ("token"), or 1 / its completion's length
    ("sequence"); 0 on padding. The sum of weight x term, divided by the token (or completion) count, is the loss."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    maskf = mask.to(dtype)
    if aggregation == "token":
        return maskf
    return maskf / maskf.sum(dim=-1, keepdim=True).clamp(min=1.0)


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
    """The GRPO loss of a batch and its statistics (the whole batch at once; the trainer computes the same sum chunk
    by chunk, torchtitan/rl/update.py).

    logp, behaviour_logp, ref_logp, entropy: [batch, T] per response token (padding anywhere `mask` is False);
    advantages: [batch], one per sample; mask: [batch, T] bool, the response tokens.
    aggregation "token": sum over every response token / normalizer (default: this batch's token count);
    "sequence": each sample's mean over its own tokens, summed / normalizer (default: this batch's sample count).
    Returns (loss, stats); stats are grpo_stats' local sums.
    """
    if kl_coeff != 0.0 and ref_logp is None:
        raise ValueError("kl_coeff != 0 needs the reference model's log-probabilities (ref_logp)")
    weights = aggregation_weights(mask, aggregation, logp.dtype)
    adv = advantages.unsqueeze(1)
    per_token = grpo_token_loss(logp, behaviour_logp, adv, mask, clip_low=clip_low, clip_high=clip_high,
                                kl_coeff=kl_coeff, ref_logp=ref_logp)
    default_norm = mask.sum() if aggregation == "token" else mask.any(dim=1).sum()
    norm = default_norm if normalizer is None else normalizer
    loss = (per_token * weights).sum() / torch.as_tensor(norm, dtype=logp.dtype, device=logp.device).clamp(min=1.0)
    stats = grpo_stats(logp, behaviour_logp, adv, mask, clip_low=clip_low, clip_high=clip_high, ref_logp=ref_logp,
                       entropy=entropy)
    return loss, stats


@torch.no_grad()
def grpo_stats(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
               clip_low: float, clip_high: float, ref_logp: torch.Tensor | None = None,
               entropy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Local *sums* over the response tokens (any shape; `advantages` broadcast to it): "tokens", "clipped",
    "clipped_low", "clipped_high", "ratio", "pg", "kl" (when ref_logp is given), "entropy" (when given), so the
    caller can add them over ranks and updates before dividing (stat_means)."""
    maskf = mask.float()
    ratio = torch.exp(torch.where(mask, logp - behaviour_logp, torch.zeros_like(logp)))
    adv = advantages.to(logp.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    # The clipped term is the one the min() picked when it is strictly smaller: the gradient is then zero.
    active = (clipped < unclipped) & mask
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    return {
        "tokens": maskf.sum(),
        "clipped": active.float().sum(),
        "clipped_low": (active & (ratio < 1.0 - clip_low)).float().sum(),
        "clipped_high": (active & (ratio > 1.0 + clip_high)).float().sum(),
        "ratio": (ratio * maskf).sum().float(),
        "pg": (-torch.minimum(unclipped, clipped) * maskf).sum().float(),
        "kl": zero if ref_logp is None else (k3_kl(logp, torch.where(mask, ref_logp, logp)) * maskf).sum().float(),
        "entropy": zero if entropy is None else (entropy * maskf).sum().float(),
    }


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
