"""Estimate one rank's peak memory by running the trainer's own build, parallelize and step on fake tensors.

A `fake` process group stands in for the job's world (collectives return immediately), the model is built on
`meta` and parallelized by the model's registered `parallelize_fn` (TP, AC, FSDP/HSDP or DDP exactly as in
training), then materialised as fake tensors: shapes, dtypes and storage sizes are real, values are not, so an
8B or 70B model costs no memory. One full training step runs (forward, loss, backward for every micro-batch,
gradient clipping, optimizer step), with the optimizer state created beforehand: the steady state of training
plus the first step's one-time allocations.
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchtitan.components.model_parts import build_model_parts, model_args_for
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.quantization import float8
from torchtitan.components.step import forward_backward_step, scheduled_garbage_collection
from torchtitan.config.job_config import JobConfig
from torchtitan.config.resolve import resolve
from torchtitan.data.dataloader import document_ids_from_positions
from torchtitan.distributed.context_parallel import shard_microbatches
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import Pipeline, PipelinePlan
from torchtitan.distributed.utils import mixed_precision_autocast
from torchtitan.estimation.pipeline import PipelineActions, layer_kinds, sample_stage_depths, stage_blocks
from torchtitan.estimation.tracker import (
    MemoryTracker,
    Record,
    TrackingFakeTensorMode,
    local_tensors,
    untracked_dtensor_metadata,
)
from torchtitan.tools.device import training_param_dtype

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "communication")
_COLLECTIVES = ("all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce", "all_to_all", "broadcast")


@dataclass
class StepPeak:
    bytes: int
    phase: str
    """forward | loss | backward | optimizer, with the step and micro-batch"""
    breakdown: dict[str, int]
    """bytes alive at the peak, per category (they add up to `bytes`)"""


@dataclass
class Estimate:
    rank: int
    world_size: int
    step_peaks: dict[str, StepPeak]
    """the highest point of each phase of the step (forward / loss / backward of each micro-batch, optimizer)"""
    steady_bytes: dict[str, int]
    """parameters, gradients and optimizer state held between steps"""
    counts: dict[str, int] = field(default_factory=dict)
    """numbers of elements behind the steady state, for the analytic cross-check"""
    seconds: float = 0.0
    extrapolated_from: tuple[int, int] | None = None
    """the two depths whose estimates were extrapolated to the model's depth (None: the full model ran); under
    pipeline parallel, the blocks this rank's stages held in the two shallower traces"""
    full_depth_reason: str = ""
    """why a pipeline rank was traced at full depth instead of extrapolated ("" otherwise)"""

    @property
    def peak(self) -> StepPeak:
        return max(self.step_peaks.values(), key=lambda p: p.bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak.bytes

    @property
    def peak_phase(self) -> str:
        return self.peak.phase

    @property
    def breakdown(self) -> dict[str, int]:
        return self.peak.breakdown


def _param_dtype(cfg: JobConfig, device_type: str) -> str:
    return training_param_dtype(cfg.training.mixed_precision_param, device_type)


def _storage_ids(tensors) -> set[int]:
    out = set()
    for t in tensors:
        if t is None:
            continue
        # the plain tensors that hold the data: a DTensor's local shard, a wrapper subclass's inner tensors (float8)
        out.update(id(local.untyped_storage()) for local in local_tensors(t))
    return out


def build_parallel_model(cfg: JobConfig, parallel_dims: ParallelDims, device_type: str, n_layers: int | None = None,
                         *, ddp: bool = True, pipeline: PipelinePlan | None = None):
    """This rank's model parts on `meta`, built by the trainer's own path (components/model_parts.py) for the
    current (fake or real) process group. `ddp=False` for fake tensors: see build_model_parts.

    Returns (model parts, model_args, loss_parallel)."""
    parallel_dims.build_mesh("cpu")
    # Compile changes kernels, not what is allocated at the step level; estimate the eager program.
    cfg = copy.deepcopy(cfg)
    cfg.compile.enable = False
    cfg.parallelism.enable_async_tensor_parallel = False
    model_args = model_args_for(cfg, n_layers)
    # Parallelize outside FakeTensorMode: inside, FSDP + TP setup fails (see docs/architecture.md,
    # 'Memory estimation reuses the trainer').
    parts = build_model_parts(cfg, parallel_dims, pipeline, _param_dtype(cfg, device_type), model_args, ddp=ddp)
    loss_parallel = parallel_dims.loss_parallel_enabled(cfg.parallelism.disable_loss_parallel)
    return parts, model_args, loss_parallel


def estimate_rank(cfg: JobConfig, world_size: int, rank: int = 0, device_type: str = "cuda",
                  steps: int = 1, n_layers: int | None = None, plan: PipelinePlan | None = None) -> Estimate:
    """Peak memory of `rank` in a job of `world_size` processes; `device_type` is the target (cuda or cpu).

    `cfg` is resolved for `world_size` as the trainer resolves it (torchtitan/config/resolve.py), on a copy: the
    caller's config may be estimated for other world sizes too. `plan` replaces the config's pipeline plan (for a
    model of `n_layers` blocks: see estimate)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    start = time.perf_counter()
    cfg = copy.deepcopy(cfg)
    resolved = resolve(cfg, world_size)
    parallel_dims, grad_accum = resolved.parallel_dims, resolved.grad_accum_steps
    plan = plan if plan is not None else resolved.pipeline
    if dist.is_initialized():
        raise RuntimeError("estimate_rank needs a process without a process group (it creates a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        parts, model_args, loss_parallel = build_parallel_model(cfg, parallel_dims, device_type, n_layers, ddp=False,
                                                                pipeline=plan)
        # The fake run is on CPU tensors, so the autocast (if any) is CPU's, with the target's parameter dtype.
        autocast = mixed_precision_autocast(parallel_dims, _param_dtype(cfg, device_type), "cpu")
        tracker = MemoryTracker()
        with TrackingFakeTensorMode(tracker, allow_non_fake_inputs=True):
            for part in parts:
                part.to_empty(device="cpu")
                with torch.no_grad():
                    # Only restores tied weights and the rotary table: values do not matter for memory.
                    part.init_weights(buffer_device=torch.device("cpu"), param_init=lambda p, fill: None)
            optimizer = OptimizersContainer(parts, cfg.optimizer, device_type)
            if steps == 1:
                _create_optimizer_state(parts, optimizer)
            params = [p for part in parts for p in part.parameters()]
            for t in [*params, *(b for part in parts for b in part.buffers()), *_optimizer_tensors(optimizer)]:
                tracker.track(t)
            phases = _Phases(tracker)
            pipeline = build_pipeline(plan, parts, parallel_dims, cfg, torch.device("cpu"))
            if pipeline is not None:
                n_microbatches = plan.n_microbatches(cfg.training.local_batch_size)
                pipeline = PipelineActions(pipeline, n_microbatches, _hidden_shape(cfg, parallel_dims, model_args),
                                           _hidden_dtype(cfg, parallel_dims, device_type), phases.action)
            with tracker, untracked_dtensor_metadata(tracker):
                run_steps(parts, optimizer, cfg, model_args.vocab_size, grad_accum, loss_parallel, phases.set,
                          steps=steps, autocast=autocast, pipeline=pipeline, pp_mesh=_pp_mesh(parallel_dims),
                          cp_mesh=parallel_dims.mesh("cp") if parallel_dims.cp > 1 else None)
            est = _summarise(tracker, params, optimizer, rank, world_size, time.perf_counter() - start)
            if parallel_dims.ddp_enabled:
                _add_ddp_buckets(est, params)
            return est
    finally:
        dist.destroy_process_group()


class _Phases:
    """The tracker's phase: run_steps' ("forward (step 1, micro-batch 1/2)", ...) and, under pipeline parallel,
    each schedule action inside it ("backward (step 1, micro-batch 1/2, stage 3, pipeline micro-batch 5)"), cut
    where the stage's blocks start and end (", blocks", ", after blocks")."""

    def __init__(self, tracker: MemoryTracker):
        self.tracker, self.base = tracker, ""

    def set(self, phase: str) -> None:
        self.base = phase
        self.tracker.set_phase(phase)

    def action(self, kind: str, stage: int, micro: int, region: str) -> None:
        inner = self.base[self.base.index("(") + 1:-1]
        where = f", {region}" if region else ""
        self.tracker.set_phase(f"{kind} ({inner}, stage {stage}, {_PIPELINE_MICRO} {micro + 1}{where})")


_PIPELINE_MICRO = "pipeline micro-batch"


def _add_ddp_buckets(est: Estimate, params) -> None:
    """DDP (gradient_as_bucket_view off) keeps one flat bucket copy of every gradient, in the parameters' dtype,
    from its first forward on: a constant that is alive in every phase of every step."""
    buckets = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    for peak in est.step_peaks.values():
        if peak.phase != "setup":
            peak.bytes += buckets
            peak.breakdown["communication"] += buckets


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    return [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _create_optimizer_state(parts, optimizer) -> None:
    """One optimizer step on zero gradients, untracked: the tracked step then starts in the steady state (moments
    allocated) while still paying the first step's lazy initialisations, so one step covers both cases."""
    for p in (p for part in parts for p in part.parameters() if p.requires_grad):  # frozen ones (LoRA) have none
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _hidden_shape(cfg: JobConfig, parallel_dims: ParallelDims, model_args) -> tuple[int, int, int]:
    # Between stages a rank holds its sequence shard of the residual stream (its cp share, then sequence parallel's
    # tp share of that).
    return (cfg.parallelism.pipeline_parallel_microbatch_size,
            cfg.training.seq_len // (parallel_dims.cp * parallel_dims.tp), model_args.dim)


def _hidden_dtype(cfg: JobConfig, parallel_dims: ParallelDims, device_type: str) -> torch.dtype:
    # FSDP's bf16 policy makes block outputs bf16; under autocast the fp32 residual stream stays fp32.
    bf16 = parallel_dims.fsdp_enabled and _param_dtype(cfg, device_type) == "bfloat16"
    return torch.bfloat16 if bf16 else torch.float32


def _pp_mesh(parallel_dims: ParallelDims):
    return parallel_dims.mesh("pp") if parallel_dims.pp > 1 else None


def build_pipeline(plan: PipelinePlan | None, parts, parallel_dims: ParallelDims, cfg: JobConfig, device):
    """The trainer's Pipeline over `parts` (None without pipeline parallel), with the trainer's scaled loss."""
    if plan is None:
        return None
    return Pipeline(plan, parts, parallel_dims.mesh("pp"), device, cfg.training.local_batch_size)


def random_batch(batch_size: int, seq_len: int, vocab_size: int, document_masking: bool) -> dict[str, torch.Tensor]:
    """A batch shaped as the dataloader's (torchtitan/data/dataloader.py): random tokens, and with document masking
    documents of seq_len / 3 tokens (the masks cost the same memory whatever the documents)."""
    batch = {"tokens": torch.randint(0, vocab_size, (batch_size, seq_len)),
             "labels": torch.randint(0, vocab_size, (batch_size, seq_len))}
    if document_masking:
        batch["positions"] = (torch.arange(seq_len) % max(1, seq_len // 3)).expand(batch_size, seq_len).contiguous()
        batch["document_ids"] = document_ids_from_positions(batch["positions"])
    return batch


def run_steps(parts, optimizer, cfg: JobConfig, vocab_size: int, grad_accum: int, loss_parallel: bool,
              set_phase, steps: int = 2, autocast=None, pipeline=None, pp_mesh=None, cp_mesh=None) -> None:
    """`steps` training steps on random tokens through the trainer's own step (forward_backward_step). Shared by
    the estimator (fake tensors) and the accuracy tests (real ones)."""
    b, s = cfg.training.local_batch_size, cfg.training.seq_len
    after_optimizer_step = float8.post_optimizer_step(cfg, parts)
    if after_optimizer_step is not None:  # as the trainer does before its first step
        after_optimizer_step()
    with scheduled_garbage_collection():  # as the trainer's loop
        for step in range(1, steps + 1):
            def on_phase(kind: str, micro: int | None, step: int = step) -> None:
                detail = f", micro-batch {micro + 1}/{grad_accum}" if micro is not None else ""
                set_phase(f"{kind} (step {step}{detail})")

            microbatches = shard_microbatches([random_batch(b, s, vocab_size,
                                                            cfg.model.attn_mask_type == "block_causal")
                                               for _ in range(grad_accum)], cp_mesh)
            forward_backward_step(parts, optimizer, microbatches, torch.tensor(b * s * grad_accum),
                                  max_norm=cfg.training.max_norm,
                                  device=torch.device("cpu"), autocast=autocast, loss_parallel=loss_parallel,
                                  pipeline=pipeline, pp_mesh=pp_mesh, on_phase=on_phase,
                                  after_optimizer_step=after_optimizer_step)
            del microbatches
            if step % cfg.training.gc_freq == 0:
                gc.collect(1)
            set_phase(f"between steps (step {step})")


def _summarise(tracker: MemoryTracker, params, optimizer, rank: int, world_size: int, seconds: float) -> Estimate:
    timeline = tracker.timeline
    params = list(params)
    param_ids = _storage_ids(params)
    grad_ids = _storage_ids(p.grad for p in params)
    state = _optimizer_tensors(optimizer)
    state_ids = _storage_ids(state)
    # Records of the storages that are params / grads / state now; classification of older records of the same
    # storage objects uses the live slot table's identity, so map storage id -> current serials via the tracker.
    current = {key: slot.record.serial for key, slot in tracker._slots.items()}
    serials = {name: {current[k] for k in ids if k in current}
               for name, ids in (("parameters", param_ids), ("gradients", grad_ids), ("optimizer_state", state_ids))}
    step_peaks = {}
    for step, peak in timeline.peaks.items():
        breakdown = dict.fromkeys(CATEGORIES, 0)
        for r in timeline.alive_at(peak.time):
            breakdown[_category(r, serials, peak.phase)] += r.nbytes
        step_peaks[step] = StepPeak(peak.bytes, peak.phase, breakdown)
    steady = {name: sum(timeline.records[i].nbytes for i in ids) for name, ids in serials.items()}

    def local_numel(ts) -> int:
        return sum((t.to_local() if hasattr(t, "to_local") else t).numel() for t in ts if t is not None)

    counts = {"parameters": local_numel(params),
              "trainable_parameters": local_numel(p for p in params if p.requires_grad),
              "gradients": local_numel(p.grad for p in params),
              "optimizer_state": local_numel(t for t in state if t.dim() > 0)}
    return Estimate(rank=rank, world_size=world_size, step_peaks=step_peaks, steady_bytes=steady, counts=counts,
                    seconds=seconds)


def _category(r: Record, serials: dict[str, set[int]], peak_phase: str) -> str:
    for name in ("parameters", "gradients", "optimizer_state"):
        if r.serial in serials[name]:
            return name
    if any(c in r.op for c in _COLLECTIVES) or r.op in ("resize", "split_with_sizes_copy", "_chunk_cat"):
        return "communication"  # collective outputs and FSDP's gathered / to-be-reduced flat buffers
    # Allocated during a forward or loss phase of this step and still alive: saved for backward (under pipeline
    # parallel also at a forward's peak: the other pipeline micro-batches' forwards in flight).
    same_step = peak_phase.split("(")[-1].split(",")[0] in r.phase
    forward = same_step and r.phase.startswith(("forward", "loss"))
    if forward and (not peak_phase.startswith("forward") or _PIPELINE_MICRO in r.phase):
        return "activations"
    if peak_phase.startswith("forward") and r.phase == peak_phase:
        return "activations"
    return "temporaries"


def _ac_interval(cfg: JobConfig) -> int:
    """Blocks per checkpointed block under selective AC every N blocks (else 1): depth samples move by whole
    groups of it, so every sample checkpoints the same share of its blocks."""
    ac = cfg.activation_checkpoint
    return int(ac.selective_ac_option) if ac.mode == "selective" and ac.selective_ac_option.isdigit() else 1


def sample_layer_counts(cfg: JobConfig, n_layers: int) -> tuple[int, int] | None:
    """Two smaller depths whose estimates determine the full one, or None when every block must be traced
    (sample_depths, on the kinds of the config's blocks)."""
    return sample_depths(layer_kinds(model_args_for(cfg), n_layers), _ac_interval(cfg))


def sample_depths(kinds: list[bool], every: int = 1) -> tuple[int, int] | None:
    """Depths L and 2L < len(kinds) to trace, for blocks of these kinds (pipeline.layer_kinds) under selective AC
    every `every` blocks, or None.

    Multiples of the AC interval, so both samples checkpoint the same share of their blocks, and at least 4 blocks
    (from 2 and 4, the 8B shapes without AC came out 2.6% low at 12). Where blocks differ in kind (DeepSeek's dense
    first blocks, Qwen3's decoder_sparse_step), the blocks after the shallower sample must repeat the kinds the deeper
    one adds, and both samples must end in a block of the real top block's kind (FSDP keeps the top block gathered
    after its forward): otherwise the line through the samples is another model's (DeepSeek with 5 dense blocks, from
    4 and 8: 0.63% low at 12)."""
    n = len(kinds)
    low = every * max(1, -(-4 // every))
    while 2 * low < n:
        added = kinds[low:2 * low]
        if (all(kinds[i] == added[(i - low) % low] for i in range(low, n))
                and kinds[low - 1] == kinds[2 * low - 1] == kinds[-1]):
            return low, 2 * low
        low += every
    return None


def estimate(cfg: JobConfig, world_size: int, rank: int = 0, device_type: str = "cuda",
             exact: bool = False) -> Estimate:
    """estimate_rank, extrapolated in depth for deep models unless `exact`.

    Transformer blocks of one kind are identical, so every memory quantity of a step is affine in the number of
    blocks (a per-block share plus the embedding, output, loss and communication buffers). Two runs with L1 and
    L2 = 2 x L1 blocks give both coefficients (sample_layer_counts); tests check the extrapolation against the
    exact run (same result to the byte on the debug model). It keeps 70B at 64 ranks to seconds instead of minutes
    on a laptop. Under pipeline parallel each stage is affine in its own blocks: see estimate_pipeline_rank.
    """
    if exact:
        return estimate_rank(cfg, world_size, rank, device_type)
    if cfg.parallelism.pipeline_parallel_degree > 1:
        return estimate_pipeline_rank(cfg, world_size, rank, device_type)
    n_layers = model_args_for(cfg).n_layers
    samples = sample_layer_counts(cfg, n_layers)
    if samples is None:
        est = estimate_rank(cfg, world_size, rank, device_type)
        if sample_depths([False] * n_layers, _ac_interval(cfg)) is not None:  # deep enough, but of mixed kinds
            est.full_depth_reason = "no two shallower models repeat the kinds of its blocks (dense, mixture of experts)"
        return est
    low, high = (estimate_rank(cfg, world_size, rank, device_type, n_layers=n) for n in samples)
    return _extrapolate(low, high, (n_layers - samples[0]) / (samples[1] - samples[0]), samples)


def estimate_pipeline_rank(cfg: JobConfig, world_size: int, rank: int, device_type: str,
                           plan: PipelinePlan | None = None, n_layers: int | None = None) -> Estimate:
    """A pipeline rank's estimate from two traces of its stages made shallower by the same number of blocks
    (pipeline.sample_stage_depths), extrapolated to the real split; at full depth where that would be wrong or
    slower (full_depth_reason says why). `plan` and `n_layers` replace the config's (tests: deeper debug models).

    A cut stage keeps at least 2 blocks: with 1, its only block is also the top one, which FSDP keeps gathered after
    forward, and the peaks are not on the line through deeper ones yet (405B, PP 8: +9% on a middle pipeline rank
    from 1 and 2 blocks; from 2 and 3, 0 B on the first and last and +0.29% on the middle one)."""
    plan = plan or resolve(copy.deepcopy(cfg), world_size).pipeline
    stages = plan.stage_ids(rank // (world_size // plan.pp))
    samples = sample_stage_depths(plan, model_args_for(cfg, n_layers), stages, _ac_interval(cfg), min_blocks=2)
    if isinstance(samples, str):
        est = estimate_rank(cfg, world_size, rank, device_type, n_layers=n_layers, plan=plan)
        est.full_depth_reason = samples
        return est
    low, high = (estimate_rank(cfg, world_size, rank, device_type, n_layers=n, plan=p)
                 for n, p in ((samples.low_layers, samples.low), (samples.high_layers, samples.high)))
    traced = tuple(sum(stage_blocks(p)[s] for s in stages) for p in (samples.low, samples.high))
    return _extrapolate(low, high, samples.scale, traced)


def _extrapolate(low: Estimate, high: Estimate, scale: float, samples: tuple[int, int]) -> Estimate:
    """low + (high - low) x scale, for every quantity of the estimate."""

    def extend(a: int, b: int) -> int:
        return round(a + (b - a) * scale)

    def extend_all(a: dict, b: dict) -> dict:
        return {k: extend(a[k], b[k]) for k in a}

    # Each phase's peak is affine in depth; the overall peak is their maximum (which phase wins may change).
    steps = {k: StepPeak(extend(low.step_peaks[k].bytes, high.step_peaks[k].bytes), high.step_peaks[k].phase,
                         extend_all(low.step_peaks[k].breakdown, high.step_peaks[k].breakdown))
             for k in high.step_peaks if k in low.step_peaks}
    return Estimate(
        rank=low.rank, world_size=low.world_size, step_peaks=steps,
        steady_bytes=extend_all(low.steady_bytes, high.steady_bytes), counts=extend_all(low.counts, high.counts),
        seconds=low.seconds + high.seconds, extrapolated_from=samples,
    )
