#!/usr/bin/env bash
# Run torch's own DCP tests (its test/distributed/checkpoint/*.py files) twice
# each: with torch's save / load / async_save, and with dcpx's patched in
# (scripts/torch_dcp_patch/sitecustomize.py: in every process, spawned ranks
# included), and print one table row per file: passed / failed / skipped /
# errors with torch and with dcpx.
#
#   scripts/torch_dcp_tests.sh DIR [FILE...]
#
# DIR holds torch's test files (they are not part of this repository: take
# them from a PyTorch checkout at the tag of the installed torch, e.g.
#   git clone --depth 1 --branch v2.13.0 --filter=blob:none --sparse \
#       <pytorch repo> pt && git -C pt sparse-checkout set test/distributed/checkpoint
# and pass pt/test/distributed/checkpoint).  FILE: names of files in DIR
# (default: every test_*.py there).  PYTHON (default .venv/bin/python) runs
# pytest; torch's test helpers need `expecttest` installed.  TIMEOUT
# (default 900) bounds each run in seconds.  OUT (default a temp dir) keeps
# each run's log.  Deliberate differences: docs/migration.md.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
dir="${1:?usage: scripts/torch_dcp_tests.sh DIR [FILE...]}"
shift
py="${PYTHON:-$repo/.venv/bin/python}"
timeout_s="${TIMEOUT:-900}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
if [ $# -eq 0 ]; then
    set -- $(cd "$dir" && ls test_*.py)
fi
"$py" -c "import expecttest" 2>/dev/null ||
    echo "warning: torch's test helpers need expecttest ($py -m pip install expecttest)" >&2

# "N passed, M failed, ..." -> "passed failed skipped errors"
counts() {
    local line
    line="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error|errors|deselected)|no tests ran' "$1" | tail -1)"
    local p f s e
    p="$(echo "$line" | grep -oE '[0-9]+ passed' | cut -d' ' -f1)"
    f="$(echo "$line" | grep -oE '[0-9]+ failed' | cut -d' ' -f1)"
    s="$(echo "$line" | grep -oE '[0-9]+ skipped' | cut -d' ' -f1)"
    e="$(echo "$line" | grep -oE '[0-9]+ errors?' | cut -d' ' -f1)"
    echo "${p:-0} ${f:-0} ${s:-0} ${e:-0}"
}

run() {  # run FILE LABEL [env...]: the run's counts, its log in $out
    local file="$1" label="$2"
    shift 2
    local log="$out/${file%.py}.$label.log"
    (cd "$dir" && env "$@" timeout "$timeout_s" "$py" -m pytest -q -p no:cacheprovider \
        -rfE "$file" >"$log" 2>&1)
    local rc=$?
    if [ $rc -eq 124 ]; then
        echo "timeout"
    else
        counts "$log"
    fi
}

torch_version="$("$py" -c 'import torch; print(torch.__version__)')"
echo "torch $torch_version; $(date -u +%Y-%m-%dT%H:%MZ); logs in $out"
echo
echo "| file | torch: passed / failed / skipped / errors | dcpx: passed / failed / skipped / errors | same outcome per test |"
echo "| --- | --- | --- | --- |"
for file in "$@"; do
    t="$(run "$file" torch DCPX_PATCH_TORCH=0)"
    d="$(run "$file" dcpx DCPX_PATCH_TORCH=1 "PYTHONPATH=$here/torch_dcp_patch:$repo${PYTHONPATH:+:$PYTHONPATH}")"
    # the tests whose outcome differs (pytest -rfE lists FAILED / ERROR ones)
    diff="$(diff <(grep -E '^(FAILED|ERROR) ' "$out/${file%.py}.torch.log" | sed 's/ - .*//' | sort) \
                 <(grep -E '^(FAILED|ERROR) ' "$out/${file%.py}.dcpx.log" | sed 's/ - .*//' | sort) |
            grep -E '^[<>]' | sed 's/^</only with torch:/; s/^>/only with dcpx:/' | tr '\n' ';')"
    echo "| $file | ${t// / \/ } | ${d// / \/ } | ${diff:-yes} |"
done
