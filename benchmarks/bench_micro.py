"""Micro-measurements behind figures quoted in docs/design.md:

* CRC-32 throughput of ``dcpx._C.crc32`` on one core (its implementation,
  e.g. ``pclmulqdq``), against ``zlib.crc32`` on the same bytes;
* the per-tensor cost of ``dcpx.formats.dtypes.dlpack_export`` (torch's C DLPack
  exporter, called directly) against ``Tensor.__dlpack__()``;
* the per-entry cost of flattening a state dict: ``dcpx.coordination.flatten``'s C walk
  against torch's ``flatten_state_dict``, on a flat model-like OrderedDict
  and a nested optimizer-like dict of 20,000 and 100,000 entries (the
  collector paused, as dcpx pauses it around the walk; CPU time).

    PYTHONPATH=$PWD python benchmarks/bench_micro.py [--mib 256] [--repeat 7]
        [--which all|crc|dlpack|flatten] [--entries 20000 100000]

Prints medians.  On a shared machine, compare the ratios.
"""
import argparse
import gc
import os
import statistics
import time
import zlib

import torch

from torch.distributed.checkpoint._nested_dict import flatten_state_dict as torch_flatten

from dcpx import _C
from dcpx.formats.dtypes import dlpack_export
from dcpx.coordination.flatten import flatten_state_dict


def _median(fn, repeat, clock=time.perf_counter):
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _model_like(n):
    """model.state_dict(): an OrderedDict of n tensors, keys with dots."""
    from collections import OrderedDict
    return {"model": OrderedDict((f"layers.{i // 4}.sub.{i % 4}.weight", torch.empty(1))
                                 for i in range(n))}


def _optim_like(n):
    """An Adam state dict of n tensors: state keyed by int param id, three
    tensors each, one param group listing the ids."""
    p = n // 3
    return {"optim": {
        "state": {i: {"step": torch.empty(()), "exp_avg": torch.empty(1),
                      "exp_avg_sq": torch.empty(1)} for i in range(p)},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(p))}]}}


def bench_flatten(entries, repeat):
    for n in entries:
        for name, make in (("flat model-like", _model_like), ("nested optim-like", _optim_like)):
            sd = make(n)
            assert flatten_state_dict(sd) == torch_flatten(sd)
            k = len(flatten_state_dict(sd)[0])
            gc.disable()
            try:
                # CPU time: one thread, and on a shared machine wall time
                # mostly says how long it waited for a core
                t_torch = _median(lambda: torch_flatten(sd), repeat, time.process_time) / k * 1e6
                t_dcpx = _median(lambda: flatten_state_dict(sd), repeat, time.process_time) / k * 1e6
            finally:
                gc.enable()
            print(f"flatten {name}, {k} entries: torch {t_torch:.3f} us/entry, "
                  f"dcpx {t_dcpx:.3f} us/entry ({t_torch / t_dcpx:.1f}x)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--which", choices=["all", "crc", "dlpack", "flatten"], default="all")
    p.add_argument("--entries", type=int, nargs="+", default=[20_000, 100_000])
    args = p.parse_args(argv)
    print(f"loadavg {os.getloadavg()[0]:.1f}, median of {args.repeat}")
    if args.which in ("all", "crc"):
        bench_crc(args)
    if args.which in ("all", "dlpack"):
        bench_dlpack(args)
    if args.which in ("all", "flatten"):
        bench_flatten(args.entries, args.repeat)


def bench_crc(args):

    buf = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8).numpy().tobytes()
    assert _C.crc32(buf) == zlib.crc32(buf)
    t_dcpx = _median(lambda: _C.crc32(buf), args.repeat)
    t_zlib = _median(lambda: zlib.crc32(buf), args.repeat)
    gbs = len(buf) / t_dcpx / 1e9
    print(f"crc32 ({_C.crc32_impl}), {args.mib} MiB, one core: {gbs:.1f} GB/s "
          f"(zlib.crc32 {len(buf) / t_zlib / 1e9:.1f} GB/s, {t_zlib / t_dcpx:.1f}x)")


def bench_dlpack(args):
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
