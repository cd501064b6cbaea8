"""Dataset mixtures: the schedule's proportions, exactly-once per source under any dp degree, resume across a dp
change, a one-source mixture equal to the plain loader, pre-tokenized sources, metrics, and one-line errors.

Corpora are tiny jsonl files written here; the tokenizer is the byte-level one the data tests use (instant).
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from torchtitan.config import validate
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.data.dataloader import build_dataloader
from torchtitan.data.datasets import build_document_source
from torchtitan.data.mixture import MixtureSchedule, build_mixture_dataloader, parse_mixture
from torchtitan.data.pretokenize import pretokenize

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
SEQ_LEN = 15  # windows of 16 tokens: documents of 10-70 tokens span windows and epochs end mid-window


class ByteTokenizer:
    """Token = UTF-8 byte + 2, BOS 0, EOS 1 (as in test_dataloader.py / test_pretokenized.py)."""

    vocab_size, bos_id, eos_id, path = 258, 0, 1, "bytes-258"

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return [0] * add_bos + [b + 2 for b in text.encode()] + [1] * add_eos


def _corpus(folder: Path, name: str, n: int, seed: int) -> str:
    rng = random.Random(seed)
    path = folder / f"{name}.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"{name} {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(1, 10)))}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[list[str], str]:
    """Three sources of different sizes (the small one loops many epochs), and a datasets cache folder."""
    folder = tmp_path_factory.mktemp("mix")
    paths = [_corpus(folder, "web", 40, 0), _corpus(folder, "code", 15, 1), _corpus(folder, "math", 2, 2)]
    return paths, str(folder / "cache")


def _loader(entries: list[str], cache: str, b: int, rank: int = 0, dp: int = 1, **kw):
    return build_mixture_dataloader(entries=entries, tokenizer=ByteTokenizer(), seq_len=SEQ_LEN, local_batch_size=b,
                                    dp_rank=rank, dp_degree=dp, source_args={"cache_dir": cache}, **kw)


def _take(loader, steps: int) -> list[dict[str, torch.Tensor]]:
    it = iter(loader)
    return [next(it) for _ in range(steps)]


def _windows(path: str, cache: str, count: int) -> list[torch.Tensor]:
    """The first `count` windows of one source's own packed stream (epochs repeating), built independently."""
    source = build_document_source(dataset="", dataset_path=path, cache_dir=cache)
    stream: list[int] = []
    while len(stream) < count * (SEQ_LEN + 1):
        for _, text in source.iter_documents(0):
            stream += ByteTokenizer().encode(text)
    return [torch.tensor(stream[j * (SEQ_LEN + 1) : (j + 1) * (SEQ_LEN + 1)]) for j in range(count)]


def _epoch_tokens(path: str, cache: str) -> int:
    source = build_document_source(dataset="", dataset_path=path, cache_dir=cache)
    return sum(len(ByteTokenizer().encode(text)) for _, text in source.iter_documents(0))


