"""TOML + command line -> one validated JobConfig, before any process group exists.

`load_config(argv, world_size)` is the entry point of a run: parse_args, then torchtitan/config/resolve.py fills
in every derived value (-1 = derive) for the world size.

Precedence: dataclass defaults < TOML file (`--job.config_file`) < `--section.key value` overrides. A key given
twice on the command line takes the last value, `--job.config_file` included (the file loaded is the one recorded).
Every problem is a `ConfigError` whose message is one line naming the key (and the file).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.resolve import Resolved, resolve
from torchtitan.config.validate import check_values

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


# Old spellings users' TOML files contain -> where the value lives now.
# Folded when each source is read, so the rest of the code only sees the real key.
ALIASES: dict[tuple[str, str], tuple[str, str]] = {
    ("model", "hf_assets_path"): ("model", "tokenizer_path"),
    # v0.2.2 keeps seed / deterministic under [debug]; later torchtitan files put them under [training].
    ("training", "seed"): ("debug", "seed"),
    ("training", "deterministic"): ("debug", "deterministic"),
}


def section_classes() -> dict[str, type]:
    """Section name -> its dataclass, in declaration order."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it (the string literal after the annotated assignment)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:] + [None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, from_cli: bool) -> Any:
    """Check (TOML) or convert (CLI string) `value` to the annotated type `tp`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None or (from_cli and isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, inner[0], key, from_cli)
    if origin is list:
        if from_cli and isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = tomllib.loads(f"v = {text}")["v"]
                except tomllib.TOMLDecodeError as e:
                    raise ConfigError(f"{key}: cannot parse list {value!r}: {e}") from None
            else:
                value = [v.strip() for v in text.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]", from_cli) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        words = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False}
        words["off"] = False
        if from_cli and isinstance(value, str) and value.lower() in words:
            return words[value.lower()]
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported config type {_type_name(tp)}")


def _resolve_key(section: str, key: str, where: str) -> tuple[str, str, Any]:
    """(section, key) -> (section, key, annotated type), following aliases; unknown names are errors."""
    section, key = ALIASES.get((section, key), (section, key))
    sections = section_classes()
    if section not in sections:
        hint = difflib.get_close_matches(section, list(sections), n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else f" (known: {', '.join(sections)})"
        raise ConfigError(f"{where}unknown config section '{section}'{extra}")
    hints = typing.get_type_hints(sections[section])
    if key not in hints:
        hint = difflib.get_close_matches(key, list(hints), n=1)
        extra = f" (did you mean '{section}.{hint[0]}'?)" if hint else ""
        raise ConfigError(f"{where}unknown config key '{section}.{key}'{extra}")
    return section, key, hints[key]


def _split_cli(argv: list[str]) -> list[tuple[str, str]]:
    """['--a.b', 'v', '--c.d=w', '--flag'] -> [('a.b','v'), ('c.d','w'), ('flag','true')]."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected command-line argument {arg!r}: overrides look like --section.key value")
        name = arg[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:
            value = "true"  # a bare flag switches a boolean on
            i += 1
        pairs.append((name, value))
    return pairs


def _set(cfg: JobConfig, section: str, key: str, value: Any) -> None:
    setattr(getattr(cfg, section), key, value)


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, int, float, str, list, type(None))) else repr(value)


def _fold(entries: list[tuple[str, str, str, Any]], source: str) -> dict[tuple[str, str], Any]:
    """One source's (spelling, section, key, value) entries -> (section, key) -> value, aliases folded.

    The same spelling twice (command line) takes the last value; two spellings of one key in the same source
    must agree, since neither can be said to come later. Across sources the later source wins (see parse_args).
    """
    spellings: dict[tuple[str, str], dict[str, Any]] = {}
    for spelled, sec, k, value in entries:
        spellings.setdefault((sec, k), {})[spelled] = value
    folded = {}
    for (sec, k), by_spelling in spellings.items():
        (first, value), *others = by_spelling.items()
        for other, other_value in others:
            if other_value != value:
                raise ConfigError(f"{source}: {first}={_show(value)} and {other}={_show(other_value)} both set "
                                  f"{sec}.{k} (one is an alias of it): set only one")
        folded[(sec, k)] = value
    return folded


def _label(spelled: str, sec: str, k: str) -> str:
    """How messages name a key: as the user spelled it, with the key it stands for when that is an alias."""
    return spelled if spelled == f"{sec}.{k}" else f"{spelled} (alias of {sec}.{k})"


def load_toml(path: str) -> dict[tuple[str, str], Any]:
    """The values of the TOML file `path`, checked for type, as (section, key) -> value with aliases folded."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"job.config_file: file not found: {path}")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    entries = []
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: top-level key '{section}' must be a [section] table")
        for key, value in values.items():
            sec, k, tp = _resolve_key(section, key, f"{path}: ")
            label = _label(f"{section}.{key}", sec, k)
            entries.append((f"{section}.{key}", sec, k, _coerce(value, tp, f"{path}: {label}", from_cli=False)))
    return _fold(entries, path)


def _read_cli(argv: list[str]) -> dict[tuple[str, str], Any]:
    """The command line's overrides, checked for type, as (section, key) -> value with aliases folded."""
    entries = []
    for name, value in _split_cli(argv):
        if "." not in name:
            raise ConfigError(f"--{name}: overrides are --section.key value (see --help)")
        section, key = name.split(".", 1)
        sec, k, tp = _resolve_key(section, key, f"--{name}: ")
        entries.append((f"--{name}", sec, k, _coerce(value, tp, f"--{_label(name, sec, k)}", from_cli=True)))
    return _fold(entries, "command line")


