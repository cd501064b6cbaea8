"""Tokenizers: the default byte-level BPE trained on the embedded corpus, a tokenizer.json, or tiktoken.

The default is trained on first use and cached on disk keyed by the corpus fingerprint, so every
later run (and every other rank on the machine) just loads it. Training is deterministic, so two
machines with the same Python produce byte-identical tokenizer files. Users point
`model.tokenizer_path` at an HF tokenizer.json (`Tokenizer`) or at a tiktoken-format BPE file such
as Llama 3's tokenizer.model (`TikTokenTokenizer`, in tiktoken_tokenizer.py); both implement
`BaseTokenizer`, which is all the data pipeline relies on.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from torchtitan.data.datasets import build_document_source, corpus_fingerprint
from torchtitan.data.tiktoken_tokenizer import TIKTOKEN_SUFFIXES, TikTokenTokenizer
from torchtitan.data.tokenizer_base import BaseTokenizer
from torchtitan.tools.logging import logger

__all__ = [
    "BOS_TOKEN", "EOS_TOKEN", "DEFAULT_VOCAB_SIZE", "Tokenizer", "build_tokenizer",
    "default_cache_dir",
]  # fmt: skip

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
DEFAULT_DATASET = "python_stdlib"
DEFAULT_VOCAB_SIZE = 8192  # total, special tokens included
# The whole corpus is ~12 MB; 10 MB of its (shuffled) documents gives the same merges to within
# noise while keeping the one-time training at a few seconds on two cores.
_TRAIN_BYTES = 10_000_000
# Llama 3's chat tokens, so that chat data renders with the built-in llama3 template on the default tokenizer (the
# debug SFT recipes, docs/finetuning.md). Bumping _SPECIALS_VERSION retires tokenizers cached with other specials.
CHAT_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
_SPECIALS_VERSION = 2
_MIN_VOCAB_SIZE = 256 + 2 + len(CHAT_TOKENS)  # the byte symbols, BOS and EOS, the chat tokens

# Fallback names when no tokenizer_config.json says which tokens are BOS/EOS, in precedence order.
# GPT-2 style vocabularies only have <|endoftext|>, which then serves as both BOS and EOS. For EOS,
# the document-end tokens come before <|eot_id|> (Llama 3's end-of-turn), since we pack documents.
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<|endoftext|>")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<|eot_id|>")


def default_cache_dir() -> Path:
    """Where derived artifacts (trained tokenizers) live: $TORCHTITAN_CACHE_DIR or ~/.cache/torchtitan."""
    env = os.environ.get("TORCHTITAN_CACHE_DIR")
    return Path(env).expanduser() if env else Path("~/.cache/torchtitan").expanduser()


def _first_line(err: BaseException) -> str:
    # Errors from the Rust side can span lines; keep our messages to one.
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class Tokenizer(BaseTokenizer):
    """A `tokenizers.Tokenizer` (an HF tokenizer.json) plus the BOS/EOS ids the data pipeline needs.

    bos_token/eos_token name the special tokens explicitly; when omitted, the first well-known
    name present in the vocabulary is used.
    """

    def __init__(self, path: str | os.PathLike, bos_token: str | None = None, eos_token: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"model.tokenizer_path: tokenizer file not found: {self.path}")
        try:
            self.backend = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # the Rust loader raises a bare Exception on malformed files
            raise ValueError(f"model.tokenizer_path: cannot load {self.path}: {_first_line(e)}") from None
        # Text that merely spells a special token (code about tokenizers, say) must stay plain text:
        # only the data pipeline may insert BOS/EOS, or documents could forge their own boundaries.
        self.backend.encode_special_tokens = True
        self.bos_id = self._resolve("BOS", bos_token, _BOS_CANDIDATES)
        self.eos_id = self._resolve("EOS", eos_token, _EOS_CANDIDATES)
        vocab = self.backend.get_vocab(with_added_tokens=True)
        # Added tokens may sit above a gap in the id space; the embedding must cover the max id.
        self.vocab_size = max(self.backend.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)

    def __setstate__(self, state: dict) -> None:
        # A tokenizers.Tokenizer pickles as its JSON, which does not record encode_special_tokens:
        # without this, dataloader workers would turn spelled-out special tokens into real ones.
        self.__dict__.update(state)
        self.backend.encode_special_tokens = True

    def _resolve(self, kind: str, name: str | None, candidates: Sequence[str]) -> int:
        if name is not None:
            token_id = self.backend.token_to_id(name)
            if token_id is None:
                raise ValueError(f"model.tokenizer_path: {kind} token {name!r} is not in the vocabulary of {self.path}")
            return token_id
        for candidate in candidates:
            token_id = self.backend.token_to_id(candidate)
            if token_id is not None:
                return token_id
        raise ValueError(
            f"model.tokenizer_path: no {kind} token in {self.path} (looked for {', '.join(candidates)}; "
            f"name it as {kind.lower()}_token in a tokenizer_config.json next to it)"
        )

    def _encode_text(self, text: str) -> list[int]:
        # add_special_tokens=False: a loaded tokenizer.json may carry a post-processor that adds
        # its own BOS; the base class adds BOS/EOS so the result is the same for every tokenizer.
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


def _special_name(value: object, config_path: Path, key: str) -> str | None:
    """bos_token/eos_token in tokenizer_config.json: a string, {"content": ...}, or absent/null."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"model.tokenizer_path: {config_path}: '{key}' must be a string or {{\"content\": ...}}")


def _load_user_tokenizer(tokenizer_path: str) -> Tokenizer:
    path = Path(tokenizer_path).expanduser()
    directory = path if path.is_dir() else path.parent
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"model.tokenizer_path: tokenizer file not found: {file}")
    bos_name = eos_name = None
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"model.tokenizer_path: cannot read {config_path}: {_first_line(e)}") from None
        if not isinstance(config, dict):
            raise ValueError(f"model.tokenizer_path: {config_path} is not a JSON object")
        bos_name = _special_name(config.get("bos_token"), config_path, "bos_token")
        eos_name = _special_name(config.get("eos_token"), config_path, "eos_token")
    tok = Tokenizer(file, bos_token=bos_name, eos_token=eos_name)
    logger.info(f"Loaded tokenizer {file}: vocab_size={tok.vocab_size} bos_id={tok.bos_id} eos_id={tok.eos_id}")
    return tok


