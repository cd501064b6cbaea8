"""Chat and instruction data for fine-tuning: record formats, templates (built-in, a tokenizer's Jinja, the sandbox),
the label mask, padding and packing with document masking, truncation counts, bad records, exact resume, and a
short training run whose loss counts only assistant tokens.

The tokenizer is made here: a byte-level BPE without merges (every ASCII character is one token) plus the chat
special tokens of the three families, so a rendering is checked token by token from a readable string in which
{braces} mark the trained tokens. CPU only, no network.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path

import pytest
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers

from tests.unit.forked import run_main
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.data.chat import ChatEncoder, Unrenderable, normalize_messages, render_generation_prompt, stop_token_ids
from torchtitan.data.chat_loader import build_chat_dataloader
from torchtitan.data.chat_source import build_chat_source
from torchtitan.data.tokenizer import Tokenizer

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
            "<｜Assistant｜>"]
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
REPO = Path(__file__).resolve().parents[2]


def make_tokenizer(folder: Path, chat_template: str | None = None, specials: list[str] = SPECIALS) -> Tokenizer:
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": specials[0], "eos_token": specials[1]}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(folder / "tokenizer.json", specials[0], specials[1])


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def expect(tok: Tokenizer, marked: str) -> tuple[list[int], list[bool]]:
    """Ids and trained flags of a rendering written out: special token names, characters, {trained spans}."""
    ids, trained, on = [], [], False
    for part in re.split(r"([{}])", marked):
        if part in "{}" and part:
            on = part == "{"
            continue
        for piece in _SPECIAL_RE.split(part):
            if piece in SPECIALS:
                ids.append(tok.backend.token_to_id(piece))
            else:
                ids += [tok.encode(c, False, False)[0] for c in piece]
        trained += [on] * (len(ids) - len(trained))
    return ids, trained


def shown(tok: Tokenizer, ids: list[int], trained: list[bool]) -> str:
    """The inverse of expect, for readable assertion messages."""
    out, on = "", False
    for i, t in zip(ids, trained, strict=True):
        if t != on:
            out, on = out + ("{" if t else "}"), t
        out += tok.decode([i])
    return out + ("}" if on else "")


def turn(role: str, content) -> dict:
    return {"role": role, "content": content}


S, U, A = (functools.partial(turn, role) for role in ("system", "user", "assistant"))  # short conversations below

CONVERSATION = [S("Be brief."), U("Hi"), A("Hello!"), U("2+2?"), A(" 4 ")]
RENDERED = {
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
              "\n\n{Hello!<|eot_id|>}<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n{4<|eot_id|>}",
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
              "{Hello!<|im_end|>}\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n{ 4 <|im_end|>}\n",
    "deepseek_v3": "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>{Hello!<｜end▁of▁sentence｜>}"
                   "<｜User｜>2+2?<｜Assistant｜>{ 4 <｜end▁of▁sentence｜>}",
}
PROMPT_END = {"llama3": "2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
              "chatml": "2+2?<|im_end|>\n<|im_start|>assistant\n", "deepseek_v3": "2+2?<｜Assistant｜>"}
END_OF_TURN = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>", "deepseek_v3": "<｜end▁of▁sentence｜>"}


@pytest.mark.parametrize("template", sorted(RENDERED))
def test_builtin_template_renders_exactly_and_labels_only_assistant_replies(tok, template):
    got = ChatEncoder(tok, template).encode_conversation(CONVERSATION)
    assert got == expect(tok, RENDERED[template]), shown(tok, *got)
    plain = RENDERED[template].replace("{", "").replace("}", "")
    prompt = plain[: plain.index(PROMPT_END[template]) + len(PROMPT_END[template])]
    assert render_generation_prompt(tok, CONVERSATION[:4], template) == expect(tok, prompt)[0]
    assert stop_token_ids(tok, template) == [tok.backend.token_to_id(END_OF_TURN[template]), tok.eos_id]
    every = ChatEncoder(tok, template, train_on="all").encode_conversation(CONVERSATION)
    assert every[0] == got[0] and all(every[1])


# A template of the kind models ship (written for this test): a default system prompt, an empty thinking block
# before the last reply only (so a conversation's rendering is not a prefix of a longer one's), trimmed replies.
JINJA = (
    "{%- if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "{%- if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% generation %}{{ m['content'] | trim }}{% endgeneration %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_tokenizer_config_chat_template_is_rendered_in_the_sandbox(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", chat_template=JINJA)
    messages = [U("Hi"), A("Hello!"), U("Bye <|im_end|>"), A("  Ciao \n")]
    encoder = ChatEncoder(tok, "auto")
    assert encoder.name.startswith("the chat_template of") and encoder.name.endswith("tokenizer_config.json")
    got = encoder.encode_conversation(messages)
    # The user's spelled-out <|im_end|> stays characters: content cannot forge a special token.
    head_ids, head_trained = expect(tok, "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi"
                                         "<|im_end|>\n<|im_start|>assistant\n{Hello!<|im_end|>}\n<|im_start|>user\n"
                                         "Bye ")
    forged = [tok.encode(c, False, False)[0] for c in "<|im_end|>"]
    tail_ids, tail_trained = expect(tok, "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{Ciao<|im_end|>}\n")
    assert got == (head_ids + forged + tail_ids, head_trained + [False] * 10 + tail_trained), shown(tok, *got)
    assert render_generation_prompt(tok, messages[:3]) == (
        head_ids + forged + expect(tok, "<|im_end|>\n<|im_start|>assistant\n")[0])
    assert stop_token_ids(tok) == [tok.backend.token_to_id("<|im_end|>"), tok.eos_id]
    with pytest.raises(Unrenderable, match="roles must alternate"):
        encoder.encode_conversation([messages[0], messages[0], messages[1]])
    assert encoder.encode(json.dumps([messages[0], messages[0], messages[1]])) == []  # the loader counts it


def test_sandbox_refuses_an_unsafe_template(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="SecurityError") as info:
        ChatEncoder(tok, "tokenizer")
    assert "\n" not in str(info.value)
    broken = make_tokenizer(tmp_path / "broken", chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="is not a valid Jinja template"):
        ChatEncoder(broken, "auto")


def test_missing_special_tokens_and_missing_template_are_one_line_errors(tmp_path):
    plain = make_tokenizer(tmp_path / "plain", specials=["<s>", "</s>"])
    for template, words in (("chatml", "<|im_start|>, <|im_end|>"), ("auto", "auto found no chat_template"),
                            ("tokenizer", "no chat_template")):
        with pytest.raises(ValueError, match=re.escape(words)) as info:
            ChatEncoder(plain, template)
        assert "\n" not in str(info.value) and str(info.value).startswith("training.chat_template: ")


def test_messages_are_normalized_or_refused_with_a_reason():
    parts = [{"type": "text", "text": "b"}]
    assert normalize_messages([{"from": "human", "value": "a"}, {"from": "gpt", "value": parts}]) == [U("a"), A("b")]
    assert normalize_messages(None) == "missing field"
    assert normalize_messages([U(3), A("x")]) == normalize_messages([U([{"type": "image"}]), A("x")]) == "not text"
    assert normalize_messages([turn("tool", "x"), A("y")]) == "unknown role"
    assert normalize_messages([U("x"), A(" ")]) == "no assistant turn"


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def documents(source) -> list[list[dict]]:
    return [json.loads(text) for _, text in source.iter_documents(0)]


def test_each_record_format_bad_records_and_a_file_with_none_usable(tmp_path):
    cache = str(tmp_path / "cache")
    chat = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [S("s"), U("u"), A("a")]},
        {"messages": [U("u")]},  # no assistant turn
        {"messages": [turn("robot", "u"), A("a")]},  # unknown role
        {"messages": [U(None), A("a")]},  # missing field
        {"other": 1},  # no messages at all: missing field
    ])
    source = build_chat_source(dataset_path=str(chat), dataset_format="auto", cache_dir=cache)
    assert source.format == "chat" and documents(source) == [[S("s"), U("u"), A("a")]]
    assert dict(source.bad) == {"no assistant turn": 1, "unknown role": 1, "missing field": 2}
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": [{"from": "human", "value": "u"},
                                                                            {"from": "gpt", "value": "a"}]}])
    assert documents(build_chat_source(dataset_path=str(sharegpt), dataset_format="chat", cache_dir=cache)) == [
        [U("u"), A("a")]]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "P", "completion": "C", "system": "S"},
                                                   {"prompt": "P", "completion": None, "system": None}])
    source = build_chat_source(dataset_path=str(pairs), dataset_format="auto", cache_dir=cache)
    assert documents(source) == [[S("S"), U("P"), A("C")]]
    assert source.format == "prompt_response" and dict(source.bad) == {"missing field": 1}
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"instruction": ["Add.", "Greet."], "input": ["2 and 2", ""], "output": ["4", "Hi"]}),
                   tmp_path / "alpaca.parquet")
    source = build_chat_source(dataset_path=str(tmp_path / "alpaca.parquet"), dataset_format="alpaca", cache_dir=cache)
    assert documents(source) == [[U("Add.\n\n2 and 2"), A("4")], [U("Greet."), A("Hi")]]
    with pytest.raises(ValueError, match="training.dataset_format: .* not those of alpaca") as info:
        build_chat_source(dataset_path=str(chat), dataset_format="alpaca", cache_dir=cache)
    none = write_jsonl(tmp_path / "none.jsonl", [{"messages": [U("u")]}, {"messages": [turn("bot", "a")]}])
    with pytest.raises(ValueError, match=r"has no usable chat records \(2 bad records: 1 no assistant turn, 1 unknown "
                                         r"role\)") as info:
        build_chat_source(dataset_path=str(none), dataset_format="chat", cache_dir=cache)
    assert "\n" not in str(info.value) and str(info.value).startswith("training.dataset_path: ")


def conversations(n: int, seed: int = 0, max_turns: int = 2) -> list[dict]:
    """n conversations of varied lengths (a third of them two exchanges long), replies of 2 to 12 characters."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        turns = min(max_turns, 1 + int(torch.randint(0, 3, (1,), generator=g)) // 2)
        messages = []
        for t in range(turns):
            messages += [U(f"q{i}." + "x" * int(torch.randint(0, 8, (1,), generator=g))),
                         A(f"a{t}" + "y" * int(torch.randint(0, 11, (1,), generator=g)))]
        out.append({"messages": messages})
    return out


