"""Wall and CPU time of repeated synchronous ``dcpx.save`` calls of many
small tensors (the per-tensor cost of planning a save, issue 12).

    PYTHONPATH=$PWD python benchmarks/bench_plan.py 20k 6    # 20,000 float32, 143 MiB
    PYTHONPATH=$PWD python benchmarks/bench_plan.py 100k 5   # 100,000 float32[4]
    PYTHONPATH=$PWD python benchmarks/bench_plan.py 100k 3 prof   # + cProfile of saves 2..N

Prints the times of saves 2..N (the first warms up: dtypes, plan cache) and
their medians; CPU time (process, all threads) is the figure to compare on a
shared machine.  Checkpoints go to a temporary directory under $TMPDIR,
fsynced (FileSystemWriter's default)."""
import cProfile
import pstats
import shutil
import statistics
import sys
import tempfile
import time

import torch

import dcpx

which = sys.argv[1] if len(sys.argv) > 1 else "20k"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 6
prof = len(sys.argv) > 3 and sys.argv[3] == "prof"
torch.manual_seed(0)
if which == "20k":
    per = (143 << 20) // 4 // 20000
    sd = {f"m.layer{i // 10}.p{i % 10}": torch.randn(per) for i in range(20000)}
else:
    sd = {f"layer{i // 10}.p{i % 10}": torch.randn(4) for i in range(100000)}
d = tempfile.mkdtemp()
times, cpus = [], []
pr = cProfile.Profile()
try:
    for i in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        if prof and i >= 1:
            pr.enable()
        dcpx.save(sd, checkpoint_id=d)
        if prof and i >= 1:
            pr.disable()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
finally:
    shutil.rmtree(d)
print(which, "saves 2..N:", " ".join(f"{t:.3f}" for t in times[1:]),
      f"median {statistics.median(times[1:]):.3f} s | cpu median {statistics.median(cpus[1:]):.3f} s")
if prof:
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
