"""Loading a float32 checkpoint into a bfloat16 model: time and extra peak
memory, torch DCP vs dcpx (docs/api.md, "Loading into another dtype").

Each load runs in a fresh process: it allocates the bf16 destination, resets
its peak RSS (/proc/self/clear_refs), loads, and reports the time and how far the peak RSS rose
above the destination (the temporaries a cast load holds).  The checkpoint
is read once first, so every load reads from the page cache.

    PYTHONPATH=$PWD python benchmarks/bench_cast.py --mib 512 --tensors 16 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, warnings
import torch
import dcpx, dcpx.filesystem
import torch.distributed.checkpoint as tdcp
path, lib, n, numel, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if budget:
    dcpx.filesystem._TEMP_BUDGET = budget
sd = {f"t{i}": torch.zeros(numel, dtype=torch.bfloat16) for i in range(n)}
def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
base = status("VmRSS")
t0 = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if lib == "torch":
        tdcp.load(sd, checkpoint_id=path, no_dist=True)
    else:
        dcpx.load(sd, checkpoint_id=path)
dt = time.perf_counter() - t0
peak = status("VmHWM")
print(json.dumps({"s": dt, "extra_mib": (peak - base) / 1024, "base": base / 1024}))
"""


def run(path: str, lib: str, n: int, numel: int, budget: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, path, lib, str(n), str(numel), str(budget)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="float32 checkpoint size")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budgets-mib", default="64,16",
                    help="dcpx temporary budgets to try (the first is the default)")
    args = ap.parse_args()
    import torch

    import dcpx

    numel = args.mib * 2**20 // 4 // args.tensors
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt")
        g = torch.Generator().manual_seed(0)
        dcpx.save({f"t{i}": torch.randn(numel, generator=g) for i in range(args.tensors)},
                  checkpoint_id=path)
        for name in os.listdir(path):  # into the page cache
            with open(os.path.join(path, name), "rb") as f:
                while f.read(1 << 24):
                    pass
        cases = [("torch DCP", "torch", 0)] + [
            (f"dcpx, budget {b} MiB", "dcpx", int(b) << 20)
            for b in args.budgets_mib.split(",")]
        load = os.getloadavg()[0]
        print(f"float32 checkpoint of {args.mib} MiB ({args.tensors} tensors of "
              f"{numel * 4 / 2**20:.0f} MiB) into bfloat16; median of {args.repeat} "
              f"fresh processes; load average {load:.2f}; {os.cpu_count()} CPUs\n")
        print("| loader | time (s) | peak RSS above the destination (MiB) |")
        print("| --- | ---: | ---: |")
        for label, lib, budget in cases:
            rs = [run(path, lib, args.tensors, numel, budget) for _ in range(args.repeat)]
            print(f"| {label} | {statistics.median(r['s'] for r in rs):.3f} | "
                  f"{statistics.median(r['extra_mib'] for r in rs):.0f} |")


if __name__ == "__main__":
    main()
