# Sourced by run_train.sh, scripts/run_tests.sh and scripts/estimate_memory.sh: sets PYTHON to an interpreter
# that can import torchtitan and its dependencies, plus the dev extra (pytest, ruff, ...) when NEED_DEV=1.
#   0. $PYTHON, if set and it already works;
#   1. ./.venv of this checkout, if it works and its stamp shows it was installed from the current
#      pyproject.toml with the extras this command needs;
#   2. otherwise the current python3, if it already has everything (a cluster's own environment): no install;
#   3. otherwise create (or update) ./.venv, with a current pip and uv, and install into it: the pinned torch when it
#      is missing (TORCH_VERSION, default 2.13.0; an open range would pull the newest release and several GB of CUDA
#      packages), then this project with only the extras this command needs. Training therefore never
#      installs test tools, and the test command adds the dev extra on top of a training install. uv installs
#      with pip's own settings (scripts/uv_pip.py); pip does where uv cannot be had or a setting has no uv
#      equivalent, where uv fails, or with USE_UV=0.
# The stamp (.venv/.installed-pyproject) is a first line "# extras: <names>" followed by the pyproject.toml
# it was installed from; once it is written, later runs of any covered command invoke no pip (offline-safe).
# Choosing an interpreter only locates the packages (importlib's find_spec, ~30 ms) rather than importing them
# (~1.5 s for torch): the command that follows imports them anyway and says which one fails, so a launch starts
# Python once before torchrun. After an install, the real imports are checked once.
# Checks run from / so the checkout itself on sys.path cannot make an uninstalled package look installed.
_tt_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_tt_venv_py="$_tt_root/.venv/bin/python"
_tt_modules="torchtitan torch tokenizers torchdata tiktoken"
_tt_extras=""  # space-separated names from [project.optional-dependencies]
if [ "${NEED_DEV:-0}" = "1" ]; then _tt_extras="dev"; _tt_modules="$_tt_modules pytest xdist"; fi
_tt_stamp="$_tt_root/.venv/.installed-pyproject"
# A namespace package (origin None: e.g. a folder left behind by an uninstall) does not count as installed.
_tt_find='import sys, importlib.util as u; sys.exit(not all((s := u.find_spec(m)) and s.origin for m in sys.argv[1:]))'

# shellcheck disable=SC2086  # the module names are meant to split
_tt_works() { (cd / && "$1" -c "$_tt_find" $_tt_modules >/dev/null 2>&1); }
_tt_imports() { (cd / && "$1" -c "import ${_tt_modules// /, }" >/dev/null 2>&1); }

# Prints the extras the stamp records; fails when there is no stamp or it is for another pyproject.toml.
_tt_installed_extras() {
    local first
    [ -f "$_tt_stamp" ] || return 1
    if cmp -s "$_tt_stamp" "$_tt_root/pyproject.toml"; then
        echo "dev"  # a stamp from before extras were recorded: a bare copy, and those installs always had dev
        return 0
    fi
    IFS= read -r first < "$_tt_stamp" || return 1
    case "$first" in "# extras:"*) ;; *) return 1 ;; esac
    tail -n +2 "$_tt_stamp" | cmp -s - "$_tt_root/pyproject.toml" || return 1
    echo "${first#"# extras:"}"
}

# True when the stamp is current and lists every extra this command needs.
_tt_fresh() {
    local have e
    have="$(_tt_installed_extras)" || return 1
    for e in $_tt_extras; do
        case " $have " in *" $e "*) ;; *) return 1 ;; esac
    done
}

# pip byte-compiles what it installs, on one core: 17 of torch's 24 s of install (measured 2026-11-27, 2 cores).
# Compiling must still happen here: where PYTHONDONTWRITEBYTECODE is set (our development machines) nothing is
# cached later, and every interpreter would compile torch's modules again at import (3.1 s instead of 1.4 s). So
# packages install uncompiled, torch compiles on one core while the rest installs, and compileall then compiles the
# other packages on every core beside it; compile errors (a package's unused Python 2 file) are ignored, as pip
# ignores them. Left out: the test suites other packages ship (pandas, sympy, networkx, numpy: 2,653 files),
# transformers' 2,597 model files (the tests import a few: under a second at import) and pip, which nothing imports
# after the install: everything but torch then compiles in 14.6 CPU-seconds instead of 31.7 (2026-11-27).
_tt_compile_skip='/(tests|pip)/|/transformers/models/'
_tt_torch_compile=""
_tt_torch_dir=""
_tt_compile() {
    local purelib skip="$_tt_compile_skip"
    purelib="$(cd / && "$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
    if [ -n "$_tt_torch_compile" ]; then  # still compiling in the background; the folder as a literal regex
        skip="$skip|^$(printf '%s' "$_tt_torch_dir" | sed 's/[][\\.*^$+?(){}|]/\\&/g')/"
    fi
    (cd / && "$PYTHON" -m compileall -q -j 0 -x "$skip" "$purelib" >> "$_tt_log.compile" 2>&1) || true
    if [ -n "$_tt_torch_compile" ]; then wait "$_tt_torch_compile" || true; fi
}

# `pip install ARGS` into $PYTHON (output to the log): through uv when _tt_uv=1, with pip if uv fails.
_tt_install() {
    if [ "$_tt_uv" = "1" ]; then
        (cd / && "$PYTHON" "$_tt_root/scripts/uv_pip.py" install "$@") >> "$_tt_log" 2>&1 && return 0
        echo "[bootstrap] uv failed: installing with pip instead (log: $_tt_log)" >&2
    fi
    "$PYTHON" -m pip install --no-compile "$@" >> "$_tt_log" 2>&1
}

