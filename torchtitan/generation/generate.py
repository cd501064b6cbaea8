"""`generate(model, prompts, config) -> GenerationResult`: batched autoregressive generation with a KV cache.

Works with any decoder of torchtitan/models (Llama 3, Qwen3 dense and MoE, DeepSeek-V3) held whole on one device
(or, dense ones, split over tensor-parallel ranks by torchtitan/distributed/generation_tp.py: every rank then runs
this same loop on the same prompts and sees the same full logits):
the prompts (token ids, of any lengths) are left-padded into one batch, run through the model once (the prefill),
then one token per row per step, each step reading the cache (kv_cache.py) instead of recomputing the past. A row
stops at a stop token or after `max_new_tokens`; the batch stops when every row has.

For RL the result carries, per row, the new tokens, their count, why the row stopped, and optionally the
log-probability of each new token under the model (before temperature, top-k or top-p).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from torchtitan.generation.kv_cache import KVCache
from torchtitan.generation.sampling import choose_tokens

FINISH_STOP = "stop"
"""The row produced one of the stop tokens (which is the last of its tokens)."""
FINISH_LENGTH = "length"
"""The row produced max_new_tokens without a stop token."""


@dataclass
class GenerationConfig:
    max_new_tokens: int = 32
    """Tokens to generate per row at most (a stop token included)."""
    temperature: float = 0.0
    """0: greedy (the argmax); > 0: sample from softmax(logits / temperature)."""
    top_k: int = 0
    """Sample among the k most probable tokens only (0: all)."""
    top_p: float = 1.0
    """Sample among the smallest set of most probable tokens whose probability reaches top_p (1: all)."""
    stop_tokens: Sequence[int] = field(default_factory=tuple)
    """Token ids that end a row (typically the tokenizer's EOS); the stop token is kept as the row's last token."""
    seed: int | None = None
    """Seed of the sampling generator (on the model's device); None: torch's default generator."""
    pad_id: int = 0
    """Fills the prompt padding and the result's slots after a row's end (any valid id: padding is masked)."""
    return_logprobs: bool = False
    """Return log_softmax(logits) at each chosen token: fp32, of the model's own distribution (before temperature,
    top-k and top-p)."""
    return_logits: bool = False
    """Return the model's fp32 logits at every step, [batch, steps, vocab] (batch x steps x vocab x 4 bytes)."""

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationResult:
    tokens: torch.Tensor
    """[batch, steps] new token ids of each row (steps <= max_new_tokens); pad_id after the row's `lengths`."""
    lengths: torch.Tensor
    """[batch] number of new tokens of each row (its stop token included)."""
    finish_reasons: list[str]
    """Per row: FINISH_STOP or FINISH_LENGTH."""
    logprobs: torch.Tensor | None = None
    """[batch, steps] fp32 log-probability of each new token (0 after the row's end); with return_logprobs."""
    logits: torch.Tensor | None = None
    """[batch, steps, vocab] fp32 logits each new token was chosen from; with return_logits."""
    cache_bytes: int = 0
    """Bytes the KV cache's buffers held on this device (every slot of every row; under tensor parallel, this
    rank's heads only)."""

    def sequences(self) -> list[list[int]]:
        """The new tokens of each row, without padding."""
        return [row[:n].tolist() for row, n in zip(self.tokens.cpu(), self.lengths.tolist(), strict=True)]


def _model_device(model: nn.Module) -> torch.device:
    emb = getattr(model, "tok_embeddings", None)
    if emb is not None:
        return emb.weight.device
    return next(model.parameters()).device


def _max_seq_len(model: nn.Module) -> int | None:
    table = getattr(model, "freqs_cis", None)
    return table.shape[0] if table is not None else None


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [batch, longest], pad [batch]): each prompt right-aligned after pad[b] copies of pad_id."""
    if not prompts:
        raise ValueError("no prompts")
    rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    for i, row in enumerate(rows):
        if row.numel() == 0:
            raise ValueError(f"prompt {i} is empty")
    longest = max(r.numel() for r in rows)
    tokens = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, longest - row.numel():] = row
    pad = torch.tensor([longest - r.numel() for r in rows], dtype=torch.long)
    return tokens.to(device), pad.to(device)


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]] | torch.Tensor,
             config: GenerationConfig | None = None) -> GenerationResult:
    """Continue each prompt (a sequence of token ids; a [batch, seq] tensor is a batch of equal-length prompts)
    with `model`, a whole decoder of torchtitan/models on one device. Runs without gradients (so MoE layers take no
    load-balancing counts); the models have no dropout, so train or eval mode is alike. Each row's result equals that
    of its prompt alone."""
    config = config if config is not None else GenerationConfig()
    config.check()
    device = _model_device(model)
    vocab = model.model_args.vocab_size if hasattr(model, "model_args") else None
    tokens, pad = left_pad(list(prompts), config.pad_id, device)
    if vocab is not None:
        bad = [int(t) for t in (*config.stop_tokens, config.pad_id) if not 0 <= int(t) < vocab]
        if bad or int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}) (the model's vocabulary)"
                             + (f": got {bad[0]} among stop_tokens/pad_id" if bad else ""))
    batch, prompt_len = tokens.shape
    total = prompt_len + config.max_new_tokens
    max_seq_len = _max_seq_len(model)
    if max_seq_len is not None and total - 1 > max_seq_len:
        # The longest row's last new token is fed at position prompt_len + max_new_tokens - 2 (the final token is
        # chosen, never fed back), so that position must have a row in the rotary table.
        raise ValueError(f"the longest prompt ({prompt_len} tokens) + max_new_tokens ({config.max_new_tokens}) - 1 "
                         f"exceeds the model's max_seq_len ({max_seq_len})")

    generator = None
    if config.seed is not None and config.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(config.seed)
    stop = torch.tensor(list(config.stop_tokens), dtype=torch.long, device=device)
    # Slots: the padded prompt, then one per new token except the last (chosen, never fed back).
    cache = KVCache(pad, total - 1)

    out_tokens, out_logprobs, out_logits = [], [], []
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    logits = model(tokens, cache=cache)[:, -1].float()
    for step in range(config.max_new_tokens):
        chosen = choose_tokens(logits, config.temperature, config.top_k, config.top_p, generator)
        chosen = chosen.masked_fill(finished, config.pad_id)
        out_tokens.append(chosen)
        if config.return_logprobs:
            logprob = logits.log_softmax(dim=-1).gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
            out_logprobs.append(logprob.masked_fill(finished, 0.0))
        if config.return_logits:
            out_logits.append(logits)
        lengths += (~finished).long()
        hit = torch.isin(chosen, stop) & ~finished
        stopped |= hit
        finished |= hit
        if step == config.max_new_tokens - 1 or bool(finished.all()):
            break
        logits = model(chosen.unsqueeze(1), cache=cache)[:, -1].float()

    return GenerationResult(
        tokens=torch.stack(out_tokens, dim=1),
        lengths=lengths,
        finish_reasons=[FINISH_STOP if s else FINISH_LENGTH for s in stopped.tolist()],
        logprobs=torch.stack(out_logprobs, dim=1) if config.return_logprobs else None,
        logits=torch.stack(out_logits, dim=1) if config.return_logits else None,
        cache_bytes=cache.nbytes(),
    )
