#!/usr/bin/env bash
# The prepared GPU check (issues 20, 30): build dcpx in place with this machine's
# python3, run every CUDA test against the real driver and the GPU benchmarks,
# write at most 8 files into OUTDIR and print a one-screen summary.
#   bash scripts/gpu_check.sh OUTDIR [--budget 480] [--parts a,b] [--quick]
# See scripts/gpu_check.py for the parts and the files.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
