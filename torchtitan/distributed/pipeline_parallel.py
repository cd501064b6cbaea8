"""Pipeline parallel: cut the model into stages by module name, place the stages on the pp ranks, run a schedule.

A stage is a deep copy of the (meta) model with every module outside the stage deleted, so each stage keeps the
whole model's parameter names (FQNs): checkpoints of any pipeline layout load into any other (docs/parallelism.md).
Everything that can be wrong with a pipeline layout (schedule name, CSV file, stage split, micro-batch count) is
found by `plan_pipeline`, from the config alone, before any process group exists. The stages and schedules
themselves come from `torch.distributed.pipelining`; what is ours is the split, the placement and the loss
normalisation (the schedule never scales gradients: the loss is already divided by the global token count).
"""

from __future__ import annotations

import copy
import csv
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where it is used: config checks (plan_pipeline) run without it
    import torch
    import torch.nn as nn

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
"""one stage per rank"""
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""several (virtual) stages per rank"""
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""exactly two stages per rank, placed in a V: rank r holds stages r and 2 x pp - 1 - r"""
CSV_SCHEDULES = ("PipelineScheduleMulti", "_PipelineScheduleRuntime")
"""schedule names that take their actions from parallelism.pipeline_parallel_schedule_csv"""
SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES + CSV_SCHEDULES


def _err(msg: str) -> None:
    raise ConfigError(msg)


@dataclass(frozen=True)
class PipelinePlan:
    """Where every stage lives and how the schedule runs; the same on every rank."""

    pp: int
    """pipeline-parallel degree (ranks in one pipeline)"""
    schedule: str
    """schedule name (a key of SCHEDULES)"""
    csv_path: str
    """custom schedule file ("" = the named schedule's own actions)"""
    module_fqns: tuple[tuple[str, ...], ...]
    """module names of each stage, stage 0 first"""
    stage_ids_by_rank: tuple[tuple[int, ...], ...]
    """the stages each pp rank holds, in the order its model parts are built"""
    microbatch_size: int
    """sequences per pipeline micro-batch"""

    @property
    def num_stages(self) -> int:
        return len(self.module_fqns)

    def stage_ids(self, pp_rank: int) -> tuple[int, ...]:
        return self.stage_ids_by_rank[pp_rank]

    def n_microbatches(self, local_batch_size: int) -> int:
        return local_batch_size // self.microbatch_size


def stage_fqn_units(n_layers: int, input_fqns: tuple[str, ...], output_fqns: tuple[str, ...]) -> list[str]:
    """Every module name a stage can hold, in forward order."""
    return [*input_fqns, *(f"layers.{i}" for i in range(n_layers)), *output_fqns]


