"""The mixture-of-experts layer: router, routed experts, optional shared experts, and the load-balancing state.

Token flow (one layer, x [batch, seq, dim] flattened to T tokens):

    router -> for each token its top_k experts and weights
    sort the T x top_k (token, expert) pairs by expert (a stable sort: the order, hence the sums, is deterministic)
    experts run on their contiguous rows (grouped matmul) -> back to (token, slot) order -> weighted sum over slots
    + shared experts (every token) -> [batch, seq, dim]

Expert parallel (torchtitan/distributed/expert_parallel.py) replaces the middle step by an all-to-all dispatch
and combine; this module stays free of torch.distributed.

Load balancing without an auxiliary loss (DeepSeek-V3): `expert_bias` shifts which experts a token selects (not
its weights); `tokens_per_expert` counts the selections of the training forwards since the last update, and after
each optimizer step the trainer moves every bias by load_balance_coeff towards the mean load
(torchtitan/components/moe_balance.py), with the counts summed over the data-parallel ranks first.

The balance loss and the router z-loss (balance_loss.py) join the training loss through this layer's own backward
(`_AddAuxLossGradient`), scaled by `token_scale`; the balance loss's counts are summed over the ranks of its scope by
`count_reduce`, which the trainer sets.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.balance_loss import balance_loss_sum, z_loss_sum
from torchtitan.models.moe.experts import GroupedExperts
from torchtitan.models.moe.router import TopKRouter
from torchtitan.models.random_fill import TruncNormal

_COUNT_TOKENS = contextvars.ContextVar("moe_count_tokens", default=True)


@contextmanager
def no_token_counting() -> Iterator[None]:
    """Forwards inside this context (with gradients, yet not training forwards: torch's pipeline stages run one to
    infer shapes on the first step) leave the load-balancing counts alone."""
    token = _COUNT_TOKENS.set(False)
    try:
        yield
    finally:
        _COUNT_TOKENS.reset(token)


class _AddAuxLossGradient(torch.autograd.Function):
    """Returns `out` unchanged; its backward also sends gradient 1 into `aux_loss` (a scalar that already carries
    its coefficients and normalisation). The balance losses thus join the training loss without travelling through
    the model's outputs, the pipeline schedule or the loss function."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss)


class SharedExperts(nn.Module):
    """The experts every token goes through: one SwiGLU MLP (w1, w3 [hidden, dim], w2 [dim, hidden])."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        errors = args.check()
        if errors:
            raise ValueError("; ".join(errors))
        self.args = args
        self.router = TopKRouter(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts, args.use_grouped_mm)
        self.shared_experts = (SharedExperts(dim, args.hidden_dim * args.num_shared_experts)
                               if args.num_shared_experts else None)
        # fp32 whatever the training dtype: the bias moves in steps of load_balance_coeff (1e-3), below bf16's
        # resolution near 1. Persistent: the balance reached is part of the training state.
        self.expert_bias: torch.Tensor | None
        if args.load_balance_coeff > 0:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32),
                             persistent=False)
        # For the metrics only (torchtitan/components/moe_balance.py): over the counted forwards since the last
        # report, the balance loss's and the z-loss's sums over tokens (balance_loss.py, without coefficients), and
        # the tokens.
        self.register_buffer("aux_loss_sum", torch.zeros(3, dtype=torch.float64), persistent=False)
        self.token_scale = 1.0
        """1 / tokens in the global batch: the trainer sets it (moe_balance.configure_balance_losses) so that the
        losses are means over the global batch's tokens, whatever the layout"""
        self.count_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Sums the balance loss's expert counts over the ranks that hold the other tokens of its scope (set from
        outside, by moe_balance.configure_balance_losses: this module stays free of torch.distributed)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts, scores, logits = self.router(tokens, self.expert_bias)
        flat = experts.reshape(-1)  # (token, slot) pairs, slot-minor
        # A fixed-shape count (bincount's output shape depends on the values, which the memory estimator's fake
        # tensors do not have); integer adds give the same result in any order.
        counts = torch.zeros(self.args.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        aux = None
        if torch.is_grad_enabled() and _COUNT_TOKENS.get():  # training forwards only (validation: no_grad)
            # Recomputed forwards (activation checkpointing) count again, every expert of that layer alike: the
            # bias update looks only at which experts are above or below the mean, so it is unaffected (and the
            # reported losses are ratios of two sums that both double).
            with torch.no_grad():
                self.tokens_per_expert += counts.float()
            aux = self._balance_losses(scores, logits, experts, shape[0])
        order = torch.argsort(flat, stable=True)
        routed = self.experts(tokens[order // self.args.top_k], counts)
        # back to (token, slot) order, weighted, summed over the slots: deterministic (no scatter-add)
        unsorted = torch.empty_like(routed).index_copy_(0, order, routed)
        out = (unsorted.view(-1, self.args.top_k, shape[-1]) * weights.unsqueeze(-1).to(routed.dtype)).sum(dim=1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if aux is not None:
            out = _AddAuxLossGradient.apply(out, aux * self.token_scale)
        return out.view(shape)

    def _balance_losses(self, scores: torch.Tensor, logits: torch.Tensor, experts: torch.Tensor,
                        batch: int) -> torch.Tensor | None:
        """coeff x balance loss + coeff x z-loss, each summed over this forward's tokens (balance_loss.py); None
        when both are off. Their values go to the metrics' sums."""
        a = self.args
        if a.aux_loss_coeff == 0 and a.router_z_loss_coeff == 0:
            return None
        zero = scores.new_zeros(())
        balance = (balance_loss_sum(scores, experts, batch, a.top_k, a.aux_loss_scope, self.count_reduce)
                   if a.aux_loss_coeff > 0 else zero)
        z = z_loss_sum(logits) if a.router_z_loss_coeff > 0 else zero
        with torch.no_grad():
            self.aux_loss_sum += torch.stack([balance.detach(), z.detach(), zero + scores.shape[0]]).to(
                self.aux_loss_sum.dtype)
        return a.aux_loss_coeff * balance + a.router_z_loss_coeff * z

    def init_weights(self, out_std: float, param_init) -> None:
        self.router.init_weights(0.02, param_init)
        self.experts.init_weights(0.02, out_std, param_init)
        if self.shared_experts is not None:
            for lin, std in ((self.shared_experts.w1, 0.02), (self.shared_experts.w2, out_std),
                             (self.shared_experts.w3, out_std)):
                param_init(lin.weight, TruncNormal(std))
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.tokens_per_expert.zero_()
            self.aux_loss_sum.zero_()
