"""Expert parallel: the routed experts of every MoE layer are spread over the ep ranks, and tokens travel to the
rank of their expert and back by all-to-all.

Rank r of an ep group of R ranks holds experts [r E/R, (r+1) E/R) of each layer (the experts' weights become
DTensors sharded on the expert dimension over the ep mesh; parameter names do not change, so checkpoints
reshard across ep degrees). The MoE layer (torchtitan/models/moe/moe.py) routes its own tokens and sorts the
(token, slot) rows by expert as without EP; around its grouped experts this module adds:

    dispatch   the row counts per expert are exchanged (all-to-all of E integers), then the rows themselves
               (all-to-all with uneven splits: rank s sends rank r the rows of r's experts); the rows received
               from every source are regrouped by local expert (a stable sort: deterministic)
    compute    the local experts on their contiguous rows, as without EP
    combine    the inverse regrouping, then the reverse all-to-all: each rank gets its own rows back, in order

Both all-to-alls are torch's functional collectives with autograd (the backward of one is the other), so the
gradient of an expert's weights on its rank sums the contributions of every rank's tokens, as one process would;
data-parallel replicas of an expert (the ranks left over, efsdp) are summed by FSDP as for any parameter.
The split sizes are read on the host (a device sync per layer), as the uneven all-to-all needs them.

The memory estimator (torchtitan/estimation/) runs this code on fake tensors, which have shapes but no values: there
the splits are assumed, each rank sending 1/R of its rows to every rank and receiving `load_factor` times a
balanced share (memory_estimation.expert_load_factor, the headroom for routing imbalance), so the all-to-all
buffers and the experts' activations are those of a rank whose experts are that much busier than average.

In the trainer (torchtitan/models/llama3/parallelize.py, which the MoE families share) expert parallel comes
right after tensor parallel, which leaves the MoE layers whole and splits their tokens over tp (the ep group of a
rank is the ranks of its tp index). FSDP then shards the experts again over the ranks that hold the same experts
(efsdp x tp, and dp_replicate under HSDP), or leaves them alone when there are none
(torchtitan/distributed/fsdp.py). Gradient norms and clipping go mesh by mesh (torchtitan/distributed/utils.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import Shard, distribute_tensor

from torchtitan.models.moe import MoE


class _Dispatch:
    """One layer's dispatch and combine over the ep group; holds the routing of the forward between the two."""

    def __init__(self, ep_mesh, num_experts: int, load_factor: float) -> None:
        self.mesh, self.group = ep_mesh, ep_mesh.get_group()
        self.ranks = ep_mesh.size()
        self.local_experts = num_experts // self.ranks
        self.load_factor = load_factor
        self.state: tuple | None = None

    def dispatch(self, module: nn.Module, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed._functional_collectives as funcol

        rows, counts = args  # this rank's (token, slot) rows sorted by expert, and their count per expert
        R, L = self.ranks, self.local_experts
        if is_fake(counts):
            return self._assumed_dispatch(rows)
        # counts_in[s, e]: rows rank s sends to this rank's local expert e
        counts_in = funcol.all_to_all_single(counts.contiguous(), None, None, self.group)
        counts_in = funcol.wait_tensor(counts_in).view(R, L)
        send = counts.view(R, L).sum(dim=1).tolist()
        recv = counts_in.sum(dim=1).tolist()
        received = funcol.all_to_all_single_autograd(rows.contiguous(), recv, send, self.group)
        received = funcol.wait_tensor(received)
        # The received rows come source by source, each source's by expert: regroup them expert by expert.
        order = _expert_major_order(counts_in)
        self.state = (order, send, recv)
        return received.index_select(0, order), counts_in.sum(dim=0)

    def _assumed_dispatch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The memory estimator's dispatch (module doc): the same collectives and buffers with assumed splits."""
        import torch.distributed._functional_collectives as funcol

        R, L, n = self.ranks, self.local_experts, rows.shape[0]
        send = [n // R + (r < n % R) for r in range(R)]
        recv = [math.ceil(self.load_factor * n / R)] * R
        received = funcol.wait_tensor(funcol.all_to_all_single_autograd(rows.contiguous(), recv, send, self.group))
        total = sum(recv)
        self.state = (torch.arange(total, device=rows.device), send, recv)
        per_expert = torch.full((L,), total // L, dtype=torch.int64, device=rows.device)
        return received.index_select(0, self.state[0]), per_expert

    def combine(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        order, send, recv = self.state
        self.state = None
        by_source = torch.empty_like(output).index_copy(0, order, output)
        back = funcol.all_to_all_single_autograd(by_source, send, recv, self.group)
        return funcol.wait_tensor(back)


class _ExpertTensorParallel:
    """Tensor parallel inside the experts (expert_tensor_parallel_degree = tp): each tp rank holds a 1/tp slice of
    every local expert's hidden units (w1, w3 on their hidden rows, w2 on its hidden columns). Under tensor parallel
    each tp rank routes its own sequence shard, so before the experts the tp ranks pool their rows (an all-to-all
    that sends each rank's rows to every rank, uneven sizes) and regroup them by expert; every rank computes its
    hidden slice of all pooled rows, a partial sum of their outputs; after, each row's partial sums go back to the
    rank that owns it (the reverse all-to-all) and are added up there, in rank order (deterministic). Forward and
    backward each move tp - 1 copies of the rows, where replicating the experts instead would gather their weights."""

    def __init__(self, tp_mesh) -> None:
        self.group, self.ranks = tp_mesh.get_group(), tp_mesh.size()
        self.state: tuple | None = None

    def gather(self, module: nn.Module, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed._functional_collectives as funcol

        rows, counts = args  # this rank's rows for its local experts, grouped by expert, and their counts
        T, L, mine = self.ranks, counts.shape[0], rows.shape[0]
        if is_fake(counts):  # the memory estimator: every rank assumed to hold as many rows as this one
            counts_by_rank, sizes = counts.repeat(T).view(T, L), [mine] * T
            order = torch.arange(mine * T, device=rows.device)
        else:
            counts_by_rank = funcol.wait_tensor(funcol.all_gather_tensor(counts.contiguous(), 0, self.group)).view(T, L)
            sizes = counts_by_rank.sum(dim=1).tolist()
            order = _expert_major_order(counts_by_rank)
        pooled = funcol.all_to_all_single_autograd(rows.contiguous().repeat(T, 1), sizes, [mine] * T, self.group)
        self.state = (order, sizes, mine)
        return funcol.wait_tensor(pooled).index_select(0, order), counts_by_rank.sum(dim=0)

    def scatter(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        order, sizes, mine = self.state
        self.state = None
        by_source = torch.empty_like(output).index_copy(0, order, output)
        partial = funcol.all_to_all_single_autograd(by_source, [mine] * self.ranks, sizes, self.group)
        return funcol.wait_tensor(partial).view(self.ranks, mine, -1).sum(dim=0)


def _expert_major_order(counts_by_source: torch.Tensor) -> torch.Tensor:
    """Rows that arrived source by source (each source's grouped by expert, `counts_by_source` [S, L]) -> the
    permutation that groups them expert by expert, sources in order within an expert (a stable sort)."""
    S, L = counts_by_source.shape
    segment = torch.repeat_interleave(torch.arange(S * L, device=counts_by_source.device), counts_by_source.reshape(-1))
    return torch.argsort((segment % L) * S + segment // L, stable=True)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' weights of every MoE layer (sharded over ep and/or tp by apply_ep)."""
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


# The dimension each expert weight is sharded on by a mesh dimension: experts over ep, hidden units over tp.
_SHARD_DIM = {"ep": {"w1": 0, "w2": 0, "w3": 0}, "tp": {"w1": 1, "w2": 2, "w3": 1}}


def _mesh_dim(mesh, name: str):
    names = mesh.mesh_dim_names
    return mesh if names == (name,) else mesh[name] if name in names else None


def apply_ep(model: nn.Module, weight_mesh, load_factor: float = 1.0) -> None:
    """Shard every MoE layer's routed experts of `model` (the model or a pipeline stage, on meta or materialised)
    over `weight_mesh`, whose dims are "ep" (expert parallel) and/or "tp" (tensor parallel inside the experts), and
    route their rows: by all-to-all over ep (see the module doc), pooled over tp (`_ExpertTensorParallel`).
    num_experts must divide by the ep degree and the experts' hidden size by the tp degree. `load_factor` only
    matters to the memory estimator's fake tensors (module doc)."""
    ep_mesh, etp_mesh = _mesh_dim(weight_mesh, "ep"), _mesh_dim(weight_mesh, "tp")
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts, num_experts = module.experts, module.args.num_experts
        if ep_mesh is not None and num_experts % ep_mesh.size():
            raise ValueError(f"expert parallel: {num_experts} experts do not divide over {ep_mesh.size()} ep ranks")
        for name, param in list(experts.named_parameters(recurse=False)):
            placements = [Shard(_SHARD_DIM[dim][name]) for dim in weight_mesh.mesh_dim_names]
            sharded = distribute_tensor(param.data, weight_mesh, placements, src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        if ep_mesh is not None:
            router = _Dispatch(ep_mesh, num_experts, load_factor)
            experts.register_forward_pre_hook(router.dispatch)
            experts.register_forward_hook(router.combine)
        if etp_mesh is not None:
            # Inside expert parallel's exchange: pool after the dispatch, return the partial sums before the combine.
            pool = _ExpertTensorParallel(etp_mesh)
            experts.register_forward_pre_hook(pool.gather)
            experts.register_forward_hook(pool.scatter, prepend=True)
