"""The load index (dcpx/formats/loadindex.py; docs/format.md, "The load
index"): a file beside ``.metadata`` from which one rank finds the chunks
of its keys without reading or decoding the whole ``.metadata`` (issue 28
item 4).

Its answers are the C decoder's (``_C.md_index_region`` on the same
metadata encoded by ``formats.metadata.dumps``), order included, on random
grids of chunks with gaps, overlaps, missing storage entries and values; it
opens only beside the ``.metadata`` it was made for; a lookup reads a few
blocks, not the file; and a damaged index never gives another answer:
every single-byte change, truncation and random garbage either makes
``open`` return None, or a lookup raise ``LoadIndexCorrupt``, or the
lookup gives the right answer anyway."""
from __future__ import annotations

import os
import pickle
import random
import struct
import tracemalloc

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

from dcpx import _C
from dcpx.formats import loadindex as li, metadata as _metadata

ARGS = (ChunkStorageMetadata, torch.Size, _StorageInfo)
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn]


def _cuts(rng: random.Random, n: int, most: int = 3) -> list:
    """Bounds that split [0, n) into parts (a part may be empty)."""
    inner = sorted(rng.randint(0, n) for _ in range(rng.randint(0, most)))
    return [0] + inner + [n]


def _key(rng: random.Random, fqn: str, nd: int, storage: dict, pos: list,
         most: int = 3) -> TensorStorageMetadata:
    """A key saved as a grid of chunks (some empty), shuffled, with now and
    then a chunk left out (a gap), chunks added over others (overlaps), a
    chunk without its storage entry; the entries' position hints right,
    wrong or absent."""
    most = max(3, int(most ** (1 / nd))) if nd else most   # (chunks: about most / 2)
    size = [rng.randint(0, 12 if most <= 3 else 4 * most) for _ in range(nd)]
    boxes = [((), ())]
    for n in size:
        cuts = _cuts(rng, n, most)
        boxes = [(o + (a,), s + (b - a,)) for o, s in boxes for a, b in zip(cuts, cuts[1:])]
    if len(boxes) > 1 and rng.random() < 0.2:
        boxes.pop(rng.randrange(len(boxes)))
    for _ in range(rng.choice([0, 0, 1, 3]) if nd else 0):
        o = tuple(rng.randint(0, n // 2) for n in size)
        boxes.append((o, tuple(rng.randint(0, n - a) for n, a in zip(size, o))))
    rng.shuffle(boxes)
    hints = rng.choice(["right", "right", "wrong", "none"])
    chunks, seen = [], set()
    for o, s in boxes:
        if o in seen:  # one storage entry per (fqn, offsets)
            continue
        seen.add(o)
        chunks.append(ChunkStorageMetadata(torch.Size(o), torch.Size(s)))
        if rng.random() < 0.05:
            continue  # no storage entry: plan_reads names the chunk
        length = 4 * max(1, int(torch.Size(s).numel()))
        hint = {"right": len(chunks) - 1, "wrong": rng.randint(-2, 40), "none": None}[hints]
        storage[MetadataIndex(fqn, torch.Size(o), hint)] = _StorageInfo(
            f"__{rng.randint(0, 3)}_0.distcp", pos[0], length)
        pos[0] += length
    return TensorStorageMetadata(TensorProperties(dtype=rng.choice(DTYPES)), torch.Size(size),
                                 chunks)


def random_metadata(rng: random.Random, keys: int = 6, most: int = 3) -> Metadata:
    sdm, storage, pos = {}, {}, [0]
    for k in range(rng.randint(1, keys)):
        fqn = f"layers.{k}.w"
        if rng.random() < 0.15:
            sdm[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = _StorageInfo("__0_0.distcp", pos[0], 9)
            pos[0] += 9
        else:
            sdm[fqn] = _key(rng, fqn, rng.randint(0, 3), storage, pos, most)
    sdm["step"] = BytesStorageMetadata()
    storage[MetadataIndex("step")] = _StorageInfo("__0_0.distcp", pos[0], 7)
    # storage_data in another order than the keys' (as ranks send them)
    items = list(storage.items())
    rng.shuffle(items)
    return Metadata(state_dict_metadata=sdm, storage_data=dict(items))


def random_region(rng: random.Random, size) -> tuple:
    r = rng.random()
    if r < 0.05:
        return None
    if r < 0.1:  # another number of dims: no chunk
        return tuple([0] * (len(size) + 1)), tuple([1] * (len(size) + 1))
    if r < 0.2:  # reaching outside the tensor, negative, empty, huge
        offsets = tuple(rng.randint(-3, n + 3) for n in size)
        sizes = tuple(rng.choice([0, 1, n + 5, 2 ** 62, -1]) for n in size)
        return offsets, sizes
    offsets = tuple(rng.randint(0, n) for n in size)
    return offsets, tuple(rng.randint(0, n - o) for n, o in zip(size, offsets))


def write_pair(directory, md: Metadata, body: bytes = None) -> bytes:
    """.metadata (dcpx's encoding) and its index in ``directory``; the
    .metadata bytes."""
    raw = _metadata.dumps(md)
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(raw)
    body = li.build_body(md) if body is None else body
    assert body is not None
    write_index(directory, raw, body)
    return raw


def write_index(directory, raw: bytes, body: bytes) -> bytes:
    _, crc, n = struct.unpack("<8sIQ", raw[-20:])
    data = li.header(body, crc, n) + body
    with open(os.path.join(directory, li.INDEX_FN), "wb") as f:
        f.write(data)
    return data


def c_tables(raw: bytes):
    got = _metadata.index(raw, "x")
    assert got is not None
    return got[0]


def outcome(fn, *args):
    """What a call gives: its value, or the type of what it raised."""
    try:
        return ("ok", fn(*args))
    except Exception as e:  # noqa: BLE001 - compared
        return ("raised", type(e))


# --- the same answers as the C decoder's ------------------------------------------

@pytest.mark.parametrize("seed", range(60))
def test_region_equals_the_c_decoders_answer(tmp_path, seed):
    rng = random.Random(seed)
    md = random_metadata(rng, keys=8, most=3 if seed % 3 else 300)
    raw = write_pair(tmp_path, md)
    index = c_tables(raw)
    with li.LoadIndex.open(tmp_path) as ix:
        assert ix.key_count() == len(md.state_dict_metadata) == _C.md_index_len(index)
        assert ix.keys() == set(md.state_dict_metadata)
        assert ix.nfiles == len({i.relative_path for i in md.storage_data.values()})
        assert ix.byte_info() == _C.md_index_bytes(index, _StorageInfo) == {
            k.fqn: v for k, v in md.storage_data.items() if k.offset is None}
        for fqn, m in md.state_dict_metadata.items():
            regions = [None] if isinstance(m, BytesStorageMetadata) else \
                [random_region(rng, m.size) for _ in range(25)]
            if not isinstance(m, BytesStorageMetadata):
                regions.append((tuple([0] * len(m.size)), tuple(m.size)))  # all of it
            for region in regions:
                want = _C.md_index_region(index, fqn, region, *ARGS)
                got = ix.region(fqn, region)
                assert got == want, (fqn, region)
                if got:
                    assert type(got[1]) is torch.Size and got[0] is want[0]
                    assert all(type(c.offsets) is torch.Size and type(c.sizes) is torch.Size
                               for c in got[2])
        assert ix.region("not.saved", None) is None
        assert ix.region("layers.0", None) is None


def test_chunks_come_in_the_order_of_the_metadata(tmp_path):
    """A key's chunks in .metadata are not sorted by offset (ranks send them
    in any order); the answer lists them as .metadata does."""
    rng = random.Random(5)
    n = 2000
    cuts = sorted(rng.sample(range(1, 10 * n), n - 1))
    bounds = [0] + cuts + [10 * n]
    boxes = [(a, b - a) for a, b in zip(bounds, bounds[1:])]
    boxes += [(rng.randint(0, 10 * n - 50), 50) for _ in range(40)]  # overlaps
    boxes = list({o: (o, s) for o, s in boxes}.values())
    rng.shuffle(boxes)
    chunks = [ChunkStorageMetadata(torch.Size([o]), torch.Size([s])) for o, s in boxes]
    storage = {MetadataIndex("w", torch.Size([o]), i): _StorageInfo("__0_0.distcp", 64 * i, 4 * s)
               for i, (o, s) in enumerate(boxes)}
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                              torch.Size([10 * n]), chunks)}, storage_data=storage)
    raw = write_pair(tmp_path, md)
    index = c_tables(raw)
    with li.LoadIndex.open(tmp_path) as ix:
        for _ in range(60):
            a = rng.randint(0, 10 * n)
            region = ((a,), (rng.choice([1, 10, 100, 10 * n]),))
            got = ix.region("w", region)
            assert got == _C.md_index_region(index, "w", region, *ARGS)
            assert got[2] == [c for c in chunks
                              if max(a, c.offsets[0]) < min(a + region[1][0],
                                                            c.offsets[0] + c.sizes[0])]


