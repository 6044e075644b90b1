#!/usr/bin/env python3
"""Floors for issue 12's two per-tensor targets that are not met: what any staging or load of
20,000 small tensors must spend on this machine, measured in the same run as the limits
the targets are relative to, next to what dcpx spends now.

Staging (bench_async.py's 20,000-tensor mix; target: <= 2.0x one warm memcpy):
  memcpy          one memcpy of all the bytes between two flat buffers (bench_async's limit)
  checks          dcpx's own check of every tensor against the staged layout, from C
                  (csrc/stage.c, _C.stage_plain with each entry's byte count set to 0, so
                  that nothing is copied): per tensor the torch getters dtype,
                  requires_grad, is_cpu, shape and the methods is_contiguous(), is_neg(),
                  data_ptr(), called through their descriptors with the GIL held.  Any
                  staging must learn at least this of every tensor, every time.
  checks during copy  `checks` while another thread runs `memcpy` in a loop (the two cores
                  busy at once, as in a staging that overlaps its checks with its copy)
Load (bench_io.py's 20,000-tensor mix, a checkpoint dcpx saved; target: >= 0.6x the read limit):
  read limit      the checkpoint's tensor bytes read from the warm page cache into one buffer
  crc32           dcpx's CRC-32 of the same bytes (one thread): a load checks every byte
  dest checks     `checks` on the destination tensors (a load needs all of them but
                  requires_grad: device, dtype, shape, contiguity, neg bit, data pointer)
  flatten         dcpx's flattening of the destination state dict (C, csrc/flatten.c)
  decode          dcpx's decoding of the .metadata into load tables (C, csrc/mdindex.c)
Each is the median of --repeat runs, every run after the CPU caches were filled with other
data (a 256 MiB buffer written), as after a training step.  Lower bounds on this machine:
the GIL-bound steps (checks, flatten) run on one thread, the byte-bound ones may split over
all cores: floor = max(GIL-bound, everything / cores), taking a copy of 20,000 separate
tensors to be as fast as one memcpy of their bytes (it is slower); `checks during copy`
shows how far the machine is from that ideal overlap.

    PYTHONPATH=$PWD python benchmarks/bench_floor.py --out benchmarks/results/floor_local
"""
import argparse
import ctypes
import gc
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_async  # noqa: E402
import bench_io  # noqa: E402
from bench_load import limit_files, read_limit  # noqa: E402

import dcpx  # noqa: E402
from dcpx import _C  # noqa: E402
from dcpx.coordination import readplan as _readplan
from dcpx.formats import metadata as _metadata

_SCRUB = torch.empty(256 << 20, dtype=torch.uint8)


def scrub():
    _SCRUB.add_(1)  # every cache line of 256 MiB written: the state dict's lines are gone


def med(fn, repeat, setup=None):
    out = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        scrub()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def zero_byte_checks(sd):
    """(stager, checks): a sync DefaultStager that staged sd, and a function that checks sd's
    tensors as that stager checks them (_C.stage_plain) and copies nothing."""
    stager = dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=False))
    stager.stage(sd)
    layout = stager._layout
    values, base = list(sd.values()), layout.buffer.base
    entries = tuple(e[:6] + (0,) + e[7:] for e in layout.plain)

    def checks():
        if not _C.stage_plain(values, entries, base, threads=1):
            raise SystemExit("bench_floor: the checks did not pass")
    return stager, checks


def during(copy, checks, repeat):
    """Median time of checks() while another thread runs copy() in a loop."""
    out = []
    for _ in range(repeat):
        scrub()
        stop, started = threading.Event(), threading.Event()

        def run():
            started.set()
            while not stop.is_set():
                copy()  # ctypes.memmove runs without the GIL
        th = threading.Thread(target=run)
        th.start()
        started.wait()
        time.sleep(0.002)
        t = time.perf_counter()
        checks()
        out.append(time.perf_counter() - t)
        stop.set()
        th.join()
    return statistics.median(out)


def staging(repeat, count):
    sd = bench_async.make_small(count)
    vals = list(sd.values())
    n = bench_async.nbytes(sd)
    flat = torch.cat([t.reshape(-1) for t in vals])
    dst = torch.empty_like(flat)
    dst.copy_(flat)
    r = {"tensors": len(vals), "bytes": n}
    memcpy = lambda: ctypes.memmove(dst.data_ptr(), flat.data_ptr(), n)  # noqa: E731
    r["memcpy"] = med(memcpy, repeat)
    stager, checks = zero_byte_checks(sd)
    r["checks"] = med(checks, repeat)
    r["checks during copy"] = during(memcpy, checks, repeat)
    r["dcpx stage (sync DefaultStager)"] = med(lambda: stager.stage(sd), repeat)
    stager.close()
    cores = os.cpu_count() or 1
    r["floor"] = max(r["checks"], (r["checks"] + r["memcpy"]) / cores)
    r["floor as measured"] = max(r["checks during copy"], r["memcpy"])
    return r


