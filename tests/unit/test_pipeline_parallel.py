"""Unit tests for torchtitan/distributed/pipeline_parallel.py: the even split, stage placement per schedule, every
config error (one line, naming the key, raised before any process group exists) and the cut of the model.

No process group anywhere: plans come from the config alone (load_config -> resolve -> plan_pipeline), stages
are cut from a meta model and run on small CPU tensors.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules  # noqa: F401  (plan_pipeline reads CSVs with it: import it once here)

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import load_config
from torchtitan.distributed.pipeline_parallel import (
    CSV_SCHEDULES,
    MULTI_STAGE_SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    split_evenly,
    split_model,
    stage_fqn_units,
)
from torchtitan.models.llama3.args import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.registry import get_model_spec

get_model_spec("llama3")  # resolve() imports the model registry lazily: pay that at collection, not in a test

REPO = Path(__file__).resolve().parents[2]
GPIPE_CSV = REPO / "tests" / "integration" / "data" / "pp2_gpipe_8mb.csv"
SMALL = ("--model.flavor", "debugmodel_small")  # 4 blocks, untied
BIG = ("--model.flavor", "8B")  # 32 blocks: only its config is read, no model is built
INPUT, OUTPUT = ("tok_embeddings",), ("norm", "output")
LOOP_SCHEDULES = tuple(s for s in MULTI_STAGE_SCHEDULES if s not in V_SCHEDULES)
FQNS_KEY = "parallelism.module_fqns_per_model_part"
CSV_KEY = "parallelism.pipeline_parallel_schedule_csv"
PER_STAGE_KEY = "parallelism.pipeline_parallel_layers_per_stage"
SCHEDULE_KEY = "parallelism.pipeline_parallel_schedule"
MB_KEY = "parallelism.pipeline_parallel_microbatch_size"


def pp_args(pp: int, schedule: str | None = None, *extra: str) -> list[str]:
    argv = ["--parallelism.pipeline_parallel_degree", str(pp)]
    if schedule is not None:
        argv += ["--parallelism.pipeline_parallel_schedule", schedule]
    return [*argv, *extra]


def fqns_arg(parts: list[list[str]]) -> list[str]:
    return ["--parallelism.module_fqns_per_model_part", json.dumps(parts)]


def plan_of(argv: list[str], world_size: int, model: tuple[str, ...] = SMALL):
    _, resolved = load_config([*model, *argv], world_size)
    assert resolved.pipeline is not None
    return resolved.pipeline


@pytest.fixture
def no_process_group(monkeypatch):
    """Config checks must finish before any process group exists: creating one here fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process group was created while checking the config")

    for name in ("init_process_group", "new_group", "init_device_mesh"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, refuse)
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


def config_error(argv: list[str], world_size: int, key: str, model: tuple[str, ...] = SMALL) -> str:
    """load_config must fail with a one-line ConfigError naming `key`; return the message."""
    with pytest.raises(ConfigError) as info:
        load_config([*model, *argv], world_size)
    msg = str(info.value)
    assert msg and "\n" not in msg and "\r" not in msg, repr(msg)
    assert key in msg, msg
    return msg


def write_csv(path: Path, rows: list[list[str]]) -> str:
    path.write_text("".join(",".join(row) + "\n" for row in rows))
    return str(path)


def forward_backward(stage: int, microbatches: int) -> list[str]:
    """GPipe-style compute actions of one stage: every forward, then every backward."""
    return [f"{stage}F{i}" for i in range(microbatches)] + [f"{stage}B{i}" for i in range(microbatches)]


def csv_args(path: str, schedule: str = "PipelineScheduleMulti") -> list[str]:
    return ["--parallelism.pipeline_parallel_schedule", schedule, "--parallelism.pipeline_parallel_schedule_csv", path]


# --------------------------------------------------------------------------- split_evenly


def block_counts(fqns: list[list[str]]) -> list[int]:
    return [sum(name.startswith("layers.") for name in part) for part in fqns]


def stage_costs(counts: list[int], input_weight: float, output_weight: float) -> list[float]:
    costs = [float(c) for c in counts]
    costs[0] += input_weight
    costs[-1] += output_weight
    return costs


def all_splits(n_layers: int, num_stages: int):
    """Block counts of every contiguous split: the first stage has >= 1 block, the last may hold only the output."""
    for cuts in itertools.combinations(range(1, n_layers + 1), num_stages - 1):
        bounds = (0, *cuts, n_layers)
        yield [b - a for a, b in itertools.pairwise(bounds)]


