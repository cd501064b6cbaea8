"""A pipeline stage's step for the memory estimator: the schedule's own actions for this rank, run on fake tensors.

torch's pipeline stages infer shapes and exchange buffers with their neighbours at the first step, which fake
tensors and the fake process group cannot do (a data-dependent read). The memory a stage needs does not depend on
the neighbours' values, only on when each micro-batch's activations are created and freed, and the schedule says
that: `schedule.pipeline_order[pp rank]` of the multi-stage schedules lists this rank's forwards (F) and backwards
(B, or I then W for the zero-bubble schedules) in the order it runs them. This runs exactly that list on the rank's
own model parts: a forward keeps its activations until that micro-batch's backward, as the real stage does, so GPipe
keeps every micro-batch in flight and 1F1B at most the number of stages from its own to the last. (For the single-
stage schedules that list is only a drawing in torch 2.13 — its 1F1B numbers the second stage's forwards from 1 — so
their order is written out below, as their step runs it.) Like torch's stages, a non-first stage holds one receive
buffer per micro-batch for its inputs and a non-last stage one per micro-batch for its output gradients, allocated
at the first step and kept. A sent tensor lives until the schedule waits on its send, which torch's schedules do at
different times: the multi-stage runtime (Interleaved1F1B, LoopedBFS, the zero-bubble and V schedules) only at the
end of the step, so every output sent forward and every input gradient sent backward stays alive until then (one
activation-sized tensor per micro-batch and boundary: 5.25 MiB per rank in the interleaved accuracy test); GPipe
after its last backward (the input gradients); 1F1B at its next send (an input gradient of the cool-down outlives
the next backward); a CSV run by PipelineScheduleMulti at once.

A zero-bubble input-gradient action (I) and weight-gradient action (W) run torch's own split of the backward
(`stage_backward_input` / `stage_backward_weight`, as its stage does), so what an I keeps alive until its W is the
real thing; the first stage does all of its backward at W, as torch's does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchtitan.distributed.pipeline_parallel import SINGLE_STAGE_SCHEDULES, Pipeline, PipelinePlan
from torchtitan.distributed.tensor_parallel import local_value


class PipelineActions:
    """Stands in for a Pipeline in components/step.py's forward_backward_step (same interface)."""

    def __init__(self, pipeline: Pipeline, n_microbatches: int, hidden_shape: tuple[int, ...],
                 hidden_dtype: torch.dtype, on_action: Callable[[str, int, int, str], None] | None = None):
        """`hidden_shape` is one pipeline micro-batch's activation between stages, as this rank holds it
        ([micro-batch, seq_len / cp / tp: its context-parallel share, cut again by sequence parallel, dim]).
        `on_action(kind, stage, micro-batch, region)` is told at every action (kind: forward, loss, backward,
        backward input, backward weight) and, within it, when the stage's blocks start and end (region "",
        "blocks", "after blocks"). The estimator keeps a peak per (action, region): depth extrapolation needs each
        to be affine in the stage's depth, which the step's overall peak is not (whether the embedding's
        backward or the top block's holds the peak can change with depth)."""
        self.pipeline, self.loss_fn = pipeline, pipeline.loss_fn
        self.on_action = on_action or (lambda kind, stage, micro, region: None)
        self.action: tuple[str, int, int] = ("", 0, 0)
        self.parts = dict(zip(pipeline.stage_ids, pipeline.parts, strict=True))
        self.last = pipeline.plan.num_stages - 1
        n = n_microbatches
        self.order = _single_stage_order(pipeline.plan.schedule, pipeline.stage_ids[0], self.last + 1, n) \
            if pipeline.plan.schedule in SINGLE_STAGE_SCHEDULES else \
            [(a.computation_type, a.stage_index, a.microbatch_index)
             for action in pipeline.schedule.pipeline_order[pipeline.pp_rank] if action is not None
             for a in (action.sub_actions or (action,))]  # DualPipeV's overlapped F+B: its F, then its B
        # torch's stages allocate these at their first step and keep them (stage.py, _prepare_*_infra).
        self.input_buffers = {(s, m): torch.empty(hidden_shape, dtype=hidden_dtype)
                              for s in self.parts if s != 0 for m in range(n)}
        self.grad_buffers = {(s, m): torch.empty(hidden_shape, dtype=hidden_dtype)
                             for s in self.parts if s != self.last for m in range(n)}
        self.send_wait = _send_wait(pipeline)
        self.n_microbatches = n
        schedule = pipeline.schedule
        stages = schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]
        self.torch_stages = {stage.stage_index: stage for stage in stages}
        for part in self.parts.values():
            self._hook_block_region(part)

    def _region(self, region: str) -> None:
        self.on_action(*self.action, region)

    def _hook_block_region(self, part) -> None:
        """Tell `on_action` where the part's blocks start and end, in forward and (by gradient hooks on the blocks'
        inputs and outputs) in backward. It is also told after every block (the same region again): the tracker
        then re-measures there (tracker.py's set_phase), so it sees FSDP's resharding, a `resize_` outside the
        dispatcher, right after each block rather than at whichever op its every-256-ops check falls on, which
        moves with depth and would make the peaks jitter by a block's gathered parameters. Hooks on the blocks'
        outer modules do not fire in activation checkpointing's recomputation, and hold no tensors."""
        blocks = list(part.layers.values()) if getattr(part, "layers", None) is not None else []

        def first_pre(module, args, kwargs):
            self._region("blocks")
            if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                args[0].register_hook(lambda grad: self._region("after blocks"))

        def post(module, args, kwargs, out, region: str):
            self._region(region)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: self._region("blocks"))

        if blocks:  # prepended: the region starts before FSDP's pre-forward hook gathers the first block
            blocks[0].register_forward_pre_hook(first_pre, prepend=True, with_kwargs=True)
        for i, block in enumerate(blocks):  # after FSDP's post-forward hook, which reshards the block
            region = "after blocks" if i == len(blocks) - 1 else "blocks"
            block.register_forward_hook(functools.partial(post, region=region), with_kwargs=True)

    def _sends_forward(self, stage: int) -> bool:
        return stage != self.last and stage + 1 not in self.parts  # a neighbour on this rank gets it without a send

    def _sends_backward(self, stage: int) -> bool:
        return stage != 0 and stage - 1 not in self.parts

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, global_tokens: torch.Tensor,
                         model_kwargs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        from torch.distributed.pipelining.schedules import _ComputationType as Kind

        self.loss_fn.global_tokens = global_tokens
        names = {Kind.FORWARD: "forward", Kind.FULL_BACKWARD: "backward", Kind.BACKWARD_INPUT: "backward input",
                 Kind.BACKWARD_WEIGHT: "backward weight"}
        mb = self.pipeline.plan.microbatch_size
        in_flight: dict[tuple[int, int], tuple] = {}
        awaiting_weight: dict[tuple[int, int], tuple] = {}  # I done, W to come: what torch's stage keeps meanwhile
        backwards_done = dict.fromkeys(self.parts, 0)
        held: list[torch.Tensor] = []  # sent tensors whose send the schedule has not waited on yet
        last_forward = max((i for i, (kind, _, _) in enumerate(self.order) if kind == Kind.FORWARD), default=-1)
        total = torch.zeros(())
        for i, (kind, stage, m) in enumerate(self.order):
            key = (stage, m)
            self.action = (names[kind], stage, m)
            self._region("")
            if kind == Kind.FORWARD:
                if stage == 0:
                    x = inputs[m * mb:(m + 1) * mb]
                else:
                    x = self.input_buffers[key].detach().requires_grad_(True)
                kwargs = {k: v[m * mb:(m + 1) * mb] for k, v in (model_kwargs or {}).items()}
                if stage == self.last:  # the stage's output projection scores the labels: its output is the loss sum
                    kwargs["labels"] = labels[m * mb:(m + 1) * mb]
                out = self.parts[stage](x, **kwargs)
                loss = None
                if stage == self.last:
                    self.action = ("loss", stage, m)
                    self._region("")
                    loss = self.loss_fn(out, labels[m * mb:(m + 1) * mb])
                    total = total + local_value(loss.detach()).float().reshape(())  # as Pipeline sums them
                # The stage keeps its output (the loss sum, on the last stage) until the backward, as torch's does.
                in_flight[key] = (x, out, loss)
                if self.send_wait == "end" and self._sends_forward(stage):
                    held.append(out)
                continue
            # Backwards go through torch's own stage code (stage.py): the same split of I and W, and the same FSDP
            # handling (parameters stay unsharded and gradients unreduced until the stage's last backward).
            torch_stage = self.torch_stages[stage]
            if kind == Kind.BACKWARD_WEIGHT:
                x, out, loss, grad_out, param_groups = awaiting_weight.pop(key)
                if stage == 0:  # torch's first stage runs its whole backward at W (its input needs no gradient)
                    self._backward(torch_stage, "full", x, out, loss, grad_out)
                else:
                    torch_stage.backward_maybe_with_nosync(
                        "weight", {"stage_output": (loss if loss is not None else out,), "param_groups": param_groups},
                        last_backward=False)
                del x, out, loss, grad_out, param_groups
            else:
                x, out, loss = in_flight.pop(key)
                grad_out = None if loss is not None else self.grad_buffers[key]
                input_grad = None
                if kind == Kind.BACKWARD_INPUT:
                    param_groups = None
                    if stage != 0:
                        input_grad, param_groups = self._backward(torch_stage, "input", x, out, loss, grad_out)
                    # torch's stage keeps the stage output until W; on the last stage that is the loss, not the logits
                    awaiting_weight[key] = (x, out if loss is None else None, loss, grad_out, param_groups)
                else:
                    input_grad, _ = self._backward(torch_stage, "full", x, out, loss, grad_out)
                if self._sends_backward(stage):
                    if self.send_wait in ("end", "backward_end"):
                        held.append(input_grad)
                    elif self.send_wait == "next_send":
                        # 1F1B's cool-down: this gradient's send is waited on at the next one
                        held[:] = [input_grad] if i > last_forward else []
                del x, out, loss, grad_out, input_grad
                if kind == Kind.BACKWARD_INPUT:
                    continue
            backwards_done[stage] += 1
            if backwards_done[stage] == self.n_microbatches:
                torch_stage.perform_reduce_grad(1)  # the schedule's REDUCE_GRAD: FSDP's deferred post-backward
        return total

    @staticmethod
    def _backward(torch_stage, kind: str, x, out, loss, grad_out) -> tuple:
        """(input gradient, param groups) of torch's full or input backward of one micro-batch."""
        output = (out,) if loss is None else (loss,) if kind == "input" else loss  # as backward_one_chunk passes it
        result = torch_stage.backward_maybe_with_nosync(
            kind, {"stage_output": output,
                   "output_grads": None if loss is not None else (grad_out,), "input_values": (x,)},
            last_backward=False)
        grads, param_groups = result
        return (grads[0] if grads else None), param_groups


