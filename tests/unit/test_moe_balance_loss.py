"""The MoE balance loss and router z-loss (torchtitan/models/moe/balance_loss.py), their place in the MoE layer's
backward and metrics, the routing-health metrics and collapse warning (torchtitan/components/moe_balance.py), and
the effect of each balancing method on a collapsed router.

The key property of balance_loss_sum: however the tokens of a scope are split over ranks (context and tensor
parallel split every sequence, data parallel hands out whole sequences), the sum over ranks of each rank's loss,
with the expert counts summed over the ranks of the scope by `reduce`, is the whole batch's loss, and each rank's
gradient is the whole batch's gradient of its tokens. The ranks are simulated in one process here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan.components import moe_balance
from torchtitan.components.moe_balance import CollapseWatch, configure_balance_losses, update_expert_biases
from torchtitan.models.moe import MoE, MoEArgs
from torchtitan.models.moe.balance_loss import balance_loss_sum, z_loss_sum

DIM = 16


# --------------------------------------------------------------------------- independent references


def _groups(batch: int, seq: int, scope: str, dp: int = 1) -> list[list[int]]:
    """The token indices (sequence-major, whole batch) of each group of `scope`; `dp` data ranks share the batch,
    each holding batch // dp consecutive sequences (a microbatch is one data rank's sequences)."""
    if scope == "sequence":
        return [list(range(b * seq, (b + 1) * seq)) for b in range(batch)]
    if scope == "microbatch":
        per = batch // dp
        return [list(range(d * per * seq, (d + 1) * per * seq)) for d in range(dp)]
    assert scope == "global_batch"
    return [list(range(batch * seq))]


def _reference_balance(scores: torch.Tensor, experts: torch.Tensor, groups: list[list[int]],
                       top_k: int) -> torch.Tensor:
    """The definition, group by group: f_i = E x count_i / (k x tokens), P_i the mean normalised score; the loss
    summed over tokens is sum over groups of tokens x sum_i f_i P_i."""
    num_experts = scores.shape[1]
    total = scores.new_zeros(())
    for idx in groups:
        s, chosen, n = scores[idx], experts[idx], len(idx)
        f = torch.tensor([float((chosen == i).sum()) for i in range(num_experts)], dtype=scores.dtype)
        f = f * num_experts / (top_k * n)
        p = torch.stack([s[t] / s[t].sum() for t in range(n)]).mean(dim=0)
        total = total + n * (f * p).sum()
    return total


def _reference_z(logits: torch.Tensor) -> torch.Tensor:
    """sum over tokens of log(sum_i exp(l_i))^2, with the max shifted out by hand."""
    m = logits.max(dim=-1, keepdim=True).values.detach()
    lse = (m + (logits - m).exp().sum(dim=-1, keepdim=True).log()).squeeze(-1)
    return (lse * lse).sum()


def _scores(tokens: int, experts: int, score_func: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 scores (softmax rows sum to 1, sigmoid ones do not) and their top-2 choice, uneven over tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64) * 1.5
    logits[:, 0] += torch.linspace(2.0, -1.0, tokens, dtype=torch.float64)  # expert 0 busy early, idle late
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else F.softmax(logits, dim=-1)
    return scores, scores.topk(2, dim=-1).indices


# --------------------------------------------------------------------------- a. the definition


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("scope", ["sequence", "microbatch", "global_batch"])
def test_balance_loss_sum_matches_the_definition(scope, score_func):
    batch, seq, num_experts, k = 3, 8, 6, 2
    scores, experts = _scores(batch * seq, num_experts, score_func)
    if score_func == "sigmoid":
        assert not torch.allclose(scores.sum(dim=-1), torch.ones(batch * seq, dtype=torch.float64))
    got_in = scores.clone().requires_grad_(True)
    got = balance_loss_sum(got_in, experts, batch, k, scope)
    got.backward()
    want_in = scores.clone().requires_grad_(True)
    want = _reference_balance(want_in, experts, _groups(batch, seq, scope), k)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_in.grad, want_in.grad, rtol=1e-12, atol=1e-12)
    # the groups matter: per-sequence loads differ from the batch's here
    other = "global_batch" if scope == "sequence" else "sequence"
    assert not torch.isclose(got, _reference_balance(scores, experts, _groups(batch, seq, other), k))


