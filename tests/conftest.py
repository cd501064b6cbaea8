"""The garbage collector of each pytest process that collects tests, as a training rank has it
(torchtitan/tools/startup_gc.py): paused while collection imports every test module (torch, transformers, the
whole package), then that heap frozen, so neither the tests' full collections nor the exit-time one walk it again.
The pytest-xdist controller collects nothing and keeps the default."""

from __future__ import annotations

import os

from torchtitan.tools import startup_gc


def pytest_configure(config):
    is_xdist_controller = bool(getattr(config.option, "numprocesses", None)) and not os.environ.get(
        "PYTEST_XDIST_WORKER")
    if not is_xdist_controller:
        startup_gc.pause()


def pytest_collection_finish(session):
    startup_gc.freeze_and_resume()