def _send_wait(pipeline: Pipeline) -> str:
    """When this rank's schedule waits on its sends: at the "end" of the step, at the end for the backward sends
    only ("backward_end"), at the "next_send", or "now"."""
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, _PipelineScheduleRuntime

    schedule = pipeline.schedule
    if isinstance(schedule, _PipelineScheduleRuntime):
        return "end"
    if isinstance(schedule, ScheduleGPipe):
        return "backward_end"  # its forward sends are waited on after the forwards; the outputs live on anyway
    return "next_send" if isinstance(schedule, Schedule1F1B) else "now"


def _single_stage_order(schedule: str, stage: int, num_stages: int, n: int) -> list[tuple]:
    """GPipe: every forward, then every backward. 1F1B: (num_stages - stage) forwards to fill the pipeline,
    then one backward and one forward in turn, then the remaining backwards."""
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    if schedule == "GPipe":
        return [(Kind.FORWARD, stage, m) for m in range(n)] + [(Kind.FULL_BACKWARD, stage, m) for m in range(n)]
    warmup = min(n, num_stages - stage)
    order = [(Kind.FORWARD, stage, m) for m in range(warmup)]
    for m in range(n):
        order.append((Kind.FULL_BACKWARD, stage, m))
        if warmup + m < n:
            order.append((Kind.FORWARD, stage, warmup + m))
    return order