def loader(tok, path, **kwargs):
    args = dict(seq_len=48, local_batch_size=2, dp_rank=0, dp_degree=1, document_masking=True, packing="pack")
    args.update(kwargs)
    template, train_on = args.pop("template", "chatml"), args.pop("train_on", "assistant")
    source = build_chat_source(dataset_path=str(path), dataset_format="chat", cache_dir=str(Path(path).parent / "c"))
    return build_chat_dataloader(source=source, encoder=ChatEncoder(tok, template, train_on), **args)


def take(it, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(it) for _ in range(n)]


def test_packing_keeps_conversations_apart(tok, tmp_path):
    """Rows hold several whole conversations; positions restart and document ids change at each, the padding is a
    document of its own, and each conversation's logits in the pack equal its logits alone (a model of its own)."""
    path = write_jsonl(tmp_path / "c.jsonl", conversations(30))
    batch = next(iter(loader(tok, path, seq_len=128)))
    docs, pos = batch["document_ids"], batch["positions"]
    assert int(docs.max()) >= 3  # at least two conversations and the padding in a row
    starts = (pos == 0).nonzero().tolist()
    assert all(int(docs[r, c]) == int(docs[r, c - 1]) + 1 for r, c in starts if c)
    from torchtitan.models.llama3.args import llama3_flavors
    from torchtitan.models.llama3.model import Transformer

    torch.manual_seed(0)
    model = Transformer(llama3_flavors["debugmodel_small"]).double()
    model.init_weights(buffer_device=torch.device("cpu"))
    with torch.no_grad():
        packed = model(batch["tokens"], batch["positions"], batch["document_ids"])
        for r in range(batch["tokens"].shape[0]):
            for d in docs[r].unique().tolist()[:-1]:  # the last document of a row may be padding
                cols = (docs[r] == d).nonzero().flatten()
                alone = model(batch["tokens"][r : r + 1, cols], batch["positions"][r : r + 1, cols],
                              torch.ones(1, len(cols), dtype=torch.long))
                torch.testing.assert_close(packed[r : r + 1, cols], alone, rtol=1e-10, atol=1e-10)