def best_max_cost(n_layers: int, num_stages: int, input_weight: float, output_weight: float) -> float:
    """The lightest most-loaded stage over every allowed split (brute force)."""
    return min(max(stage_costs(c, input_weight, output_weight)) for c in all_splits(n_layers, num_stages))


def check_split(fqns: list[list[str]], n_layers: int, num_stages: int) -> list[int]:
    """Every module once, in forward order; embedding first, norm + output last; >= 1 block per stage except a
    last stage that holds only the output."""
    assert len(fqns) == num_stages
    assert [name for part in fqns for name in part] == stage_fqn_units(n_layers, INPUT, OUTPUT)
    assert fqns[0][0] == "tok_embeddings"
    assert fqns[-1][-2:] == ["norm", "output"]
    counts = block_counts(fqns)
    assert min(counts[:-1], default=1) >= 1 and counts[0] >= 1, counts
    return counts


@pytest.mark.parametrize(("n_layers", "num_stages", "expected"), [
    # costs 2 2 3 3: the embedding and output count as a block each; of the splits whose heaviest stage costs 3,
    # the one with the lightest early stages (1F1B keeps pp - s micro-batches in flight on stage s)
    (8, 4, [1, 2, 3, 2]),
    (4, 2, [2, 2]),
    (4, 4, [1, 1, 1, 1]),
    (126, 16, [7, *[8] * 14, 7]),  # 405B over 16 stages: 128 units of cost, 8 per stage
    (32, 8, [1, 2, 5, 5, 5, 5, 5, 4]),
    (4, 5, [1, 1, 1, 1, 0]),  # five stages of four blocks: the last holds the output alone
])
def test_split_evenly_known_splits(n_layers, num_stages, expected):
    fqns = split_evenly(n_layers, num_stages)
    counts = check_split(fqns, n_layers, num_stages)
    assert counts == expected
    # optimum of a contiguous split: ceil(total cost / stages), and >= 1 + a weight
    assert max(stage_costs(counts, 1, 1)) == max(-(-(n_layers + 2) // num_stages), 2)


@pytest.mark.parametrize(("input_weight", "output_weight"), [(1, 1), (0, 0), (2, 1), (0, 3), (4, 4), (0.3, 2.3),
                                                             (0.0, 0.7)])
def test_split_evenly_is_optimal_against_brute_force(input_weight, output_weight):
    for n_layers in range(1, 10):
        for num_stages in range(1, n_layers + 2):
            fqns = split_evenly(n_layers, num_stages, INPUT, OUTPUT, input_weight, output_weight)
            counts = check_split(fqns, n_layers, num_stages)
            best = best_max_cost(n_layers, num_stages, input_weight, output_weight)
            assert max(stage_costs(counts, input_weight, output_weight)) == pytest.approx(best), (
                n_layers, num_stages, counts)
            # ties: the earliest stages as light as they can be (the smallest block counts, read front to back)
            optimal = [c for c in all_splits(n_layers, num_stages)
                       if max(stage_costs(c, input_weight, output_weight)) <= best + 1e-9]
            assert counts == min(optimal), (n_layers, num_stages, counts)


def test_split_evenly_without_weights_balances_blocks():
    for n_layers, num_stages in [(8, 4), (9, 4), (126, 16), (5, 5)]:
        counts = block_counts(split_evenly(n_layers, num_stages, input_weight=0, output_weight=0))
        assert sum(counts) == n_layers
        assert max(counts) == -(-n_layers // num_stages), counts


def test_split_evenly_keeps_other_input_and_output_names():
    fqns = split_evenly(4, 2, ("embed", "pos"), ("head",))
    assert fqns == [["embed", "pos", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]]


def test_split_evenly_heavy_output_gets_a_stage_of_its_own():
    # debugmodel at seq 256: output + loss ~ 2.3 blocks, the lookup ~ free (the balance measured in
    # docs/performance.md)
    assert split_evenly(4, 2, INPUT, OUTPUT, 0.0, 2.3) == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2"], ["layers.3", "norm", "output"]]
    assert split_evenly(4, 4, INPUT, OUTPUT, 0.0, 2.3) == [
        ["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2", "layers.3"], ["norm", "output"]]


@pytest.mark.parametrize(("n_layers", "num_stages"), [(4, 6), (1, 3), (32, 64)])
def test_split_evenly_more_stages_than_blocks_is_a_config_error(n_layers, num_stages):
    with pytest.raises(ConfigError) as info:
        split_evenly(n_layers, num_stages)
    msg = str(info.value)
    assert "\n" not in msg and str(num_stages) in msg and str(n_layers) in msg, msg


# --------------------------------------------------------------------------- plan_pipeline: placement


@pytest.mark.parametrize("schedule", SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES)
def test_default_stages_per_rank(schedule, no_process_group):
    plan = plan_of(pp_args(2, schedule), 2)
    per_rank = 1 if schedule in SINGLE_STAGE_SCHEDULES else 2
    assert plan.pp == 2 and plan.schedule == schedule and plan.csv_path == ""
    assert plan.num_stages == 2 * per_rank
    assert [list(part) for part in plan.module_fqns] == split_evenly(4, 2 * per_rank)
    assert all(len(plan.stage_ids(r)) == per_rank for r in range(2))
    assert sorted(s for r in range(2) for s in plan.stage_ids(r)) == list(range(plan.num_stages))
    assert plan.microbatch_size == 1 and plan.n_microbatches(8) == 8


def test_default_schedule_is_1f1b_with_one_stage_per_rank():
    plan = plan_of(pp_args(2), 2)
    assert plan.schedule == "1F1B"
    assert plan.module_fqns == (("tok_embeddings", "layers.0", "layers.1"), ("layers.2", "layers.3", "norm", "output"))
    assert plan.stage_ids_by_rank == ((0,), (1,))


def test_no_plan_without_pipeline():
    _, resolved = load_config([*SMALL], 2)
    assert resolved.pipeline is None


@pytest.mark.parametrize("schedule", LOOP_SCHEDULES)
@pytest.mark.parametrize(("pp", "extra", "per_rank"), [
    (2, [], 2),
    (4, [], 2),
    (4, ["--parallelism.pipeline_parallel_layers_per_stage", "2", "--training.local_batch_size", "16"], 4),
])
def test_loop_schedules_place_rank_r_stages_r_r_plus_pp(schedule, pp, extra, per_rank):
    plan = plan_of(pp_args(pp, schedule, *extra), pp, model=SMALL if pp == 2 else BIG)
    assert plan.num_stages == pp * per_rank
    for r in range(pp):
        assert plan.stage_ids(r) == tuple(r + pp * v for v in range(per_rank))


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_v_schedules_place_rank_r_stages_r_and_2pp_minus_1_minus_r(schedule, pp):
    plan = plan_of(pp_args(pp, schedule), pp, model=SMALL if pp == 2 else BIG)
    assert plan.num_stages == 2 * pp
    assert plan.stage_ids_by_rank == tuple((r, 2 * pp - 1 - r) for r in range(pp))
    # rank 0 holds both the first and the last stage
    assert {0, 2 * pp - 1} == set(plan.stage_ids(0))


def test_v_schedule_with_layers_per_stage():
    plan = plan_of(pp_args(2, "DualPipeV", "--parallelism.pipeline_parallel_layers_per_stage", "1"), 2)
    assert plan.stage_ids_by_rank == ((0, 3), (1, 2))
    assert plan.module_fqns == (("tok_embeddings", "layers.0"), ("layers.1",), ("layers.2",),
                                ("layers.3", "norm", "output"))


@pytest.mark.parametrize(("pp", "schedule", "per_stage", "model"), [
    (2, "Interleaved1F1B", 1, SMALL),
    (2, "1F1B", 2, SMALL),
    (2, "GPipe", 2, SMALL),
    (4, "LoopedBFS", 4, BIG),
])
def test_layers_per_stage(pp, schedule, per_stage, model):
    n_layers = 4 if model == SMALL else 32
    plan = plan_of(pp_args(pp, schedule, "--parallelism.pipeline_parallel_layers_per_stage", str(per_stage)), pp,
                   model=model)
    assert plan.num_stages == n_layers // per_stage
    for s, part in enumerate(plan.module_fqns):
        blocks = [f"layers.{i}" for i in range(s * per_stage, (s + 1) * per_stage)]
        first = list(INPUT) if s == 0 else []
        last = list(OUTPUT) if s == plan.num_stages - 1 else []
        assert list(part) == first + blocks + last


@pytest.mark.parametrize(("schedule", "parts", "by_rank"), [
    ("1F1B", [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]],
     ((0,), (1,))),
    ("GPipe", [["tok_embeddings", "layers.0", "layers.1", "layers.2"], ["layers.3", "norm", "output"]],
     ((0,), (1,))),
    ("Interleaved1F1B", [["tok_embeddings"], ["layers.0", "layers.1"], ["layers.2", "layers.3"], ["norm", "output"]],
     ((0, 2), (1, 3))),
    ("ZBVZeroBubble", [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "output"]],
     ((0, 3), (1, 2))),
])
def test_explicit_module_fqns(schedule, parts, by_rank):
    plan = plan_of(pp_args(2, schedule, *fqns_arg(parts)), 2)
    assert [list(part) for part in plan.module_fqns] == parts
    assert plan.stage_ids_by_rank == by_rank


def test_microbatch_size_sets_the_microbatch_count():
    plan = plan_of(pp_args(2, "1F1B", "--training.local_batch_size", "4",
                           "--parallelism.pipeline_parallel_microbatch_size", "2"), 2)
    assert plan.microbatch_size == 2 and plan.n_microbatches(4) == 2


def test_pipeline_composes_with_data_parallel_degrees():
    # pp x dp_replicate x dp_shard x tp = 2 x 2 x 2 x 1 = 8 ranks; the plan is the same on every rank
    _, resolved = load_config([*SMALL, *pp_args(2, "Interleaved1F1B", "--training.local_batch_size", "4",
                                                 "--parallelism.data_parallel_replicate_degree", "2")], 8)
    dims = resolved.parallel_dims
    assert (dims.pp, dims.dp_replicate, dims.dp_shard) == (2, 2, 2)
    assert resolved.pipeline.stage_ids_by_rank == ((0, 2), (1, 3))


def test_csv_schedule_from_the_repository(no_process_group):
    plan = plan_of(pp_args(2, None, *csv_args(str(GPIPE_CSV))), 2)
    assert plan.schedule == "PipelineScheduleMulti" and plan.csv_path == str(GPIPE_CSV)
    assert plan.stage_ids_by_rank == ((0,), (1,))
    assert [list(part) for part in plan.module_fqns] == split_evenly(4, 2)


@pytest.mark.parametrize("schedule", CSV_SCHEDULES)
def test_csv_schedule_gpipe(tmp_path, schedule):
    path = write_csv(tmp_path / "gpipe.csv", [forward_backward(0, 4), forward_backward(1, 4)])
    plan = plan_of(pp_args(2, None, "--training.local_batch_size", "4", *csv_args(path, schedule)), 2)
    assert plan.schedule == schedule and plan.csv_path == path
    assert plan.num_stages == 2 and plan.stage_ids_by_rank == ((0,), (1,))


@pytest.mark.parametrize(("rows", "by_rank"), [
    ([forward_backward(0, 4) + forward_backward(2, 4), forward_backward(1, 4) + forward_backward(3, 4)],
     ((0, 2), (1, 3))),
    ([forward_backward(0, 4) + forward_backward(3, 4), forward_backward(1, 4) + forward_backward(2, 4)],
     ((0, 3), (1, 2))),
])
def test_csv_schedule_takes_stage_count_and_placement_from_the_file(tmp_path, rows, by_rank):
    path = write_csv(tmp_path / "multi.csv", rows)
    plan = plan_of(pp_args(2, None, "--training.local_batch_size", "4", *csv_args(path)), 2)
    assert plan.num_stages == 4
    assert plan.stage_ids_by_rank == by_rank
    assert [list(part) for part in plan.module_fqns] == split_evenly(4, 4)


def test_csv_schedule_with_microbatch_size(tmp_path):
    path = write_csv(tmp_path / "gpipe.csv", [forward_backward(0, 2), forward_backward(1, 2)])
    plan = plan_of(pp_args(2, None, "--training.local_batch_size", "4",
                           "--parallelism.pipeline_parallel_microbatch_size", "2", *csv_args(path)), 2)
    assert plan.n_microbatches(4) == 2


# --------------------------------------------------------------------------- plan_pipeline: errors

_PARTS_OK = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]]

