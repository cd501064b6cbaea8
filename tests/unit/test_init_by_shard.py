"""Initialisation by shard (torchtitan/models/random_fill.py, torchtitan/distributed/utils.py::param_init): a rank
fills only its own shard, with the values one process gives the whole tensor, and its peak memory during init is
its shards plus a bounded chunk, not a full parameter. (Every parity layout starting from the 1-process weights is
the end-to-end check: tests/integration/test_parity.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.unit.forked import in_child
from tests.unit.test_memory_estimation import _allocator_peak
from torchtitan.models.random_fill import CHUNK, Constant, Normal, TruncNormal


@pytest.mark.parametrize("fill", [TruncNormal(0.02), Normal(1.0), TruncNormal(0.5, a=-0.1, b=0.7)],
                         ids=["trunc_normal", "normal", "asymmetric_cut"])
def test_any_box_equals_that_slice_of_the_whole_tensor(fill):
    torch.manual_seed(3)
    whole = fill(torch.empty(40, 6, 33))
    for offset, shape in [((0, 0, 0), (40, 6, 33)), ((7, 2, 5), (11, 3, 20)), ((39, 5, 32), (1, 1, 1))]:
        box = torch.empty(shape)
        fill.fill_box(box, (40, 6, 33), offset)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        assert torch.equal(box, whole[index])


def test_values_follow_the_seed_and_the_distribution():
    torch.manual_seed(1)
    a = TruncNormal(0.02)(torch.empty(1000, 500))
    again = TruncNormal(0.02)(torch.empty(1000, 500))
    torch.manual_seed(2)
    b = TruncNormal(0.02)(torch.empty(1000, 500))
    assert torch.equal(a, again) and not torch.equal(a, b)
    # N(0, 0.02) cut at +-3 std has std 0.02 x 0.9866
    assert a.std().item() == pytest.approx(0.02 * 0.9866, rel=0.01) and a.abs().max().item() <= 0.06
    assert abs(a.mean().item()) < 1e-4
    assert Normal(1.0)(torch.empty(400_000)).std().item() == pytest.approx(1.0, rel=0.01)
    assert torch.equal(Constant(1.0)(torch.empty(3)), torch.ones(3))


def _init_405b_block(world_size: int) -> dict:
    """Rank 0 of a 405B-shaped job (one block, FSDP 8 x TP 8) under a fake process group: its shards are real CPU
    tensors, filled by the trainer's own materialize path; the allocator's peak during init, replayed."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.components.model_parts import materialize
    from torchtitan.config.manager import load_config
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.estimation.engine import build_parallel_model

    cfg, resolved = load_config(["--job.config_file", "train_configs/llama3_405b.toml"], world_size)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    parts, _, _ = build_parallel_model(cfg, resolved.parallel_dims, "cpu", n_layers=1, ddp=False)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        materialize(parts, torch.device("cpu"), seed=0, param_init=dist_utils.param_init)
    params = [p for part in parts for p in part.parameters()]
    return {
        "peak": _allocator_peak(prof),
        "local_bytes": sum(p.to_local().numel() * p.to_local().element_size() for p in params),
        "largest_full_bytes": max(p.numel() * p.element_size() for p in params),
        "finite": all(bool(torch.isfinite(p.to_local()).all()) for p in params),
    }


def test_init_of_a_405b_block_is_bounded_by_the_shard():
    got = in_child(_init_405b_block, 64)
    assert got["finite"]
    # The shards themselves (to_empty) plus the fill's chunk temporaries (CHUNK elements of int64 / float64 work
    # arrays); drawing a full parameter first, as before, would add the largest one (3.5 GB for w1).
    bound = got["local_bytes"] + 48 * CHUNK
    assert got["peak"] <= bound, got
    assert got["peak"] < got["largest_full_bytes"] / 4, got
