"""Routed experts held as grouped weights: one SwiGLU MLP per expert, stacked on a leading expert dimension."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: torch._grouped_mm's backward rejects
    stride-0 gradients (measured on torch 2.13, e.g. the gradient of out.sum())."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x in expert order (expert e owns rows offsets[e-1]:offsets[e]) times weight[e]^T."""
    if torch.is_autocast_enabled(x.device.type):
        # autocast has no rule for _grouped_mm: cast as it would for a matmul (CUDA's kernel takes bfloat16 only)
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets))


class GroupedExperts(nn.Module):
    """w2(silu(w1 x) * w3 x) with each expert's own weights: w1, w3 [experts, hidden, dim], w2 [experts, dim, hidden]
    (each slice in nn.Linear's [out, in] layout, so expert e's slices are its Hugging Face projections)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True) -> None:
        super().__init__()
        self.num_experts, self.use_grouped_mm = num_experts, use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [tokens, dim] sorted by expert; tokens_per_expert [experts] (int64, sums to tokens). Under expert
        parallel the weights are sharded on the expert dimension and this rank computes its own experts only
        (torchtitan/distributed/expert_parallel.py hands it their rows and counts)."""
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        if w1.dtype != x.dtype:  # weights FSDP does not cast (expert parallel's): compute in the activations' dtype
            w1, w2, w3 = w1.to(x.dtype), w2.to(x.dtype), w3.to(x.dtype)
        if self.use_grouped_mm:
            offsets = tokens_per_expert.cumsum(0).to(torch.int32)
            h = F.silu(_grouped_matmul(x, w1, offsets)) * _grouped_matmul(x, w3, offsets)
            return _grouped_matmul(h, w2, offsets)
        # The loop: one matmul per expert (reads the counts on the host)
        outs = [F.linear(F.silu(F.linear(chunk, w1[e])) * F.linear(chunk, w3[e]), w2[e])
                for e, chunk in enumerate(x.split(tokens_per_expert.tolist()))]
        return torch.cat(outs) if outs else x.new_empty(0, w2.shape[1])

    def init_weights(self, in_std: float, out_std: float, param_init) -> None:
        for weight, std in ((self.w1, in_std), (self.w2, out_std), (self.w3, out_std)):
            param_init(weight, lambda t, std=std: nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std))
