"""Save-and-exit on a signal (cluster preemption, time limits), agreed by every rank.

torchrun forwards the signal to every rank, but ranks may sit in different steps when it lands; a rank that
saves while another trains on would deadlock both in mismatched collectives. So the flag is OR-reduced over
the world once per step and every rank acts on the same step.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from torchtitan.tools.logging import logger


class PreemptionFlag:
    def __init__(self, signal_name: str):
        """signal_name: SIGTERM | SIGUSR1 | none."""
        self.name = signal_name
        self._received = False
        self.enabled = signal_name != "none"
        if self.enabled:
            signal.signal(getattr(signal, signal_name), self._handler)

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if not self._received:
            logger.info(f"{self.name} received: saving a checkpoint after the current step")
        self._received = True

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank has received the signal (one tiny all-reduce per step)."""
        if not self.enabled:
            return False
        flag = torch.tensor([1 if self._received else 0], dtype=torch.int32, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
