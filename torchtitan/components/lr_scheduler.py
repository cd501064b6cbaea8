"""Warmup, then an optional stable phase, then decay (linear, sqrt or cosine) to min_lr_factor x lr."""

from __future__ import annotations

import copy
import math
from functools import partial

import torch

from torchtitan.config.job_config import LRScheduler as LRSchedulerConfig
from torchtitan.tools.logging import logger


def lr_factor(step: int, *, warmup_steps: int, stable_end: int, decay_steps: int, decay_type: str,
              min_lr_factor: float) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0 = the first step).

    Warmup starts at 1/(warmup+1), not 0, so the first step already moves the weights.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step < stable_end or decay_steps <= 0:
        return 1.0
    progress = min((step - stable_end + 1) / decay_steps, 1.0)
    if decay_type == "linear":
        curve = 1.0 - progress
    elif decay_type == "sqrt":
        curve = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        curve = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler.decay_type: unknown '{decay_type}'")
    return min_lr_factor + (1.0 - min_lr_factor) * curve


def schedule_bounds(cfg: LRSchedulerConfig, total_steps: int) -> tuple[int, int, int]:
    """(warmup_steps, stable_end, decay_steps): decay_ratio=None decays over everything after warmup (WSD
    with a one-step stable phase); decay_ratio=r decays over the last r x steps.

    The step right after warmup always runs at the peak LR (factor 1.0): warmup ends at w/(w+1), and a decay
    phase of d steps starts at 1 - (1 - min)/d, so without that one stable step the configured peak would
    never be used (and warmup_steps=0 would not start at the peak). The last step runs at min_lr_factor.
    """
    warmup = cfg.warmup_steps
    if warmup > total_steps:
        logger.warning(f"lr_scheduler.warmup_steps={warmup} exceeds training.steps={total_steps}: "
                       "the LR never reaches its peak")
    max_decay = max(total_steps - warmup - 1, 0)  # keep one step at the peak LR after warmup
    if cfg.decay_ratio is None:
        decay_steps = max_decay
    else:
        decay_steps = round(cfg.decay_ratio * total_steps)
        if warmup + decay_steps > total_steps:
            logger.warning(f"lr_scheduler: warmup ({warmup}) + decay ({decay_steps}) steps exceed "
                           f"training.steps={total_steps}; decay starts right after warmup")
        decay_steps = min(decay_steps, max_decay)
    stable_end = total_steps - decay_steps
    return warmup, stable_end, decay_steps


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig,
                       total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup, stable_end, decay_steps = schedule_bounds(cfg, total_steps)
    fn = partial(lr_factor, warmup_steps=warmup, stable_end=stable_end, decay_steps=decay_steps,
                 decay_type=cfg.decay_type, min_lr_factor=cfg.min_lr_factor)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


class LRSchedulersContainer:
    """One scheduler per optimizer of an OptimizersContainer, stepped together. They agree at every step, so the
    checkpoint holds one state (the first's) and loads it into all: it does not depend on the number of parts.

    The schedule is a function of this run's config evaluated at the step reached: loading a checkpoint takes
    only the step count from it. A run extended with a larger training.steps (or another peak LR, warmup or
    decay) therefore continues exactly as a run started with these settings would at that step, from the first
    resumed step on (docs/checkpointing.md, "Resume": extending a run)."""

    def __init__(self, optimizers, cfg: LRSchedulerConfig, total_steps: int):
        self.schedulers = [build_lr_scheduler(opt, cfg, total_steps) for opt in optimizers.optimizers]
        self.total_steps = total_steps
        # this run's peak LRs: loading the optimizer's state brings back the checkpointed run's
        self._base_lrs = [list(s.base_lrs) for s in self.schedulers]

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Take the step count from `state` and set every group's LR from this run's schedule at that step (the
        optimizer's state, loaded before, holds the LR the checkpointed run's schedule gave it)."""
        for scheduler, base_lrs in zip(self.schedulers, self._base_lrs, strict=True):
            scheduler.load_state_dict(copy.deepcopy(state))
            scheduler.base_lrs = list(base_lrs)
            groups = scheduler.optimizer.param_groups
            saved = [group["lr"] for group in groups]
            for group, base, factor in zip(groups, base_lrs, scheduler.lr_lambdas, strict=True):
                group["initial_lr"] = base
                group["lr"] = base * factor(scheduler.last_epoch)
            scheduler._last_lr = [group["lr"] for group in groups]
            changed = [(old, group["lr"]) for old, group in zip(saved, groups, strict=True)
                       if not math.isclose(old, group["lr"], rel_tol=1e-9, abs_tol=0.0)]
            if changed and scheduler is self.schedulers[0]:
                old, new = changed[0]
                logger.info(f"lr_scheduler: the schedule differs from the checkpointed run's (training.steps, "
                            f"lr_scheduler.* or optimizer.lr changed): step {scheduler.last_epoch + 1} runs at lr "
                            f"{new:.4g} instead of {old:.4g}, following this run's schedule over "
                            f"{self.total_steps} steps")
