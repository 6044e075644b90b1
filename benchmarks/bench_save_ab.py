#!/usr/bin/env python3
"""Synchronous dcpx.save of many small tensors, two source trees compared
in one run (A/B interleaved: the machine's load changes over minutes).

    python3 benchmarks/bench_save_ab.py TREE_A TREE_B [--rounds 4] [--saves 3] [--count 20000]
                                        [--case small|tiny]

Each round runs one process per tree, in alternating order; a process
imports dcpx from its tree, saves bench_io's make_small(count) (or
make_tiny(count), --case tiny) once
(untimed: the plan cache is then warm, as from a training loop's second
save), then `--saves` times into fresh directories, each followed by the
write+fsync limit of the same bytes (bench_io.limit_write).  Prints, per
tree, min and median of the save's wall time, of the limit and of the
save's main-thread CPU time, and the per-tensor overhead (median save minus
median limit, per tensor)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import gc, json, os, shutil, sys, time
tree, saves, count, work, case = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
sys.path.insert(0, tree)
sys.path.insert(0, HERE)
import bench_io
import dcpx
assert os.path.abspath(dcpx.__file__).startswith(os.path.abspath(tree)), dcpx.__file__
sd = bench_io.make_small(count) if case == 'small' else bench_io.make_tiny(count)
src, _ = bench_io.limit_buffers(sd, bench_io.empty_like_sd(sd))
dcpx.save(sd, checkpoint_id=os.path.join(work, "warm"))
out = {"save": [], "cpu": [], "limit": []}
for i in range(saves):
    gc.collect()
    c0, t0 = time.thread_time(), time.perf_counter()
    dcpx.save(sd, checkpoint_id=os.path.join(work, str(i)))
    out["save"].append(time.perf_counter() - t0)
    out["cpu"].append(time.thread_time() - c0)
    gc.collect()
    t0 = time.perf_counter()
    bench_io.limit_write(src, os.path.join(work, "limit"))
    out["limit"].append(time.perf_counter() - t0)
    os.unlink(os.path.join(work, "limit"))
print(json.dumps(out))
""".replace("HERE", repr(HERE))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--case", choices=["small", "tiny"], default="small")
    ap.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp dir)")
    args = ap.parse_args()
    res = {t: {"save": [], "cpu": [], "limit": []} for t in args.trees}
    for r in range(args.rounds):
        for tree in (args.trees if r % 2 == 0 else args.trees[::-1]):
            with tempfile.TemporaryDirectory(dir=args.workdir) as work:
                got = subprocess.run([sys.executable, "-c", CHILD, tree, str(args.saves),
                                      str(args.count), work, args.case],
                                     check=True, capture_output=True, text=True).stdout
            for k, v in json.loads(got.splitlines()[-1]).items():
                res[tree][k] += v
    print(f"{args.count} tensors (bench_io make_{args.case}), {args.rounds} rounds x {args.saves} saves "
          f"per tree, alternating; ms")
    for tree, d in res.items():
        s, c, lim = d["save"], d["cpu"], d["limit"]
        med = statistics.median
        print(f"{tree}: save min {min(s)*1e3:.1f} med {med(s)*1e3:.1f} | main-thread CPU min "
              f"{min(c)*1e3:.1f} med {med(c)*1e3:.1f} | limit min {min(lim)*1e3:.1f} med "
              f"{med(lim)*1e3:.1f} | limit/save (medians) {med(lim)/med(s):.2f}x | over the "
              f"limit {(med(s)-med(lim))/args.count*1e6:.2f} us/tensor")


if __name__ == "__main__":
    main()
