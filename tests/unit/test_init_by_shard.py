"""Initialisation by shard (torchtitan/models/random_fill.py, torchtitan/distributed/utils.py::param_init): a rank
fills only its own shard, with the values one process gives the whole tensor, and its peak memory during init is
its shards plus a bounded chunk, not a full parameter. (Every parity layout starting from the 1-process weights is
the end-to-end check: tests/integration/test_parity.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.forked import in_child
from torchtitan.models import random_fill
from torchtitan.models.random_fill import CHUNK, Constant, Normal, TruncNormal, uniform_at
from torchtitan.tools.profiling import allocator_peak

FILLS = [TruncNormal(0.02), Normal(1.0), TruncNormal(0.5, a=-0.1, b=0.7)]
FILL_IDS = ["trunc_normal", "normal", "asymmetric_cut"]


@pytest.mark.parametrize("fill", FILLS, ids=FILL_IDS)
def test_any_box_equals_that_slice_of_the_whole_tensor(fill):
    torch.manual_seed(3)
    whole = fill(torch.empty(40, 6, 33))
    for offset, shape in [((0, 0, 0), (40, 6, 33)), ((7, 2, 5), (11, 3, 20)), ((39, 5, 32), (1, 1, 1))]:
        box = torch.empty(shape)
        fill.fill_box(box, (40, 6, 33), offset)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        assert torch.equal(box, whole[index])


# 3.5 x CHUNK elements. A row is 7 x 4001 elements, so fill_box generates 37 rows at a time: the whole tensor is
# filled in chunks starting at rows 0, 37, 74 and 111 (flat indices that are not multiples of CHUNK).
MULTI_CHUNK = (131, 7, 4001)


@pytest.mark.parametrize("fill", FILLS, ids=FILL_IDS)
def test_boxes_across_chunks_equal_the_slices_of_the_whole_tensor(fill):
    rows_per_chunk = CHUNK // (7 * 4001)
    assert rows_per_chunk == 37 and 3.4 * CHUNK < math.prod(MULTI_CHUNK) < 3.6 * CHUNK
    torch.manual_seed(11)
    whole = fill(torch.empty(MULTI_CHUNK))
    # Independent of the chunking: element i holds values(uniform_at(seed, i)), checked at a few indices in every
    # chunk (the first and last element of each included).
    flat = whole.flatten()
    chunk = rows_per_chunk * 7 * 4001
    ends = [min((k + 1) * chunk, flat.numel()) for k in range(4)]
    index = torch.tensor([i for k in range(4) for i in (k * chunk, k * chunk + 12_345, ends[k] - 1)])
    assert torch.equal(flat[index], fill.values(uniform_at(11, index)).float())
    # Chunks that repeated one another (an index offset lost between chunks) would also repeat these rows.
    starts = range(0, MULTI_CHUNK[0], rows_per_chunk)
    for a in starts:
        for b in starts:
            if a < b:
                assert not torch.equal(whole[a:a + 20], whole[b:b + 20]), (a, b)
    boxes = [
        ((30, 0, 0), (10, 7, 4001)),  # whole rows across the first chunk boundary (row 37)
        ((36, 3, 100), (3, 4, 2000)),  # an uneven box across the same boundary
        ((70, 5, 3999), (45, 2, 2)),  # across two boundaries (74 and 111)
        ((1, 1, 1), (80, 5, 3990)),  # 1.6M elements: the box is itself generated in two chunks (52 rows, then 28)
        ((111, 0, 0), (20, 7, 4001)),  # the last, partial chunk
        ((130, 6, 4000), (1, 1, 1)),
    ]
    for offset, shape in boxes:
        box = torch.empty(shape)
        fill.fill_box(box, MULTI_CHUNK, offset)
        assert torch.equal(box, whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]), offset
    # An accelerator generates in ACCELERATOR_CHUNK steps (the whole tensor at once here): the same values.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(random_fill, "chunk_elements", lambda device: random_fill.ACCELERATOR_CHUNK)
        torch.manual_seed(11)
        assert torch.equal(fill(torch.empty(MULTI_CHUNK)), whole)


def _sharded_fills(layouts: list, chunk: int) -> list[tuple]:
    """Every rank of each layout (mesh shape, global shape, placements) in turn, under a fake process group: the
    rank's shard initialised by param_init, against the elements of the 1-process fill of the whole tensor that torch
    itself puts on that rank (distribute_tensor of the flat indices), and all shards put back together. The shards
    are generated `chunk` elements at a time, the whole tensor in one chunk, so the shards cross many chunk
    boundaries that the reference never sees."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor import empty as dtensor_empty
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.distributed.utils import param_init

    whole_calls = []
    real_call = random_fill.Fill.__call__

    def counted_call(self, tensor):
        whole_calls.append(tuple(tensor.shape))
        return real_call(self, tensor)

    out = []
    for mesh_shape, shape, names in layouts:
        assert math.prod(shape) < CHUNK  # the reference is one chunk
        placements = [Shard(int(n[1:])) if n.startswith("S") else Replicate() for n in names]
        for fill_id, fill in zip(FILL_IDS, FILLS, strict=True):
            torch.manual_seed(7)
            whole = fill(torch.empty(shape))
            assembled = torch.full(shape, float("nan"))
            local_shapes, mismatched = [], []
            for rank in range(math.prod(mesh_shape)):
                dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=math.prod(mesh_shape))
                try:
                    mesh = init_device_mesh("cpu", mesh_shape)
                    param = dtensor_empty(shape, device_mesh=mesh, placements=placements)
                    held = distribute_tensor(torch.arange(whole.numel()).view(shape), mesh, placements,
                                             src_data_rank=None).to_local()
                    random_fill.CHUNK, random_fill.Fill.__call__ = chunk, counted_call
                    try:
                        torch.manual_seed(7)
                        param_init(param, fill)
                    finally:
                        random_fill.CHUNK, random_fill.Fill.__call__ = CHUNK, real_call
                    local = param.to_local()
                finally:
                    dist.destroy_process_group()
                local_shapes.append(tuple(local.shape))
                if not torch.equal(local, whole.flatten()[held]):
                    mismatched.append(rank)
                assembled.view(-1)[held.flatten()] = local.flatten()
            out.append((mesh_shape, shape, names, fill_id, local_shapes, mismatched, torch.equal(assembled, whole),
                        whole_calls.copy()))
    return out


def test_uneven_dtensor_shards_equal_the_one_process_fill():
    # Dims of 301 and 203 split unevenly over 3 ranks (101/101/99 rows, 68/68/67 columns) and over 2 x 2; 2 rows
    # over 3 ranks leave the last rank an empty shard.
    layouts = [((3,), (301, 203), ("S0",)), ((3,), (301, 203), ("S1",)), ((3,), (2, 203), ("S0",)),
               ((3,), (5, 7, 301), ("S2",)), ((2, 2), (301, 203), ("S0", "S1")), ((2, 2), (301, 203), ("S1", "S0")),
               ((2, 2), (301, 203), ("S0", "S0")), ((2, 2), (301, 203), ("R", "S1"))]
    chunk = 2_000  # about 10 rows of a shard: every shard spans several chunks
    for mesh_shape, shape, names, fill_id, local_shapes, mismatched, equal, whole_calls in in_child(
            _sharded_fills, layouts, chunk):
        case = (mesh_shape, shape, names, fill_id, local_shapes)
        assert mismatched == [] and equal, case
        # Each rank filled only its box: param_init never fell back to filling the whole tensor.
        assert whole_calls == [], case
        assert len(set(local_shapes)) > 1, case  # the layout is uneven indeed

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
        "peak": allocator_peak(prof),
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
