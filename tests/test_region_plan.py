"""A rank plans a sharded load from the C decoder's tables, for its own
region only (issue 28 item 4): ``_C.md_index_region`` finds the chunks that
plan_reads finds in the whole ``Metadata``, with the same storage entries;
plan_reads gives the same reads and raises the same errors from either;
and a load of a sharded checkpoint into one rank's regions is bit-exact
without the ``Metadata`` of every key ever being decoded."""
from __future__ import annotations

import random

import pytest
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

import dcpx
from dcpx import _C
from dcpx.coordination import dist as _dist, readplan as _readplan
from dcpx.formats import metadata as _metadata
from dcpx.storage.reader import FileSystemReader

from conftest import assert_bit_equal


@pytest.fixture(autouse=True)
def _fresh_cache():
    _readplan.clear()
    yield
    _readplan.clear()


def _cuts(rng: random.Random, n: int) -> list:
    """Bounds that split [0, n) into 1-4 parts (a part may be empty)."""
    inner = sorted(rng.randint(0, n) for _ in range(rng.randint(0, 3)))
    return [0] + inner + [n]


def _random_metadata(rng: random.Random) -> Metadata:
    """Keys of 0-3 dims, each saved as a grid of chunks (some empty), with
    now and then a chunk left out (a gap), a chunk added over others (an
    overlap) or a chunk without its storage entry; a non-tensor value."""
    sdm, storage = {}, {}
    pos = 0
    for k in range(rng.randint(1, 5)):
        fqn = f"layers.{k}.w"
        nd = rng.randint(0, 3)
        size = [rng.randint(0, 12) for _ in range(nd)]
        grids = [_cuts(rng, n) for n in size]
        boxes = [((), ())]
        for cuts in grids:
            boxes = [(o + (a,), s + (b - a,)) for o, s in boxes
                     for a, b in zip(cuts, cuts[1:])]
        if len(boxes) > 1 and rng.random() < 0.2:
            boxes.pop(rng.randrange(len(boxes)))
        if nd and rng.random() < 0.2:
            o = tuple(rng.randint(0, n // 2) for n in size)
            boxes.append((o, tuple(n - a for n, a in zip(size, o))))
        rng.shuffle(boxes)
        chunks = []
        seen = set()
        for o, s in boxes:
            if o in seen:  # one storage entry per (fqn, offsets)
                continue
            seen.add(o)
            chunks.append(ChunkStorageMetadata(torch.Size(o), torch.Size(s)))
            if rng.random() < 0.05:
                continue  # no storage entry: plan_reads names the chunk
            length = 4 * max(1, int(torch.Size(s).numel()))
            storage[MetadataIndex(fqn, o)] = _StorageInfo(f"__{rng.randint(0, 2)}_0.distcp",
                                                          pos, length)
            pos += length
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                         torch.Size(size), chunks)
    sdm["step"] = BytesStorageMetadata()
    storage[MetadataIndex("step")] = _StorageInfo("__0_0.distcp", pos, 7)
    if rng.random() < 0.5:
        # storage entries in another order than the chunks (the decoder
        # links those by its hash, the rest as they come)
        items = list(storage.items())
        rng.shuffle(items)
        storage = dict(items)
    return Metadata(state_dict_metadata=sdm, storage_data=storage)


def _region(rng: random.Random, size) -> tuple:
    offsets = tuple(rng.randint(0, n) for n in size)
    sizes = tuple(rng.randint(0, n - o) for n, o in zip(size, offsets))
    return offsets, sizes


def _meets(region: tuple, ch) -> bool:
    """plan_reads' test: the chunk and the region share an element in every
    dimension."""
    return all(max(o, co) < min(o + n, co + cn)
               for o, n, co, cn in zip(region[0], region[1], ch.offsets, ch.sizes))


def _indexed(raw: bytes) -> _readplan.Checkpoint:
    index, names = _metadata.index(raw, "x")
    return _readplan.Checkpoint(None, raw, None, {}, "x", index, names, lazy=True)


@pytest.mark.parametrize("seed", range(40))
def test_region_lookup_finds_the_chunks_plan_reads_finds(seed):
    rng = random.Random(seed)
    md = _random_metadata(rng)
    raw = _metadata.dumps(md)
    ck = _indexed(raw)
    args = (ChunkStorageMetadata, torch.Size, _StorageInfo)
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            assert ck.region(fqn, None) == ()
            continue
        assert ck.region(fqn, None) == (torch.float32, m.size, [], [])
        for _ in range(6):
            region = _region(rng, m.size)
            want = [c for c in m.chunks if _meets(region, c)]
            dtype, size, chunks, infos = _C.md_index_region(ck.index, fqn, region, *args)
            assert (dtype, size) == (torch.float32, m.size)
            assert chunks == want, (fqn, region)
            assert all(type(c.offsets) is torch.Size for c in chunks)
            assert infos == [md.storage_data.get(MetadataIndex(fqn, c.offsets)) for c in want]
    assert ck.region("not.saved", None) is None
    # a destination of another shape: no chunk (plan_reads raises its
    # size mismatch); a malformed region: an error
    m = md.state_dict_metadata["layers.0.w"]
    assert _C.md_index_region(ck.index, "layers.0.w", ((0,) * 5, (1,) * 5), *args) == (
        torch.float32, m.size, [], [])
    for bad in ((0, 1), ((0,), (1, 2)), [(0,), (1,)], ("ab", "cd")):
        with pytest.raises((ValueError, TypeError)):
            _C.md_index_region(ck.index, "layers.0.w", bad, *args)
    assert not ck.decoded


def _fake_local_chunk(monkeypatch, regions: dict, dtypes: dict = {}) -> dict:
    """flat of stand-ins (a tensor of the key's full size, no memory) whose
    local chunk is ``regions[fqn]``, its target a fresh tensor."""
    flat, chunks = {}, {}
    for fqn, (size, (offsets, sizes)) in regions.items():
        dtype = dtypes.get(fqn, torch.float32)
        obj = torch.empty((), dtype=dtype).expand(size)
        target = torch.full(sizes, -1, dtype=dtype)
        chunks[id(obj)] = (target, torch.Size(offsets), torch.Size(sizes))
        flat[fqn] = obj
    real = _dist.local_chunk
    monkeypatch.setattr(_dist, "local_chunk",
                        lambda obj: chunks[id(obj)] if id(obj) in chunks else real(obj))
    return flat


def _outcome(reader, md, flat) -> tuple:
    """plan_reads' reads (in a stable order) or the error it raises."""
    serial: list = []
    try:
        reads, byte_keys = _dist.plan_reads(reader, md, flat, False, serial)
    except Exception as e:  # noqa: BLE001 - compared
        return ("raised", type(e), str(e))
    def norm(r):
        t = r.target
        info = (r.info.relative_path, r.info.offset, r.info.length)
        return (r.key, info, tuple(r.chunk), str(r.dtype), r.narrow,
                t.storage_offset(), tuple(t.shape), t.stride())
    return (sorted(map(norm, reads)), [norm(r) for r in serial], byte_keys)


@pytest.mark.parametrize("seed", range(40))
def test_plan_reads_from_a_region_equals_the_plan_from_every_chunk(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    md = _random_metadata(rng)
    ck = _indexed(_metadata.dumps(md))
    regions = {fqn: (tuple(m.size), _region(rng, m.size))
               for fqn, m in md.state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata)}
    if rng.random() < 0.3:  # a key the checkpoint does not hold
        regions["not.saved"] = ((3,), ((0,), (3,)))
    reader = FileSystemReader(tmp_path)
    flat = _fake_local_chunk(monkeypatch, regions)
    flat["step"] = 0
    part = _dist.region_metadata(ck, flat)
    assert part is not None and not ck.decoded
    # the same reads into the same views, or the same error
    assert _outcome(reader, part, flat) == _outcome(reader, md, flat)


def _sharded_checkpoint(path, shards: dict) -> dict:
    """A checkpoint whose keys are saved in several chunks, as a job of
    several ranks saves them: each chunk a record of a dcpx.save, the
    metadata rewritten to name them as chunks of one key.  ``shards``:
    {fqn: (full tensor, dim-0 bounds)}."""
    sd, parts = {}, {}
    for fqn, (full, bounds) in shards.items():
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            sd[f"{fqn}#{i}"] = full[a:b].clone()
            parts[f"{fqn}#{i}"] = (fqn, a)
    sd["step"] = 7
    dcpx.save(sd, checkpoint_id=path)
    saved = dcpx.FileSystemReader(path).read_metadata()
    sdm, storage = {"step": saved.state_dict_metadata["step"]}, {}
    storage[MetadataIndex("step")] = saved.storage_data[MetadataIndex("step")]
    for name, (fqn, a) in parts.items():
        m = saved.state_dict_metadata[name]
        full = shards[fqn][0]
        if fqn not in sdm:
            sdm[fqn] = TensorStorageMetadata(m.properties, full.size(), [])
        off = torch.Size((a,) + (0,) * (full.dim() - 1))
        sdm[fqn].chunks.append(ChunkStorageMetadata(off, m.size))
        storage[MetadataIndex(fqn, off)] = saved.storage_data[
            MetadataIndex(name, torch.Size((0,) * full.dim()))]
    with open(path / ".metadata", "wb") as f:
        f.write(_metadata.dumps(Metadata(state_dict_metadata=sdm, storage_data=storage)))
    return sd


def test_a_rank_loads_its_region_of_a_sharded_checkpoint_without_decoding_it_all(
        tmp_path, monkeypatch):
    """64 chunks per key, as 64 ranks save an FSDP model: a rank's load
    reads its rows bit-exact (from one chunk, and across two), the
    checkpoint's Metadata never decoded; torch loads the same checkpoint
    the same."""
    g = torch.Generator().manual_seed(0)
    shards = {"w": (torch.randn(256, 3, generator=g), list(range(0, 257, 4))),
              "b": (torch.randint(-9, 9, (128,), generator=g).to(torch.int16),
                    list(range(0, 129, 2)))}
    path = tmp_path / "ck"
    _sharded_checkpoint(path, shards)
    for rows in (((8, 0), (4, 3)), ((10, 0), (7, 3))):
        regions = {"w": ((256, 3), rows), "b": ((128,), ((rows[0][0],), (rows[1][0],)))}
        flat = _fake_local_chunk(monkeypatch, regions,
                                 {fqn: full.dtype for fqn, (full, _) in shards.items()})
        reader = FileSystemReader(path)
        ck = _dist.open_checkpoint(reader, None)
        assert ck.index is not None and not ck.decoded
        reads, byte_keys, serial = _dist.plan_checked(reader, ck, flat, False)
        assert not ck.decoded and not serial and byte_keys == []
        reader.read_tensors(reads)
        for fqn, (full, _) in shards.items():
            (o, n) = regions[fqn][1]
            want = full[o[0]:o[0] + n[0]]
            assert_bit_equal(_dist.local_chunk(flat[fqn])[0], want)
    # torch reads the rewritten checkpoint as dcpx does
    import torch.distributed.checkpoint as tdcp
    got = {"w": torch.zeros(256, 3), "b": torch.zeros(128, dtype=torch.int16)}
    tdcp.load(got, storage_reader=tdcp.FileSystemReader(str(path)))
    for fqn, (full, _) in shards.items():
        assert_bit_equal(got[fqn], full)


def test_reference_counts_are_kept_on_every_path():
    """Found, a non-tensor value, no such key, region None, a region of
    another shape, a chunk without a storage entry, a class that raises, a
    malformed region: the arguments and the dtype are held as before once
    the results are gone."""
    import sys
    rng = random.Random(3)
    md = _random_metadata(rng)
    ck = _indexed(_metadata.dumps(md))
    fqn = max((k for k, m in md.state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata)),
              key=lambda k: len(md.state_dict_metadata[k].chunks))
    size = tuple(md.state_dict_metadata[fqn].size)
    region = (tuple(0 for _ in size), size)

    def broken(*a):
        raise RuntimeError("made to fail")
    args = [ck.index, fqn, region, ChunkStorageMetadata, torch.Size, _StorageInfo, broken]

    def counts():
        return [sys.getrefcount(a) for a in args] + [sys.getrefcount(torch.float32)]
    def calls():
        for key, reg in ((fqn, region), ("step", None), ("nope", None), (fqn, None),
                         (fqn, ((0,) * 7, (1,) * 7))):
            out = _C.md_index_region(ck.index, key, reg, ChunkStorageMetadata, torch.Size,
                                     _StorageInfo)
            del out
        for cls in ((broken, torch.Size, _StorageInfo), (ChunkStorageMetadata, broken, _StorageInfo),
                    (ChunkStorageMetadata, torch.Size, broken)):
            if size and md.state_dict_metadata[fqn].chunks:
                with pytest.raises(RuntimeError, match="made to fail"):
                    _C.md_index_region(ck.index, fqn, region, *cls)
        with pytest.raises(ValueError):
            _C.md_index_region(ck.index, fqn, (region[0],), ChunkStorageMetadata, torch.Size,
                               _StorageInfo)
    calls()
    before = counts()
    for _ in range(50):
        calls()
    assert counts() == before
