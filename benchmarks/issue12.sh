#!/usr/bin/env bash
# Issue 12's benchmark runs (benchmarks/README.md "Issue 12 results"), in order, on a quiet
# machine, from the repository root with the extension built:
#
#   BASE=/path/to/old/checkout bash benchmarks/issue12.sh     # old tree and new tree
#   bash benchmarks/issue12.sh                                # new tree only (old results kept)
#
# BASE is a checkout of the main before the change, its extension built there. Without BASE the
# old tree's results already in benchmarks/results/ (io_base, async_large_base, dist8_base) are
# what compare.py and bench_dist --compare set beside the new ones. PY overrides the interpreter.
set -euo pipefail
PY=${PY:-python3}
R=benchmarks/results
export PYTHONPATH=$PWD
old() { if [ -n "${BASE:-}" ]; then PYTHONPATH=$BASE "$PY" "$@"; fi; }

old benchmarks/bench_io.py --which both --repeat 5 --out $R/io_base
"$PY" benchmarks/bench_io.py --which both --repeat 5 --out $R/io_local
"$PY" benchmarks/compare.py $R/io_base.json $R/io_local.json --out $R/io_compare
"$PY" benchmarks/bench_io.py --which tiny --repeat 3 --out $R/io_tiny_local
old benchmarks/bench_async.py --which large --repeat 5 --only dcpx --out $R/async_large_base
"$PY" benchmarks/bench_async.py --which large --repeat 5 --only dcpx --out $R/async_large_local
"$PY" benchmarks/compare.py $R/async_large_base.json $R/async_large_local.json \
    --out $R/async_large_compare
"$PY" benchmarks/bench_async.py --which small --repeat 5 --out $R/async_small_local
old benchmarks/bench_dist.py --ranks 8 --impls dcpx --repeat 3 --out $R/dist8_base
"$PY" benchmarks/bench_dist.py --ranks 8 --impls dcpx --repeat 3 \
    --compare $R/dist8_base.json --out $R/dist8_local
"$PY" benchmarks/plot.py
"$PY" benchmarks/bench_floor.py --out $R/floor_local
