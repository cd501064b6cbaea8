"""A tokenizer for tiktoken-format BPE files, such as Llama 3's tokenizer.model.

The file holds one `base64(token bytes) rank` pair per line; ranks must be exactly 0..n-1. It is
read through blobfile, so gs://, az:// and https:// paths work like local ones, and turned into a
`tiktoken.Encoding` with Llama 3's pre-tokenization regex.

Special tokens follow Meta's Llama 3 tokenizer: 256 ids appended after the n mergeable ranks.

    n+0 <|begin_of_text|> (BOS)     n+4 <|finetune_right_pad_id|>   n+8  <|eom_id|>
    n+1 <|end_of_text|>   (EOS)     n+5 <|step_id|>                 n+9  <|eot_id|>
    n+2 <|reserved_special_token_0|> n+6 <|start_header_id|>        n+10 <|python_tag|>
    n+3 <|reserved_special_token_1|> n+7 <|end_header_id|>          n+11..n+255 <|reserved_special_token_2..246|>

These are the names of Llama 3.1 and later (llama-models). Llama 3.0 used the same ids for BOS, EOS,
the header tokens and <|eot_id|> (128000, 128001, 128006, 128007, 128009 with n = 128000) and called
every other slot <|reserved_special_token_K|>; ids, and so trained models, are identical.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from torchtitan.data.tokenizer_base import BaseTokenizer
from torchtitan.tools.logging import logger

__all__ = ["LLAMA3_PATTERN", "NUM_SPECIAL_TOKENS", "TIKTOKEN_SUFFIXES", "TikTokenTokenizer", "llama3_special_tokens"]

TIKTOKEN_SUFFIXES = (".model", ".tiktoken")
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIAL = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
    "<|eot_id|>", "<|python_tag|>",
)  # fmt: skip

# tiktoken's regex engine backtracks recursively: one call on ~2M characters of whitespace overflows
# its stack (a Rust panic, measured), and merging one huge pre-token is superlinear (~0.4 s for 400K
# letters). So text goes to tiktoken in chunks of at most this many characters.
_MAX_CHUNK_CHARS = 25_000
# A chunk ends just before a space that follows a visible non-space character. No pre-token of the
# pattern above ever spans such a pair, and matching never looks behind, so cutting there gives
# exactly the ids of encoding the whole text. Only text with no such pair in 25K characters (a run
# of whitespace, or of non-space, e.g. minified code) is cut blindly, which may change a few ids
# at the cut, as in Meta's reference (which cuts runs at 25K characters), but always round-trips.
_SAFE_CUT = re.compile(r"\S ")


def llama3_special_tokens(num_base_tokens: int) -> dict[str, int]:
    """Llama 3's 256 special tokens and their ids, placed after `num_base_tokens` mergeable ranks."""
    reserved = [f"<|reserved_special_token_{k}|>" for k in range(2, 2 + NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL))]
    return {name: num_base_tokens + i for i, name in enumerate(list(_NAMED_SPECIAL) + reserved)}


def _safe_cut(text: str, lo: int, hi: int) -> int | None:
    """The first index in [lo, hi] where a chunk may end without changing the encoding, if any."""
    match = _SAFE_CUT.search(text, lo - 1, hi + 1)
    while match is not None:
        # isprintable() rules out control and format characters, about which Python's and
        # tiktoken's ideas of "whitespace" might differ.
        if text[match.start()].isprintable():
            return match.start() + 1
        match = _SAFE_CUT.search(text, match.start() + 1, hi + 1)
    return None


def _chunks(text: str) -> Iterator[str]:
    pos, half = 0, _MAX_CHUNK_CHARS // 2
    while len(text) - pos > _MAX_CHUNK_CHARS:
        end = pos + _MAX_CHUNK_CHARS
        # Prefer a cut in the second half (chunks stay large); else anywhere; else a blind cut.
        cut = _safe_cut(text, pos + half, end) or _safe_cut(text, pos + 1, pos + half) or end
        yield text[pos:cut]
        pos = cut
    yield text[pos:]


def _read_ranks(path: str) -> dict[bytes, int]:
    import blobfile

    try:
        with blobfile.BlobFile(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"model.tokenizer_path: tokenizer file not found: {path}") from None
    except OSError as e:
        raise ValueError(f"model.tokenizer_path: cannot read {path}: {e}") from None
    ranks: dict[bytes, int] = {}
    lines = 0
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        lines += 1
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(
                f"model.tokenizer_path: {path} line {lineno} is not 'base64-token rank': not a tiktoken BPE file "
                f"(a SentencePiece .model, as Llama 2 ships, is not supported)"
            ) from None
    if not ranks or len(ranks) != lines or sorted(ranks.values()) != list(range(len(ranks))):
        # Special tokens are placed at n, n+1, ...: ranks with gaps or repeats would collide with them.
        raise ValueError(f"model.tokenizer_path: {path}: ranks must be 0..n-1, each token once")
    return ranks


class TikTokenTokenizer(BaseTokenizer):
    """A tiktoken BPE file with Llama 3's pre-tokenizer and special tokens; BOS/EOS = begin/end_of_text."""

    def __init__(self, path: str | Path) -> None:
        import tiktoken

        self.path = path if "://" in str(path) else Path(path).expanduser()
        ranks = _read_ranks(str(self.path))
        special = llama3_special_tokens(len(ranks))
        # A name no tiktoken registry knows: tiktoken pickles registered encodings by name and would
        # then re-download them on unpickling; ours pickle by value.
        self.encoding = tiktoken.Encoding(
            name=f"torchtitan:{Path(str(path)).name}", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
            special_tokens=special, explicit_n_vocab=len(ranks) + NUM_SPECIAL_TOKENS,
        )  # fmt: skip
        self.num_base_tokens = len(ranks)
        self.special_tokens = special
        self.bos_id = special["<|begin_of_text|>"]
        self.eos_id = special["<|end_of_text|>"]
        self.vocab_size = len(ranks) + NUM_SPECIAL_TOKENS
        logger.info(f"Loaded tiktoken tokenizer {self.path}: vocab_size={self.vocab_size} "
                    f"bos_id={self.bos_id} eos_id={self.eos_id}")  # fmt: skip

    def _encode_text(self, text: str) -> list[int]:
        if len(text) <= _MAX_CHUNK_CHARS:  # the common case: one call, no chunking work
            return self.encoding.encode_ordinary(text)
        ids: list[int] = []
        for chunk in _chunks(text):
            ids.extend(self.encoding.encode_ordinary(chunk))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        # Bytes that are not valid UTF-8 on their own (a cut multi-byte character) become U+FFFD.
        return self.encoding.decode(list(ids))
