"""Reward functions and prompt data for RL (torchtitan/rl/rewards.py, torchtitan/rl/data.py)."""

from __future__ import annotations

import json

import pytest

from torchtitan.rl.data import PromptStream, check_prompts_fit, encode_prompt, load_records, synthetic_record
from torchtitan.rl.rewards import RewardSet, exact_answer, extract_answer, format_reward, resolve_reward

GSM8K_REF = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72"


@pytest.mark.parametrize(("completion", "reward"), [
    ("so the answer is #### 72", 1.0),
    ("#### 72.", 1.0),
    ("####72", 1.0),
    ("The total is \\boxed{72}", 1.0),
    ("\\boxed{ 72.0 }", 1.0),
    ("#### 71", 0.0),
    ("72", 0.0),  # no stated final answer
    ("#### 12 then again #### 72", 1.0),  # the last one counts
    ("\\boxed{72} but finally #### 70", 0.0),
])
def test_exact_answer(completion, reward):
    assert exact_answer(completion, GSM8K_REF) == reward


def test_commas_dollars_and_bare_references():
    assert exact_answer("#### $1,234", "#### 1234") == 1.0
    assert exact_answer("#### 1 234 apples", "1234") == 1.0
    assert exact_answer("#### -5", "-5") == 1.0
    assert exact_answer("#### 0.5", "1/2") == 1.0
    assert extract_answer("no answer here") is None


def test_format_reward():
    assert format_reward("#### 3", "") == 1.0
    assert format_reward("\\boxed{x}", "") == 0.0
    assert format_reward("the answer is 3", "") == 0.0


def test_rewards_by_name_path_and_weights():
    assert resolve_reward("exact_answer") is exact_answer
    assert resolve_reward("tests.unit.rl_rewards:digit_fraction")("a1", "") == 0.5
    rs = RewardSet(["exact_answer", "format"], [1.0, 0.1])
    assert rs("#### 72", "72") == pytest.approx(1.1)
    assert rs("#### 7", "72") == pytest.approx(0.1)
    with pytest.raises(ValueError, match="unknown reward"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="cannot load"):
        resolve_reward("tests.unit.rl_rewards:missing")
    with pytest.raises(ValueError, match="weights"):
        RewardSet(["exact_answer"], [1.0, 2.0])


def test_synthetic_task_is_deterministic_and_correct():
    a = [synthetic_record(3, i, digits=2, ops="+-*") for i in range(50)]
    assert a == [synthetic_record(3, i, digits=2, ops="+-*") for i in range(50)]
    assert a != [synthetic_record(4, i, digits=2, ops="+-*") for i in range(50)]
    for rec in a:
        x, op, y = rec["question"].removeprefix("What is ").removesuffix("?").split()
        assert 10 <= int(x) <= 99 and 10 <= int(y) <= 99
        assert int(rec["answer"]) == eval(f"{x} {op} {y}")  # noqa: S307 - our own generated arithmetic
        assert exact_answer(f"#### {rec['answer']}", rec["answer"]) == 1.0
    assert all(len(r["question"].split()[2]) == 3 for r in (synthetic_record(0, i, digits=3) for i in range(5)))


def test_cursor_resumes_the_stream(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(5)))
    records = load_records(str(path))
    assert len(records) == 5
    straight = PromptStream("gsm8k", 0, records=records)
    first = straight.take(3) + straight.take(4)  # crosses an epoch: a new seeded order
    assert sorted(r["question"] for _, r in first[:5]) == [f"q{i}" for i in range(5)]
    assert [i for i, _ in first] == list(range(7))
    resumed = PromptStream("gsm8k", 0, records=records)
    resumed.load_state_dict({"consumed": 3})
    assert resumed.take(4) == first[3:]
    synth = PromptStream("synthetic", 1)
    synth.load_state_dict({"consumed": 10})
    assert synth.take(1)[0] == (10, synthetic_record(1, 10))


def test_bad_records_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="line 1 needs string fields"):
        load_records(str(path))
    with pytest.raises(FileNotFoundError, match="not a file"):
        load_records(str(tmp_path / "missing.jsonl"))


def test_prompt_encoding():
    from torchtitan.data.tokenizer import build_tokenizer, default_cache_dir

    tok = build_tokenizer("", default_cache_dir(), 512)
    ids = encode_prompt(tok, "What is 1 + 2?")
    assert ids[0] == tok.bos_id and tok.decode(ids[1:]) == "Question: What is 1 + 2?\nAnswer:"


def _bytes(question: str) -> list[int]:  # a stand-in tokenizer: one token per byte
    return list(question.encode())


def test_preflight_synthetic_prompts_must_fit_seq_len():
    # Every question "What is ab + cd?" is 16 bytes: 16 + max_new_tokens - 1 input positions.
    for run_prompts in (16, 10**6):  # the run's own prompts, or every question the digits allow
        check_prompts_fit(PromptStream("synthetic", 0), _bytes, 10, 25, run_prompts, "")
        with pytest.raises(ValueError, match=r"rl.max_new_tokens: the longest prompt of the synthetic task "
                                             r"\(rl.synthetic_digits 2\) .* has 16 tokens: .* training.seq_len 24"):
            check_prompts_fit(PromptStream("synthetic", 0), _bytes, 10, 24, run_prompts, "")
    # Three digits: the longest questions are longer, and only the run's prompts are checked (too many to list).
    with pytest.raises(ValueError, match="has 18 tokens"):
        check_prompts_fit(PromptStream("synthetic", 0, digits=3), _bytes, 10, 26, 10**6, "")


def test_preflight_names_the_file_of_a_prompt_too_long(tmp_path):
    path = tmp_path / "gsm.jsonl"
    rows = [{"question": "short", "answer": "1"}, {"question": "x" * 50, "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stream = PromptStream("gsm8k", 0, records=load_records(str(path)))
    check_prompts_fit(stream, _bytes, 11, 60, 1, str(path))  # the long record is checked even if not drawn first
    with pytest.raises(ValueError, match=f"rl.max_new_tokens: the longest prompt of rl.dataset_path {path} "
                                         r"\('xxxxx.*\.\.\.'\) has 50 tokens"):
        check_prompts_fit(stream, _bytes, 12, 60, 1, str(path))