def test_padding_mode_one_conversation_per_row(tok, tmp_path):
    records = conversations(6)
    path = write_jsonl(tmp_path / "c.jsonl", records)
    batch = next(iter(loader(tok, path, packing="pad", document_masking=False, local_batch_size=3, seq_len=128)))
    assert set(batch) == {"tokens", "labels"}
    encoder = ChatEncoder(tok, "chatml")
    for r in range(3):
        ids, trained = encoder.encode_conversation(records[r]["messages"])
        n = len(ids) - 1
        assert batch["tokens"][r, :n].tolist() == ids[:-1]
        assert batch["labels"][r, :n].tolist() == [i if t else IGNORE_INDEX for i, t in zip(ids[1:], trained[1:],
                                                                                           strict=True)]
        assert (batch["tokens"][r, n:] == tok.eos_id).all() and (batch["labels"][r, n:] == IGNORE_INDEX).all()


def test_truncation_and_drop_are_counted(tok, tmp_path, caplog, monkeypatch):
    from torchtitan.tools.logging import logger

    monkeypatch.setattr(logger, "propagate", True)  # init_logger() turns it off; caplog listens at the root
    caplog.set_level(logging.INFO, logger="torchtitan")
    short, long_reply, late_reply = ({"messages": [U("q" * n), A("a" * m)]} for n, m in ((1, 1), (1, 40), (40, 1)))
    path = write_jsonl(tmp_path / "c.jsonl", [short, long_reply, late_reply, short])
    cut = loader(tok, path, seq_len=24, infinite=False, packing="pad", document_masking=False)
    batches = list(cut)
    assert dict(cut.totals) == {"conversations": 3, "rows": 3, "truncated": 2, "no_target": 1}
    assert "record 1 has 62 tokens, more than seq_len + 1 = 25: truncated" in caplog.text
    assert "epoch 0: 3 conversations in 3 rows, 2 truncated to 25 tokens, 1 without a trained token" in caplog.text
    # The long reply cut to seq_len + 1 = 25 tokens: its first 20 are the prompt, the last 5 predict reply tokens.
    row = batches[0]["labels"][1]
    assert (row[19:] != IGNORE_INDEX).all() and (row[:19] == IGNORE_INDEX).all()
    dropped = loader(tok, path, seq_len=24, infinite=False, packing="pad", document_masking=False,
                     truncation="drop")
    list(dropped)
    assert dict(dropped.totals) == {"conversations": 2, "rows": 2, "dropped": 2}


