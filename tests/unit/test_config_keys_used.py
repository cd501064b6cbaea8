"""No config key is accepted and then ignored: every key is read by the code, or refused when set.

A key counts as read when torchtitan/ outside torchtitan/config/ names it (an attribute access `.name` or the
quoted name). A key that nothing reads must make the config checks fail, naming it, as soon as it is set to
anything but its default; the keys of features still to come (validate.NOT_YET) must do so saying "not available
yet". One failure lists every offending key.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from pathlib import Path

from torchtitan.config import validate
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import section_classes

PACKAGE = Path(__file__).resolve().parents[2] / "torchtitan"

# Valid non-default values where the type alone suggests none (a string with fixed choices, a nested list).
NON_DEFAULT: dict[str, typing.Any] = {
    "parallelism.pipeline_parallel_schedule": "GPipe",
    "parallelism.context_parallel_rotate_method": "alltoall",
    "parallelism.module_fqns_per_model_part": [["tok_embeddings", "layers.0"], ["norm", "output"]],
    "model.converters": ["float8"],
}


# Keys the config loader itself consumes: the scan of the rest of the package cannot see them being read.
READ_BY_THE_LOADER = {"job.config_file": PACKAGE / "config" / "manager.py"}


def _code_outside_config() -> str:
    paths = [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "config"]
    return "\n".join(p.read_text() for p in paths)


def is_read(name: str, code: str) -> bool:
    return re.search(rf"\.{re.escape(name)}\b", code) is not None or f'"{name}"' in code or f"'{name}'" in code


def non_default(key: str, tp: typing.Any, default: typing.Any) -> typing.Any:
    """A value of type `tp` other than `default`, valid for the key where possible."""
    if key in NON_DEFAULT:
        return NON_DEFAULT[key]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if tp is bool:
        return not default
    if tp is int:
        return 4 if default in (None, -1) else default * 2 + 1
    if tp is float:
        return 0.5 if default in (None, 0.0) else default / 2
    if tp is str:
        return f"{default}_other"
    if typing.get_origin(tp) is list:
        return ["other"]
    raise AssertionError(f"{key}: no non-default value for type {tp}")


def refusal(key: str, value: typing.Any) -> str | None:
    """The ConfigError message when `key` = `value` on an otherwise default config, or None if it is accepted."""
    cfg = JobConfig()
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, copy.deepcopy(value))
    try:
        validate.check_values(cfg)
    except ConfigError as e:
        return str(e)
    return None


def offending_keys() -> list[str]:
    code = _code_outside_config()
    problems = []
    for section, cls in section_classes().items():
        hints, defaults = typing.get_type_hints(cls), cls()
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            if key not in validate.NOT_YET and is_read(f.name, code):
                continue
            if key in READ_BY_THE_LOADER and is_read(f.name, READ_BY_THE_LOADER[key].read_text()):
                continue
            value = non_default(key, hints[f.name], getattr(defaults, f.name))
            msg = refusal(key, value)
            if key in validate.NOT_YET:
                if msg is None or key not in msg or "not available yet" not in msg:
                    problems.append(f"{key} (in validate.NOT_YET, but {key}={value!r} gives: {msg})")
            elif msg is None or key not in msg:
                problems.append(f"{key} (read by nothing outside torchtitan/config, and {key}={value!r} "
                                f"is {'accepted' if msg is None else 'refused naming another key: ' + msg})")
    return problems


def test_the_scan_tells_read_from_unread():
    code = _code_outside_config()
    assert is_read("steps", code) and is_read("tokenizer_path", code)
    assert not is_read("no_such_key_anywhere", code)
    assert "parallelism.context_parallel_rotate_method" in validate.NOT_YET


def test_every_not_yet_key_is_a_real_key():
    sections = section_classes()
    for key in validate.NOT_YET:
        section, name = key.split(".")
        assert name in {f.name for f in dataclasses.fields(sections[section])}, key


def test_every_config_key_is_read_or_refused():
    problems = offending_keys()
    assert not problems, "config keys accepted and ignored:\n  " + "\n  ".join(problems)
