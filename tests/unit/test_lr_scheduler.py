"""Unit tests for torchtitan.components.lr_scheduler: warmup, stable phase, decay shapes and endpoints."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan.components.lr_scheduler import build_lr_scheduler, lr_factor, schedule_bounds
from torchtitan.config.job_config import LRScheduler


def factors(total: int, **cfg_kwargs) -> list[float]:
    cfg = LRScheduler(**cfg_kwargs)
    warmup, stable_end, decay_steps = schedule_bounds(cfg, total)
    return [
        lr_factor(s, warmup_steps=warmup, stable_end=stable_end, decay_steps=decay_steps,
                  decay_type=cfg.decay_type, min_lr_factor=cfg.min_lr_factor)
        for s in range(total)
    ]


# --------------------------------------------------------------------------- warmup


@pytest.mark.parametrize("warmup", [1, 3, 5, 10])
@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_warmup_starts_at_one_over_warmup_plus_one_and_reaches_peak(warmup, decay_type):
    f = factors(40, warmup_steps=warmup, decay_type=decay_type, min_lr_factor=0.1)
    assert f[0] == pytest.approx(1 / (warmup + 1))
    for s in range(warmup):
        assert f[s] == pytest.approx((s + 1) / (warmup + 1))
    assert f[warmup] == pytest.approx(1.0)  # the step after warmup runs at the peak LR
    assert max(f) == pytest.approx(1.0)
    assert all(b > a for a, b in zip(f[:warmup], f[1:warmup + 1], strict=True))  # strictly increasing


def test_no_warmup_starts_at_peak():
    f = factors(10, warmup_steps=0, min_lr_factor=0.0)
    assert f[0] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.0)


def test_warmup_factor_is_never_zero():
    f = factors(20, warmup_steps=5, min_lr_factor=0.0)
    assert all(x > 0 for x in f[:-1])


# --------------------------------------------------------------------------- decay shapes


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
@pytest.mark.parametrize("min_lr", [0.0, 0.1, 0.5])
@pytest.mark.parametrize(("total", "warmup"), [(20, 0), (20, 4), (60, 5), (7, 2)])
def test_decay_endpoints_and_monotonic(decay_type, min_lr, total, warmup):
    f = factors(total, warmup_steps=warmup, decay_type=decay_type, min_lr_factor=min_lr)
    assert len(f) == total
    assert f[-1] == pytest.approx(min_lr)  # the last step reaches min_lr_factor
    after_peak = f[warmup:]
    assert after_peak[0] == pytest.approx(1.0)
    # non-increasing after the peak
    assert all(b <= a + 1e-12 for a, b in zip(after_peak[:-1], after_peak[1:], strict=True))
    assert all(min_lr - 1e-12 <= x <= 1.0 + 1e-12 for x in after_peak)


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_decay_shape(decay_type):
    total, warmup, m = 25, 4, 0.2
    f = factors(total, warmup_steps=warmup, decay_type=decay_type, min_lr_factor=m)
    _, stable_end, d = schedule_bounds(LRScheduler(warmup_steps=warmup), total)
    assert stable_end + d == total
    for s in range(stable_end, total):
        p = (s - stable_end + 1) / d
        curve = {"linear": 1 - p, "sqrt": 1 - math.sqrt(p), "cosine": 0.5 * (1 + math.cos(math.pi * p))}[decay_type]
        assert f[s] == pytest.approx(m + (1 - m) * curve)


def test_decay_shapes_differ_as_expected():
    lin = factors(101, warmup_steps=0, decay_type="linear")
    sqrt = factors(101, warmup_steps=0, decay_type="sqrt")
    cos = factors(101, warmup_steps=0, decay_type="cosine")
    mid = 50  # halfway through the decay
    assert lin[mid] == pytest.approx(0.5)
    assert sqrt[mid] == pytest.approx(1 - math.sqrt(0.5))
    assert cos[mid] == pytest.approx(0.5)
    # sqrt drops fastest early; cosine drops slowest early
    assert sqrt[10] < lin[10] < cos[10]
    # linear steps are equal
    diffs = [a - b for a, b in zip(lin[1:-1], lin[2:], strict=True)]
    assert max(diffs) == pytest.approx(min(diffs))


def test_unknown_decay_type_raises():
    with pytest.raises(ValueError, match="decay_type"):
        lr_factor(5, warmup_steps=0, stable_end=0, decay_steps=10, decay_type="exp", min_lr_factor=0.0)


def test_lr_factor_after_the_end_stays_at_min():
    kw = dict(warmup_steps=0, stable_end=2, decay_steps=8, decay_type="linear", min_lr_factor=0.25)
    assert lr_factor(9, **kw) == pytest.approx(0.25)
    assert lr_factor(100, **kw) == pytest.approx(0.25)


# --------------------------------------------------------------------------- WSD


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
@pytest.mark.parametrize(("total", "warmup", "ratio"), [(100, 10, 0.2), (100, 0, 0.5), (40, 5, 0.1), (10, 2, 0.33)])
def test_wsd_stable_phase_then_decay(decay_type, total, warmup, ratio):
    m = 0.1
    f = factors(total, warmup_steps=warmup, decay_ratio=ratio, decay_type=decay_type, min_lr_factor=m)
    d = round(ratio * total)
    assert schedule_bounds(LRScheduler(warmup_steps=warmup, decay_ratio=ratio), total) == (warmup, total - d, d)
    stable = f[warmup:total - d]
    assert len(stable) == total - d - warmup > 0
    assert all(x == 1.0 for x in stable)  # flat stable phase at the peak
    decay = f[total - d:]
    assert len(decay) == d
    assert all(x < 1.0 for x in decay)  # the decay lasts exactly round(ratio*steps) steps
    assert decay[-1] == pytest.approx(m)
    assert all(b < a for a, b in zip(decay[:-1], decay[1:], strict=True))


def test_wsd_zero_ratio_never_decays():
    f = factors(20, warmup_steps=3, decay_ratio=0.0, min_lr_factor=0.1)
    assert f[3:] == [1.0] * 17


def test_wsd_ratio_too_large_warns_and_decays_right_after_warmup(warnings_log):
    total, warmup = 20, 5
    f = factors(total, warmup_steps=warmup, decay_ratio=0.9, min_lr_factor=0.0)
    assert any("decay" in m for m in warnings_log), warnings_log
    assert f[warmup] == pytest.approx(1.0)
    assert f[warmup + 1] < 1.0
    assert f[-1] == pytest.approx(0.0)


def test_wsd_ratio_one_without_warmup_does_not_warn(warnings_log):
    f = factors(10, warmup_steps=0, decay_ratio=1.0, min_lr_factor=0.0)
    assert not warnings_log
    assert f[0] == pytest.approx(1.0) and f[-1] == pytest.approx(0.0)


def test_default_schedule_is_decay_over_everything_after_warmup():
    total, warmup = 60, 5
    w, stable_end, d = schedule_bounds(LRScheduler(warmup_steps=warmup), total)
    assert w == warmup
    assert stable_end == warmup + 1  # a single step at the peak
    assert stable_end + d == total


# --------------------------------------------------------------------------- warmup longer than training


def test_warmup_longer_than_steps_warns_and_still_runs(warnings_log):
    total, warmup = 10, 30
    f = factors(total, warmup_steps=warmup, min_lr_factor=0.0)
    assert any("warmup_steps" in m for m in warnings_log), warnings_log
    assert f == pytest.approx([(s + 1) / (warmup + 1) for s in range(total)])
    assert max(f) < 1.0


@pytest.mark.parametrize("warmup", [9, 10, 11])
def test_warmup_about_as_long_as_steps(warmup):
    f = factors(10, warmup_steps=warmup, min_lr_factor=0.0)
    assert len(f) == 10
    assert all(0.0 < x <= 1.0 for x in f)


def test_single_step_run():
    assert factors(1, warmup_steps=0) == [1.0]
    assert factors(1, warmup_steps=1) == [pytest.approx(0.5)]


# --------------------------------------------------------------------------- with a real optimizer


def _lr_sequence(total: int, lr: float, **cfg_kwargs) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([param], lr=lr)
    sched = build_lr_scheduler(opt, LRScheduler(**cfg_kwargs), total)
    seen = []
    for _ in range(total):
        seen.append(opt.param_groups[0]["lr"])  # the LR this optimizer step uses
        param.grad = torch.ones_like(param)
        opt.step()
        sched.step()
    return seen


def test_build_lr_scheduler_sequence():
    lr = 1e-3
    seen = _lr_sequence(8, lr, warmup_steps=2, decay_type="linear", min_lr_factor=0.1)
    # warmup 1/3, 2/3; peak at step 2; then 5 linear decay steps down to 0.1
    expected = [1 / 3, 2 / 3, 1.0, 0.82, 0.64, 0.46, 0.28, 0.1]
    assert seen == pytest.approx([lr * x for x in expected])


def test_build_lr_scheduler_wsd_sequence():
    lr = 2.0
    seen = _lr_sequence(10, lr, warmup_steps=1, decay_ratio=0.4, decay_type="linear", min_lr_factor=0.0)
    expected = [0.5, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0.0]
    assert seen == pytest.approx([lr * x for x in expected])


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_build_lr_scheduler_matches_lr_factor(decay_type):
    total, lr = 30, 3e-4
    kwargs = dict(warmup_steps=4, decay_type=decay_type, min_lr_factor=0.05, decay_ratio=0.5)
    seen = _lr_sequence(total, lr, **kwargs)
    assert seen == pytest.approx([lr * x for x in factors(total, **kwargs)])


def test_build_lr_scheduler_keeps_param_group_lrs_proportional():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.5}])
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=3), 10)
    for _ in range(5):
        lrs = [g["lr"] for g in opt.param_groups]
        assert lrs[1] == pytest.approx(0.5 * lrs[0])
        opt.step()
        sched.step()


# --------------------------------------------------------------------------- resuming under another schedule


class _Optimizers:
    def __init__(self, lr: float) -> None:
        self.param = torch.nn.Parameter(torch.zeros(3))
        self.optimizers = [torch.optim.AdamW([self.param], lr=lr)]

    def step(self) -> None:
        self.param.grad = torch.ones_like(self.param)
        self.optimizers[0].step()


def _run(opts: _Optimizers, sched, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        seen.append(opts.optimizers[0].param_groups[0]["lr"])
        opts.step()
        sched.step()
    return seen


@pytest.mark.parametrize(("new_total", "new_lr"), [(15, 1e-3), (15, 5e-4), (10, 1e-3)])
def test_resume_follows_this_runs_schedule_from_the_first_resumed_step(new_total, new_lr):
    """A finished 10-step run (warmup 2, cosine to 0.1) extended to 15 steps, or resumed with another peak LR:
    steps 11.. use the new schedule's LR at their step, as a run started with the new settings would; the same
    settings resume unchanged."""
    from torchtitan.components.lr_scheduler import LRSchedulersContainer

    cfg = LRScheduler(warmup_steps=2, decay_type="cosine", min_lr_factor=0.1)
    first = _Optimizers(1e-3)
    first_sched = LRSchedulersContainer(first, cfg, 10)
    _run(first, first_sched, 10)
    optimizer_state, schedule_state = first.optimizers[0].state_dict(), first_sched.state_dict()

    resumed = _Optimizers(new_lr)
    sched = LRSchedulersContainer(resumed, cfg, new_total)
    resumed.optimizers[0].load_state_dict(optimizer_state)  # as the checkpoint loads them: optimizer first
    sched.load_state_dict(schedule_state)
    got = _run(resumed, sched, new_total - 10) if new_total > 10 else [resumed.optimizers[0].param_groups[0]["lr"]]
    expected = [new_lr * f for f in factors(new_total, warmup_steps=2, decay_type="cosine", min_lr_factor=0.1)]
    assert got == pytest.approx(expected[10:] if new_total > 10 else [new_lr * 0.1], rel=1e-12)
    assert sched.state_dict()["base_lrs"] == [new_lr]
