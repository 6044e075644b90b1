#!/usr/bin/env python3
"""Per-tensor costs of async_save with a stager: the parts issue 12 asks about, for
bench_async.py's 20,000 small tensors (143 MiB), printed (no result file).

    PYTHONPATH=$PWD python benchmarks/bench_staged.py [--which check,metadata,saves] [--repeat N]

* check:    CPU time of ``_C.stage_plain`` checking every tensor with nothing to copy (the
            per-tensor check of a reused layout), min and median of 40 calls.
* metadata: encoding + decoding one save's Metadata as the checkpoint process's reply: pickle
            (multiprocessing's ForkingPickler, the old reply, decoded with the collector on)
            against dcpx's .metadata bytes (decoded with it paused), each decoded both ways.
* saves:    per save, wall and CPU (``time.process_time``, every thread of this process) from the
            call to staging complete and from there to upload complete; a sync and an async
            DefaultStager (THREAD), then a sync one with AsyncCheckpointerType.PROCESS (its
            checkpoint process's CPU is not counted); a warm memcpy of the same bytes first.

Run it for two trees alternately (PYTHONPATH=<tree>) to compare them; on a shared machine, trust
CPU times and minima over wall medians.
"""
import argparse
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_async import make_small, stamp  # noqa: E402

import dcpx  # noqa: E402

perf = time.perf_counter


def ms(xs):
    return f"{min(xs) * 1e3:7.1f} / {statistics.median(xs) * 1e3:7.1f}"


def check(sd, repeat):
    from dcpx import _C, staging
    with dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=False)) as st:
        st.stage(sd)
        lay = st._layout
        values = list(sd.values())
        entries = tuple(e[:5] + (0, 0) + e[7:] for e in lay.plain)  # nothing to copy
        cpu = []
        for _ in range(max(repeat, 40)):
            c0 = time.process_time()
            assert _C.stage_plain(values, entries, lay.buffer.base,
                                  threads=staging._copy_threads())
            cpu.append(time.process_time() - c0)
    print(f"check: stage_plain CPU min / median {ms(cpu)} ms = "
          f"{min(cpu) / len(sd) * 1e9:.0f} ns per tensor (min)")


def metadata(sd, repeat):
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from dcpx.formats import metadata as _metadata
    from dcpx.coordination.gcpause import paused_gc
    d = tempfile.mkdtemp()
    try:
        md = dcpx.save(sd, checkpoint_id=d)
    finally:
        shutil.rmtree(d)
    for name, enc, dec in (("pickle (ForkingPickler)", lambda: ForkingPickler.dumps(md),
                            pickle.loads),
                           (".metadata bytes (dcpx)", lambda: _metadata.dumps(md),
                            lambda b: _metadata.loads(b, "reply"))):
        e, t, tp = [], [], []
        for _ in range(repeat):
            t0 = perf()
            b = enc()
            e.append(perf() - t0)
            t0 = perf()
            dec(b)
            t.append(perf() - t0)
            with paused_gc():
                t0 = perf()
                dec(b)
                tp.append(perf() - t0)
        print(f"metadata reply, {name}: encode {ms(e)} ms, decode {ms(t)} ms, with the "
              f"collector paused {ms(tp)} ms (min / median), {len(b) / 1e6:.2f} MB")


def saves(sd, repeat):
    n = sum(t.numel() * t.element_size() for t in sd.values())
    flat = torch.cat([t.reshape(-1) for t in sd.values()])
    dst = torch.empty_like(flat)
    dst.copy_(flat)
    mc = []
    for _ in range(repeat):
        t0 = perf()
        ctypes.memmove(dst.data_ptr(), flat.data_ptr(), n)
        mc.append(perf() - t0)
    del dst, flat
    print(f"memcpy of the same bytes: {ms(mc)} ms (min / median)")
    base = tempfile.mkdtemp()
    thread, process = dcpx.AsyncCheckpointerType.THREAD, dcpx.AsyncCheckpointerType.PROCESS
    try:
        for name, async_staging, kind in (("sync stager, THREAD", False, thread),
                                          ("async stager, THREAD", True, thread),
                                          ("sync stager, PROCESS", False, process)):
            sw, sc, uw, uc = [], [], [], []
            with dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=async_staging)) as st:
                for i in range(repeat + 1):
                    path = os.path.join(base, f"c{i}")
                    stamp(sd, float(i))
                    os.sync()
                    c0, t0 = time.process_time(), perf()
                    r = dcpx.async_save(sd, checkpoint_id=path, async_stager=st,
                                        async_checkpointer_type=kind)
                    if hasattr(r, "staging_completion"):
                        r.staging_completion.result()
                        r = r.upload_completion
                    c1, t1 = time.process_time(), perf()
                    r.result()
                    c2, t2 = time.process_time(), perf()
                    if i:  # saves 2..N
                        sw.append(t1 - t0)
                        sc.append(c1 - c0)
                        uw.append(t2 - t1)
                        uc.append(c2 - c1)
                    shutil.rmtree(path)
            print(f"{name:22s} staging wall {ms(sw)}  CPU {ms(sc)} ms | upload wall {ms(uw)}  "
                  f"CPU {ms(uc)} ms   (min / median of {repeat})")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--which", default="check,metadata,saves")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--count", type=int, default=20000)
    args = ap.parse_args()
    sd = make_small(args.count)
    print(f"dcpx from {os.path.dirname(os.path.abspath(dcpx.__file__))}; {len(sd)} tensors; "
          f"load average {os.getloadavg()[0]:.1f}")
    for part in args.which.split(","):
        {"check": check, "metadata": metadata, "saves": saves}[part](sd, args.repeat)


if __name__ == "__main__":
    main()