def test_schedule_within_one_sequence_in_every_prefix() -> None:
    rng = random.Random(0)
    cases = [[Fraction(7, 10), Fraction(2, 10), Fraction(1, 10)], [Fraction(1)] * 5]
    cases += [[Fraction(rng.randint(1, 40), rng.choice([1, 10, 100])) for _ in range(rng.randint(1, 8))]
              for _ in range(40)]  # fmt: skip
    for weights in cases:
        schedule, again = MixtureSchedule(weights), MixtureSchedule(list(weights))
        assert schedule.order.tolist() == again.order.tolist()  # deterministic: the weights alone decide
        assert sum(schedule.counts) == schedule.period
        taken = [0] * len(weights)
        for k in range(min(3 * schedule.period, 2000)):  # past the period: the closed form wraps correctly
            taken[schedule.source(k)] += 1
            assert schedule.taken(k + 1) == taken
            assert all(abs(t - s * (k + 1)) < 1 for t, s in zip(taken, schedule.shares, strict=True)), (weights, k)
    assert MixtureSchedule([Fraction(7, 10), Fraction(2, 10), Fraction(1, 10)]).order.tolist() == \
        [0, 0, 1, 0, 0, 2, 0, 0, 1, 0]  # fmt: skip


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_every_source_window_exactly_once_in_order_for_any_dp(corpora, dp: int) -> None:
    paths, cache = corpora
    entries = [f"{paths[0]}:0.5", f"{paths[1]}:0.3", f"{paths[2]}:0.2"]
    b, steps = 2, 6
    ranks = [_take(_loader(entries, cache, b, r, dp), steps) for r in range(dp)]
    schedule = MixtureSchedule([Fraction(5, 10), Fraction(3, 10), Fraction(2, 10)])
    n = steps * dp * b
    reference = [_windows(p, cache, t + 1) for p, t in zip(paths, schedule.taken(n), strict=True)]
    got = torch.cat([torch.cat([ranks[r][s]["tokens"] for r in range(dp)]) for s in range(steps)])
    labels = torch.cat([torch.cat([ranks[r][s]["labels"] for r in range(dp)]) for s in range(steps)])
    for k in range(n):
        source = schedule.source(k)
        window = reference[source][schedule.taken(k)[source]]  # the source's next window, in its own order
        assert torch.equal(got[k], window[:-1]) and torch.equal(labels[k], window[1:]), k
    if dp == 4:  # the small source went round more than once
        assert schedule.taken(n)[2] * (SEQ_LEN + 1) > 2 * _epoch_tokens(paths[2], cache)


def test_resume_saved_at_dp4_continues_at_dp2(corpora) -> None:
    paths, cache = corpora
    entries = [f"{paths[0]}:5", f"{paths[1]}:3", f"{paths[2]}:2"]
    single = _take(_loader(entries, cache, 8), 7)  # 1 rank, batch 8 = the global batch at dp 4 x 2 and dp 2 x 4
    dp4 = [_loader(entries, cache, 2, r, 4) for r in range(4)]
    for loader in dp4:
        _take(loader, 3)
    states = [loader.state_dict() for loader in dp4]
    assert all(s == states[0] for s in states) and states[0]["sequences_consumed"] == 24
    for rank in range(2):
        resumed = _loader(entries, cache, 4, rank, 2)
        resumed.load_state_dict(states[0])
        for step, batch in enumerate(_take(resumed, 4), start=3):
            for key in batch:
                assert torch.equal(batch[key], single[step][key][rank * 4 : (rank + 1) * 4]), (rank, step, key)
    changed = _loader([f"{paths[0]}:1", f"{paths[1]}:1", f"{paths[2]}:1"], cache, 4)
    with pytest.raises(ValueError, match=r"^training.dataset_mixture: the checkpoint's source 0 gave 12 .* gives 8"):
        changed.load_state_dict(states[0])


