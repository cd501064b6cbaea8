"""The start-up lines (components/startup.py): the layout actually applied, every mesh dimension included."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from torchtitan.components.startup import data_line, layout_line, training_line
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims


def _dims(**degrees) -> ParallelDims:
    full = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, "etp": 1, **degrees}
    world = full["dp_replicate"] * full["dp_shard"] * full["cp"] * full["tp"] * full["pp"]
    return ParallelDims(world_size=world, **full)


def test_layout_line_names_every_dimension_and_the_expert_mesh():
    plain = layout_line(_dims(dp_shard=4), loss_parallel=False)
    assert plain == "layout: world 4 = dp_replicate 1 x dp_shard 4 x cp 1 x tp 1 x pp 1; experts ep 1 x etp 1"
    # expert parallel changes no degree of the world mesh: the line still tells the two apart
    assert layout_line(_dims(dp_shard=4, ep=2), loss_parallel=False) != plain
    line = layout_line(_dims(dp_shard=2, tp=2, ep=2, etp=2), loss_parallel=True)
    assert "dp_shard 2 x cp 1 x tp 2" in line and "experts ep 2 x etp 2; loss parallel on" in line


def test_layout_line_shows_the_pipeline_schedule_and_this_ranks_stages():
    plan = SimpleNamespace(schedule="Interleaved1F1B", num_stages=4, n_microbatches=lambda local_batch: local_batch,
                           module_fqns=[["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"],
                                        ["layers.3", "norm", "output"]])
    line = layout_line(_dims(pp=2, dp_shard=2), False, SimpleNamespace(plan=plan, stage_ids=[1, 3]), 8)
    assert line.endswith("; pipeline Interleaved1F1B, 4 stages, 8 micro-batches, this rank's stages "
                         "1: layers.1..layers.1, 3: layers.3..output")


def test_training_line_states_batch_ac_compile_and_dtypes():
    cfg = parse_args(["--training.local_batch_size", "2", "--training.global_batch_size", "16",
                      "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
                      "--compile.enable", "true"])
    line = training_line(cfg, _dims(dp_shard=4), 2, "bfloat16", torch.device("cuda", 0))
    assert line.startswith("training: global batch 16 sequences of ")
    assert "= local 2 x dp 4 x 2 accumulation steps; activation checkpointing selective (op); compile " in line
    assert line.endswith("params bfloat16, reduce float32; device cuda:0")


def test_data_line_for_the_registry_and_a_mixture():
    registry = SimpleNamespace(num_documents=792)
    assert data_line(parse_args([]), registry) == "data: registry dataset 'python_stdlib', 792 documents"
    mixed = parse_args(["--training.dataset_mixture", "python_stdlib:0.7,tinystories:0.3"])
    assert data_line(mixed, None).startswith("data: mixture of 2 sources: python_stdlib:0.7")


def test_startup_line_adds_up_every_phase(monkeypatch):
    from torchtitan.components import startup

    age = startup.process_age_seconds()  # from /proc on Linux
    assert age is None or age > 0
    ticks = iter([100.0, 101.5, 104.0, 104.25])
    monkeypatch.setattr(startup.time, "monotonic", lambda: next(ticks))
    monkeypatch.setattr(startup, "process_age_seconds", lambda: 7.0)
    clock = startup.StartupClock()
    for phase in ("data", "model build", "step 1"):
        clock.mark(phase)
    assert clock.line() == "start-up: 11.2 s to the end of step 1 = process 7.0 + data 1.5 + model build 2.5 + " \
                           "step 1 0.2 s"
