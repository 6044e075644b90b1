#!/usr/bin/env bash
# Set up everything dcpx needs on a fresh machine, idempotently:
# a virtual environment in .venv with torch 2.13.0 (CPU build; pinned so
# that no install ever pulls a CUDA build), the test tools, and dcpx itself
# built in place (a C compiler and the Python headers are all it needs).
#
#   DCPX_SANITIZE=1 scripts/setup.sh   builds the extension with ASan+UBSan
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${DCPX_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.dcpx-deps-1"
if [ ! -f "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" numpy pytest hypothesis fsspec
    touch "$stamp"
fi
# Rebuild the extension every time: it takes seconds and follows the sources.
rm -f dcpx/_C*.so
DCPX_WERROR=${DCPX_WERROR:-1} "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
(
    . scripts/sanitizer_env.sh
    "$VENV/bin/python" -c "import dcpx, torch; print(f'dcpx {dcpx.__version__} (crc32: {dcpx._C.crc32_impl}), torch {torch.__version__}')"
)
