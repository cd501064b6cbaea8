"""Document-source tests: the embedded stdlib corpus and its held-out split, local json/jsonl/parquet/txt
files (map-style and streamed), resuming by raw index, bad input, hub names offline, pickling."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torchtitan.data import datasets, hf_sources
from torchtitan.data.datasets import build_document_source, corpus_fingerprint
from torchtitan.data.source import DocumentSource

DOCS = [f"doc {i}: " + "héllo wörld 🦙 " * (i % 5 + 1) + "\n\nsecond paragraph" * (i % 2) for i in range(23)]
ROOT = Path(__file__).resolve().parents[2]


def _src(path: Path | str, tmp_path: Path, **kw: Any) -> DocumentSource:
    return build_document_source(dataset="local", dataset_path=str(path), cache_dir=str(tmp_path / "hf"), **kw)


def _all(source: DocumentSource, start: int = 0) -> list[tuple[int, str]]:
    return list(source.iter_documents(start))


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _write(fmt: str, folder: Path, docs: list[str] = DOCS) -> Path:
    """`docs` in format `fmt`; returns what dataset_path should name."""
    folder.mkdir(parents=True, exist_ok=True)
    records = [{"id": i, "text": d} for i, d in enumerate(docs)]
    if fmt == "jsonl":
        return _jsonl(folder / "data.jsonl", records)
    if fmt == "json":  # one JSON array
        (folder / "data.json").write_text(json.dumps(records), encoding="utf-8")
        return folder / "data.json"
    if fmt == "jsonl.gz":
        (folder / "data.jsonl.gz").write_bytes(gzip.compress(_jsonl(folder / "x", records).read_bytes()))
        (folder / "x").unlink()
        return folder / "data.jsonl.gz"
    if fmt == "parquet":
        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), folder / "data.parquet",
                       row_group_size=7)  # fmt: skip
        return folder / "data.parquet"
    assert fmt == "txt"  # one document per file; zero-padded names sort in document order
    for i, d in enumerate(docs):
        (folder / f"{i:03d}.txt").write_text(d, encoding="utf-8")
    return folder


FORMATS = ["jsonl", "json", "jsonl.gz", "parquet", "txt"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_local_formats(tmp_path: Path, fmt: str) -> None:
    source = _src(_write(fmt, tmp_path / "data"), tmp_path)
    assert _all(source) == list(enumerate(DOCS))
    assert source.num_documents == len(DOCS) and not source.streaming
    assert _all(source, 17) == list(enumerate(DOCS))[17:]
    assert _all(source, len(DOCS)) == [] and _all(source, 1000) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_streaming_matches_map_style(tmp_path: Path, fmt: str) -> None:
    path = _write(fmt, tmp_path / "data")
    streamed = _src(path, tmp_path, streaming="true")
    assert streamed.streaming and streamed.num_documents is None
    assert _all(streamed) == _all(_src(path, tmp_path, streaming="false")) == list(enumerate(DOCS))
    assert _all(streamed, 9) == list(enumerate(DOCS))[9:]


def test_auto_streams_only_big_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write("jsonl", tmp_path / "data")
    assert not _src(path, tmp_path).streaming
    monkeypatch.setattr(hf_sources, "_STREAM_AUTO_BYTES", path.stat().st_size - 1)
    assert _src(path, tmp_path).streaming


def test_directory_and_glob(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _jsonl(root / "b.jsonl", [{"text": "b0"}, {"text": "b1"}])
    _jsonl(root / "a.jsonl", [{"text": "a0"}])
    _jsonl(root / "sub" / "c.jsonl", [{"text": "c0"}])
    _jsonl(root / ".hidden.jsonl", [{"text": "hidden"}])
    (root / "README.md").write_text("not data")
    texts = [t for _, t in _all(_src(root, tmp_path))]
    assert texts == ["a0", "b0", "b1", "c0"]  # sorted by relative path, recursive, hidden/other skipped
    assert [t for _, t in _all(_src(root / "*.jsonl", tmp_path))] == ["a0", "b0", "b1"]
    assert [t for _, t in _all(_src(f"{root}/**/*.jsonl", tmp_path))] == ["a0", "b0", "b1", "c0"]


def test_txt_documents_and_paragraphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "book.txt").write_text("Chapter 1\n\nIt begins.\n\nChapter 2\n", encoding="utf-8")
    assert _all(_src(tmp_path / "t" / "book.txt", tmp_path)) == [(0, "Chapter 1\n\nIt begins.\n\nChapter 2\n")]
    monkeypatch.setattr(hf_sources, "_TXT_DOCUMENT_MAX_BYTES", 10)  # "huge" files: paragraphs instead
    texts = [t.strip() for _, t in _all(_src(tmp_path / "t" / "book.txt", tmp_path))]
    assert texts == ["Chapter 1", "It begins.", "Chapter 2"]


def test_text_column(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"content": d, "text": "other"} for d in DOCS[:3]])
    assert [t for _, t in _all(_src(path, tmp_path, text_column="content"))] == DOCS[:3]
    pq.write_table(pa.table({"body": DOCS[:3]}), tmp_path / "d.parquet")
    assert [t for _, t in _all(_src(tmp_path / "d.parquet", tmp_path, text_column="body"))] == DOCS[:3]


def test_bad_records_skipped_and_counted(tmp_path: Path) -> None:
    records = [{"text": "one"}, {"text": ""}, {"text": "  \n\t"}, {"text": None}, {}, {"text": "two"}]
    path = _jsonl(tmp_path / "d.jsonl", records)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtitan").addHandler(handler)
    logging.getLogger("torchtitan").setLevel(logging.INFO)
    try:
        for streaming in ("false", "true"):
            source = _src(path, tmp_path, streaming=streaming)
            assert _all(source) == [(0, "one"), (5, "two")]  # raw indexes stay stable
            assert source.skipped_documents == 4
            assert _all(source, 2) == [(5, "two")] and source.skipped_documents == 3
    finally:
        logging.getLogger("torchtitan").removeHandler(handler)
    assert any("skipped 4 empty or non-text records" in m for m in messages)


def test_start_reads_nothing_before_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _src(_write("parquet", tmp_path / "data"), tmp_path)
    seen: list[slice] = []
    real = source.dataset

    class Spy:  # records which rows the source asks the Arrow table for
        def __len__(self) -> int:
            return len(real)

        def __getitem__(self, key: slice) -> Any:
            seen.append(key)
            return real[key]

    source.dataset = Spy()
    assert _all(source, 20) == list(enumerate(DOCS))[20:]
    assert seen and min(s.start for s in seen) == 20
    # Stdlib corpus: records before `start` point at missing files, and are never opened.
    stdlib = build_document_source(dataset="python_stdlib", dataset_path="")
    broken = [datasets._Source(key=f"gone{i}", size=1, path=tmp_path / f"gone{i}") for i in range(5)]
    stdlib.sources = tuple(broken) + stdlib.sources[:3]
    assert [i for i, _ in _all(stdlib, 5)] == [5, 6, 7] and stdlib.skipped_documents == 0
    # Streams use datasets' skip(): records are read, not tokenized; indexes continue from `start`.
    streamed = _src(_write("jsonl", tmp_path / "data2"), tmp_path, streaming="true")
    skips: list[int] = []
    real_stream = streamed.dataset
    monkeypatch.setattr(type(real_stream), "skip", lambda self, n, _real=type(real_stream).skip: (skips.append(n),
                        _real(self, n))[1])  # fmt: skip
    assert _all(streamed, 11) == list(enumerate(DOCS))[11:] and skips == [11]


def _error(tmp_path: Path, path: Path | str, match: str, key: str = "training.dataset_path", **kw: Any) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        _src(path, tmp_path, **kw)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}: "), message
    assert match in message, message
    return message


def test_bad_paths(tmp_path: Path) -> None:
    _error(tmp_path, tmp_path / "nope.jsonl", f"no such file or directory: {tmp_path / 'nope.jsonl'}")
    _error(tmp_path, tmp_path / "nope" / "*.jsonl", f"no files match {tmp_path / 'nope' / '*.jsonl'}")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.md").write_text("x")
    _error(tmp_path, tmp_path / "d", f"no .json/.jsonl/.parquet/.txt/.text files in {tmp_path / 'd'}")
    (tmp_path / "d.csv").write_text("text\nhello\n")
    _error(tmp_path, tmp_path / "d.csv", f"{tmp_path / 'd.csv'}: unsupported file type")
    _error(tmp_path, tmp_path / "d" / "*", "notes.md: unsupported file type")
    _jsonl(tmp_path / "d" / "a.jsonl", [{"text": "x"}])
    (tmp_path / "d" / "b.txt").write_text("y")
    _error(tmp_path, tmp_path / "d", "mixes formats (json: a.jsonl, text: b.txt)")
    msg = _error(tmp_path, tmp_path / "d" / "a.jsonl", "local files have only the 'train' split",
                 key="validation.dataset_split", split="validation", key_prefix="validation")  # fmt: skip
    assert "validation.dataset_path" in msg
    _error(tmp_path, tmp_path / "d" / "a.jsonl", "must be auto, true or false", key="training.dataset_streaming",
           streaming="maybe")  # fmt: skip
    with pytest.raises(ValueError, match=r"^training.dataset: unknown dataset 'nope'; known: c4, c4_validation, "):
        build_document_source(dataset="nope", dataset_path="")


@pytest.mark.parametrize("streaming", ["false", "true"])
def test_bad_contents(tmp_path: Path, streaming: str) -> None:
    kw = {"streaming": streaming}
    path = _jsonl(tmp_path / "c.jsonl", [{"content": "x", "id": 1}])
    _error(tmp_path, path, f"no column 'text' in {path}; columns: content, id", "training.dataset_text_column", **kw)
    path = _jsonl(tmp_path / "n.jsonl", [{"text": 1}, {"text": 2}])
    _error(tmp_path, path, f"column 'text' in {path} holds int64, not text", "training.dataset_text_column", **kw)
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    _error(tmp_path, tmp_path / "p.parquet", f"no column 'text' in {tmp_path / 'p.parquet'}; columns: body",
           "training.dataset_text_column", **kw)  # fmt: skip
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    _error(tmp_path, tmp_path / "bad.parquet", f"{tmp_path / 'bad.parquet'} is not a readable parquet file", **kw)
    path = _jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": " \n "}, {"text": None}])
    _error(tmp_path, path, f"'{path}' has no usable documents (3 records, all empty or not text)", **kw)
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "a.jsonl").write_bytes(b"")
    _error(tmp_path, tmp_path / "z", f"'{tmp_path / 'z'}' has no usable documents (its files are empty)", **kw)
    _jsonl(tmp_path / "z" / "b.jsonl", [{"text": "x"}])
    assert _all(_src(tmp_path / "z", tmp_path, **kw)) == [(0, "x")]  # empty files hold no records
    (tmp_path / "broken.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:-30])
    _error(tmp_path, tmp_path / "broken.jsonl.gz", f"cannot read {tmp_path / 'broken.jsonl.gz'}: EOFError", **kw)
    path = tmp_path / "syntax.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b", oops}\n')
    _error(tmp_path, path, f"{path}")
    (tmp_path / "mix").mkdir()
    _jsonl(tmp_path / "mix" / "a.jsonl", [{"text": "a"}] * 2000)
    _jsonl(tmp_path / "mix" / "b.jsonl", [{"text": 5, "other": [1, 2]}])
    if streaming == "false":
        _error(tmp_path, tmp_path / "mix", "Couldn't cast", **kw)
    else:  # a stream is parsed only as it is read: a later file's bad schema shows up then, still in one line
        source = _src(tmp_path / "mix", tmp_path, **kw)
        with pytest.raises(ValueError, match=r"^training.dataset_path: reading '.*mix' failed near record \d+: Cast"):
            _all(source)
    (tmp_path / "u").mkdir()
    _jsonl(tmp_path / "u" / "a.jsonl", [{"text": "fine"}])
    (tmp_path / "u" / "b.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9 au lait"}\n')
    _error(tmp_path, tmp_path / "u", f"{tmp_path / 'u' / 'b.jsonl'} is not valid UTF-8 (byte 28)", **kw)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_bytes(b"ok \xff\xfe broken")
    _error(tmp_path, tmp_path / "t", f"{tmp_path / 't' / 'a.txt'} is not valid UTF-8 (byte 3)", **kw)
    # Parquet writers can store invalid UTF-8 too (Arrow checks it only when asked).
    data, offsets = b"okcaf\xe9", pa.array([0, 2, 6], pa.int32()).buffers()[1]
    column = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(data)])
    pq.write_table(pa.table({"text": column}), tmp_path / "u8.parquet")
    _error(tmp_path, tmp_path / "u8.parquet", f"{tmp_path / 'u8.parquet'} column 'text' is not valid UTF-8", **kw)


def test_file_check_is_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write("jsonl", tmp_path / "data")
    calls: list[Path] = []
    real = hf_sources._invalid_utf8_offset
    monkeypatch.setattr(hf_sources, "_invalid_utf8_offset", lambda p: (calls.append(p), real(p))[1])
    _src(path, tmp_path, streaming="true")
    _src(path, tmp_path, streaming="false")
    assert calls == [path]
    path.write_text(path.read_text() + json.dumps({"text": "more"}) + "\n")  # a new version is checked again
    _src(path, tmp_path)
    assert calls == [path, path]
    # No cache_dir: checked on every build. (Keep the default HF cache, used then, inside tmp_path.)
    import datasets as hf_datasets

    monkeypatch.setattr(hf_datasets.config, "HF_DATASETS_CACHE", tmp_path / "default_cache")
    build_document_source(dataset="local", dataset_path=str(path))
    assert calls == [path, path, path]


def test_pickle_round_trip(tmp_path: Path) -> None:
    sources = [
        _src(_write("jsonl", tmp_path / "a"), tmp_path),
        _src(_write("parquet", tmp_path / "b"), tmp_path, streaming="true"),
        build_document_source(dataset="python_stdlib_val", dataset_path="", key_prefix="validation"),
    ]
    for source in sources:
        copy = pickle.loads(pickle.dumps(source))
        assert _all(copy, 3) == _all(source, 3) and copy.name == source.name
    assert len(pickle.dumps(sources[0])) < 10_000  # the Arrow cache is memory-mapped by path, not copied


def _first_docs(source: DocumentSource) -> list[tuple[int, str]]:
    return _all(source, 2)[:5]


def test_spawned_worker_iterates_the_same(tmp_path: Path) -> None:
    source = _src(_write("jsonl", tmp_path / "a"), tmp_path, streaming="true")
    with mp.get_context("spawn").Pool(1) as pool:  # a fresh interpreter, as dataloader workers get
        assert pool.apply(_first_docs, (source,)) == _first_docs(source)


def test_stdlib_splits() -> None:
    train = build_document_source(dataset="python_stdlib", dataset_path="")
    val = build_document_source(dataset="python_stdlib_val", dataset_path="", key_prefix="validation")
    train_keys, val_keys = [s.key for s in train.sources], [s.key for s in val.sources]
    every = [s.key for s in datasets._stdlib_sources()]
    assert not set(train_keys) & set(val_keys)
    assert sorted(train_keys + val_keys) == sorted(every)
    assert 0.01 < len(val_keys) / len(every) < 0.04  # ~2%, chosen by key hash
    val_docs = [t for _, t in _all(val)]
    assert len(val_docs) >= 5 and sum(map(len, val_docs)) > 50_000
    assert set(val_docs).isdisjoint(t for _, t in _all(train))
    assert train.num_documents + val.num_documents == len(every)
    assert corpus_fingerprint("python_stdlib") != corpus_fingerprint("python_stdlib_val")


def test_stdlib_deterministic_across_processes() -> None:
    code = (
        "import hashlib\nfrom torchtitan.data.datasets import build_document_source\n"
        "h = hashlib.sha256()\nfor name in ('python_stdlib', 'python_stdlib_val'):\n"
        "    for i, d in build_document_source(dataset=name, dataset_path='').iter_documents():\n"
        "        h.update(f'{name}{i}'.encode() + hashlib.sha256(d.encode()).digest())\nprint(h.hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    h = hashlib.sha256()
    for name in ("python_stdlib", "python_stdlib_val"):
        for i, d in build_document_source(dataset=name, dataset_path="").iter_documents():
            h.update(f"{name}{i}".encode() + hashlib.sha256(d.encode()).digest())
    assert out.stdout.strip() == h.hexdigest()


def test_hub_names_fail_fast_offline(tmp_path: Path) -> None:
    # A child process, so HF_HUB_OFFLINE is in place before huggingface_hub reads it at import.
    code = (
        "import sys, time\nfrom torchtitan.data.datasets import build_document_source\n"
        "for ds, path in (('c4', ''), ('fineweb-edu', ''), ('x', 'someone/some-corpus:cfg')):\n"
        "    start = time.perf_counter()\n"
        "    try:\n        build_document_source(dataset=ds, dataset_path=path, cache_dir=sys.argv[1])\n"
        "    except ValueError as e:\n        print(f'{time.perf_counter() - start:.2f}', e)\n"
    )  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3, out.stdout + out.stderr
    # Without offline mode, huggingface_hub retries for ~24 s per name before failing; a bound well below that
    # (not a speed measurement: a loaded 2-core machine takes 0.1-3 s) shows no retry loop ran.
    assert all(float(line.split()[0]) < 15.0 for line in lines), lines
    assert "training.dataset: cannot open hub dataset allenai/c4 (config en) split 'train'" in lines[0]
    assert "training.dataset: cannot open hub dataset HuggingFaceFW/fineweb-edu (config sample-10BT)" in lines[1]
    assert ("training.dataset_path: no local file or folder 'someone/some-corpus:cfg'; cannot open hub dataset "
            "someone/some-corpus (config cfg)") in lines[2]  # fmt: skip
    assert all("offline?" in line for line in lines)


def test_stdlib_corpus_contents() -> None:
    docs = [t for _, t in build_document_source(dataset="python_stdlib", dataset_path="").iter_documents()]
    assert len(docs) > 500
    assert sum(len(d.encode()) for d in docs) > 5_000_000
    assert all(d.strip() for d in docs)
    keys = [s.key for s in datasets._stdlib_sources()]
    assert "json/decoder.py" in keys and "collections/__init__.py" in keys
    assert any(k.startswith("pydoc_data/topics:") for k in keys)
    assert keys != sorted(keys)  # shuffled, so early batches mix packages and topics
    for key in keys:
        parts = key.split(":")[0].split("/")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts[:-1]), key
        assert key != "pydoc_data/topics.py"
    assert len(corpus_fingerprint("python_stdlib")) == 12


def test_stdlib_skips_undecodable_empty_and_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
        # All three files hash into the training split.
        source = build_document_source(dataset="python_stdlib", dataset_path="")
        docs = [t for _, t in source.iter_documents()]
        assert "print('ok')\n" in docs and "import this\n" not in docs
        assert source.skipped_documents == 2  # latin1.py and blank.py, counted, indexes kept
        assert sorted(s.key for s in datasets._stdlib_sources() if s.path) == ["blank.py", "good.py", "latin1.py"]
        assert corpus_fingerprint("python_stdlib") != before
    finally:
        datasets._stdlib_sources.cache_clear()
