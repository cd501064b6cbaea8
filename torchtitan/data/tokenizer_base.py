"""The interface every tokenizer implements (tokenizer.py, tiktoken_tokenizer.py), all the data pipeline needs.

In a module of its own so that the tokenizer implementations and the builder in tokenizer.py import it one way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

__all__ = ["BaseTokenizer"]


class BaseTokenizer(ABC):
    """What the data pipeline needs: ids for text, text for ids, and the document-boundary tokens.

    vocab_size covers every id the tokenizer can emit (the model's embedding must be at least that
    big). Subclasses set path, vocab_size, bos_id and eos_id, and must pickle (dataloader workers
    each get a copy). Text that merely spells a special token is encoded as plain text: only the
    data pipeline inserts BOS/EOS, so documents cannot forge their own boundaries.
    """

    path: Path | str
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = self._encode_text(text)
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    @abstractmethod
    def _encode_text(self, text: str) -> list[int]:
        """The ids of `text`, no BOS/EOS added, special-token spellings treated as text."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; special tokens appear as their names, so packed data shows boundaries."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id})"
        )
