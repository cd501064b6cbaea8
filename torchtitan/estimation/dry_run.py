"""Dry run of a job at its real size on one CPU: layout, pipeline stage split, per-rank parameters, memory verdict.

Nothing here creates a real process group or allocates the model. The config is resolved by the trainer's own
`load_config` (so every problem is the trainer's one-line ConfigError); the per-rank parameter table comes from
the trainer's own build + parallelize code (`build_parallel_model`) run on `meta` under a `fake` process group of
the job's world size, at the model's full depth (building 405B on meta with FSDP x TP takes about 1.5 s); the
verdict is the memory estimator's (`estimate`, depth-extrapolated, per pipeline stage under pipeline parallel: see
engine.py).

Each rank's build runs in a forked child: a fake process group and DTensor's caches keyed by mesh shape must not
leak from one rank's build into the next one's, nor into the estimator, which creates its own group.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from torchtitan.config.job_config import JobConfig
from torchtitan.config.resolve import Resolved
from torchtitan.estimation.forked import in_child

GIB = 1024**3
# AdamW and Adam (the only optimizers, components/optimizer.py) keep two moments shaped and typed as the parameter,
# plus a float32 step counter per parameter.
_MOMENTS = 2
_STEP_BYTES = 4


# ---- layout ---------------------------------------------------------------------------------------------------
def layout(cfg: JobConfig, resolved: Resolved, world_size: int, target: str = "cuda") -> dict:
    """Every mesh dimension and derived view with its size, the data-parallel flavour and the batch arithmetic."""
    from torchtitan.tools.device import training_param_dtype
    pd = resolved.parallel_dims
    mesh = {d: getattr(pd, d) for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    # The flattened views ParallelDims.build_mesh creates, with what each is for.
    views = {"dp": pd.dp_degree, "dp_shard_cp": pd.fsdp_degree, "dp_cp": pd.loss_degree}
    if pd.tp > 1:
        views["dp_shard_cp_tp"] = pd.fsdp_degree * pd.tp
        views["dp_cp_tp"] = pd.loss_degree * pd.tp
    if pd.ep > 1:
        views["ep"] = pd.ep
        views["efsdp"] = pd.efsdp
    if pd.ddp_enabled:
        data = f"DDP over {pd.dp_replicate} replicas"
    elif pd.hsdp_enabled:
        data = f"HSDP: {pd.dp_replicate} replicas x FSDP over {pd.fsdp_degree} ranks"
    elif pd.fsdp_enabled:
        data = f"FSDP over {pd.fsdp_degree} ranks"
    else:
        data = "none (every rank of a tp / pp group holds the whole of its parameters)"
    t = cfg.training
    out = {
        "world_size": world_size, "mesh": mesh, "views": views, "data_parallel": data,
        "loss_parallel": pd.loss_parallel_enabled(cfg.parallelism.disable_loss_parallel),
        "activation_checkpoint": cfg.activation_checkpoint.mode,
        "param_dtype": training_param_dtype(t.mixed_precision_param, target),
        "global_batch_size": t.global_batch_size, "local_batch_size": t.local_batch_size, "seq_len": t.seq_len,
        "grad_accum_steps": resolved.grad_accum_steps, "tokens_per_step": t.global_batch_size * t.seq_len,
    }
    if resolved.pipeline is not None:
        out["pp_microbatches"] = resolved.pipeline.n_microbatches(t.local_batch_size)
        out["pp_microbatch_size"] = resolved.pipeline.microbatch_size
    return out


def representative_ranks(resolved: Resolved, world_size: int) -> list[int]:
    """The first rank of every pipeline rank (pp is the outermost mesh dimension), or rank 0 without one."""
    pp = resolved.parallel_dims.pp
    return [r * (world_size // pp) for r in range(pp)]


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 63, 64] -> '0-2,63-64' (an interleaved schedule's rank holds blocks from far apart stages)."""
    spans, start = [], numbers[0]
    for prev, cur in zip(numbers, [*numbers[1:], None], strict=True):
        if cur != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(spans)


