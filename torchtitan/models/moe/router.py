"""Top-k token-choice router: which experts each token goes to, and with what weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.random_fill import TruncNormal


class TopKRouter(nn.Module):
    """gate (a bias-free linear map to one logit per expert) -> scores -> top-k experts per token.

    The load-balancing bias (auxiliary-loss-free balancing, DeepSeek-V3) only shifts which experts are selected;
    the weights come from the unbiased scores. Group-limited routing first keeps each token's best
    `num_limited_groups` expert groups, a group scoring the sum of its two best (biased) scores.
    """

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, dim] -> (weights [tokens, top_k], expert indices [tokens, top_k], scores [tokens, experts],
        logits [tokens, experts]); weights, scores and logits in fp32 (or fp64 for an fp64 model)."""
        a = self.args
        logits = self.gate(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # scores at least in fp32
        scores = torch.sigmoid(logits) if a.score_func == "sigmoid" else F.softmax(logits, dim=-1)
        choice = scores if expert_bias is None else scores + expert_bias
        if a.num_expert_groups > 1:
            grouped = choice.view(x.shape[0], a.num_expert_groups, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(a.num_limited_groups, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view_as(choice)
        experts = choice.topk(a.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if a.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, experts, scores, logits

    def init_weights(self, std: float, param_init) -> None:
        param_init(self.gate.weight, TruncNormal(std))
