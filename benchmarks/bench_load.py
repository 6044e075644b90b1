#!/usr/bin/env python3
"""Load benchmark: the same checkpoint loaded repeatedly into the same state dict.

For (a) 20,000 small tensors (bench_io.py's mix, 143 MiB) and (b) 100,000 tiny ones
(``{f"layer{i//10}.p{i%10}": torch.randn(4)}``): the read limit (the checkpoint's tensor bytes
read from the page cache with ``os.readv`` into one preallocated buffer, as bench_io.py's
``limit read``), dcpx.load's first load and loads 2..N, torch DCP's load (``--torch-repeat``
times), each verified against the source.  Per-tensor overhead = (load - read limit) / tensors.
Loads run alternately with the read limit, so that both see the same machine load.

    PYTHONPATH=$PWD python benchmarks/bench_load.py [--which small|tiny|both] [--repeat 7]
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_io import make_small  # noqa: E402  (its 20,000-tensor mix)

CHUNK = 64 << 20


def make_tiny(count=100000):
    return {f"layer{i // 10}.p{i % 10}": torch.randn(4) for i in range(count)}


def limit_files(path, nbytes):
    """[(data file, bytes)] for read_limit: as many bytes as the tensors hold, spread over the
    checkpoint's data files in proportion to their sizes."""
    datafiles = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp"))
    sizes = [os.path.getsize(f) for f in datafiles]
    total, files, left = sum(sizes), [], nbytes
    for f, s in zip(datafiles, sizes):
        n = min(left, s * nbytes // total + 1)
        files.append((f, n))
        left -= n
    return files


def read_limit(files, buf):
    """The checkpoint's tensor bytes' worth of each data file, read into buf."""
    mv, off = memoryview(buf.numpy()).cast("B"), 0
    for path, n in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < n:
                got = os.readv(fd, [mv[off + done:off + min(n, done + CHUNK)]])
                if got == 0:
                    break
                done += got
        finally:
            os.close(fd)
        off += n


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(name, sd, args, workdir):
    import dcpx
    import torch.distributed.checkpoint as tdcp
    path = os.path.join(workdir, name)
    dcpx.save(sd, checkpoint_id=path)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    files = limit_files(path, nbytes)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    limit, loads = [], []
    read_limit(files, buf)  # warm the page cache
    for i in range(args.repeat):
        limit.append(timed(lambda: read_limit(files, buf)))
        for t in dst.values():
            t.zero_()
        loads.append(timed(lambda: dcpx.load(dst, checkpoint_id=path)))
    bad = [k for k in sd if not torch.equal(sd[k], dst[k])]
    if bad:
        sys.exit(f"{name}: dcpx load differs at {bad[:3]}")
    torch_t = []
    for _ in range(args.torch_repeat):
        for t in dst.values():
            t.zero_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch_t.append(timed(lambda: tdcp.load(dst, checkpoint_id=path, no_dist=True)))
        if not all(torch.equal(sd[k], dst[k]) for k in sd):
            sys.exit(f"{name}: torch load differs")
    lim, later = statistics.median(limit), statistics.median(loads[1:] or loads)
    n = len(sd)
    print(f"({name}) {n} tensors, {nbytes / 2**20:.1f} MiB, {sum(os.path.getsize(f) for f, _ in files) / 2**20:.1f} MiB of data files")
    print(f"  read limit             median {lim:.4f} s   ({nbytes / lim / 1e9:.2f} GB/s)")
    print(f"  dcpx load, first       {loads[0]:.4f} s")
    print(f"  dcpx load, 2..N        median {later:.4f} s  min {min(loads[1:] or loads):.4f} s"
          f"   -> {lim / later:.2f}x the read limit, "
          f"{(later - lim) / n * 1e6:.2f} us per tensor above it")
    if torch_t:
        tm = statistics.median(torch_t)
        print(f"  torch DCP load         median {tm:.3f} s  -> dcpx 2..N is {tm / later:.1f}x faster")
    print(f"  all dcpx loads: {' '.join(f'{t:.4f}' for t in loads)}")
    print(f"  all limit reads: {' '.join(f'{t:.4f}' for t in limit)}")
    sys.stdout.flush()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--which", choices=["small", "tiny", "both"], default="both")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--torch-repeat", type=int, default=1)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; torch {torch.__version__}")
    workdir = tempfile.mkdtemp(prefix="dcpx-bench-load-", dir=args.dir)
    try:
        if args.which in ("small", "both"):
            run("small", make_small(20000), args, workdir)
        if args.which in ("tiny", "both"):
            run("tiny", make_tiny(), args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
