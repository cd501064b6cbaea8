"""Named text corpora for pretraining, shipped with every Python install so runs need no downloads.

A dataset is a zero-argument callable returning a fresh iterator of documents (strings). Each call
must yield the same documents in the same order, in every process: the dataloader relies on that
to shard by global sequence index, and the tokenizer cache relies on it to train reproducibly.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import random
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from torchtitan.tools.logging import logger

__all__ = ["DATASETS", "corpus_fingerprint", "iter_documents"]

# Directory names pruned anywhere under the stdlib root. Test suites are excluded because they are
# full of deliberately odd code (bad encodings, syntax-error fixtures, huge generated literals) and
# would dominate the corpus (`test/` alone is larger than the rest of the stdlib). This covers
# test/, idlelib/idle_test/, lib2to3/tests/, ctypes/test/, tkinter/test/, unittest/test/,
# distutils/tests/ and the like. site-packages/ holds third-party code that differs per install.
# __pycache__ holds only bytecode.
_EXCLUDED_DIR_NAMES = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# Build-specific generated files: they differ between builds of the same Python version, which
# would make the corpus (and the tokenizer cache key) machine-dependent for no benefit.
_EXCLUDED_DIR_PREFIXES = ("config-",)
_EXCLUDED_FILE_PREFIXES = ("_sysconfigdata_",)
# pydoc_data/topics.py is one big dict literal of the help topics; we add those texts as separate
# plain-text documents instead, so the source file would only duplicate them.
_EXCLUDED_REL_PATHS = frozenset({"pydoc_data/topics.py"})

# A constant (not the training seed): the document order is part of the dataset's identity, so
# runs with different training seeds still see the same data stream.
_SHUFFLE_SEED = 20240917


@dataclass(frozen=True)
class _Source:
    """One document of the stdlib corpus: a source file (path set) or a pydoc topic (topic set)."""

    key: str  # relative path or "pydoc_data/topics:<name>"; stable across machines
    size: int  # bytes on disk, or characters of the topic text
    path: Path | None = None
    topic: str | None = None


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIR_NAMES or name.startswith(_EXCLUDED_DIR_PREFIXES)


@functools.lru_cache(maxsize=1)
def _stdlib_sources() -> tuple[_Source, ...]:
    """The stdlib corpus's document list, in its fixed shuffled order (cached per process)."""
    root = _stdlib_root()
    files: list[_Source] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into (large) excluded trees.
        dirnames[:] = [d for d in dirnames if not _is_excluded_dir(d)]
        for fname in filenames:
            if not fname.endswith(".py") or fname.startswith(_EXCLUDED_FILE_PREFIXES):
                continue
            path = Path(dirpath) / fname
            rel = path.relative_to(root).as_posix()
            if rel in _EXCLUDED_REL_PATHS:
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue  # dangling symlink or similar: not part of the corpus
            files.append(_Source(key=rel, size=size, path=path))
    # os.walk order depends on the filesystem; sort by relative path so every machine agrees.
    files.sort(key=lambda s: s.key)

    from pydoc_data.topics import topics

    topic_sources = [
        _Source(key=f"pydoc_data/topics:{name}", size=len(topics[name]), topic=name) for name in sorted(topics)
    ]
    sources = files + topic_sources
    # Shuffle so the first batches (and the tokenizer's training sample) mix packages and prose
    # instead of being all of asyncio/ then all of email/. random.Random's shuffle is stable for a
    # given seed on a given Python, which is all we need (the fingerprint includes the version).
    random.Random(_SHUFFLE_SEED).shuffle(sources)
    return tuple(sources)


# Names whose skipped-file count was already logged in this process (log it once, not per epoch).
_logged_skips: set[str] = set()


def _iter_stdlib() -> Iterator[str]:
    from pydoc_data.topics import topics

    skipped = 0
    for source in _stdlib_sources():
        if source.path is not None:
            try:
                text = source.path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                skipped += 1
                continue
        else:
            text = topics[source.topic]
        if not text.strip():
            continue
        yield text
    if skipped and "python_stdlib" not in _logged_skips:
        _logged_skips.add("python_stdlib")
        logger.info(f"training.dataset 'python_stdlib': skipped {skipped} files that are not readable UTF-8")


DATASETS: dict[str, Callable[[], Iterator[str]]] = {
    "python_stdlib": _iter_stdlib,
}


def _lookup(name: str) -> Callable[[], Iterator[str]]:
    if name not in DATASETS:
        raise ValueError(f"training.dataset: unknown dataset '{name}'; known: {', '.join(sorted(DATASETS))}")
    return DATASETS[name]


def iter_documents(name: str) -> Iterator[str]:
    """A fresh iterator over the documents of dataset `name`, in its fixed order.

    Not a generator function itself, so an unknown name raises here rather than on first next().
    """
    return _lookup(name)()


def corpus_fingerprint(name: str) -> str:
    """A short hash identifying the document list of `name` (used as the tokenizer-cache key).

    Built from the document keys and sizes plus the Python version, without reading file
    contents, so it is cheap enough to compute on every start.
    """
    _lookup(name)
    h = hashlib.sha256()
    h.update(f"{name}\n{sys.implementation.name}-{platform.python_version()}\n".encode())
    if name == "python_stdlib":
        for source in _stdlib_sources():
            h.update(f"{source.key}\t{source.size}\n".encode())
    # Datasets registered later without a document list are identified by name and version only.
    return h.hexdigest()[:12]
