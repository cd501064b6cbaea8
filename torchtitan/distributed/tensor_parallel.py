"""Tensor parallel (Megatron-style) with sequence parallel and loss parallel, keyed by module names.

Layout over the 1-D `tp` mesh, per transformer block (the plan is the model's: Llama's in
torchtitan/models/llama3/parallelize.py):
- `attention_norm`, `ffn_norm`: sequence parallel. Between blocks the residual stream is sharded on the
  sequence dimension (Shard(1)), so norms and residual adds run on S/tp tokens and activations take 1/tp of
  the memory.
- `attention` and `feed_forward` inputs are all-gathered on the sequence (Shard(1) -> Replicate) once each;
  `wq/wk/wv` and `w1/w3` are column-wise (each rank owns a slice of the heads / hidden units, no comms), `wo`
  and `w2` are row-wise with a reduce-scatter back to Shard(1). Two all-gathers and two reduce-scatters per
  block forward, the same in backward.
Outside the blocks: the embedding is sharded on the vocabulary (row-wise; the lookup result is
reduce-scattered to Shard(1)), the final norm is sequence parallel and the output projection is column-wise on
the vocabulary. With loss parallel the logits stay vocab-sharded and cross-entropy reduces over the tp mesh
(max and sum-exp), so the [B, S, vocab] logits are never gathered; without it they are gathered (Replicate).

MoE layers (`moe`, in place of `feed_forward`) are not sharded: each tp rank runs the whole layer (router, experts,
shared experts) on its own S/tp tokens of the sequence-sharded stream, with no communication at all over tp
(`moe_token_split`). For those parameters the tp ranks are therefore data-parallel ranks: their gradients are sums
over tp, which FSDP does by sharding them over dp_shard x cp x tp (torchtitan/distributed/fsdp.py,
ParallelDims.moe_fsdp_mesh), and the routing counts for load balancing are summed over tp too. Expert parallel
composes as without TP: the ranks of one ep group share a tp index and exchange their own tokens. With
expert_tensor_parallel_degree = tp the experts themselves are split over tp (torchtitan/distributed/expert_parallel.py).

The model code is unchanged: `Attention` reads its local head count from the tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from torchtitan.components.quantization import float8, lora
from torchtitan.tools.logging import logger


def moe_token_split() -> ParallelStyle:
    """The plan of an MoE layer under tensor parallel (see the module doc): its input, the Shard(1) residual stream,
    enters as this rank's local S/tp tokens, and its output leaves as the same Shard(1) DTensor; both conversions
    are free (no communication), and their backwards hand the gradient shard through unchanged."""
    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
        output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False,
    )  # fmt: skip


class OutputParallel(ColwiseParallel):
    """The output projection's style: column-wise on the vocabulary. Given labels (by keyword, which the input
    hook leaves alone) the projection returns the loss sum of its chunks (torchtitan/models/decoder.py), which
    leaves as it is rather than being laid out like logits: with loss parallel a replicated scalar DTensor from the
    vocab-sharded cross-entropy; without it a plain scalar, each chunk's logits gathered before its loss."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self.use_local_output:  # no loss parallel: the loss takes whole (gathered) logits
            module.logits_to_loss = _gathered
        return super()._apply(module, device_mesh)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.ndim == 0:
            return outputs.to_local() if isinstance(outputs, DTensor) and use_local_output else outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def _gathered(logits: DTensor) -> torch.Tensor:
    return logits.redistribute(placements=[Replicate()]).to_local()


