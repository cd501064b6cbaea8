"""Prompts with reference answers for RL: GSM8K-style records, or a synthetic arithmetic task that needs no files.

A record is {"question": str, "answer": str}; the answer is GSM8K's worked solution ending in "#### <number>", or a
bare number (rewards.py reads either). Sources:

  synthetic  "What is 47 + 18?" -> "65": record i is drawn from a generator seeded by (seed, i), so the stream is the
             same on every rank and after a resume; rl.synthetic_digits sets the operands' digits, rl.synthetic_ops
             the operators among + - *
  gsm8k      rl.dataset_path: a local .jsonl file with question/answer fields, or a hub dataset (openai/gsm8k,
             rl.dataset_config "main"), loaded whole; served in a seeded random order, a new order every epoch

The cursor is global (prompts consumed so far), identical on every rank, and is all a checkpoint needs.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

TASKS = ("synthetic", "gsm8k")
PROMPT = "Question: {question}\nAnswer:"
"""How a question becomes a plain-text prompt (without rl.chat_template)."""
PREFLIGHT_LIMIT = 20_000
"""At most this many synthetic prompts are tokenized before step 1 (about 40 us each on CPU)."""


def _operands(digits: int) -> range:
    """The operands of `digits` digits (one digit: 0 .. 9)."""
    return range(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


def synthetic_record(seed: int, index: int, digits: int = 2, ops: str = "+-") -> dict[str, str]:
    """The index-th arithmetic question of the stream `seed` (operands of `digits` digits, operators from `ops`)."""
    rng = random.Random(seed * 1_000_003 + index)
    low, high = _operands(digits)[0], _operands(digits)[-1]
    a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(ops)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"question": f"What is {a} {op} {b}?", "answer": str(value)}


def _checked(record: Any, where: str) -> dict[str, str]:
    if not isinstance(record, dict) or not isinstance(record.get("question"), str) \
            or not isinstance(record.get("answer"), (str, int, float)):
        raise ValueError(f"rl.dataset_path: {where} needs string fields 'question' and 'answer'")
    return {"question": record["question"], "answer": str(record["answer"])}


def load_records(dataset_path: str, split: str = "train", config: str = "", cache_dir: str | None = None
                 ) -> list[dict[str, str]]:
    """Every question/answer record of a local .jsonl file or a hub dataset."""
    path = Path(dataset_path)
    if path.is_file():
        records = []
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(_checked(json.loads(line), f"{path} line {n}"))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"rl.dataset_path: {path} line {n} is not JSON: {e}") from None
    elif path.suffix in (".jsonl", ".json") or path.exists():
        raise FileNotFoundError(f"rl.dataset_path: {path} is not a file")
    else:
        from torchtitan.data.hf_sources import open_hub_dataset

        ds, _, where = open_hub_dataset(dataset_path, dataset_path, config or None, split, "false", cache_dir,
                                        "rl", "dataset_path")
        records = [_checked(r, where) for r in ds]
    if not records:
        raise ValueError(f"rl.dataset_path: {dataset_path} holds no records")
    return records


class PromptStream:
    """Records in a fixed, seeded order; `take(n)` returns the next n as (global index, record) pairs."""

    def __init__(self, task: str, seed: int, *, records: list[dict[str, str]] | None = None, digits: int = 2,
                 ops: str = "+-"):
        if task not in TASKS:
            raise ValueError(f"rl.task must be one of {TASKS}, got {task!r}")
        if task == "gsm8k" and not records:
            raise ValueError("rl.task gsm8k needs records (rl.dataset_path)")
        self.task, self.seed, self.records, self.digits, self.ops = task, seed, records, digits, ops
        self.consumed = 0
        self._epoch, self._order = -1, []

    def record(self, index: int) -> dict[str, str]:
        if self.task == "synthetic":
            return synthetic_record(self.seed, index, self.digits, self.ops)
        epoch, pos = divmod(index, len(self.records))
        if epoch != self._epoch:  # a fresh permutation per epoch, from (seed, epoch) alone
            self._order = list(range(len(self.records)))
            random.Random(self.seed * 7919 + epoch).shuffle(self._order)
            self._epoch = epoch
        return self.records[self._order[pos]]

    def take(self, n: int) -> list[tuple[int, dict[str, str]]]:
        out = [(i, self.record(i)) for i in range(self.consumed, self.consumed + n)]
        self.consumed += n
        return out

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed = int(state["consumed"])


def encode_prompt(tokenizer: Any, question: str, chat_template: str = "") -> list[int]:
    """Token ids of the prompt for `question`: PROMPT with BOS, or one user message rendered with `chat_template`
    up to the assistant's turn (torchtitan/data/chat.py)."""
    if chat_template:
        from torchtitan.data.chat import render_generation_prompt

        return render_generation_prompt(tokenizer, [{"role": "user", "content": question}], chat_template)
    return tokenizer.encode(PROMPT.format(question=question), add_bos=True, add_eos=False)


def _synthetic_questions(digits: int, ops: str) -> list[str]:
    return [f"What is {a} {op} {b}?" for op in dict.fromkeys(ops) for a in _operands(digits) for b in _operands(digits)]


def check_prompts_fit(stream: PromptStream, encode: Callable[[str], list[int]], max_new_tokens: int, seq_len: int,
                      run_prompts: int, source: str) -> None:
    """ValueError, before step 1, when a prompt of the run plus rl.max_new_tokens does not fit training.seq_len (the
    model's rotary table; the last sampled token is never an input, so prompt + max_new_tokens - 1 must fit).

    gsm8k: every record of `source` is tokenized. synthetic: the digits bound the questions, so all of them when
    there are fewer than the run draws (`run_prompts`, the cursor's whole range), else the run's own prompts;
    beyond PREFLIGHT_LIMIT only the first ones, and `prompt_fits` checks each step's prompts as they come."""
    if stream.task == "synthetic":
        space = len(_operands(stream.digits)) ** 2
        if space * len(set(stream.ops)) <= min(run_prompts, PREFLIGHT_LIMIT):
            questions = _synthetic_questions(stream.digits, stream.ops)
        else:
            questions = [stream.record(i)["question"] for i in range(min(run_prompts, PREFLIGHT_LIMIT))]
        where = f"the synthetic task (rl.synthetic_digits {stream.digits})"
    else:
        questions, where = [r["question"] for r in stream.records], f"rl.dataset_path {source}"
    lengths = {q: len(encode(q)) for q in dict.fromkeys(questions)}
    longest = max(lengths, key=lengths.__getitem__)
    problem = prompt_fits(lengths[longest], max_new_tokens, seq_len)
    if problem:
        shown = longest if len(longest) <= 40 else longest[:40] + "..."
        raise ValueError(f"rl.max_new_tokens: the longest prompt of {where} ({shown!r}) {problem}")


def prompt_fits(prompt_tokens: int, max_new_tokens: int, seq_len: int) -> str:
    """'' when a prompt of `prompt_tokens` and its completion fit training.seq_len, else what is wrong."""
    if prompt_tokens + max_new_tokens - 1 <= seq_len:
        return ""
    return (f"has {prompt_tokens} tokens: + rl.max_new_tokens {max_new_tokens} - 1 (the last token is never an input) "
            f"= {prompt_tokens + max_new_tokens - 1} positions exceed training.seq_len {seq_len}; raise "
            "training.seq_len or lower rl.max_new_tokens")
