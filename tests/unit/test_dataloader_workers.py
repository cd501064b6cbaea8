"""Dataloader worker processes: the batches equal the in-process ones, and workers never outlive the run.

Starting workers costs ~2 s once per test process (the fork server imports torch), ~0.1 s after that.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_dataloader import ByteTokenizer, ListSource, _loader, _rows, _same, _source, _take
from torchtitan.data.datasets import build_document_source
from torchtitan.data.tokenizer import build_tokenizer

# More workers than this machine's cores is deliberate here (ordering, not speed, is under test).
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def test_identical_for_any_num_workers() -> None:
    source, seq_len, b = _source(50), 8, 2
    steps = 40  # about two epochs
    ref = _take(_loader(source, seq_len, b, 1, 2, document_masking=True), steps)
    for workers in (1, 2, 3):
        dl = _loader(source, seq_len, b, 1, 2, num_workers=workers, document_masking=True)
        assert _same(_take(dl, steps), ref), workers
        dl.close()


def test_fewer_documents_than_workers() -> None:
    source = ListSource(["one two three four five six seven", "eight nine ten eleven twelve"])
    infinite = _loader(source, 4, 2, num_workers=3, block_chars=1)
    assert _same(_take(infinite, 10), _take(_loader(source, 4, 2, block_chars=1), 10))
    pids = [w.pid for w in infinite._pool[1]._iterator._workers]
    infinite.close()  # the workers see their pipe to the loader close and exit
    _wait_until_gone(pids)
    finite = _loader(source, 8, 2, num_workers=3, block_chars=1, infinite=False)
    assert _same(list(finite), list(_loader(source, 8, 2, block_chars=1, infinite=False)))
    assert _same(list(finite), list(_loader(source, 8, 2, block_chars=1, infinite=False)))  # persistent workers
    finite.close()


def test_finite_with_workers_matches_in_process() -> None:
    source = _source(23, seed=5)
    ref = [list(_loader(source, 8, 2, r, 3, infinite=False, document_masking=True)) for r in range(3)]
    for r in range(3):
        dl = _loader(source, 8, 2, r, 3, infinite=False, document_masking=True, num_workers=2)
        assert _same(list(dl), ref[r])
        if r == 0:
            # Every iter() is a whole pass from the start, also after a pass left unfinished
            # (validation.steps), and the persistent workers are reused for it.
            pool = dl._pool
            _take(dl, 2)
            assert _same(list(dl), ref[r]) and dl._pool is pool
        dl.close()


class ForgetfulTokenizer(ByteTokenizer):
    """Loses a setting when pickled, as a pickled HF tokenizer loses encode_special_tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = 1

    def __getstate__(self) -> dict:
        return {"calls": 0}

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return [t + getattr(self, "shift", 0) for t in super().encode(text, add_bos, add_eos)]


def test_tokenizer_must_survive_pickling() -> None:
    with pytest.raises(ValueError, match="model.tokenizer_path: the tokenizer encodes differently once pickled"):
        _loader(_source(), 8, 2, tokenizer=ForgetfulTokenizer(), num_workers=2)
    with pytest.raises(ValueError, match="model.tokenizer_path: Tokenizer cannot be pickled"):
        _loader(_source(), 8, 2, tokenizer=type("Tokenizer", (ByteTokenizer,), {})(), num_workers=2)


