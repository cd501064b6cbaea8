# Sourced by run_train.sh and scripts/run_tests.sh: sets PYTHON to an interpreter that can import torchtitan
# and its dependencies (with pytest when NEED_DEV=1).
#   0. $PYTHON, if set and it already works;
#   1. ./.venv of this checkout, if it already works;
#   2. otherwise the current python3, if it already has everything (a cluster's own environment): no install;
#   3. otherwise create ./.venv and install into it: the pinned torch first (TORCH_VERSION, default 2.13.0;
#      an open range would pull the newest release and several GB of CUDA packages), then this project.
# Checks run from / so the checkout itself on sys.path cannot make an uninstalled package look installed.
_tt_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_tt_check='import torchtitan, torch, tokenizers, torchdata'
if [ "${NEED_DEV:-0}" = "1" ]; then _tt_check="$_tt_check, pytest"; fi

_tt_works() { (cd / && "$1" -c "$_tt_check" >/dev/null 2>&1); }

if [ -n "${PYTHON:-}" ] && _tt_works "$PYTHON"; then
    :  # an explicitly chosen interpreter that already has everything
elif [ -x "$_tt_root/.venv/bin/python" ] && _tt_works "$_tt_root/.venv/bin/python"; then
    PYTHON="$_tt_root/.venv/bin/python"
elif _tt_works python3; then
    PYTHON=python3
else
    _tt_base="${PYTHON:-python3}"
    echo "[bootstrap] torchtitan is not importable: creating $_tt_root/.venv and installing into it" >&2
    echo "[bootstrap] torch==${TORCH_VERSION:-2.13.0} first (set TORCH_VERSION to change), then the project" >&2
    if [ ! -x "$_tt_root/.venv/bin/python" ]; then
        "$_tt_base" -m venv "$_tt_root/.venv" || { echo "[bootstrap] could not create a venv" >&2; exit 1; }
    fi
    PYTHON="$_tt_root/.venv/bin/python"
    "$PYTHON" -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}" \
        || { echo "[bootstrap] installing torch==${TORCH_VERSION:-2.13.0} failed" >&2; exit 1; }
    "$PYTHON" -m pip install --quiet -e "$_tt_root[dev]" \
        || { echo "[bootstrap] installing torchtitan failed" >&2; exit 1; }
    _tt_works "$PYTHON" || { echo "[bootstrap] torchtitan still not importable from $PYTHON" >&2; exit 1; }
    echo "[bootstrap] done: using $PYTHON" >&2
fi
export PYTHON
