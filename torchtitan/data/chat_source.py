"""Fine-tuning records as conversations: chat messages, prompt/response pairs and Alpaca instructions.

Formats (training.dataset_format), by the record fields they read:

- `chat`: `messages` (or `conversations`), a list of turns {"role", "content"} with roles system, user and
  assistant; ShareGPT's {"from", "value"} with human/gpt, and content given as [{"type": "text", "text"}] parts,
  are read too.
- `prompt_response`: `prompt` and `response` (or `completion`), optionally `system`: one user turn and its reply.
- `alpaca`: `instruction`, optionally `input` (appended after a blank line when not empty), and `output`.
- `auto`: the first of these whose fields the data has.

Every record becomes a list of messages, serialised as JSON: the document text the dataloader's workers hand to
torchtitan/data/chat.py. A record with a missing or null field, a non-text field, an unknown role or no non-empty
assistant turn is skipped and counted by reason (its raw index stays reserved, so resume cursors never shift); the
counts are logged once per process at the end of a pass. Files are read through HF `datasets` as for
pretraining (torchtitan/data/hf_sources.py: local json/jsonl/parquet, checked file by file, or a hub dataset).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchtitan.data import hf_sources
from torchtitan.data.chat import normalize_messages
from torchtitan.data.source import ConversationSource
from torchtitan.data.stdlib_chat import CHAT_DATASETS, stdlib_chat_source
from torchtitan.tools.logging import logger

__all__ = ["FORMATS", "ChatSource", "ConversationSource", "build_chat_source", "to_messages"]

FORMATS = ("chat", "prompt_response", "alpaca")
# format -> [(role in the record, accepted field names, required)]
_FIELDS: dict[str, list[tuple[str, tuple[str, ...], bool]]] = {
    "chat": [("messages", ("messages", "conversations"), True)],
    "prompt_response": [("prompt", ("prompt",), True), ("response", ("response", "completion"), True),
                        ("system", ("system",), False)],
    "alpaca": [("instruction", ("instruction",), True), ("output", ("output",), True), ("input", ("input",), False)],
}
_BATCH = 256


def _columns_for(fmt: str, columns: list[str]) -> dict[str, str] | None:
    """The record's field for each part of `fmt`, or None if a required one is missing."""
    found: dict[str, str] = {}
    for part, names, required in _FIELDS[fmt]:
        name = next((n for n in names if n in columns), None)
        if name is None and required:
            return None
        if name is not None:
            found[part] = name
    return found


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def to_messages(record: dict[str, Any], fmt: str, columns: dict[str, str]) -> list[dict[str, str]] | str:
    """The record's messages, or why it is bad (see torchtitan/data/chat.py normalize_messages)."""
    if fmt == "chat":
        return normalize_messages(record.get(columns["messages"]))
    fields = {part: record.get(name) for part, name in columns.items()}
    required = [part for part, _, needed in _FIELDS[fmt] if needed]
    if any(fields[part] is None for part in required):
        return "missing field"
    if any(value is not None and _text(value) is None for value in fields.values()):
        return "not text"
    if fmt == "prompt_response":
        user, reply, system = fields["prompt"], fields["response"], fields.get("system")
    else:
        extra = fields.get("input")
        user = fields["instruction"] + (f"\n\n{extra}" if extra and extra.strip() else "")
        reply, system = fields["output"], None
    if not reply.strip():
        return "no assistant turn"
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


class ChatSource(ConversationSource):
    """Records of one format from a `datasets` object (map-style: skips by index; streamed: `skip`)."""

    def __init__(self, name: str, key_prefix: str, dataset: Any, fmt: str, columns: dict[str, str],
                 streaming: bool) -> None:
        super().__init__(name, key_prefix, None if streaming else len(dataset))
        self.dataset = dataset.select_columns(sorted(set(columns.values())))
        self.format, self.columns, self.streaming = fmt, columns, streaming

    def to_messages(self, record: Any) -> list[dict[str, str]] | str:
        return to_messages(record, self.format, self.columns)

    def _iter_raw(self, start: int) -> Iterator[tuple[int, Any]]:
        index = start
        try:
            if self.streaming:
                batches = (self.dataset.skip(start) if start else self.dataset).iter(batch_size=_BATCH)
            else:
                batches = (self.dataset[i : i + _BATCH] for i in range(start, len(self.dataset), _BATCH))
            for batch in batches:
                names = list(batch)
                for values in zip(*(batch[n] for n in names), strict=True):
                    yield index, dict(zip(names, values, strict=True))
                    index += 1
        except (OSError, ValueError, ImportError) as e:  # files changed since the check, connection lost
            raise ValueError(f"{self.key_prefix}.dataset_path: reading '{self.name}' failed near record {index}: "
                             f"{hf_sources._one_line(e)}") from None


