"""Tensor parallel for generation, and the weight sync into it from the training policy.

A decode step feeds one token per row, so training's sequence parallel has nothing to shard; what is worth
splitting over the tp ranks is the weights and the KV cache. `shard_for_generation` cuts a whole model of
torchtitan/models into this rank's shards, with the same split as training's plan, read from it (the family's
block plan, ModelSpec.tp_block_plan, and torchtitan/distributed/tensor_parallel.py's for the embedding and output),
so that a training parameter's tp shard IS the generator's:

- attention: wq, wk, wv (MLA: wq or wq_b, and wkv_b) row blocks (column-wise, whole heads per rank); wo column
  blocks (row-wise), whose partial outputs are summed over tp (one all-reduce);
- dense MLP: w1, w3 row blocks, w2 column blocks, one all-reduce;
- embedding: vocabulary rows; each rank looks up the ids it holds, zeros for the others, one all-reduce (adding
  zeros is exact, so the sum is the whole model's row bit for bit);
- output projection: vocabulary rows; the [batch, 1, vocab / tp] logits of every rank are all-gathered, so every
  rank holds the same full logits (a gather copies bits, the ranks agree exactly);
- norms (and MLA's per-token low-rank projections wq_a, q_norm, wkv_a, kv_norm, which are small and feed every
  head): replicated, as training's sequence-parallel ones are.

The parameters are plain local tensors, not DTensors: the model code reads head counts from its tensors, so it
runs unchanged on local heads (MLA's latent attention reshapes wkv_b's weight by the local head count, which a
DTensor's global shape would break), and a decode step pays no DTensor dispatch. The collectives are forward hooks
on the plan's row-wise modules (`wo`, `w2`) and `output` (and the embedding's own forward), three all-reduces and one
all-gather per block pair and step. Every rank's residual stream, and so its logits, are bit for bit the same;
given the same seed the ranks then sample the same tokens, and stop together.

The KV cache (torchtitan/generation/kv_cache.py) allocates its buffers from the keys and values it is handed,
which here are this rank's heads: Llama and Qwen3 caches shrink by tp. MLA caches the per-token latent shared by
all heads, which every rank needs whole, so its cache does not shrink.

`load_tp_weights` copies the policy's parameters into these shards: a DTensor of the training layout (a (tp,),
(dp_shard, tp) or (dp_replicate, dp_shard, tp) mesh) is redistributed to Replicate on every mesh dim but tp, which
gathers over the data-parallel dims only and moves each rank's tp shard, never the whole tensor; a tp-only policy
already holds the shard and nothing moves. Plain (whole) tensors are sliced locally.

Not supported (refused with one line): MoE layers (training runs them whole on each rank's sequence shard, which a
single decode token cannot be split into), and shapes training's plan refuses (heads, KV heads, hidden units or
vocabulary not divisible by tp).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from torchtitan.config.validate import tp_divisibility_errors

ROWS, COLS = 0, 1
"""A sharded weight's split dimension: output features (column-wise parallel) or input features (row-wise)."""


@dataclass
class GenerationTP:
    """This rank's place in the generator's tensor parallel: the tp group, and for every parameter (by name) the
    dimension it is split on over the tp ranks (None: replicated)."""

    group: Any
    rank: int
    size: int
    mesh_dim_name: str | None
    split_dims: dict[str, int | None] = field(default_factory=dict)
    handles: list = field(default_factory=list)
    """The collectives' forward hooks (removable)."""


def generation_tp_errors(model: nn.Module, tp: int) -> list[str]:
    """Why `model` cannot be split over `tp` ranks for generation (empty: it can)."""
    if tp <= 1:
        return []
    moe = [key for key, block in model.layers.items() if getattr(block, "moe", None) is not None]
    if moe:
        return [f"the tensor-parallel generator does not support MoE layers (layers {', '.join(moe)}): use "
                "LocalGenerator for MoE models"]
    args = getattr(model, "model_args", None)
    return [] if args is None else tp_divisibility_errors(args, tp, {})  # training's rules, without the sequence


