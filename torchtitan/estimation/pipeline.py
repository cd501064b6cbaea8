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
at the first step and kept.

Known approximation: a zero-bubble input-gradient action (I) is run as a full backward and its weight-gradient
action (W) as nothing, so the activations a real I keeps alive until its W are not counted.
"""

from __future__ import annotations

import torch

from torchtitan.distributed.pipeline_parallel import SINGLE_STAGE_SCHEDULES, Pipeline


class PipelineActions:
    """Stands in for a Pipeline in components/step.py's forward_backward_step (same interface)."""

    def __init__(self, pipeline: Pipeline, n_microbatches: int, hidden_shape: tuple[int, ...],
                 hidden_dtype: torch.dtype):
        """`hidden_shape` is one pipeline micro-batch's activation between stages, as this rank holds it
        ([micro-batch, seq_len / tp with sequence parallel, dim])."""
        self.pipeline, self.loss_fn = pipeline, pipeline.loss_fn
        self.parts = dict(zip(pipeline.stage_ids, pipeline.parts, strict=True))
        self.last = pipeline.plan.num_stages - 1
        n = n_microbatches
        self.order = _single_stage_order(pipeline.plan.schedule, pipeline.stage_ids[0], self.last + 1, n) \
            if pipeline.plan.schedule in SINGLE_STAGE_SCHEDULES else \
            [(a.computation_type, a.stage_index, a.microbatch_index)
             for a in pipeline.schedule.pipeline_order[pipeline.pp_rank] if a is not None]
        # torch's stages allocate these at their first step and keep them (stage.py, _prepare_*_infra).
        self.input_buffers = {(s, m): torch.empty(hidden_shape, dtype=hidden_dtype)
                              for s in self.parts if s != 0 for m in range(n)}
        self.grad_buffers = {(s, m): torch.empty(hidden_shape, dtype=hidden_dtype)
                             for s in self.parts if s != self.last for m in range(n)}

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, global_tokens: torch.Tensor
                         ) -> torch.Tensor:
        from torch.distributed.pipelining.schedules import _ComputationType as Kind

        self.loss_fn.global_tokens = global_tokens

        mb = self.pipeline.plan.microbatch_size
        in_flight: dict[tuple[int, int], torch.Tensor] = {}
        total = torch.zeros(())
        for kind, stage, m in self.order:
            key = (stage, m)
            if kind == Kind.FORWARD:
                if stage == 0:
                    x = inputs[m * mb:(m + 1) * mb]
                else:
                    x = self.input_buffers[key].detach().requires_grad_(True)
                out = self.parts[stage](x)
                loss = None
                if stage == self.last:
                    loss = self.loss_fn(out, labels[m * mb:(m + 1) * mb])
                    total = total + loss.detach()
                # The stage keeps its output (the logits, on the last stage) until the backward, as torch's does.
                in_flight[key] = (out, loss)
            elif kind in (Kind.FULL_BACKWARD, Kind.BACKWARD_INPUT):
                out, loss = in_flight.pop(key)
                if loss is not None:
                    loss.backward()
                else:
                    out.backward(self.grad_buffers[key])
                del out, loss
        return total


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
