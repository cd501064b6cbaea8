"""Pre-tokenized data: the writer (format, determinism, resume), the loader (same batches and state as the raw-text
path, checks), and the scaling test: 1,024 simulated data-parallel ranks, and resume under a dp change.

Tokenizers: a byte-level one defined here (instant) and a 300-token BPE trained here in milliseconds (the real
Tokenizer class, which worker processes must unpickle); never the default BPE (seconds to train).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from torchtitan.data.dataloader import build_dataloader
from torchtitan.data.datasets import build_document_source
from torchtitan.data.pretokenize import MANIFEST, SETTINGS, pretokenize, shard_paths, tokenizer_fingerprint
from torchtitan.data.pretokenized import PretokenizedDataLoader, PretokenizedSource, open_pretokenized
from torchtitan.data.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[2]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
INFO = {"dataset": "memory", "dataset_path": "", "text_column": "text", "split": "train"}


class ByteTokenizer:
    """Token = UTF-8 byte + 2, BOS 0, EOS 1; counts encode calls."""

    bos_id, eos_id = 0, 1

    def __init__(self, vocab_size: int = 258) -> None:
        self.vocab_size, self.path, self.calls = vocab_size, f"bytes-{vocab_size}", 0

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        self.calls += 1
        return [0] * add_bos + [b + 2 for b in text.encode()] + [1] * add_eos


class ListSource:
    """A document source over a list; indexes in `bad` are skipped (keeping their index), as real sources do."""

    def __init__(self, docs: list[str], bad: frozenset[int] = frozenset(), fail_at: int | None = None) -> None:
        self.name, self.key_prefix, self.docs, self.bad = "memory", "training", docs, bad
        self.num_documents, self.fail_at = len(docs), fail_at

    def iter_documents(self, start: int = 0) -> Iterator[tuple[int, str]]:
        for i in range(start, len(self.docs)):
            if i == self.fail_at:
                raise KeyboardInterrupt  # an interruption mid-run
            if i not in self.bad:
                yield i, self.docs[i]


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(1, 12))) for i in range(n)]


def _source(n: int = 300, **kw) -> ListSource:
    return ListSource(_docs(n), bad=frozenset({3, 17, 150}), **kw)


def _stream(source: ListSource, tokenizer) -> np.ndarray:
    return np.array([t for _, text in source.iter_documents(0) for t in tokenizer.encode(text)], dtype=np.int64)


def _write(folder: Path, source=None, tokenizer=None, **kw) -> dict:
    kw.setdefault("shard_tokens", 2000)  # several shards for a few hundred documents
    return pretokenize(source or _source(), tokenizer or ByteTokenizer(), folder, source_info=INFO, progress=False,
                       block_chars=300, **kw)  # fmt: skip


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_docs(200, seed=1), trainer=trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return build_tokenizer(str(path), tmp_path_factory.mktemp("cache"))


def test_format_and_same_bytes_for_any_worker_count(tmp_path: Path, bpe) -> None:
    source = _source()
    manifest = _write(tmp_path / "w0", source, bpe, workers=0)
    assert _write(tmp_path / "w2", source, bpe, workers=2) == manifest
    assert _files(tmp_path / "w2") == _files(tmp_path / "w0")
    assert manifest["format"] == "torchtitan-pretokenized" and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["vocab_size"] == bpe.vocab_size and len(manifest["shards"]) > 3
    folder, tokens, starts, raw = tmp_path / "w0", [], [], []
    for shard, entry in enumerate(manifest["shards"]):
        bin_path, idx_path = shard_paths(folder, shard)
        data, index = np.fromfile(bin_path, dtype="<u2"), np.load(idx_path)
        assert len(data) == entry["tokens"] and index.shape == (2, entry["documents"]) and index.dtype == np.int64
        assert entry["tokens"] >= 2000 or shard == len(manifest["shards"]) - 1  # closed at the first document end
        assert np.all(data[index[0]] == bpe.bos_id)  # every start is a BOS
        starts += (index[0] + sum(len(t) for t in tokens)).tolist()
        raw += index[1].tolist()
        tokens.append(data)
    assert np.array_equal(np.concatenate(tokens), _stream(source, bpe))  # one epoch of the raw path's stream
    assert raw == [i for i, _ in source.iter_documents(0)]  # raw indexes, the bad documents' left out
    assert manifest["num_tokens"] == sum(map(len, tokens)) and manifest["num_documents"] == len(raw) == len(starts)


def test_uint32_above_65536_ids(tmp_path: Path) -> None:
    manifest = _write(tmp_path, tokenizer=ByteTokenizer(70_000))
    assert manifest["dtype"] == "uint32"
    data = np.concatenate([np.fromfile(shard_paths(tmp_path, i)[0], "<u4") for i in range(len(manifest["shards"]))])
    assert np.array_equal(data, _stream(_source(), ByteTokenizer()))


def test_resume_after_interruption(tmp_path: Path) -> None:
    _write(tmp_path / "whole")
    folder = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        _write(folder, _source(fail_at=200))
    assert (folder / SETTINGS).is_file() and not (folder / MANIFEST).exists()
    with pytest.raises(ValueError, match=r"^training.dataset_path: .* unfinished pre-tokenized folder .*again"):
        open_pretokenized(str(folder))
    kept = sorted(p for p in folder.iterdir() if p.suffix == ".bin")
    assert kept, "some shards completed before the interruption"
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in kept}
    (folder / "shard-00099.bin.tmp").write_bytes(b"left over")
    tok = ByteTokenizer()
    tokenizer_fingerprint(tok)  # cached per tokenizer; its probe text is one encode call
    tok.calls = 0
    manifest = _write(folder, tokenizer=tok)
    assert _files(folder) == _files(tmp_path / "whole")  # byte for byte, the leftover gone
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in kept} == stamps  # complete shards kept
    kept_docs = sum(s["documents"] for s in manifest["shards"][: len(kept)])
    assert tok.calls == manifest["num_documents"] - kept_docs  # only what was not written yet is tokenized
    # A complete folder is left alone; one begun with other settings is refused.
    assert _write(folder, tokenizer=tok) == manifest and tok.calls == manifest["num_documents"] - kept_docs
    with pytest.raises(ValueError, match=r"begun with other settings \(differing: shard_tokens\)"):
        _write(folder, shard_tokens=999)


def _raw_loader(source, tokenizer, seq_len, b, rank=0, dp=1, **kw):
    return build_dataloader(source=source, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=b, dp_rank=rank,
                            dp_degree=dp, block_chars=150, **kw)  # fmt: skip


def _pre_loader(folder, tokenizer, seq_len, b, rank=0, dp=1, **kw) -> PretokenizedDataLoader:
    source = folder if isinstance(folder, PretokenizedSource) else open_pretokenized(str(folder))
    loader = build_dataloader(source=source, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=b,
                              dp_rank=rank, dp_degree=dp, **kw)  # fmt: skip
    assert isinstance(loader, PretokenizedDataLoader)
    return loader


def _same_batch(x: dict, y: dict) -> bool:
    return list(x) == list(y) and all(torch.equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x)


@pytest.mark.parametrize("dp", [1, 3])
def test_same_batches_and_state_as_raw_text(tmp_path: Path, dp: int) -> None:
    source, tok, seq_len, b = _source(160), ByteTokenizer(), 24, 2
    _write(tmp_path, source, shard_tokens=700)
    steps = len(_stream(source, tok)) // (dp * b * (seq_len + 1)) * 2 + 3  # over two epoch boundaries
    for rank in range(dp):
        raw = _raw_loader(source, tok, seq_len, b, rank, dp, document_masking=True)
        pre = _pre_loader(tmp_path, tok, seq_len, b, rank, dp, document_masking=True)
        for k, x, y in zip(range(steps), raw, pre, strict=False):
            assert _same_batch(x, y), (rank, k)
            assert raw.state_dict() == pre.state_dict(), (rank, k)
        # A state saved by the raw path resumes here, and back.
        again = _pre_loader(tmp_path, tok, seq_len, b, rank, dp, document_masking=True)
        again.load_state_dict(raw.state_dict())
        assert all(_same_batch(x, y) for _, x, y in zip(range(3), raw, again, strict=False))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_finite_pass_same_as_raw_text(tmp_path: Path, dp: int) -> None:
    source, tok = _source(40), ByteTokenizer()
    _write(tmp_path, source, shard_tokens=300)
    for rank in range(dp):
        raw = _raw_loader(source, tok, 16, 3, rank, dp, infinite=False, document_masking=True)
        pre = _pre_loader(tmp_path, tok, 16, 3, rank, dp, infinite=False, document_masking=True)
        for _ in range(2):  # every iter() is a fresh pass
            raw_batches, pre_batches = list(raw), list(pre)
            assert len(raw_batches) == len(pre_batches) > 1
            assert all(map(_same_batch, raw_batches, pre_batches))
            assert raw.state_dict() == pre.state_dict()


def test_through_the_config_path(tmp_path: Path, bpe, monkeypatch) -> None:
    """jsonl files -> scripts/pretokenize.py -> training.dataset_path: the batches of the raw-text path."""
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("torchtitan.tools.logging.init_logger", lambda: None)  # keep log records for caplog
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(120, seed=2)))
    spec = importlib.util.spec_from_file_location("pretokenize_script", REPO / "scripts" / "pretokenize.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    bpe_path = str(bpe.path)
    manifest = script.main(["--dataset-path", str(data), "--tokenizer-path", bpe_path, "--output",
                            str(tmp_path / "tok"), "--workers", "0", "--shard-tokens", "500", "--no-progress"])
    assert manifest["source"]["dataset_path"] == str(data) and len(manifest["shards"]) > 1
    kw = {"dataset": "c4", "text_column": "text", "cache_dir": str(tmp_path / "cache")}
    raw_source = build_document_source(dataset_path=str(data), **kw)
    pre_source = build_document_source(dataset_path=str(tmp_path / "tok"), **kw)
    assert isinstance(pre_source, PretokenizedSource)
    raw = _raw_loader(raw_source, bpe, 32, 2, 1, 2, document_masking=True)
    pre = _pre_loader(pre_source, bpe, 32, 2, 1, 2, document_masking=True)
    assert all(_same_batch(x, y) for _, x, y in zip(range(12), raw, pre, strict=False))
    # the start-up log names the source the trainer reads (components/startup.py)
    from torchtitan.components.startup import data_line
    from torchtitan.config.manager import parse_args

    assert data_line(parse_args(["--training.dataset_path", str(tmp_path / "tok")]), pre_source) == \
        f"data: pre-tokenized shards in {tmp_path / 'tok'}"
    assert data_line(parse_args(["--training.dataset_path", str(data)]), raw_source).startswith(
        f"data: {data} (column 'text', split 'train'")


def test_one_line_errors(tmp_path: Path, bpe) -> None:
    _write(tmp_path / "ok")
    with pytest.raises(ValueError, match=r"^training.dataset_path: .*ok was tokenized with another tokenizer "
                                         r"\(bytes-258: 258 tokens, .*\) than model.tokenizer_path gives \(300 tok"):
        _pre_loader(tmp_path / "ok", bpe, 16, 2)
    _write(tmp_path / "big", tokenizer=ByteTokenizer(300))
    with pytest.raises(ValueError, match=r"bytes-300: 300 tokens.* gives \(258 tokens"):  # more ids than the model
        _pre_loader(tmp_path / "big", ByteTokenizer(), 16, 2)
    source = build_document_source(dataset="x", dataset_path=str(tmp_path / "ok"), key_prefix="validation")
    with pytest.raises(ValueError, match=r"^validation.dataset_path: .* holds token ids, not text"):
        next(source.iter_documents(0))
    with pytest.raises(ValueError, match=r"holds only \d+ sequences .* fewer than one global batch"):
        _pre_loader(tmp_path / "ok", ByteTokenizer(), 64, 64, dp=8)
    bin_path, idx_path = shard_paths(tmp_path / "ok", 2)
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"^training.dataset_path: .*ok: shard-00002.bin holds \d+ bytes, the"):
        open_pretokenized(str(tmp_path / "ok"))
    _write(tmp_path / "ok2")
    shard_paths(tmp_path / "ok2", 1)[1].unlink()
    with pytest.raises(ValueError, match=r"shard-00001.idx.npy is missing"):
        open_pretokenized(str(tmp_path / "ok2"))
    assert open_pretokenized(str(tmp_path / "nothing")) is None  # not a folder of ours: read as raw data


def _reference_windows(folder: Path, seq_len: int, count: int) -> np.ndarray:
    manifest = json.loads((folder / MANIFEST).read_text())
    epoch = np.concatenate([np.fromfile(shard_paths(folder, i)[0], "<u2") for i in range(len(manifest["shards"]))])
    w = seq_len + 1
    return np.tile(epoch, -(-count * w // len(epoch)))[: count * w].reshape(count, w)


def _rows(batch: dict) -> np.ndarray:
    return torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1).numpy()


def _run(loaders: list[PretokenizedDataLoader], steps: int, windows: np.ndarray, reads: list,
         batches: list | None = None) -> None:
    """Each rank's `steps` batches must be its windows (step n, rank r, row i = window n*G + r*b + i); `batches`,
    if given, gets each rank's list of batches."""
    for r, loader in enumerate(loaders):
        it = iter(loader)
        if batches is not None:
            batches.append([])
        for _ in range(steps):
            batch = next(it)
            if batches is not None:
                batches[-1].append(batch)
            first, count = loader.last_read
            w, b = loader.seq_len + 1, loader.local_batch_size
            assert count == b * w and first // w == loader.state_dict()["sequences_consumed"] - \
                loader.global_batch_size + r * b
            assert np.array_equal(_rows(batch), windows[first // w : first // w + b])
            reads.append((first, count))


def _covered_once(reads: list[tuple[int, int]], total: int) -> bool:
    reads = sorted(reads)
    return reads[0][0] == 0 and all(a + n == c for (a, n), (c, _) in zip(reads, reads[1:], strict=False)) \
        and sum(n for _, n in reads) == total


def test_1024_simulated_ranks_read_disjoint_windows_and_constant_work(tmp_path: Path) -> None:
    # Local batch 4: with 1 a rank offset of r instead of r * b would read the same windows.
    seq_len, b, steps, tok = 15, 4, 3, ByteTokenizer()
    # About 100K tokens: a global batch of 1024 x 4 windows of 16 tokens is 65,536, so 3 steps cross an epoch end.
    _write(tmp_path, _source(2000), tok, shard_tokens=4000)
    source = open_pretokenized(str(tmp_path))  # one object for all simulated ranks: it only maps files
    assert 2 * 1024 * b * (seq_len + 1) > source.tokens_per_epoch >= 1024 * b * (seq_len + 1)
    per_rank = {}
    for dp in (8, 1024):
        loaders = [_pre_loader(source, tok, seq_len, b, r, dp, document_masking=True) for r in range(dp)]
        windows, reads, batches = _reference_windows(tmp_path, seq_len, steps * dp * b), [], []
        _run(loaders, steps, windows, reads, batches)
        assert _covered_once(reads, steps * dp * b * (seq_len + 1))  # disjoint, and every window once
        assert len({str(loader.state_dict()) for loader in loaders}) == 1
        # One reader of the whole global batch: rank r's batch is its rows r*b .. (r+1)*b - 1, every key (tokens,
        # labels, positions, document ids) included.
        single = iter(_pre_loader(source, tok, seq_len, dp * b, 0, 1, document_masking=True))
        for step in range(steps):
            whole = next(single)
            for r in range(dp):
                rows = {k: v[r * b:(r + 1) * b] for k, v in whole.items()}
                assert _same_batch(batches[r][step], rows), (dp, step, r)
        per_rank[dp] = [loader.reads for loader in loaders]
    # Per-rank work: exactly b*W tokens a step at any dp degree, and the same bounds on slices (a window
    # crosses at most one shard end and one epoch end) and on document starts (documents are >= 2 tokens).
    for dp, counts in per_rank.items():
        assert {c.tokens for c in counts} == {steps * b * (seq_len + 1)}, dp
        assert max(c.slices for c in counts) <= steps * 3 and max(c.searches for c in counts) <= steps * 6, dp
        assert max(c.index_entries for c in counts) <= steps * (b * (seq_len + 1) // 2 + 3), dp
    assert sum(c.tokens for c in per_rank[1024]) / 1024 == sum(c.tokens for c in per_rank[8]) / 8


def test_resume_from_dp4_at_dp2_and_dp8_reads_every_window_once(tmp_path: Path, caplog) -> None:
    seq_len, b, tok = 15, 2, ByteTokenizer()
    _write(tmp_path, tokenizer=tok)
    source = open_pretokenized(str(tmp_path))
    first = [_pre_loader(source, tok, seq_len, b, r, 4) for r in range(4)]
    windows, before = _reference_windows(tmp_path, seq_len, 400), []
    _run(first, 5, windows, before)
    state = first[0].state_dict()
    assert all(loader.state_dict() == state for loader in first) and state["sequences_consumed"] == 40
    for dp, steps in ((2, 7), (8, 3)):
        loaders = [_pre_loader(source, tok, seq_len, b, r, dp) for r in range(dp)]
        for loader in loaders:
            loader.load_state_dict(json.loads(json.dumps(state)))
        after = []
        _run(loaders, steps, windows, after)
        assert _covered_once(before + after, (40 + steps * dp * b) * (seq_len + 1))
        assert all(loader.reads.tokens == steps * b * (seq_len + 1) for loader in loaders)  # O(1): no prefix read
    # sequences_consumed is the position; a state whose other keys disagree is reported, then followed.
    loader = _pre_loader(source, tok, seq_len, b)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        loader.load_state_dict({**state, "next_doc": state["next_doc"] + 5})
    assert "differs from global sequence 40" in caplog.text and loader.state_dict() == state
