"""The per-step decision taken before the optimizer update: is the loss or the gradient non-finite, and has any
rank been asked to stop?

Both answers need every rank to agree (a rank that skips an update or saves while another trains on would leave
the model diverged or deadlock the next collective), so they travel in one small all-reduce over the world and
one host read per step: the non-finite check costs no synchronisation beyond the preemption check's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.distributed.preemption import PreemptionFlag
from torchtitan.tools.logging import logger

NONFINITE_ACTIONS = ("stop", "skip")


class TrainingError(RuntimeError):
    """A failure whose message already says everything (the step, what went wrong, what to do): printed as one
    line; when it wraps an exception, that exception's traceback is logged before it."""


class StepGuard:
    def __init__(self, action: str, model_parts: list[nn.Module], stop_signal: PreemptionFlag, device: torch.device,
                 train_state, param_order: dict[str, int] | None = None) -> None:
        """action: what training.on_nonfinite asks for when the loss or gradient norm is NaN or infinite;
        skipped updates are counted in `train_state.skipped_steps` (checkpointed with it)."""
        if action not in NONFINITE_ACTIONS:
            raise ValueError(f"training.on_nonfinite: '{action}' is not one of {', '.join(NONFINITE_ACTIONS)}")
        self.action, self.model_parts, self.stop_signal, self.device = action, model_parts, stop_signal, device
        self.train_state = train_state
        self.param_order = param_order or {}
        self.step = 0
        self.stop_requested = False

    def should_step(self, local_loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Called by the step between the gradient norm and the update (see components/step.py)."""
        flags = torch.stack([
            (~torch.isfinite(local_loss_sum)).to(device=self.device, dtype=torch.int32),
            (~torch.isfinite(grad_norm)).to(device=self.device, dtype=torch.int32),
            torch.tensor(int(self.stop_signal.received), dtype=torch.int32, device=self.device),
        ])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        loss_bad, grad_bad, stop = (bool(v) for v in flags.tolist())
        self.stop_requested = stop
        if not (loss_bad or grad_bad):
            return True
        what = ("the loss is not finite on some rank; " if loss_bad else "") + \
               f"the gradient norm is {grad_norm.item()}"
        if self.action == "skip":
            self.train_state.skipped_steps += 1
            logger.warning(f"step {self.step}: {what}: update skipped (training.on_nonfinite=skip; "
                           f"{self.train_state.skipped_steps} skipped so far)")
            return False
        culprit = first_nonfinite_gradient(self.model_parts, self.device, self.param_order)
        where = f"; first non-finite gradient in backward order: {culprit}" if culprit else ""
        raise TrainingError(f"step {self.step}: {what}{where}; stopping before the update "
                            "(training.on_nonfinite=stop; 'skip' drops such updates instead)")


def first_nonfinite_gradient(model_parts: list[nn.Module], device: torch.device,
                              param_order: dict[str, int] | None = None) -> str | None:
    """The parameter closest to the output whose gradient holds a NaN or infinity on any rank, with the count.

    Backward reaches parameters roughly in reverse registration order, so scanning from the end finds where
    non-finite values entered the backward pass (a NaN born in forward makes every gradient non-finite). Runs
    only after a failed check. Ranks may hold different parameters (pipeline stages), so each rank reports its
    own (position in the whole model's `param_order`, name, bad) list and one all_gather_object merges them.
    """
    from torchtitan.components.model_parts import named_parameters  # lazy: model_parts imports the model registry

    order = param_order or {}
    named = [(order.get(n, i), n, p) for i, (n, p) in enumerate(named_parameters(model_parts)) if p.grad is not None]
    local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for _, _, p in named]
    flags = [bool((~torch.isfinite(g)).any()) for g in local]
    mine = {n: (i, bad) for (i, n, _), bad in zip(named, flags, strict=True)}
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    merged: dict[str, tuple[int, bool]] = {}
    for part in everyone:
        for name, (order, bad) in part.items():
            merged[name] = (order, merged.get(name, (order, False))[1] or bad)
    if not merged:
        return None
    bad = sorted((order, name) for name, (order, flag) in merged.items() if flag)
    if not bad:
        return None
    return f"{bad[-1][1]} ({len(bad)} of {len(merged)} parameters have non-finite gradients)"
