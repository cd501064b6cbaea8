"""`pip install`, done by uv with the settings pip would use (run by scripts/bootstrap.sh, with the .venv's Python).

    python scripts/uv_pip.py check            # exit 0 when uv can stand in for this interpreter's pip
    python scripts/uv_pip.py install ARGS...  # uv pip install ARGS into this interpreter

uv resolves and installs this project's dependencies in about 6 s where pip takes 22 (fresh .venv, 2 cores,
2026-11-28): pip spends most of its time parsing the index pages of large projects (100,000 links for one
install). uv does not read pip's configuration, so this reads it from `pip config list` (configuration files and
PIP_* variables, as the pip beside uv would apply them to an install) and passes each setting to uv. A setting
without a faithful uv equivalent makes `check` fail, and bootstrap.sh then installs with pip, as before.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

# pip setting -> uv option, once per whitespace-separated value (pip splits these the same way)
LIST_OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
                "constraint": "--constraints", "trusted-host": "--allow-insecure-host"}
# pip setting -> the environment variables uv reads for it
ENV_SETTINGS = {"cert": ("SSL_CERT_FILE",), "client-cert": ("SSL_CLIENT_CERT",), "timeout": ("UV_HTTP_TIMEOUT",),
                "default-timeout": ("UV_HTTP_TIMEOUT",), "retries": ("UV_HTTP_RETRIES",),
                "proxy": ("HTTPS_PROXY", "HTTP_PROXY")}
# pip on/off settings -> uv's arguments when on
SWITCHES = {"no-index": ("--no-index",), "pre": ("--prerelease", "allow")}
# settings that change pip's output or bookkeeping, not what gets installed or from where
IGNORED = {"disable-pip-version-check", "no-color", "progress-bar", "quiet", "verbose", "no-input",
           "root-user-action", "cache-dir", "no-cache-dir", "log", "require-virtualenv", "break-system-packages",
           "no-warn-script-location", "no-python-version-warning", "no-warn-conflicts"}
# pip reads these sections for `pip install`, each overriding the one before (PIP_* variables list as ":env:")
SECTIONS = ("global", "install", ":env:")
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


class Untranslatable(Exception):
    """A pip setting uv would not apply the same way."""


def pip_settings(listing: str) -> dict[str, str]:
    """The settings an install applies, from `pip config list` lines such as `global.find-links='/opt/wheels'`."""
    by_section: dict[str, dict[str, str]] = {s: {} for s in SECTIONS}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        section, dot, key = name.rpartition(".")
        if sep and dot and section in by_section:
            by_section[section][key] = ast.literal_eval(value)
    return {k: v for s in SECTIONS for k, v in by_section[s].items()}


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's arguments and environment variables for pip's settings; Untranslatable names the first that has none."""
    args: list[str] = ["--index-strategy", "unsafe-best-match"]  # pip's rule: the best version over all indexes
    env: dict[str, str] = {}
    for key, value in sorted(settings.items()):
        if key in IGNORED:
            continue
        if key in LIST_OPTIONS:
            args += [a for v in value.split() for a in (LIST_OPTIONS[key], v)]
        elif key in ENV_SETTINGS:
            env.update(dict.fromkeys(ENV_SETTINGS[key], value))
        elif key in SWITCHES and value.strip().lower() in TRUE | FALSE:
            args += SWITCHES[key] if value.strip().lower() in TRUE else ()
        else:
            raise Untranslatable(f"pip setting {key}={value!r} has no uv equivalent")
    return args, env


def uv_command(install_args: Iterable[str], listing: str) -> tuple[list[str], dict]:
    """The `uv pip install` command line for this interpreter and the environment it runs in: uv is the one
    installed beside it."""
    args, env = uv_arguments(pip_settings(listing))
    uv = Path(sys.executable).parent / "uv"
    return [str(uv), "pip", "install", "--python", sys.executable, *args, *install_args], {**env, **os.environ}


def _pip_config_listing() -> str:
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise Untranslatable(f"`pip config list` failed: {proc.stderr.strip()}")
    return proc.stdout


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("check", "install"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        cmd, env = uv_command(argv[1:], _pip_config_listing())
    except Untranslatable as e:
        print(f"uv_pip: {e}: installing with pip", file=sys.stderr)
        return 1
    if not Path(cmd[0]).is_file():
        print(f"uv_pip: no uv at {cmd[0]}", file=sys.stderr)
        return 1
    if argv[0] == "check":
        return 0
    print("uv_pip:", " ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