if [ -n "${PYTHON:-}" ] && _tt_works "$PYTHON"; then
    :  # an explicitly chosen interpreter that already has everything
elif [ -x "$_tt_venv_py" ] && _tt_fresh && _tt_works "$_tt_venv_py"; then
    PYTHON="$_tt_venv_py"
elif [ ! -x "$_tt_venv_py" ] && _tt_works python3; then
    PYTHON=python3
else
    _tt_base="${PYTHON:-python3}"
    if [ ! -x "$_tt_venv_py" ]; then
        echo "[bootstrap] torchtitan is not importable: creating $_tt_root/.venv and installing into it" >&2
        "$_tt_base" -m venv --without-pip "$_tt_root/.venv" || { echo "[bootstrap] could not create a venv" >&2; exit 1; }
    elif ! _tt_installed_extras >/dev/null; then
        echo "[bootstrap] $_tt_root/.venv is from another pyproject.toml (or unfinished): updating it" >&2
    elif ! _tt_fresh; then
        echo "[bootstrap] adding the extra '$_tt_extras' to $_tt_root/.venv" >&2
    else
        echo "[bootstrap] $_tt_root/.venv is missing packages: updating it" >&2
    fi
    PYTHON="$_tt_venv_py"
    # pip's output goes to a log (shown only on failure) so the first run's console stays readable.
    _tt_log="$_tt_root/.venv/bootstrap.log"
    : > "$_tt_log"
    # The venv is made without pip: its Python's bundled pip (3.11's: 23.2) takes 4 s to install, and 22 s to resolve
    # this project's dependencies where a current pip takes 11 s. The base interpreter's own pip (22.3 or later)
    # installs a current one into it instead (2 s, against 6 s for the bundled pip and its upgrade; measured
    # 2026-11-27, 2 cores), and uv beside it (3.4 s for both, 2026-11-28). Where that fails (no pip in the base, no uv
    # or no newer pip to be had), a current pip alone, then the bundled one, goes on.
    if ! (cd / && "$PYTHON" -c "import pip" >/dev/null 2>&1); then
        { [ "${USE_UV:-1}" != "0" ] \
              && "$_tt_base" -m pip --python "$PYTHON" install --retries 1 --upgrade pip uv >> "$_tt_log" 2>&1; } \
            || "$_tt_base" -m pip --python "$PYTHON" install --retries 1 --upgrade pip >> "$_tt_log" 2>&1 \
            || "$PYTHON" -m ensurepip >> "$_tt_log" 2>&1 \
            || { tail -n 30 "$_tt_log" >&2; echo "[bootstrap] could not give $_tt_root/.venv a pip (log: $_tt_log)" >&2; exit 1; }
    fi
    # uv resolves and installs in a quarter of pip's time: pip spends most of its time parsing large projects' index
    # pages (torch, numpy: 100,000 links in all). uv_pip.py passes pip's settings on, or says why it cannot.
    _tt_uv=0
    if [ "${USE_UV:-1}" != "0" ] && (cd / && "$PYTHON" "$_tt_root/scripts/uv_pip.py" check >> "$_tt_log" 2>&1); then
        _tt_uv=1
    fi
    if ! (cd / && "$PYTHON" -c "import torch" >/dev/null 2>&1); then
        echo "[bootstrap] installing torch==${TORCH_VERSION:-2.13.0} (set TORCH_VERSION to change)" >&2
        _tt_install "torch==${TORCH_VERSION:-2.13.0}" || {
            tail -n 30 "$_tt_log" >&2
            echo "[bootstrap] installing torch==${TORCH_VERSION:-2.13.0} failed (log: $_tt_log)" >&2
            exit 1
        }
        # torch's byte-code is compiled on the other core while the rest installs (see _tt_compile below).
        _tt_torch_dir="$(cd / && "$PYTHON" -c "import importlib.util as u; print(u.find_spec('torch').submodule_search_locations[0])")"
        ( cd / && "$PYTHON" -m compileall -q -j 1 "$_tt_torch_dir" >> "$_tt_log.compile" 2>&1 ) &
        _tt_torch_compile=$!
    fi
    _tt_target="$_tt_root"
    if [ -n "$_tt_extras" ]; then
        _tt_target="$_tt_root[${_tt_extras// /,}]"
        echo "[bootstrap] installing torchtitan, its dependencies and the extra '$_tt_extras'" >&2
    else
        echo "[bootstrap] installing torchtitan and its dependencies" >&2
    fi
    _tt_install -e "$_tt_target" || {
        tail -n 30 "$_tt_log" >&2
        echo "[bootstrap] installing torchtitan failed (log: $_tt_log)" >&2
        exit 1
    }
    _tt_compile
    _tt_imports "$PYTHON" || { echo "[bootstrap] torchtitan still not importable from $PYTHON" >&2; exit 1; }
    # Record only what this run installed: extras from an earlier install may be stale (e.g. after a
    # pyproject.toml change, a training run leaves dev unrecorded and the next test command updates it).
    { echo "# extras: $_tt_extras"; cat "$_tt_root/pyproject.toml"; } > "$_tt_stamp"
    echo "[bootstrap] done: using $PYTHON" >&2
fi
export PYTHON
