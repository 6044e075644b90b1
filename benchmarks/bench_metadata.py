"""Reading a many-tensor checkpoint's .metadata with the cyclic garbage
collector on, and paused as dcpx pauses it (dcpx/coordination/gcpause.py; docs/design.md,
"Why the cyclic GC is paused"); and writing it, with the C encoder
(csrc/mdpickle.c) and with Python's pickler.

Saves a state dict of COUNT small tensors (bench_io.py's "small" case), then
times dcpx's safe metadata reader (``dcpx.formats.metadata.loads``: CRC, opcode
scan, allow-list unpickling, validation) on the bytes in memory, REPEAT
times each way, alternating, with the state dict alive (as in a training
process, whose model and optimizer the collector's full passes also scan).

    PYTHONPATH=$PWD python benchmarks/bench_metadata.py [--count 20000] [--repeat 7]

Prints the medians and their ratio.  On a shared machine, compare the ratio
rather than the absolute times.
"""
import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import dcpx  # noqa: E402
from dcpx import _C  # noqa: E402
from dcpx.formats import metadata as _metadata
from dcpx.coordination.gcpause import paused_gc  # noqa: E402

from bench_io import make_small  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--tiny", action="store_true",
                   help="COUNT tensors of 4 elements (issue 12's 100,000-tensor case)")
    args = p.parse_args(argv)

    if args.tiny:
        sd = {f"l{i // 10}.p{i % 10}": torch.randn(4) for i in range(args.count)}
    else:
        sd = make_small(args.count)
    with tempfile.TemporaryDirectory() as d:
        saved = dcpx.save(sd, checkpoint_id=d)
        path = os.path.join(d, _metadata.METADATA_FN)
        with open(path, "rb") as f:
            data = f.read()

    assert gc.isenabled()
    times = {"gc on": [], "gc paused": []}
    for _ in range(args.repeat):
        for mode in times:
            t0 = time.perf_counter()
            if mode == "gc on":
                md = _metadata.loads(data, path)
            else:
                with paused_gc():
                    md = _metadata.loads(data, path)
            times[mode].append(time.perf_counter() - t0)
            assert len(md.state_dict_metadata) == args.count
            del md
    on, off = (statistics.median(times[m]) for m in ("gc on", "gc paused"))
    print(f".metadata of {args.count} tensors: {len(data)} bytes, "
          f"median of {args.repeat}, loadavg {os.getloadavg()[0]:.1f}")
    print(f"  gc on:     {on:.3f} s  (min {min(times['gc on']):.3f})")
    print(f"  gc paused: {off:.3f} s  (min {min(times['gc paused']):.3f})")
    print(f"  ratio:     {on / off:.1f}x")

    def python_dumps(md):  # _metadata.dumps before csrc/mdpickle.c
        body = _metadata._python_body(md)
        return body + _metadata._TRAILER.pack(_metadata._TRAILER_MAGIC, _C.crc32(body),
                                              len(body))

    assert _metadata._c_body(saved) is not None
    writes = {"C encoder": [], "pickle": []}
    sizes = {}
    for _ in range(args.repeat):
        for mode, fn in (("C encoder", _metadata.dumps), ("pickle", python_dumps)):
            with paused_gc():
                t0 = time.perf_counter()
                out = fn(saved)
                writes[mode].append(time.perf_counter() - t0)
            sizes[mode] = len(out)
            del out
    c, py = (statistics.median(writes[m]) for m in ("C encoder", "pickle"))
    print(f"  write, C encoder: {c:.3f} s  (min {min(writes['C encoder']):.3f}, "
          f"{sizes['C encoder']} bytes)")
    print(f"  write, pickle:    {py:.3f} s  (min {min(writes['pickle']):.3f}, "
          f"{sizes['pickle']} bytes)")
    print(f"  write speed-up:   {py / c:.1f}x")


if __name__ == "__main__":
    main()
