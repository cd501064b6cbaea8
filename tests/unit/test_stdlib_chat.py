"""The embedded chat corpus `python_stdlib_chat` (torchtitan/data/stdlib_chat.py) and the default tokenizer's chat
tokens: the debug SFT recipes' data, offline on every machine."""

from __future__ import annotations

import json

import pytest

from torchtitan.data.stdlib_chat import SYSTEM, conversation_of, stdlib_chat_source

MODULE = '''"""Tools for frobnicating.

Longer text that is not part of the answer."""

def frob(x, *, times=2):
    """Frobnicate x, times times."""

def _hidden():
    """Never asked about."""

class Widget:
    """A thing that frobs."""

def undocumented():
    pass
'''


def test_a_module_becomes_one_conversation_about_its_documented_public_names() -> None:
    messages = conversation_of("pkg/frobber.py", MODULE)
    assert messages[0] == {"role": "system", "content": SYSTEM}
    roles = [m["role"] for m in messages[1:]]
    assert roles == ["user", "assistant"] * 3  # the module, frob and Widget; not _hidden nor undocumented
    assert "`pkg.frobber`" in messages[1]["content"] and messages[2]["content"] == "Tools for frobnicating."
    assert "`pkg.frobber.frob`" in messages[3]["content"] or "`frob` from `pkg.frobber`" in messages[3]["content"]
    assert messages[4]["content"] == "`frob(x, *, times=2)`: Frobnicate x, times times."
    assert messages[6]["content"] == "`Widget` is a class. A thing that frobs."
    assert conversation_of("pkg/__init__.py", MODULE)[1]["content"].count("`pkg`") == 1  # a package by its name


def test_modules_without_an_answer_are_bad_records_with_a_reason() -> None:
    assert conversation_of("a.py", "def f(:\n") == "unparsable"
    assert conversation_of("a.py", "x = 1\ndef _f():\n    '''private'''\n") == "no docstrings"
    many = "".join(f"def f{i}():\n    '''Doc {i}.'''\n" for i in range(10))
    assert len(conversation_of("a.py", many)) == 1 + 2 * 4  # at most three names after the module's (none here)


def test_the_splits_are_the_text_corpus_module_files_and_hold_usable_conversations() -> None:
    from torchtitan.data.datasets import _stdlib_split

    train, val = stdlib_chat_source("python_stdlib_chat", "training"), \
        stdlib_chat_source("python_stdlib_chat_val", "validation")
    assert {s.key for s in val.sources} == {s.key for s in _stdlib_split(True) if s.path is not None}
    assert not {s.key for s in train.sources} & {s.key for s in val.sources}
    docs = list(val.iter_documents(0))
    assert docs and len(docs) + sum(val.bad.values()) == val.num_documents
    for _, text in docs:
        messages = json.loads(text)
        assert messages[-1]["role"] == "assistant" and messages[-1]["content"].strip()
    resumed = list(val.iter_documents(docs[1][0]))
    assert resumed == docs[1:]  # a cursor restarts at a raw index, as for every source
    with pytest.raises(ValueError, match="validation.dataset: 'nope' is not a chat dataset"):
        stdlib_chat_source("nope", "validation")


def test_the_default_tokenizer_renders_it_with_the_llama3_template(tmp_path) -> None:
    from torchtitan.data.chat import ChatEncoder
    from torchtitan.data.chat_source import build_chat_source
    from torchtitan.data.tokenizer import build_tokenizer

    tok = build_tokenizer("", tmp_path, model_vocab_size=512)  # the chat tokens survive the smallest vocabularies
    encoder = ChatEncoder(tok, "auto", "assistant")
    assert encoder.name == "llama3"
    source = build_chat_source(dataset_path="", dataset_format="auto", key_prefix="validation",
                               dataset="python_stdlib_chat_val")
    _, text = next(iter(source.iter_documents(0)))
    messages = json.loads(text)
    ids, trained = encoder.encode_conversation(messages)
    eot = tok.backend.token_to_id("<|eot_id|>")
    assert ids.count(eot) == len(messages)  # each turn ends with the special token, never with spelled-out text
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert tok.decode([i for i, t in zip(ids, trained, strict=True) if t]) == "<|eot_id|>".join(replies) + "<|eot_id|>"
    with pytest.raises(ValueError, match="training.dataset: python_stdlib_chat holds chat messages"):
        build_chat_source(dataset_path="", dataset_format="alpaca", dataset="python_stdlib_chat")