def test_malformed_regions_raise_as_the_c_lookup_does(tmp_path):
    md = random_metadata(random.Random(3))
    sdm = md.state_dict_metadata
    sdm["m"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 4]),
                                     [ChunkStorageMetadata(torch.Size([0, 0]),
                                                           torch.Size([4, 4]))])
    md.storage_data[MetadataIndex("m", torch.Size([0, 0]), 0)] = _StorageInfo("__0_0.distcp", 0, 64)
    raw = write_pair(tmp_path, md)
    index = c_tables(raw)
    bad = [(0, 1), ((0,), (1, 2)), [(0, 0), (1, 1)], ("ab", "cd"), ((0, 0),), ((0, 0), [1, 1]),
           ((0.5, 0), (1, 1)), ((0, 0), (None, 1)), ((2 ** 63, 0), (1, 1)), ((0, 0), (-2 ** 64, 1)),
           ((True, 0), (1, 1)), ((0, 0, 0), ("x", 1, 1)), 5, "ab"]
    with li.LoadIndex.open(tmp_path) as ix:
        for region in bad:
            want = outcome(_C.md_index_region, index, "m", region, *ARGS)
            assert outcome(ix.region, "m", region) == want, region
            # a non-tensor value or a missing key: the region is not looked at
            assert ix.region("step", region) == () and ix.region("nope", region) is None
        for fqn in (b"m", None, 3):
            assert outcome(ix.region, fqn, None) == outcome(_C.md_index_region, index, fqn,
                                                            None, *ARGS)


