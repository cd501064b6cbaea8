"""scripts/bootstrap.sh: training installs only what it needs, the test command adds the dev extra on top, and
a command that already ran once invokes no pip (training must work offline after its first run).

The real script runs against a temporary copy of scripts/ and pyproject.toml, with a fake `python3` first on
PATH: nothing is downloaded or installed, and the checkout's own .venv is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Stands in for python3 and, copied by `-m venv`, for .venv/bin/python. What an interpreter has "installed" is
# a marker file per group in <its bin folder>/fake-site: pip, uv, torch, base (torchtitan and its dependencies), dev.
# `-c "import a, b"` (or the find_spec check, `-c "import sys, importlib.util ..." a b`) succeeds only when
# every module's group is marked; `-m pip install ARGS` (which needs pip marked) appends ARGS
# (tab-separated) to $FAKE_PIP_LOG and marks the groups it would install; `-m pip --python OTHER install ARGS` logs
# ARGS and marks pip, and uv when ARGS name it, in OTHER's fake-site (it fails when they name uv and $FAKE_NO_UV is
# set: no uv on the index); `.../uv_pip.py check` succeeds when uv is marked, `.../uv_pip.py install ARGS` logs "uv"
# and ARGS and installs as pip does (it fails when $FAKE_UV_FAILS is set); `-m ensurepip` marks pip (and logs
# "ensurepip"); `-m venv [--without-pip] DIR` copies this script, with nothing installed; `-m compileall ... FOLDER`
# appends FOLDER to $FAKE_PIP_LOG.compile.
FAKE_PYTHON = r"""#!/usr/bin/env bash
site="$(cd "$(dirname "$0")" && pwd)/fake-site"
has() { [ -e "$site/$1" ]; }
if [ "${1:-}" = "-c" ]; then
    case "$2" in
        "import sys, importlib.util"*) modules=("${@:3}") ;;  # the find_spec check: module names as arguments
        "import importlib.util as u; print"*) has torch && echo "$site/torch" && exit 0; exit 1 ;;  # torch's folder
        "import sysconfig; print"*) echo "$site" && exit 0 ;;  # site-packages
        "import "*) IFS=', ' read -r -a modules <<< "${2#import }" ;;
        *) exit 1 ;;
    esac
    for m in "${modules[@]}"; do
        case "$m" in
            "") ;;
            pip|torch) has "$m" || exit 1 ;;
            pytest|xdist) has dev || exit 1 ;;
            *) has base || exit 1 ;;
        esac
    done
    exit 0
fi
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "venv" ]; then
    mkdir -p "${*: -1}/bin" && cp "$0" "${*: -1}/bin/python"
    exit $?
fi
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "ensurepip" ]; then
    echo ensurepip >> "$FAKE_PIP_LOG"
    mkdir -p "$site" && touch "$site/pip"
    exit 0
fi
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "pip" ] && [ "${3:-}" = "--python" ]; then
    has pip || exit 1
    other="$(cd "$(dirname "$4")" && pwd)/fake-site"
    (IFS=$'\t'; printf '%s\n' "${*:5}") >> "$FAKE_PIP_LOG"
    case " ${*:5} " in *" uv "*) [ -z "${FAKE_NO_UV:-}" ] || exit 1; mkdir -p "$other" && touch "$other/uv" ;; esac
    mkdir -p "$other" && touch "$other/pip"
    exit 0
fi
install() {  # marks the groups that `pip install ARGS` would install
    mkdir -p "$site"
    for a in "$@"; do
        case "$a" in
            -e|--*|pip|1) ;;
            torch==*) touch "$site/torch" ;;
            *"[dev]") touch "$site/base" "$site/dev" ;;
            *) touch "$site/base" ;;
        esac
    done
}
case "${1:-}" in
    */uv_pip.py)
        has uv || exit 1
        [ "$2" = "check" ] && exit 0
        [ -z "${FAKE_UV_FAILS:-}" ] || exit 1
        (IFS=$'\t'; printf 'uv\t%s\n' "${*:2}") >> "$FAKE_PIP_LOG"
        install "${@:3}"
        exit 0 ;;
esac
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "compileall" ]; then
    printf '%s\n' "${@: -1}" >> "$FAKE_PIP_LOG.compile"
    exit 0
fi
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "pip" ] && [ "${3:-}" = "install" ]; then
    has pip || { echo "No module named pip" >&2; exit 1; }
    (IFS=$'\t'; printf '%s\n' "${*:3}") >> "$FAKE_PIP_LOG"
    install "${@:4}"
    exit 0
