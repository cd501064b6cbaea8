"""Unit tests for torchtitan.distributed.parallel_dims: degree validation and derived views."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Parallelism
from torchtitan.distributed.parallel_dims import MESH_DIMS, ParallelDims


def make(world_size: int, *, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1, pp: int = 1,
         ep: int = 1, etp: int = 1) -> ParallelDims:
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=ep,
                        world_size=world_size, etp=etp)


def _one_line_error(fn, *keys: str) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    for key in keys:
        assert key in msg, msg
    return msg


# --------------------------------------------------------------------------- dp_shard = -1


@pytest.mark.parametrize(
    ("world", "degrees", "expected_shard"),
    [
        (1, {}, 1),
        (2, {}, 2),
        (8, {}, 8),
        (8, {"dp_replicate": 2}, 4),
        (8, {"tp": 2}, 4),
        (8, {"pp": 2, "tp": 2}, 2),
        (16, {"dp_replicate": 2, "cp": 2, "tp": 2}, 2),
        (8, {"dp_replicate": 8}, 1),
        (12, {"dp_replicate": 3, "pp": 2}, 2),
    ],
)
def test_dp_shard_minus_one_takes_the_leftover(world, degrees, expected_shard):
    pd = make(world, **degrees)
    assert pd.dp_shard == expected_shard
    prod = pd.dp_replicate * pd.dp_shard * pd.cp * pd.tp * pd.pp
    assert prod == world


def test_from_config():
    p = Parallelism(data_parallel_replicate_degree=2, data_parallel_shard_degree=-1)
    pd = ParallelDims.from_config(p, world_size=8)
    assert (pd.dp_replicate, pd.dp_shard, pd.cp, pd.tp, pd.pp, pd.ep) == (2, 4, 1, 1, 1, 1)
    assert pd.world_size == 8


def test_from_config_defaults_on_one_process():
    pd = ParallelDims.from_config(Parallelism(), world_size=1)
    assert pd.dp_shard == 1


def test_explicit_degrees_that_multiply_to_world_size():
    pd = make(8, dp_replicate=2, dp_shard=2, tp=2)
    assert pd.dp_shard == 2


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("world", "degrees"),
    [
        (8, {"dp_shard": 2}),  # 2 != 8
        (4, {"dp_shard": 8}),  # more than the world
        (8, {"dp_replicate": 2, "dp_shard": 2}),
        (4, {"dp_replicate": 2, "dp_shard": 4}),
        (1, {"dp_shard": 2}),
    ],
)
def test_product_mismatch(world, degrees):
    msg = _one_line_error(lambda: make(world, **degrees), "parallelism")
    assert str(world) in msg


@pytest.mark.parametrize(
    ("world", "degrees"),
    [
        (6, {"dp_replicate": 4}),
        (3, {"tp": 2}),
        (8, {"dp_replicate": 3}),
        (2, {"dp_replicate": 2, "tp": 2}),
    ],
)
def test_other_degrees_not_dividing_world_size(world, degrees):
    msg = _one_line_error(lambda: make(world, **degrees), "parallelism", "data_parallel_shard_degree")
    assert str(world) in msg


@pytest.mark.parametrize(
    ("attr", "key"),
    [
        ("dp_replicate", "parallelism.data_parallel_replicate_degree"),
        ("cp", "parallelism.context_parallel_degree"),
        ("tp", "parallelism.tensor_parallel_degree"),
        ("pp", "parallelism.pipeline_parallel_degree"),
        ("ep", "parallelism.expert_parallel_degree"),
    ],
)
@pytest.mark.parametrize("value", [0, -1])
def test_degree_below_one(attr, key, value):
    _one_line_error(lambda: make(4, **{attr: value}), key)


@pytest.mark.parametrize("value", [0, -2, -8])
def test_dp_shard_invalid(value):
    _one_line_error(lambda: make(4, dp_shard=value), "parallelism.data_parallel_shard_degree")


@pytest.mark.parametrize("world", [0, -1])
def test_world_size_below_one(world):
    _one_line_error(lambda: make(world), "world size")


@pytest.mark.parametrize(
    ("world", "degrees"),
    [
        (4, {"ep": 3}),  # 3 does not divide dp_shard*cp = 4
        (4, {"ep": 8}),  # larger than dp_shard*cp
        (8, {"dp_replicate": 2, "ep": 8}),  # dp_shard = 4; replicate ranks do not count
        (8, {"tp": 2, "ep": 8}),  # dp_shard = 4; tp ranks do not count
    ],
)
def test_ep_must_divide_dp_shard_times_cp(world, degrees):
    _one_line_error(lambda: make(world, **degrees), "parallelism.expert_parallel_degree")


@pytest.mark.parametrize(
    ("world", "degrees"),
    [
        (2, {"etp": 2}),  # expert tensor parallel splits over the tp ranks: its degree is 1 or tp
        (8, {"tp": 2, "etp": 4}),
        (8, {"tp": 2, "etp": 2, "ep": 2}),  # EP 2 of dp_shard 4 leaves efsdp 2: FSDP over 2-D experts, not yet
        (8, {"dp_replicate": 2, "tp": 2, "etp": 2, "ep": 2}),  # replicas of 2-D experts: not yet either
    ],
)
def test_expert_tensor_parallel_degree_is_one_or_tp(world, degrees):
    _one_line_error(lambda: make(world, **degrees), "parallelism.expert_tensor_parallel_degree")


@pytest.mark.parametrize(
    ("world", "degrees"),
    [
        (4, {"ep": 4}),
        (4, {"ep": 2}),
        (8, {"cp": 2, "ep": 8}),  # dp_shard=4 x cp=2 = 8
        (8, {"dp_replicate": 2, "ep": 4}),
    ],
)
def test_ep_borrows_from_dp_shard_and_cp(world, degrees):
    pd = make(world, **degrees)
    # ep does not multiply the world
    assert pd.dp_replicate * pd.dp_shard * pd.cp * pd.tp * pd.pp == world


# --------------------------------------------------------------------------- derived degrees and flags


@pytest.mark.parametrize(
    ("name", "world", "degrees", "expected"),
    [
        # name, world, degrees: (dp, fsdp, loss, ddp, fsdp_enabled, hsdp)
        ("1 process", 1, {}, (1, 1, 1, False, False, False)),
        ("TP 2 alone", 2, {"dp_shard": 1, "tp": 2}, (1, 1, 1, False, False, False)),
        ("FSDP 4", 4, {}, (4, 4, 4, False, True, False)),
        ("HSDP 2x2", 4, {"dp_replicate": 2, "dp_shard": 2}, (4, 2, 4, False, True, True)),
        ("HSDP 2x-1", 4, {"dp_replicate": 2}, (4, 2, 4, False, True, True)),
        ("DDP 2", 2, {"dp_replicate": 2, "dp_shard": 1}, (2, 1, 2, True, False, False)),
        ("DDP 2 via -1", 2, {"dp_replicate": 2}, (2, 1, 2, True, False, False)),
        ("FSDP 2 x TP 2", 4, {"tp": 2}, (2, 2, 2, False, True, False)),
        ("FSDP 2 x CP 2", 4, {"cp": 2}, (2, 4, 4, False, True, False)),
        ("replicate 2 x CP 2", 4, {"dp_replicate": 2, "cp": 2}, (2, 2, 4, False, True, True)),
        # DDP does not take DTensor parameters: replication with TP is HSDP with shard degree 1
        ("replicate 2 x TP 2", 4, {"dp_replicate": 2, "tp": 2}, (2, 1, 2, False, True, True)),
    ],
)
def test_derived_degrees_and_flags(name, world, degrees, expected):
    pd = make(world, **degrees)
    got = (pd.dp_degree, pd.fsdp_degree, pd.loss_degree, pd.ddp_enabled, pd.fsdp_enabled, pd.hsdp_enabled)
    assert got == expected, name
    assert not (pd.ddp_enabled and pd.fsdp_enabled)
    assert pd.autocast_enabled == (not pd.fsdp_enabled)


@pytest.mark.parametrize(("world", "degrees", "expected"), [
    (4, {}, 1), (4, {"tp": 2}, 2), (8, {"tp": 2, "cp": 2}, 2), (8, {"tp": 2, "pp": 2}, 4),
])
def test_same_tokens_size_divides_throughput(world, degrees, expected):
    # context parallel ranks count their own share of each sequence: no division by cp
    assert make(world, **degrees).same_tokens_size == expected


def test_loss_parallel_only_with_tp():
    assert make(2, tp=2).loss_parallel_enabled(disable_loss_parallel=False)
    assert not make(2, tp=2).loss_parallel_enabled(disable_loss_parallel=True)
    assert not make(2).loss_parallel_enabled(disable_loss_parallel=False)


def test_world_mesh_before_build_raises():
    pd = make(1)
    with pytest.raises(RuntimeError, match="build_mesh"):
        _ = pd.world_mesh


# --------------------------------------------------------------------------- a real mesh on one gloo process


@pytest.fixture
def gloo_one_process(tmp_path):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group(
        backend="gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_build_mesh_one_process(gloo_one_process):
    pd = make(1)
    mesh = pd.build_mesh("cpu")
    assert pd.world_mesh is mesh
    assert tuple(mesh.mesh_dim_names) == MESH_DIMS
    assert tuple(mesh.shape) == (1, 1, 1, 1, 1)
    for view in ("dp", "dp_shard_cp", "dp_cp", "dp_replicate", *MESH_DIMS):
        sub = pd.mesh(view)
        assert sub.size() == 1, view
        assert sub.get_local_rank() == 0, view
    assert pd.fsdp_mesh().size() == 1
    assert pd.fsdp_mesh().ndim == 1
