#!/usr/bin/env python3
"""Load of a *fresh* checkpoint: one this process has not loaded before, so that dcpx's
read-plan cache (dcpx/coordination/readplan.py) does not hit and the load decodes and checks its
``.metadata``, plans, and reads.  bench_load.py measures loads 2..N of one checkpoint instead.

COUNT checkpoints of one state dict (bench_io.py's 20,000-tensor mix by default; ``--tiny``:
bench_load.py's 100,000 4-element tensors) are saved once.
Each round starts one child process per implementation (``--impl NAME=DIR``: DIR goes first on
PYTHONPATH; the implementations alternate, so all see the same machine load); a child loads
checkpoint 0 (imports and first-use costs, not timed), then each of checkpoints 1..COUNT-1 once,
each load right after a read limit (the checkpoint's tensor bytes read from the warm page cache
with ``os.readv`` into one buffer, as bench_load.py).  Per implementation: min and median of all
its loads, of the read limits, and the per-tensor overhead (load - read limit) / tensors, in
wall time and in CPU time of the process (all threads), and whether every load was bit-exact.

    PYTHONPATH=$PWD python benchmarks/bench_load_fresh.py --impl base=/work/base --impl new=$PWD
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(args):
    sys.path.insert(0, HERE)
    import torch

    import dcpx
    from bench_load import limit_files, read_limit
    sd = torch.load(os.path.join(args.dir, "sd.pt"))
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    buf = torch.empty(nbytes, dtype=torch.uint8)
    dcpx.load(dst, checkpoint_id=os.path.join(args.dir, "c0"))
    out = []
    for i in range(1, args.count):
        path = os.path.join(args.dir, f"c{i}")
        files = limit_files(path, nbytes)
        t, c = time.perf_counter(), time.process_time()
        read_limit(files, buf)
        lim, lim_cpu = time.perf_counter() - t, time.process_time() - c
        for v in dst.values():
            v.zero_()
        t, c = time.perf_counter(), time.process_time()
        dcpx.load(dst, checkpoint_id=path)
        load, load_cpu = time.perf_counter() - t, time.process_time() - c
        exact = all(torch.equal(sd[k], dst[k]) for k in sd)
        out.append({"limit": lim, "limit_cpu": lim_cpu, "load": load, "load_cpu": load_cpu,
                    "exact": exact})
    print(json.dumps({"dcpx": os.path.dirname(dcpx.__file__), "loads": out}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", action="append", default=[], help="NAME=DIR (repeatable)")
    p.add_argument("--tensors", type=int, default=20000)
    p.add_argument("--tiny", action="store_true",
                   help="bench_load.py's 100,000 4-element tensors instead (--tensors ignored)")
    p.add_argument("--count", type=int, default=6, help="checkpoints (the first one is not timed)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    impls = [tuple(s.split("=", 1)) for s in args.impl] or [("this", os.path.dirname(HERE))]
    sys.path.insert(0, HERE)
    import torch

    import dcpx
    from bench_io import make_small
    from bench_load import make_tiny
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; torch {torch.__version__}")
    workdir = tempfile.mkdtemp(prefix="dcpx-bench-fresh-", dir=args.dir)
    try:
        sd = make_tiny() if args.tiny else make_small(args.tensors)
        for i in range(args.count):
            dcpx.save(sd, checkpoint_id=os.path.join(workdir, f"c{i}"))
        torch.save(sd, os.path.join(workdir, "sd.pt"))
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        print(f"{len(sd)} tensors, {nbytes / 2**20:.1f} MiB; {args.count - 1} fresh loads per child, "
              f"{args.rounds} rounds; saved by {os.path.dirname(dcpx.__file__)}")
        results = {name: [] for name, _ in impls}
        for r in range(args.rounds):
            for name, src in (impls if r % 2 == 0 else impls[::-1]):
                env = dict(os.environ, PYTHONPATH=src)
                got = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                      "--dir", workdir, "--count", str(args.count)],
                                     env=env, check=True, capture_output=True, text=True)
                res = json.loads(got.stdout.strip().splitlines()[-1])
                results[name] += res["loads"]
                print(f"  round {r} {name} ({res['dcpx']}): "
                      + " ".join(f"{x['load']:.4f}" for x in res["loads"]))
                sys.stdout.flush()
        n = len(sd)
        for name, loads in results.items():
            def col(k):
                v = [x[k] for x in loads]
                return min(v), statistics.median(v)
            lmin, lmed = col("load")
            cmin, cmed = col("load_cpu")
            rmin, rmed = col("limit")
            over = [(x["load"] - x["limit"]) / n * 1e6 for x in loads]
            over_cpu = [(x["load_cpu"] - x["limit_cpu"]) / n * 1e6 for x in loads]
            print(f"({name}) {len(loads)} fresh loads, all bit-exact: {all(x['exact'] for x in loads)}")
            print(f"  load        min {lmin:.4f} s  median {lmed:.4f} s   "
                  f"(read limit min {rmin:.4f} median {rmed:.4f} -> {rmed / lmed:.3f}x the limit)")
            print(f"  load CPU    min {cmin:.4f} s  median {cmed:.4f} s")
            print(f"  per tensor above the limit: wall min {min(over):.2f} median "
                  f"{statistics.median(over):.2f} us; CPU min {min(over_cpu):.2f} median "
                  f"{statistics.median(over_cpu):.2f} us")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