def test_the_position_hints_never_change_the_body():
    """Storage entries joined to their chunks by MetadataIndex.index (as
    dcpx's and torch's planners set it) or by (fqn, offsets): the same
    bytes, whatever the hints say."""
    for seed in range(40):
        md = random_metadata(random.Random(seed), keys=8)
        bodies = set()
        for mode in ("right", "none", "shifted"):
            storage = {}
            for k, v in md.storage_data.items():
                hint = None
                if k.offset is not None and mode != "none":
                    chunks = md.state_dict_metadata[k.fqn].chunks
                    hint = [c.offsets for c in chunks].index(k.offset)
                    hint = hint if mode == "right" else hint + 1
                storage[MetadataIndex(k.fqn, k.offset, hint)] = v
            bodies.add(li.build_body(Metadata(md.state_dict_metadata, storage_data=storage)))
        assert len(bodies) == 1 and None not in bodies


def test_small_keys_are_packed_as_the_columns_pack_them(monkeypatch):
    """Keys of few chunks are packed row by row (_small_area): the same
    bytes as the column passes give, and the same refusals."""
    cases = [random_metadata(random.Random(seed), keys=8) for seed in range(60)]
    cases += [Metadata({"w": _tensor([4], [((2,), (4,))])}, storage_data={
                  MetadataIndex("w", torch.Size([2])): _StorageInfo("f", 0, 4)}),
              Metadata({"w": _tensor([4, 4], [((0,), (4,))])}, storage_data={
                  MetadataIndex("w", torch.Size([0])): _StorageInfo("f", 0, 4)}),
              Metadata({"w": _tensor([4], [((-1,), (2,))])}, storage_data={
                  MetadataIndex("w", torch.Size([-1])): _StorageInfo("f", 0, 4)}),
              Metadata({"w": _tensor([4, 4], [((0, 0), (4, 5))])}, storage_data={
                  MetadataIndex("w", torch.Size([0, 0])): _StorageInfo("f", 0, 4)})]
    small = [li.build_body(md) for md in cases]
    monkeypatch.setattr(li, "_SMALL", 0)
    assert [li.build_body(md) for md in cases] == small
    assert small[-4:] == [None] * 4 and None not in small[:-4]


def test_hints_that_point_into_another_key_are_not_followed():
    """Two keys of the same chunks; each one's entries hint at the other's
    places: every chunk still gets its own key's entry."""
    sdm = {k: _tensor([4], [((0,), (2,)), ((2,), (2,))]) for k in ("a", "b")}
    base = {"a": 0, "b": 2}
    other = {"a": "b", "b": "a"}
    storage = {}
    for k in ("a", "b"):
        for i, o in enumerate((0, 2)):
            hint = base[other[k]] - base[k] + i  # the other key's slot
            storage[MetadataIndex(k, torch.Size([o]), hint)] = _StorageInfo(f"{k}{i}", 0, 8)
    md = Metadata(sdm, storage_data=storage)
    plain = Metadata(sdm, storage_data={MetadataIndex(k.fqn, k.offset): v
                                        for k, v in storage.items()})
    assert li.build_body(md) == li.build_body(plain) is not None


def test_a_save_s_metadata_is_joined_by_its_hints(monkeypatch):
    """The metadata a save commits (every chunk with its entry, the
    entries' hints set, values among them) takes the join by hints: no
    dict over every (fqn, offsets)."""
    md = _fsdp(64, 3)
    want = li.build_body(md)

    def refuse(*args):
        raise AssertionError("joined by (fqn, offsets)")
    monkeypatch.setattr(li, "_slow_links", refuse)
    assert li.build_body(md) == want
    storage = {MetadataIndex(k.fqn, k.offset): v for k, v in md.storage_data.items()}
    with pytest.raises(AssertionError, match="joined by"):  # no hints: the dict
        li.build_body(Metadata(md.state_dict_metadata, storage_data=storage))


# --- the file pair ------------------------------------------------------------------

def _md(n: int = 4) -> Metadata:
    chunks = [ChunkStorageMetadata(torch.Size([i * 2]), torch.Size([2])) for i in range(n)]
    storage = {MetadataIndex("w", c.offsets, i): _StorageInfo(f"__{i}_0.distcp", 0, 8)
               for i, c in enumerate(chunks)}
    storage[MetadataIndex("step")] = _StorageInfo("__0_0.distcp", 64, 5)
    return Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                torch.Size([2 * n]), chunks),
                     "step": BytesStorageMetadata()}, storage_data=storage)


