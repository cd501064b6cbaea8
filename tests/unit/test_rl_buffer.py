"""The replay buffer: sampling order, eviction by lag and capacity, zero-variance dropping, determinism and
checkpointing (torchtitan/rl/buffer.py)."""

from __future__ import annotations

import pytest

from torchtitan.rl.buffer import Group, ReplayBuffer


def group(index: int, version: int = 0, rewards=(0.0, 1.0), advantages=None) -> Group:
    advantages = list(advantages) if advantages is not None else [r - sum(rewards) / len(rewards) for r in rewards]
    return Group(index=index, prompt=[1, 2], completions=[[3]] * len(rewards), logprobs=[[-1.0]] * len(rewards),
                 rewards=list(rewards), advantages=advantages, version=version)


def test_fifo_returns_oldest_first_and_consumes():
    buf = ReplayBuffer("fifo")
    buf.add([group(2), group(0), group(1, version=1)])
    assert [g.index for g in buf.sample(2, version=1)] == [0, 2]  # version 0 before 1, then by prompt index
    assert [g.index for g in buf.sample(5, version=1)] == [1]
    assert buf.sample(1, version=1) == []


def test_zero_variance_groups_are_dropped_and_counted():
    buf = ReplayBuffer("fifo", drop_zero_variance=True)
    assert buf.add([group(0, rewards=(1.0, 1.0)), group(1), group(2, rewards=(0.0, 0.0))]) == 2
    assert len(buf) == 1 and buf.dropped == 2
    keep = ReplayBuffer("fifo", drop_zero_variance=False)
    assert keep.add([group(0, rewards=(1.0, 1.0))]) == 0 and len(keep) == 1


def test_eviction_by_lag():
    buf = ReplayBuffer("uniform", max_lag=1, seed=0)
    buf.add([group(0, version=0), group(1, version=1), group(2, version=2)])
    chosen = buf.sample(3, version=2)  # version 0 is two behind: evicted
    assert sorted(g.index for g in chosen) == [1, 2]
    assert buf.evicted_lag == 1
    on_policy = ReplayBuffer("fifo", max_lag=0)
    on_policy.add([group(0, version=0), group(1, version=1)])
    assert [g.index for g in on_policy.sample(2, version=1)] == [1]


def test_eviction_by_capacity_keeps_the_newest():
    buf = ReplayBuffer("fifo", capacity=2)
    buf.add([group(i, version=i) for i in range(4)])
    assert [g.index for g in buf.sample(4, version=3)] == [2, 3]
    assert buf.evicted_capacity == 2


def test_uniform_and_prioritized_keep_groups_and_are_seeded():
    def draws(sampling: str, seed: int) -> list[list[int]]:
        buf = ReplayBuffer(sampling, seed=seed)
        buf.add([group(i, advantages=[i * 1.0, -i * 1.0]) for i in range(6)])
        return [[g.index for g in buf.sample(3, version=0)] for _ in range(4)]

    for sampling in ("uniform", "prioritized"):
        a = draws(sampling, 0)
        assert a == draws(sampling, 0)
        assert a != draws(sampling, 1)
        assert all(len(set(d)) == 3 for d in a)  # without replacement within a draw


def test_prioritized_prefers_large_advantages():
    buf = ReplayBuffer("prioritized", seed=0)
    buf.add([group(0, advantages=[0.01, -0.01]), group(1, advantages=[5.0, -5.0])])
    firsts = [buf.sample(1, version=0)[0].index for _ in range(200)]
    assert firsts.count(1) > 190


def test_state_dict_round_trip_continues_identically():
    buf = ReplayBuffer("uniform", capacity=10, max_lag=3, seed=5)
    buf.add([group(i, version=i % 2) for i in range(8)] + [group(9, rewards=(1.0, 1.0))])
    buf.sample(2, version=1)
    copy = ReplayBuffer("uniform", capacity=10, max_lag=3, seed=99)
    copy.load_state_dict(buf.state_dict())
    assert copy.dropped == 1
    for _ in range(5):
        assert [g.index for g in copy.sample(3, version=2)] == [g.index for g in buf.sample(3, version=2)]


def test_unknown_sampling_is_refused():
    with pytest.raises(ValueError, match="sampling"):
        ReplayBuffer("lifo")