def _named_by_file(err: ConfigError, files: dict[str, str]) -> ConfigError:
    """A check's message starts with the key it rejects: put the file in front when the value came from one."""
    match = re.match(r"[a-z_]+\.[a-z0-9_]+", str(err))
    if match is None or match.group(0) not in files:
        return err
    return ConfigError(f"{files[match.group(0)]}: {err}")


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from defaults, the TOML file and command-line overrides, then check values."""
    cfg, files = _read(argv)
    try:
        check_values(cfg)
    except ConfigError as e:
        raise _named_by_file(e, files) from None
    return cfg


def load_config(argv: list[str] | None, world_size: int) -> tuple[JobConfig, Resolved]:
    """parse_args, then resolve for `world_size` processes: the config with every derived value filled in (what
    the run uses and job_config.json records) and what the trainer needs beyond it. Errors name the TOML file
    when the rejected value came from it."""
    cfg, files = _read(argv)
    try:
        check_values(cfg)
        resolved = resolve(cfg, world_size)
    except ConfigError as e:
        raise _named_by_file(e, files) from None
    return cfg, resolved


def read_args(argv: list[str] | None = None) -> JobConfig:
    """The JobConfig the TOML file and command line spell out, types checked but no value checked (for tests)."""
    return _read(argv)[0]


def _read(argv: list[str] | None) -> tuple[JobConfig, dict[str, str]]:
    """The config the sources spell out, unchecked, and key -> file for the values that came from the TOML file."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(help_text([a for a in argv if a not in ("--help", "-h")]))
        raise SystemExit(0)
    overrides = _read_cli(argv)
    # Taken after folding, so the last --job.config_file wins as for every key; it is also the value the overrides
    # below leave in job.config_file, i.e. job_config.json records the file loaded.
    config_file = overrides.get(("job", "config_file"), "")
    from_file = load_toml(config_file) if config_file else {}
    cfg = JobConfig()
    files = {}
    for (sec, k), value in from_file.items():
        _set(cfg, sec, k, value)
        files[f"{sec}.{k}"] = config_file
    for (sec, k), value in overrides.items():
        _set(cfg, sec, k, value)
        files.pop(f"{sec}.{k}", None)  # the command line's value is the one checked now
    return cfg, files


def to_dict(cfg: JobConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_json(cfg: JobConfig) -> str:
    return json.dumps(to_dict(cfg), indent=2)


# The launcher's environment variables (run_train.sh, torchtitan/launch.py), listed by --help.
LAUNCHER_VARIABLES = (
    ("CONFIG_FILE", "TOML file (default train_configs/debug_model.toml); a --job.config_file argument replaces it"),
    ("NGPU", "processes per node (default: the GPU count, or 2 CPU processes where there is no GPU)"),
    ("LOG_RANK", "ranks whose output is shown, comma-separated (default 0)"),
    ("TORCHRUN_ARGS", "replaces the single-node rendezvous arguments, e.g. \"--nnodes 4 --rdzv_backend c10d ...\""),
)


def help_text(argv: list[str] | None = None) -> str:
    """Every key with its type, default and docstring; with `argv` (the config file and overrides of the command
    that asked for help) each value they set is shown next to the default, with where it came from."""
    lines = [
        "usage: [CONFIG_FILE=file.toml] [NGPU=n] run_train.sh [--section.key value ...]",
        "",
        "Defaults < TOML file (--job.config_file) < command-line overrides; a key given twice on the command line",
        "takes the last value.",
    ]
    cfg, files = JobConfig(), {}
    try:
        cfg, files = _read(argv or [])
    except (ConfigError, ValueError, OSError) as e:
        lines += ["", f"(the values below are the defaults: {e})"]
    if cfg.job.config_file:
        lines += ["", f"Values set by {cfg.job.config_file} or the command line are shown as 'now'."]
    lines += ["", "Launcher environment variables:"]
    lines += [f"  {name:<14}{text}" for name, text in LAUNCHER_VARIABLES]
    from torchtitan.models.registry import get_model_spec, model_names

    lines += ["", "Models (--model.name) and their flavors (--model.flavor):"]
    lines += [f"  {name}: {', '.join(get_model_spec(name).flavors)}" for name in model_names()]
    lines.append("\nSections and keys:")
    for section, cls in section_classes().items():
        docs = field_docs(cls)
        lines.append(f"\n[{section}]")
        defaults, current = cls(), getattr(cfg, section)
        for sub in dataclasses.fields(cls):
            tp = _type_name(typing.get_type_hints(cls)[sub.name])
            default = json.dumps(getattr(defaults, sub.name))
            now = json.dumps(getattr(current, sub.name))
            origin = files.get(f"{section}.{sub.name}", "command line")
            set_here = f", now {now} from {origin}" if now != default else ""
            lines.append(f"  --{section}.{sub.name} ({tp}, default {default}{set_here})")
            lines.append(f"      {docs.get(sub.name, '')}")
            aliases = [f"--{a}.{b}" for (a, b), target in ALIASES.items() if target == (section, sub.name)]
            if aliases:
                lines.append(f"      Also accepted as {', '.join(aliases)}")
    return "\n".join(lines)
