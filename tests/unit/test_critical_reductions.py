"""The reductions that make a distributed run compute what one process would: the gradient norm over pipeline
stages and over every mesh the gradients live on, and the MoE routing counts over the ranks that route different
tokens (bias update) or share a balance-loss scope; plus the bias update's effect on a skewed router. Dropping one
of them leaves every single-process test green while each rank clips, balances or penalises by its own share only,
and until these tests only the slow integration suite noticed. Each compares against a computation that does not go
through the code under test: exact sums of the full gradients, or one process running the same tokens."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.forked import run_ranks
from torchtitan.components.moe_balance import configure_balance_losses, update_expert_biases
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.utils import clip_grads_, total_grad_norm
from torchtitan.models.moe import MoE, MoEArgs

TIMEOUT = 60.0
DIM = 16


# --------------------------------------------------------------------------- 1. gradient norm


def _full_grad(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _exact_norm(tensors: list[torch.Tensor]) -> float:
    # math.fsum is exactly rounded: a reference that shares no summation order with torch's kernels.
    return math.sqrt(math.fsum(v * v for t in tensors for v in t.double().flatten().tolist()))


def _with_grad(grad: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad
    return p


# Stage s's gradients; the stages' norms differ by far more than the tolerance, so a stage left out shows.
STAGES = {0: [((37, 11), 1.0), ((5,), 1.0)], 1: [((13, 17), 3.0), ((29,), 3.0), ((3, 3), 3.0)]}


def _stage_grads(stage: int) -> list[torch.Tensor]:
    return [_full_grad(shape, 100 * stage + i, scale) for i, (shape, scale) in enumerate(STAGES[stage])]


def _pp_norm(rank: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    pp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    params = [_with_grad(g) for g in _stage_grads(rank)]
    params.append(torch.nn.Parameter(torch.zeros(4)))  # frozen: no gradient, must not count or break the sum
    return total_grad_norm(params, pp_mesh=pp_mesh).item()


def test_grad_norm_sums_over_pipeline_stages():
    expected = _exact_norm(_stage_grads(0) + _stage_grads(1))
    norms = run_ranks(_pp_norm, world=2, timeout=TIMEOUT)
    # Both stages clip by this number: a different value per stage would scale the model's halves differently.
    assert norms[0] == norms[1], norms
    assert norms[0] == pytest.approx(expected, rel=1e-12), (norms, expected)


# Full gradients by kind. Row counts are odd so Shard(0) over 2 ranks is uneven (and the 3 experts split 2 + 1).
DENSE_SHARD0 = ((9, 5), 10)
DENSE_SHARD1 = ((4, 7), 11)
DENSE_REPLICATE = ((6,), 12)
DENSE_PARTIAL = ((3, 5), 13)  # each rank holds alternate elements (zeros elsewhere): the sum over ranks is exact
EXPERT_SHARD0 = ((3, 4, 6), 20)
EXPERT_SHARD1 = ((3, 5, 2), 21)
PLAIN = [((8,), 30), ((2, 3), 31)]  # replicated plain tensors: identical on every rank, counted once


def _mesh_grads_full() -> list[torch.Tensor]:
    spec = [DENSE_SHARD0, DENSE_SHARD1, DENSE_REPLICATE, DENSE_PARTIAL, EXPERT_SHARD0, EXPERT_SHARD1, *PLAIN]
    return [_full_grad(shape, seed) for shape, seed in spec]


def _mesh_params(rank: int, dense_mesh, expert_mesh, scale: float = 1.0) -> list[torch.nn.Parameter]:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    def full(spec):
        return _full_grad(spec[0], spec[1], scale)

    partial = full(DENSE_PARTIAL)
    mine = torch.arange(partial.numel()).view_as(partial) % 2 == rank
    grads = [
        distribute_tensor(full(DENSE_SHARD0), dense_mesh, [Shard(0)]),
        distribute_tensor(full(DENSE_SHARD1), dense_mesh, [Shard(1)]),
        distribute_tensor(full(DENSE_REPLICATE), dense_mesh, [Replicate()]),
        DTensor.from_local(partial * mine, dense_mesh, [Partial()]),
        distribute_tensor(full(EXPERT_SHARD0), expert_mesh, [Shard(0)]),
        distribute_tensor(full(EXPERT_SHARD1), expert_mesh, [Shard(1)]),
        *(full(spec) for spec in PLAIN),
    ]
    return [_with_grad(g) for g in grads]


def _two_mesh_norm(rank: int) -> tuple[float, list[str]]:
    # The production meshes: dense gradients on FSDP's flattened dp_shard_cp view, experts on expert parallel's
    # second mesh over the same ranks. They must stay two groups (DTensor cannot combine values of two meshes).
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, world_size=2)
    dims.build_mesh("cpu")
    dense_mesh, expert_mesh = dims.fsdp_mesh(), dims.expert_weight_mesh()
    params = _mesh_params(rank, dense_mesh, expert_mesh)
    return total_grad_norm(params).item(), [str(dense_mesh.mesh_dim_names), str(expert_mesh.mesh_dim_names)]


def test_grad_norm_reduces_dtensor_gradients_of_two_meshes():
    expected = _exact_norm(_mesh_grads_full())
    results = run_ranks(_two_mesh_norm, world=2, timeout=TIMEOUT)
    names = results[0][1]
    assert names[0] != names[1], f"the test needs two distinct meshes, got {names}"
    norms = [norm for norm, _ in results]
    assert norms[0] == norms[1], norms
    assert norms[0] == pytest.approx(expected, rel=1e-12), (norms, expected)


def _clipped_two_meshes(rank: int, max_norm: float) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, world_size=2)
    dims.build_mesh("cpu")
    params = _mesh_params(rank, dims.fsdp_mesh(), dims.expert_weight_mesh())
    clip_grads_(params, max_norm, total_grad_norm(params))
    return [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).tolist() for p in params]


@pytest.mark.parametrize("ratio", [1 / 3, 2.0])  # clipped to a third; below max_norm: left alone
def test_clipping_scales_every_placement_as_one_process_would(ratio):
    # The factor multiplies local tensors (torchtitan/distributed/utils.py): every placement (both shards, a
    # replica, a pending sum, two meshes, plain tensors) must come out as the full gradient times the same factor.
    full = _mesh_grads_full()
    norm = torch.tensor(_exact_norm(full), dtype=torch.float64)
    max_norm = float(norm) * ratio
    factor = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
    for rank, grads in enumerate(run_ranks(_clipped_two_meshes, max_norm, world=2, timeout=TIMEOUT)):
        for i, (got, g) in enumerate(zip(grads, full, strict=True)):
            torch.testing.assert_close(torch.tensor(got), g * factor, rtol=1e-6, atol=0,
                                       msg=f"rank {rank}, gradient {i}")


def _pp_dp_norm(rank: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    # One mesh object for both kinds here; what is new over the tests above is the dp reduction inside a stage
    # followed by the pp sum across stages. Stage 1's gradients are 3x stage 0's.
    params = _mesh_params(mesh["dp"].get_local_rank(), mesh["dp"], mesh["dp"], scale=1.0 + 2.0 * stage)
    return total_grad_norm(params, pp_mesh=mesh["pp"]).item()


def test_grad_norm_sums_over_pipeline_stages_of_sharded_gradients():
    full = _mesh_grads_full()
    expected = _exact_norm(full + [3.0 * g for g in full])
    norms = run_ranks(_pp_dp_norm, world=4, timeout=TIMEOUT)
    assert len(set(norms)) == 1, norms
    assert norms[0] == pytest.approx(expected, rel=1e-12), (norms, expected)


# --------------------------------------------------------------------------- 2. MoE routing counts

BATCH, SEQ, EXPERTS, TOP_K = 4, 8, 8, 2

# Parallel layouts: ranks that split the batch (dp), every sequence (cp), or the MoE layer's tokens (tp).
LAYOUTS = {
    "dp2": {"dp_shard": 2},
    "cp2": {"cp": 2},
    "tp2": {"tp": 2},
    "dp2_cp2": {"dp_shard": 2, "cp": 2},
}


def _dims(layout: str) -> ParallelDims:
    degrees = {"dp_shard": 1, "cp": 1, "tp": 1, **LAYOUTS[layout]}
    world = degrees["dp_shard"] * degrees["cp"] * degrees["tp"]
    return ParallelDims(dp_replicate=1, pp=1, ep=1, world_size=world, **degrees)


def _moe(**kwargs) -> MoE:
    """A float64 MoE layer, the same on every process, whose router sends each token mostly to two of experts 0-3:
    one chosen by the token's half of the batch, one by its half of the sequence (features 0-3 below). A rank
    holding half of the batch or half of every sequence thus sees a load unlike the global one."""
    args = MoEArgs(num_experts=EXPERTS, top_k=TOP_K, hidden_dim=4, use_grouped_mm=False, **kwargs)
    layer = MoE(DIM, args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.router.gate.weight[:4, :4] += 1.5 * torch.eye(4)
    return layer.double()


def _batch(step: int) -> torch.Tensor:
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1000 + step), dtype=torch.float64)
    x[..., :4] = 0.0
    x[: BATCH // 2, :, 0] = 1.0
    x[BATCH // 2:, :, 1] = 1.0
    x[:, : SEQ // 2, 2] = 1.0
    x[:, SEQ // 2:, 3] = 1.0
    return x


def _share(x: torch.Tensor, data: int, data_ranks: int, part: int, parts: int) -> torch.Tensor:
    """The tokens one rank's MoE layer sees: its data rank's sequences, and of each its part of the positions (cp
    then tp split the sequence; the MoE layer is token-wise, so which positions a part holds does not matter)."""
    per, width = x.shape[0] // data_ranks, x.shape[1] // parts
    return x[data * per:(data + 1) * per, part * width:(part + 1) * width]


def _coordinates(dims: ParallelDims) -> tuple[int, int, int, int]:
    """(data rank, data ranks, sequence part, parts) of this process in the world mesh (pp, dp_replicate, dp_shard,
    cp, tp)."""
    _, replicate, shard, cp, tp = dims.world_mesh.get_coordinate()
    return replicate * dims.dp_shard + shard, dims.dp_degree, cp * dims.tp + tp, dims.cp * dims.tp


def _split(x: torch.Tensor, layout: str) -> list[torch.Tensor]:
    """Every rank's share of x, in rank order, without a process group."""
    degrees = {"dp_shard": 1, "cp": 1, "tp": 1, **LAYOUTS[layout]}
    dp, parts = degrees["dp_shard"], degrees["cp"] * degrees["tp"]
    return [_share(x, rank // parts, dp, rank % parts, parts) for rank in range(dp * parts)]


BIAS_STEPS = 4
BIAS_COEFF = 0.05  # large enough that the bias changes the routing between steps


def _bias_rank(rank: int, layout: str) -> dict:
    dims = _dims(layout)
    dims.build_mesh("cpu")
    data, data_ranks, part, parts = _coordinates(dims)
    layer = _moe(load_balance_coeff=BIAS_COEFF)
    biases, loads = [], []
    for step in range(BIAS_STEPS):
        layer(_share(_batch(step), data, data_ranks, part, parts))
        metrics, counts = update_expert_biases({"moe": layer}, dims.token_mesh())
        biases.append(layer.expert_bias.clone())
        loads.append(metrics["moe_load_max_over_mean"])
    return {"biases": biases, "loads": loads, "counts": counts["moe"]}


def _single_process_biases(shares) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process running `shares(step)`'s tokens (each share a forward, as micro-batches are) and updating alone."""
    layer = _moe(load_balance_coeff=BIAS_COEFF)
    biases, counts = [], []
    for step in range(BIAS_STEPS):
        for tokens in shares(step):
            layer(tokens)
        counts.append(layer.tokens_per_expert.clone())
        update_expert_biases({"moe": layer}, data_mesh=None)
        biases.append(layer.expert_bias.clone())
    return biases, counts


@pytest.mark.parametrize("layout", ["dp2", "cp2", "tp2"])
def test_expert_bias_update_sums_routing_counts_over_the_token_ranks(layout):
    want_biases, want_counts = _single_process_biases(lambda step: [_batch(step)])
    # The layout must make the reduction matter: one rank's tokens alone move some bias the other way.
    alone, _ = _single_process_biases(lambda step: _split(_batch(step), layout)[:1])
    assert not torch.equal(alone[0], want_biases[0]), "the test data no longer tells local from global counts"
    # and the bias must change the routing, so that the later steps also check every rank selects with it
    router, last = _moe(load_balance_coeff=BIAS_COEFF).router, _batch(BIAS_STEPS - 1).reshape(-1, DIM)
    assert not torch.equal(router(last, want_biases[-2])[1], router(last, None)[1])
    for rank, got in enumerate(run_ranks(_bias_rank, layout, world=2, timeout=TIMEOUT)):
        for step in range(BIAS_STEPS):
            assert torch.tensor(got["biases"][step], dtype=torch.float64).equal(want_biases[step]), (
                f"rank {rank} step {step}: bias {got['biases'][step]}, one process {want_biases[step].tolist()}")
        final = want_counts[-1]
        assert torch.tensor(got["counts"], dtype=torch.float64).equal(final), (rank, got["counts"], final)
        assert got["loads"][-1] == pytest.approx(float(final.max() / final.mean()), rel=1e-6)


def _balance_rank(rank: int, layout: str) -> dict:
    dims = _dims(layout)
    dims.build_mesh("cpu")
    data, data_ranks, part, parts = _coordinates(dims)
    layers = {scope: _moe(aux_loss_coeff=1.0, aux_loss_scope=scope) for scope in ("global_batch", "sequence")}
    configure_balance_losses(layers, dims, global_batch_size=BATCH, seq_len=SEQ)
    out = {}
    for scope, layer in layers.items():
        # A zero task loss: the router gradient is then the balance loss's alone, the part the counts decide.
        (layer(_share(_batch(0), data, data_ranks, part, parts)) * 0.0).sum().backward()
        out[scope] = {"loss": float(layer.aux_loss_sum[0]) * layer.token_scale,
                      "grad": layer.router.gate.weight.grad.clone()}
    return out


def _single_process_balance(scope: str, shares: list[torch.Tensor]) -> tuple[float, torch.Tensor]:
    """The balance loss (mean over the batch's tokens) and its router gradient, one process running every share
    separately without reducing anything: with the whole batch as the only share, the reference."""
    layer = _moe(aux_loss_coeff=1.0, aux_loss_scope=scope)
    layer.token_scale = 1.0 / (BATCH * SEQ)
    for tokens in shares:
        (layer(tokens) * 0.0).sum().backward()
    return float(layer.aux_loss_sum[0]) * layer.token_scale, layer.router.gate.weight.grad.clone()


# (layout, scope) pairs whose scope spans several ranks, so that the counts must be reduced. In the others (the
# sequence scope on dp2) every rank holds whole scopes, and a reduction reaching further would be wrong.
BALANCE_CASES = [("dp2", "global_batch"), ("cp2", "sequence"), ("tp2", "sequence"), ("tp2", "global_batch"),
                 ("dp2_cp2", "sequence"), ("dp2_cp2", "global_batch")]


@pytest.mark.parametrize("layout", ["dp2", "cp2", "tp2", "dp2_cp2"])
def test_balance_loss_counts_are_summed_over_the_ranks_of_its_scope(layout):
    results = run_ranks(_balance_rank, layout, world=_dims(layout).world_size, timeout=TIMEOUT)
    wrong = []  # every scope's mismatches, not just the first: which scopes break tells which mesh is wrong
    for scope in ("global_batch", "sequence"):
        want_loss, want_grad = _single_process_balance(scope, [_batch(0)])
        alone_loss, alone_grad = _single_process_balance(scope, _split(_batch(0), layout))
        if (layout, scope) in BALANCE_CASES:
            assert alone_loss != pytest.approx(want_loss, rel=1e-6), "this case no longer needs the reduction"
            assert not torch.allclose(alone_grad, want_grad, rtol=1e-6, atol=0)
        # The ranks' losses and gradients add up in the backward and the loss sum: the sum is what one process
        # gets on the whole batch.
        loss = math.fsum(r[scope]["loss"] for r in results)
        grad = sum(torch.tensor(r[scope]["grad"], dtype=torch.float64) for r in results)
        if loss != pytest.approx(want_loss, rel=1e-10):
            wrong.append(f"{scope} loss {loss!r}, one process {want_loss!r}")
        if not torch.allclose(grad, want_grad, rtol=1e-9, atol=1e-12):
            wrong.append(f"{scope} router gradient off by up to {(grad - want_grad).abs().max().item():.3g} "
                         f"(largest entry {want_grad.abs().max().item():.3g})")
    assert not wrong, f"{layout}: " + "; ".join(wrong)


def _pipeline_balance_rank(rank: int) -> dict[str, float]:
    """PP 2 whose stage 0 holds no MoE layer (DeepSeek's dense first blocks, cut into stages): both stages join the
    routing metrics' reductions over pp."""
    from torch.distributed.device_mesh import init_device_mesh

    pp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    layer = _moe(aux_loss_coeff=1.0, load_balance_coeff=BIAS_COEFF)
    layer.token_scale = 1.0 / (BATCH * SEQ)
    layer(_batch(0))
    # the trainer hands every stage the model's MoE settings, so that both report the same metrics
    layers = {"layers.1.moe": layer} if rank == 1 else {}
    metrics, _ = update_expert_biases(layers, None, pp_mesh, torch.device("cpu"), moe_args=layer.args)
    return {k: v for k, v in metrics.items() if "/" not in k}


def test_routing_metrics_reduce_over_a_pipeline_stage_without_moe_layers():
    # Regression: the stage without MoE layers reduced the load before the losses, the other stage the losses first;
    # gloo failed the mismatched pair ("Received data size doesn't match expected size").
    layer = _moe(aux_loss_coeff=1.0, load_balance_coeff=BIAS_COEFF)
    layer.token_scale = 1.0 / (BATCH * SEQ)
    layer(_batch(0))
    want, _ = update_expert_biases({"moe": layer}, data_mesh=None)
    got = run_ranks(_pipeline_balance_rank, world=2, timeout=TIMEOUT)
    assert got[0] == got[1], got
    for key in ("moe_load_max_over_mean", "moe_idle_experts_max", "moe_aux_loss"):
        assert got[0][key] == pytest.approx(want[key], rel=1e-6), (key, got[0], want)


# --------------------------------------------------------------------------- 3. the bias update's effect


def _skewed_router_layer(coeff: float) -> tuple[MoE, torch.Tensor]:
    """An MoE layer whose gate favours experts 0 and 1 for every token (all inputs carry a constant feature 0), and
    fixed inputs."""
    args = MoEArgs(num_experts=EXPERTS, top_k=TOP_K, hidden_dim=4, load_balance_coeff=coeff, use_grouped_mm=False)
    layer = MoE(DIM, args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.router.gate.weight[0, 0] = 2.0
        layer.router.gate.weight[1, 0] = 1.6
    x = torch.randn(8, 64, DIM, generator=torch.Generator().manual_seed(1))
    x[..., 0] = 1.0
    return layer, x


def _imbalance(layer: MoE, x: torch.Tensor) -> float:
    """Busiest expert's routed pairs over the mean, from the router's selection (not the layer's own counts)."""
    with torch.no_grad():
        _, experts, _, _ = layer.router(x.reshape(-1, DIM), layer.expert_bias)
    counts = torch.bincount(experts.flatten(), minlength=EXPERTS).double()
    return float(counts.max() / counts.mean())


def _balance_run(coeff: float, steps: int) -> tuple[float, list[float]]:
    """The training loop's balancing with a frozen gate: a counted forward, then the update, `steps` times. Returns
    the imbalance before and over the last 5 steps."""
    layer, x = _skewed_router_layer(coeff)
    start, last = _imbalance(layer, x), []
    for step in range(steps):
        layer(x)
        update_expert_biases({"moe": layer}, data_mesh=None)
        if step >= steps - 5:
            last.append(_imbalance(layer, x))
    return start, last


def test_expert_bias_update_balances_a_skewed_router():
    start, last = _balance_run(0.005, steps=60)
    assert start > 2.5, start  # experts 0 and 1 take most tokens
    assert max(last) < 1.3, (start, last)
    # the same loop without the bias leaves the skew where it was: the balance above is the update's doing
    start_off, last_off = _balance_run(0.0, steps=10)
    assert start_off == start and min(last_off) > 2.5, (start_off, last_off)
