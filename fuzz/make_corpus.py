"""Generate the fuzzing seed corpus from real checkpoints.

    PYTHONPATH=. .venv/bin/python fuzz/make_corpus.py [OUT]   (default fuzz/seeds)

Writes (OUT defaults to fuzz/seeds, which is not committed; fuzz/run.sh
merges it into the committed, minimised fuzz/corpus/):

  OUT/archive/    raw one-tensor archives (up to 64 KiB): items of dcpx- and torch-written
                  DCP data files (sliced through .metadata's storage_data),
                  torch.save archives of plain tensors and of saved views
                  (non-contiguous, storage offsets, 0-d, empty, many dtypes),
                  and non-tensor (bytes) items.
  OUT/metadata/   .metadata files: dcpx-written (pickle + trailer), the same
                  without the trailer, and torch-written.
  OUT/fuzz_zipread/  fuzz_zipread inputs: b"\\0"+archive, b"\\1"+data.pkl,
                  and b"\\2"+gap+head+tail windows of large archives.
  OUT/fuzz_reader/   fuzz_reader inputs: flags + gap + archive (or its windows),
                  and round-trip specs (flags bit 2: dtype, rank, sizes, bytes).
  OUT/fuzz_picklescan/  raw pickles: .metadata bodies and data.pkl records.

Deterministic (fixed generator seed), so a re-run gives the same files.
"""
from __future__ import annotations

import hashlib
import io
import os
import struct
import sys
import tempfile
import warnings
import zipfile

import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from dcpx.formats import metadata as _metadata

warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))


def gen_tensor(shape, dtype, g):
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
          torch.bool, torch.complex64, torch.complex128,
          # v3 (UntypedStorage) pickles:
          torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.complex32]


def state_dict(g, big: bool):
    sd = {}
    for d in DTYPES:
        t = gen_tensor((3, 5), torch.uint8 if d == torch.bool else d, g)
        sd[f"dt.{d}".replace("torch.", "")] = t.bool() if d == torch.bool else t
    base = gen_tensor((4, 6), torch.float32, g)
    sd.update({
        "scalar": gen_tensor((), torch.float64, g),
        "empty": torch.empty(0, dtype=torch.float32),
        "empty2d": torch.empty(0, 3, dtype=torch.int64),
        "ones_dims": gen_tensor((1, 1, 7, 1), torch.float16, g),
        "rank4": gen_tensor((2, 3, 2, 2), torch.int32, g),
        "transposed": base.t(),
        "strided": base[::2, 1::2],
        "sliced": base[1:3],
        "plain": {"n": 7, "s": "x", "l": [1, 2.5, None]},
    })
    if big:  # > 256 KiB: read through the head/tail windows
        sd["big"] = gen_tensor((300, 300), torch.float32, g)
    return sd


