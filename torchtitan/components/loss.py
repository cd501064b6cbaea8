"""Cross-entropy as a *sum* over target tokens; the trainer divides by the global token count.

Summing locally and dividing by the token count of the whole global batch (all micro-batches, all DP/CP
ranks) makes the gradient independent of how the batch is split (see docs/architecture.md, 'Loss normalisation').
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token losses in fp32 (bf16 logits would lose precision in the log-sum-exp). `logits` [..., vocab],
    `labels` of the same leading shape ([batch, seq], or [tokens] for a chunk of them)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def count_target_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