def split_evenly(n_layers: int, num_stages: int, input_fqns: tuple[str, ...] = ("tok_embeddings",),
                 output_fqns: tuple[str, ...] = ("norm", "output"), input_weight: float = 1.0,
                 output_weight: float = 1.0) -> list[list[str]]:
    """Contiguous stages such that the most loaded stage is as light as possible, counting the embedding as
    `input_weight` blocks (on the first stage, with at least one block) and the final norm + output as
    `output_weight` blocks (on the last stage, which may hold them alone). Among the splits with that lightest
    maximum, earlier stages are kept lighter: under 1F1B stage s holds pp - s micro-batches of activations.
    """
    if num_stages > n_layers + 1:
        _err(f"parallelism: {num_stages} pipeline stages but the model has only {n_layers} transformer blocks "
             "(every stage needs at least one, the last may hold the output alone)")
    # units a stage boundary may fall between: embedding + block 0, blocks 1 .. n-1, norm + output
    costs = [input_weight + 1.0, *([1.0] * (n_layers - 1)), output_weight]
    n = len(costs)
    tol = 1e-9

    def stages_needed(start: int, cap: float) -> int:
        count, load = 1, 0.0
        for c in costs[start:]:
            if load + c > cap + tol and load > 0:
                count, load = count + 1, 0.0
            load += c
        return count

    sums = sorted({sum(costs[i:j]) for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(sums) - 1  # the lightest maximum is one of the contiguous sums
    while lo < hi:
        mid = (lo + hi) // 2
        if sums[mid] + tol >= max(costs) and stages_needed(0, sums[mid]) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    cap = sums[lo]
    bounds, start = [0], 0
    for stage in range(num_stages - 1):
        left = num_stages - stage - 1
        end = start + 1
        while not (n - end >= left and stages_needed(end, cap) <= left):
            end += 1
        bounds.append(end)
        start = end
    bounds.append(n)
    fqns = []
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        blocks = [f"layers.{i}" for i in range(a, min(b, n_layers))]
        fqns.append([*(input_fqns if s == 0 else ()), *blocks, *(output_fqns if b == n else ())])
    return fqns


def _check_explicit_fqns(fqns: list[list[str]], units: list[str]) -> None:
    key = "parallelism.module_fqns_per_model_part"
    seen = [name for part in fqns for name in part]
    unknown = [name for name in seen if name not in units]
    if unknown:
        _err(f"{key}: unknown module '{unknown[0]}'; the model has {units[0]}, layers.0 .. "
             f"layers.{len(units) - 4}, {', '.join(units[-2:])}" if len(units) > 3 else f"{key}: unknown module "
             f"'{unknown[0]}'")
    duplicated = sorted({name for name in seen if seen.count(name) > 1})
    if duplicated:
        _err(f"{key}: '{duplicated[0]}' is listed in more than one model part")
    missing = [name for name in units if name not in seen]
    if missing:
        _err(f"{key}: module '{missing[0]}' is in no model part (every module must be in exactly one)")
    if seen != units:
        _err(f"{key}: modules must be listed in forward order, stage after stage ({' '.join(units[:4])} ...)")
    empty = [i for i, part in enumerate(fqns) if not part]
    if empty:
        _err(f"{key}: model part {empty[0]} is empty")


def _csv_stage_ids(path: str, pp: int) -> tuple[tuple[tuple[int, ...], ...], int]:
    """(stages of each rank, micro-batch count) read from a compute-only schedule CSV (one row per rank)."""
    from torch.distributed.pipelining.schedules import _Action

    key = "parallelism.pipeline_parallel_schedule_csv"
    if not Path(path).is_file():
        _err(f"{key}: file not found: {path}")
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f)]
    if len(rows) != pp:
        _err(f"{key}: {path} has {len(rows)} rows but pipeline_parallel_degree is {pp} (one row per rank)")
    stages, microbatches = [], set()
    for rank, row in enumerate(rows):
        mine: list[int] = []
        for text in row:
            if not text.strip():
                continue
            try:
                action = _Action.from_str(text.strip())
            except (RuntimeError, ValueError) as e:
                _err(f"{key}: {path} row {rank + 1}: cannot read action '{text.strip()}': {e}")
            if action is None:
                continue
            if action.stage_index not in mine:
                mine.append(action.stage_index)
            if action.microbatch_index is not None:
                microbatches.add(action.microbatch_index)
        stages.append(tuple(sorted(mine)))
    return tuple(stages), len(microbatches)