def test_launcher_refuses_unusable_chat_data_in_one_line(tmp_path, capsys, monkeypatch):
    from torchtitan.launch import check_before_torch

    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))  # the datasets cache of the check
    make_tokenizer(tmp_path / "tok")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [U("u")]}])
    good = write_jsonl(tmp_path / "good.jsonl", conversations(2))
    plain = make_tokenizer(tmp_path / "plain", specials=["<s>", "</s>"])
    env = {"NGPU": "1"}
    for path, tokenizer, words in ((bad, tmp_path / "tok", "has no usable chat records (1 bad records: 1 no "
                                                           "assistant turn)"),
                                   (good, plain.path.parent, "the chatml template needs the special tokens")):
        with pytest.raises(SystemExit) as info:
            check_before_torch(["--model.tokenizer_path", str(tokenizer), "--training.dataset_format", "chat",
                                "--training.chat_template", "chatml", "--training.dataset_path", str(path)], env)
        err = capsys.readouterr().err
        assert info.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_resume_gives_the_uninterrupted_batches_under_any_dp_degree(tok, tmp_path, packing):
    path = write_jsonl(tmp_path / "c.jsonl", conversations(25, seed=1))
    whole = take(iter(loader(tok, path, packing=packing)), 20)  # more than one epoch
    for cut, epoch in ((5, 0), (15, 1)):
        first = loader(tok, path, packing=packing)
        take(iter(first), cut)
        state = first.state_dict()
        assert state["epoch"] == epoch and state["doc_token_offset"] == 0 and state["sequences_consumed"] == 2 * cut
        resumed = loader(tok, path, packing=packing)
        resumed.load_state_dict(state)
        for a, b in zip(take(iter(resumed), 20 - cut), whole[cut:], strict=True):
            assert all(torch.equal(a[k], b[k]) for k in b)
    first = loader(tok, path, packing=packing)
    take(iter(first), 5)
    state = first.state_dict()
    # Two ranks of one row each read the rows of one rank of two; a 2-rank state resumes on one rank.
    ranks = [loader(tok, path, packing=packing, local_batch_size=1, dp_rank=r, dp_degree=2) for r in range(2)]
    iters = [iter(r) for r in ranks]
    for step in range(5):
        rows = [next(i) for i in iters]
        assert all(torch.equal(torch.cat([rows[0][k], rows[1][k]]), whole[step][k]) for k in whole[step])
    assert ranks[0].state_dict() == ranks[1].state_dict() == state
    one = loader(tok, path, packing=packing)
    one.load_state_dict(ranks[1].state_dict())
    after = next(iter(one))
    assert all(torch.equal(after[k], whole[5][k]) for k in whole[5])


