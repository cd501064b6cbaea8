"""The one-line failures every config check raises (torchtitan/config/validate.py, validate_finetune.py): each
names its key first, which tests/unit/test_config.py reads to hold every check to a bad-value test."""

from __future__ import annotations

from torchtitan.config.errors import ConfigError


def _err(msg: str) -> None:
    raise ConfigError(msg)


def _one_of(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _err(f"{key}: '{value}' is not one of {', '.join(choices)}")


def _positive(key: str, value: float) -> None:
    if value <= 0:
        _err(f"{key}: must be > 0, got {value}")


def _not_yet(key: str, what: str) -> None:
    _err(f"{key}: {what} is not available yet in this version of torchtitan")