def apply_tp(model: nn.Module, tp_mesh, *, loss_parallel: bool,
             block_plan: dict | Callable[[nn.Module], dict]) -> nn.Module:
    """Shard `model` (on meta or materialised) over the 1-D `tp_mesh` in place, following the layout above: the
    modules every family names alike (tok_embeddings, norm, output) here, each block by `block_plan` (module name
    within the block -> ParallelStyle, or a function of the block that returns it, for models whose blocks differ),
    which the model's own parallelize function supplies (torchtitan/models/llama3/parallelize.py)."""
    tied = _is_tied(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}  # LoRA's base weights
    top: dict = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                 use_local_output=False)
    if getattr(model, "norm", None) is not None:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        # A pipeline stage without the final norm receives hidden states already sharded on the sequence.
        top["output"] = OutputParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    if getattr(model, "tok_embeddings", None) is not None:
        model.tok_embeddings.register_forward_hook(_waited_output)
    else:
        # A later pipeline stage receives the sequence-sharded residual stream as its local shard (stages send
        # plain tensors, torchtitan/distributed/pipeline_parallel.py): make it the Shard(1) DTensor the blocks'
        # residual adds expect. The backward of from_local hands the previous stage the local gradient shard.
        model.register_forward_pre_hook(partial(_sequence_sharded_input, tp_mesh))
    if tied:
        # Row-wise embedding and column-wise output both shard the shared [vocab, dim] matrix on dim 0, so one
        # DTensor serves both; parallelize_module replaced it twice, so restore the single shared parameter.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        plan = block_plan(block) if callable(block_plan) else block_plan
        # float8 (torchtitan/components/quantization/float8.py): tensorwise layers take the float8 styles;
        # LoRA (lora.py): adapters placed by the base projection's style
        plan = {name: lora.tp_style(block.get_submodule(name), float8.tp_style(block.get_submodule(name), style,
                                                                                 tp_mesh), tp_mesh)
                for name, style in plan.items()}
        parallelize_module(block, tp_mesh, plan)
    for name, p in model.named_parameters():  # torch's SequenceParallel re-creates the norms' weights trainable
        if name in frozen:
            p.requires_grad_(False)
    # The sequence-sharded embedding output is a view of a DTensor's local tensor, and FSDP2 warns that an
    # in-place op on it would skip its pre-backward hook. The blocks only use out-of-place residual adds
    # (`h = x + ...`), so the warning describes nothing that can happen here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    logger.info(f"applied tensor parallel over {tp_mesh.size()} ranks with sequence parallel, "
                f"loss parallel {'on' if loss_parallel else 'off'}")
    return model


def _waited_output(module, args, output):
    """The embedding's output with its reduce-scatter waited for. Row-wise parallel styles leave the collective
    asynchronous (an AsyncCollectiveTensor inside the DTensor), and torch.compile guards on the local tensor's class
    and requires_grad: the first block, compiled on that input, recompiled for every later block's plain one, so a
    compiled job traced and compiled the block twice, forward and backward (measured 2026-11-27, torch 2.13, TP 2 on
    CPU: 4 inductor graphs instead of 2; the compiled parity layout took 22 s instead of 28 in isolation). A clone is a
    DTensor op whose local result is plain: one copy of the hidden states, whose collective the first block's first
    op would have waited for anyway."""
    if isinstance(output, DTensor) and isinstance(output._local_tensor, funcol.AsyncCollectiveTensor):
        return output.clone()
    return None


def _sequence_sharded_input(tp_mesh, module, args):
    if args and isinstance(args[0], torch.Tensor) and not isinstance(args[0], DTensor):
        return (DTensor.from_local(args[0], tp_mesh, (Shard(1),), run_check=False), *args[1:])
    return None


def _is_tied(model: nn.Module) -> bool:
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    return emb is not None and out is not None and out.weight is emb.weight


def loss_parallel_context(enabled: bool) -> AbstractContextManager:
    """Wrap both the loss computation and backward: the vocab-sharded cross-entropy has its own backward."""
    return loss_parallel() if enabled else nullcontext()


def enable_async_tp(tp_mesh) -> None:
    """Let inductor fuse TP's all-gather/reduce-scatter with the neighbouring matmuls (CUDA only, with compile).

    Symmetric memory on the TP group is what the fused kernels communicate through.
    """
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    logger.info("async tensor parallel enabled (inductor micro-pipelining on the tp group)")


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A loss from loss parallel is a replicated DTensor; metrics and accumulation want the plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
