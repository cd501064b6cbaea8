"""The model parts a rank trains, built by one path for the trainer and the memory estimator.

Without pipeline parallel a rank holds one part, the whole (sharded) model; with it, one part per local pipeline
stage (torchtitan/distributed/pipeline_parallel.py). Every part keeps the whole model's parameter names, so the
state-dict helpers below merge the parts into one dict keyed by name: checkpoints do not depend on the split.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from torchtitan.components.quantization import float8, lora
from torchtitan.config.flavor import flavor_args
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import PipelinePlan, split_model
from torchtitan.models.registry import get_model_spec

_WRAPPERS = ("._checkpoint_wrapped_module", "._orig_mod")


def canonical_name(name: str) -> str:
    """A parameter's name without activation-checkpoint and compile wrappers (as checkpoints store it)."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def model_args_for(cfg: JobConfig, n_layers: int | None = None) -> Any:
    """The flavor's args for this run (torchtitan/config/flavor.py: model.n_layers and the [moe] keys applied); the
    rotary table covers the longest sequence trained or validated. `n_layers`: another depth (the estimator's
    samples)."""
    max_seq_len = max(cfg.training.seq_len, cfg.validation.seq_len if cfg.validation.enable else 0)
    args = dataclasses.replace(flavor_args(cfg), max_seq_len=max_seq_len)
    return args if n_layers is None else dataclasses.replace(args, n_layers=n_layers)


# training.loss_chunks = 0: chunks of at most this many bytes of fp32 logits (docs/performance.md, "Chunked loss")
AUTO_LOSS_CHUNK_BYTES = 256 * 2**20


def loss_chunks(cfg: JobConfig, parallel_dims: ParallelDims, pipeline: PipelinePlan | None, vocab_size: int) -> int:
    """How many token chunks the output projection scores a micro-batch in: training.loss_chunks, or with 0 the
    fewest whose fp32 logits fit AUTO_LOSS_CHUNK_BYTES. The output sees a micro-batch (a pipeline micro-batch under
    pipeline parallel) of this rank's context-parallel share of each sequence, and its vocabulary shard under loss
    parallel (tensor parallel gathers the sequence before the projection)."""
    if cfg.training.loss_chunks > 0:
        return cfg.training.loss_chunks
    sequences = pipeline.microbatch_size if pipeline is not None else cfg.training.local_batch_size
    tokens = sequences * cfg.training.seq_len // parallel_dims.cp
    vocab = vocab_size // parallel_dims.tp if parallel_dims.loss_parallel_enabled(
        cfg.parallelism.disable_loss_parallel) else vocab_size
    return max(1, -(-tokens * vocab * 4 // AUTO_LOSS_CHUNK_BYTES))


def build_model_parts(cfg: JobConfig, parallel_dims: ParallelDims, pipeline: PipelinePlan | None, param_dtype: str,
                      model_args: Any, *, ddp: bool = True) -> list[nn.Module]:
    """This rank's model parts on `meta`: the model, cut into this rank's pipeline stages (if any), each part
    parallelized by the model's parallelize_fn (TP, AC, compile, FSDP/HSDP or DDP). The mesh must exist.

    `ddp=False` leaves DDP's wrapper out (the estimator, whose fake tensors DDP's reducer cannot bucket, adds the
    buckets' memory itself)."""
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    if "float8" in cfg.model.converters:  # before any parallelism: TP and FSDP pick their float8 forms from it
        float8.convert(model, cfg)
    if "lora" in cfg.model.converters:  # before any parallelism: TP places the adapters by the base's style
        lora.convert(model, cfg)
    if pipeline is None:
        parts = [model]
    else:
        pp_rank = parallel_dims.mesh("pp").get_local_rank()
        parts = [split_model(model, pipeline.module_fqns[s]) for s in pipeline.stage_ids(pp_rank)]
    chunks = loss_chunks(cfg, parallel_dims, pipeline, model_args.vocab_size)
    for part in parts:
        if getattr(part, "output", None) is not None:
            part.output.loss_chunks = chunks
    return [spec.parallelize_fn(part, parallel_dims, cfg, param_dtype, ddp=ddp) for part in parts]


def seeded_param_init(part: nn.Module, seed: int, param_init: Callable) -> Callable:
    """`param_init` that first seeds the generators from (seed, parameter name): each parameter then gets the same
    values whichever stage, part or layout holds it (a shared generator's sequence would depend on which
    parameters came before on this rank)."""
    names = {id(p): canonical_name(n) for n, p in part.named_parameters()}

    def init(param: torch.Tensor, fill) -> None:
        name = names.get(id(param))
        if name is None:
            raise KeyError("seeded_param_init: a parameter outside the model part")
        torch.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        param_init(param, fill)

    return init


def materialize(parts: list[nn.Module], device: torch.device, seed: int, param_init: Callable) -> None:
    """Allocate every part on `device` and initialise it (layout-invariant values, see seeded_param_init)."""
    for part in parts:
        part.to_empty(device=device)
        with torch.no_grad():
            part.init_weights(buffer_device=device, param_init=seeded_param_init(part, seed, param_init))
        part.train()
    torch.manual_seed(seed)  # whatever runs next draws the same numbers in every layout


def model_state_dict(parts: list[nn.Module], options: StateDictOptions | None = None) -> dict[str, Any]:
    """One state dict over all parts, keyed by parameter name."""
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(get_model_state_dict(part, options=options))
    return merged


def load_model_state_dict(parts: list[nn.Module], state: dict[str, Any],
                          options: StateDictOptions | None = None) -> None:
    """Load `state` (a merged dict) into every part, each taking the names it holds."""
    for part in parts:
        own = get_model_state_dict(part).keys()  # sharded: no communication
        set_model_state_dict(part, {k: v for k, v in state.items() if k in own}, options=options)


def named_parameters(parts: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(canonical name, parameter) of every part, in forward order."""
    return [(canonical_name(n), p) for part in parts for n, p in part.named_parameters()]