# ---- depth extrapolation of pipeline stages ----------------------------------------------------------------------
# A stage's memory is affine in its number of blocks, as long as they are of one kind (see engine.estimate). Every
# stage of a plan is cut by the same number of blocks t, twice (t_low > t_high): the estimate is then affine in t
# along that line and extrapolates to t = 0, the real split. Cutting by the same number keeps an uneven split
# uneven by as much (a first or last stage a block lighter stays a block lighter), and keeps the schedule, the
# number of stages, the micro-batches and the first and last stages' modules as they are.

@dataclass(frozen=True)
class StageSamples:
    """Two shallower copies of a pipeline plan whose estimates extrapolate to the real one."""

    low: PipelinePlan
    high: PipelinePlan
    low_layers: int
    """blocks of the model `low` cuts (its stages' blocks, renumbered from 0)"""
    high_layers: int
    scale: float
    """the real estimate is low + (high - low) x scale"""


def stage_blocks(plan: PipelinePlan) -> list[int]:
    """Number of transformer blocks (`layers.<i>`) in each stage."""
    return [sum(name.startswith("layers.") for name in fqns) for fqns in plan.module_fqns]


def with_stage_blocks(plan: PipelinePlan, blocks: list[int]) -> PipelinePlan:
    """`plan` with `blocks[s]` blocks in stage s, numbered from 0 in forward order (a model of sum(blocks)
    blocks); every other module stays on its stage, in its place."""
    fqns, start = [], 0
    for stage, count in zip(plan.module_fqns, blocks, strict=True):
        first = next((i for i, n in enumerate(stage) if n.startswith("layers.")), len(stage))
        after = [n for n in stage[first:] if not n.startswith("layers.")]
        fqns.append((*stage[:first], *(f"layers.{i}" for i in range(start, start + count)), *after))
        start += count
    return dataclasses.replace(plan, module_fqns=tuple(fqns))