def test_opens_only_beside_the_metadata_it_was_made_for(tmp_path):
    md = _md()
    raw = write_pair(tmp_path, md)
    meta = tmp_path / ".metadata"
    assert li.LoadIndex.open(tmp_path) is not None
    assert li.LoadIndex.open(str(tmp_path)) is not None
    # another .metadata (another trailer): the index is not for it
    md2 = _md(5)
    raw2 = _metadata.dumps(md2)
    meta.write_bytes(raw2)
    assert li.LoadIndex.open(tmp_path) is None
    # the same layout saved again: the body is reused with a new header
    write_index(tmp_path, raw2, li.build_body(md2))
    with li.LoadIndex.open(tmp_path) as ix:
        assert ix.region("w", ((0,), (10,)))[2] == md2.state_dict_metadata["w"].chunks
    # torch's pickle (no trailer) never matches, even with the right bytes
    meta.write_bytes(pickle.dumps(md2))
    assert li.LoadIndex.open(tmp_path) is None
    meta.write_bytes(raw2[:-20])
    assert li.LoadIndex.open(tmp_path) is None
    # a trailer whose length is not the file's
    meta.write_bytes(b"x" + raw2)
    assert li.LoadIndex.open(tmp_path) is None
    meta.write_bytes(raw)
    assert li.LoadIndex.open(tmp_path) is None  # the index is md2's now
    write_index(tmp_path, raw, li.build_body(md))
    assert li.LoadIndex.open(tmp_path) is not None
    # no index; no .metadata (the directory is not a checkpoint)
    os.unlink(tmp_path / li.INDEX_FN)
    assert li.LoadIndex.open(tmp_path) is None
    write_index(tmp_path, raw, li.build_body(md))
    os.unlink(meta)
    with pytest.raises(FileNotFoundError):
        li.LoadIndex.open(tmp_path)
    with pytest.raises(FileNotFoundError):
        li.LoadIndex.open(tmp_path / "nowhere")


def test_an_index_that_is_not_a_regular_file_is_not_opened(tmp_path):
    md = _md()
    raw = write_pair(tmp_path, md)
    index = tmp_path / li.INDEX_FN
    real = tmp_path / "elsewhere"
    os.rename(index, real)
    os.symlink(real, index)
    assert li.LoadIndex.open(tmp_path) is None
    os.unlink(index)
    os.mkfifo(index)
    assert li.LoadIndex.open(tmp_path) is None  # not waited on
    os.unlink(index)
    os.mkdir(index)
    assert li.LoadIndex.open(tmp_path) is None
    os.rmdir(index)
    os.rename(real, index)
    # a .metadata that is a link: not the file the index names
    meta = tmp_path / ".metadata"
    os.rename(meta, tmp_path / "md")
    os.symlink(tmp_path / "md", meta)
    assert li.LoadIndex.open(tmp_path) is None
    os.unlink(meta)
    meta.write_bytes(raw)
    assert li.LoadIndex.open(tmp_path) is not None


