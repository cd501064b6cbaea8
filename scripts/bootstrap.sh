# Sourced by run_train.sh and scripts/run_tests.sh: sets PYTHON to an interpreter that can import torchtitan
# and its dependencies (with pytest when NEED_DEV=1).
#   0. $PYTHON, if set and it already works;
#   1. ./.venv of this checkout, if it works and was installed from the current pyproject.toml;
#   2. otherwise the current python3, if it already has everything (a cluster's own environment): no install;
#   3. otherwise create (or refresh) ./.venv and install into it: the pinned torch first (TORCH_VERSION,
#      default 2.13.0; an open range would pull the newest release and several GB of CUDA packages), then
#      this project with its dev extra.
# Checks run from / so the checkout itself on sys.path cannot make an uninstalled package look installed.
_tt_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_tt_check='import torchtitan, torch, tokenizers, torchdata, tiktoken'
if [ "${NEED_DEV:-0}" = "1" ]; then _tt_check="$_tt_check, pytest"; fi
_tt_stamp="$_tt_root/.venv/.installed-pyproject"

_tt_works() { (cd / && "$1" -c "$_tt_check" >/dev/null 2>&1); }
_tt_fresh() { [ -f "$_tt_stamp" ] && cmp -s "$_tt_stamp" "$_tt_root/pyproject.toml"; }

if [ -n "${PYTHON:-}" ] && _tt_works "$PYTHON"; then
    :  # an explicitly chosen interpreter that already has everything
elif [ -x "$_tt_root/.venv/bin/python" ] && _tt_fresh && _tt_works "$_tt_root/.venv/bin/python"; then
    PYTHON="$_tt_root/.venv/bin/python"
elif [ ! -x "$_tt_root/.venv/bin/python" ] && _tt_works python3; then
    PYTHON=python3
else
    _tt_base="${PYTHON:-python3}"
    if [ -x "$_tt_root/.venv/bin/python" ]; then
        echo "[bootstrap] $_tt_root/.venv is missing packages or pyproject.toml changed: updating it" >&2
    else
        echo "[bootstrap] torchtitan is not importable: creating $_tt_root/.venv and installing into it" >&2
        "$_tt_base" -m venv "$_tt_root/.venv" || { echo "[bootstrap] could not create a venv" >&2; exit 1; }
    fi
    PYTHON="$_tt_root/.venv/bin/python"
    # pip's output goes to a log (shown only on failure) so the first run's console stays readable.
    _tt_log="$_tt_root/.venv/bootstrap.log"
    : > "$_tt_log"
    if ! (cd / && "$PYTHON" -c "import torch" >/dev/null 2>&1); then
        echo "[bootstrap] installing torch==${TORCH_VERSION:-2.13.0} (set TORCH_VERSION to change)" >&2
        "$PYTHON" -m pip install "torch==${TORCH_VERSION:-2.13.0}" >> "$_tt_log" 2>&1 || {
            tail -n 30 "$_tt_log" >&2
            echo "[bootstrap] installing torch==${TORCH_VERSION:-2.13.0} failed (log: $_tt_log)" >&2
            exit 1
        }
    fi
    echo "[bootstrap] installing torchtitan and its dependencies" >&2
    "$PYTHON" -m pip install -e "$_tt_root[dev]" >> "$_tt_log" 2>&1 || {
        tail -n 30 "$_tt_log" >&2
        echo "[bootstrap] installing torchtitan failed (log: $_tt_log)" >&2
        exit 1
    }
    _tt_works "$PYTHON" || { echo "[bootstrap] torchtitan still not importable from $PYTHON" >&2; exit 1; }
    cp "$_tt_root/pyproject.toml" "$_tt_stamp"
    echo "[bootstrap] done: using $PYTHON" >&2
fi
export PYTHON
