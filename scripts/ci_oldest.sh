#!/usr/bin/env bash
# CI: the version-sensitive part of the suite (the API against torch's,
# interop with torch both ways, 4-rank sharded saves and loads, async_save) on the
# oldest torch dcpx declares (pyproject.toml: torch>=2.4), pinned exactly.
#
# The torch venv lives outside the repo and is reused when present:
#   $DCPX_OLDEST_VENV (default ~/.cache/dcpx/venv-torch-2.4.1)
# On a fresh machine it is made from PyPI: the CUDA build of torch with its
# nvidia-* packages (about 2.5 GB to download; PyPI has no CPU build).  dcpx
# is then built into the ignored .venv-oldest, which reuses that torch
# (scripts/setup.sh), and the tests run there.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_OLDEST=2.4.1
VENV=${DCPX_OLDEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dcpx/venv-torch-$TORCH_OLDEST}
PY=${PYTHON:-python3}
# numpy < 2.3: torch 2.4 was built against numpy 2.0
DEPS=("torch==$TORCH_OLDEST" "numpy<2.3" pytest hypothesis fsspec safetensors tqdm
      matplotlib setuptools wheel)

have_torch() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c \
        "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_OLDEST')" 2>/dev/null
}
if ! have_torch; then
    echo "ci_oldest: making $VENV (torch==$TORCH_OLDEST from PyPI)"
    rm -rf "$VENV.tmp"
    mkdir -p "$(dirname "$VENV")"
    if command -v uv >/dev/null 2>&1; then
        uv venv -q --python "$("$PY" -c 'import sys; print(sys.executable)')" "$VENV.tmp"
        uv pip install -q --python "$VENV.tmp/bin/python" "${DEPS[@]}"
    else
        "$PY" -m venv "$VENV.tmp"
        "$VENV.tmp/bin/python" -m pip install -q --upgrade pip
        "$VENV.tmp/bin/python" -m pip install -q "${DEPS[@]}"
    fi
    rm -rf "$VENV"
    mv "$VENV.tmp" "$VENV"
    # a venv's scripts name its directory; the interpreter is all we run
    have_torch
fi
PYTHON="$VENV/bin/python" DCPX_VENV=.venv-oldest bash scripts/setup.sh
set +e
.venv-oldest/bin/python -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/test_torch_names.py tests/test_interop.py tests/test_async.py \
    tests/test_dist_sharded.py "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "no tests ran"; exit 1; }
exit "$rc"
