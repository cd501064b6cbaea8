"""Small filesystem helpers shared by the checkpoint and Hugging Face writers."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in `path` durable: they are only once the directory itself is synced."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform or filesystem can open a directory; best effort
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
