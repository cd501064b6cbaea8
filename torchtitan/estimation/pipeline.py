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

import torch

from torchtitan.distributed.pipeline_parallel import SINGLE_STAGE_SCHEDULES, Pipeline
from torchtitan.distributed.tensor_parallel import local_value


class PipelineActions:
    """Stands in for a Pipeline in components/step.py's forward_backward_step (same interface)."""

    def __init__(self, pipeline: Pipeline, n_microbatches: int, hidden_shape: tuple[int, ...],
                 hidden_dtype: torch.dtype):
        """`hidden_shape` is one pipeline micro-batch's activation between stages, as this rank holds it
        ([micro-batch, seq_len / cp / tp: its context-parallel share, cut again by sequence parallel, dim])."""
        self.pipeline, self.loss_fn = pipeline, pipeline.loss_fn
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

    def _sends_forward(self, stage: int) -> bool:
        return stage != self.last and stage + 1 not in self.parts  # a neighbour on this rank gets it without a send

    def _sends_backward(self, stage: int) -> bool:
        return stage != 0 and stage - 1 not in self.parts

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, global_tokens: torch.Tensor,
                         model_kwargs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        from torch.distributed.pipelining.schedules import _ComputationType as Kind

        self.loss_fn.global_tokens = global_tokens

        mb = self.pipeline.plan.microbatch_size
        in_flight: dict[tuple[int, int], tuple] = {}
        awaiting_weight: dict[tuple[int, int], tuple] = {}  # I done, W to come: what torch's stage keeps meanwhile
        backwards_done = dict.fromkeys(self.parts, 0)
        held: list[torch.Tensor] = []  # sent tensors whose send the schedule has not waited on yet
        last_forward = max((i for i, (kind, _, _) in enumerate(self.order) if kind == Kind.FORWARD), default=-1)
        total = torch.zeros(())
        for i, (kind, stage, m) in enumerate(self.order):
            key = (stage, m)
            if kind == Kind.FORWARD:
                if stage == 0:
                    x = inputs[m * mb:(m + 1) * mb]
                else:
                    x = self.input_buffers[key].detach().requires_grad_(True)
                out = self.parts[stage](x, **{k: v[m * mb:(m + 1) * mb] for k, v in (model_kwargs or {}).items()})
                loss = None
                if stage == self.last:
                    loss = self.loss_fn(out, labels[m * mb:(m + 1) * mb])
                    total = total + local_value(loss.detach()).float().reshape(())  # as Pipeline sums them
                # The stage keeps its output (the logits, on the last stage) until the backward, as torch's does.
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