def _short_fqns(fqns) -> str:
    """('tok_embeddings', 'layers.0', ..., 'layers.14') -> 'tok_embeddings, layers.0-14 (15 blocks)'."""
    blocks = [int(f.split(".")[1]) for f in fqns if f.startswith("layers.")]
    others = [f for f in fqns if not f.startswith("layers.")]
    head = [f for f in others if fqns.index(f) < (fqns.index(f"layers.{blocks[0]}") if blocks else len(fqns))]
    tail = [f for f in others if f not in head]
    parts = list(head)
    if blocks:
        span = f"layers.{blocks[0]}" if len(blocks) == 1 else f"layers.{blocks[0]}-{blocks[-1]}"
        parts.append(f"{span} ({len(blocks)} block{'s' if len(blocks) > 1 else ''})")
    return ", ".join(parts + tail)


def stage_split(resolved: Resolved, world_size: int) -> dict | None:
    """Which modules each stage holds and which stages each pp rank runs (None without pipeline parallel)."""
    plan = resolved.pipeline
    if plan is None:
        return None
    per_group = world_size // plan.pp
    ranks = []
    for pp_rank in range(plan.pp):
        ranks.append({"pp_rank": pp_rank, "ranks": [pp_rank * per_group, (pp_rank + 1) * per_group - 1],
                      "stages": [{"stage": s, "modules": _short_fqns(plan.module_fqns[s]),
                                  "fqns": list(plan.module_fqns[s])} for s in plan.stage_ids(pp_rank)]})
    return {"schedule": plan.schedule, "num_stages": plan.num_stages, "pp_ranks": ranks}


# ---- per-rank parameters ----------------------------------------------------------------------------------------
@dataclass
class ParamRow:
    name: str
    """the parameter's name, with `layers.<a>-<b>` standing for that many identical blocks"""
    count: int
    """how many tensors the row stands for (blocks with the same shapes and placements)"""
    global_shape: list[int]
    local_shape: list[int]
    placements: str
    dtype: str
    local_bytes: int
    """bytes of one of those tensors on this rank"""


@dataclass
class RankParams:
    rank: int
    pp_rank: int
    stages: list[int]
    tensors: int = 0
    global_elements: int = 0
    local_elements: int = 0
    bytes: dict[str, int] = field(default_factory=dict)
    """parameters, gradients, optimizer_state held on this rank between steps"""
    rows: list[ParamRow] = field(default_factory=list)


def _placements(p) -> str:
    if not hasattr(p, "placements"):
        return "replicated (no DTensor)"
    names = p.device_mesh.mesh_dim_names or tuple(str(i) for i in range(p.device_mesh.ndim))
    return ", ".join(f"{n}:{pl}" for n, pl in zip(names, p.placements, strict=True))