def layer_kinds(model_args, n_layers: int) -> list[bool]:
    """Which blocks of a model of `n_layers` blocks are of the second kind. Models whose blocks differ say so by
    `is_moe_layer(i)` (Qwen3: every decoder_sparse_step-th block; DeepSeek: all but the first n_dense_layers);
    tests/unit/test_memory_estimation.py checks, for every registered flavor, that blocks of one kind have the same
    parameters, so a model with another difference fails there rather than extrapolating wrongly."""
    is_moe = getattr(dataclasses.replace(model_args, n_layers=n_layers), "is_moe_layer", None)
    return [bool(is_moe(i)) if is_moe is not None else False for i in range(n_layers)]


def _by_stage(kinds: list[bool], blocks: list[int]) -> list[list[bool]]:
    out, start = [], 0
    for count in blocks:
        out.append(kinds[start:start + count])
        start += count
    return out


def sample_stage_depths(plan: PipelinePlan, model_args, stages: tuple[int, ...], every: int = 1,
                        min_blocks: int = 2) -> StageSamples | str:
    """Two shallower plans for `plan` (see above) to estimate the rank holding `stages`, or why every block must
    be traced. Only that rank's stages are cut: the others are not built on it.

    Stages that mix block kinds, or whose kind is not the model's usual one (DeepSeek's dense first blocks), keep
    their real depth; the others are cut by the same t, a multiple of `every` (the selective-AC interval, so each
    cut drops whole checkpointed groups) leaving at least `min_blocks`. The shallower models must give every kept
    stage its real kinds and every cut stage its one kind, or the result would be a different model."""
    blocks = stage_blocks(plan)
    real = _by_stage(layer_kinds(model_args, sum(blocks)), blocks)
    kinds = [k for stage in real for k in stage]
    usual = max(set(kinds), key=kinds.count)
    cuttable = [s for s in stages if real[s] and set(real[s]) == {usual}]
    if not cuttable:
        return "none of the rank's pipeline stages holds blocks of one kind only"
    full = sum(blocks[s] for s in stages)
    best = None
    for m in sorted({blocks[s] for s in cuttable}):
        t_low = (m - min_blocks) // every * every
        if t_low - every < 0:
            continue
        cut = [s for s in cuttable if blocks[s] >= m]
        traced = 2 * full - (2 * t_low - every) * len(cut)
        if best is None or traced < best[0]:
            best = (traced, t_low, cut)
    if best is None or best[0] >= full:
        return f"stages of at most {max(blocks[s] for s in stages)} blocks: tracing every block is cheaper than " \
            "two shallower traces"
    _, t_low, cut = best
    depths = [[n - t if s in cut else n for s, n in enumerate(blocks)] for t in (t_low, t_low - every)]
    for d in depths:
        for s, (want, got) in enumerate(zip(real, _by_stage(layer_kinds(model_args, sum(d)), d), strict=True)):
            if got != (want if s not in cut else [usual] * d[s]):
                return f"pipeline stage {s}'s block kinds (dense, mixture of experts) would change in a shallower model"
    low, high = depths
    return StageSamples(with_stage_blocks(plan, low), with_stage_blocks(plan, high), sum(low), sum(high),
                        t_low / every)