def load(repeat, count, workdir):
    sd = bench_io.make_small(count)
    dst = bench_io.empty_like_sd(sd)
    vals = list(dst.values())
    n = bench_io.nbytes(sd)
    path = os.path.join(workdir, "ck")
    dcpx.save(sd, checkpoint_id=path)
    files = limit_files(path, n)
    buf = torch.empty(n, dtype=torch.uint8)
    raw = open(os.path.join(path, ".metadata"), "rb").read()
    r = {"tensors": len(vals), "bytes": n}
    r["read limit"] = med(lambda: read_limit(files, buf), repeat)
    r["crc32"] = med(lambda: _C.crc32(buf.numpy()), repeat)
    stager, checks = zero_byte_checks(dst)
    r["dest checks"] = med(checks, repeat)
    stager.close()
    r["flatten"] = med(lambda: _C.flatten_state_dict(dst), repeat)
    r["decode"] = med(lambda: _metadata.index(raw, path), repeat)
    dcpx.load(dst, checkpoint_id=path)
    r["dcpx load (fresh: read-plan cache cleared)"] = med(
        lambda: dcpx.load(dst, checkpoint_id=path), repeat, setup=_readplan.clear)
    exact = all(torch.equal(sd[k], dst[k]) for k in sd)
    if not exact:
        raise SystemExit("bench_floor: dcpx.load did not load the saved values")
    cores = os.cpu_count() or 1
    gil = r["dest checks"] + r["flatten"]
    every = r["read limit"] + r["crc32"] + gil
    r["floor"] = max(gil, every / cores)
    r["floor with decode"] = max(gil + r["decode"], (every + r["decode"]) / cores)
    return r


def report(st, ld, meta):
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    out = ["# Floors of issue 12's unmet per-tensor targets", "",
           f"`{' '.join(shlex.quote(a) for a in ['python', 'benchmarks/bench_floor.py'] + sys.argv[1:])}`",
           "", "| machine / setting | value |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in meta.items()]
    lim = st["memcpy"]
    out += ["", f"## Staging: {st['tensors']} tensors, {st['bytes'] / 2**20:.1f} MiB "
            "(target: <= 2.0x one warm memcpy)", "",
            "| step | median ms | / memcpy |", "|---|---|---|"]
    for k in ("memcpy", "checks", "checks during copy", "floor",
              "floor as measured", "dcpx stage (sync DefaultStager)"):
        out.append(f"| {k} | {ms(st[k])} | {st[k] / lim:.2f}x |")
    lim = ld["read limit"]
    out += ["", f"## Load: {ld['tensors']} tensors, {ld['bytes'] / 2**20:.1f} MiB "
            "(target: >= 0.6x the read limit, i.e. at most "
            f"{ms(lim / 0.6)} ms here)", "",
            "| step | median ms | read limit / this |", "|---|---|---|"]
    for k in ("read limit", "crc32", "dest checks", "flatten", "decode", "floor",
              "floor with decode", "dcpx load (fresh: read-plan cache cleared)"):
        out.append(f"| {k} | {ms(ld[k])} | {lim / ld[k]:.2f}x |")
    out += ["", "floor = max(GIL-bound steps, all steps / cores): the checks and flatten hold the "
            "GIL (one thread); copies, reads and CRCs split over the cores (a copy of 20,000 "
            "separate tensors taken as fast as one memcpy of their bytes, which it is not).  "
            "`floor as measured`: the checks as slowed by a copy on the other core, or the copy, "
            "whichever is longer.  `decode` is dcpx's present decoder, not a floor."]
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--out", help="path stem of the .json/.md results")
    args = p.parse_args()
    gc.disable()  # no collection inside the timed loops (dcpx pauses it too: dcpx/coordination/gcpause.py)
    workdir = tempfile.mkdtemp(prefix="dcpx-floor-", dir=args.dir)
    try:
        meta = bench_io.machine_info(workdir, dcpx, None)
        meta["loadavg_start"] = os.getloadavg()
        st = staging(args.repeat, args.tensors)
        ld = load(args.repeat, args.tensors, workdir)
        meta["loadavg_end"] = os.getloadavg()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = report(st, ld, meta)
    print(text)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "staging": st, "load": ld}, f, indent=1, default=str)
        with open(args.out + ".md", "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
