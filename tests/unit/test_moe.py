"""MoE building blocks (torchtitan/models/moe): routing, grouped experts against a per-expert loop, the whole layer
against a per-token reference (values and gradients), and the auxiliary-loss-free balancing update."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from torchtitan.components.moe_balance import moe_layers, update_expert_biases
from torchtitan.models.moe import GroupedExperts, MoE, MoEArgs, TopKRouter
from torchtitan.models.moe.balance_loss import balance_loss_sum

DIM = 16


def _init(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return module.double()


def test_router_picks_the_top_scores_and_normalises_them():
    args = MoEArgs(num_experts=6, top_k=2, route_norm=True, route_scale=2.5)
    router = _init(TopKRouter(DIM, args))
    x = torch.randn(10, DIM, dtype=torch.float64)
    weights, experts, _, _ = router(x)
    scores = F.softmax(router.gate(x), dim=-1)
    for t in range(10):
        assert set(experts[t].tolist()) == set(scores[t].topk(2).indices.tolist())
        top = scores[t, experts[t]]
        torch.testing.assert_close(weights[t], 2.5 * top / top.sum())


def test_expert_bias_changes_the_choice_not_the_weights():
    args = MoEArgs(num_experts=4, top_k=1, score_func="sigmoid", route_norm=False)
    router = _init(TopKRouter(DIM, args))
    x = torch.randn(8, DIM, dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    weights, experts, _, _ = router(x, bias)
    assert experts.eq(3).all()  # the bias dominates the choice
    torch.testing.assert_close(weights[:, 0], torch.sigmoid(router.gate(x))[:, 3])  # unbiased weights


def test_group_limited_routing_matches_brute_force():
    args = MoEArgs(num_experts=8, top_k=2, score_func="sigmoid", num_expert_groups=4, num_limited_groups=2)
    router = _init(TopKRouter(DIM, args), seed=3)
    x = torch.randn(32, DIM, dtype=torch.float64)
    _, experts, _, _ = router(x)
    scores = torch.sigmoid(router.gate(x)).detach()
    for t in range(32):
        groups = scores[t].view(4, 2)
        group_score = groups.sum(dim=1)  # the two best of a group of two: the whole group
        kept = group_score.topk(2).indices.tolist()
        allowed = [g * 2 + i for g in kept for i in range(2)]
        best = sorted(allowed, key=lambda e: -float(scores[t, e]))[:2]
        assert set(experts[t].tolist()) == set(best)


@pytest.mark.parametrize("counts", [[3, 0, 5, 8], [0, 0, 16, 0], [4, 4, 4, 4]])
def test_grouped_mm_matches_the_loop_with_gradients(counts):
    torch.manual_seed(0)
    loop = GroupedExperts(DIM, 24, 4, use_grouped_mm=False)
    for p in loop.parameters():
        torch.nn.init.normal_(p, std=0.2)
    grouped = GroupedExperts(DIM, 24, 4, use_grouped_mm=True)
    grouped.load_state_dict(loop.state_dict())
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), DIM)
    outs, grads = [], []
    for module in (loop, grouped):
        xi = x.clone().requires_grad_(True)
        out = module(xi, counts)
        out.sum().backward()  # a stride-0 gradient: the grouped path must make it contiguous
        outs.append(out.detach())
        grads.append([xi.grad, *(p.grad for p in module.parameters())])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _reference_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the weighted sum of its experts' SwiGLU outputs, plus the shared experts."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, experts, _, _ = layer.router(tokens, layer.expert_bias)
    e = layer.experts
    rows = []
    for t in range(tokens.shape[0]):
        row = sum(weights[t, s] * F.linear(F.silu(F.linear(tokens[t], e.w1[i])) * F.linear(tokens[t], e.w3[i]), e.w2[i])
                  for s, i in enumerate(experts[t].tolist()))
        if layer.shared_experts is not None:
            row = row + layer.shared_experts(tokens[t])
        rows.append(row)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize(("grouped_mm", "shared", "score_func"), list(itertools.product(
    [False, True], [0, 2], ["softmax", "sigmoid"])))
def test_moe_layer_matches_the_per_token_reference(grouped_mm, shared, score_func):
    args = MoEArgs(num_experts=6, top_k=3, hidden_dim=12, num_shared_experts=shared, score_func=score_func,
                   load_balance_coeff=1e-3, use_grouped_mm=grouped_mm)
    layer = _init(MoE(DIM, args))
    if grouped_mm:
        layer = layer.float()  # torch._grouped_mm takes float32 and bfloat16
    dtype = torch.float64 if not grouped_mm else torch.float32
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.0, 0.3, 0.0, -0.1]))
        layer.tokens_per_expert.zero_()
    x = torch.randn(2, 5, DIM, dtype=dtype, requires_grad=True)
    out = layer(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum().backward()
    got = [x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
    for p in [x, *layer.parameters()]:
        p.grad = None
    want_out = _reference_moe(layer, x)
    (want_out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum().backward()
    want = [x.grad, *(p.grad for p in layer.parameters())]
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out, want_out, rtol=tol, atol=tol)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def test_training_forwards_count_tokens_and_balancing_moves_the_bias():
    args = MoEArgs(num_experts=4, top_k=2, hidden_dim=8, load_balance_coeff=0.01, use_grouped_mm=False)
    layer = _init(MoE(DIM, args))
    with torch.no_grad():
        layer.expert_bias.zero_()
        layer.tokens_per_expert.zero_()
    x = torch.randn(3, 7, DIM, dtype=torch.float64)
    with torch.no_grad():
        layer(x)  # validation: not counted
    assert layer.tokens_per_expert.sum() == 0
    layer(x)
    layer(x)
    counts = layer.tokens_per_expert.clone()
    assert counts.sum() == 2 * 3 * 7 * 2
    metrics, per_layer = update_expert_biases(moe_layers([layer]), data_mesh=None)
    expected = 0.01 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(layer.expert_bias, expected.to(layer.expert_bias.dtype))
    assert layer.tokens_per_expert.sum() == 0
    assert metrics["moe_load_max_over_mean"] == pytest.approx(float(counts.max() / counts.mean()))
    # a layer that is the model itself has the empty name
    assert metrics["moe_load/"] == metrics["moe_load_max_over_mean"] and torch.equal(per_layer[""], counts)


def test_expert_bias_is_checkpointed_and_counts_are_not():
    layer = MoE(DIM, MoEArgs(num_experts=4, load_balance_coeff=1e-3))
    assert "expert_bias" in layer.state_dict() and "tokens_per_expert" not in layer.state_dict()
    assert "expert_bias" not in MoE(DIM, MoEArgs(num_experts=4)).state_dict()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"top_k": 9}, "top_k=9 must be in [1, num_experts=8]"),
    ({"score_func": "relu"}, "score_func 'relu' is not one of softmax, sigmoid"),
    ({"num_expert_groups": 3}, "num_expert_groups=3 must divide num_experts=8"),
    ({"num_expert_groups": 4, "num_limited_groups": 1, "top_k": 4}, "hold fewer than top_k=4"),
])
def test_inconsistent_args_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        MoE(DIM, MoEArgs(**kwargs))


def test_sequence_balance_loss_matches_its_definition():
    torch.manual_seed(0)
    batch, seq, experts, k = 2, 6, 4, 2
    scores = torch.rand(batch * seq, experts, dtype=torch.float64)
    chosen = scores.topk(k, dim=-1).indices
    got = balance_loss_sum(scores, chosen, batch, k, "sequence")
    want = 0.0
    for b in range(batch):
        rows = slice(b * seq, (b + 1) * seq)
        f = torch.tensor([float((chosen[rows] == i).sum()) for i in range(experts)]) * experts / (k * seq)
        p = (scores[rows] / scores[rows].sum(-1, keepdim=True)).mean(0)
        want += (f * p).sum() * seq  # a sum over tokens: the sequence's loss times its tokens
    torch.testing.assert_close(got, want)
    # perfectly balanced routing with uniform scores gives 1 per token
    uniform = torch.full((4, 4), 0.25, dtype=torch.float64)
    balanced = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert float(balance_loss_sum(uniform, balanced, 1, 2, "sequence")) == pytest.approx(4.0)


def test_balance_loss_reaches_the_gradients_scaled_by_the_global_batch():
    """The layer's backward adds coeff x the balance loss summed over its tokens / tokens of the global batch: the
    same gradients as adding that term to the loss by hand; its value is kept for the metrics."""
    args = MoEArgs(num_experts=6, top_k=2, hidden_dim=12, aux_loss_coeff=0.1, use_grouped_mm=False)
    layer = _init(MoE(DIM, args))
    with torch.no_grad():
        layer.tokens_per_expert.zero_()
        layer.aux_loss_sum.zero_()
    layer.token_scale = 1 / (8 * 5)  # a global batch of 8 sequences of 5 tokens
    x = torch.randn(3, 5, DIM, dtype=torch.float64)
    weight = torch.linspace(-1, 1, x.numel(), dtype=torch.float64).view_as(x)
    (layer(x) * weight).sum().backward()
    got = [p.grad.clone() for p in layer.parameters()]
    reported = layer.aux_loss_sum.clone()
    for p in layer.parameters():
        p.grad = None
    layer.token_scale = 0.0  # the hand-written total below adds the balance term itself
    out = layer(x)
    _, experts, scores, _ = layer.router(x.reshape(-1, DIM))
    aux = balance_loss_sum(scores, experts, 3, 2, "sequence")
    ((out * weight).sum() + 0.1 * aux / 40).backward()
    for g, p in zip(got, layer.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-10)
    assert layer.router.gate.weight.grad.abs().sum() > 0
    torch.testing.assert_close(reported, torch.tensor([float(aux.detach()), 0.0, 15.0], dtype=torch.float64))
    metrics, _ = update_expert_biases({"moe": layer}, data_mesh=None)
    # two counted forwards with the same value: their mean per token is the value per token
    assert metrics["moe_aux_loss"] == pytest.approx(0.1 * float(aux.detach()) / 15, rel=1e-6)
    assert "moe_z_loss" not in metrics
