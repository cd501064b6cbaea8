"""Conversations to token ids and a label mask through a chat template; prompts for generation.

How the assistant's tokens are found: the template is rendered twice, once as it is and once with every message's
content replaced by a marker. The markers cut the second rendering into the template's own text around each
content; walking the real rendering with those texts gives each message's content exactly as the template wrote it
(after a trim or strip of its own, say). A template that changes content in other ways (or depends on it) leaves a
rendering the walk cannot follow: that conversation is skipped and counted, never labelled by guesswork.

Tokens: template text is split at the tokenizer's added tokens, which become their ids; every other piece, content
included, is encoded on its own as plain text, so a message that spells a special token cannot forge one. Labels
("assistant"): the content of each assistant message plus the template text after it up to and including the first
special token, its end of turn (<|eot_id|>, <|im_end|>, <｜end▁of▁sentence｜>). Headers, other roles and text after
the end of turn are not targets. "all": every token is.

For generation (torchtitan/generation): `render_generation_prompt` gives the ids of a conversation followed by the
template's assistant header, `stop_token_ids` the ids that end a reply.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from torchtitan.data.chat_templates import (
    checked_compile,
    compile_template,
    resolve_template,
    special_tokens,
    tokenizer_config,
)
from torchtitan.tools.logging import logger

__all__ = ["ROLES", "ChatEncoder", "normalize_messages", "render_generation_prompt", "stop_token_ids"]

ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}
_MARK = "\ue000{}\ue001"  # private-use characters: no template writes them
_MARK_RE = re.compile("\ue000(\\d+)\ue001")


class Unrenderable(ValueError):
    """The template failed on a conversation, or changed its content so that its tokens cannot be labelled."""


def normalize_messages(turns: Any, need_assistant: bool = True) -> list[dict[str, str]] | str:
    """[{"role", "content"}] with roles system/user/assistant (ShareGPT's from/value and human/gpt accepted; content
    may be a list of {"type": "text", "text"} parts), or the reason the record is bad: "missing field", "not text",
    "unknown role", "no assistant turn"."""
    if turns is None:
        return "missing field"
    if not isinstance(turns, (list, tuple)) or not all(isinstance(t, dict) for t in turns):
        return "not text"
    out = []
    for turn in turns:
        role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        content = turn.get("content") if turn.get("content") is not None else turn.get("value")
        if role is None or content is None:
            return "missing field"
        if isinstance(content, list):  # multimodal-style parts: only text parts are trainable text
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                return "not text"
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            return "not text"
        if not isinstance(role, str) or role not in ROLES:
            return "unknown role"
        out.append({"role": ROLES[role], "content": content})
    if need_assistant and not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        return "no assistant turn"
    return out


def _variants(content: str) -> list[str]:
    # What templates do to content on its way out, most common first; exact wins when several fit.
    seen: list[str] = []
    for v in (content, content.strip(), content.lstrip(), content.rstrip(), content.strip("\n"),
              content.lstrip("\n"), content.rstrip("\n")):
        if v not in seen:
            seen.append(v)
    return seen


def _token_name(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatEncoder:
    """A chat template resolved for one tokenizer (training.chat_template, torchtitan/data/chat_templates.py).

    `encode_conversation(messages)` gives (ids, trained flags). For the dataloader, which hands each worker a
    tokenizer-like object, `encode(json_text)` gives the ids of a JSON list of messages with the label mask folded
    into the sign: a trained id i is stored as -1 - i (ids fit in int32 with room to spare); [] if unrenderable.
    Pickles small: the compiled template is rebuilt (and cached) in each process.
    """

    def __init__(self, tokenizer: Any, template: str = "auto", train_on: str = "assistant",
                 key: str = "training.chat_template"):
        if train_on not in ("assistant", "all"):
            raise ValueError(f"training.train_on: must be assistant or all, got {train_on!r}")
        self.tokenizer, self.train_all, self.key = tokenizer, train_on == "all", key
        self.name, self.source = resolve_template(tokenizer, template, key)
        checked_compile(self.source, self.name, key)
        self.table = special_tokens(tokenizer)
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(self.table, key=len, reverse=True))
                                 + ")") if self.table else None
        config = tokenizer_config(tokenizer)[0]
        decode = getattr(tokenizer, "decode", None)
        self.context = {
            "bos_token": _token_name(config.get("bos_token")) or (decode([tokenizer.bos_id]) if decode else ""),
            "eos_token": _token_name(config.get("eos_token")) or (decode([tokenizer.eos_id]) if decode else ""),
            "tools": None, "documents": None,
        }
        self.end_of_turn = self._probe()
        self._warned = False

    # The loader's tokenizer interface (torchtitan/data/dataloader.py reads these).
    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def path(self) -> Any:
        return self.tokenizer.path

    def _probe(self) -> int:
        """The end-of-turn id, from a two-message conversation: the template must render and end the assistant's
        turn with a special token (or the model would never learn to stop)."""
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        try:
            pieces = self._layout(messages, False)
        except Unrenderable as e:
            raise ValueError(f"{self.key}: {self.name} cannot render a user/assistant exchange: {e}") from None
        after = next((k for k, (_, j) in enumerate(pieces) if j == 1), None)
        if after is None:
            raise ValueError(f"{self.key}: {self.name} does not write the assistant's message content")
        for text, _ in pieces[after + 1:]:
            for chunk in self._chunks(text):
                if isinstance(chunk, tuple) and chunk[1]:
                    return chunk[0]
        raise ValueError(f"{self.key}: {self.name} ends an assistant turn with no special token (an end of turn "
                         "the model could learn to emit); use a template that does")

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        template = compile_template(self.source)
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.context)
        except Exception as e:  # raise_exception, the sandbox's SecurityError, or a template's own bug (TypeError)
            raise Unrenderable(f"{type(e).__name__}: {' '.join(str(e).split())}") from None

    def _layout(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[tuple[str, int | None]]:
        """The rendering as (text, message index) pieces: None for the template's own text, j for message j's
        content as the template wrote it."""
        marked = [dict(m, content=_MARK.format(j)) for j, m in enumerate(messages)]
        parts = _MARK_RE.split(self._render(marked, add_generation_prompt))
        texts, order = parts[0::2], [int(j) for j in parts[1::2]]
        if any(j >= len(messages) for j in order):  # a template that writes our marker characters itself
            raise Unrenderable("the template writes the private-use characters U+E000/U+E001")
        real = self._render(messages, add_generation_prompt)
        pieces: list[tuple[str, int | None]] = []
        pos = 0
        for k, j in enumerate(order):
            if not real.startswith(texts[k], pos):
                raise Unrenderable(f"the template renders message {j} differently when its content changes")
            pieces.append((texts[k], None))
            pos += len(texts[k])
            following, last = texts[k + 1], k + 1 == len(order)
            for content in _variants(messages[j]["content"]):
                end = pos + len(content)
                if real.startswith(content, pos) and real.startswith(following, end) and (
                        not last or end + len(following) == len(real)):
                    break
            else:
                raise Unrenderable(f"the template changes the content of message {j} ({messages[j]['role']})")
            pieces.append((content, j))
            pos = end
        if real[pos:] != texts[-1]:
            raise Unrenderable("the template's text after the last message depends on the content")
        pieces.append((texts[-1], None))
        return pieces

    def _chunks(self, text: str) -> list[str | tuple[int, bool]]:
        """Template text split at added tokens: plain strings and (id, special) pairs."""
        if self._split is None:
            return [text] if text else []
        out: list[str | tuple[int, bool]] = []
        for i, chunk in enumerate(self._split.split(text)):
            if i % 2:
                out.append(self.table[chunk])
            elif chunk:
                out.append(chunk)
        return out

    def encode_conversation(self, messages: list[dict[str, str]], add_generation_prompt: bool = False
                            ) -> tuple[list[int], list[bool]]:
        """(ids, trained) of normalized messages; raises Unrenderable."""
        ids: list[int] = []
        trained: list[bool] = []
        in_turn = False  # after an assistant's content, before its end of turn
        for text, j in self._layout(messages, add_generation_prompt):
            if j is not None:
                piece = self.tokenizer.encode(text, add_bos=False, add_eos=False)
                in_turn = messages[j]["role"] == "assistant"
                ids += piece
                trained += [in_turn or self.train_all] * len(piece)
                continue
            for chunk in self._chunks(text):
                piece = [chunk[0]] if isinstance(chunk, tuple) else self.tokenizer.encode(chunk, False, False)
                ids += piece
                trained += [in_turn or self.train_all] * len(piece)
                if isinstance(chunk, tuple) and chunk[1]:
                    in_turn = False
        return ids, trained

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """The dataloader's call: ids with the mask in the sign (see the class); BOS/EOS come from the template."""
        try:
            ids, trained = self.encode_conversation(json.loads(text))
        except Unrenderable as e:
            if not self._warned:  # once per process: the loader counts every such conversation
                self._warned = True
                logger.warning(f"{self.key}: skipping conversations that {self.name} cannot render, first: {e}")
            return []
        return [-1 - i if t else i for i, t in zip(ids, trained, strict=True)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i if i >= 0 else -1 - i for i in ids])

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _warned=False)


def render_generation_prompt(tokenizer: Any, messages: list[dict], template: str = "auto") -> list[int]:
    """The ids of `messages` (role/content dicts, no assistant turn needed) followed by the template's assistant
    header (add_generation_prompt), to generate the assistant's reply from. ValueError on a bad message or a
    template that cannot render them."""
    normal = normalize_messages(messages, need_assistant=False)
    if isinstance(normal, str):
        raise ValueError(f"messages: {normal} (each message needs a role of system, user or assistant and a text "
                         "content)")
    encoder = ChatEncoder(tokenizer, template, key="chat template")
    try:
        return encoder.encode_conversation(normal, add_generation_prompt=True)[0]
    except Unrenderable as e:
        raise ValueError(f"chat template {encoder.name}: {e}") from None


def stop_token_ids(tokenizer: Any, template: str = "auto") -> list[int]:
    """The ids that end an assistant reply under `template`: its end-of-turn token, then the tokenizer's EOS."""
    end = ChatEncoder(tokenizer, template, key="chat template").end_of_turn
    return [end] if end == tokenizer.eos_id else [end, tokenizer.eos_id]
