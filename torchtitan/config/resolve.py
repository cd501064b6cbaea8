"""The one pass from the config as written to the config as run, for a world of `world_size` processes.

Some keys leave their value to be derived (-1): parallelism.data_parallel_shard_degree (the ranks the other
dimensions leave over), training.global_batch_size (one micro-batch per data-parallel rank),
validation.local_batch_size and validation.seq_len (the training values). `resolve` writes the derived numbers
into the config itself, so everything downstream (checks, trainer, estimator, the saved job_config.json) reads
the numbers the run uses, and returns what the trainer needs beyond the config. It runs before any process
group exists; an impossible combination is a one-line ConfigError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.config.errors import ConfigError
from torchtitan.config.flavor import flavor_args
from torchtitan.config.job_config import JobConfig
from torchtitan.config.moe import fill_moe
from torchtitan.config.validate import check_resolved
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import PipelinePlan, plan_pipeline
from torchtitan.models.registry import get_model_spec

__all__ = ["Resolved", "resolve"]


@dataclass(frozen=True)
class Resolved:
    """What a run needs beyond its resolved JobConfig."""

    parallel_dims: ParallelDims
    """Degrees of every mesh dimension, dp_shard resolved; the mesh itself is built later, by the trainer"""
    grad_accum_steps: int
    """Micro-batches (of training.local_batch_size sequences) per optimizer step on each data-parallel rank"""
    pipeline: PipelinePlan | None = None
    """The stage split and schedule when parallelism.pipeline_parallel_degree > 1"""


def resolve(cfg: JobConfig, world_size: int) -> Resolved:
    """Fill in every derived value of `cfg` (in place) for `world_size` processes, check them, return the rest.

    `cfg` is a config as parse_args returns it (each value checked on its own). Resolving a resolved config
    again for the same world size changes nothing, so callers may resolve whatever config they are handed.
    """
    t, v = cfg.training, cfg.validation
    if v.local_batch_size == -1:
        v.local_batch_size = t.local_batch_size
    if v.seq_len == -1:
        v.seq_len = t.seq_len
    parallel_dims = ParallelDims.from_config(cfg.parallelism, world_size)
    cfg.parallelism.data_parallel_shard_degree = parallel_dims.dp_shard
    per_microstep = t.local_batch_size * parallel_dims.dp_degree
    if t.global_batch_size == -1:
        t.global_batch_size = per_microstep
    if t.global_batch_size % per_microstep != 0:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} must be a multiple of training.local_batch_size x "
            f"data-parallel degree = {t.local_batch_size} x {parallel_dims.dp_degree} = {per_microstep}"
        )
    check_resolved(cfg)
    fill_moe(cfg)
    pipeline = None
    if parallel_dims.pp == 1:
        _check_no_pipeline_keys(cfg)
    else:
        spec = get_model_spec(cfg.model.name)
        args = flavor_args(cfg)
        # Validation walks the stages forward only, in micro-batches of any count (pipeline_parallel.py).
        batches = {"training.local_batch_size": t.local_batch_size}
        weights = (1.0, 1.0)
        if spec.pipeline_unit_flops_fn is not None:
            first, block, last = spec.pipeline_unit_flops_fn(args, t.seq_len)
            weights = (first / block, last / block)
        pipeline = plan_pipeline(cfg.parallelism, args.n_layers, batches, args.tie_word_embeddings,
                                 spec.pipeline_input_fqns, spec.pipeline_output_fqns, weights)
    return Resolved(parallel_dims=parallel_dims, grad_accum_steps=t.global_batch_size // per_microstep,
                    pipeline=pipeline)


def _check_no_pipeline_keys(cfg: JobConfig) -> None:
    """Pipeline keys set without a pipeline would be read by nothing: most likely the degree was forgotten."""
    p, default = cfg.parallelism, type(cfg.parallelism)()
    for key in ("pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                "pipeline_parallel_layers_per_stage", "module_fqns_per_model_part"):
        if getattr(p, key) != getattr(default, key):
            raise ConfigError(f"parallelism.{key}: set, but parallelism.pipeline_parallel_degree is 1 (it applies "
                              "only to pipeline-parallel runs)")
