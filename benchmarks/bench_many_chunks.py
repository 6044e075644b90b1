"""A ``.metadata`` whose one key has many chunks (issue 21: 40,000 chunks
took 18.9 s to ``dcpx.load``, 160,000 took 161 s, where torch's
``pickle.loads`` of the same file took 11 s): decode time per chunk, and a
whole ``dcpx.load`` per chunk, against torch's unpickling of the same file
(``pickle.loads``, what ``torch.distributed.checkpoint`` does with it).

The checkpoint: key ``w`` of N float32 elements saved as N one-element
chunks, every chunk's storage entry pointing at the same 4-byte record (a
crafted file: a save writes one record per chunk, which changes nothing in
the decoding).

    PYTHONPATH=$PWD python benchmarks/bench_many_chunks.py [--chunks 10000 40000 160000]
        [--repeat 3] [--load] [--out benchmarks/results/many_chunks_local.md]

Prints, per N: dcpx's metadata decode (``dcpx.formats.metadata.loads``, what a load
runs; and the C index ``_metadata.index`` when it takes the file), torch's
``pickle.loads``, and with ``--load`` a whole ``dcpx.load`` (decode, checks,
read planning, reads); medians of ``--repeat``, in CPU seconds of the
process (``time.process_time``: the machine this was measured on is shared).  (torch's ``dcp.load`` of
this file is not timed: it ``torch.load``s the one shared record once per
chunk, 87 s at 20,000 chunks here, which measures nothing about decoding.)
"""
import argparse
import gc
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

import dcpx
from dcpx.formats import metadata as _metadata
from dcpx.coordination import readplan as _readplan


def make(path: Path, n: int) -> None:
    """The crafted checkpoint of ``n`` one-element chunks at ``path``."""
    one = path.parent / f"_one_{n}"
    dcpx.save({"p": torch.ones(1)}, checkpoint_id=one)
    md = pickle.loads((one / _metadata.METADATA_FN).read_bytes())
    (info,) = md.storage_data.values()
    path.mkdir()
    os.rename(one / info.relative_path, path / info.relative_path)
    props = md.state_dict_metadata["p"].properties
    chunks, storage = [], {}
    for i in range(n):
        ch = ChunkStorageMetadata(offsets=torch.Size([i]), sizes=torch.Size([1]))
        chunks.append(ch)
        storage[MetadataIndex("w", ch.offsets)] = info
    out = Metadata(state_dict_metadata={"w": TensorStorageMetadata(props, torch.Size([n]), chunks)},
                   storage_data=storage)
    (path / _metadata.METADATA_FN).write_bytes(pickle.dumps(out))
    for f in one.iterdir():
        f.unlink()
    one.rmdir()


def timed(fn, repeat: int) -> float:
    """Median CPU seconds of this process (all its threads) per call: on a
    shared, loaded machine the wall time says more about the neighbours."""
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, nargs="+", default=[10000, 40000, 160000])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--load", action="store_true", help="also a whole dcpx.load and dcp.load")
    p.add_argument("--index-only", action="store_true",
                   help="time the C decoder (_metadata.index) alone: no unpickling")
    p.add_argument("--out", help="also write the table (markdown) to this file")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.chunks:
            ck = Path(tmp) / f"ck{n}"
            make(ck, n)
            raw = (ck / _metadata.METADATA_FN).read_bytes()
            t_torch = t_dcpx = None
            if not args.index_only:
                t_torch = timed(lambda: pickle.loads(raw), args.repeat)
                t_dcpx = timed(lambda: _metadata.loads(raw, str(ck)), args.repeat)
            t_index = timed(lambda: _metadata.index(raw, str(ck)), args.repeat)
            row = {"chunks": n, "bytes": len(raw), "torch_unpickle": t_torch,
                   "dcpx_decode": t_dcpx, "dcpx_index": t_index}
            if args.load:
                def dload():
                    _readplan.clear()
                    dcpx.load({"w": torch.zeros(n)}, checkpoint_id=ck)

                row["dcpx_load"] = timed(dload, args.repeat)
            rows.append(row)
            print(row, flush=True)
    cols = ["chunks", "bytes", "torch_unpickle", "dcpx_decode", "dcpx_index"]
    if args.load:
        cols += ["dcpx_load"]
    lines = ["| " + " | ".join(cols) + " | (per chunk: torch unpickle / dcpx decode"
             + (" / dcpx load" if args.load else "") + " / dcpx index) |",
             "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        n = r["chunks"]
        per = [r["torch_unpickle"], r["dcpx_decode"]] + (
            [r["dcpx_load"]] if args.load else []) + [r["dcpx_index"]]
        lines.append("| " + " | ".join(f"{r[c]:.3f} s" if isinstance(r[c], float)
                                      else "-" if r[c] is None else str(r[c]) for c in cols)
                     + " | " + " / ".join("-" if t is None else f"{t / n * 1e6:.2f} us"
                                          for t in per) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        cmd = "PYTHONPATH=$PWD python benchmarks/bench_many_chunks.py " + " ".join(
            argv if argv is not None else sys.argv[1:])
        Path(args.out).write_text(f"# many chunks of one key\n\n`{cmd}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