def test_balanced_routing_with_uniform_scores_costs_one_per_token():
    uniform = torch.full((6, 4), 0.3, dtype=torch.float64)  # sigmoid-like: rows sum to 1.2, normalised to 0.25
    balanced = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3], [0, 2], [1, 3]])
    for scope in ("microbatch", "global_batch"):
        assert float(balance_loss_sum(uniform, balanced, 1, 2, scope)) == pytest.approx(6.0)
    collapsed = torch.tensor([[0, 1]] * 6)  # every token on experts 0 and 1: f = (2, 2, 0, 0)
    assert float(balance_loss_sum(uniform, collapsed, 1, 2, "global_batch")) == pytest.approx(6.0)
    peaked = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 6, dtype=torch.float64)
    assert float(balance_loss_sum(peaked, collapsed, 1, 2, "global_batch")) == pytest.approx(6 * 2 * 0.8)


# --------------------------------------------------------------------------- b. split over ranks


def _layout(batch: int, seq: int, dp: int, cp: int, tp: int) -> list[tuple[int, torch.Tensor, int]]:
    """Per simulated rank: (its data rank, its token indices into the whole batch in sequence-major order, its
    sequences). Data rank d holds sequences [d x batch/dp, (d+1) x batch/dp); within them, context-parallel rank c
    holds chunks c and 2cp-1-c of 2cp chunks of every sequence (context parallel's load-balanced split; with cp = 1
    the whole sequence), and tensor-parallel rank t the t-th contiguous part of those positions."""
    per = batch // dp
    ranks = []
    for d in range(dp):
        for c in range(cp):
            if cp > 1:
                n = seq // (2 * cp)
                held = list(range(c * n, (c + 1) * n)) + list(range((2 * cp - 1 - c) * n, (2 * cp - c) * n))
            else:
                held = list(range(seq))
            for t in range(tp):
                m = len(held) // tp
                pos = held[t * m:(t + 1) * m]
                idx = [b * seq + p for b in range(d * per, (d + 1) * per) for p in pos]
                ranks.append((d, torch.tensor(idx), per))
    covered = torch.cat([idx for _, idx, _ in ranks]).sort().values
    assert torch.equal(covered, torch.arange(batch * seq))  # a partition of the batch
    return ranks


