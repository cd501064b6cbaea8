from __future__ import annotations

import logging

import pytest

from torchtitan.tools.logging import logger as tt_logger


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_log():
    """The package logger's warnings during the test. It may not propagate (init_logger), so a handler is attached
    to it directly."""
    handler = _Capture()
    old_level = tt_logger.level
    tt_logger.addHandler(handler)
    if tt_logger.getEffectiveLevel() > logging.WARNING:
        tt_logger.setLevel(logging.WARNING)
    try:
        yield handler.messages
    finally:
        tt_logger.removeHandler(handler)
        tt_logger.setLevel(old_level)
