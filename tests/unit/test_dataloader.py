"""Packed, dp-sharded dataloader: exactness for any dp degree and worker count, resume, epochs, finite mode.

Uses an in-memory document source and a byte-level tokenizer defined here (both picklable, so worker
processes can import them), so no tokenizer training is needed.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator

import pytest
import torch

from torchtitan.data.dataloader import STATE_KEYS, build_dataloader

BOS, EOS = 0, 1


class ByteTokenizer:
    """Token = UTF-8 byte + 2; counts encode calls (in this process) to prove what was tokenized."""

    vocab_size, bos_id, eos_id = 258, BOS, EOS

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        self.calls += 1
        return [BOS] * add_bos + [b + 2 for b in text.encode()] + [EOS] * add_eos


class ListSource:
    """A DocumentSource over a list; indices in `bad` are skipped, as a real source skips bad documents."""

    def __init__(self, docs: list[str], bad: frozenset[int] = frozenset()) -> None:
        self.name, self.docs, self.bad, self.num_documents = "memory", docs, bad, len(docs)

    def iter_documents(self, start: int = 0) -> Iterator[tuple[int, str]]:
        return ((i, self.docs[i]) for i in range(start, len(self.docs)) if i not in self.bad)


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def _source(n: int = 60, seed: int = 0, bad: frozenset[int] = frozenset({3, 17})) -> ListSource:
    rng = random.Random(seed)
    return ListSource([f"doc {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(1, 30))) for i in range(n)], bad)


def _reference(source: ListSource, min_tokens: int = 0, epochs: int | None = None) -> tuple[list[int], list[int]]:
    """The packed stream (tokens, in-document positions), built independently of the dataloader."""
    tokens, positions, epoch = [], [], 0
    while len(tokens) < min_tokens if epochs is None else epoch < epochs:
        for _, text in source.iter_documents(0):
            ids = ByteTokenizer().encode(text)
            tokens += ids
            positions += range(len(ids))
        epoch += 1
    return tokens, positions


def _loader(source: ListSource, seq_len: int, b: int, rank: int = 0, dp: int = 1, **kw):
    kw.setdefault("tokenizer", ByteTokenizer())
    kw.setdefault("block_chars", 150)  # several documents per block, many blocks per epoch
    return build_dataloader(source=source, seq_len=seq_len, local_batch_size=b, dp_rank=rank, dp_degree=dp, **kw)


def _as_tuple(batch: dict[str, torch.Tensor] | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """(tokens, labels[, positions, document_ids]) of a batch dict, in the loader's key order."""
    if isinstance(batch, dict):
        assert list(batch)[:2] == ["tokens", "labels"] and set(batch) <= {"tokens", "labels", "positions",
                                                                         "document_ids"}, list(batch)
        return tuple(batch.values())
    return batch


def _take(loader, steps: int) -> list[tuple[torch.Tensor, ...]]:
    it = iter(loader)
    return [_as_tuple(next(it)) for _ in range(steps)]


def _rows(batches: list[tuple[torch.Tensor, ...]]) -> list[list[int]]:
    # Rebuild each seq_len+1 window from (input_ids, labels); an ignored last label was padding (EOS).
    pairs = [(x, y) for xb, yb, *_ in map(_as_tuple, batches) for x, y in zip(xb, yb, strict=True)]
    return [x.tolist() + [int(y[-1]) if y[-1] != -100 else EOS] for x, y in pairs]


def _same(xs: list, ys: list) -> bool:
    if len(xs) != len(ys):
        return False
    xs, ys = list(map(_as_tuple, xs)), list(map(_as_tuple, ys))
    return all(len(a) == len(c) and all(map(torch.equal, a, c)) for a, c in zip(xs, ys, strict=True))


