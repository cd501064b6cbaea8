"""The losses an MoE layer may add to the training loss to keep its routing healthy: the balance loss over a chosen
scope of tokens, and the router z-loss. Pure functions of the router's outputs; the layer (moe.py) decides when they
run and how they join the backward.

Both come out as a sum over this rank's tokens of a per-token term. The layer multiplies it by its `token_scale`,
1 / the tokens of the global batch, so that, summed over every rank and (pipeline) micro-batch, each loss is a mean
over the global batch, the same in every layout.

The balance loss of a group of tokens (one sequence, one data rank's micro-batch, or the micro-batch of every data
rank) is sum_i f_i P_i, with f_i = num_experts x (the group's routed (token, slot) pairs on expert i) / (top_k x the
group's tokens), 1 for every expert when balanced and without gradient (the selection is discrete), and P_i the
group's mean normalised score of expert i. Given f, the loss is linear in the scores:
sum over the group's tokens t of sum_i f_i p_ti / (the group's tokens). Every group has the same number of tokens, so
the mean over groups is the sum over tokens of sum_i f_i p_ti / (all tokens): the token scale above. A rank thus
needs only the group's counts for f, which `reduce` sums over the ranks holding the group's other tokens
(context- and tensor-parallel ranks split each sequence; global_batch adds the data ranks); its own tokens' scores
give its share of the loss and of the gradient, and the backward's sums over ranks do the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def balance_loss_sum(scores: torch.Tensor, experts: torch.Tensor, batch: int, top_k: int, scope: str,
                     reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """sum over this rank's tokens t of sum_i f_{group(t), i} p_ti (a scalar; gradient through `scores` only).

    scores [tokens, experts] (tokens = batch sequences x their tokens on this rank, sequence-major), experts
    [tokens, top_k] the chosen experts; scope sequence | microbatch | global_batch (the groups above); `reduce` sums
    an int64 tensor over the ranks that share this rank's groups (None: nobody does)."""
    tokens, num_experts = scores.shape
    groups = batch if scope == "sequence" else 1
    assert tokens % groups == 0, f"{tokens} tokens are not {groups} sequences of equal length"
    probs = scores / scores.sum(dim=-1, keepdim=True)  # sigmoid scores do not sum to 1
    with torch.no_grad():
        # Per group: routed pairs per expert, then the group's token count (int64: exact at any batch size).
        stats = torch.zeros(groups, num_experts + 1, dtype=torch.int64, device=scores.device)
        group = torch.arange(tokens, device=scores.device) // (tokens // groups)
        pairs = (group.unsqueeze(1) * (num_experts + 1) + experts).reshape(-1)
        stats.view(-1).scatter_add_(0, pairs, torch.ones_like(pairs))
        stats[:, num_experts] = tokens // groups
        if reduce is not None:
            stats = reduce(stats)
        load = stats[:, :num_experts].to(scores.dtype) * num_experts / (top_k * stats[:, num_experts:].to(scores.dtype))
    return (probs.view(groups, -1, num_experts) * load.unsqueeze(1)).sum()


def z_loss_sum(logits: torch.Tensor) -> torch.Tensor:
    """sum over tokens of logsumexp(router logits)^2 (ST-MoE's router z-loss): keeps the logits small, which keeps
    the router's softmax out of the range where rounding decides the top-k."""
    return torch.logsumexp(logits, dim=-1).square().sum()
