"""Context parallel: the head-tail layout, the all-gather-KV attention against full attention on one process
(values and gradients, on 2 and 4 gloo ranks), the model's global rotary positions, and the config checks.

Whole-trainer parity (loss, gradient norm, parameters) of the CP layouts is in tests/integration/layouts.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from tests.unit.forked import run_ranks
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import load_config
from torchtitan.distributed.context_parallel import AllGatherKVAttention, sequence_positions, shard_microbatches
from torchtitan.models.llama3.args import llama3_flavors
from torchtitan.models.llama3.model import Transformer


@pytest.mark.parametrize(("seq_len", "cp"), [(8, 2), (64, 2), (64, 4), (48, 3)])
def test_positions_cover_the_sequence_once_with_equal_causal_work(seq_len, cp):
    per_rank = [sequence_positions(seq_len, cp, r) for r in range(cp)]
    assert sorted(torch.cat(per_rank).tolist()) == list(range(seq_len))
    chunk = seq_len // (2 * cp)
    for r, pos in enumerate(per_rank):
        assert pos.tolist() == [*range(r * chunk, (r + 1) * chunk),
                                *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)]
    # causal work of a query = the keys it sees (position + 1): the same on every rank
    assert len({int((pos + 1).sum()) for pos in per_rank}) == 1


def test_positions_reject_a_length_not_divisible_by_twice_cp():
    with pytest.raises(ValueError, match="not divisible by 2 x context_parallel_degree = 4"):
        sequence_positions(10, 2, 0)


def _qkv(seed: int = 0, heads: int = 4, kv_heads: int = 2, seq: int = 32, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, seq, dim, generator=g, dtype=torch.float64),
            torch.randn(2, kv_heads, seq, dim, generator=g, dtype=torch.float64),
            torch.randn(2, kv_heads, seq, dim, generator=g, dtype=torch.float64),
            torch.randn(2, heads, seq, dim, generator=g, dtype=torch.float64))


def _full_attention() -> tuple[torch.Tensor, ...]:
    q, k, v, weight = (t.requires_grad_(True) if i < 3 else t for i, t in enumerate(_qkv()))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _cp_attention_rank(rank: int, cp: int) -> tuple[torch.Tensor, ...]:
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    q, k, v, weight = _qkv()
    index = sequence_positions(q.shape[2], cp, rank)
    local = [t[:, :, index].clone().requires_grad_(True) for t in (q, k, v)]
    out = AllGatherKVAttention(mesh)(*local)
    (out * weight[:, :, index]).sum().backward()
    return index, out.detach(), *(t.grad for t in local)


@pytest.mark.parametrize("cp", [2, 4])
def test_all_gather_kv_attention_matches_full_attention(cp):
    """Each rank's output rows and q/k/v gradient rows equal full causal attention's rows at its positions (the
    k/v gradients arrive through the all-gather's reduce-scatter backward)."""
    out, dq, dk, dv = _full_attention()
    for index, *got in run_ranks(_cp_attention_rank, cp, world=cp):
        for name, want, have in zip(("output", "dq", "dk", "dv"), (out, dq, dk, dv), got, strict=True):
            have = torch.tensor(have, dtype=torch.float64)  # ranks send plain lists (tests/unit/forked.py)
            torch.testing.assert_close(have, want[:, :, index], rtol=1e-10, atol=1e-10, msg=name)


class _MaskedByPositions(torch.nn.Module):
    """Causal attention over tokens given in any order: key k is visible to query q when pos[k] <= pos[q]."""

    def __init__(self, positions: torch.Tensor) -> None:
        super().__init__()
        self.positions = positions

    def forward(self, q, k, v, document_ids=None):
        mask = self.positions.unsqueeze(0) <= self.positions.unsqueeze(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def test_model_positions_select_the_rotary_rows():
    """The sequence fed in the head-tail order of cp 2 (all four chunks, rank 0's then rank 1's) with its global
    positions gives the whole-sequence logits at those positions: rotary angles follow `positions`."""
    torch.manual_seed(0)
    args = llama3_flavors["debugmodel_small"]
    model = Transformer(args).double()
    model.init_weights(buffer_device=torch.device("cpu"))
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    full = model(tokens)
    order = torch.cat([sequence_positions(16, 2, r) for r in range(2)])
    assert order.tolist() != list(range(16))
    for block in model.layers.values():
        block.attention.sdpa = _MaskedByPositions(order)
    torch.testing.assert_close(model(tokens[:, order], positions=order), full[:, order], rtol=1e-9, atol=1e-9)
    # and without the positions the rotary rows are 0..15 for the reordered tokens: different logits
    assert not torch.allclose(model(tokens[:, order]), full[:, order], rtol=1e-6, atol=1e-6)


def test_shard_microbatches_without_cp_is_the_identity():
    batch = [{"tokens": torch.arange(8).view(1, 8), "labels": torch.arange(8).view(1, 8)}]
    assert shard_microbatches(batch, None) is batch


@pytest.mark.parametrize(("argv", "world", "message"), [
    (["--training.seq_len", "62"], 2, "training.seq_len=62 is not divisible by 2 x context_parallel_degree = 4"),
    (["--training.seq_len", "64", "--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree",
      "4"], 8, None),
    (["--model.flavor", "debugmodel", "--training.seq_len", "20", "--parallelism.tensor_parallel_degree", "4"], 8,
     "training.seq_len=20 over context_parallel_degree=2 leaves 10 tokens per rank, not divisible by "
     "tensor_parallel_degree=4"),
    (["--parallelism.context_parallel_rotate_method", "alltoall"], 2, "parallelism.context_parallel_rotate_method"),
    (["--validation.enable", "true", "--validation.seq_len", "30"], 2,
     "validation.seq_len=30 is not divisible by 2 x context_parallel_degree = 4"),
])
def test_config_checks(argv, world, message):
    argv = ["--model.flavor", "debugmodel_small", "--parallelism.context_parallel_degree", "2", *argv]
    if message is None:
        load_config(argv, world)  # 64 / 4 = 16 tokens per cp rank, 8 per tp rank: fine
        return
    with pytest.raises(ConfigError) as info:
        load_config(argv, world)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
