"""One optimizer step over a list of micro-batches: the code the trainer runs and the memory estimator traces.

Kept outside the Trainer so the estimator (torchtitan/estimation) follows exactly what training does.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch

from torchtitan.distributed.fsdp import set_gradient_sync
from torchtitan.distributed.tensor_parallel import local_value, loss_parallel_context
from torchtitan.distributed.utils import clip_grads_, total_grad_norm


def forward_backward_step(
    model_parts: list[torch.nn.Module],
    optimizer,
    microbatches: list[dict[str, torch.Tensor]],
    global_tokens: torch.Tensor,
    *,
    max_norm: float,
    device: torch.device,
    autocast=None,
    loss_parallel: bool = False,
    pipeline=None,
    pp_mesh=None,
    on_phase: Callable[[str, int | None], None] | None = None,
    should_step: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
    after_optimizer_step: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward every micro-batch, clip, step. Returns (local loss sum, grad norm before clipping).

    A micro-batch is a dict: "tokens" and "labels", and the model's other inputs by keyword ("positions",
    "document_ids" with document masking; torchtitan/data/dataloader.py).

    The model computes the loss sum itself from the labels (its output projection scores the tokens in chunks,
    torchtitan/models/decoder.py). Every rank divides its loss sum by the same global token count, so summed
    gradients equal the 1-process gradient. With `pipeline` (torchtitan/distributed/pipeline_parallel.py) each
    micro-batch runs through the pipeline schedule, which cuts it again into pipeline micro-batches; the loss sum
    is then non-zero only on the rank holding the last stage, and the gradient norm is reduced over `pp_mesh` too.
    `on_phase(kind, micro_batch)` is told forward (the loss included) / backward (per micro-batch) and optimizer.
    `should_step(local loss sum, grad norm)`, asked after the norm and before clipping, can veto the update
    (the trainer's non-finite check); the gradients are then left as they are for the next zero_grad.
    `after_optimizer_step()` runs after each update (float8's scale precompute, torchtitan/components/quantization).
    """
    phase = on_phase or (lambda kind, micro: None)
    optimizer.zero_grad(set_to_none=True)
    local_loss_sum = torch.zeros((), device=device)
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    last = len(microbatches) - 1
    for micro, batch in enumerate(microbatches):
        phase("forward", micro)
        inputs = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        tokens, labels = inputs.pop("tokens"), inputs.pop("labels")
        if pipeline is not None:
            # Forward, loss and backward of every pipeline micro-batch happen inside the schedule; loss parallel
            # must cover all three.
            with autocast if autocast is not None else nullcontext(), loss_parallel_context(loss_parallel):
                local_loss_sum += pipeline.forward_backward(tokens, labels, global_tokens, inputs) * global_tokens
            continue
        model = model_parts[0]
        set_gradient_sync(model, micro == last)  # DDP reduces once, after the last micro-batch
        # With loss parallel the logits stay vocab-sharded over tp; the context must cover the loss, computed in
        # the forward, and the backward, which recomputes chunked logits.
        with loss_parallel_context(loss_parallel):
            with autocast if autocast is not None else nullcontext():
                loss_sum = model(tokens, labels=labels, **inputs)
            phase("backward", micro)
            (loss_sum / global_tokens).backward()
        local_loss_sum += local_value(loss_sum.detach())
    phase("optimizer", None)
    grad_norm = total_grad_norm(params, pp_mesh)
    if should_step is None or should_step(local_loss_sum, grad_norm):
        clip_grads_(params, max_norm, grad_norm)
        optimizer.step()
        if after_optimizer_step is not None:
            after_optimizer_step()
    return local_loss_sum, grad_norm


@contextmanager
def scheduled_garbage_collection():
    """Training's garbage-collection policy, for the trainer and the memory estimator alike: automatic collection
    off (a collection at an allocation-count threshold would run at a random point inside a step and free FSDP's
    cyclic garbage there), one collection before the steps; the loop collects every training.gc_freq steps."""
    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect(1)
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