fi
echo "fake python: unexpected arguments: $*" >&2
exit 2
"""


@dataclass
class Sandbox:
    root: Path
    bin: Path
    pip_log: Path
    stderr: str = ""

    @property
    def compile_log(self) -> Path:
        return self.pip_log.with_name(self.pip_log.name + ".compile")

    @property
    def venv_python(self) -> str:
        return str(self.root / ".venv" / "bin" / "python")

    def run(self, need_dev: bool = False, python: str | None = None, torch_version: str | None = None,
            **extra_env: str) -> tuple[str, list[list[str]]]:
        """Source bootstrap.sh as run_train.sh (or, need_dev, scripts/run_tests.sh) does.

        Returns the PYTHON it chose and the argument lists of its pip and uv calls."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "NEED_DEV", "TORCH_VERSION", "USE_UV")}
        env.update(extra_env)
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env["FAKE_PIP_LOG"] = str(self.pip_log)
        if python is not None:
            env["PYTHON"] = python
        if torch_version is not None:
            env["TORCH_VERSION"] = torch_version
        source = ("NEED_DEV=1 " if need_dev else "") + "source scripts/bootstrap.sh"
        self.pip_log.write_text("")
        self.compile_log.write_text("")
        proc = subprocess.run(["bash", "-c", f'set -euo pipefail; {source}; printf "%s" "$PYTHON"'],
                              cwd=self.root, env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert all(line.startswith("[bootstrap]") for line in proc.stderr.splitlines()), proc.stderr
        self.stderr = proc.stderr
        return proc.stdout, [line.split("\t") for line in self.pip_log.read_text().splitlines()]


def _make_fake_python(folder: Path, name: str, installed: tuple[str, ...] = ()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / name
    exe.write_text(FAKE_PYTHON)
    exe.chmod(0o755)
    for group in installed:
        (folder / "fake-site").mkdir(exist_ok=True)
        (folder / "fake-site" / group).touch()
    return exe


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    tmp_path = tmp_path.resolve()  # bootstrap.sh reports the root as `pwd` prints it
    root = tmp_path / "repo"
    shutil.copytree(REPO / "scripts", root / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    _make_fake_python(tmp_path / "bin", "python3", ("pip",))  # a bare python3: only pip
    return Sandbox(root, tmp_path / "bin", tmp_path / "pip.log")


# neither pip nor uv byte-compiles: bootstrap.sh compiles on both cores itself
# (test_byte_code_is_compiled_after_an_install)
def _install(package: str) -> list[str]:
    return ["install", "--no-compile", package]


def _editable(target: str) -> list[str]:
    return ["install", "--no-compile", "-e", target]


def _uv(*args: str) -> list[str]:
    """scripts/uv_pip.py: uv installs with pip's settings."""
    return ["uv", "install", *args]


# a new venv (made without pip) gets a current pip and uv from the base interpreter's pip before anything else
PIP_AND_UV = ["install", "--retries", "1", "--upgrade", "pip", "uv"]
UPGRADE_PIP = ["install", "--retries", "1", "--upgrade", "pip"]


def test_training_installs_torch_and_the_project_without_extras(sandbox: Sandbox) -> None:
    python, calls = sandbox.run()
    assert python == sandbox.venv_python
    assert calls == [PIP_AND_UV, _uv("torch==2.13.0"), _uv("-e", str(sandbox.root))]
    # a second training run must not need the network
    assert sandbox.run() == (sandbox.venv_python, [])


def test_a_base_without_pip_leaves_the_venv_its_bundled_pip(sandbox: Sandbox) -> None:
    (sandbox.bin / "fake-site" / "pip").unlink()
    python, calls = sandbox.run()
    assert python == sandbox.venv_python
    assert calls == [["ensurepip"], _install("torch==2.13.0"), _editable(str(sandbox.root))]


def test_pip_installs_where_there_is_no_uv_to_be_had(sandbox: Sandbox) -> None:
    python, calls = sandbox.run(FAKE_NO_UV="1")
    assert python == sandbox.venv_python
    assert calls == [PIP_AND_UV, UPGRADE_PIP, _install("torch==2.13.0"), _editable(str(sandbox.root))]


def test_pip_installs_again_what_uv_failed_to(sandbox: Sandbox) -> None:
    python, calls = sandbox.run(FAKE_UV_FAILS="1")
    assert python == sandbox.venv_python
    assert calls == [PIP_AND_UV, _install("torch==2.13.0"), _editable(str(sandbox.root))]
    assert sandbox.stderr.count("uv failed: installing with pip instead") == 2, sandbox.stderr


def test_use_uv_0_installs_with_pip_only(sandbox: Sandbox) -> None:
    python, calls = sandbox.run(USE_UV="0")
    assert calls == [UPGRADE_PIP, _install("torch==2.13.0"), _editable(str(sandbox.root))]
    # a .venv without uv (as older bootstraps made them) is updated with pip
    assert sandbox.run(need_dev=True) == (sandbox.venv_python, [_editable(f"{sandbox.root}[dev]")])


def test_the_test_command_adds_dev_on_top_of_a_training_install(sandbox: Sandbox) -> None:
    sandbox.run()
    python, calls = sandbox.run(need_dev=True)
    assert python == sandbox.venv_python
    assert calls == [_uv("-e", f"{sandbox.root}[dev]")]  # torch is already there: not reinstalled
    assert sandbox.run(need_dev=True) == (sandbox.venv_python, [])
    assert sandbox.run() == (sandbox.venv_python, [])


def test_training_after_the_test_command_installs_nothing(sandbox: Sandbox) -> None:
    python, calls = sandbox.run(need_dev=True)
    assert calls == [PIP_AND_UV, _uv("torch==2.13.0"), _uv("-e", f"{sandbox.root}[dev]")]
    assert sandbox.run() == (sandbox.venv_python, [])
    assert sandbox.run(need_dev=True) == (sandbox.venv_python, [])


def test_a_changed_pyproject_updates_only_what_the_command_needs(sandbox: Sandbox) -> None:
    sandbox.run(need_dev=True)
    with open(sandbox.root / "pyproject.toml", "a") as f:
        f.write("\n# a dependency changed\n")
    assert sandbox.run() == (sandbox.venv_python, [_uv("-e", str(sandbox.root))])
    assert sandbox.run(need_dev=True) == (sandbox.venv_python, [_uv("-e", f"{sandbox.root}[dev]")])
    assert sandbox.run() == (sandbox.venv_python, [])


def test_a_stamp_written_before_extras_were_recorded_counts_as_dev(sandbox: Sandbox) -> None:
    sandbox.run(need_dev=True)
    # the earlier bootstrap stamped a bare copy of pyproject.toml, and it always installed the dev extra
    shutil.copy(sandbox.root / "pyproject.toml", sandbox.root / ".venv" / ".installed-pyproject")
    assert sandbox.run(need_dev=True) == (sandbox.venv_python, [])
    assert sandbox.run() == (sandbox.venv_python, [])


def test_byte_code_is_compiled_after_an_install(sandbox: Sandbox) -> None:
    site = sandbox.root / ".venv" / "bin" / "fake-site"
    sandbox.run()
    # torch's folder (in the background from when torch is installed), and site-packages beside it
    assert sorted(sandbox.compile_log.read_text().splitlines()) == [str(site), str(site / "torch")]
    sandbox.run(need_dev=True)  # torch already there: only site-packages, where compileall skips what is current
    assert sandbox.compile_log.read_text().splitlines() == [str(site)]
    sandbox.run()
    assert sandbox.compile_log.read_text() == ""  # nothing installed, nothing compiled


def test_torch_version_chooses_the_pin(sandbox: Sandbox) -> None:
    assert sandbox.run(torch_version="2.12.1")[1][1] == _uv("torch==2.12.1")


def test_an_interpreter_that_has_everything_is_used_without_installing(sandbox: Sandbox, tmp_path: Path) -> None:
    cluster = _make_fake_python(tmp_path / "cluster", "python", installed=("torch", "base", "dev"))
    assert sandbox.run(need_dev=True, python=str(cluster)) == (str(cluster), [])
    _make_fake_python(sandbox.bin, "python3", installed=("torch", "base"))
    assert sandbox.run() == ("python3", [])
    assert not (sandbox.root / ".venv").exists()


def test_the_real_check_accepts_a_real_interpreter_that_has_everything(sandbox: Sandbox) -> None:
    # The fake above parses the check; this runs bootstrap's actual find_spec command on this interpreter.
    assert sandbox.run(need_dev=True, python=sys.executable) == (sys.executable, [])


@pytest.mark.parametrize("script", ["pretokenize.py", "convert_checkpoint.py"])
def test_scripts_rerun_themselves_under_the_projects_python(script: str, tmp_path: Path) -> None:
    # `python -S` sees no site-packages, like a system Python without torch: the script finds the project's
    # interpreter through scripts/bootstrap.sh (this checkout's .venv, already set up) and runs again there.
    proc = subprocess.run([sys.executable, "-S", str(REPO / "scripts" / script), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: {script}"), proc.stdout[:500]


def test_loss_compare_needs_only_the_standard_library(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    proc = subprocess.run([sys.executable, "-S", str(REPO / "scripts" / "loss_compare.py"), str(run), str(run)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "run#2 0.00e+00 (1 steps)" in proc.stdout, proc.stdout + proc.stderr
