"""Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p (nucleus).

All on tensors of a whole batch ([batch, vocab], fp32 logits), without a host sync, and reproducible through an
explicit `torch.Generator`. The order is the usual one: divide by the temperature, keep the top-k logits, keep the
top-p nucleus of what is left, renormalise, sample.
"""

from __future__ import annotations

import torch


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """`logits` [..., vocab] with all but the k largest of each row set to -inf (k <= 0 or >= vocab: unchanged).
    Ties at the k-th value are all kept, so a row may keep more than k."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """`logits` [..., vocab] keeping, per row, the smallest set of most probable tokens whose probability reaches
    p (the most probable token always stays); the rest set to -inf. p >= 1: unchanged."""
    if p >= 1.0:
        return logits
    if p <= 0.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token stays when the tokens before it (the more probable ones) have not reached p yet.
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampling_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The logits sampling draws from (their softmax is its distribution): scaled by 1 / temperature, then top-k, then
    top-p. temperature must be positive (0 means greedy: see `choose_tokens`)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive here (0 is greedy), got {temperature}")
    scaled = logits.float() / temperature
    return top_p_filter(top_k_filter(scaled, top_k), top_p)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of `probs` [batch, vocab] (non-negative, rows summing to 1), drawn with those
    probabilities: argmax of probs / E with E ~ Exponential(1) i.i.d. (the exponential race, equivalent to a categorical
    draw). Unlike torch.multinomial it needs no host sync on a GPU; zero-probability tokens are never chosen."""
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    # A draw of exactly 0 would make 0 / 0 = NaN for a zero-probability token, which argmax would pick.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def choose_tokens(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token of each row from `logits` [batch, vocab]: the argmax when temperature is 0 (greedy; top_k and
    top_p then do not matter), else a draw from softmax(sampling_logits(...))."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample(sampling_logits(logits, temperature, top_k, top_p).softmax(dim=-1), generator)