def test_windows_positions_and_epochs() -> None:
    source, seq_len, b = _source(), 16, 3
    ref_tokens, ref_positions = _reference(source, 0, epochs=1)
    steps = len(ref_tokens) // ((seq_len + 1) * b) * 2 + 2  # two epochs and a bit
    batches = _take(_loader(source, seq_len, b, document_masking=True), steps)
    ref_tokens, ref_positions = _reference(source, steps * b * (seq_len + 1))
    first_column = (torch.arange(seq_len) == 0).expand(b, seq_len)
    for k, (x, y, pos, docs) in enumerate(batches):
        assert x.shape == y.shape == pos.shape == docs.shape == (b, seq_len)
        assert x.dtype == y.dtype == pos.dtype == docs.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        start = k * b * (seq_len + 1)
        window = torch.tensor(ref_positions[start : start + b * (seq_len + 1)]).view(b, seq_len + 1)
        # In-document positions, counted from the row's start for a document that began before it.
        assert torch.equal(pos, torch.minimum(window[:, :-1], torch.arange(seq_len)))
        # Positions restart at 0 exactly at every BOS (and at the row's start) and count up by one inside a document.
        assert torch.equal(pos == 0, (x == BOS) | first_column)
        step_up = pos[:, 1:] == pos[:, :-1] + 1
        assert torch.equal(step_up, x[:, 1:] != BOS)
        # A new document id exactly where a position restarts.
        assert torch.equal(docs[:, 0], torch.ones(b, dtype=torch.int64))
        assert torch.equal(docs[:, 1:] - docs[:, :-1], (pos[:, 1:] == 0).long())
    rows = _rows(batches)
    w = seq_len + 1
    assert rows == [ref_tokens[i * w : (i + 1) * w] for i in range(steps * b)]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_exactly_once_coverage(dp: int) -> None:
    source, seq_len, b, steps = _source(), 8, 2, 7
    ref = _take(_loader(source, seq_len, dp * b), steps)  # one process reading the whole global batch
    per_rank = [_take(_loader(source, seq_len, b, r, dp), steps) for r in range(dp)]
    for k in range(steps):
        for t in range(2):
            assert torch.equal(torch.cat([per_rank[r][k][t] for r in range(dp)]), ref[k][t])
    tokens, _ = _reference(source, steps * dp * b * (seq_len + 1))
    expected = [tokens[i * (seq_len + 1) : (i + 1) * (seq_len + 1)] for i in range(steps * dp * b)]
    got = sorted(row for rank in per_rank for row in _rows(rank))
    assert got == sorted(expected)  # every global sequence exactly once


def test_state_identical_across_ranks_and_json() -> None:
    source, dp = _source(), 3
    loaders = [_loader(source, 8, 2, r, dp) for r in range(dp)]
    for dl in loaders:
        _take(dl, 5)
    states = [dl.state_dict() for dl in loaders]
    assert all(s == states[0] for s in states)
    assert set(states[0]) == set(STATE_KEYS) and all(type(v) is int for v in states[0].values())
    assert states[0]["sequences_consumed"] == 5 * dp * 2
    restored = json.loads(json.dumps(states[0]))
    fresh = _loader(source, 8, 2, 1, dp)
    fresh.load_state_dict(restored)
    assert fresh.state_dict() == states[0]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch(workers: int) -> None:
    source, seq_len, b, dp = _source(), 8, 2, 2
    runs = [_loader(source, seq_len, b, r, dp, num_workers=workers) for r in range(dp)]
    iters = [iter(dl) for dl in runs]
    for it in iters:
        for _ in range(4):
            next(it)
    state = runs[0].state_dict()
    assert state == runs[1].state_dict() and state["epoch"] == 0 and state["doc_token_offset"] > 0
    for r in range(dp):
        resumed = _loader(source, seq_len, b, r, dp, num_workers=workers)
        resumed.load_state_dict(state)
        assert _same(_take(resumed, 6), [next(iters[r]) for _ in range(6)])  # runs into the second epoch
        resumed.close()
    for dl in runs:
        dl.close()