def test_one_source_mixture_is_the_plain_loader(corpora) -> None:
    paths, cache = corpora
    source = build_document_source(dataset="", dataset_path=paths[1], cache_dir=cache)
    plain = build_dataloader(source=source, tokenizer=ByteTokenizer(), seq_len=SEQ_LEN, local_batch_size=3,
                             dp_rank=1, dp_degree=2, document_masking=True)  # fmt: skip
    mixture = _loader([f"{paths[1]}:1"], cache, 3, 1, 2, document_masking=True)
    for x, y in zip(_take(plain, 9), _take(mixture, 9), strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    state = mixture.state_dict()
    assert {k[5:]: v for k, v in state.items() if k.startswith("mix0_")} == plain.state_dict()
    assert mixture.mixture_metrics() == {"data/mix/code": 1.0}


def test_pretokenized_source_gives_the_same_batches(corpora, tmp_path: Path) -> None:
    paths, cache = corpora
    source = build_document_source(dataset="", dataset_path=paths[0], cache_dir=cache)
    pretokenize(source, ByteTokenizer(), tmp_path / "web", source_info={"dataset_path": paths[0]}, progress=False,
                shard_tokens=100)  # several shards  # fmt: skip
    raw = [f"{paths[0]}:0.5", f"{paths[2]}:0.5"]
    pre = [f"{tmp_path / 'web'}:0.5", f"{paths[2]}:0.5"]
    for rank in range(2):
        a, b = _loader(raw, cache, 2, rank, 2, document_masking=True), _loader(pre, cache, 2, rank, 2,
                                                                               document_masking=True)
        for x, y in zip(_take(a, 8), _take(b, 8), strict=True):
            assert all(torch.equal(x[k], y[k]) for k in x)
        assert a.state_dict() == b.state_dict()


def test_realised_proportions_logged(corpora, caplog) -> None:
    paths, cache = corpora
    loader = _loader([f"{paths[0]}:0.7", f"{paths[1]}:0.2", f"{paths[2]}:0.1"], cache, 5, 0, 2)
    _take(loader, 3)
    assert loader.mixture_metrics() == {"data/mix/web": 0.7, "data/mix/code": 0.2, "data/mix/math": 0.1}
    with caplog.at_level("INFO"):
        _loader([f"{paths[0]}:0.7", f"{paths[1]}:0.2", f"{paths[2]}:0.1"], cache, 5).load_state_dict(
            loader.state_dict())
    assert "resuming at global sequence 30; web (target 0.7): 21 sequences, 336 tokens, 0.7000" in caplog.text


def _config_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        validate.check_values(parse_args(argv))
    return str(e.value)


def test_one_line_errors(corpora) -> None:
    paths, cache = corpora
    for entries, match in (
        (["c4:0.7", "python_stdlib:x"], r"'python_stdlib:x': the weight 'x' is not a number"),
        (["c4:0.7", "python_stdlib:-1"], r"'python_stdlib:-1': the weight must be > 0"),
        (["c4"], r"'c4' is not source:weight"),
        (["c4:1", "c4:2"], r"source 'c4' is listed twice"),
        (["c4:0.1234567", "python_stdlib:1"], r"the weights repeat only every 11234567 sequences"),
    ):
        with pytest.raises(ValueError, match=r"^training.dataset_mixture: " + match):
            parse_mixture(entries)
    with pytest.raises(ValueError, match=r"^training.dataset_mixture: unknown source 'webtext': not a registry"):
        _loader(["webtext:1", f"{paths[0]}:1"], cache, 2)
    with pytest.raises(ValueError, match=r"^training.dataset_mixture: source '/no/such.jsonl': training.dataset_path"):
        _loader(["/no/such.jsonl:1"], cache, 2)
    both = "training.dataset_mixture: set it or training.dataset / training.dataset_path, not both"
    assert _config_error(["--training.dataset", "c4", "--training.dataset_mixture", "c4:1"]) == both
    assert _config_error(["--training.dataset_path", paths[0], "--training.dataset_mixture", "c4:1"]) == both
    assert "the weight 'x' is not a number" in _config_error(["--training.dataset_mixture", "c4:1,python_stdlib:x"])
    validate.check_values(parse_args(["--training.dataset_mixture", f"c4:0.7,{paths[0]}:0.3"]))
    assert len(parse_mixture([f"{paths[0]}:1", "allenai/c4:en:2"])) == 2  # the weight follows the last ':'


def test_a_source_reads_its_own_text_column(corpora, tmp_path: Path) -> None:
    paths, cache = corpora
    body = tmp_path / "code_body.jsonl"  # the code corpus with its text under "body"
    body.write_text("".join(json.dumps({"body": json.loads(line)["text"], "text": 7}) + "\n"
                            for line in Path(paths[1]).read_text().splitlines()))
    own = _loader([f"{paths[0]}:0.5", f"{body}:0.5:column=body"], cache, 2)
    same = _loader([f"{paths[0]}:0.5", f"{paths[1]}:0.5"], cache, 2)
    for x, y in zip(_take(own, 6), _take(same, 6), strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert parse_mixture(["allenai/c4:en:2:column=body"]) == [("allenai/c4:en", 2, "body")]
    for entries, match in ((["c4:1:colum=body"], r"unknown option 'colum='"),
                           (["python_stdlib:1:column=body"], r"a registry dataset knows its text column")):
        with pytest.raises(ValueError, match=r"^training.dataset_mixture: .*" + match):
            parse_mixture(entries)
