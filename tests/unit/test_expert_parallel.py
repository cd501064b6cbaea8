"""Expert parallel's dispatch and combine, and tensor parallel inside the experts (the rows pooled over tp), in
torchtitan/distributed/expert_parallel.py, on 2 and 4 gloo ranks against one process: every rank's MoE output and
input gradient, and every expert's weight gradient (summed over all ranks' tokens), equal the single-process values
for the union of the ranks' tokens."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.unit.forked import run_ranks
from torchtitan.distributed.expert_parallel import apply_ep
from torchtitan.models.moe import MoE, MoEArgs

DIM, TOKENS = 16, 12


def _layer(use_grouped_mm: bool) -> MoE:
    # hidden 16: split over 2 tp ranks each slice row is 8 floats, the 16-byte stride torch._grouped_mm requires
    torch.manual_seed(0)
    args = MoEArgs(num_experts=8, top_k=2, hidden_dim=16, num_shared_experts=1, use_grouped_mm=use_grouped_mm)
    layer = MoE(DIM, args)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    # Skewed inputs: ranks route unevenly, some experts get no rows from some ranks.
    x = torch.randn(1, TOKENS, DIM, generator=g) * (1 + rank)
    return x, torch.randn(1, TOKENS, DIM, generator=g)


def _reference(world: int, use_grouped_mm: bool):
    layer = _layer(use_grouped_mm)
    xs = [(_inputs(r)[0].clone().requires_grad_(True), _inputs(r)[1]) for r in range(world)]
    total = 0
    outs = []
    for x, w in xs:
        out = layer(x)
        outs.append(out.detach())
        total = total + (out * w).sum()
    total.backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return outs, [x.grad for x, _ in xs], grads


def _ep_rank(rank: int, world: int, use_grouped_mm: bool, dims: tuple[str, ...]):
    # ("ep",): expert parallel; ("tp",): the experts' hidden units split over the ranks; ("tp", "ep"): both, 2 x 2
    mesh = init_device_mesh("cpu", (world,) if len(dims) == 1 else (2, world // 2), mesh_dim_names=dims)
    layer = _layer(use_grouped_mm)
    apply_ep(layer, mesh)
    x, w = _inputs(rank)
    x.requires_grad_(True)
    out = layer(x)
    (out * w).sum().backward()
    # The replicated parameters (router, shared experts) hold this rank's share of the gradient; the experts' local
    # shard holds the whole sum for its experts.
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
             for name, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.mark.parametrize(("world", "dims", "use_grouped_mm"), [
    (2, ("ep",), False), (2, ("ep",), True), (4, ("ep",), False), (4, ("ep",), True),
    (2, ("tp",), True), (4, ("tp", "ep"), False), (4, ("tp", "ep"), True),
])
def test_expert_parallel_matches_one_process(world, dims, use_grouped_mm):
    ref_out, ref_dx, ref_grads = _reference(world, use_grouped_mm)
    results = run_ranks(_ep_rank, world, use_grouped_mm, dims, world=world)
    summed = {name: 0 for name in ref_grads}
    for rank, (out, dx, grads) in enumerate(results):
        torch.testing.assert_close(torch.tensor(out), ref_out[rank], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(dx), ref_dx[rank], rtol=1e-5, atol=1e-5)
        for name, g in grads.items():
            summed[name] = summed[name] + torch.tensor(g)
            if name.startswith("experts."):  # the full tensor of the expert gradient: the same on every rank
                torch.testing.assert_close(torch.tensor(g), ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    for name, g in summed.items():
        if not name.startswith("experts."):  # data-parallel parameters: the ranks' gradients add up
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def _indivisible_rank(rank: int) -> bool:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    layer = MoE(DIM, MoEArgs(num_experts=3, top_k=1))
    with pytest.raises(ValueError, match="3 experts do not divide over 2 ep ranks"):
        apply_ep(layer, mesh)
    return True


def test_experts_must_divide_over_the_ep_ranks():
    assert run_ranks(_indivisible_rank, world=2) == [True, True]