@pytest.mark.parametrize("new_dp", [1, 2, 3, 8])
def test_resume_with_other_dp(new_dp: int) -> None:
    source, seq_len, b, steps, more = _source(), 8, 2, 3, 4
    before = []
    states = []
    for r in range(4):
        dl = _loader(source, seq_len, b, r, 4)
        before += _rows(_take(dl, steps))
        states.append(dl.state_dict())
    assert all(s == states[0] for s in states)
    cursor = states[0]["sequences_consumed"]
    after = []
    for r in range(new_dp):
        dl = _loader(source, seq_len, b, r, new_dp)
        dl.load_state_dict(states[0])
        after += _rows(_take(dl, more))
    # Union of both runs = the first sequences of the uninterrupted stream, none twice.
    total = cursor + more * new_dp * b
    tokens, _ = _reference(source, total * (seq_len + 1))
    expected = [tokens[i * (seq_len + 1) : (i + 1) * (seq_len + 1)] for i in range(total)]
    assert sorted(before + after) == sorted(expected)


def test_resume_across_epoch_boundary() -> None:
    source, seq_len, b = _source(20), 8, 3
    per_epoch = len(_reference(source, epochs=1)[0]) // (seq_len + 1)
    dl = _loader(source, seq_len, b)
    it = iter(dl)
    for _ in range(per_epoch // b + 2):
        next(it)
    state = dl.state_dict()
    assert state["epoch"] == 1
    fresh = _loader(source, seq_len, b)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert _same(_take(fresh, 3), [next(it) for _ in range(3)])


def test_tokenizes_lazily() -> None:
    tok = ByteTokenizer()
    dl = _loader(_source(5000), 32, 2, tokenizer=tok)
    tok.calls = 0
    _take(dl, 10)  # ~660 tokens: a few blocks of documents, not the corpus
    assert 0 < tok.calls < 30


def test_first_blocks_are_small_and_change_no_token() -> None:
    # A pass starts with blocks of FIRST_BLOCK_CHARS that double up to block_chars: the first batch waits for a
    # few documents, not 32K characters of them, and the packed stream is the one-document-at-a-time reference.
    from torchtitan.data.dataloader import DEFAULT_BLOCK_CHARS, FIRST_BLOCK_CHARS

    source = _source(3000, bad=frozenset())
    doc_chars = sum(len(text) for _, text in source.iter_documents(0)) / source.num_documents
    tok = ByteTokenizer()
    dl = _loader(source, 32, 2, tokenizer=tok, block_chars=DEFAULT_BLOCK_CHARS)
    tok.calls = 0
    it = iter(dl)
    first = [next(it)]
    assert tok.calls <= FIRST_BLOCK_CHARS / doc_chars + 2, (tok.calls, doc_chars)  # ~40, not ~400
    batches = first + [next(it) for _ in range(500)]  # ~33K tokens: past the 4K+8K+16K blocks into a full one
    assert tok.calls > DEFAULT_BLOCK_CHARS / doc_chars
    tokens, _ = _reference(source, min_tokens=501 * 2 * 33)
    rows = _rows(batches)
    assert [t for row in rows for t in row] == tokens[:len(rows) * 33]


def test_resume_does_not_retokenize_prefix() -> None:
    source = _source(400, bad=frozenset())
    tok = ByteTokenizer()
    dl = _loader(source, 64, 2, tokenizer=tok, block_chars=1)  # one document per block
    _take(dl, 100)
    state = dl.state_dict()
    assert state["next_doc"] > 100
    tok2 = ByteTokenizer()
    resumed = _loader(source, 64, 2, tokenizer=tok2, block_chars=1)
    tok2.calls = 0  # build_dataloader's epoch-size check tokenized the first few documents
    resumed.load_state_dict(state)
    batch = _take(resumed, 1)
    assert _same(batch, _take(dl, 1))
    # One batch of 130 tokens needs the resume document plus a few more, never the prefix.
    assert tok2.calls <= 6


def test_epoch_logged_once() -> None:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("torchtitan")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        source = _source(10)
        tokens, _ = _reference(source, 0, epochs=1)
        steps = 3 * len(tokens) // 9 // 2 + 1  # into the fourth epoch (seq_len 8, batch 2)
        _take(_loader(source, 8, 2), steps)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    epochs = [m for m in records if m.startswith("training.dataset 'memory': epoch")]
    assert epochs == ["training.dataset 'memory': epoch 1", "training.dataset 'memory': epoch 2",
                      "training.dataset 'memory': epoch 3"]  # fmt: skip


def test_too_small_dataset() -> None:
    source = ListSource(["a tiny corpus", "of two docs"])
    msg = r"training.dataset 'memory' holds only 3 sequences .*training.seq_len.*training.local_batch_size"
    with pytest.raises(ValueError, match=msg):
        _loader(source, 8, 2, 0, 2)
    with pytest.raises(ValueError, match="training.dataset 'memory' holds only 0"):
        _loader(ListSource([]), 8, 1)
    assert list(_loader(ListSource([]), 8, 1, infinite=False)) == []  # validation of nothing: no batches


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("n_docs", [7, 13])
def test_finite_pass_even_and_exactly_once(dp: int, n_docs: int) -> None:
    source, seq_len, b = _source(n_docs, seed=n_docs, bad=frozenset({2})), 8, 2
    w = seq_len + 1
    per_rank = [[_as_tuple(batch) for batch in _loader(source, seq_len, b, r, dp, infinite=False,
                                                       document_masking=True)] for r in range(dp)]
    steps = len(per_rank[0])
    assert all(len(batches) == steps for batches in per_rank)  # no rank waits in a collective alone
    tokens, _ = _reference(source, 0, epochs=1)
    assert steps == -(-len(tokens) // (w * dp * b))  # ceil: the last step is the only padded one
    # Global order: step k, rank r, row i is window k*G + r*b + i.
    windows = [row for k in range(steps) for r in range(dp) for row in _rows([per_rank[r][k]])]
    labels = [y.tolist() for k in range(steps) for r in range(dp) for y in per_rank[r][k][1]]
    flat = [t for row in windows for t in row]
    assert flat[: len(tokens)] == tokens  # every real token once, in order
    assert all(t == EOS for t in flat[len(tokens) :])  # padding
    # Token c > 0 of window j is the target labels[j][c - 1]: real tokens are targets, padding never.
    targets = [(j * w + c < len(tokens), labels[j][c - 1] != -100) for j in range(len(labels)) for c in range(1, w)]
    assert all(real == target for real, target in targets)
    # Padding forms one pseudo-document per row: its positions count from 0 where it starts.
    _, ref_positions = _reference(source, epochs=1)
    positions = [p.tolist() for k in range(steps) for r in range(dp) for p in per_rank[r][k][2]]
    for j, row in enumerate(positions):
        real = min(max(len(tokens) - j * w, 0), seq_len)
        in_document = [min(p, i) for i, p in enumerate(ref_positions[j * w : j * w + real])]
        assert row == in_document + list(range(seq_len - real))


def test_bad_state() -> None:
    dl = _loader(_source(), 8, 2)
    good = dl.state_dict()
    with pytest.raises(ValueError, match="dataloader state: missing keys next_doc, doc_token_offset"):
        dl.load_state_dict({"sequences_consumed": 0, "epoch": 0})
    with pytest.raises(ValueError, match="dataloader state: doc_token_offset must be ints >= 0"):
        dl.load_state_dict({**good, "doc_token_offset": -1})
    with pytest.raises(ValueError, match="dataloader state: epoch must be ints >= 0"):
        dl.load_state_dict({**good, "epoch": True})
    with pytest.raises(ValueError, match="dataloader state: missing keys sequences_consumed, next_doc"):
        dl.load_state_dict([1, 2])  # type: ignore[arg-type]
    assert dl.state_dict() == good


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="training.seq_len"):
        _loader(_source(), 0, 2)
    with pytest.raises(ValueError, match="training.local_batch_size"):
        _loader(_source(), 8, 0)
    with pytest.raises(ValueError, match="training.num_workers"):
        _loader(_source(), 8, 2, num_workers=-1)
    with pytest.raises(ValueError, match="dp_rank 2 is not in"):
        _loader(_source(), 8, 2, 2, 2)
