"""Context parallel: the sequence of every batch is split over the cp ranks; attention sees the whole sequence.

Layout (head-tail load balancing): the sequence is cut into 2 x cp equal chunks and cp rank r holds chunks r and
2 x cp - 1 - r, so every rank gets one early and one late chunk and the causal work (late queries see more keys)
is the same on every rank. Inputs and labels are sharded that way before the forward (`shard_microbatches`), the
rotary rows are taken at the tokens' global positions (the model's `positions` argument, fed by a forward
pre-hook), and attention runs with all the keys and values of the sequence:

    K, V (local, [B, H, S/cp, D]) --all-gather over the cp mesh--> [B, H, S, D], put back in sequence order
    each local query chunk (global chunk g) attends to the keys of chunks 0 .. g, causal within chunk g

The all-gather is torch's functional collective with autograd: its backward is a reduce-scatter, which sums the
gradients every rank's queries sent to this rank's keys and values. Memory per rank: the gathered K and V (S x kv
heads x head_dim, not S / cp) of each layer; the chunk's mask and attention are recomputed in the backward rather
than kept, so the rest of the activations fall by cp. Work per rank: the keys after a chunk are skipped, so the
two chunks together read (2 cp + 1) / (4 cp) of the S x S/cp scores, about the causal half.
This one implementation serves CPU and GPU (torch's own SDPA context parallel has no CPU rule;
docs/parallelism.md).

Loss normalisation is unchanged: each rank's loss is a sum over its tokens divided by the global token count,
counted after sharding and all-reduced over dp x cp (the trainer's loss mesh), and FSDP shards over dp_shard x cp,
so its reduce-scatter also sums the cp ranks' gradients.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torchtitan.models.attention import document_causal_mask


def sequence_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of the tokens cp rank `cp_rank` holds, in its local order (chunk r, then 2 x cp - 1 - r).
    Built on `device` directly: attention asks for them in every layer, and a host-to-GPU copy there would
    synchronise."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context_parallel_degree = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


# Batch entries cut along the sequence; `document_ids` stays whole: attention compares every local query's document
# with those of all the keys, which come from every cp rank (every cp rank of a data-parallel rank reads the same
# batch, so each already holds them).
SHARDED_KEYS = ("tokens", "labels", "positions")


def shard_microbatches(microbatches: list[dict[str, torch.Tensor]], cp_mesh) -> list[dict[str, torch.Tensor]]:
    """This cp rank's share of each micro-batch ({tokens, labels[, positions, document_ids]}, [batch, seq] each)."""
    if cp_mesh is None:
        return microbatches
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    out = []
    for batch in microbatches:
        index = sequence_positions(batch["tokens"].shape[1], cp, rank)
        out.append({key: value[:, index] if key in SHARDED_KEYS else value for key, value in batch.items()})
    return out


class AllGatherKVAttention(nn.Module):
    """Causal attention of the local queries over the keys and values of every cp rank (see the module doc)."""

    def __init__(self, cp_mesh) -> None:
        super().__init__()
        self.cp_mesh = cp_mesh
        self.cp, self.cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """q, k, v: [batch, heads, local seq, head_dim] (k and v may have fewer, grouped, heads); document_ids
        [batch, seq]: the whole sequence's (document masking), or None (causal only)."""
        import torch.distributed._functional_collectives as funcol

        group = self.cp_mesh.get_group()
        # The collective's output lands in cp-rank order (rank r's chunks r and 2cp-1-r at rows r x S/cp); index
        # it back into sequence order so that each query chunk reads the keys before it as one prefix.
        k_all = funcol.wait_tensor(funcol.all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=group))
        v_all = funcol.wait_tensor(funcol.all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=group))
        chunk = q.shape[2] // 2
        seq_len = 2 * chunk * self.cp
        gathered_pos = torch.cat([sequence_positions(seq_len, self.cp, r, q.device) for r in range(self.cp)])
        order = torch.argsort(gathered_pos)
        k_seq, v_seq = k_all.index_select(2, order), v_all.index_select(2, order)
        outs = []
        for half, global_chunk in enumerate((self.cp_rank, 2 * self.cp - 1 - self.cp_rank)):
            q_chunk = q[:, :, half * chunk:(half + 1) * chunk]
            end = (global_chunk + 1) * chunk  # keys after this chunk are all in its future: left out
            docs = document_ids[:, :end] if document_ids is not None else None
            # Recomputed in the backward instead of saved: the mask (and the float copy SDPA makes of it) would
            # otherwise stay alive for every layer, chunk x seq_len elements each.
            outs.append(checkpoint(_prefix_causal_attention, q_chunk, k_seq[:, :, :end], v_seq[:, :, :end], docs,
                                   use_reentrant=False))
        return torch.cat(outs, dim=2)


def _prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             key_docs: torch.Tensor | None) -> torch.Tensor:
    """Attention of q, the last q.shape[2] positions of a prefix, over the keys of that prefix: causal aligned to
    the bottom right (query i of the chunk sees keys up to its own position), and within each document when
    `key_docs` (the prefix's document ids, [batch, prefix]) is given."""
    n_q, n_k = q.shape[2], k.shape[2]
    if key_docs is not None:
        mask = document_causal_mask(key_docs[:, n_k - n_q:], key_docs)
    else:
        q_pos = torch.arange(n_k - n_q, n_k, device=q.device)
        mask = torch.arange(n_k, device=q.device).unsqueeze(0) <= q_pos.unsqueeze(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _positions_hook(cp_mesh):
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def hook(module, args, kwargs):
        if kwargs.get("positions") is not None:  # document masking's per-token positions, sharded with the tokens
            return args, kwargs
        # tokens [batch, seq / cp], or a later pipeline stage's hidden states [batch, seq / cp, dim] (a DTensor of
        # that global shape under sequence parallel: tensor parallel's pre-hook runs first)
        local = args[0].shape[1]
        return args, {**kwargs, "positions": sequence_positions(local * cp, cp, rank, args[0].device)}

    return hook


def apply_cp(model: nn.Module, cp_mesh) -> None:
    """Every block's attention core becomes the all-gather-KV attention over `cp_mesh`, and the model's rotary
    rows follow the tokens' global positions. `model` (the model or a pipeline stage) takes already sharded tokens
    ([batch, seq / cp]) or hidden states."""
    for block in model.layers.values():
        block.attention.sdpa = AllGatherKVAttention(cp_mesh)
    model.register_forward_pre_hook(_positions_hook(cp_mesh), with_kwargs=True)
