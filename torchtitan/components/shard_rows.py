"""Which rows of a tensor this rank holds, for moving data by rows (torchtitan/components/hf_sharded.py).

A tensor's rows are its last dimension's vectors, every other dimension flattened (a 1-D tensor is one row), as
in torchtitan/models/hf_common.py `RowLink`. A DTensor's local tensor holds, along each dimension, a set of global
indices; the rows it holds are their product in row-major order, the columns the last dimension's set.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from torchtitan.models.hf_common import RowLink


def sharded_dim(p: Any) -> int | None:
    """The tensor dimension a placement cuts: Shard's and _StridedShard's `dim` (torch 2.13's _StridedShard is not
    a Shard, so `is_shard()` misses it), None for Replicate and Partial."""
    dim = getattr(p, "dim", None)
    return dim if isinstance(dim, int) else None


def dim_indices(t: Tensor) -> list[Tensor]:
    """For each dimension, the global indices this rank's local tensor holds, in local order. DTensor cuts each
    dimension independently, so cutting an index vector with the placements that shard that dimension (the others
    made Replicate) gives them exactly, uneven and strided shards included, without communication."""
    if not isinstance(t, DTensor):
        return [torch.arange(n) for n in t.shape]
    out = []
    for d, n in enumerate(t.shape):
        placements = [p if sharded_dim(p) == d else Replicate() for p in t.placements]
        index = torch.arange(n).reshape([n if i == d else 1 for i in range(t.dim())])
        local = distribute_tensor(index, t.device_mesh, placements, src_data_rank=None).to_local()
        out.append(local.flatten().cpu())  # on the mesh's device (CUDA on GPU jobs); indices stay on the CPU
    return out


def local_rows_cols(t: Tensor) -> tuple[Tensor, Tensor]:
    """(global row ids of the local rows in local order, global column ids): the tensor seen as rows of its last
    dimension, as in RowLink."""
    dims = dim_indices(t) if t.dim() else [torch.zeros(1, dtype=torch.long)]
    rows = torch.zeros(1, dtype=torch.long)
    for d in range(len(dims) - 1):
        rows = (rows[:, None] * t.shape[d] + dims[d][None, :]).flatten()
    return rows, dims[-1]


def as_rows(rows: range | Tensor | None, n: int) -> Tensor:
    if rows is None:
        return torch.arange(n)
    return torch.arange(rows.start, rows.stop, rows.step) if isinstance(rows, range) else rows.long()


def match_rows(link: RowLink, our_n: int, hf_n: int, local_rows: Tensor) -> tuple[Tensor, Tensor]:
    """(local row positions, HF rows) of the link's rows this rank holds, ordered by HF row."""
    ours, hf = as_rows(link.our_rows, our_n), as_rows(link.hf_rows, hf_n)
    if ours.numel() != hf.numel():
        raise ValueError(f"row link {link.our_key} -> {link.hf_key}: {ours.numel()} rows against {hf.numel()}")
    if local_rows.numel() == 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    order = torch.argsort(local_rows)
    held = local_rows[order]
    pos = torch.searchsorted(held, ours).clamp(max=held.numel() - 1)
    hit = held[pos] == ours
    local, hf = order[pos[hit]], hf[hit]
    by_hf = torch.argsort(hf)
    return local[by_hf], hf[by_hf]


def n_rows(shape: torch.Size | tuple[int, ...]) -> int:
    n = 1
    for s in tuple(shape)[:-1]:
        n *= s
    return n


def row_chunks(n_rows: int, row_bytes: int, chunk_bytes: int) -> list[slice]:
    """Slices of at most `chunk_bytes` worth of rows (at least one row each)."""
    step = max(1, chunk_bytes // max(row_bytes, 1))
    return [slice(a, min(a + step, n_rows)) for a in range(0, n_rows, step)]


def local_2d(t: Tensor, n_rows: int, n_cols: int) -> Tensor:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.detach().reshape(n_rows, n_cols)


def shard_index(t: Tensor) -> int:
    """Which shard of its tensor this rank holds: its coordinates on the mesh dimensions that cut the tensor, as
    one number (0 for a plain tensor). Ranks with the same index hold the same rows: replicas."""
    if not isinstance(t, DTensor):
        return 0
    index = 0
    for m, p in enumerate(t.placements):
        if sharded_dim(p) is not None:
            index = index * t.device_mesh.size(m) + t.device_mesh.get_local_rank(m)
    return index
