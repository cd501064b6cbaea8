"""Corpus, tokenizer and packed/sharded dataloader tests (CPU, no network, a few seconds each)."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from torchtitan.data import datasets
from torchtitan.data.dataloader import PackedSequenceDataset, build_dataloader
from torchtitan.data.datasets import corpus_fingerprint, iter_documents
from torchtitan.data.tokenizer import Tokenizer, build_tokenizer, default_cache_dir


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return list(iter_documents("python_stdlib"))


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


def test_corpus_nonempty_and_stdlib(corpus: list[str]) -> None:
    assert len(corpus) > 500
    assert sum(len(d.encode()) for d in corpus) > 5_000_000
    assert all(d.strip() for d in corpus)
    keys = [s.key for s in datasets._stdlib_sources()]
    assert "json/decoder.py" in keys and "collections/__init__.py" in keys
    assert any(k.startswith("pydoc_data/topics:") for k in keys)
    assert keys != sorted(keys)  # shuffled, so early batches mix packages and topics


def test_corpus_excludes_tests_and_third_party() -> None:
    for source in datasets._stdlib_sources():
        parts = source.key.split(":")[0].split("/")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts[:-1]), source.key
        assert source.key != "pydoc_data/topics.py"


def test_corpus_deterministic_across_processes(corpus: list[str]) -> None:
    assert list(iter_documents("python_stdlib")) == corpus
    # Only the datasets module is imported there (not torch), to keep the child quick.
    code = (
        "import hashlib\nfrom torchtitan.data.datasets import corpus_fingerprint, iter_documents\n"
        "h = hashlib.sha256()\n"
        "for d in iter_documents('python_stdlib'): h.update(hashlib.sha256(d.encode()).digest())\n"
        "print(h.hexdigest(), corpus_fingerprint('python_stdlib'))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    h = hashlib.sha256()
    for d in corpus:
        h.update(hashlib.sha256(d.encode()).digest())
    assert out.stdout.split() == [h.hexdigest(), corpus_fingerprint("python_stdlib")]
    assert len(corpus_fingerprint("python_stdlib")) == 12


def test_corpus_skips_undecodable_empty_and_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "good.py").write_text("print('ok')\n")
    (tmp_path / "latin1.py").write_bytes(b"s = '\xe9t\xe9'\n")
    (tmp_path / "blank.py").write_text("  \n\n")
    for d in ("test", "idlelib/idle_test", "site-packages/pkg"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "x.py").write_text("import this\n")
    before = corpus_fingerprint("python_stdlib")
    monkeypatch.setattr(datasets, "_stdlib_root", lambda: tmp_path)
    datasets._stdlib_sources.cache_clear()
    try:
        docs = list(iter_documents("python_stdlib"))
        assert "print('ok')\n" in docs and "import this\n" not in docs
        assert sorted(s.key for s in datasets._stdlib_sources() if s.path) == ["blank.py", "good.py", "latin1.py"]
        assert corpus_fingerprint("python_stdlib") != before
    finally:
        datasets._stdlib_sources.cache_clear()


def test_unknown_dataset() -> None:
    with pytest.raises(ValueError, match=r"training.dataset: unknown dataset 'nope'; known: python_stdlib"):
        iter_documents("nope")


TEXTS = ["def f(x):\n    return x ** 2\n", "héllo wörld — naïve café", "日本語のテキスト",
         "🦙🔥 emoji 👩‍👩‍👧", "\x00\t\r\n ", ""]  # fmt: skip


def test_default_tokenizer(tok: Tokenizer, builds: Builds) -> None:
    assert tok.vocab_size == 8192
    assert tok.bos_id != tok.eos_id
    name = f"python_stdlib-bpe8192-{corpus_fingerprint('python_stdlib')}.json"
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
    # Text that spells a special token stays text.
    ids = tok.encode("x <|begin_of_text|> y <|end_of_text|>", add_bos=False, add_eos=False)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == "x <|begin_of_text|> y <|end_of_text|>"


def test_cache_hit(builds: Builds) -> None:
    tok, cache = builds.tok, builds.cache_a
    mtime = tok.path.stat().st_mtime_ns
    start = time.perf_counter()
    again = build_tokenizer("", cache)
    assert time.perf_counter() - start < 1.0
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


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def _docs(n: int = 120, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(3, 40))) for i in range(n)]


def _windows(tok: Tokenizer, docs: list[str], seq_len: int, count: int) -> list[list[int]]:
    """The first `count` global windows, computed independently of the dataloader."""
    stream: list[int] = []
    while len(stream) < count * (seq_len + 1):
        for d in docs:
            stream += tok.encode(d)
    return [stream[k * (seq_len + 1) : (k + 1) * (seq_len + 1)] for k in range(count)]


def _loader(tok: Tokenizer, docs, seq_len: int, b: int, rank: int = 0, dp: int = 1, state=None):
    # docs: a list of documents, or a callable returning a fresh iterator over them.
    dl = build_dataloader(
        dataset="memory", tokenizer=tok, seq_len=seq_len, local_batch_size=b, dp_rank=rank, dp_degree=dp,
        documents=docs if callable(docs) else lambda: iter(docs),
    )  # fmt: skip
    if state is not None:
        dl.load_state_dict(state)
    return dl


def _take(dl, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(dl)
    return [next(it) for _ in range(steps)]


def _same(xs: list[tuple[torch.Tensor, torch.Tensor]], ys: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return all(torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]) for a, c in zip(xs, ys, strict=True))


def _rows(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[int]]:
    # Rebuild each seq_len+1 window from (input_ids, labels).
    return [x.tolist() + [y[-1].item()] for xb, yb in batches for x, y in zip(xb, yb, strict=True)]


def test_packing_windows_and_epochs(tok: Tokenizer) -> None:
    docs, seq_len, b = _docs(30), 16, 4
    per_epoch = sum(len(tok.encode(d)) for d in docs) // (seq_len + 1)
    steps = per_epoch // b + 3  # run into the second epoch
    dl = _loader(tok, docs, seq_len, b)
    batches = _take(dl, steps)
    for x, y in batches:
        assert x.shape == y.shape == (b, seq_len) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
    rows = _rows(batches)
    assert rows == _windows(tok, docs, seq_len, steps * b)
    flat = [t for r in rows for t in r]
    assert any(flat[i : i + 2] == [tok.eos_id, tok.bos_id] for i in range(len(flat) - 1))
    assert dl.state_dict() == {"sequences_consumed": steps * b, "epoch": 1}


def test_lazy_tokenization(tok: Tokenizer) -> None:
    pulled = 0

    def documents() -> Iterator[str]:
        nonlocal pulled
        for d in _docs(5000):
            pulled += 1
            yield d

    _take(_loader(tok, documents, 32, 2), 10)
    assert 0 < pulled < 200


def test_real_corpus_batches(tok: Tokenizer) -> None:
    kw = dict(dataset="python_stdlib", tokenizer=tok, seq_len=64, local_batch_size=2, dp_rank=1, dp_degree=2)
    dl = build_dataloader(**kw)
    for x, _ in _take(dl, 5):
        assert x.shape == (2, 64) and int(x.max()) < tok.vocab_size
    assert dl.state_dict() == {"sequences_consumed": 20, "epoch": 0}


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_exactly_once_coverage(tok: Tokenizer, dp: int) -> None:
    docs, seq_len, b, steps = _docs(), 8, 2, 6
    ref = _take(_loader(tok, docs, seq_len, dp * b), steps)  # one process, the whole global batch
    per_rank = [_take(_loader(tok, docs, seq_len, b, r, dp), steps) for r in range(dp)]
    for k in range(steps):
        assert torch.equal(torch.cat([per_rank[r][k][0] for r in range(dp)]), ref[k][0])
        assert torch.equal(torch.cat([per_rank[r][k][1] for r in range(dp)]), ref[k][1])
    expected = _windows(tok, docs, seq_len, steps * dp * b)
    assert len({tuple(w) for w in expected}) == len(expected)  # the test corpus has no repeats
    got = Counter(tuple(r) for rank in per_rank for r in _rows(rank))
    assert got == Counter(tuple(w) for w in expected)  # every global sequence exactly once


def test_resume_same_dp(tok: Tokenizer) -> None:
    docs, seq_len, b, dp = _docs(), 8, 2, 2
    loaders = [_loader(tok, docs, seq_len, b, r, dp) for r in range(dp)]
    iters = [iter(dl) for dl in loaders]
    [next(it) for it in iters for _ in range(3)]
    states = [dl.state_dict() for dl in loaders]
    assert states == [{"sequences_consumed": 3 * dp * b, "epoch": 0}] * dp
    for r in range(dp):
        resumed = _take(_loader(tok, docs, seq_len, b, r, dp, state=states[0]), 3)
        assert _same(resumed, [next(iters[r]) for _ in range(3)])


@pytest.mark.parametrize(("old", "new", "steps"), [((2, 2), (3, 2), 2), ((1, 4), (2, 2), 3), ((2, 2), (4, 2), 4)])
def test_resume_different_dp(tok: Tokenizer, old: tuple[int, int], new: tuple[int, int], steps: int) -> None:
    docs, seq_len = _docs(), 8
    (dp0, b0), (dp1, b1) = old, new
    states = []
    for r in range(dp0):
        dl = _loader(tok, docs, seq_len, b0, r, dp0)
        _take(dl, steps)
        states.append(dl.state_dict())
    assert all(s == states[0] for s in states)
    cursor = states[0]["sequences_consumed"]
    assert cursor == steps * dp0 * b0
    resumed = [_take(_loader(tok, docs, seq_len, b1, r, dp1, state=states[0]), 3) for r in range(dp1)]
    windows = _windows(tok, docs, seq_len, cursor + 3 * dp1 * b1)
    g = dp1 * b1
    for k in range(3):
        union = [w for r in range(dp1) for w in _rows([resumed[r][k]])]
        assert union == windows[cursor + k * g : cursor + (k + 1) * g]


def test_resume_across_epoch_boundary(tok: Tokenizer) -> None:
    docs, seq_len, b = _docs(20), 8, 3
    per_epoch = sum(len(tok.encode(d)) for d in docs) // (seq_len + 1)
    steps = per_epoch // b + 2
    dl = _loader(tok, docs, seq_len, b)
    it = iter(dl)
    [next(it) for _ in range(steps)]
    state = dl.state_dict()
    assert state["epoch"] == 1
    fresh = _loader(tok, docs, seq_len, b, state=state)
    assert fresh.state_dict() == state
    assert _same(_take(fresh, 2), [next(it) for _ in range(2)])


def test_bad_state(tok: Tokenizer) -> None:
    dl = _loader(tok, _docs(), 8, 2)
    with pytest.raises(ValueError, match="dataloader state"):
        dl.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="dataloader state"):
        dl.load_state_dict({"sequences_consumed": -1, "epoch": 0})


def test_too_small_corpus(tok: Tokenizer) -> None:
    msg = r"training.dataset 'memory'.*training.seq_len.*training.local_batch_size"
    with pytest.raises(ValueError, match=msg):
        _loader(tok, ["a tiny corpus", "of two docs"], 16, 2, 0, 2)
    ds = PackedSequenceDataset("memory", tok, 16, 2, 1, 2, documents=lambda: iter(["tiny"]))
    with pytest.raises(ValueError, match=msg):
        next(iter(ds))
    with pytest.raises(ValueError, match="training.dataset: unknown dataset 'nope'"):
        build_dataloader(dataset="nope", tokenizer=tok, seq_len=8, local_batch_size=1, dp_rank=0, dp_degree=1)