def _check_csv_schedule(path: str, pp: int, num_stages: int, n_microbatches: int) -> None:
    """torch's own check of a compute-only schedule (every micro-batch forward and backward on every stage), run
    here so a bad file fails before any process group."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType, _validate_schedule

    compute = {_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT,
               _ComputationType.BACKWARD_WEIGHT}
    with open(path, newline="") as f:
        actions = {rank: [_Action.from_str(t.strip()) for t in row if t.strip()]
                   for rank, row in enumerate(csv.reader(f))}
    for rank, row in actions.items():
        for action in row:
            if action is not None and action.computation_type not in compute:
                _err(f"parallelism.pipeline_parallel_schedule_csv: {path} row {rank + 1}: '{action}' is not a "
                     "compute action (F, B, I, W): the file must be compute-only")
    try:
        _validate_schedule(actions, pp, num_stages, n_microbatches)
    except (AssertionError, ValueError, RuntimeError) as e:
        _err(f"parallelism.pipeline_parallel_schedule_csv: {path}: {' '.join(str(e).split())}")


def plan_pipeline(p, n_layers: int, local_batch_sizes: dict[str, int], tied_embeddings: bool,
                  input_fqns: tuple[str, ...] = ("tok_embeddings",),
                  output_fqns: tuple[str, ...] = ("norm", "output"),
                  unit_weights: tuple[float, float] = (1.0, 1.0)) -> PipelinePlan:
    """The pipeline layout `p` (config section `parallelism`) asks for, or a ConfigError naming the key.

    `local_batch_sizes` maps config keys to the batches the schedule runs (training.local_batch_size);
    `unit_weights` is the cost of the input and of the output modules in blocks, for the automatic split."""
    pp, name = p.pipeline_parallel_degree, p.pipeline_parallel_schedule
    if name not in SCHEDULES:
        _err(f"parallelism.pipeline_parallel_schedule: '{name}' is not one of {', '.join(SCHEDULES)}")
    if tied_embeddings:
        _err("parallelism.pipeline_parallel_degree: the model ties its embedding and output weights, which would "
             "then live on two stages; pick an untied flavor for pipeline parallel")
    if p.pipeline_parallel_microbatch_size < 1:
        _err(f"parallelism.pipeline_parallel_microbatch_size: must be >= 1, got {p.pipeline_parallel_microbatch_size}")
    csv_path = p.pipeline_parallel_schedule_csv
    if bool(csv_path) != (name in CSV_SCHEDULES):
        _err("parallelism.pipeline_parallel_schedule_csv: a custom schedule file goes with pipeline_parallel_schedule "
             f"= {' or '.join(CSV_SCHEDULES)}, and only with those (schedule '{name}', file '{csv_path}')")
    units = stage_fqn_units(n_layers, input_fqns, output_fqns)
    csv_stages, csv_microbatches = _csv_stage_ids(csv_path, pp) if csv_path else (None, 0)

    if p.module_fqns_per_model_part is not None:
        if p.pipeline_parallel_layers_per_stage is not None:
            _err("parallelism.module_fqns_per_model_part: set it or pipeline_parallel_layers_per_stage, not both")
        fqns = [list(part) for part in p.module_fqns_per_model_part]
        _check_explicit_fqns(fqns, units)
    elif p.pipeline_parallel_layers_per_stage is not None:
        per = p.pipeline_parallel_layers_per_stage
        if per < 1 or n_layers % per:
            _err(f"parallelism.pipeline_parallel_layers_per_stage={per} does not divide the model's {n_layers} "
                 "transformer blocks")
        count = n_layers // per
        fqns = [[*(input_fqns if s == 0 else ()), *(f"layers.{i}" for i in range(s * per, (s + 1) * per)),
                 *(output_fqns if s == count - 1 else ())] for s in range(count)]
    else:
        if csv_stages is not None:
            count = 1 + max((s for rank in csv_stages for s in rank), default=0)
        else:
            count = pp * (1 if name in SINGLE_STAGE_SCHEDULES else 2)
        fqns = split_evenly(n_layers, count, input_fqns, output_fqns, *unit_weights)
    num_stages = len(fqns)

    what = ("parallelism.module_fqns_per_model_part" if p.module_fqns_per_model_part is not None
            else "parallelism.pipeline_parallel_schedule_csv" if csv_path
            else "parallelism.pipeline_parallel_layers_per_stage")
    if num_stages % pp:
        _err(f"{what}: {num_stages} stages do not spread evenly over pipeline_parallel_degree={pp}")
    per_rank = num_stages // pp
    if name in SINGLE_STAGE_SCHEDULES and per_rank != 1:
        _err(f"parallelism.pipeline_parallel_schedule={name} runs one stage per rank, but {what} gives {num_stages} "
             f"stages for {pp} ranks; use a multi-stage schedule ({', '.join(MULTI_STAGE_SCHEDULES)})")
    if name in V_SCHEDULES and per_rank != 2:
        _err(f"parallelism.pipeline_parallel_schedule={name} needs exactly 2 stages per rank (a V), but there are "
             f"{num_stages} stages for {pp} ranks")
    if name in V_SCHEDULES:
        by_rank = tuple((r, 2 * pp - 1 - r) for r in range(pp))
    elif csv_stages is not None:
        by_rank = csv_stages
        if sorted(s for rank in by_rank for s in rank) != list(range(num_stages)):
            _err(f"parallelism.pipeline_parallel_schedule_csv: {csv_path} does not run each of the {num_stages} "
                 "stages on exactly one rank")
    else:
        by_rank = tuple(tuple(r + pp * v for v in range(per_rank)) for r in range(pp))

    mb = p.pipeline_parallel_microbatch_size
    for key, batch in local_batch_sizes.items():
        if batch % mb:
            _err(f"parallelism.pipeline_parallel_microbatch_size={mb} does not divide {key}={batch}")
        n = batch // mb
        if n < num_stages:
            _err(f"{key}={batch} gives {n} pipeline micro-batches of {mb} (pipeline_parallel_microbatch_size), fewer "
                 f"than the {num_stages} pipeline stages: the pipeline would never fill")
        if csv_stages is not None and n != csv_microbatches:
            _err(f"parallelism.pipeline_parallel_schedule_csv: {csv_path} schedules {csv_microbatches} micro-batches "
                 f"but {key}={batch} gives {n}")
        rounds = max(1, n // pp)
        if name in ("Interleaved1F1B", "InterleavedZeroBubble") and n % rounds:
            _err(f"{key}={batch} gives {n} pipeline micro-batches; {name} runs them in rounds of "
                 f"pipeline_parallel_degree={pp} and needs a multiple of the {rounds} rounds (multiples of {pp} work)")
    if csv_path:
        _check_csv_schedule(csv_path, pp, num_stages, csv_microbatches)
    return PipelinePlan(pp=pp, schedule=name, csv_path=csv_path, module_fqns=tuple(tuple(f) for f in fqns),
                        stage_ids_by_rank=by_rank, microbatch_size=mb)


def split_model(model: nn.Module, keep: tuple[str, ...] | list[str]) -> nn.Module:
    """A copy of `model` holding only the modules named in `keep` (top-level names, or `layers.<i>` entries of a
    ModuleDict); the others are deleted (ModuleDict entries) or set to None. Call it on the meta model: the copy
    costs nothing there. Parameter names of the kept modules are unchanged."""
    import torch.nn as nn

    part = copy.deepcopy(model)
    keep = set(keep)
    for name, child in list(part.named_children()):
        if isinstance(child, nn.ModuleDict):
            for key in list(child.keys()):
                if f"{name}.{key}" not in keep:
                    del child[key]
        elif name not in keep:
            setattr(part, name, None)
    return part


def _local_output(module, inputs, output):
    # Tensor parallel leaves a block's output as a sequence-sharded DTensor; a stage sends plain tensors. The next
    # stage's first norm (sequence parallel) takes the local shard back as Shard(1) (torchtitan/distributed/
    # tensor_parallel.py), and the backward of to_local() turns the received gradient into a DTensor again.
    # to_local() returns a view, which torch's input-gradient backward (zero-bubble schedules) cannot detach in
    # place: the copy makes it a tensor of its own (one activation per micro-batch; the DTensor's is freed).
    from torch.distributed.tensor import DTensor

    return output.to_local().clone() if isinstance(output, DTensor) else output


class ScaledLoss:
    """The schedule's loss: the last stage's output, the loss sum over a pipeline micro-batch (the stage's output
    projection scores the labels it is handed, torchtitan/models/decoder.py), divided by the step's global token
    count (set before each step), so the schedule never scales gradients and they equal the 1-process ones."""

    def __init__(self):
        self.global_tokens: torch.Tensor | None = None

    def __call__(self, loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_sum / self.global_tokens


class Pipeline:
    """This rank's stages, the training schedule over them, and a forward-only walk for validation."""

    def __init__(self, plan: PipelinePlan, parts: list[nn.Module], pp_mesh, device: torch.device,
                 local_batch_size: int):
        """`parts` are this rank's model parts in plan.stage_ids(pp rank) order, materialised and parallelized."""
        self.plan, self.parts, self.pp_mesh, self.device = plan, parts, pp_mesh, device
        self.loss_fn = ScaledLoss()
        self.pp_rank = pp_mesh.get_local_rank()
        self.stage_ids = plan.stage_ids(self.pp_rank)
        self.has_first = 0 in self.stage_ids
        self.has_last = plan.num_stages - 1 in self.stage_ids
        for stage_id, part in zip(self.stage_ids, parts, strict=True):
            if stage_id != plan.num_stages - 1:
                part.register_forward_hook(_local_output)
        self.schedule = self._build(plan.n_microbatches(local_batch_size), self.loss_fn)

    def _build(self, n_microbatches: int, loss_fn):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleSingle,
            _PipelineScheduleRuntime,
            get_schedule_class,
        )

        from torchtitan.models.moe import no_token_counting

        class Stage(PipelineStage):
            def _prepare_forward_infra(self, *args, **kwargs):
                # On the first step torch runs each stage once to infer its shapes (torch 2.13: with gradients, on
                # the first micro-batch or on uninitialised inputs). MoE layers must not count those tokens in
                # their expert load (torchtitan/components/moe_balance.py).
                with no_token_counting():
                    return super()._prepare_forward_infra(*args, **kwargs)

        group = self.pp_mesh.get_group()
        stages = [Stage(part, stage_id, self.plan.num_stages, self.device, group=group)
                  for stage_id, part in zip(self.stage_ids, self.parts, strict=True)]
        if self.plan.csv_path:
            schedule = _PipelineScheduleRuntime(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
            schedule._load_csv(self.plan.csv_path, format="compute_only")
            return schedule
        cls = get_schedule_class(self.plan.schedule)
        if issubclass(cls, PipelineScheduleSingle):
            return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, global_tokens: torch.Tensor,
                         model_kwargs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Forward and backward of one local batch through the schedule; returns this rank's sum of the scaled
        micro-batch losses (zero on ranks without the last stage). `model_kwargs` ([batch, ...] tensors, such as
        document masking's positions and document ids) are cut into the same micro-batches and reach every stage,
        so every rank passes them. So do the labels: every stage is handed them, the last one scores them."""
        import torch

        self.loss_fn.global_tokens = global_tokens

        from torchtitan.distributed.tensor_parallel import local_value  # loss parallel's losses are DTensors

        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        target = labels if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses if self.has_last else None, return_outputs=False,
                           labels=labels, **(model_kwargs or {}))
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([local_value(loss.detach()).float().reshape(()) for loss in losses]).sum()

    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor,
                      model_kwargs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Forward only (validation): the summed loss of a batch (zero on ranks without the last stage).

        Written out rather than a schedule's eval(): torch's multi-stage runtime fails forward-only on V
        placements (2.13: "can't steal_bwd_input if this stage doesn't have backward"), and validation needs
        no overlap. Every rank walks the same global order (micro-batch, then stage), so each receive meets its
        send: stage s-1's output goes to stage s's rank by point-to-point send on the pp group, preceded by a
        small header with its shape and dtype.
        """
        import torch
        import torch.distributed as dist

        from torchtitan.distributed.tensor_parallel import local_value

        group = self.pp_mesh.get_group()
        rank_of = {s: r for r, stages in enumerate(self.plan.stage_ids_by_rank) for s in stages}
        part_of = dict(zip(self.stage_ids, self.parts, strict=True))
        last = self.plan.num_stages - 1
        total = torch.zeros((), device=self.device)
        mb = self.plan.microbatch_size
        for start in range(0, inputs.shape[0], mb):
            held = None  # the previous stage's output when that stage ran on this rank
            for stage in range(self.plan.num_stages):
                if stage not in part_of:
                    held = None
                    continue
                if stage == 0:
                    x = inputs[start:start + mb]
                elif held is not None:
                    x = held
                else:
                    x = _recv(dist.get_global_rank(group, rank_of[stage - 1]), group, self.device)
                kwargs = {k: v[start:start + mb] for k, v in (model_kwargs or {}).items()}
                if stage == last:
                    kwargs["labels"] = labels[start:start + mb]
                out = part_of[stage](x, **kwargs)
                if stage == last:
                    total += local_value(out).float()
                elif rank_of[stage + 1] == self.pp_rank:
                    held = out
                else:
                    _send(out, dist.get_global_rank(group, rank_of[stage + 1]), group)
                    held = None
        return total


_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64")


def _send(t, dst: int, group) -> None:
    import torch
    import torch.distributed as dist

    t = t.contiguous()
    header = torch.zeros(10, dtype=torch.int64, device=t.device)
    header[0], header[1] = t.dim(), _DTYPES.index(str(t.dtype).removeprefix("torch."))
    header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header, dst, group=group)
    dist.send(t, dst, group=group)


def _recv(src: int, group, device):
    import torch
    import torch.distributed as dist

    header = torch.zeros(10, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    ndim, dtype = int(header[0]), getattr(torch, _DTYPES[int(header[1])])
    t = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(t, src, group=group)
    return t