def _split_run(scores: torch.Tensor, experts: torch.Tensor, layout, top_k: int, scope: str,
               reduced: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every simulated rank's balance_loss_sum on its tokens, summed, and the gradients of the scores scattered
    back to whole-batch order. The reduce: a first pass records each rank's int64 stats; the second sums those of
    the ranks sharing the scope (the same data rank; every rank for global_batch)."""
    recorded: dict[int, torch.Tensor] = {}

    def recorder(rank: int):
        def reduce(stats: torch.Tensor) -> torch.Tensor:
            assert stats.dtype == torch.int64
            recorded[rank] = stats.clone()
            return stats
        return reduce

    def summer(rank: int):
        peers = [q for q, (d, _, _) in enumerate(layout) if scope == "global_batch" or d == layout[rank][0]]

        def reduce(stats: torch.Tensor) -> torch.Tensor:
            assert torch.equal(stats, recorded[rank])  # the same local stats as in the first pass
            return sum(recorded[q] for q in peers)
        return reduce

    for rank, (_, idx, local_batch) in enumerate(layout):
        balance_loss_sum(scores[idx], experts[idx], local_batch, top_k, scope, recorder(rank))
    total = scores.new_zeros(())
    grad = torch.full_like(scores, float("nan"))
    for rank, (_, idx, local_batch) in enumerate(layout):
        local = scores[idx].clone().requires_grad_(True)
        loss = balance_loss_sum(local, experts[idx], local_batch, top_k, scope, summer(rank) if reduced else None)
        loss.backward()
        grad[idx] = local.grad
        total = total + loss.detach()
    assert not grad.isnan().any()
    return total, grad


SPLITS = [
    # (scope, data ranks, context-parallel ranks, tensor-parallel ranks)
    ("sequence", 1, 1, 2), ("sequence", 1, 1, 3), ("sequence", 1, 2, 1), ("sequence", 1, 3, 1),
    ("sequence", 1, 2, 2), ("sequence", 2, 1, 2), ("sequence", 3, 2, 1), ("sequence", 2, 2, 2),
    ("sequence", 2, 1, 1),
    ("microbatch", 1, 1, 2), ("microbatch", 1, 3, 1), ("microbatch", 1, 2, 2), ("microbatch", 2, 2, 1),
    ("microbatch", 2, 2, 2), ("microbatch", 3, 1, 1),
    ("global_batch", 2, 1, 1), ("global_batch", 3, 1, 1), ("global_batch", 1, 2, 1), ("global_batch", 1, 1, 2),
    ("global_batch", 1, 2, 2), ("global_batch", 2, 2, 1), ("global_batch", 3, 1, 2), ("global_batch", 2, 2, 2),
]


@pytest.mark.parametrize(("scope", "dp", "cp", "tp"), SPLITS)
def test_split_over_ranks_gives_the_whole_batch_loss_and_gradient(scope, dp, cp, tp):
    batch, seq, num_experts, k = 6, 12, 5, 2
    scores, experts = _scores(batch * seq, num_experts, "sigmoid", seed=1)
    # the whole batch on one rank (microbatch: its groups are the data ranks' microbatches)
    whole_in = scores.clone().requires_grad_(True)
    if scope == "microbatch":
        per = batch // dp
        whole = sum(balance_loss_sum(whole_in[g], experts[g], per, k, scope) for g in _groups(batch, seq, scope, dp))
    else:
        whole = balance_loss_sum(whole_in, experts, batch, k, scope)
    whole.backward()
    torch.testing.assert_close(whole.detach(), _reference_balance(scores, experts, _groups(batch, seq, scope, dp), k),
                               rtol=1e-12, atol=1e-12)
    layout = _layout(batch, seq, dp, cp, tp)
    total, grad = _split_run(scores, experts, layout, k, scope, reduced=True)
    torch.testing.assert_close(total, whole.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, whole_in.grad, rtol=1e-12, atol=1e-12)
    # Without the reduce each rank's counts cover only its own tokens: wrong wherever a scope spans ranks.
    alone_total, alone_grad = _split_run(scores, experts, layout, k, scope, reduced=False)
    if cp * tp > 1 or (scope == "global_batch" and dp > 1):
        assert not torch.isclose(alone_total, whole.detach(), rtol=1e-6, atol=0)
        assert not torch.allclose(alone_grad, whole_in.grad, rtol=1e-6, atol=0)
    else:  # every scope's tokens on one rank: nothing to share
        torch.testing.assert_close(alone_total, whole.detach(), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- c. z-loss


def test_z_loss_sum_is_the_sum_of_squared_logsumexp_with_its_gradient():
    torch.manual_seed(0)
    logits = (torch.randn(10, 7, dtype=torch.float64) * 4 + 3).requires_grad_(True)
    got = z_loss_sum(logits)
    (grad,) = torch.autograd.grad(got, logits)
    want = _reference_z(logits)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    lse = torch.logsumexp(logits.detach(), dim=-1, keepdim=True)
    torch.testing.assert_close(grad, 2 * lse * F.softmax(logits.detach(), dim=-1), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- d. in the MoE layer


def _init(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return module.double()


@pytest.mark.parametrize(("aux", "z", "scope", "score_func"), [
    (0.1, 0.01, "sequence", "softmax"),
    (0.1, 0.01, "global_batch", "sigmoid"),
    (0.3, 0.0, "microbatch", "softmax"),
    (0.0, 0.02, "sequence", "sigmoid"),
])
def test_moe_layer_adds_both_losses_scaled_by_the_global_batch(aux, z, scope, score_func):
    """The gradients of the layer with the losses on are those of the task loss + aux x balance x token_scale +
    z_coeff x z x token_scale written by hand; aux_loss_sum holds [balance sum, z sum, tokens]; the metrics report
    each loss as coefficient x sum / tokens."""
    batch, seq = 3, 5
    args = MoEArgs(num_experts=6, top_k=2, hidden_dim=12, score_func=score_func, aux_loss_coeff=aux,
                   aux_loss_scope=scope, router_z_loss_coeff=z, use_grouped_mm=False)
    layer = _init(MoE(DIM, args))
    with torch.no_grad():
        layer.tokens_per_expert.zero_()
        layer.aux_loss_sum.zero_()
    scale = 1 / (8 * seq)  # a global batch of 8 sequences
    layer.token_scale = scale
    x = torch.randn(batch, seq, DIM, dtype=torch.float64, requires_grad=True)
    weight = torch.linspace(-1, 1, x.numel(), dtype=torch.float64).view_as(x)
    (layer(x) * weight).sum().backward()
    params = [x, *layer.parameters()]
    got = [p.grad.clone() for p in params]
    reported = layer.aux_loss_sum.clone()
    for p in params:
        p.grad = None

    layer.token_scale = 0.0  # the total below adds both terms itself
    out = layer(x)
    _, experts, scores, logits = layer.router(x.reshape(-1, DIM))
    torch.testing.assert_close(logits, layer.router.gate(x.reshape(-1, DIM)))
    balance = _reference_balance(scores, experts, _groups(batch, seq, scope), 2)
    zsum = _reference_z(logits)
    ((out * weight).sum() + aux * balance * scale + z * zsum * scale).backward()
    for g, p in zip(got, params, strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12)
    for p in params:
        p.grad = None
    (layer(x) * weight).sum().backward()  # token_scale 0: the losses add nothing
    assert params[1] is layer.router.gate.weight
    assert not torch.allclose(got[1], layer.router.gate.weight.grad, rtol=1e-6, atol=0)

    want = torch.tensor([float(balance.detach()) if aux else 0.0, float(zsum.detach()) if z else 0.0, batch * seq],
                        dtype=torch.float64)
    torch.testing.assert_close(reported, want, rtol=1e-12, atol=1e-12)
    metrics, _ = update_expert_biases({"layers.0.moe": layer}, data_mesh=None)
    # three counted forwards of the same tokens: the per-token means are those of one
    assert ("moe_aux_loss" in metrics) == (aux > 0) and ("moe_z_loss" in metrics) == (z > 0)
    if aux:
        assert metrics["moe_aux_loss"] == pytest.approx(aux * float(balance.detach()) / (batch * seq), rel=1e-9)
    if z:
        assert metrics["moe_z_loss"] == pytest.approx(z * float(zsum.detach()) / (batch * seq), rel=1e-9)
    assert layer.aux_loss_sum.eq(0).all()  # the report restarts the sums


def test_validation_forwards_leave_the_loss_sums_alone():
    args = MoEArgs(num_experts=4, top_k=2, hidden_dim=8, aux_loss_coeff=0.1, router_z_loss_coeff=0.1,
                   use_grouped_mm=False)
    layer = _init(MoE(DIM, args))
    with torch.no_grad():
        layer.aux_loss_sum.zero_()
        layer(torch.randn(2, 3, DIM, dtype=torch.float64))
    assert layer.aux_loss_sum.eq(0).all()


class _FakeMesh:
    def __init__(self, name: str, size: int) -> None:
        self.name, self._size = name, size

    def size(self) -> int:
        return self._size


class _FakeDims:
    """token_mesh: every rank routing different tokens; sequence_mesh: those splitting each sequence."""

    def __init__(self, token: int, sequence: int | None) -> None:
        self.token = _FakeMesh("token", token)
        self.sequence = None if sequence is None else _FakeMesh("sequence", sequence)

    def token_mesh(self):
        return self.token

    def sequence_mesh(self):
        return self.sequence


@pytest.mark.parametrize(("scope", "token", "sequence", "reduced_over"), [
    ("sequence", 8, 4, "sequence"), ("microbatch", 8, 2, "sequence"), ("global_batch", 8, 4, "token"),
    ("global_batch", 2, None, "token"), ("sequence", 2, None, None), ("microbatch", 4, None, None),
    ("global_batch", 1, None, None), ("sequence", 4, 1, None),
])
def test_configure_balance_losses_scales_by_the_global_batch_and_reduces_over_the_scope(
        monkeypatch, scope, token, sequence, reduced_over):
    calls = []
    monkeypatch.setattr(moe_balance.dist_utils, "all_reduce",
                        lambda t, mesh, op="sum": calls.append((mesh.name, op)) or t * 10)
    args = MoEArgs(num_experts=4, top_k=2, hidden_dim=8, aux_loss_coeff=0.1, aux_loss_scope=scope)
    layers = {"layers.0.moe": MoE(DIM, args), "layers.1.moe": MoE(DIM, args)}
    configure_balance_losses(layers, _FakeDims(token, sequence), global_batch_size=16, seq_len=32)
    for layer in layers.values():
        assert layer.token_scale == 1 / (16 * 32)
        if reduced_over is None:
            assert layer.count_reduce is None
        else:
            assert torch.equal(layer.count_reduce(torch.ones(2, 5, dtype=torch.int64)),
                               torch.full((2, 5), 10, dtype=torch.int64))
            assert calls.pop() == (reduced_over, "sum")


# --------------------------------------------------------------------------- e. idle experts


def test_update_expert_biases_reports_idle_experts_per_layer_and_the_max():
    args = MoEArgs(num_experts=4, top_k=2, hidden_dim=8, use_grouped_mm=False)
    layers = {name: MoE(DIM, args) for name in ("layers.0.moe", "layers.1.moe", "layers.2.moe")}
    for layer, counts in zip(layers.values(), [[5, 0, 0, 3], [1, 1, 1, 1], [0, 7, 2, 0]], strict=True):
        layer.tokens_per_expert.copy_(torch.tensor(counts, dtype=torch.float32))
    metrics, per_layer = update_expert_biases(layers, data_mesh=None)
    assert metrics["moe_idle_experts/layers.0.moe"] == 2
    assert metrics["moe_idle_experts/layers.1.moe"] == 0
    assert metrics["moe_idle_experts/layers.2.moe"] == 2
    assert metrics["moe_idle_experts_max"] == 2 and isinstance(metrics["moe_idle_experts_max"], int)
    assert metrics["moe_load/layers.2.moe"] == pytest.approx(7 / 2.25)
    assert metrics["moe_load_max_over_mean"] == pytest.approx(7 / 2.25)
    assert "moe_aux_loss" not in metrics and "moe_z_loss" not in metrics
    assert torch.equal(per_layer["layers.0.moe"], torch.tensor([5.0, 0.0, 0.0, 3.0]))
    # counts restart: a step that routed nothing leaves every expert idle
    metrics, _ = update_expert_biases(layers, data_mesh=None)
    assert metrics["moe_idle_experts_max"] == 4 and metrics["moe_idle_experts/layers.1.moe"] == 4


# --------------------------------------------------------------------------- f. collapse warning


def _observe(watch: CollapseWatch, loads: list[float], start: int = 1) -> list[int]:
    """Steps at which "a" is warned about; "b" stays balanced and must never be."""
    warned = []
    for step, load in enumerate(loads, start=start):
        layers = watch.observe(step, {"moe_load_max_over_mean": load, "moe_load/a": load, "moe_load/b": 1.0,
                                      "moe_idle_experts/a": 3, "moe_idle_experts/b": 0})
        assert "b" not in layers
        if "a" in layers:
            warned.append(step)
    return warned


def test_collapse_warns_after_a_streak_then_every_n_steps(warnings_log):
    args = MoEArgs(num_experts=8, top_k=2)  # most possible load: 4x the mean; 0.75 of it: 3.0
    watch = CollapseWatch(args, load_fraction=0.75, after_steps=3, every_steps=4)
    assert _observe(watch, [3.5] * 12) == [3, 7, 11]
    assert len(warnings_log) == 3
    assert "step 3" in warnings_log[0] and " a " in warnings_log[0] and "3 experts" in warnings_log[0]


def test_collapse_streak_resets_when_the_layer_recovers(warnings_log):
    watch = CollapseWatch(MoEArgs(num_experts=8, top_k=2), load_fraction=0.75, after_steps=3, every_steps=4)
    loads = [3.5, 3.5, 2.9, 3.5, 3.5, 3.0, 3.5, 1.0, 4.0, 4.0, 4.0]
    # a streak of 2 broken at 2.9 (below 3.0); 3.0 itself counts: warned at its third step; then again from scratch
    assert _observe(watch, loads) == [6, 11]
    assert len(warnings_log) == 2


def test_collapse_threshold_is_a_fraction_of_num_experts_over_top_k():
    # 8 experts, top_k 4: at most 2x the mean, threshold 0.75 x 2 = 1.5
    watch = CollapseWatch(MoEArgs(num_experts=8, top_k=4), load_fraction=0.75, after_steps=1, every_steps=1)
    assert _observe(watch, [1.6, 1.49, 1.5]) == [1, 3]
    # 16 experts, top_k 2: at most 8x, threshold 6: 5.9 is not collapse
    watch = CollapseWatch(MoEArgs(num_experts=16, top_k=2), load_fraction=0.75, after_steps=1, every_steps=1)
    assert _observe(watch, [5.9, 6.1]) == [2]


def test_collapse_fraction_zero_never_warns(warnings_log):
    watch = CollapseWatch(MoEArgs(num_experts=8, top_k=2), load_fraction=0.0, after_steps=1, every_steps=1)
    assert _observe(watch, [4.0] * 5 + [0.0] * 3) == []
    assert warnings_log == []


# --------------------------------------------------------------------------- g. effect on a collapsed router


def _collapsed_layer(**kwargs) -> MoE:
    args = MoEArgs(num_experts=8, top_k=2, hidden_dim=16, use_grouped_mm=False, **kwargs)
    layer = MoE(DIM, args)
    torch.manual_seed(0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    layer = layer.double()
    with torch.no_grad():
        layer.router.gate.weight[0, 0] = 2.0  # inputs carry a constant feature 0: expert 0 in every token's top 2
        layer.tokens_per_expert.zero_()
        layer.aux_loss_sum.zero_()
    return layer


def _inputs(g: torch.Generator, batch: int = 4, seq: int = 16) -> torch.Tensor:
    x = torch.randn(batch, seq, DIM, generator=g, dtype=torch.float64)
    x[..., 0] = 1.0
    return x


def _load(layer: MoE, x: torch.Tensor) -> float:
    """Busiest expert's share of the routed pairs over the mean share (1 balanced, num_experts / top_k collapsed)."""
    with torch.no_grad():
        _, experts, _, _ = layer.router(x.reshape(-1, DIM), layer.expert_bias)
    counts = torch.bincount(experts.reshape(-1), minlength=layer.args.num_experts).double()
    return float(counts.max() / counts.mean())


def _train(layer: MoE, steps: int = 40, bias_update: bool = False) -> float:
    """Adam on a regression to a fixed random teacher, fresh random inputs every step; the load on a held-out batch
    at the end."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(DIM, DIM, generator=g, dtype=torch.float64) / DIM ** 0.5
    held_out = _inputs(torch.Generator().manual_seed(2))
    opt = torch.optim.Adam(layer.parameters(), lr=0.03)
    for _ in range(steps):
        x = _inputs(g)
        layer.token_scale = 1.0 / x[..., 0].numel()  # this batch is the global batch
        loss = F.mse_loss(layer(x), torch.tanh(x @ teacher))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bias_update:
            update_expert_biases({"moe": layer}, data_mesh=None)
    return _load(layer, held_out)


def test_balance_loss_and_expert_bias_each_spread_a_collapsed_router():
    held_out = _inputs(torch.Generator().manual_seed(2))
    start = _load(_collapsed_layer(), held_out)
    assert start > 3.5  # near the most possible, 8 / 2
    neither = _train(_collapsed_layer())
    with_loss = _train(_collapsed_layer(aux_loss_coeff=1.0, aux_loss_scope="global_batch"))
    with_bias = _train(_collapsed_layer(load_balance_coeff=0.02), bias_update=True)
    assert neither > 3.0  # the task alone leaves it collapsed
    for load in (with_loss, with_bias):
        assert load < 0.6 * start and load < 0.6 * neither, (start, neither, with_loss, with_bias)
