"""The load index (dcpx/formats/loadindex.py, issue 28 item 4): what it costs rank 0
to build at commit, and what one rank reads and computes to find its chunks, against
reading and decoding the whole ``.metadata`` as a load does today.

Synthetic FSDP2 metadata, as a save's commit builds it: T tensors of shape [4R, 256]
(bf16), each sharded along dim 0 over all R ranks (R chunks a tensor), the storage
entries in rank order with their position hints (``MetadataIndex.index``), one data file
per rank, a non-tensor value ``step``.  Sizes interned as dcpx's planner interns them.

Build (rank 0, at commit; the cyclic GC paused, as dcpx's commit runs): CPU time per chunk
of ``build_body`` and ``header`` (the body's CRC-32), beside the C encoder of the same
``.metadata`` (``formats.metadata.dumps``, which the commit runs anyway) in the same run;
also the same metadata without position hints (the join by (fqn, offsets)) and one of
single-chunk keys (per-key cost).

Load (one rank, R//2 + 1, a fresh ``LoadIndex`` each time, the page cache warm): bytes
read and CPU time to open the index and look up the rank's region of every key, against
today's path: read ``.metadata`` whole, decode it with the C decoder
(``formats.metadata.index``) and look the same regions up (``_C.md_index_region``).

    PYTHONPATH=$PWD python benchmarks/bench_loadindex.py [--out benchmarks/results/loadindex_local.md]
        [--quick]   # the small cases only
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import tempfile
import time

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcpx import _C
from dcpx.formats import loadindex as li, metadata as _metadata

ARGS = (ChunkStorageMetadata, torch.Size, _StorageInfo)


def fsdp(ranks: int, tensors: int, hints: bool = True, rows: int = 4) -> Metadata:
    props = TensorProperties(dtype=torch.bfloat16)
    size = torch.Size([rows * ranks, 256])
    sz = torch.Size([rows, 256])
    offs = [torch.Size([rows * r, 0]) for r in range(ranks)]
    sdm: dict = {}
    for t in range(tensors):
        fqn = f"model.layers.{t // 9}.block.w{t % 9}.exp_avg"
        sdm[fqn] = TensorStorageMetadata(props, size, [ChunkStorageMetadata(o, sz) for o in offs])
    storage: dict = {}
    nbytes = 2 * rows * 256
    for r in range(ranks):
        name = f"__{r}_0123456789abcdef_0.distcp"
        for t, fqn in enumerate(sdm):
            storage[MetadataIndex(fqn, offs[r], r if hints else None)] = _StorageInfo(
                name, 64 * ((nbytes + 63) // 64) * t, nbytes)
    sdm["step"] = BytesStorageMetadata()
    storage[MetadataIndex("step")] = _StorageInfo("__0_0123456789abcdef_0.distcp", 0, 5)
    return Metadata(sdm, storage_data=storage)


def single_chunk_keys(n: int) -> Metadata:
    props = TensorProperties(dtype=torch.float32)
    size = torch.Size([4])
    zero = torch.Size([0])
    sdm, storage = {}, {}
    for i in range(n):
        fqn = f"l{i // 10}.p{i % 10}"
        sdm[fqn] = TensorStorageMetadata(props, size, [ChunkStorageMetadata(zero, size)])
        storage[MetadataIndex(fqn, zero, 0)] = _StorageInfo("__0_0123456789abcdef_0.distcp",
                                                            64 * i, 16)
    return Metadata(sdm, storage_data=storage)


def cpu(fn, repeat: int) -> tuple:
    """(best CPU seconds, last result), the cyclic GC paused."""
    best, out = None, None
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeat):
            t0 = time.process_time()
            out = fn()
            t = time.process_time() - t0
            best = t if best is None else min(best, t)
    finally:
        gc.enable()
    return best, out


def build_row(label: str, md: Metadata, chunks: int, repeat: int) -> dict:
    t_body, body = cpu(lambda: li.build_body(md), repeat)
    assert body is not None
    t_hdr, _ = cpu(lambda: li.header(body, 0, 0), repeat)
    t_dumps, raw = cpu(lambda: _metadata.dumps(md), repeat)
    return {"case": label, "chunks": chunks, "body_ns": 1e9 * t_body / chunks,
            "header_ns": 1e9 * t_hdr / chunks, "dumps_ns": 1e9 * t_dumps / chunks,
            "index_bytes": li.HEADER_LEN + len(body), "metadata_bytes": len(raw)}


def load_row(ranks: int, tensors: int, workdir: str, repeat: int) -> dict:
    md = fsdp(ranks, tensors)
    d = os.path.join(workdir, f"r{ranks}_t{tensors}")
    os.makedirs(d, exist_ok=True)
    raw = _metadata.dumps(md)
    with open(os.path.join(d, ".metadata"), "wb") as f:
        f.write(raw)
    body = li.build_body(md)
    _, crc, n = _metadata._TRAILER.unpack(raw[-20:])
    with open(os.path.join(d, li.INDEX_FN), "wb") as f:
        f.write(li.header(body, crc, n) + body)
    r = ranks // 2 + 1
    regions = {fqn: (None if fqn == "step" else ((4 * r, 0), (4, 256)))
               for fqn in md.state_dict_metadata}
    del md

    def by_index():
        with li.LoadIndex.open(d) as ix:
            got = [ix.region(fqn, reg) for fqn, reg in regions.items()]
            return ix.bytes_read, got

    def today():
        with open(os.path.join(d, ".metadata"), "rb") as f:
            data = f.read()
        index, _ = _metadata.index(data, d)
        return len(data), [_C.md_index_region(index, fqn, reg, *ARGS)
                           for fqn, reg in regions.items()]

    t_ix, (b_ix, got_ix) = cpu(by_index, repeat)
    t_md, (b_md, got_md) = cpu(today, repeat)
    assert got_ix == got_md
    return {"ranks": ranks, "tensors": tensors, "ix_bytes": b_ix, "ix_ms": 1e3 * t_ix,
            "md_bytes": b_md, "md_ms": 1e3 * t_md}


def _x(r: float) -> str:
    return f"{r:.2f}x" if r < 10 else f"{r:.0f}x"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)

    load0 = os.getloadavg()
    builds = []
    cases = [(16384, 6)] if args.quick else [(16384, 6), (16384, 61), (4096, 244), (1000, 1000)]
    for R, T in cases:
        builds.append(build_row(f"FSDP2 {R} ranks x {T} tensors", fsdp(R, T), R * T, args.repeat))
        print(builds[-1], flush=True)
        gc.collect()
    builds.append(build_row("FSDP2 16384 x 6, no position hints", fsdp(16384, 6, hints=False),
                            16384 * 6, args.repeat))
    print(builds[-1], flush=True)
    n = 20000 if args.quick else 100000
    builds.append(build_row(f"{n:,} single-chunk keys", single_chunk_keys(n), n, args.repeat))
    print(builds[-1], flush=True)

    loads = []
    with tempfile.TemporaryDirectory() as work:
        for R, T in ([(64, 6), (1024, 6), (16384, 6)] if args.quick else
                     [(64, 6), (256, 6), (1024, 6), (4096, 6), (16384, 6), (64, 24),
                      (16384, 24), (16384, 61)]):
            loads.append(load_row(R, T, work, max(args.repeat, 5)))
            print(loads[-1], flush=True)
            gc.collect()
    load1 = os.getloadavg()

    lines = ["# The load index: build cost at commit, bytes and CPU per rank at load", "",
             "`PYTHONPATH=$PWD python benchmarks/bench_loadindex.py"
             + (" --quick" if args.quick else "") + (f" --out {args.out}" if args.out else "")
             + "`", "",
             f"{time.strftime('%Y-%m-%d %H:%M')}; {platform.node()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}, torch {torch.__version__}; load average "
             f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end (CPU times: "
             f"`time.process_time`, best of {args.repeat}+; other processes share the cores).",
             "", "## Build (rank 0, at commit; cyclic GC paused)", "",
             "| metadata | chunks | build_body ns/chunk | header ns/chunk | C encoder of .metadata "
             "ns/chunk | build_body / C encoder | index | .metadata |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for b in builds:
        lines.append(f"| {b['case']} | {b['chunks']:,} | {b['body_ns']:.0f} | "
                     f"{b['header_ns']:.0f} | {b['dumps_ns']:.0f} | "
                     f"{b['body_ns'] / b['dumps_ns']:.2f}x | {_mb(b['index_bytes'])} | "
                     f"{_mb(b['metadata_bytes'])} |")
    lines += ["", "## Load (rank R/2+1 finds its chunk of every key; a fresh open each time)",
              "",
              "| ranks | tensors | chunks | index: bytes read | index: CPU | today: bytes read "
              "(.metadata) | today: CPU (read + C decode + lookups) | bytes today / index | "
              "CPU today / index |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in loads:
        lines.append(f"| {r['ranks']:,} | {r['tensors']} | {r['ranks'] * r['tensors']:,} | "
                     f"{_mb(r['ix_bytes'])} | {r['ix_ms']:.2f} ms | {_mb(r['md_bytes'])} | "
                     f"{r['md_ms']:.2f} ms | {_x(r['md_bytes'] / r['ix_bytes'])} | "
                     f"{_x(r['md_ms'] / r['ix_ms'])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
