"""Imported first by the fork server (tests/forking.py): the garbage collector stays paused while the server
preloads torch and the package (torchtitan/tools/startup_gc.py); tests/forkserver_heap.py, imported last, freezes
what the preloads built and turns collection back on, which every forked child inherits."""

from torchtitan.tools import startup_gc

startup_gc.pause()
