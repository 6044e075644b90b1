#!/usr/bin/env bash
# Set up, then run the test suite.  Arguments go to pytest as they are:
#   scripts/test.sh                        the whole suite (tests/; about 20
#                                          minutes on a 2-core VM)
#   scripts/test.sh tests/test_cli.py -x   only that file
#   scripts/test.sh -m "not dist"          the whole suite, options added
#   DCPX_SANITIZE=1 scripts/test.sh   the same suite against an ASan+UBSan
#                                     build of the extension
#   DCPX_SLOW=1 scripts/test.sh       include the slow tests (huge tensors)
# pytest collects tests/ (pyproject.toml's testpaths) only when no file,
# directory or test id is given.
#   DCPX_NO_SETUP=1 scripts/test.sh   skip the set-up (done already; .ci/run,
#                                     which runs TSan beside the ASan stage)
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${DCPX_NO_SETUP:-0}" = 1 ] || scripts/setup.sh
. scripts/sanitizer_env.sh
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "no tests ran"; exit 1; }
exit "$rc"