ERRORS = [
    # micro-batches: at least one per stage, a whole number of them
    ("fewer_microbatches_than_stages_interleaved", 2,
     pp_args(2, "Interleaved1F1B", "--training.local_batch_size", "2"), "training.local_batch_size"),
    ("fewer_microbatches_than_stages_1f1b", 2, pp_args(2, "1F1B", "--training.local_batch_size", "1"),
     "training.local_batch_size"),
    ("fewer_microbatches_than_stages_mb_size", 2,
     pp_args(2, "GPipe", "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_microbatch_size", "4"),
     "training.local_batch_size"),
    ("fewer_microbatches_than_stages_dualpipev", 2, pp_args(2, "DualPipeV", "--training.local_batch_size", "3"),
     "training.local_batch_size"),
    ("microbatch_size_not_dividing", 2,
     pp_args(2, "1F1B", "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_microbatch_size", "3"),
     MB_KEY),
    ("microbatch_size_zero", 2, pp_args(2, "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "0"), MB_KEY),
    # layers per stage
    ("layers_per_stage_not_dividing", 2, pp_args(2, "1F1B", "--parallelism.pipeline_parallel_layers_per_stage", "3"),
     PER_STAGE_KEY),
    ("layers_per_stage_zero", 2, pp_args(2, "1F1B", "--parallelism.pipeline_parallel_layers_per_stage", "0"),
     PER_STAGE_KEY),
    ("stages_not_a_multiple_of_pp_layers_per_stage", 2,
     pp_args(2, "1F1B", "--parallelism.pipeline_parallel_layers_per_stage", "4"), PER_STAGE_KEY),
    ("stages_not_a_multiple_of_pp_fqns", 2,
     pp_args(2, "Interleaved1F1B", *fqns_arg([["tok_embeddings", "layers.0"], ["layers.1", "layers.2"],
                                              ["layers.3", "norm", "output"]])), FQNS_KEY),
    # schedules and stages per rank
    ("gpipe_two_stages_per_rank", 2, pp_args(2, "GPipe", "--parallelism.pipeline_parallel_layers_per_stage", "1"),
     SCHEDULE_KEY),
    ("1f1b_two_stages_per_rank", 2,
     pp_args(2, "1F1B", *fqns_arg([["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"],
                                   ["layers.3", "norm", "output"]])), SCHEDULE_KEY),
    ("zbv_one_stage_per_rank", 2,
     pp_args(2, "ZBVZeroBubble", "--parallelism.pipeline_parallel_layers_per_stage", "2"), SCHEDULE_KEY),
    ("dualpipev_one_stage_per_rank", 2, pp_args(2, "DualPipeV", *fqns_arg(_PARTS_OK)), SCHEDULE_KEY),
    ("unknown_schedule", 2, pp_args(2, "Zigzag"), SCHEDULE_KEY),
    # the model
    ("tied_embeddings", 2, [*pp_args(2), "--model.flavor", "debugmodel_small_tied"],
     "parallelism.pipeline_parallel_degree"),
    # explicit module names
    ("fqns_unknown", 2,
     pp_args(2, "1F1B", *fqns_arg([["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm",
                                                                    "lm_head"]])), FQNS_KEY),
    ("fqns_layer_out_of_range", 2,
     pp_args(2, "1F1B", *fqns_arg([["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "layers.4",
                                                                                "norm", "output"]])), FQNS_KEY),
    ("fqns_duplicated", 2,
     pp_args(2, "1F1B", *fqns_arg([["tok_embeddings", "layers.0", "layers.1"], ["layers.1", "layers.2", "layers.3",
                                                                                "norm", "output"]])), FQNS_KEY),
    ("fqns_missing", 2,
     pp_args(2, "1F1B", *fqns_arg([["tok_embeddings", "layers.0"], ["layers.2", "layers.3", "norm", "output"]])),
     FQNS_KEY),
    ("fqns_missing_output", 2,
     pp_args(2, "1F1B", *fqns_arg([["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm"]])),
     FQNS_KEY),
    ("fqns_out_of_order_across_parts", 2,
     pp_args(2, "1F1B", *fqns_arg([["layers.2", "layers.3", "norm", "output"], ["tok_embeddings", "layers.0",
                                                                               "layers.1"]])), FQNS_KEY),
    ("fqns_out_of_order_within_part", 2,
     pp_args(2, "1F1B", *fqns_arg([["tok_embeddings", "layers.1", "layers.0"], ["layers.2", "layers.3", "norm",
                                                                                "output"]])), FQNS_KEY),
    ("fqns_empty_part", 2,
     pp_args(2, "Interleaved1F1B", *fqns_arg([["tok_embeddings", "layers.0", "layers.1"], [],
                                              ["layers.2"], ["layers.3", "norm", "output"]])), FQNS_KEY),
    ("fqns_and_layers_per_stage", 2,
     pp_args(2, "1F1B", *fqns_arg(_PARTS_OK), "--parallelism.pipeline_parallel_layers_per_stage", "2"), FQNS_KEY),
    # CSV schedules (files that need tmp_path are in test_csv_errors)
    ("csv_schedule_without_csv", 2, pp_args(2, "PipelineScheduleMulti"), CSV_KEY),
    ("csv_without_csv_schedule", 2,
     pp_args(2, "1F1B", "--parallelism.pipeline_parallel_schedule_csv", str(GPIPE_CSV)), CSV_KEY),
    ("csv_with_interleaved_schedule", 2,
     pp_args(2, "Interleaved1F1B", "--parallelism.pipeline_parallel_schedule_csv", str(GPIPE_CSV)), CSV_KEY),
    ("csv_microbatch_count_mismatch", 2,
     pp_args(2, None, "--training.local_batch_size", "4", *csv_args(str(GPIPE_CSV))), CSV_KEY),
    ("csv_microbatch_count_mismatch_mb_size", 2,
     pp_args(2, None, "--parallelism.pipeline_parallel_microbatch_size", "2", *csv_args(str(GPIPE_CSV))), CSV_KEY),
    ("csv_wrong_row_count", 4, pp_args(4, None, *csv_args(str(GPIPE_CSV))), CSV_KEY),
]


@pytest.mark.parametrize(("world_size", "argv", "key"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_config_errors_name_the_key(world_size, argv, key, no_process_group):
    config_error(argv, world_size, key)


def test_error_messages_say_what_is_wrong(no_process_group):
    msg = config_error(pp_args(2, "Interleaved1F1B", "--training.local_batch_size", "2"), 2,
                       "training.local_batch_size")
    assert "2 pipeline micro-batches" in msg and "4 pipeline stages" in msg
    typo = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "outpt"]]
    msg = config_error(pp_args(2, "1F1B", *fqns_arg(typo)), 2, FQNS_KEY)
    assert "'outpt'" in msg
    msg = config_error(pp_args(2, "1F1B", *fqns_arg([["tok_embeddings", "layers.0"], ["layers.2", "layers.3", "norm",
                                                                                         "output"]])), 2, FQNS_KEY)
    assert "'layers.1'" in msg
    msg = config_error(pp_args(2, "1F1B", *fqns_arg([["tok_embeddings", "layers.0", "layers.1"],
                                                     ["layers.1", "layers.2", "layers.3", "norm", "output"]])),
                       2, FQNS_KEY)
    assert "'layers.1'" in msg
    msg = config_error(pp_args(2, "ZBVZeroBubble", "--parallelism.pipeline_parallel_layers_per_stage", "2"), 2,
                       SCHEDULE_KEY)
    assert "2 stages per rank" in msg


def test_v_schedule_with_four_stages_per_rank_is_an_error(no_process_group):
    msg = config_error(pp_args(2, "DualPipeV", "--parallelism.pipeline_parallel_layers_per_stage", "4"), 2,
                       SCHEDULE_KEY, model=BIG)
    assert "8 stages for 2 ranks" in msg


def test_more_stages_than_blocks_is_a_config_error(no_process_group):
    # pp 4 x 2 stages per rank = 8 stages for a 4-block model; pp 8 x 1 stage likewise
    config_error(pp_args(4, "Interleaved1F1B"), 4, "parallelism")
    config_error(pp_args(8, "1F1B"), 8, "parallelism")


def test_csv_missing_file(tmp_path, no_process_group):
    msg = config_error(pp_args(2, None, *csv_args(str(tmp_path / "nope.csv"))), 2, CSV_KEY)
    assert "nope.csv" in msg


def test_csv_wrong_row_count(tmp_path, no_process_group):
    path = write_csv(tmp_path / "three_rows.csv", [forward_backward(0, 8), forward_backward(1, 8),
                                                   forward_backward(2, 8)])
    msg = config_error(pp_args(2, None, *csv_args(path)), 2, CSV_KEY)
    assert "3 rows" in msg


def test_csv_microbatch_count_mismatch(tmp_path, no_process_group):
    path = write_csv(tmp_path / "gpipe4.csv", [forward_backward(0, 4), forward_backward(1, 4)])
    msg = config_error(pp_args(2, None, "--training.local_batch_size", "6", *csv_args(path)), 2, CSV_KEY)
    assert "4 micro-batches" in msg and "training.local_batch_size=6" in msg


def test_csv_unreadable_action(tmp_path, no_process_group):
    path = write_csv(tmp_path / "bad.csv", [forward_backward(0, 8), ["1Q0", *forward_backward(1, 8)]])
    config_error(pp_args(2, None, *csv_args(path)), 2, CSV_KEY)


def test_csv_stage_on_two_ranks(tmp_path, no_process_group):
    # stages 0..3 but stage 2 on both ranks and stage 3 on rank 1 only: every stage must live on exactly one rank
    rows = [forward_backward(0, 4) + forward_backward(2, 4), forward_backward(1, 4) + forward_backward(2, 4)
            + forward_backward(3, 4)]
    path = write_csv(tmp_path / "shared.csv", rows)
    config_error(pp_args(2, None, "--training.local_batch_size", "4", *csv_args(path)), 2, CSV_KEY)


def test_csv_stage_count_not_a_multiple_of_pp_names_the_csv(tmp_path, no_process_group):
    # Three stages from the file on two ranks. The error must name the key that was set (the CSV), not
    # pipeline_parallel_layers_per_stage, which this config leaves unset.
    rows = [forward_backward(0, 4), forward_backward(1, 4) + forward_backward(2, 4)]
    path = write_csv(tmp_path / "three_stages.csv", rows)
    msg = config_error(pp_args(2, None, "--training.local_batch_size", "4", *csv_args(path)), 2, CSV_KEY)
    assert PER_STAGE_KEY not in msg, msg


@pytest.mark.parametrize(("name", "rows"), [
    # rank 1 never runs the backward of micro-batch 3: torch's _validate_schedule rejects the file in _load_csv
    ("missing_backward", [forward_backward(0, 4), forward_backward(1, 4)[:-1]]),
    # a communication action in a compute-only file: torch's _prepare_schedule_with_comms rejects it
    ("communication_action", [["0UNSHARD", *forward_backward(0, 4)], forward_backward(1, 4)]),
])
def test_csv_that_torch_rejects_is_a_config_error(tmp_path, name, rows, no_process_group):
    # plan_pipeline promises to find everything wrong with the CSV before the process group exists; torch
    # (2.13) refuses these files only in Pipeline._build -> _PipelineScheduleRuntime._load_csv, on every rank.
    path = write_csv(tmp_path / f"{name}.csv", rows)
    config_error(pp_args(2, None, "--training.local_batch_size", "4", *csv_args(path)), 2, CSV_KEY)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble"])
def test_microbatch_count_torch_rejects_is_a_config_error(schedule, no_process_group):
    # torch (2.13) ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble need n_microbatches to be a multiple of
    # rounds = max(1, n_microbatches // pp): at pp 2, 5 micro-batches give 2 rounds and the constructor raises
    # "... requires the number of microbatches to be a multiple of the number of rounds (2), but got 5", in
    # Pipeline._build after the process group exists. The plan must refuse the count first.
    for good in (4, 6, 8):
        plan_of(pp_args(2, schedule, "--training.local_batch_size", str(good)), 2)
    with pytest.raises(ConfigError) as info:
        load_config([*SMALL, *pp_args(2, schedule, "--training.local_batch_size", "5")], 2)
    msg = str(info.value)
    assert "\n" not in msg
    assert "training.local_batch_size" in msg or MB_KEY in msg, msg


@pytest.mark.parametrize(("key", "value"), [
    ("pipeline_parallel_schedule", "GPipe"),
    ("pipeline_parallel_schedule_csv", str(GPIPE_CSV)),
    ("pipeline_parallel_microbatch_size", "2"),
    ("pipeline_parallel_layers_per_stage", "2"),
    ("module_fqns_per_model_part", json.dumps(_PARTS_OK)),
])
@pytest.mark.parametrize("world_size", [1, 2])
def test_pipeline_keys_without_pipeline_are_errors(key, value, world_size, no_process_group):
    msg = config_error([f"--parallelism.{key}", value], world_size, f"parallelism.{key}")
    assert "pipeline_parallel_degree" in msg


def test_default_pipeline_values_with_pp_1_are_fine():
    _, resolved = load_config([*SMALL, "--parallelism.pipeline_parallel_schedule", "1F1B",
                               "--parallelism.pipeline_parallel_microbatch_size", "1"], 1)
    assert resolved.pipeline is None


def test_tied_flavor_without_pipeline_is_fine():
    load_config(["--model.flavor", "debugmodel_small_tied"], 2)


# --------------------------------------------------------------------------- split_model


ARGS = llama3_flavors["debugmodel_small"]


@pytest.fixture(scope="module")
def meta_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(ARGS)


def module_names(part: Transformer) -> list[str]:
    """Top-level modules a part holds, with `layers` expanded to `layers.<i>`, in forward order."""
    names = []
    for name in ("tok_embeddings", "layers", "norm", "output"):
        child = getattr(part, name)
        if name == "layers":
            names += [f"layers.{key}" for key in child]
        elif child is not None:
            names.append(name)
    return names


SPLITS = [split_evenly(4, 2), split_evenly(4, 4), [list(p) for p in _PARTS_OK],
          [["tok_embeddings"], ["layers.0", "layers.1", "layers.2", "layers.3"], ["norm", "output"]]]


@pytest.mark.parametrize("split", SPLITS, ids=["even2", "even4", "explicit", "embedding_alone"])
def test_split_model_keeps_exactly_the_named_modules(meta_model, split):
    whole = dict(meta_model.named_parameters())
    seen: dict[str, int] = {}
    for s, keep in enumerate(split):
        part = split_model(meta_model, keep)
        assert part is not meta_model
        assert module_names(part) == keep
        names = [name for name, _ in part.named_parameters()]
        assert names, keep
        for name in names:
            assert name in whole, name  # the whole model's FQN, not re-numbered
            assert any(name.startswith(f"{m}.") for m in keep), name
            assert part.get_parameter(name).shape == whole[name].shape
            assert part.get_parameter(name).is_meta
            assert name not in seen, f"{name} in parts {seen.get(name)} and {s}"
            seen[name] = s
        assert set(part.state_dict()) == set(names)  # checkpoints key by the same names
    assert set(seen) == set(whole)
    # the whole model is untouched
    assert module_names(meta_model) == stage_fqn_units(4, INPUT, OUTPUT)
    assert len(dict(meta_model.named_parameters())) == len(whole)


def test_split_model_keeps_the_block_depth(meta_model):
    part = split_model(meta_model, ["layers.3", "norm", "output"])
    assert list(part.layers.keys()) == ["3"]
    assert part.layers["3"].weight_init_std == meta_model.layers["3"].weight_init_std


def _materialize(part: Transformer) -> Transformer:
    part.to_empty(device="cpu")
    part.init_weights(buffer_device=torch.device("cpu"))
    return part.eval()


def test_middle_stage_takes_hidden_states(meta_model):
    torch.manual_seed(0)
    middle = _materialize(split_model(meta_model, ["layers.1", "layers.2"]))
    hidden = torch.randn(2, 8, ARGS.dim)
    with torch.no_grad():
        out = middle(hidden)
    assert out.shape == (2, 8, ARGS.dim)
    assert torch.isfinite(out).all()


def test_stages_chained_equal_the_whole_model(meta_model):
    torch.manual_seed(0)
    whole = _materialize(split_model(meta_model, stage_fqn_units(4, INPUT, OUTPUT)))
    state = whole.state_dict()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    with torch.no_grad():
        expected = whole(tokens)
        x = tokens
        for s, keep in enumerate(split_evenly(4, 4)):
            part = _materialize(split_model(meta_model, keep))
            part.load_state_dict({k: v for k, v in state.items() if k in part.state_dict()}, strict=True)
            x = part(x)
            assert x.shape == ((2, 8, ARGS.vocab_size) if s == 3 else (2, 8, ARGS.dim))
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_plan_split_cuts_the_model(meta_model):
    plan = plan_of(pp_args(2, "ZBVZeroBubble"), 2)
    parts = {s: split_model(meta_model, plan.module_fqns[s]) for s in range(plan.num_stages)}
    rank0 = [parts[s] for s in plan.stage_ids(0)]  # stages 0 and 3: embedding and output on rank 0
    assert rank0[0].tok_embeddings is not None and rank0[0].output is None
    assert rank0[1].tok_embeddings is None and rank0[1].output is not None
    names = [n for p in parts.values() for n, _ in p.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in meta_model.named_parameters())


# --------------------------------------------------------------------------- automatic split weights


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_small", "8B", "405B"])
def test_unit_flops_add_up_to_the_models_flops(flavor):
    """The split's per-unit FLOPs are the model's FLOPs per token cut in pieces (norm weights aside)."""
    spec = get_model_spec("llama3")
    args = llama3_flavors[flavor]
    first, block, last = spec.pipeline_unit_flops_fn(args, 512)
    with torch.device("meta"):
        model = Transformer(args)
    _, flops = spec.nparams_and_flops_fn(model, args, 512)
    norm_weights = (2 * args.n_layers + 1) * args.dim  # counted by the model's FLOPs, not by the split's
    assert first + args.n_layers * block + last == flops - 6 * norm_weights


def test_plan_weighs_the_output_by_its_flops(no_process_group):
    # debugmodel: output + loss cost 2.3 blocks at seq 256 (vocab 8192, dim 256): one block on the last stage;
    # debugmodel_small (vocab 512, dim 64): 0.4 blocks, an even split
    plan = plan_of(pp_args(2, "1F1B", "--training.seq_len", "256"), 2, ("--model.flavor", "debugmodel"))
    assert block_counts([list(p) for p in plan.module_fqns]) == [3, 1]
    plan = plan_of(pp_args(2, "Interleaved1F1B", "--training.seq_len", "256", "--training.local_batch_size", "8"), 2,
                   ("--model.flavor", "debugmodel"))
    assert [list(p) for p in plan.module_fqns][-1] == ["norm", "output"]
    plan = plan_of(pp_args(2, "1F1B"), 2)
    assert block_counts([list(p) for p in plan.module_fqns]) == [2, 2]