def _training_sample(dataset: str, max_bytes: int) -> Iterator[str]:
    """The corpus's first documents (in its fixed shuffled order) up to about max_bytes of UTF-8."""
    used = 0
    for _, doc in build_document_source(dataset=dataset, dataset_path="").iter_documents():
        if used >= max_bytes:
            return
        used += len(doc.encode("utf-8"))
        yield doc


def _train_bpe(dataset: str, vocab_size: int, max_bytes: int) -> tokenizers.Tokenizer:
    # Byte-level BPE with the full 256-symbol byte alphabet seeded up front, so any string encodes
    # (no unknown token) even if some bytes never occur in the training sample.
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_sample(dataset, max_bytes), trainer=trainer)
    return tok


def _build_default(cache_dir: Path, vocab_size: int) -> Tokenizer:
    fingerprint = corpus_fingerprint(DEFAULT_DATASET)
    out_dir = cache_dir / "tokenizers"
    target = out_dir / f"{DEFAULT_DATASET}-bpe{vocab_size}-s{_SPECIALS_VERSION}-{fingerprint}.json"
    if not target.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        # Ranks on one machine race here: the first to take the lock trains, the others block on
        # it and then find the finished file. flock is released by the kernel if the holder dies,
        # so a crashed trainer just hands the job to the next waiter. The lock file is left in
        # place on purpose: unlinking it would let a late arrival lock a different inode.
        with open(target.with_name(target.name + ".lock"), "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                if not target.is_file():
                    _train_and_save(target, vocab_size)
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    tok = Tokenizer(target, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN)
    logger.info(f"Tokenizer: {target} (vocab_size={tok.vocab_size})")
    return tok


def _train_and_save(target: Path, vocab_size: int) -> None:
    logger.info(f"Training the default {vocab_size}-token byte-level BPE on '{DEFAULT_DATASET}' -> {target}")
    start = time.perf_counter()
    backend = _train_bpe(DEFAULT_DATASET, vocab_size, _TRAIN_BYTES)
    # Write a temp file in the same directory and rename it over the target: os.replace is atomic
    # on POSIX, so readers never see a half-written tokenizer.json.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}.", suffix=".tmp")
    os.close(fd)
    try:
        backend.save(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache may be shared with other users
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    logger.info(f"Trained tokenizer in {time.perf_counter() - start:.1f}s")


def build_tokenizer(tokenizer_path: str, cache_dir: str | os.PathLike, model_vocab_size: int | None = None
                    ) -> BaseTokenizer:
    """The tokenizer for `model.tokenizer_path`.

    "" means the default: a byte-level BPE with DEFAULT_VOCAB_SIZE tokens (fewer when `model_vocab_size`, the
    model's embedding size, is smaller: small test models then get a matching tokenizer) trained on the
    python_stdlib corpus and cached under `<cache_dir>/tokenizers/`. Otherwise an HF tokenizer.json
    (a .json file, or a folder holding tokenizer.json and optionally tokenizer_config.json naming
    bos_token/eos_token), or a tiktoken BPE file (a .model or .tiktoken file, or a folder holding
    tokenizer.model and no tokenizer.json). tiktoken files may also be gs://, az:// or https:// URLs.
    """
    if tokenizer_path == "":
        vocab_size = min(DEFAULT_VOCAB_SIZE, model_vocab_size or DEFAULT_VOCAB_SIZE)
        if vocab_size < _MIN_VOCAB_SIZE:
            raise ValueError(f"model.tokenizer_path: the default byte-level BPE needs at least {_MIN_VOCAB_SIZE} "
                             f"tokens, the model has {vocab_size}: give a tokenizer that fits")
        return _build_default(Path(cache_dir).expanduser(), vocab_size)
    if "://" in tokenizer_path:  # remote: read through blobfile, tiktoken files only
        if tokenizer_path.endswith(TIKTOKEN_SUFFIXES):
            return TikTokenTokenizer(tokenizer_path)
        raise ValueError(f"model.tokenizer_path: {tokenizer_path}: remote paths must name a tiktoken "
                         f".model/.tiktoken file (copy a tokenizer.json to a local path)")  # fmt: skip
    path = Path(tokenizer_path).expanduser()
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return _load_user_tokenizer(str(path))
        if (path / "tokenizer.model").is_file():
            return TikTokenTokenizer(str(path / "tokenizer.model"))
        raise FileNotFoundError(f"model.tokenizer_path: {path} holds neither tokenizer.json nor tokenizer.model")
    if path.suffix == ".json" or not path.exists():
        return _load_user_tokenizer(str(path))  # a missing file is reported there, by name
    if path.name.endswith(TIKTOKEN_SUFFIXES):
        return TikTokenTokenizer(str(path))
    raise ValueError(f"model.tokenizer_path: {path}: unsupported tokenizer file (use a tokenizer.json, a "
                     f"tiktoken .model/.tiktoken file, or a folder holding one)")  # fmt: skip
