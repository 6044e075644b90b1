"""Micro-measurements behind figures quoted in docs/design.md:

* CRC-32 throughput of ``dcpx._C.crc32`` on one core (its implementation,
  e.g. ``pclmulqdq``), against ``zlib.crc32`` on the same bytes;
* the per-tensor cost of ``dcpx._dtypes.dlpack_export`` (torch's C DLPack
  exporter, called directly) against ``Tensor.__dlpack__()``.

    PYTHONPATH=$PWD python benchmarks/bench_micro.py [--mib 256] [--repeat 7]

Prints medians.  On a shared machine, compare the ratios.
"""
import argparse
import os
import statistics
import time
import zlib

import torch

from dcpx import _C
from dcpx._dtypes import dlpack_export


def _median(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--calls", type=int, default=100_000)
    args = p.parse_args(argv)
    print(f"loadavg {os.getloadavg()[0]:.1f}, median of {args.repeat}")

    buf = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8).numpy().tobytes()
    assert _C.crc32(buf) == zlib.crc32(buf)
    t_dcpx = _median(lambda: _C.crc32(buf), args.repeat)
    t_zlib = _median(lambda: zlib.crc32(buf), args.repeat)
    gbs = len(buf) / t_dcpx / 1e9
    print(f"crc32 ({_C.crc32_impl}), {args.mib} MiB, one core: {gbs:.1f} GB/s "
          f"(zlib.crc32 {len(buf) / t_zlib / 1e9:.1f} GB/s, {t_zlib / t_dcpx:.1f}x)")

    t = torch.ones(16)
    n = args.calls

    def export():
        for _ in range(n):
            dlpack_export(t)

    def dunder():
        for _ in range(n):
            t.__dlpack__()

    e = _median(export, args.repeat) / n * 1e6
    d = _median(dunder, args.repeat) / n * 1e6
    print(f"per tensor: dlpack_export {e:.2f} us, Tensor.__dlpack__() {d:.2f} us ({d / e:.1f}x)")


if __name__ == "__main__":
    main()