def test_a_key_of_many_fence_blocks(tmp_path):
    """A key of 30,000 chunks: 411 leaves of rows in two fence blocks, its
    leaves at 4 KiB boundaries; lookups on both sides of every boundary;
    and a sample of single-byte changes in it."""
    n = 30000
    rng = random.Random(4)
    order = list(range(n))
    for _ in range(500):  # ranks' chunks a little out of order
        a, b = rng.randrange(n), rng.randrange(n)
        order[a], order[b] = order[b], order[a]
    chunks = [((i,), (1,)) for i in order]
    md = Metadata({"w": _tensor([n], chunks), "step": BytesStorageMetadata()}, storage_data={
        MetadataIndex("step"): _StorageInfo("__0_0.distcp", 0, 5)})
    for j, i in enumerate(order):
        md.storage_data[MetadataIndex("w", torch.Size([i]), j)] = _StorageInfo(
            f"__{i % 7}_0.distcp", 64 * i, 4)
    raw = write_pair(tmp_path, md)
    index = c_tables(raw)
    per = li._leaf_rows(li._row_width(1))
    area = li._Area(0, 1, n)
    assert area[6] == -(-n // per) > li._FENCE_BLOCK and area[7] == 2
    edge = li._FENCE_BLOCK * per  # the first row of the second fence block
    regions = [((i,), (w,)) for i in (0, per - 1, per, edge - 1, edge, edge + 1, n - 1)
               for w in (1, 3)] + [((edge - 100,), (200,)), ((n - 5,), (10,)), ((-5,), (6,))]
    answers = {r: _C.md_index_region(index, "w", r, *ARGS) for r in regions}
    with li.LoadIndex.open(tmp_path) as ix:
        for r, want in answers.items():
            assert ix.region("w", r) == want, r
        assert ix.bytes_read < 64 * 1024
    path = tmp_path / li.INDEX_FN
    data = path.read_bytes()
    fd = os.open(path, os.O_RDWR)
    try:
        with li.LoadIndex.open(tmp_path) as ix:
            w_row = ix._find("w")[1]
        lay = li._Area(w_row[8], 1, n)
        head = range(li.HEADER_LEN + w_row[8], li.HEADER_LEN + w_row[8] + lay[0])
        fences = rng.sample(range(li.HEADER_LEN + lay[1], li.HEADER_LEN + lay[1] + 2 * li._BLOCK),
                            60)
        leaves = [li.HEADER_LEN + lay[3] + lay[4] * (edge // per + d) + rng.randrange(per * 56)
                  for d in (-1, 0) for _ in range(30)]
        for at in list(head) + fences + leaves + rng.sample(range(len(data)), 60):
            os.pwrite(fd, bytes([data[at] ^ 0x21]), at)
            ix = li.LoadIndex.open(tmp_path)
            if ix is not None:
                with ix:
                    for r, want in answers.items():
                        try:
                            got = ix.region("w", r)
                        except li.LoadIndexCorrupt:
                            continue
                        assert got == want, (at, r)
            os.pwrite(fd, data[at:at + 1], at)
    finally:
        os.close(fd)


# --- a rank reads a few blocks --------------------------------------------------------

def _fsdp(ranks: int, tensors: int) -> Metadata:
    """Every tensor sharded along dim 0 over all ranks (FSDP2), the storage
    entries in rank order, as a save's commit makes them."""
    sdm, storage = {}, {}
    for t in range(tensors):
        chunks = [ChunkStorageMetadata(torch.Size([4 * r, 0]), torch.Size([4, 256]))
                  for r in range(ranks)]
        sdm[f"model.layers.{t}.weight"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16), torch.Size([4 * ranks, 256]), chunks)
    for r in range(ranks):
        for t, fqn in enumerate(sdm):
            storage[MetadataIndex(fqn, torch.Size([4 * r, 0]), r)] = _StorageInfo(
                f"__{r}_0123456789abcdef_0.distcp", 2048 * t, 2048)
    sdm["step"] = BytesStorageMetadata()
    storage[MetadataIndex("step")] = _StorageInfo("__0_0123456789abcdef_0.distcp", 0, 5)
    return Metadata(sdm, storage_data=storage)


def bytes_per_key(directory, ranks: int, tensors: int = 2) -> tuple:
    """(bytes read by one rank's lookups per key, the index's size)."""
    md = _fsdp(ranks, tensors)
    raw = write_pair(directory, md)
    index = c_tables(raw)
    per_rank = []
    for r in (0, ranks // 2 + 1, ranks - 1):
        with li.LoadIndex.open(directory) as ix:
            for fqn in md.state_dict_metadata:
                region = None if fqn == "step" else ((4 * r, 0), (4, 256))
                got = ix.region(fqn, region)
                assert got == _C.md_index_region(index, fqn, region, *ARGS)
                assert fqn == "step" or len(got[2]) == 1
            per_rank.append(ix.bytes_read / tensors)
    return max(per_rank), os.path.getsize(os.path.join(directory, li.INDEX_FN))


def test_a_rank_reads_a_few_blocks_per_key(tmp_path):
    small = tmp_path / "small"
    large = tmp_path / "large"
    small.mkdir()
    large.mkdir()
    at_1k, size_1k = bytes_per_key(small, 1024)
    at_16k, size_16k = bytes_per_key(large, 16384)
    assert at_16k < 32 * 1024
    assert at_16k <= 2 * at_1k, (at_1k, at_16k)
    assert at_16k * 2 < size_16k / 50, (at_16k, size_16k)


# --- a damaged index ---------------------------------------------------------------

def _expected(ix_answers: dict, ix: li.LoadIndex) -> None:
    """Every lookup gives the right answer or raises LoadIndexCorrupt."""
    for (fqn, region), want in ix_answers.items():
        if fqn in ("keys", "byte_info"):
            continue
        try:
            got = ix.region(fqn, region)
        except li.LoadIndexCorrupt:
            continue
        assert got == want, (fqn, region)
    for call, want in (("keys", ix_answers[("keys", None)]),
                       ("byte_info", ix_answers[("byte_info", None)])):
        try:
            got = getattr(ix, call)()
        except li.LoadIndexCorrupt:
            continue
        assert got == want, call


def _small_case(tmp_path):
    """A small index with every part: keys of 0-2 dims, a key of two
    leaves of rows (shuffled, with an overlap and a chunk without storage
    entry), two values, three files; its bytes and every answer."""
    rng = random.Random(11)
    n = 80
    chunks = [((3 * i,), (3,)) for i in range(n)] + [((100,), (50,))]
    rng.shuffle(chunks)
    grid = [((a, b), (2, 3)) for a in (0, 2, 4) for b in (0, 3)]
    sdm = {"big": _tensor([3 * n], chunks, torch.float16), "grid": _tensor([6, 6], grid),
           "scalar": _tensor([], [((), ())], torch.int64), "step": BytesStorageMetadata(),
           "name": BytesStorageMetadata()}
    storage = {MetadataIndex("step"): _StorageInfo("__0_0.distcp", 0, 5),
               MetadataIndex("name"): _StorageInfo("__2_0.distcp", 0, 9)}
    for fqn in ("big", "grid", "scalar"):
        for i, c in enumerate(sdm[fqn].chunks):
            if (fqn, i) != ("big", 7):
                storage[MetadataIndex(fqn, c.offsets, i)] = _StorageInfo(
                    f"__{i % 3}_0.distcp", 64 * i, 8)
    md = Metadata(sdm, storage_data=storage)
    raw = write_pair(tmp_path, md)
    index = c_tables(raw)
    regions = {"big": [None, ((200,), (40,)), ((0,), (1,)), ((3 * n - 1,), (1,))],
               "grid": [((1, 2), (3, 3))], "scalar": [((), ())], "step": [None],
               "name": [None], "absent": [None]}
    answers = {(fqn, r): _C.md_index_region(index, fqn, r, *ARGS)
               for fqn, rs in regions.items() for r in rs}
    assert all(answers[("big", r)][2] for r in regions["big"][1:])
    answers[("keys", None)] = set(sdm)
    answers[("byte_info", None)] = _C.md_index_bytes(index, _StorageInfo)
    data = (tmp_path / li.INDEX_FN).read_bytes()
    return answers, data


def _check(tmp_path, answers: dict) -> str:
    ix = li.LoadIndex.open(tmp_path)
    if ix is None:
        return "refused"
    with ix:
        _expected(answers, ix)
    return "opened"


def test_every_single_byte_change_is_refused_or_harmless(tmp_path):
    answers, data = _small_case(tmp_path)
    path = tmp_path / li.INDEX_FN
    fd = os.open(path, os.O_RDWR)
    seen = {"refused": 0, "opened": 0}
    try:
        for at in range(len(data)):
            for mask in (0x01, 0x80) if at < li.HEADER_LEN else (0x5A,):
                os.pwrite(fd, bytes([data[at] ^ mask]), at)
                seen[_check(tmp_path, answers)] += 1
            os.pwrite(fd, data[at:at + 1], at)
    finally:
        os.close(fd)
    # every header byte counts; body bytes no lookup reads are harmless
    assert seen["refused"] >= 2 * li.HEADER_LEN and seen["opened"] > 0, seen


def test_truncated_and_garbled_indexes(tmp_path):
    answers, data = _small_case(tmp_path)
    path = tmp_path / li.INDEX_FN
    for n in list(range(0, 200)) + list(range(200, len(data), 37)) + [len(data) - 1]:
        path.write_bytes(data[:n])
        assert li.LoadIndex.open(tmp_path) is None
    path.write_bytes(data + b"\0")
    assert li.LoadIndex.open(tmp_path) is None
    rng = random.Random(2)
    for _ in range(300):
        garbled = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(li.HEADER_LEN, len(data))
            span = rng.randint(1, 64)
            garbled[at:at + span] = bytes(rng.randrange(256) for _ in range(span))[:len(data) - at]
        path.write_bytes(bytes(garbled))
        _check(tmp_path, answers)


def _forge_header(data: bytes, **fields) -> bytes:
    """The header with some fields replaced and its CRC made again."""
    names = ("magic", "version", "md_crc", "md_len", "body_len", "body_crc", "nkeys",
             "ndtypes", "nfiles", "nbytes", "r0", "r1")
    values = dict(zip(names, li._HDR.unpack_from(data)))
    values.update(fields)
    hdr = li._HDR.pack(*(values[n] for n in names))
    return hdr + struct.pack("<I", _C.crc32(hdr)) + data[li.HEADER_LEN:]


def _forge_key_row(data: bytes, i: int, **fields) -> bytes:
    names = ("hash", "name_off", "name_len", "name_crc", "kind", "ndim", "dtype", "nchunks",
             "area", "file", "offset", "length")
    at = li.HEADER_LEN + li._HEAD_LEN + li._KEY_W * i
    values = dict(zip(names, li._KEY.unpack_from(data, at)))
    values.update(fields)
    row = li._KEY.pack(*(values[n] for n in names))
    row += struct.pack("<I", _C.crc32(row, i))
    return data[:at] + row + data[at + len(row):]


def test_forged_counts_and_lengths_allocate_nothing_large(tmp_path):
    """An index crafted with valid CRCs whose counts and lengths claim more
    than the file holds: refused at open, or at the lookup, with nothing
    allocated in proportion to the claim."""
    md = _md(200)
    write_pair(tmp_path, md)
    path = tmp_path / li.INDEX_FN
    data = path.read_bytes()
    huge = 2 ** 32 - 1
    for fields in ({"nkeys": huge}, {"nfiles": huge}, {"ndtypes": huge}, {"nbytes": huge},
                   {"nkeys": 1000}, {"body_len": 2 ** 63}, {"version": 3}, {"r0": 1}):
        path.write_bytes(_forge_header(data, **fields))
        assert li.LoadIndex.open(tmp_path) is None, fields
    path.write_bytes(data)
    with li.LoadIndex.open(tmp_path) as ix:
        order = [ix._key_row(i) for i in range(ix.nkeys)]
    w = [i for i, row in enumerate(order) if row[4] == li._TENSOR][0]
    s = [i for i, row in enumerate(order) if row[4] == li._BYTES][0]
    for i, fields in ((w, {"nchunks": huge}), (w, {"name_len": huge}), (w, {"area": 2 ** 63}),
                      (w, {"ndim": 65}), (w, {"ndim": 40}), (w, {"dtype": 9}), (w, {"kind": 7}),
                      (s, {"file": huge}), (s, {"offset": 2 ** 63}), (s, {"name_off": 2 ** 63})):
        path.write_bytes(_forge_key_row(data, i, **fields))
        with li.LoadIndex.open(tmp_path) as ix:
            tracemalloc.start()
            try:
                for call in (lambda: ix.region("w", ((0,), (400,))), ix.keys, ix.byte_info,
                             lambda: ix.region("step", None)):
                    try:
                        call()
                    except li.LoadIndexCorrupt as e:
                        assert li.INDEX_FN in str(e)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < 4 * len(data) + (1 << 20), (fields, peak)


def test_a_forged_index_names_no_file_outside_the_checkpoint(tmp_path):
    """Names are checked as dcpx checks .metadata's: a crafted index with
    valid CRCs cannot point a read at another directory."""
    md = _md()
    write_pair(tmp_path, md)
    path = tmp_path / li.INDEX_FN
    data = path.read_bytes()
    with li.LoadIndex.open(tmp_path) as ix:
        files_at = li.HEADER_LEN + ix._files_at
        rows = [files_at + li._FILE_W * i for i in range(ix.nfiles)]
    good = b"__0_0.distcp"
    at = data.index(good, li.HEADER_LEN)
    (row_at, i), = [(r, i) for i, r in enumerate(rows)
                    if li._FILE.unpack_from(data, r)[0] + li.HEADER_LEN == at]
    for bad in ("../x", "/etc/passwd", "a\\b", "..", ".", "a\0b", ""):
        raw = bad.encode()
        forged = data[:at] + raw + data[at + len(raw):]
        row = li._FILE.pack(at - li.HEADER_LEN, len(raw), _C.crc32(raw)) + b"\0" * 4
        row += struct.pack("<I", _C.crc32(row, i))
        path.write_bytes(forged[:row_at] + row + forged[row_at + len(row):])
        with li.LoadIndex.open(tmp_path) as ix:
            with pytest.raises(li.LoadIndexCorrupt, match="data file name"):
                ix.region("w", ((0,), (8,)))
            with pytest.raises(li.LoadIndexCorrupt, match="data file name"):
                ix.byte_info()


def _forge_row(data: bytes, ordinal: int, row: tuple, j: int, **fields) -> bytes:
    """Chunk row j (sorted order) of the tensor key at ``ordinal`` (its key
    row ``row``) with fields replaced, and the CRCs above it made again:
    its leaf's in its fence block, the block's in the head, the head's."""
    nd, n, area = row[5], row[7], row[8]
    head_len, fence_at, fstride, rows_at, stride, _, nleaves, nfb = li._Area(area, nd, n)
    k = 2 * nd + 5
    per = li._leaf_rows(8 * k)
    leaf, r = divmod(j, per)
    buf = bytearray(data)
    h = li.HEADER_LEN
    at = h + rows_at + stride * leaf + 8 * k * r
    vals = list(struct.unpack_from(f"<{k}Q", buf, at))
    names = ["off%d" % d for d in range(nd)] + ["sz%d" % d for d in range(nd)] + \
        ["maxend", "pos", "file", "offset", "length"]
    for name, v in fields.items():
        vals[names.index(name)] = v
    struct.pack_into(f"<{k}Q", buf, at, *vals)
    cnt = min(per, n - leaf * per)
    leaf_at = h + rows_at + stride * leaf
    fb, e = divmod(leaf, li._FENCE_BLOCK)
    entry_at = h + fence_at + fstride * fb + 12 * e
    start, _ = li._FENCE.unpack_from(buf, entry_at)
    li._FENCE.pack_into(buf, entry_at, start, _C.crc32(bytes(buf[leaf_at:leaf_at + 8 * k * cnt])))
    fcnt = min(li._FENCE_BLOCK, nleaves - li._FENCE_BLOCK * fb)
    block = bytes(buf[h + fence_at + fstride * fb:h + fence_at + fstride * fb + 12 * fcnt])
    top_at = h + area + 8 * nd + 12 * fb
    first, _ = li._FENCE.unpack_from(buf, top_at)
    li._FENCE.pack_into(buf, top_at, first, _C.crc32(block))
    struct.pack_into("<I", buf, h + area + head_len - 4,
                     _C.crc32(bytes(buf[h + area:h + area + head_len - 4]), ordinal))
    return bytes(buf)


def test_forged_chunk_rows_are_checked(tmp_path):
    """Rows crafted with every CRC made again: a chunk outside its tensor,
    a position, a file or an extent out of range is refused; a harmless
    change (the storage offset) is answered as the index says."""
    md = _md(100)
    write_pair(tmp_path, md)
    path = tmp_path / li.INDEX_FN
    data = path.read_bytes()
    with li.LoadIndex.open(tmp_path) as ix:
        ordinal, row = ix._find("w")
        nfiles = ix.nfiles
    for fields, match in (({"sz0": 3}, "outside the tensor"), ({"off0": 2 ** 64 - 1}, "outside"),
                          ({"pos": 100}, "chunk row"), ({"file": nfiles + 1}, "chunk row"),
                          ({"offset": 2 ** 63}, "chunk row"), ({"length": 2 ** 64 - 1}, "chunk row")):
        path.write_bytes(_forge_row(data, ordinal, row, 99, **fields))
        with li.LoadIndex.open(tmp_path) as ix:
            assert ix.region("w", ((0,), (2,)))[2] == md.state_dict_metadata["w"].chunks[:1]
            with pytest.raises(li.LoadIndexCorrupt, match=match):
                ix.region("w", ((198,), (2,)))
    path.write_bytes(_forge_row(data, ordinal, row, 99, offset=4096))
    with li.LoadIndex.open(tmp_path) as ix:  # (a crafted pair can differ: only checks)
        assert ix.region("w", ((198,), (2,)))[3] == [_StorageInfo("__99_0.distcp", 4096, 8)]


# --- what the index cannot represent ------------------------------------------------

def _tensor(size, chunks, dtype=torch.float32) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                                  for o, s in chunks])


