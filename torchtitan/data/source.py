"""The base of every document source: a fixed, resumable sequence of raw records (see datasets.py).

In a module of its own so that the sources (datasets.py, hf_sources.py) and the dataloader import it one way.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

from torchtitan.tools.logging import logger

__all__ = ["ConversationSource", "DocumentSource"]

_SKIP_LOG_EVERY = 100_000


class DocumentSource:
    """A deterministic sequence of raw records; `iter_documents` yields the usable ones with their index."""

    def __init__(self, name: str, key_prefix: str, num_documents: int | None) -> None:
        self.name = name  # for messages: the registry name or the dataset_path
        self.key_prefix = key_prefix
        self.num_documents = num_documents  # raw records, bad ones included; None when unknown
        self.skipped_documents = 0  # bad records met so far in the current (or last) pass
        self._reported = False

    def iter_documents(self, start: int = 0) -> Iterator[tuple[int, str]]:
        """(raw_index, text) for every usable record from raw index `start` on, in the fixed order."""
        if start < 0:
            raise ValueError(f"{self.key_prefix}.dataset '{self.name}': start must be >= 0, got {start}")
        self.skipped_documents = 0
        for index, value in self._iter_raw(start):
            # isspace() instead of strip(): no copy of a possibly huge document.
            if isinstance(value, str) and value and not value.isspace():
                yield index, value
                continue
            self.skipped_documents += 1
            if self.skipped_documents % _SKIP_LOG_EVERY == 0:
                logger.info(f"{self._label()}: skipped {self.skipped_documents} records so far (at {index})")
        if self.skipped_documents and not self._reported:
            self._reported = True  # once per process, not every epoch
            logger.info(f"{self._label()}: skipped {self.skipped_documents} empty or non-text records "
                        f"(of records {start} onwards); their indexes stay reserved")  # fmt: skip

    def own_loader(self, **loader_args: Any) -> Any:
        """A loader this source builds itself (a pre-tokenized folder reads its windows by index), or None: the
        dataloader then packs iter_documents (torchtitan/data/dataloader.py, which calls this with its arguments)."""
        return None

    def _label(self) -> str:
        return f"{self.key_prefix}.dataset '{self.name}'"

    def _iter_raw(self, start: int) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, num_documents={self.num_documents})"


def _first_worker() -> bool:
    if "torch.utils.data" not in sys.modules:  # the launcher's check, which must not import torch
        return True
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return info is None or info.id == 0  # every worker reads every record: one of them reports


class ConversationSource(DocumentSource):
    """A source whose documents are JSON lists of messages: `to_messages(raw record)` gives a record's messages or
    why it has none. `bad` counts the skipped records of the current (or last) pass by reason; their raw indexes stay
    reserved, so resume cursors never shift."""

    format = "chat"

    def __init__(self, name: str, key_prefix: str, num_documents: int | None) -> None:
        super().__init__(name, key_prefix, num_documents)
        self.bad: Counter[str] = Counter()

    def to_messages(self, record: Any) -> list[dict[str, str]] | str:
        raise NotImplementedError

    def iter_documents(self, start: int = 0) -> Iterator[tuple[int, str]]:
        if start < 0:
            raise ValueError(f"{self.key_prefix}.dataset '{self.name}': start must be >= 0, got {start}")
        self.bad, self.skipped_documents = Counter(), 0
        for index, record in self._iter_raw(start):
            messages = self.to_messages(record)
            if isinstance(messages, str):
                self.bad[messages] += 1
                self.skipped_documents += 1
                continue
            yield index, json.dumps(messages, ensure_ascii=False)
        if self.bad and not self._reported and _first_worker():
            self._reported = True  # once per process, not every epoch
            logger.info(f"{self._label()}: skipped {self.bad_summary()} (of records {start} onwards)")

    def bad_summary(self) -> str:
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(self.bad.items()))
        return f"{sum(self.bad.values())} bad records: {reasons}"
