"""One logger for the whole package. torchrun prefixes each line with its rank and LOG_RANK picks which
ranks are shown, so the logger itself adds no rank prefix and logs on every rank."""

from __future__ import annotations

import logging

logger = logging.getLogger("torchtitan")


def init_logger() -> None:
    """Configure the package logger once: time, level, message at INFO."""
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