def slices(path):
    """(name, archive bytes) per item, through the checkpoint's metadata."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = _metadata.loads(f.read(), path)
    files = {}
    for index, info in md.storage_data.items():
        if info.relative_path not in files:
            with open(os.path.join(path, info.relative_path), "rb") as f:
                files[info.relative_path] = f.read()
        yield index.fqn, files[info.relative_path][info.offset:info.offset + info.length]


def torch_save_bytes(obj) -> bytes:
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


def data_pkl(archive: bytes) -> bytes | None:
    try:
        with zipfile.ZipFile(io.BytesIO(archive)) as z:
            [name] = [n for n in z.namelist() if n.endswith("/data.pkl")]
            return z.read(name)
    except Exception:
        return None


def windows(archive: bytes, w: int) -> bytes:
    """fuzz_zipread mode-2 / fuzz_reader body: gap + head + tail."""
    gap = len(archive) - 2 * w
    assert gap > 0
    return struct.pack("<Q", gap) + archive[:w] + archive[-w:]


class Out:
    def __init__(self, root):
        self.root = root
        self.n = {}

    def put(self, kind, data: bytes, tag: str):
        d = os.path.join(self.root, kind)
        os.makedirs(d, exist_ok=True)
        h = hashlib.sha1(data).hexdigest()[:12]
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in tag)[:40]
        with open(os.path.join(d, f"{safe}-{h}"), "wb") as f:
            f.write(data)
        self.n[kind] = self.n.get(kind, 0) + 1


def main(out_dir: str) -> None:
    g = torch.Generator().manual_seed(20240601)
    out = Out(out_dir)
    archives = []  # (tag, bytes)
    with tempfile.TemporaryDirectory() as tmp:
        # dcpx-written checkpoint (single file per rank) and torch-written
        # checkpoints (default, and one file per item).
        sd = state_dict(g, big=True)
        dcpx.save(sd, checkpoint_id=os.path.join(tmp, "dcpx"))
        tdcp.save(sd, checkpoint_id=os.path.join(tmp, "torch"))
        tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(
            os.path.join(tmp, "torch1"), single_file_per_rank=False))
        for who in ("dcpx", "torch", "torch1"):
            path = os.path.join(tmp, who)
            for fqn, raw in slices(path):
                archives.append((f"{who}.{fqn}", raw))
            with open(os.path.join(path, ".metadata"), "rb") as f:
                md = f.read()
            out.put("metadata", md, f"{who}.metadata")
            if md[-_metadata._TRAILER.size:].startswith(_metadata._TRAILER_MAGIC):
                out.put("metadata", md[:-_metadata._TRAILER.size], f"{who}.notrailer")
                out.put("fuzz_picklescan", md[:-_metadata._TRAILER.size], f"{who}.metadata")
            else:
                out.put("fuzz_picklescan", md, f"{who}.metadata")
        # a small dcpx checkpoint's metadata (one tensor), and one of bytes only
        p = os.path.join(tmp, "small")
        dcpx.save({"w": torch.ones(2)}, checkpoint_id=p)
        with open(os.path.join(p, ".metadata"), "rb") as f:
            out.put("metadata", f.read(), "dcpx.small.metadata")
        p = os.path.join(tmp, "tsmall")
        tdcp.save({"w": torch.ones(2), "n": 3}, checkpoint_id=p)
        with open(os.path.join(p, ".metadata"), "rb") as f:
            out.put("metadata", f.read(), "torch.small.metadata")

    # torch.save of tensors and of saved views (the whole storage is saved,
    # with the view's offset and strides in the pickle)
    base = gen_tensor((5, 8), torch.float32, g)
    views = {
        "ts.scalar": gen_tensor((), torch.int64, g),
        "ts.empty": torch.empty(0, 4, dtype=torch.float64),
        "ts.t": base.t(),
        "ts.step": base[:, ::3],
        "ts.offset": base[2:, 1:],
        "ts.expand": gen_tensor((3, 1), torch.int16, g).expand(3, 4),
        "ts.neg_dims": gen_tensor((1, 0, 2), torch.bfloat16, g),
        "ts.u16": gen_tensor((2, 3), torch.uint16, g),
        "ts.f8": gen_tensor((4,), torch.float8_e5m2, g)[1:],
        "ts.c32": gen_tensor((2,), torch.complex32, g),
        "ts.bool": torch.tensor([True, False, True]),
        "ts.rank6": gen_tensor((1, 2, 1, 2, 1, 2), torch.int8, g),
    }
    for tag, t in views.items():
        archives.append((tag, torch_save_bytes(t)))
    # not one tensor: archives dcpx must reject or hand to torch.load
    archives.append(("ts.two", torch_save_bytes([torch.ones(2), torch.zeros(3)])))
    archives.append(("ts.dict", torch_save_bytes({"a": torch.ones(1)})))
    archives.append(("ts.int", torch_save_bytes(5)))

    for tag, raw in archives:
        if len(raw) <= 64 << 10:
            out.put("archive", raw, tag)
            out.put("fuzz_zipread", b"\0" + raw, tag)
            out.put("fuzz_reader", b"\0" + struct.pack("<Q", 0) + raw, tag)
        else:  # large: keep only the head and tail windows
            out.put("fuzz_zipread", b"\2" + windows(raw, 4096), tag + ".win")
            out.put("fuzz_reader", b"\0" + windows(raw, 4096), tag + ".win")
        pkl = data_pkl(raw)
        if pkl is not None:
            out.put("fuzz_zipread", b"\1" + pkl, tag + ".pkl")
            out.put("fuzz_picklescan", pkl, tag + ".pkl")
    # fuzz_reader round trips: (dtype index, sizes); see ITEMSIZE in fuzz_reader.c
    for dt, sizes in [(0, ()), (0, (0,)), (1, (3, 4)), (12, (2, 3)), (16, (5,)),
                      (0, (300, 300)), (9, (1, 1, 7, 1)), (0, (2**63 - 1, 2, 0))]:
        spec = bytes([4, dt, len(sizes)]) + b"".join(struct.pack("<q", n) for n in sizes)
        out.put("fuzz_reader", spec + b"\x01\x02\x03", f"roundtrip.{dt}.{len(sizes)}")
    for kind, n in sorted(out.n.items()):
        print(f"{kind}: {n} files", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "seeds"))
