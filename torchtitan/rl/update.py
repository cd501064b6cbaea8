"""The policy update of one RL step (docs/rl.md, "The update"): the drawn groups make `rl.ppo_epochs` passes of
mini-batches of `rl.mini_batch_size` groups, one optimizer step each; each step accumulates the gradients of
micro-batches of `rl.micro_batch_size` completions of this rank's share; and the log-probability of every response
token comes out of the output projection's token chunks, so [batch, seq, vocab] fp32 logits never exist at once.

The chunks are the pretraining loss's (torchtitan/models/decoder.py, OutputProjection): given `labels`, the model's
output projection cuts the positions into `loss_chunks` chunks and calls its `loss_fn(chunk logits, chunk labels)` on
each, keeping no chunk's logits for the backward (it recomputes them, activation checkpointing per chunk); under
tensor parallel its hooks keep each chunk's logits vocab-sharded (loss parallel) or gather them, and under FSDP it
reads the gathered weight. The update swaps in its own loss_fn (a `TokenTable`) and passes as labels each position's
row in a flat table of the update's per-token inputs (target, behaviour log-probability, advantage, weight, reference
log-probability), so that a chunk finds its own. The GRPO loss is a weighted sum of per-token terms (loss.py), so the
chunks' sums add up to it; divided by the token (or completion) count of the whole update, over every micro-batch and
rank, the accumulated gradient is the gradient of the whole update in one forward.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchtitan.components.model_parts import AUTO_LOSS_CHUNK_BYTES
from torchtitan.components.step import forward_backward_step
from torchtitan.distributed import utils as dist_utils
from torchtitan.rl.loss import aggregation_weights, grpo_stats, grpo_token_loss, token_logprobs

Sample = tuple[Sequence[int], Sequence[int], Sequence[float], float]
"""(prompt ids, completion ids, the completion's behaviour log-probabilities, its advantage)"""


@dataclass(frozen=True)
class LossSettings:
    clip_low: float
    clip_high: float
    kl_coeff: float = 0.0
    aggregation: str = "token"


def logit_chunks(configured: int, tokens: int, vocab: int) -> int:
    """training.loss_chunks, or with 0 the fewest chunks whose fp32 logits ([tokens, vocab], vocab being this rank's
    shard under loss parallel) fit in AUTO_LOSS_CHUNK_BYTES each, as pretraining picks them."""
    return configured if configured > 0 else max(1, -(-tokens * vocab * 4 // AUTO_LOSS_CHUNK_BYTES))


def mini_batches(groups: list, size: int, epochs: int, shuffle_seed: int | None = None) -> Iterator[list]:
    """`epochs` passes over `groups`, `size` groups per optimizer update (0: all of them). Each pass cuts them in the
    drawn order, or, with `shuffle_seed` and more than one mini-batch per pass, in an order drawn afresh for each pass
    from (shuffle_seed, pass): the same on every rank and in a resumed run, so nothing to checkpoint. A draw that
    `size` does not divide (the buffer held fewer groups than rl.train_groups) ends each pass with a smaller one."""
    size = size or len(groups)
    for epoch in range(epochs):
        order = list(groups)
        if shuffle_seed is not None and size < len(order):
            random.Random(shuffle_seed * 1_000_003 + epoch).shuffle(order)
        for start in range(0, len(order), size):
            yield order[start:start + size]


def samples_of(groups: list) -> list[Sample]:
    return [(g.prompt, c, lp, a) for g in groups
            for c, lp, a in zip(g.completions, g.logprobs, g.advantages, strict=True)]


def pack(samples: Sequence[Sample], multiple: int, device: torch.device):
    """Right-padded [n, L] inputs (prompt + completion, last token dropped; L the longest, rounded up to `multiple`,
    which sequence parallel needs), targets, the mask of response targets, behaviour log-probs at those targets, and
    [n] advantages. No sample: one all-masked row, so this rank still joins FSDP's collectives with a zero loss."""
    n = max(len(samples), 1)
    longest = max((len(p) + len(c) - 1 for p, c, _, _ in samples), default=1)
    length = -(-longest // multiple) * multiple
    tokens = torch.zeros(n, length, dtype=torch.long)
    targets = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length, dtype=torch.bool)
    behaviour = torch.zeros(n, length)
    adv = torch.zeros(n)
    for i, (prompt, completion, logprobs, advantage) in enumerate(samples):
        full = torch.tensor(list(prompt) + list(completion), dtype=torch.long)
        tokens[i, :full.numel() - 1] = full[:-1]
        targets[i, :full.numel() - 1] = full[1:]
        start = len(prompt) - 1  # the input position that predicts the first completion token
        mask[i, start:start + len(completion)] = True
        behaviour[i, start:start + len(completion)] = torch.tensor(logprobs)
        adv[i] = advantage
    return tokens.to(device), targets.to(device), mask.to(device), behaviour.to(device), adv.to(device)


@dataclass
class MicroBatch:
    tokens: torch.Tensor
    """[n, L] model inputs"""
    index: torch.Tensor
    """[n, L] each position's row in the TokenTable: the model's labels"""
    samples: int
    """real samples (0: the placeholder row of a rank with nothing to train)"""


class TokenTable:
    """The per-token inputs of one update's micro-batches, flat, and what their forward computes: each token's
    log-probability and entropy (recorded in the forward, not in the backward's recompute) and, when there is a
    reference model, its log-probability. Called as the output projection's loss_fn: (chunk logits, chunk indices)
    -> the chunk's sum of weighted GRPO terms."""

    def __init__(self, micro_samples: list[Sequence[Sample]], multiple: int, settings: LossSettings,
                 device: torch.device):
        self.settings, self.micro, parts, offset = settings, [], [], 0
        for samples in micro_samples:
            tokens, targets, mask, behaviour, adv = pack(samples, multiple, device)
            index = torch.arange(offset, offset + tokens.numel(), device=device).view(tokens.shape)
            self.micro.append(MicroBatch(tokens, index, len(samples)))
            offset += tokens.numel()
            parts.append((targets, mask, behaviour, adv.unsqueeze(1).expand_as(behaviour),
                          aggregation_weights(mask, settings.aggregation)))
        self.targets, self.mask, self.behaviour, self.advantages, self.weights = (
            torch.cat([t.flatten() for t in column]) for column in zip(*parts, strict=True))
        self.logp = torch.zeros(offset, device=device)
        self.entropy = torch.zeros(offset, device=device)
        self.ref_logp: torch.Tensor | None = None
        self.recording = True

    def phase(self, kind: str, micro: int | None) -> None:
        # forward_backward_step's phases: a checkpointed chunk runs again in the backward, where its values are
        # the forward's; recording once spares the entropy's second log-softmax.
        self.recording = kind == "forward"

    def __call__(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        s = self.settings
        logp, entropy = token_logprobs(logits, self.targets[index], entropy=self.recording)
        if self.recording:
            self.logp[index] = logp.detach()
            self.entropy[index] = entropy
        ref = None if self.ref_logp is None else self.ref_logp[index]
        terms = grpo_token_loss(logp, self.behaviour[index], self.advantages[index], self.mask[index],
                                clip_low=s.clip_low, clip_high=s.clip_high, kl_coeff=s.kl_coeff, ref_logp=ref)
        return (terms * self.weights[index]).sum()

    def score_reference(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        self.ref_logp[index] = token_logprobs(logits, self.targets[index])[0]
        return torch.zeros((), device=index.device)

    def stats(self) -> dict[str, torch.Tensor]:
        s = self.settings
        return grpo_stats(self.logp, self.behaviour, self.advantages, self.mask, clip_low=s.clip_low,
                          clip_high=s.clip_high, ref_logp=self.ref_logp, entropy=self.entropy)


@contextlib.contextmanager
def scoring_with(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """The model's output projection scores its chunks with `loss_fn`; held until the backward is done, since the
    backward's recompute calls it again."""
    output = model.output
    previous, output.loss_fn = output.loss_fn, loss_fn
    try:
        yield
    finally:
        output.loss_fn = previous


def policy_update(model_parts: list[nn.Module], optimizer, samples: Sequence[Sample], settings: LossSettings, *,
                  device: torch.device, dp_mesh=None, micro_batch_size: int = 0, multiple: int = 1,
                  reference: nn.Module | None = None, autocast=None, loss_parallel: bool = False,
                  max_norm: float = 0.0) -> dict[str, Any]:
    """One optimizer update on `samples` (the same list on every rank): this rank's share (every dp_size-th sample)
    in micro-batches of `micro_batch_size` completions (0: the whole share in one), their gradients accumulated,
    then clipping and the optimizer step (components/step.py, the pretraining step). `multiple`: the padded length's
    (the tp degree, for sequence parallel). Returns grpo_stats' sums over the data-parallel ranks, "loss" (the
    update's), "grad_norm" (before clipping) and "trained_tokens" (positions through the forward, padding
    included)."""
    dp_rank, dp_size = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    # Every rank holds every sample: the normaliser is the whole update's, so micro-batches and ranks add up to it.
    normalizer = max(sum(len(c) for _, c, _, _ in samples) if settings.aggregation == "token" else len(samples), 1)
    largest = -(-len(samples) // dp_size)
    rows = micro_batch_size or largest
    share = samples[dp_rank::dp_size]
    # The largest share's micro-batch count on every rank, so that all ranks join each of FSDP's collectives; a
    # shorter share ends with a placeholder row.
    table = TokenTable([share[i * rows:(i + 1) * rows] for i in range(-(-largest // rows))], multiple, settings,
                       device)
    if reference is not None:
        table.ref_logp = torch.zeros_like(table.logp)
        with torch.no_grad(), scoring_with(reference, table.score_reference):
            for micro in table.micro:
                reference(micro.tokens, labels=micro.index)
    batches = [{"tokens": m.tokens, "labels": m.index} for m in table.micro]
    with scoring_with(model_parts[0], table):
        loss_sum, grad_norm = forward_backward_step(
            model_parts, optimizer, batches, torch.tensor(float(normalizer), device=device), max_norm=max_norm,
            device=device, autocast=autocast, loss_parallel=loss_parallel, on_phase=table.phase)
    stats = table.stats()
    names = sorted(stats)
    trained = float(sum(m.samples * m.tokens.shape[1] for m in table.micro))
    summed = dist_utils.all_reduce(torch.stack([stats[k] for k in names] + [loss_sum.float(), torch.tensor(
        trained, device=device)]), dp_mesh, "sum")
    out: dict[str, Any] = dict(zip(names, summed[:-2].tolist(), strict=True))
    out.update(loss=float(summed[-2]) / normalizer, grad_norm=float(grad_norm), trained_tokens=int(summed[-1]))
    return out


def merge_updates(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One step's numbers from its updates: the statistics' sums added (stat_means divides them by every update's
    tokens: per-token means over the step), loss and grad_norm averaged over the updates, and their count."""
    out = {key: sum(r[key] for r in results) for key in results[0]}
    out.update(loss=out["loss"] / len(results), grad_norm=out["grad_norm"] / len(results), updates=len(results))
    return out
