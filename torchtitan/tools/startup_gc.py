"""The garbage collector while a process starts: paused during the imports, then everything they built moved out of
every later collection (docs/performance.md, "Launch to the first step").

`import torchtitan.train` builds ~400,000 objects that live as long as the process: torch's modules and operator
tables, DTensor's and FSDP's. With the collector on, allocation counts trigger full collections over that growing
heap while the imports run (five of them), every later full collection walks the whole heap again, and so does the
interpreter's collection at exit. Frozen (gc.freeze), those objects sit in a permanent generation that no
collection visits. The cyclic garbage the imports leave (~7,000 objects, 1-2 MB) is frozen with them: freeing it
would take one more full collection (0.26 s).
"""

from __future__ import annotations

import gc

_was_on: bool | None = None  # whether collection was on before pause(); None when not paused


def pause() -> None:
    """Stops automatic collection before the imports (until `freeze_and_resume`)."""
    global _was_on
    if _was_on is None:
        _was_on = gc.isenabled()
    gc.disable()


def freeze_and_resume() -> None:
    """After the imports: freezes every object that exists now and turns automatic collection back on if pause()
    found it on. Does nothing when collection was not paused (a module imported by another program)."""
    global _was_on
    if _was_on is None:
        return
    gc.freeze()
    if _was_on:
        gc.enable()
    _was_on = None
