"""Reward functions, chosen by name or by a dotted path `package.module:function` in rl.rewards.

A reward function takes the completion's text and the record's reference answer and returns a float:
`fn(completion: str, answer: str) -> float`. Several are combined as a weighted sum (rl.reward_weights).

Built in:
  exact_answer  1.0 when the completion's final answer equals the reference numerically, else 0.0. The reference
                is GSM8K-style ("... #### 72", the number after the last ####) or a bare number; the completion's
                answer is the number after its last "####" or inside its last \\boxed{...}. Commas, spaces and a
                leading $ are ignored; "1,000", "1000.0" and "$1000" are all 1000.
  format        1.0 when the completion states a final answer in one of those two forms at all, else 0.0.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from fractions import Fraction

RewardFn = Callable[[str, str], float]

_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)(/\d+)?$")
_HASHES = re.compile(r"####\s*([^\n#]*)")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def parse_number(text: str) -> Fraction | None:
    """A number from `text` (commas, whitespace, a leading $ and a trailing period ignored), or None."""
    cleaned = re.sub(r"[\s,$]", "", text).rstrip(".")
    if not _NUMBER.match(cleaned):
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(completion: str) -> str | None:
    """The completion's stated final answer: after its last "####", or inside its last \\boxed{}; None if neither.
    A "####" answer is the first whitespace-separated run of number characters after it."""
    hashes, boxed = list(_HASHES.finditer(completion)), list(_BOXED.finditer(completion))
    last = max(hashes + boxed, key=lambda m: m.start(), default=None)
    if last is None:
        return None
    text = last.group(1).strip()
    if last.re is _HASHES:  # "#### 1,234 apples" -> "1,234"
        m = re.match(r"[-+$\d.,/\s]*\d[\d.,/]*", text)
        text = m.group(0) if m else text
    return text


def reference_answer(answer: str) -> str:
    """The reference number of a record: after its last "####" (GSM8K), else the whole field."""
    found = _HASHES.findall(answer)
    return found[-1].strip() if found else answer.strip()


def exact_answer(completion: str, answer: str) -> float:
    stated = extract_answer(completion)
    if stated is None:
        return 0.0
    got, want = parse_number(stated), parse_number(reference_answer(answer))
    return 1.0 if got is not None and want is not None and got == want else 0.0


def format_reward(completion: str, answer: str) -> float:
    del answer  # the form alone is rewarded
    stated = extract_answer(completion)
    return 1.0 if stated is not None and parse_number(stated) is not None else 0.0


BUILTIN: dict[str, RewardFn] = {"exact_answer": exact_answer, "format": format_reward}


def resolve_reward(name: str) -> RewardFn:
    """A built-in reward by name, or `module:function` imported (ValueError naming the entry when it fails)."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ValueError(f"rl.rewards: unknown reward '{name}'; built in: {', '.join(BUILTIN)}, "
                         "or give a dotted path module:function")
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rl.rewards: cannot load '{name}': {e}") from None
    if not callable(fn):
        raise ValueError(f"rl.rewards: '{name}' is not callable")
    return fn


class RewardSet:
    """The weighted sum of the configured reward functions."""

    def __init__(self, names: list[str], weights: list[float] | None = None):
        if not names:
            raise ValueError("rl.rewards: name at least one reward function")
        weights = list(weights) if weights else [1.0] * len(names)
        if len(weights) != len(names):
            raise ValueError(f"rl.reward_weights: {len(weights)} weights for {len(names)} rewards")
        self.names, self.weights = list(names), weights
        self.fns = [resolve_reward(n) for n in names]

    def __call__(self, completion: str, answer: str) -> float:
        return float(sum(w * float(fn(completion, answer)) for w, fn in zip(self.weights, self.fns, strict=True)))
