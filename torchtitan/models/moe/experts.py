"""Routed experts held as grouped weights: one SwiGLU MLP per expert, stacked on a leading expert dimension."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.random_fill import TruncNormal

# torch._grouped_mm wrapped as custom ops: their fake kernels (shapes only) let the memory estimator trace the
# experts in any dtype (torch's own fake kernel accepts bfloat16 only, though the CPU kernel runs float32), and the
# backward makes its incoming gradient contiguous (torch's backward rejects stride-0 gradients, e.g. of out.sum()).
# Rows of x are in expert order: expert e owns rows offsets[e-1]:offsets[e]; w is [experts, out, in].


@torch.library.custom_op("torchtitan::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[rows, in] x per-expert w[e]^T -> [rows, out]."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[1]))


@torch.library.custom_op("torchtitan::grouped_mm_input_grad", mutates_args=())
def grouped_mm_input_grad(grad: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """d x = grad [rows, out] x per-expert w[e] -> [rows, in]."""
    return torch._grouped_mm(grad, w, offs=offsets)


@grouped_mm_input_grad.register_fake
def _(grad: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return grad.new_empty((grad.shape[0], w.shape[2]))


@torch.library.custom_op("torchtitan::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """d w[e] = grad[rows of e]^T x[rows of e] -> [experts, out, in] (zero for an expert without rows)."""
    return torch._grouped_mm(grad.t(), x, offs=offsets)


@grouped_mm_weight_grad.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return grad.new_empty((offsets.shape[0], grad.shape[1], x.shape[1]))


def _setup_context(ctx, inputs, output) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad: torch.Tensor):
    x, w, offsets = ctx.saved_tensors
    grad = grad.contiguous()
    return grouped_mm_input_grad(grad, w, offsets), grouped_mm_weight_grad(grad, x, offsets), None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def _grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x in expert order times weight[e]^T."""
    if torch.is_autocast_enabled(x.device.type):
        # autocast has no rule for _grouped_mm: cast as it would for a matmul (CUDA's kernel takes bfloat16 only)
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    return grouped_mm(x, weight, offsets)


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
            param_init(weight, TruncNormal(std))