def test_build_body_declines_what_it_cannot_represent():
    info = _StorageInfo("__0_0.distcp", 0, 4)
    ok_sdm = {"w": _tensor([4], [((0,), (4,))]), "s": BytesStorageMetadata()}
    ok_sd = {MetadataIndex("w", torch.Size([0]), 0): info, MetadataIndex("s"): info}
    assert li.build_body(Metadata(ok_sdm, storage_data=ok_sd)) is not None

    def body(sdm=None, sd=None):
        return li.build_body(Metadata({**ok_sdm, **(sdm or {})},
                                      storage_data={**ok_sd, **(sd or {})}))

    if li._HAS_TD:
        assert body(sd={MetadataIndex("w", torch.Size([0]), 0):
                        _StorageInfo("__0_0.distcp", 0, 4, transform_descriptors=["zstd"])}) is None
    assert body(sd={MetadataIndex("x", torch.Size([0])): info}) is None        # no such key
    assert body(sd={MetadataIndex("x"): info}) is None
    big = _tensor([1] * 65, [((0,) * 65, (1,) * 65)])                       # 65 dims
    assert li.build_body(Metadata({"w": big}, storage_data={
        MetadataIndex("w", torch.Size([0] * 65)): info})) is None
    assert li.build_body(Metadata({"w": _tensor([1] * 64, [((0,) * 64, (1,) * 64)])}, storage_data={
        MetadataIndex("w", torch.Size([0] * 64)): info})) is not None
    odd = _tensor([4], [((0,), (4,))])
    odd.properties = TensorProperties(dtype="float32")                     # not a dtype
    assert body(sdm={"w": odd}) is None
    assert body(sdm={"w": _tensor([4], [((0,), (4,)), ((0,), (2,))])}) is None  # twice at 0
    assert li.build_body(Metadata(ok_sdm, storage_data={
        MetadataIndex("w", torch.Size([0])): info})) is None                 # a value without entry
    assert body(sd={MetadataIndex("s", torch.Size([0])): info}) is None      # a value's 2nd entry
    assert body(sd={MetadataIndex("w", torch.Size([2])): info}) is None      # no chunk has it
    assert body(sd={MetadataIndex("w"): info}) is None                        # offset None, a tensor
    assert li.build_body(Metadata({"w": _tensor([4], [((2,), (4,))])}, storage_data={
        MetadataIndex("w", torch.Size([2])): info})) is None                  # outside it
    assert li.build_body(Metadata({"w": _tensor([4], [((-1,), (2,))])}, storage_data={
        MetadataIndex("w", torch.Size([-1])): info})) is None                 # negative
    assert li.build_body(Metadata({"w": _tensor([4, 4], [((0,), (4,))])}, storage_data={
        MetadataIndex("w", torch.Size([0])): info})) is None                  # another ndim
    assert li.build_body(Metadata({"w": _tensor([-4], [])}, storage_data={})) is None
    for name in ("", "a/b", "a\\b", "a\0b", ".", ".."):
        assert body(sd={MetadataIndex("s"): _StorageInfo(name, 0, 4)}) is None, name
    assert body(sd={MetadataIndex("s"): _StorageInfo("f", -1, 4)}) is None
    assert body(sd={MetadataIndex("s"): _StorageInfo("f", 0, 2 ** 63)}) is None
    assert body(sdm={"v": object()}) is None
    assert li.build_body(object()) is None
    # an empty checkpoint, a tensor with no chunks: representable
    assert li.build_body(Metadata({}, storage_data={})) is not None
    assert li.build_body(Metadata({"e": _tensor([0, 3], [])}, storage_data={})) is not None


def test_the_index_is_a_name_dcp_never_uses():
    from dcpx.formats import files
    assert li.INDEX_FN == ".metadata.index"
    assert not files.replaced_by_a_save(li.INDEX_FN)
