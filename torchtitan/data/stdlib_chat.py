"""`python_stdlib_chat`: conversations about the Python standard library, made from its own sources (offline).

The chat twin of the `python_stdlib` corpus (torchtitan/data/datasets.py), so that supervised fine-tuning has a
dataset on every machine: the debug SFT and LoRA recipes (train_configs/debug_sft.toml, debug_lora.toml) and their
tests need no download. One conversation per module file, in the corpus's fixed order and split (the held-out 2%
is `python_stdlib_chat_val`): a system turn, then the module's docstring as the answer to "what is it for", then up
to three of its public functions and classes, each answered with its signature and the first paragraph of its
docstring. A file with none of these (no docstrings, or source that does not parse) is a bad record, counted and
skipped like a bad record of a chat file (ConversationSource, torchtitan/data/source.py).

Files are parsed with `ast` as the loader reads them (about 5 ms each), never imported.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterator
from typing import Any

from torchtitan.data.source import ConversationSource

__all__ = ["CHAT_DATASETS", "StdlibChatSource", "conversation_of", "stdlib_chat_source"]

CHAT_DATASETS = ("python_stdlib_chat", "python_stdlib_chat_val")
SYSTEM = "You are a concise assistant who explains the Python standard library."
_MAX_TOPICS = 3  # public functions/classes asked about per module, after the module itself
_MAX_ANSWER_CHARS = 480
_MAX_SIGNATURE_CHARS = 100
_MODULE_QUESTIONS = ("What is the `{m}` module for?", "Explain the purpose of `{m}`.", "What does `{m}` provide?")
_NAME_QUESTIONS = ("What does `{m}.{n}` do?", "Describe `{n}` from `{m}`.", "How do I use `{m}.{n}`?")


def _first_paragraph(doc: str | None) -> str | None:
    if not doc or not doc.strip():
        return None
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    if len(paragraph) > _MAX_ANSWER_CHARS:  # cut at a word boundary: answers stay a few sentences long
        paragraph = paragraph[:_MAX_ANSWER_CHARS].rsplit(" ", 1)[0] + " ..."
    return paragraph


def _pick(choices: tuple[str, ...], key: str) -> str:
    # The phrasing depends on the question's own key, not on a random state: every rank and worker agrees.
    return choices[int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % len(choices)]


def _module_name(rel_path: str) -> str:
    name = rel_path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(node.args)
    if len(args) > _MAX_SIGNATURE_CHARS:
        args = args[:_MAX_SIGNATURE_CHARS].rsplit(",", 1)[0] + ", ..."
    return f"({args})"


def conversation_of(rel_path: str, source: str) -> list[dict[str, str]] | str:
    """The messages about one module file, or why there are none ("unparsable", "no docstrings")."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return "unparsable"
    module = _module_name(rel_path)
    turns: list[tuple[str, str]] = []
    if (about := _first_paragraph(ast.get_docstring(tree))) is not None:
        turns.append((_pick(_MODULE_QUESTIONS, module).format(m=module), about))
    for node in tree.body:
        if len(turns) > _MAX_TOPICS or not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if node.name.startswith("_") or (doc := _first_paragraph(ast.get_docstring(node))) is None:
            continue
        question = _pick(_NAME_QUESTIONS, f"{module}.{node.name}").format(m=module, n=node.name)
        if isinstance(node, ast.ClassDef):
            answer = f"`{node.name}` is a class. {doc}"
        else:
            answer = f"`{node.name}{_signature(node)}`: {doc}"
        turns.append((question, answer))
    if not turns:
        return "no docstrings"
    messages = [{"role": "system", "content": SYSTEM}]
    for question, answer in turns:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


class StdlibChatSource(ConversationSource):
    """The module files of one split of the stdlib corpus, one conversation each."""

    def __init__(self, name: str, key_prefix: str, sources: tuple[Any, ...]) -> None:
        super().__init__(name, key_prefix, len(sources))
        self.sources = sources

    def _iter_raw(self, start: int) -> Iterator[tuple[int, Any]]:
        for index in range(start, len(self.sources)):
            yield index, self.sources[index]

    def to_messages(self, record: Any) -> list[dict[str, str]] | str:
        try:
            return conversation_of(record.key, record.path.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError):
            return "unreadable"


def stdlib_chat_source(name: str, key_prefix: str) -> StdlibChatSource:
    """`python_stdlib_chat` (training split) or `python_stdlib_chat_val` (the held-out 2% of module files)."""
    from torchtitan.data.datasets import stdlib_module_files

    if name not in CHAT_DATASETS:
        raise ValueError(f"{key_prefix}.dataset: '{name}' is not a chat dataset; known: {', '.join(CHAT_DATASETS)}")
    return StdlibChatSource(name, key_prefix, stdlib_module_files(held_out=name.endswith("_val")))