def _plan(model: nn.Module, block_plan: Callable[[nn.Module], dict]) -> tuple[dict[str, int | None], list[str]]:
    """(parameter name -> split dim, for every parameter of `model`; the row-wise modules, whose partial outputs are
    summed over tp), read from training's plans: the embedding and output projection on the vocabulary (tensor_
    parallel.py's plan of the modules every family names alike), and in each block what the family's `block_plan`
    makes column-wise (a Linear's weight split on its rows, the output features) or row-wise (on its columns). Every
    other parameter is held whole, as training holds it on every tp rank (norms, MLA's low-rank projections). One
    inside a split module but not its weight or bias (an adapter, say) raises: it would need a split of its own."""
    plan: dict[str, int | None] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings.weight"] = ROWS
    if model.output is not None:
        plan["output.weight"] = ROWS  # tied or not: both split the [vocab, dim] matrix on the vocabulary
    rowwise, split_modules = [], []
    for key, block in model.layers.items():
        for name, style in block_plan(block).items():
            if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
                continue
            path = f"layers.{key}.{name}"
            split_modules.append(path)
            colwise = isinstance(style, ColwiseParallel)
            plan[f"{path}.weight"] = ROWS if colwise else COLS
            if getattr(model.get_submodule(path), "bias", None) is not None:
                plan[f"{path}.bias"] = ROWS if colwise else None  # a row-wise bias is added once, after the sum
            if not colwise:
                rowwise.append(path)
    out = {}
    for name, _ in model.named_parameters():
        if name not in plan and any(name.startswith(f"{path}.") for path in split_modules):
            raise ValueError(f"the tensor-parallel generator has no placement for parameter {name}")
        out[name] = plan.get(name)
    return out, rowwise


class VocabShardEmbedding(nn.Embedding):
    """An embedding holding rows [start, start + rows) of the vocabulary: ids outside give zeros, and the sum over
    the tp group (each id is inside exactly one rank's rows) is the whole table's lookup."""

    def __init__(self, weight: nn.Parameter, start: int, group: Any) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True, device=weight.device)
        self.weight = weight  # the very parameter (nn.Embedding wraps _weight anew): a tied output shares it
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(out, group=self.group)
        return out


def _sum_over_tp(group: Any):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out, group=group)  # row-wise layer: each rank's heads / hidden units give a partial sum
        return out

    return hook


def gather_stacked(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[size, *x.shape]: every rank's `x` (same shape on all), in rank order, one all-gather."""
    flat = x.new_empty(size * x.numel())
    # torch >= 2.13 names it all_gather_single (and deprecates the old name); gloo wants a flat output there
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat, x.contiguous().view(-1), group=group)
    return flat.view(size, *x.shape)


def _gather_vocab(group: Any, size: int):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        if out.ndim == 0:
            raise ValueError("the tensor-parallel generator computes logits only (no labels)")
        gathered = gather_stacked(out.reshape(-1, out.shape[-1]), group, size)
        # [tp, tokens, vocab / tp] -> [tokens, vocab]: rank r's rows are vocabulary block r
        return gathered.permute(1, 0, 2).reshape(*out.shape[:-1], size * out.shape[-1])

    return hook


