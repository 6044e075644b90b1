"""Loads through the load index (issue 28 item 4): a rank that loads its
region of a sharded checkpoint with an index beside ``.metadata`` never
reads ``.metadata``, and gets the same bytes; a damaged index falls back to
``.metadata`` (same bytes); an index made for another ``.metadata`` is not
used."""
from __future__ import annotations

import pytest
import torch

from dcpx.coordination import dist as _dist, readplan as _readplan
from dcpx.formats import loadindex as _loadindex, metadata as _metadata
from dcpx.storage.reader import FileSystemReader

from conftest import assert_bit_equal
from test_region_plan import _fake_local_chunk, _sharded_checkpoint


@pytest.fixture(autouse=True)
def _fresh_cache():
    _readplan.clear()
    yield
    _readplan.clear()


def _write_index(path) -> bytes:
    raw = (path / _metadata.METADATA_FN).read_bytes()
    _, crc, n = _metadata._TRAILER.unpack(raw[-_metadata._TRAILER.size:])
    md = _metadata.loads(raw, str(path))
    body = _loadindex.build_body(md)
    assert body is not None
    data = _loadindex.header(body, crc, n) + body
    (path / _loadindex.INDEX_FN).write_bytes(data)
    return data


def _shards():
    g = torch.Generator().manual_seed(1)
    return {"w": (torch.randn(256, 3, generator=g), list(range(0, 257, 4))),
            "b": (torch.randint(-9, 9, (128,), generator=g).to(torch.int16),
                  list(range(0, 129, 2)))}


def _load_region(monkeypatch, path, shards, rows) -> tuple:
    """Plan and read one rank's rows; (the checkpoint opened, how many
    times .metadata was read)."""
    reads_md = [0]
    real = FileSystemReader._read_metadata_file

    def counted(self, rank):
        reads_md[0] += 1
        return real(self, rank)
    monkeypatch.setattr(FileSystemReader, "_read_metadata_file", counted)
    regions = {"w": ((256, 3), rows), "b": ((128,), ((rows[0][0],), (rows[1][0],)))}
    flat = _fake_local_chunk(monkeypatch, regions,
                             {fqn: full.dtype for fqn, (full, _) in shards.items()})
    reader = FileSystemReader(path)
    ck = _dist.open_checkpoint(reader, None)
    opened_with_index = ck.lidx is not None
    reads, byte_keys, serial = _dist.plan_checked(reader, ck, flat, False)
    reader.read_tensors(reads)
    for fqn, (full, _) in shards.items():
        (o, n) = regions[fqn][1]
        assert_bit_equal(_dist.local_chunk(flat[fqn])[0], full[o[0]:o[0] + n[0]])
    monkeypatch.setattr(FileSystemReader, "_read_metadata_file", real)
    return opened_with_index, reads_md[0]


def test_a_rank_loads_its_region_through_the_index_without_reading_the_metadata(
        tmp_path, monkeypatch):
    shards = _shards()
    path = tmp_path / "ck"
    _sharded_checkpoint(path, shards)
    _write_index(path)
    for rows in (((8, 0), (4, 3)), ((10, 0), (7, 3))):
        assert _load_region(monkeypatch, path, shards, rows) == (True, 0)


def test_a_damaged_index_falls_back_to_the_metadata(tmp_path, monkeypatch):
    shards = _shards()
    path = tmp_path / "ck"
    _sharded_checkpoint(path, shards)
    data = bytearray(_write_index(path))
    # one byte of the body changed at a time: the same bytes load, from
    # the index where the lookups did not meet the damage, else from
    # .metadata (read once)
    seen = set()
    for at in range(len(data) - 1, _loadindex.HEADER_LEN, -97):
        bad = bytearray(data)
        bad[at] ^= 0x5A
        (path / _loadindex.INDEX_FN).write_bytes(bytes(bad))
        _readplan.clear()
        opened, md_reads = _load_region(monkeypatch, path, shards, ((10, 0), (7, 3)))
        assert opened and md_reads <= 1
        seen.add(md_reads)
    assert seen == {0, 1}


def test_an_index_of_another_metadata_is_not_used(tmp_path, monkeypatch):
    shards = _shards()
    path = tmp_path / "ck"
    _sharded_checkpoint(path, shards)
    old = _write_index(path)
    _sharded_checkpoint(path, shards)  # saved again: a new .metadata, the old index stays
    assert (path / _loadindex.INDEX_FN).read_bytes() == old
    assert _load_region(monkeypatch, path, shards, ((8, 0), (4, 3))) == (False, 1)


def test_a_body_built_with_the_save_tag_names_the_files_of_each_header_s_tag(tmp_path):
    """dcpx names data files ``__{rank}_{tag}_{i}.distcp``, the tag new per
    save: a body built with the tag holds a hole there, and the header's
    tag fills it, so a later save of the same layout reuses the body under
    its own header and its own file names; a name without the tag, or one
    that holds the hole already, is not indexed."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata)
    old, new = "0123456789abcdef", "fedcba9876543210"

    def md(tag, names=None):
        chunks = [ChunkStorageMetadata(torch.Size([4 * r]), torch.Size([4])) for r in range(3)]
        storage = {MetadataIndex("w", c.offsets): _StorageInfo(
            (names or {}).get(r, f"__{r}_{tag}_0.distcp"), 0, 16) for r, c in enumerate(chunks)}
        return Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                    torch.Size([12]), chunks)},
                        storage_data=storage)
    body = _loadindex.build_body(md(old), tag=old)
    assert body is not None and old.encode() not in body
    assert body == _loadindex.build_body(md(new), tag=new)  # the same bytes
    for tag in (old, new):
        path = tmp_path / tag
        path.mkdir()
        raw = _metadata.dumps(md(tag))
        (path / _metadata.METADATA_FN).write_bytes(raw)
        _, crc, n = _metadata._TRAILER.unpack(raw[-_metadata._TRAILER.size:])
        (path / _loadindex.INDEX_FN).write_bytes(_loadindex.header(body, crc, n, tag=tag) + body)
        with _loadindex.LoadIndex.open(path) as idx:
            _, _, chunks, infos = idx.region("w", ((0,), (12,)))
            assert [i.relative_path for i in infos] == [f"__{r}_{tag}_0.distcp" for r in range(3)]
    assert _loadindex.build_body(md(old, {1: "__1_0.distcp"}), tag=old) is None
    assert _loadindex.build_body(md(old, {1: "__1_????????????????_0.distcp"})) is None
    assert _loadindex.build_body(md(old), tag="not-a-tag") is None
