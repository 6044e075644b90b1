#!/usr/bin/env bash
# Build dcpx against several torch versions and run the version-sensitive
# part of the test suite on each; write a results table.
#
#   scripts/torch_matrix.sh                      every declared minor version
#                                                (pyproject's torch>=X.Y up
#                                                to 2.14), newest patch each
#   scripts/torch_matrix.sh 2.11.0 2.14.1        these versions
#   scripts/torch_matrix.sh 2.13.0=/path/venv    this version from an existing
#                                                venv (checked: its torch must
#                                                be 2.13.0, any +local suffix)
#
# Each version runs in its own virtual environment, kept OUTSIDE the repo and
# reused: $DCPX_MATRIX_VENVS/torch-X.Y.Z (default ~/.cache/dcpx-torch-venvs).
# A missing one is created with uv (shared cache, hard links: the nvidia-*
# wheels that several torch versions share are stored once):
#   uv venv --python $DCPX_MATRIX_PYTHON DIR.tmp
#   uv pip install torch==X.Y.Z numpy pytest hypothesis fsspec safetensors \
#       tqdm matplotlib zstandard setuptools wheel
# then DIR.tmp is renamed to DIR (a half-built venv is never reused).  From
# PyPI on Linux x86-64 these are CUDA builds with their nvidia-* packages:
# 3-7 GB per venv (less with the shared cache), minutes to download each.
#
# dcpx is built per version in a scratch copy of the working tree
# ($DCPX_MATRIX_WORK/src-X.Y.Z: tracked and untracked-but-not-ignored files),
# with that venv's Python (the extension links no libtorch, but the copy
# keeps the repo's own .venv and dcpx/_C*.so untouched), and the tests run
# there with PYTHONPATH pointing at the copy.
#
# The tests (SUBSET below, about 480 of the suite's ~3,300 on torch 2.13, chosen to
# take at most ~7 minutes per version on 2 idle cores, against ~20 for the whole
# suite; the committed table was timed on a loaded machine, see its note):
# the files where torch's version shows: the public names and signatures and the errors
# torch's API raises (test_torch_names), features only some versions have
# (test_torch_versions), checkpoints both ways with that torch, every dtype
# it has (test_interop, test_roundtrip), the metadata pickles torch reads
# (test_mdpickle), planner and storage objects (test_plan, test_storage_api,
# test_monkeypatch), async_save with torch's stager protocol, THREAD and
# PROCESS (test_async), 2-rank gloo saves and loads of DTensors
# (test_dist_sharded), and the CLI, whose conversions use torch's own zip
# writer and planner helpers (test_cli, test_cli_commands,
# test_tools_hostile), big-endian records (test_byteorder), steady-state
# saves' all-reduces (test_steady_state) and the node-local tier's own gloo
# groups, built on the default store with torch's internals where they
# exist (test_tiers).  DCPX_MATRIX_TESTS
# replaces the list (e.g. DCPX_MATRIX_TESTS=tests for the whole suite).
#
# Output: $DCPX_MATRIX_OUT (default benchmarks/results/torch_matrix.md), a
# table of version / passed / failed / skipped / errors / seconds, and the
# command that made it; per-version logs and junit XML in $DCPX_MATRIX_WORK
# (default /tmp/dcpx-torch-matrix).  Exit status: 0 when every version
# passed, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENVS=${DCPX_MATRIX_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/dcpx-torch-venvs}
WORK=${DCPX_MATRIX_WORK:-/tmp/dcpx-torch-matrix}
OUT=${DCPX_MATRIX_OUT:-benchmarks/results/torch_matrix.md}
MPY=${DCPX_MATRIX_PYTHON:-python3}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$VENVS/uv-cache}
export UV_LINK_MODE=${UV_LINK_MODE:-hardlink}

SUBSET="tests/test_torch_names.py tests/test_torch_versions.py tests/test_interop.py
tests/test_roundtrip.py tests/test_mdpickle.py tests/test_plan.py tests/test_storage_api.py
tests/test_monkeypatch.py tests/test_async.py tests/test_dist_sharded.py tests/test_cli.py
tests/test_cli_commands.py tests/test_tools_hostile.py tests/test_byteorder.py
tests/test_steady_state.py tests/test_tiers.py"
TESTS=${DCPX_MATRIX_TESTS:-$SUBSET}

# The newest patch release of each minor version (PyPI, 2026-11).
NEWEST="2.4.1 2.5.1 2.6.0 2.7.1 2.8.0 2.9.1 2.10.0 2.11.0 2.12.1 2.13.0 2.14.1"

# "X Y" of a version string X.Y[.Z][+local]
minor_of() { echo "$1" | sed -E 's/^([0-9]+)\.([0-9]+).*/\1 \2/'; }
version_ge() {  # $1 >= $2, both X.Y...
    local a b
    read -r a1 a2 <<<"$(minor_of "$1")"; read -r b1 b2 <<<"$(minor_of "$2")"
    [ "$a1" -gt "$b1" ] || { [ "$a1" -eq "$b1" ] && [ "$a2" -ge "$b2" ]; }
}