def _column_names(ds: Any, where: str, p: str) -> list[str]:
    columns = ds.column_names
    if columns is None:  # a stream whose schema is unknown until read
        try:
            columns = list(next(iter(ds)).keys())
        except StopIteration:
            raise ValueError(f"{p}.dataset_path: {where} has no records") from None
        except Exception as e:
            raise ValueError(f"{p}.dataset_path: cannot read {where}: {hf_sources._one_line(e)}") from None
    return list(columns)


def build_chat_source(*, dataset_path: str, dataset_format: str, split: str = "train", streaming: str = "auto",
                      cache_dir: str | None = None, key_prefix: str = "training",
                      dataset: str = "") -> ConversationSource:
    """The conversations of `<key_prefix>.dataset_path` in `dataset_format` (chat | prompt_response | alpaca |
    auto), checked down to the first usable record: a missing field in every record, no record usable, a
    pre-tokenized folder are one-line ValueErrors naming the key. Without a dataset_path, `dataset` may name the
    embedded chat corpus (torchtitan/data/stdlib_chat.py)."""
    p = key_prefix
    if dataset_format not in (*FORMATS, "auto"):
        raise ValueError(f"{p}.dataset_format: '{dataset_format}' is not one of {', '.join(FORMATS)}, auto")
    if not dataset_path and dataset in CHAT_DATASETS:
        if dataset_format not in ("chat", "auto"):
            raise ValueError(f"{p}.dataset: {dataset} holds chat messages; set training.dataset_format = chat")
        embedded = stdlib_chat_source(dataset, p)
        for _ in embedded.iter_documents(0):
            return embedded
        raise ValueError(f"{p}.dataset: '{dataset}' has no usable conversations ({embedded.bad_summary()})")
    if not dataset_path:
        raise ValueError(f"{p}.dataset_path: dataset_format {dataset_format} reads conversations from local "
                         "json/jsonl/parquet files or a hub dataset: set dataset_path")
    if Path(dataset_path).expanduser().is_dir():
        from torchtitan.data.pretokenized import open_pretokenized  # here: it imports torch (the launcher has not)

        if open_pretokenized(dataset_path, p) is not None:
            raise ValueError(f"{p}.dataset_path: {dataset_path} is a pre-tokenized folder (token ids, no "
                             f"conversations); dataset_format {dataset_format} needs the records themselves")
    mode = str(streaming).strip().lower()
    opened = hf_sources.open_path_dataset(dataset_path, None, split, mode, cache_dir, p)
    if opened is None:  # a hub name
        name, _, config = dataset_path.partition(":")
        opened = hf_sources.open_hub_dataset(dataset_path, name, config or None, split, mode, cache_dir, p,
                                             "dataset_path")
    ds, streamed, where = opened
    columns = _column_names(ds, where, p)
    fmt, fields = dataset_format, None
    for candidate in FORMATS if dataset_format == "auto" else (dataset_format,):
        fields = _columns_for(candidate, columns)
        if fields is not None:
            fmt = candidate
            break
    if fields is None:
        wanted = "; ".join(f"{f}: " + " + ".join("/".join(names) for _, names, req in _FIELDS[f] if req)
                           for f in (FORMATS if dataset_format == "auto" else (dataset_format,)))
        raise ValueError(f"{p}.dataset_format: {where} has the fields {', '.join(columns)}, not those of "
                         f"{dataset_format} ({wanted})")
    source = ChatSource(dataset_path, p, ds, fmt, fields, streamed)
    for _ in source.iter_documents(0):
        break
    else:
        raise ValueError(f"{p}.dataset_path: '{dataset_path}' has no usable {fmt} records ({source.bad_summary()})")
    logger.info(f"{p}.dataset_path: {fmt} records (fields {', '.join(sorted(fields.values()))})")
    return source