@torch.no_grad()
def shard_for_generation(model: nn.Module, tp_mesh, block_plan: Callable[[nn.Module], dict]) -> GenerationTP:
    """Replace, in place, every parameter of `model` (a whole model of torchtitan/models, on `meta` or
    materialised) by this rank's shard over the 1-D `tp_mesh`, split as its family's training `block_plan`
    (ModelSpec.tp_block_plan) splits it, and install the collectives (module doc). On `meta`
    nothing is allocated: `to_empty` then allocates the shards only. A materialised model's shards are copied out
    (the whole tensors are freed when nothing else holds them)."""
    size, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    errors = generation_tp_errors(model, size)
    if errors:
        raise ValueError("; ".join(errors))
    names = tp_mesh.mesh_dim_names
    tp = GenerationTP(group=tp_mesh.get_group(), rank=rank, size=size, mesh_dim_name=names[0] if names else None)
    tp.split_dims, rowwise = _plan(model, block_plan)
    tied = (model.output is not None and model.tok_embeddings is not None
            and model.output.weight is model.tok_embeddings.weight)
    replaced: dict[int, nn.Parameter] = {}  # a tied weight is cut once and shared again
    for name, dim in tp.split_dims.items():
        if dim is None:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        whole = getattr(owner, attr)
        if id(whole) not in replaced:
            block = whole.shape[dim] // size
            piece = whole.narrow(dim, rank * block, block)
            replaced[id(whole)] = nn.Parameter(piece if piece.is_meta else piece.clone(), requires_grad=False)
        setattr(owner, attr, replaced[id(whole)])
    if model.tok_embeddings is not None:
        weight = model.tok_embeddings.weight
        model.tok_embeddings = VocabShardEmbedding(weight, rank * weight.shape[0], tp.group)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    for path in rowwise:
        tp.handles.append(model.get_submodule(path).register_forward_hook(_sum_over_tp(tp.group)))
    if model.output is not None:
        tp.handles.append(model.output.register_forward_hook(_gather_vocab(tp.group, size)))
    return tp


@dataclass
class SyncStats:
    params: int = 0
    """Parameters written."""
    gathered: int = 0
    """Parameters that needed a collective (sharded over a data-parallel dim, or a whole-tensor gather)."""
    bytes_received: int = 0
    """Bytes of parameter data this rank received from others (the result less what it held)."""


@torch.no_grad()
def load_tp_weights(model: nn.Module, tp: GenerationTP,
                    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
    """Write the policy's `params` (name -> DTensor of the training layout, or whole tensor) into `model`'s tp
    shards (module doc), parameter by parameter: at most one parameter's tp shard is in flight at a time. Every
    rank of the policy's mesh must call this (the gathers over the data-parallel dims are collectives), with the
    parameters in the same order."""
    params = params if isinstance(params, Mapping) else dict(params)
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(params))
    if missing:
        raise KeyError(f"load_tp_weights: no value for {missing[0]} (and {len(missing) - 1} more)")
    stats = SyncStats()
    for name, param in own.items():
        local, moved = _tp_shard(params[name].detach(), tp.split_dims[name], tp, name)
        if local.shape != param.shape:
            raise ValueError(f"load_tp_weights: {name}'s tp shard has shape {tuple(local.shape)}, the generator's "
                             f"{tuple(param.shape)}")
        param.copy_(local)
        stats.params += 1
        if moved:
            stats.gathered += 1
            stats.bytes_received += moved
    return stats


def _tp_shard(value: torch.Tensor, dim: int | None, tp: GenerationTP, name: str) -> tuple[torch.Tensor, int]:
    """(this rank's tp shard of `value`, bytes received to make it)."""
    if not isinstance(value, DTensor):
        return (value if dim is None else value.chunk(tp.size, dim=dim)[tp.rank]), 0
    mesh = value.device_mesh
    names = mesh.mesh_dim_names or ()
    if tp.mesh_dim_name not in names:
        # A policy that is not tensor parallel over this tp mesh (FSDP only, say): gather it whole, then cut.
        held = value.to_local().numel() * value.element_size()
        whole = value.full_tensor()
        moved = whole.numel() * whole.element_size() - held
        return (whole if dim is None else whole.chunk(tp.size, dim=dim)[tp.rank]), moved
    i = names.index(tp.mesh_dim_name)
    if mesh.get_local_rank(i) != tp.rank or mesh.size(i) != tp.size:
        raise ValueError(f"load_tp_weights: {name} lives on tp rank {mesh.get_local_rank(i)} of {mesh.size(i)}, "
                         f"the generator on {tp.rank} of {tp.size}: they must share the tp mesh")
    target = [Replicate()] * mesh.ndim
    target[i] = Replicate() if dim is None else Shard(dim)
    if tuple(value.placements) == tuple(target):
        return value.to_local(), 0  # tp-only policy: the shard is already here
    held = value.to_local().numel() * value.element_size()
    local = value.redistribute(mesh, target).to_local()
    return local, max(local.numel() * local.element_size() - held, 0)
