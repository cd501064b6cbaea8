"""Save-and-exit on a signal (cluster preemption, time limits), agreed by every rank.

torchrun forwards the signal to every rank, but ranks may sit in different steps when it lands; a rank that
saves while another trains on would deadlock both in mismatched collectives. So the flag is OR-reduced over
the world once per step (components/step_guard.py) and every rank acts on the same step.

A rank that is stuck (a hung data read, a collective whose peer died) never reaches the end of its step, so it
would ignore the signal until the launcher's SIGKILL. After the signal it therefore gets a grace period (the
trainer sets comm.train_timeout_seconds): if it has not acknowledged the signal at a step boundary by then, it
exits with code 1 and says why.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from torchtitan.tools.logging import logger


class PreemptionFlag:
    def __init__(self, signal_name: str, grace_s: float = 300.0):
        """signal_name: SIGTERM | SIGUSR1 | none."""
        self.name = signal_name
        self.grace_s = grace_s
        """seconds a rank may take, after the signal, to reach a step boundary before it exits as stuck"""
        self._received = False
        self._acknowledged = threading.Event()
        self.enabled = signal_name != "none"
        if self.enabled:
            signal.signal(getattr(signal, signal_name), self._handler)

    @property
    def received(self) -> bool:
        return self._received

    def acknowledge(self) -> None:
        """The trainer reached a step boundary with the stop agreed: it will save and exit, not hang."""
        self._acknowledged.set()

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self._received:
            return
        self._received = True
        logger.info(f"{self.name} received: saving a checkpoint after the current step")
        watchdog = threading.Thread(target=self._exit_if_stuck, name="preemption-watchdog", daemon=True)
        watchdog.start()

    def _exit_if_stuck(self) -> None:
        if self._acknowledged.wait(self.grace_s):
            return
        print(f"{self.name} received, but this rank did not reach the end of its step within {self.grace_s:.0f} s: "
              "it is stuck; exiting without a checkpoint", file=sys.stderr, flush=True)
        os._exit(1)
