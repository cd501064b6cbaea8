"""Where rollouts come from: a small interface, and its implementation on torchtitan/generation.

`Generator.generate(prompts, sampling)` returns, for every prompt, `sampling.n` completions with their token ids
and the behaviour policy's log-probability of each token (the policy that sampled them, before temperature and
top-p: what the GRPO ratio divides by). `Generator.update_weights(state_dict, version)` installs the policy's new
weights (full tensors keyed by parameter name) after an optimizer step. docs/rl.md describes how an external engine
(vLLM, say) would implement the same two methods.

`LocalGenerator` keeps a plain, whole copy of the model on each rank and runs torchtitan.generation.generate on
it, one prompt's group at a time with a seed of its own: a group's completions then depend only on (weights, prompt,
seed), not on which rank generated it or which other prompts shared the batch, so every data-parallel layout
samples exactly what one process samples.

`TPGenerator` holds the model split over the tp ranks instead (torchtitan/distributed/generation_tp.py: heads, MLP
hidden units and vocabulary as training splits them, no sequence parallel, full logits on every rank): the tp ranks
of one data-parallel index generate the same groups together, and `update_weights` takes the policy's parameters
as they are (`sharded_state_dict`, DTensors) and gathers each only over the data-parallel dims.
"""

from __future__ import annotations

import abc
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchtitan.generation import GenerationConfig, generate


@dataclass
class SamplingParams:
    n: int = 4
    """Completions per prompt (the group size G)."""
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    stop_tokens: Sequence[int] = field(default_factory=tuple)
    pad_id: int = 0


@dataclass
class Completion:
    tokens: list[int]
    """The new token ids (a stop token, if the row ended on one, is the last)."""
    logprobs: list[float]
    """Behaviour log-probability of each new token."""
    finish_reason: str


class Generator(abc.ABC):
    """Samples completions from the current policy; receives its weights after every update."""

    version: int = 0
    """The policy version whose weights the generator holds."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 seeds: Sequence[int] | None = None) -> list[list[Completion]]:
        """For each prompt, `sampling.n` completions. `seeds` (one per prompt) make sampling reproducible."""

    @abc.abstractmethod
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Install the policy's weights (full tensors, keyed by parameter name) as `version`."""


def full_state_dict(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The policy's parameters as full tensors: each DTensor (FSDP or TP shards) gathered once with full_tensor(),
    parameter by parameter, so at most one unsharded parameter is in flight besides the generator's copy."""
    from torchtitan.components.model_parts import named_parameters

    out = {}
    for name, param in named_parameters(model_parts):
        value = param.detach()
        out[name] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return out


def sharded_state_dict(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The policy's parameters as they are (DTensors stay sharded), detached, by canonical name: what
    `TPGenerator.update_weights` takes. Nothing is communicated here."""
    from torchtitan.components.model_parts import named_parameters

    return {name: param.detach() for name, param in named_parameters(model_parts)}


class LocalGenerator(Generator):
    def __init__(self, model: nn.Module):
        """`model`: a whole, unsharded model of torchtitan/models on this rank's device (materialised)."""
        self.model = model.eval().requires_grad_(False)
        self.version = 0
        self.cache_bytes = 0
        """The largest KV cache (bytes, on this rank) of the last `generate` call."""

    def generate(self, prompts, sampling, seeds=None):
        results = []
        self.cache_bytes = 0
        for i, prompt in enumerate(prompts):
            config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                      top_p=sampling.top_p, stop_tokens=tuple(sampling.stop_tokens),
                                      seed=None if seeds is None else int(seeds[i]), pad_id=sampling.pad_id,
                                      return_logprobs=True)
            out = generate(self.model, [list(prompt)] * sampling.n, config)
            self.cache_bytes = max(self.cache_bytes, out.cache_bytes)
            lengths = out.lengths.tolist()
            results.append([
                Completion(tokens=out.tokens[r, :n].tolist(), logprobs=out.logprobs[r, :n].tolist(),
                           finish_reason=out.finish_reasons[r])
                for r, n in enumerate(lengths)])
        return results

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        own = dict(self.model.named_parameters())
        missing = sorted(set(own) - set(state_dict))
        if missing:
            raise KeyError(f"update_weights: no value for {missing[0]} (and {len(missing) - 1} more)")
        for name, param in own.items():
            param.copy_(state_dict[name].to(param.device, param.dtype))
        self.version = version


class TPGenerator(LocalGenerator):
    """The policy's model split over the tensor-parallel ranks (torchtitan/distributed/generation_tp.py). Every tp
    rank of a group must call `generate` with the same prompts, sampling and seeds (checked: a mismatch would
    otherwise desynchronise the per-token collectives) and gets the same completions; `update_weights` is a
    collective over the policy's whole mesh."""

    def __init__(self, model: nn.Module, tp_mesh, block_plan: Callable[[nn.Module], dict],
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        """`model`: a whole model of torchtitan/models (dense), best on the `meta` device, where only this rank's
        shards are ever allocated, on `device` (its weights are then undefined until the first `update_weights`);
        a materialised model is cut in place. `tp_mesh`: the 1-D tp mesh, the training's (ParallelDims.mesh("tp")),
        so that a policy parameter's tp shard is this generator's. `block_plan`: the family's training plan inside a
        block (ModelSpec.tp_block_plan), which the split follows. `dtype`: the copy's dtype (bf16 on a GPU, as
        LocalGenerator's)."""
        from torchtitan.distributed.generation_tp import shard_for_generation

        on_meta = any(p.is_meta for p in model.parameters())
        self.tp = shard_for_generation(model, tp_mesh, block_plan)
        if on_meta:
            if device is None:
                raise ValueError("TPGenerator: a model on the meta device needs `device`")
            tied = model.output is not None and model.output.weight is model.tok_embeddings.weight
            model.to_empty(device=device)
            if tied:  # to_empty allocates each module's parameters separately
                model.output.weight = model.tok_embeddings.weight
            with torch.no_grad():
                model.freqs_cis = model.rope_table(torch.device(device))
        elif device is not None:
            model.to(device)
        if dtype is not None:
            model.to(dtype)
        super().__init__(model)
        self.last_sync = None
        """SyncStats of the last update_weights: parameters written, gathered, bytes received."""

    def generate(self, prompts, sampling, seeds=None):
        self._check_same_requests(prompts, sampling, seeds)
        return super().generate(prompts, sampling, seeds)

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """`state_dict`: the policy's parameters by name, DTensors of the training layout (`sharded_state_dict`) or
        whole tensors; each is gathered over the data-parallel dims only (nothing moves for a tp-only policy)."""
        from torchtitan.distributed.generation_tp import load_tp_weights

        self.last_sync = load_tp_weights(self.model, self.tp, state_dict)
        self.version = version

    def _check_same_requests(self, prompts, sampling, seeds) -> None:
        # One small all-gather per call (never per token): ranks fed different prompts would run collectives of
        # different sizes, which is an abort or a hang, not an error message.
        from torchtitan.distributed.generation_tp import gather_stacked

        text = repr(([list(map(int, p)) for p in prompts], sampling, None if seeds is None else list(seeds)))
        mine = torch.tensor([zlib.crc32(text.encode()), len(prompts)], dtype=torch.long,
                            device=self.model.tok_embeddings.weight.device)
        every = gather_stacked(mine, self.tp.group, self.tp.size)
        if not bool((every == mine).all()):
            raise ValueError("TPGenerator.generate: the tp ranks were given different prompts, sampling or seeds "
                             "(each tp rank of a data-parallel index must generate the same groups)")