def rank_params(cfg: JobConfig, resolved: Resolved, world_size: int, rank: int, device_type: str) -> RankParams:
    """The parameters `rank` holds after the trainer's parallelize code ran (call it in a child: see in_child)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.components.model_parts import canonical_name
    from torchtitan.estimation.engine import build_parallel_model

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        # ddp=False as in the estimator: DDP's reducer needs real storage; it does not change parameter shapes.
        parts, _, _ = build_parallel_model(cfg, resolved.parallel_dims, device_type, ddp=False,
                                           pipeline=resolved.pipeline)
        pp_rank = rank // (world_size // resolved.parallel_dims.pp)
        stages = list(resolved.pipeline.stage_ids(pp_rank)) if resolved.pipeline is not None else [0]
        out = RankParams(rank=rank, pp_rank=pp_rank, stages=stages)
        # Blocks are identical, so their parameters collapse into one row per (name in the block, shapes,
        # placements) with the block indices it covers: 126 blocks of 405B read as 9 rows, and a block whose
        # layout differs (it would not, but the table must not hide it) gets rows of its own.
        groups: dict[tuple, list[int]] = {}
        signatures: dict[tuple, tuple] = {}
        order: list[tuple] = []
        for part in parts:
            for name, p in part.named_parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                nbytes = local.numel() * local.element_size()
                out.tensors += 1
                out.global_elements += p.numel()
                out.local_elements += local.numel()
                out.bytes["parameters"] = out.bytes.get("parameters", 0) + nbytes
                if p.requires_grad:
                    # Gradients are reduced into the sharded parameter's dtype and layout (FSDP2, DTensor).
                    out.bytes["gradients"] = out.bytes.get("gradients", 0) + nbytes
                    out.bytes["optimizer_state"] = out.bytes.get("optimizer_state", 0) + _MOMENTS * nbytes + \
                        _STEP_BYTES
                name = canonical_name(name)
                match = re.match(r"layers\.(\d+)\.(.*)", name)
                block, rest = (int(match.group(1)), match.group(2)) if match else (None, name)
                sig = (list(p.shape), list(local.shape), _placements(p), str(p.dtype).removeprefix("torch."),
                       nbytes)
                key = (rest if block is not None else name, block is not None, repr(sig))
                if key not in groups:
                    groups[key], signatures[key] = [], sig
                    order.append(key)
                groups[key].append(block)
        for key in order:
            rest, is_block, _ = key
            blocks = groups[key]
            name = rest
            if is_block:
                name = f"layers.{_ranges(blocks)}.{rest}"
            g, loc, pl, dt, nb = signatures[key]
            out.rows.append(ParamRow(name, len(blocks), g, loc, pl, dt, nb))
        for k in ("parameters", "gradients", "optimizer_state"):
            out.bytes.setdefault(k, 0)
        return out
    finally:
        dist.destroy_process_group()


# ---- rendering --------------------------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB ({n:,} B)"


def render_layout(lay: dict) -> list[str]:
    m = lay["mesh"]
    lines = ["layout:",
             "  mesh (outer -> inner): " + " x ".join(f"{k} {v}" for k, v in m.items())
             + f" = {math.prod(m.values())} ranks",
             "  derived views: " + ", ".join(f"{k} {v}" for k, v in lay["views"].items()),
             f"  data parallel: {lay['data_parallel']}; tensor parallel {m['tp']}"
             f"{' (loss parallel)' if lay['loss_parallel'] else ''}; context parallel {m['cp']}; "
             f"activation checkpointing {lay['activation_checkpoint']}; compute dtype {lay['param_dtype']}",
             f"  batch: global {lay['global_batch_size']} sequences x {lay['seq_len']} tokens = "
             f"{lay['tokens_per_step']:,} tokens per step; local {lay['local_batch_size']} per data-parallel rank, "
             f"{lay['grad_accum_steps']} gradient accumulation step(s)"]
    if "pp_microbatches" in lay:
        lines.append(f"  pipeline micro-batches: {lay['pp_microbatches']} of {lay['pp_microbatch_size']} "
                     "sequence(s) per local batch")
    return lines


def render_stages(split: dict | None) -> list[str]:
    if split is None:
        return ["pipeline: none (pp 1): every rank holds the whole model (sharded as below)"]
    lines = [f"pipeline: {split['num_stages']} stages, schedule {split['schedule']}"]
    for r in split["pp_ranks"]:
        stages = "; ".join(f"stage {s['stage']}: {s['modules']}" for s in r["stages"])
        lines.append(f"  pp rank {r['pp_rank']} (ranks {r['ranks'][0]}-{r['ranks'][1]}): {stages}")
    return lines


def render_params(rp: RankParams, n_pp: int) -> list[str]:
    where = f", pp rank {rp.pp_rank}, stage(s) {', '.join(map(str, rp.stages))}" if n_pp > 1 else ""
    lines = [f"parameters of rank {rp.rank}{where}: {rp.tensors} tensors, {rp.local_elements:,} elements on this "
             f"rank of {rp.global_elements:,} (identical blocks on one row, 'x N')"]
    width = max(len(r.name) for r in rp.rows)
    lines.append(f"  {'name':{width}s}  {'x':>4s}  {'global shape':16s}  {'local shape':14s}  {'dtype':8s}  "
                 f"{'bytes each':>12s}  placements")
    for r in rp.rows:
        lines.append(f"  {r.name:{width}s}  {r.count:4d}  {str(r.global_shape):16s}  {str(r.local_shape):14s}  "
                     f"{r.dtype:8s}  {r.local_bytes:12,d}  {r.placements}")
    b = rp.bytes
    total = sum(b.values())
    lines.append(f"  per rank: parameters {_gib(b['parameters'])}, gradients {_gib(b['gradients'])}, "
                 f"optimizer state {_gib(b['optimizer_state'])} (2 moments + step), total {total / GIB:.2f} GiB")
    return lines


# ---- the estimator's verdict ------------------------------------------------------------------------------------
def _call(fn, args: tuple):
    return fn(*args)


def in_children(calls: list[tuple], jobs: int = 1) -> list:
    """[fn(*args) for fn, args in calls], each in a forked child process of its own (as in_child), `jobs` at a
    time: the pipeline ranks' builds and estimates are independent, and a machine with two cores runs two at once."""
    if jobs <= 1 or len(calls) <= 1:
        return [in_child(fn, *args) for fn, args in calls]
    import multiprocessing as mp

    # One task per child (chunks of one): a rank's fake process group and DTensor's caches die with its child.
    with mp.get_context("fork").Pool(min(jobs, len(calls)), maxtasksperchild=1) as pool:
        return pool.starmap(_call, calls, chunksize=1)


