"""A replay buffer of scored groups (one prompt's G completions), with sampling and eviction chosen by name.

A group enters with the policy version that generated it. Before every draw the buffer evicts: groups more than
`max_lag` versions behind the current policy, then the oldest groups beyond `capacity`. Sampling policies:

  fifo         the oldest groups first; a drawn group leaves the buffer (each group trains once)
  uniform      groups drawn uniformly without replacement; they stay (replayed until evicted by lag or capacity)
  prioritized  drawn without replacement with probability proportional to the group's mean |advantage| (+ eps);
               they stay, as with uniform

Groups whose rewards are all equal carry no signal under group-normalised advantages (every advantage is zero);
`drop_zero_variance` keeps them out and counts them. Everything here is plain data (lists of ints and floats) and
one seeded `random.Random`, so the buffer is replicated bit for bit on every rank and in checkpoints.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

SAMPLING = ("fifo", "uniform", "prioritized")
PRIORITY_EPS = 1e-6  # keeps every group drawable under prioritized sampling


@dataclass
class Group:
    """One prompt and its G scored completions."""

    index: int
    """Global index of the prompt in the data stream (unique; orders the buffer)."""
    prompt: list[int]
    completions: list[list[int]]
    logprobs: list[list[float]]
    """Behaviour log-probabilities of each completion's tokens, recorded at generation."""
    rewards: list[float]
    advantages: list[float]
    correct: list[float] = field(default_factory=list)
    """Exact-answer correctness of each completion (for the accuracy metric, whatever the rewards are)."""
    version: int = 0
    """The policy version that generated the group."""

    def zero_variance(self) -> bool:
        return max(self.rewards) == min(self.rewards)

    def priority(self) -> float:
        return sum(abs(a) for a in self.advantages) / len(self.advantages) + PRIORITY_EPS


class ReplayBuffer:
    def __init__(self, sampling: str = "fifo", capacity: int = 0, max_lag: int = -1, drop_zero_variance: bool = True,
                 seed: int = 0):
        """capacity 0: unbounded; max_lag -1: any age is kept."""
        if sampling not in SAMPLING:
            raise ValueError(f"buffer sampling must be one of {SAMPLING}, got {sampling!r}")
        self.sampling, self.capacity, self.max_lag = sampling, capacity, max_lag
        self.drop_zero_variance = drop_zero_variance
        self.rng = random.Random(seed)
        self.groups: list[Group] = []
        self.dropped = 0  # zero-variance groups kept out, in all
        self.evicted_lag = 0
        self.evicted_capacity = 0

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, groups: list[Group]) -> int:
        """Add scored groups; returns how many were dropped for zero reward variance."""
        dropped = 0
        for g in groups:
            if self.drop_zero_variance and g.zero_variance():
                dropped += 1
                continue
            self.groups.append(g)
        self.dropped += dropped
        return dropped

    def evict(self, version: int) -> None:
        """Drop groups older than max_lag versions, then the oldest beyond capacity."""
        if self.max_lag >= 0:
            keep = [g for g in self.groups if version - g.version <= self.max_lag]
            self.evicted_lag += len(self.groups) - len(keep)
            self.groups = keep
        if self.capacity > 0 and len(self.groups) > self.capacity:
            self.groups.sort(key=lambda g: (g.version, g.index))
            extra = len(self.groups) - self.capacity
            self.evicted_capacity += extra
            self.groups = self.groups[extra:]

    def sample(self, n: int, version: int) -> list[Group]:
        """Up to `n` groups for an update of the policy at `version` (fewer if the buffer holds fewer)."""
        self.evict(version)
        self.groups.sort(key=lambda g: (g.version, g.index))  # oldest first: the order every policy starts from
        n = min(n, len(self.groups))
        if self.sampling == "fifo":
            chosen, self.groups = self.groups[:n], self.groups[n:]
            return chosen
        if self.sampling == "uniform":
            picks = self.rng.sample(range(len(self.groups)), n)
        else:
            picks = self._weighted_without_replacement([g.priority() for g in self.groups], n)
        return [self.groups[i] for i in picks]

    def _weighted_without_replacement(self, weights: list[float], n: int) -> list[int]:
        # Sequential draws, each among those left: with few groups per step this is exact and cheap.
        left = list(range(len(weights)))
        picks = []
        for _ in range(n):
            total = sum(weights[i] for i in left)
            x, acc = self.rng.random() * total, 0.0
            for pos, i in enumerate(left):
                acc += weights[i]
                if x < acc or pos == len(left) - 1:
                    picks.append(left.pop(pos))
                    break
        return picks

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {
            "groups": [asdict(g) for g in self.groups],
            "rng": [version, list(internal), gauss],
            "dropped": self.dropped,
            "evicted_lag": self.evicted_lag,
            "evicted_capacity": self.evicted_capacity,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = [Group(**g) for g in state["groups"]]
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.dropped = int(state["dropped"])
        self.evicted_lag = int(state["evicted_lag"])
        self.evicted_capacity = int(state["evicted_capacity"])
