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
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
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


class LocalGenerator(Generator):
    def __init__(self, model: nn.Module):
        """`model`: a whole, unsharded model of torchtitan/models on this rank's device (materialised)."""
        self.model = model.eval().requires_grad_(False)
        self.version = 0

    def generate(self, prompts, sampling, seeds=None):
        results = []
        for i, prompt in enumerate(prompts):
            config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                      top_p=sampling.top_p, stop_tokens=tuple(sampling.stop_tokens),
                                      seed=None if seeds is None else int(seeds[i]), pad_id=sampling.pad_id,
                                      return_logprobs=True)
            out = generate(self.model, [list(prompt)] * sampling.n, config)
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