def test_worker_processes_give_the_same_batches(tok, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", conversations(25, seed=2))
    want = take(iter(loader(tok, path)), 6)
    workers = loader(tok, path, num_workers=2, block_chars=200)
    try:
        got = take(iter(workers), 6)
    finally:
        workers.close()
    assert all(torch.equal(a[k], b[k]) for a, b in zip(got, want, strict=True) for k in b)


def _train(argv: list[str]) -> None:
    from torchtitan.train import main

    main(argv)


def test_training_on_chat_data_counts_only_assistant_tokens(tmp_path):
    """A few steps of the debug model on a chat jsonl: the loss's token count (tokens_seen) is the number of
    assistant characters plus one end of turn per reply, counted from the records themselves; so is validation's on
    held-out conversations."""
    records = conversations(12, seed=3, max_turns=1)
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    held_out = conversations(5, seed=4, max_turns=1)  # validation: held-out conversations, rendered the same way
    val_path = write_jsonl(tmp_path / "val.jsonl", held_out)
    make_tokenizer(tmp_path / "tok")
    steps, batch = 3, 2
    argv = ["--model.flavor", "debugmodel", "--model.tokenizer_path", str(tmp_path / "tok"),
            "--training.dataset_format", "chat", "--training.dataset_path", str(path), "--training.chat_template",
            "llama3", "--training.seq_len", "64", "--training.local_batch_size", str(batch), "--training.steps",
            str(steps), "--training.num_workers", "0", "--metrics.log_freq", "1", "--job.dump_folder",
            str(tmp_path / "out"), "--lr_scheduler.warmup_steps", "1", "--validation.enable", "true",
            "--validation.dataset_path", str(val_path), "--validation.freq", str(steps), "--validation.steps", "-1"]
    code, out, err = run_main(_train, argv, env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                                                 "TORCHTITAN_CACHE_DIR": str(tmp_path / "cache")}, cwd=REPO)
    assert code == 0, err[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    # pad mode: one conversation per row, the first steps x batch conversations (all fit in 65 tokens)
    replies = [m["content"] for r in records[: steps * batch] for m in r["messages"] if m["role"] == "assistant"]
    assert metrics[-1]["tokens_seen"] == sum(len(r) + 1 for r in replies)
    assert all(m["loss"] == m["loss"] and 0 < m["loss"] < 20 for m in metrics)
    # one full pass over the held-out conversations, scoring only their replies
    val_replies = [m["content"] for r in held_out for m in r["messages"] if m["role"] == "assistant"]
    (val,) = [m for m in metrics if "val_tokens" in m]
    assert val["val_tokens"] == sum(len(r) + 1 for r in val_replies) and 0 < val["val_loss"] < 20
