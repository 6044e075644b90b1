#!/usr/bin/env bash
# Set up, then run the test suite.  Extra arguments go to pytest.
#   DCPX_SANITIZE=1 scripts/test.sh   the same suite against an ASan+UBSan
#                                     build of the extension
#   DCPX_SLOW=1 scripts/test.sh       include the slow tests (huge tensors)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "${DCPX_SANITIZE:-0}" = "1" ]; then
    # The interpreter is not instrumented: preload the runtimes.  Leak
    # checking is off because CPython itself keeps memory until exit.
    export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
    export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=1"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
fi
set +e
.venv/bin/python -m pytest -q tests "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "no tests ran"; exit 1; }
exit "$rc"
