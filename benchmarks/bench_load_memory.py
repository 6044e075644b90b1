#!/usr/bin/env python3
"""Memory of repeated loads: 100,000 4-element tensors saved once, then loaded N times into
one state dict in a fresh process per library.  Per load: seconds, the peak RSS above the RSS
before it (VmHWM after writing 5 to /proc/self/clear_refs, Linux), and the RSS it leaves.

    PYTHONPATH=$PWD python benchmarks/bench_load_memory.py [--loads 3] [--torch]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

N = 100000


def child(lib, path, loads):
    import torch
    warnings.filterwarnings("ignore")
    import dcpx
    import torch.distributed.checkpoint as tdcp

    def rss(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))
    dst = {f"layer{i // 10}.p{i % 10}": torch.empty(4) for i in range(N)}
    out = []
    for _ in range(loads):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = rss("VmRSS:")
        t = time.perf_counter()
        if lib == "dcpx":
            dcpx.load(dst, checkpoint_id=path)
        else:
            tdcp.load(dst, checkpoint_id=path, no_dist=True)
        dt = time.perf_counter() - t
        out.append(f"{dt:.3f} s, peak +{(rss('VmHWM:') - base) / 2**20:.1f} MiB, "
                   f"kept {(rss('VmRSS:') - base) / 2**20:+.1f} MiB")
    print(f"{lib}: " + "; ".join(out), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--loads", type=int, default=3)
    p.add_argument("--torch", action="store_true", help="also torch DCP's load (slow)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.loads)
    import torch
    import dcpx
    d = tempfile.mkdtemp(prefix="dcpx-bench-loadmem-")
    try:
        dcpx.save({f"layer{i // 10}.p{i % 10}": torch.randn(4) for i in range(N)},
                  checkpoint_id=os.path.join(d, "c"))
        for lib in ["dcpx"] + (["torch"] if args.torch else []):
            subprocess.run([sys.executable, __file__, "--loads", str(args.loads),
                            "--child", lib, os.path.join(d, "c")], check=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