def estimate_calls(cfg: JobConfig, world_size: int, ranks: list[int], target: str) -> list[tuple]:
    """The memory estimator's calls for `ranks` (one per pipeline rank), for in_children. Without pipeline parallel
    `estimate` traces 4 and 8 blocks and extrapolates (seconds even for 405B); under pipeline parallel it traces
    each pipeline rank's stages twice, made shallower, and extrapolates to the real split (see
    docs/memory_estimation.md)."""
    from torchtitan.estimation.engine import estimate

    return [(estimate, (cfg, world_size, r, target)) for r in ranks]


def verdict(estimates: list, capacity_gib: float, reserve_gib: float) -> dict:
    """The estimates of one rank per pipeline rank, the worst against the device."""
    per_rank = []
    for est in estimates:
        per_rank.append({"rank": est.rank, "peak_bytes": est.peak_bytes, "peak_phase": est.peak_phase,
                         "breakdown_bytes": est.breakdown, "steady_bytes": est.steady_bytes,
                         "extrapolated_from": est.extrapolated_from, "full_depth_reason": est.full_depth_reason,
                         "seconds": est.seconds})
    worst = max(per_rank, key=lambda e: e["peak_bytes"])
    from torchtitan.estimation.report import fits, needed_gib

    need = needed_gib(worst["peak_bytes"], reserve_gib)
    return {"per_rank": per_rank, "worst_rank": worst["rank"], "peak_gib": worst["peak_bytes"] / GIB,
            "capacity_gib": capacity_gib, "reserve_gib": reserve_gib, "needed_gib": need,
            "fits": fits(worst["peak_bytes"], capacity_gib, reserve_gib), "headroom_gib": capacity_gib - need}


def render_verdict(v: dict, device: str) -> list[str]:
    from torchtitan.estimation.report import depth_note

    lines = ["memory (the estimator's trace of one training step, per rank):"]
    for e in v["per_rank"]:
        how = depth_note(e["extrapolated_from"], e.get("full_depth_reason", ""))
        parts = ", ".join(f"{k} {n / GIB:.2f}" for k, n in e["breakdown_bytes"].items() if n)
        lines.append(f"  rank {e['rank']}: peak {e['peak_bytes'] / GIB:.2f} GiB during {e['peak_phase']} ({parts} "
                     f"GiB; {how}, {e['seconds']:.1f} s)")
    from torchtitan.estimation.report import GPU_ALLOCATOR_OVERHEAD

    grown = f" x {1 + GPU_ALLOCATOR_OVERHEAD:.3f} (allocator)" if v["reserve_gib"] > 0 else ""
    lines.append(f"verdict: {'FITS' if v['fits'] else 'DOES NOT FIT'} on {device}: peak {v['peak_gib']:.2f} GiB "
                 f"(rank {v['worst_rank']}){grown} + {v['reserve_gib']:.1f} GiB reserve = {v['needed_gib']:.2f} of "
                 f"{v['capacity_gib']:.1f} GiB, headroom {v['headroom_gib']:+.2f} GiB")
    return lines