def test_real_tokenizer(tmp_path: Path) -> None:
    """The project's Tokenizer class (a tiny BPE trained here): batches decode to the documents, and
    worker processes (which get a pickled copy) produce the same batches."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    source = _source(40)
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator((text for _, text in source.iter_documents()), trainer=trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(str(tmp_path / "tokenizer.json"), tmp_path)
    batches = _take(_loader(source, 32, 2, tokenizer=tok, document_masking=True), 6)
    expected = [t for _, text in source.iter_documents() for t in tok.encode(text)]
    assert [t for row in _rows(batches) for t in row] == expected[: 6 * 2 * 33]
    assert tok.decode(expected[:40]).startswith("<|begin_of_text|>doc 0: ")
    workers = _loader(source, 32, 2, tokenizer=tok, document_masking=True, num_workers=2)
    assert _same(_take(workers, 6), batches)
    workers.close()


def test_embedded_corpus_with_workers() -> None:
    """The real embedded source (pickled into workers) gives the same batches in-process and in workers."""
    source = build_document_source(dataset="python_stdlib", dataset_path="")
    ref = _loader(source, 64, 2, 1, 2, block_chars=4096)
    workers = _loader(source, 64, 2, 1, 2, block_chars=4096, num_workers=2)
    assert _same(_take(workers, 8), _take(ref, 8))
    state = ref.state_dict()
    assert state == workers.state_dict() and state["sequences_consumed"] == 32
    workers.close()


def _running(pid: int) -> bool:
    try:  # a zombie has exited; only its parent has not collected it yet
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_until_gone(pids: list[int], seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_running, pids))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_workers_exit_with_the_trainer() -> None:
    """The trainer ends with os._exit (see docs/architecture.md, 'The exit path'): its workers and their fork
    server must not outlive it."""
    code = ("import os\nfrom multiprocessing import forkserver\n"
            "from tests.unit.test_dataloader import _loader, _source, _take\n"
            "dl = _loader(_source(), 8, 2, num_workers=2)\n_take(dl, 2)\n"
            "print(forkserver._forkserver._forkserver_pid, *(w.pid for w in dl._pool[1]._iterator._workers))\n"
            "os._exit(0)\n")  # fmt: skip
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 3, out.stderr
    _wait_until_gone(pids)


def test_default_workers_tokenize_ahead_on_gpu_and_inline_on_cpu() -> None:
    from torchtitan.config.job_config import JobConfig
    from torchtitan.train import data_workers

    assert JobConfig().training.num_workers == -1
    assert data_workers(-1, "cuda") == 2 and data_workers(-1, "cpu") == 0
    assert data_workers(0, "cuda") == 0 and data_workers(3, "cpu") == 3  # a number set is the number used


class SlowLoggingTokenizer(ByteTokenizer):
    """Takes 20 ms a document, and records every document it encodes (its first 6 characters) in a file that all
    processes append to: which documents were tokenized by when, whatever process did it."""

    def __init__(self, log: str) -> None:
        super().__init__()
        self.log = log

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        time.sleep(0.02)
        with open(self.log, "a") as f:
            f.write(text[:6] + "\n")
        return super().encode(text, add_bos, add_eos)


def _encoded(log: Path) -> set[str]:
    return set(log.read_text().split()) if log.exists() else set()


def _tokenized_during_the_step(log: Path, wanted: set[str], seconds: float) -> bool:
    """The training step, as the data path sees it: the loop is busy elsewhere for up to `seconds`. True if the
    documents in `wanted` get tokenized meanwhile."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if wanted <= _encoded(log):
            return True
        time.sleep(0.05)
    return wanted <= _encoded(log)


@pytest.mark.parametrize("workers", [2, 0])
def test_a_slow_tokenizer_is_hidden_behind_the_step_by_workers(tmp_path: Path, workers: int) -> None:
    # 30-character documents: 32 tokens each with BOS and EOS, one 32-token window (seq_len 31) per document, so
    # step k's batch of 2 rows holds documents 2k-2 and 2k-1; one document per block.
    docs = [f"doc{i:03d}".ljust(30, ".") for i in range(40)]
    log = tmp_path / "encoded.txt"
    dl = _loader(ListSource(docs), 31, 2, tokenizer=SlowLoggingTokenizer(str(log)), block_chars=30,
                 num_workers=workers)
    try:
        it = iter(dl)
        first = next(it)
        # While step 1 trains, worker processes tokenize step 2's documents (and beyond, up to their prefetch);
        # without workers nothing is tokenized until the loop asks for step 2, which then waits for all of it.
        ahead = _tokenized_during_the_step(log, {"doc002", "doc003"}, 60.0 if workers else 1.0)
        second = next(it)
    finally:
        dl.close()
    assert ahead == (workers > 0)
    ref = _take(_loader(ListSource(docs), 31, 2, block_chars=30), 2)
    assert _same([first, second], ref)  # and the batches are the in-process ones
