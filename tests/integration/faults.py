"""Faults and mutations the tests inject into a built Trainer (never into production code), by name: run_layout
(tests/integration/parity.py) applies `faults=((name, *args), ...)`, each returning how to undo it or None."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.components.model_parts import named_parameters


def _nan_gradient(trainer, module_fqn: str, step: int, rank: int) -> None:
    """From `module_fqn`'s output back, the backward pass of step `step` on `rank` carries NaN."""
    from torchtitan.distributed.utils import env_world

    class _NanBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return torch.full_like(grad, float("nan"))

    def hook(module, inputs, output):
        if env_world()[0] == rank and trainer.train_state.step == step - 1 and module.training:
            return _NanBackward.apply(output)
        return output

    for part in trainer.model_parts:
        try:
            part.get_submodule(module_fqn).register_forward_hook(hook)
        except AttributeError:
            continue  # another pipeline stage holds it


def _average_gradients(trainer) -> None:
    """The bug the parity suite must catch: data parallelism averaging gradients on top of the global-token
    normalisation (every gradient divided by the data-parallel degree)."""
    from torch.distributed.fsdp import FSDPModule

    dp = trainer.parallel_dims.dp_degree
    fsdp_modules = [m for part in trainer.model_parts for m in part.modules() if isinstance(m, FSDPModule)]
    for module in fsdp_modules:
        module.set_gradient_divide_factor(float(trainer.parallel_dims.fsdp_degree * trainer.parallel_dims.dp_replicate))
    if not fsdp_modules:  # DDP: swap our SUM hook for an averaging one before the first forward registers it
        from torch.distributed._composable.replicate import replicate

        state = replicate.state(trainer.model_parts[0])
        (hook_state, _), kwargs = state._comm_hook_args[0]

        def average_hook(hook_state, bucket):
            fut = dist.all_reduce(bucket.buffer().div_(dp), group=hook_state[0], async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        state._comm_hook_args[0] = ((hook_state, average_hook), kwargs)


def _scale_gradients(trainer, factors: dict[str, float]) -> Callable[[], None]:
    """The bug a wrong reduction of one parameter produces (a missing or doubled sum over tp, a replica averaged
    once too often): the named parameters' gradients, as reduced, off by a constant factor from the first step. Applied
    where the step takes the gradient norm, so the logged norm, clipping and the update all see the wrong gradients.
    Returns the undo (the pool's next layout runs the real step)."""
    from torchtitan.components import step as step_module

    total_grad_norm = step_module.total_grad_norm
    scaled = [(p, factors[name]) for name, p in named_parameters(trainer.model_parts) if name in factors]

    def scale_then_norm(params, pp_mesh=None):
        for p, factor in scaled:
            if p.grad is not None:
                p.grad.mul_(factor)
        return total_grad_norm(params, pp_mesh)

    step_module.total_grad_norm = scale_then_norm
    return lambda: setattr(step_module, "total_grad_norm", total_grad_norm)


def _param_and_optimizer(trainer, name: str) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """The named parameter on this rank and the optimizer (of its model part) that steps it."""
    (param,) = [p for n, p in named_parameters(trainer.model_parts) if n == name]
    (optimizer,) = [opt for opt in trainer.optimizer.optimizers
                    if any(p is param for group in opt.param_groups for p in group["params"])]
    return param, optimizer


def _misplace_values(trainer, name: str, step: int) -> None:
    """After step `step`, the named parameter's values rolled by one place along its last dimension on every rank
    that holds a piece of it: the same values in the wrong places (the bug a shard written at a wrong offset makes),
    invisible to whole-tensor sums."""
    param, optimizer = _param_and_optimizer(trainer, name)
    local = param.to_local() if isinstance(param, DTensor) else param

    def hook(optimizer, args, kwargs):
        if trainer.guard.step == step:
            with torch.no_grad():
                local.copy_(local.roll(1, dims=-1))

    optimizer.register_step_post_hook(hook)


def _local_float8_amax(trainer) -> Callable[[], None]:
    """The bug of a float8 scale taken from this rank's shard alone: torchao's amax of a DTensor (a TP-sharded
    weight or input) computed on the local tensor and declared replicated, so each rank quantizes with its own
    scale. Returns the undo."""
    from torch.distributed.tensor import Replicate
    from torchao.float8 import float8_utils

    tensor_to_amax = float8_utils.tensor_to_amax

    def local_amax(x, *args, **kwargs):
        if not isinstance(x, DTensor):
            return tensor_to_amax(x, *args, **kwargs)
        amax = tensor_to_amax(x.to_local(), *args, **kwargs)
        return DTensor.from_local(amax, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)

    float8_utils.tensor_to_amax = local_amax
    return lambda: setattr(float8_utils, "tensor_to_amax", tensor_to_amax)


def _partial_adapter_grads(trainer) -> Callable[[], None]:
    """The LoRA bug of a replicated adapter under TP whose gradient is taken as whole while it is each rank's partial
    sum (the row-wise layers' B, the column-wise ones' A: torchtitan/components/quantization/lora.py): declared
    replicated without the reduction over tp. Patched before the first forward registers the hook. Returns the undo."""
    from torch.distributed.tensor import Replicate

    from torchtitan.components.quantization import lora

    replicated_grad = lora._replicated_grad

    def local_as_whole(grad):
        if any(pl.is_partial() for pl in grad.placements):
            return DTensor.from_local(grad.to_local(), grad.device_mesh, [Replicate()] * grad.device_mesh.ndim,
                                      run_check=False)
        return grad

    lora._replicated_grad = local_as_whole
    return lambda: setattr(lora, "_replicated_grad", replicated_grad)


def _unfreeze(trainer, name: str) -> None:
    """The LoRA bug of a parameter left trainable (a norm the converter forgot to freeze): it gets a gradient and its
    optimizer updates it."""
    (param,) = [p for n, p in named_parameters(trainer.model_parts) if n == name]
    param.requires_grad_(True)
    trainer.optimizer.optimizers[0].param_groups[0]["params"].append(param)


def _scale_moment(trainer, name: str, of: str, factor: float, step: int, rank: int) -> None:
    """After step `step`'s update, this rank's part of the named parameter's optimizer state `of` (exp_avg or
    exp_avg_sq) scaled by `factor`: one shard of the state wrong (the bug a state resharded or loaded at a wrong
    offset makes), which the parameters show only at a later step."""
    param, optimizer = _param_and_optimizer(trainer, name)

    def hook(optimizer, args, kwargs):
        if trainer.guard.step == step and dist.get_rank() == rank:
            state = optimizer.state[param][of]
            with torch.no_grad():
                (state.to_local() if isinstance(state, DTensor) else state).mul_(factor)

    optimizer.register_step_post_hook(hook)


FAULTS = {"nan_gradient": _nan_gradient, "average_gradients": _average_gradients, "scale_gradients": _scale_gradients,
          "misplace_values": _misplace_values, "local_float8_amax": _local_float8_amax,
          "partial_adapter_grads": _partial_adapter_grads, "unfreeze": _unfreeze,
          "scale_moment": _scale_moment}
