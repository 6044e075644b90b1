#!/usr/bin/env bash
# Set up, then run the test suite.  Extra arguments go to pytest.
#   DCPX_SANITIZE=1 scripts/test.sh   the same suite against an ASan+UBSan
#                                     build of the extension
#   DCPX_SLOW=1 scripts/test.sh       include the slow tests (huge tensors)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. scripts/sanitizer_env.sh
set +e
.venv/bin/python -m pytest -q tests "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "no tests ran"; exit 1; }
exit "$rc"
