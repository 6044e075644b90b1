"""``WriteJob(..., base=buffer)`` with base items ``(offset, nbytes,
storage_type, shape[, gate])``: tensors stored contiguously in one buffer
(a staging buffer) written without a DLPack export per tensor.  The data
files must be byte-identical to those written from the same tensors as
``(tensor, storage_type)`` items; bad items get clear errors; the buffer's
reference is dropped by release() and on every error path."""
import sys

import pytest
import torch

from dcpx import _C
from dcpx.formats.dtypes import storage_type_name


def refs(t: torch.Tensor) -> tuple:
    return sys.getrefcount(t), t._use_count()


def _pack(tensors):
    """One uint8 buffer holding the tensors back to back (64-byte aligned),
    and each one's (offset, nbytes)."""
    offs, at = [], 0
    for t in tensors:
        offs.append((at, t.nbytes))
        at += (t.nbytes + 63) // 64 * 64
    buf = torch.zeros(max(at, 1), dtype=torch.uint8)
    for t, (o, n) in zip(tensors, offs):
        if n:
            buf[o:o + n] = t.contiguous().view(-1).view(torch.uint8)
    return buf, offs


def _write(path, items, base=None, threads=1):
    job = _C.WriteJob([(str(path), items)], sync_files=False, threads=threads, serial=7,
                      base=base)
    layout = job.layout()
    job.start()
    job.wait()
    job.release()
    return layout


TENSORS = [
    torch.randn(3, 5),
    torch.tensor(2.5),                                   # 0-d
    torch.empty(0, 4),                                   # empty
    torch.arange(17, dtype=torch.int16),
    torch.randn(6, dtype=torch.bfloat16),
    torch.randn(2, 3, dtype=torch.complex64),
    torch.ones(5, dtype=torch.bool),
    torch.randn(1, 2, 1, 3, 2, 1),                       # ndim > 4: shape stored apart
    torch.randn(300_000),                                # > 1 MiB: the large path
    torch.arange(10, dtype=torch.float64),
]


@pytest.mark.parametrize("threads", [1, 2])
def test_base_items_write_the_same_bytes_as_tensor_items(tmp_path, threads):
    buf, offs = _pack(TENSORS)
    base_items = [(o, n, storage_type_name(t.dtype), tuple(t.shape))
                  for t, (o, n) in zip(TENSORS, offs)]
    base_items.insert(3, b"a bytes item between them")
    tensor_items = [(t, storage_type_name(t.dtype)) for t in TENSORS]
    tensor_items.insert(3, b"a bytes item between them")
    la = _write(tmp_path / "a", base_items, base=buf, threads=threads)
    lb = _write(tmp_path / "b", tensor_items, threads=threads)
    assert la == lb
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


def test_base_items_load_in_torch(tmp_path):
    import io
    buf, offs = _pack(TENSORS)
    items = [(o, n, storage_type_name(t.dtype), torch.Size(t.shape))  # a tuple subclass
             for t, (o, n) in zip(TENSORS, offs)]
    [layout] = _write(tmp_path / "a", items, base=buf)
    raw = (tmp_path / "a").read_bytes()
    for t, (off, length) in zip(TENSORS, layout):
        got = torch.load(io.BytesIO(raw[off:off + length]), weights_only=True)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.view(-1).view(torch.uint8) if got.numel() else got,
                           t.view(-1).view(torch.uint8) if t.numel() else t)


@pytest.mark.parametrize("item, base, match", [
    ((0, 16, "FloatStorage", (4,)), None, "needs WriteJob"),
    ((60, 16, "FloatStorage", (4,)), 64, "outside the buffer"),
    ((0, 12, "FloatStorage", (4,)), 64, "does not hold 4 elements"),
    ((0, 4, "FloatStorage", (0,)), 64, "does not hold 0 elements"),
    ((0, 16, "FloatStorage", (-4,)), 64, "negative dimension"),
    ((0, 16, "FloatStorage", [4]), 64, "base item must be"),
    ((0, 16, "FloatStorage", (4, "x")), 64, ""),
    ((0, 16, 5, (4,)), 64, "base item must be"),
], ids=["no-base", "outside", "not-a-multiple", "empty-with-bytes", "negative",
        "shape-list", "shape-str", "stype-int"])
def test_bad_base_items_are_refused_and_release_the_buffer(tmp_path, item, base, match):
    buf = torch.zeros(base, dtype=torch.uint8) if base else None
    t = torch.randn(3)
    before = refs(buf) if buf is not None else None
    tb = refs(t)
    for _ in range(3):
        with pytest.raises((ValueError, TypeError), match=match):
            _C.WriteJob([(str(tmp_path / "a"), [(t, "FloatStorage"), item])],
                        sync_files=False, base=buf)
    if buf is not None:
        assert refs(buf) == before
    assert refs(t) == tb
    assert not (tmp_path / "a").exists()


def test_base_must_be_contiguous_host_memory(tmp_path):
    buf = torch.zeros(8, 8, dtype=torch.uint8).t()
    before = refs(buf)
    with pytest.raises(ValueError, match="contiguous host memory"):
        _C.WriteJob([(str(tmp_path / "a"), [])], base=buf)
    assert refs(buf) == before


def test_the_job_holds_the_buffer_until_release(tmp_path):
    buf, offs = _pack(TENSORS[:2])
    before = refs(buf)
    items = [(o, n, storage_type_name(t.dtype), tuple(t.shape))
             for t, (o, n) in zip(TENSORS[:2], offs)]
    job = _C.WriteJob([(str(tmp_path / "a"), items)], sync_files=False, base=buf)
    assert buf._use_count() == before[1] + 1  # the live capsule keeps the memory
    job.start()
    job.wait()
    job.release()
    assert refs(buf) == before
    del job
    assert refs(buf) == before
    job = _C.WriteJob([(str(tmp_path / "b"), items)], sync_files=False, base=buf)
    del job  # never started: dealloc releases
    assert refs(buf) == before
