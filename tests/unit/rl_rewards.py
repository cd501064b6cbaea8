"""A reward for RL tests: an untrained model never states a correct answer, so exact_answer would give every group
zero variance; the fraction of digit characters varies from completion to completion."""


def digit_fraction(completion: str, answer: str) -> float:
    del answer
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def char_variety(completion: str, answer: str) -> float:
    """Distinct characters per character: differs between almost any two random completions."""
    del answer
    return len(set(completion)) / (len(completion) + 1)