if [ $# -eq 0 ]; then
    declared=$(sed -nE 's/.*"torch>=([0-9]+\.[0-9]+)[^"]*".*/\1/p' pyproject.toml | head -1)
    [ -n "$declared" ] || { echo "torch_matrix: no torch>=X.Y in pyproject.toml" >&2; exit 2; }
    set --
    for v in $NEWEST; do version_ge "$v" "$declared" && set -- "$@" "$v"; done
fi

mkdir -p "$WORK" "$VENVS"
command="scripts/torch_matrix.sh $*"
rows=()
details=()
status=0

make_venv() {  # $1 version, $2 venv dir
    command -v uv >/dev/null || { echo "torch_matrix: uv is needed to create $2" >&2; return 1; }
    rm -rf "$2.tmp"
    uv venv -q --python "$MPY" "$2.tmp"
    uv pip install -q --python "$2.tmp/bin/python" "torch==$1" numpy pytest hypothesis \
        fsspec safetensors tqdm matplotlib zstandard setuptools wheel
    mv "$2.tmp" "$2"
}

write_table() {  # rewritten after each version: a cut-short run leaves its rows
    mkdir -p "$(dirname "$OUT")"
    {
        echo "# dcpx on each torch version"
        echo
        echo "Made by \`$command\` on $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores."
        [ -z "${DCPX_MATRIX_NOTE:-}" ] || { echo; echo "$DCPX_MATRIX_NOTE"; }
        echo
        echo "Tests: \`$(echo $TESTS)\`"
        echo
        echo "| torch | passed | failed | skipped | errors | seconds (build + tests) |"
        echo "|---|---|---|---|---|---|"
        [ ${#rows[@]} -eq 0 ] || printf '%s\n' "${rows[@]}"
        if [ ${#details[@]} -gt 0 ]; then
            echo; echo "Failed or erroring tests:"; echo; printf '%s\n' "${details[@]}"
        fi
    } >"$OUT"
}

for spec in "$@"; do
    v=${spec%%=*}
    if [ "$spec" != "$v" ]; then venv=${spec#*=}; else venv=$VENVS/torch-$v; fi
    log=$WORK/torch-$v.log
    xml=$WORK/torch-$v.xml
    src=$WORK/src-$v
    echo "== torch $v ($venv)"
    if [ ! -x "$venv/bin/python" ]; then
        if [ "$spec" != "$v" ]; then
            echo "torch_matrix: $venv has no bin/python" >&2; rows+=("| $v | venv missing | | | | |"); status=1; write_table; continue
        fi
        if ! make_venv "$v" "$venv" >"$log" 2>&1; then
            echo "torch_matrix: creating $venv failed (see $log)" >&2
            rows+=("| $v | venv failed | | | | |"); status=1; write_table; continue
        fi
    fi
    have=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
    if [ "${have%%+*}" != "$v" ]; then
        echo "torch_matrix: $venv has torch '${have}', not $v" >&2
        rows+=("| $v | wrong torch ($have) | | | | |"); status=1; write_table; continue
    fi
    # a scratch copy of the working tree, built with this venv's Python
    rm -rf "$src"; mkdir -p "$src"
    git ls-files -z -co --exclude-standard | (cd "$REPO" && tar --null --ignore-failed-read -T - -cf - 2>/dev/null) \
        | tar -xf - -C "$src"
    start=$(date +%s)
    if ! (cd "$src" && DCPX_WERROR=1 "$venv/bin/python" setup.py -q build_ext --inplace) >"$log" 2>&1; then
        echo "torch_matrix: build failed on torch $v (see $log)" >&2
        rows+=("| $have | build failed | | | | $(( $(date +%s) - start )) |"); status=1; write_table; continue
    fi
    rm -f "$xml"
    set +e
    # shellcheck disable=SC2086
    (cd "$src" && PYTHONPATH="$src" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
        --junitxml="$xml" $TESTS) >>"$log" 2>&1
    rc=$?
    set -e
    secs=$(( $(date +%s) - start ))
    summary=$("$venv/bin/python" - "$xml" <<'EOF' 2>/dev/null || echo "? ? ? ?"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
s = root if root.tag == "testsuite" else root.find("testsuite")
n, f, e, k = (int(s.get(a, 0)) for a in ("tests", "failures", "errors", "skipped"))
print(n - f - e - k, f, k, e)
for case in s.iter("testcase"):  # the failed and erroring tests, one a line
    if case.find("failure") is not None or case.find("error") is not None:
        print("%s::%s" % (case.get("classname", "").replace(".", "/") + ".py", case.get("name")))
EOF
)
    read -r passed failed skipped errors <<<"$(head -1 <<<"$summary")"
    while IFS= read -r t; do
        [ -n "$t" ] && details+=("- torch $have: \`$t\`")
    done <<<"$(tail -n +2 <<<"$summary")"
    echo "   passed $passed, failed $failed, skipped $skipped, errors $errors, ${secs}s (log: $log)"
    rows+=("| $have | $passed | $failed | $skipped | $errors | $secs |")
    [ "$rc" -eq 0 ] || status=1
    write_table
done
write_table

echo "torch_matrix: wrote $OUT"
exit "$status"
