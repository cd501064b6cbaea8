"""Let `python scripts/<name>.py` work with any Python, as `./run_train.sh` does.

A script that needs torch and the project's dependencies calls `use_project_python()` before importing them. When
the running interpreter lacks them (the system Python, while the project lives in `./.venv`), it finds or creates
the project's environment with scripts/bootstrap.sh, the same code run_train.sh sources, and runs the script again
there with the same arguments. An interpreter that already has everything (a cluster's own environment) is used
as it is.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NEEDED = ("torch", "tokenizers", "torchdata", "safetensors", "datasets")
_AGAIN = "TORCHTITAN_SCRIPT_REEXEC"  # set for the second run: never loop between interpreters


def use_project_python() -> None:
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if not missing:
        if sys._getframe(1).f_globals.get("__name__") == "__main__":  # run as a program, not imported by a test
            _pause_collection_for_the_imports()
        return
    if os.environ.get(_AGAIN):
        raise SystemExit(f"{sys.executable} still lacks {', '.join(missing)} (chosen by scripts/bootstrap.sh)")
    # bootstrap.sh prints its progress on stderr (shown to the user) and leaves the interpreter in $PYTHON.
    found = subprocess.run(["bash", "-c", 'unset PYTHON; source scripts/bootstrap.sh && printf %s "$PYTHON"'],
                           cwd=REPO, stdout=subprocess.PIPE, text=True)
    if found.returncode != 0 or not found.stdout:
        raise SystemExit(f"{sys.argv[0]}: {sys.executable} lacks {', '.join(missing)} and scripts/bootstrap.sh "
                         "could not set up the project's environment (see above)")
    os.environ[_AGAIN] = "1"
    os.execv(found.stdout, [found.stdout, *sys.argv])


def _pause_collection_for_the_imports() -> None:
    """The script's own imports follow with the garbage collector paused; its `__main__` block then calls
    startup_gc.freeze_and_resume() (torchtitan/tools/startup_gc.py; tests/unit/test_startup_gc.py checks every
    script does). Skipped where torchtitan itself is not importable: the script fails on its own import then."""
    try:
        from torchtitan.tools import startup_gc
    except ImportError:
        return
    startup_gc.pause()
