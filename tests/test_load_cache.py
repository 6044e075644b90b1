"""The load side's cache (dcpx/coordination/readplan.py): the checked metadata of a
checkpoint and a compiled read plan per destination layout are reused by
later loads, and never serve anything but what a load without the cache
would: the new data after a new save, an error for corrupted data on every
load, the right values into a destination of another layout."""
from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint import DefaultLoadPlanner

import dcpx
from dcpx.formats import metadata as _metadata
from dcpx.coordination import readplan as _readplan
from dcpx.errors import CorruptCheckpointError

from conftest import assert_bit_equal, fast_writer, flip_byte, locate


def _state(seed: int, n: int = 40, shape=(3, 5), dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i // 4}.p{i % 4}": torch.randn(shape, generator=g).to(dtype)
            for i in range(n)}


def _save(sd: dict, path) -> None:
    dcpx.save(sd, storage_writer=fast_writer(path))


def _empty_like(sd: dict) -> dict:
    return {k: torch.full_like(v, -1) for k, v in sd.items()}


def _assert_loaded(dst: dict, src: dict) -> None:
    assert dst.keys() == src.keys()
    for k in src:
        assert_bit_equal(dst[k], src[k], k)


@pytest.fixture(autouse=True)
def _fresh_cache():
    _readplan.clear()
    yield
    _readplan.clear()


@pytest.fixture
def parses(monkeypatch):
    """How many times a .metadata file was parsed (into Metadata objects by
    _metadata.loads, or into the C decoder's tables by _metadata.index)."""
    count = [0]

    def counted(real):
        def spy(*a, **kw):
            count[0] += 1
            return real(*a, **kw)
        return spy
    monkeypatch.setattr(_metadata, "loads", counted(_metadata.loads))
    monkeypatch.setattr(_metadata, "index", counted(_metadata.index))
    return count


def _plans(path) -> int:
    ck = _readplan._cache.get(str(os.path.join(path, ".metadata")))
    return 0 if ck is None else len(ck.plans)


def test_repeated_loads_parse_the_metadata_once_and_reuse_the_plan(tmp_path, parses):
    src = _state(0)
    _save(src, tmp_path / "c")
    dst = _empty_like(src)
    for _ in range(3):
        for t in dst.values():
            t.fill_(7)
        dcpx.load(dst, checkpoint_id=tmp_path / "c")
        _assert_loaded(dst, src)
    assert parses[0] == 1
    assert _plans(tmp_path / "c") == 1


def test_overwritten_checkpoint_loads_the_new_data_and_layout(tmp_path):
    path = tmp_path / "c"
    first = _state(0)
    _save(first, path)
    dst = _empty_like(first)
    dcpx.load(dst, checkpoint_id=path)
    dcpx.load(dst, checkpoint_id=path)
    _assert_loaded(dst, first)
    # Same keys and layout, new values: the new .metadata is a new file.
    second = _state(1)
    _save(second, path)
    dcpx.load(dst, checkpoint_id=path)
    _assert_loaded(dst, second)
    # New shapes and dtypes under the same keys.
    third = _state(2, shape=(7,), dtype=torch.float64)
    _save(third, path)
    with pytest.raises(Exception, match="Size mismatch"):
        dcpx.load(dst, checkpoint_id=path)
    dst = _empty_like(third)
    dcpx.load(dst, checkpoint_id=path)
    _assert_loaded(dst, third)


def test_metadata_rewritten_in_place_with_same_size_and_mtime(tmp_path):
    path, other = tmp_path / "c", tmp_path / "d"
    first, second = _state(0), _state(1)
    _save(first, path)
    _save(second, other)
    md_path = path / ".metadata"
    new = (other / ".metadata").read_bytes()
    assert len(new) == md_path.stat().st_size  # same layout: same length
    dst = _empty_like(first)
    dcpx.load(dst, checkpoint_id=path)
    dcpx.load(dst, checkpoint_id=path)
    _assert_loaded(dst, first)
    for name in os.listdir(other):
        if name.endswith(".distcp"):
            shutil.copy(other / name, path / name)
    st = md_path.stat()
    with open(md_path, "r+b") as f:  # same inode, same size
        f.write(new)
    os.utime(md_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = md_path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size,
                                                                 st.st_mtime_ns)
    dcpx.load(dst, checkpoint_id=path)
    _assert_loaded(dst, second)


def test_destination_of_another_layout_after_a_cached_plan(tmp_path):
    path = tmp_path / "c"
    src = _state(0)
    _save(src, path)
    dst = _empty_like(src)
    dcpx.load(dst, checkpoint_id=path)
    dcpx.load(dst, checkpoint_id=path)
    # A tensor replaced by another object: the data goes to the new one.
    keys = list(src)
    dst[keys[0]] = torch.zeros(3, 5)
    # Another dtype: a cast, as torch does it.
    dst[keys[1]] = torch.zeros(3, 5, dtype=torch.float64)
    # Non-contiguous memory.
    dst[keys[2]] = torch.zeros(5, 3).t()
    # A neg view (the DLPack export would ignore its bit).
    neg = torch._neg_view(torch.zeros(3, 5))
    dst[keys[3]] = neg
    # Another type of tensor value: a Parameter.
    dst[keys[4]] = torch.nn.Parameter(torch.zeros(3, 5))
    dcpx.load(dst, checkpoint_id=path)
    assert_bit_equal(dst[keys[0]], src[keys[0]])
    assert torch.equal(dst[keys[1]], src[keys[1]].double())
    assert_bit_equal(dst[keys[2]].contiguous(), src[keys[2]])
    assert torch.equal(neg, src[keys[3]])
    assert torch.equal(dst[keys[4]].detach(), src[keys[4]])
    for k in keys[5:]:
        assert_bit_equal(dst[k], src[k], k)
    # And back to plain tensors: a plan for that layout again.
    dst = _empty_like(src)
    dcpx.load(dst, checkpoint_id=path)
    dcpx.load(dst, checkpoint_id=path)
    _assert_loaded(dst, src)


def test_partial_load_plans_are_kept_apart(tmp_path):
    path = tmp_path / "c"
    src = _state(0)
    _save(src, path)
    dst = _empty_like(src)
    dst["extra"] = torch.zeros(2)
    planner = DefaultLoadPlanner(allow_partial_load=True)
    for _ in range(2):
        dcpx.load(dst, checkpoint_id=path, planner=planner)
        assert torch.equal(dst["extra"], torch.zeros(2))
        for k in src:
            assert_bit_equal(dst[k], src[k], k)
    with pytest.raises(Exception, match="Missing key in checkpoint state_dict: extra"):
        dcpx.load(dst, checkpoint_id=path)


def test_dtype_cast_loads_repeat(tmp_path):
    path = tmp_path / "c"
    src = _state(0)
    _save(src, path)
    dst = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in src.items()}
    for _ in range(3):
        dcpx.load(dst, checkpoint_id=path)
        for k in src:
            assert torch.equal(dst[k], src[k].to(torch.bfloat16)), k


@pytest.mark.parametrize("shape", [(3, 5), (32, 64)], ids=["copied", "read-into-place"])
def test_corrupted_data_is_caught_on_every_load(tmp_path, shape):
    """Tensors of 4 KiB and more are read straight into their destinations
    by a plan's later runs (csrc/reader.c, read_run): CRC-checked there."""
    path = tmp_path / "c"
    src = _state(0, shape=shape)
    _save(src, path)
    dst = _empty_like(src)
    dcpx.load(dst, checkpoint_id=path)
    dcpx.load(dst, checkpoint_id=path)
    md = dcpx.FileSystemReader(path).read_metadata()
    key = list(src)[5]
    file, off, _ = locate(path, md, key)
    st = os.stat(file)
    flip_byte(file, off + 1)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same identity
    for _ in range(3):
        with pytest.raises(CorruptCheckpointError, match=f"{key}.*CRC-32 mismatch"):
            dcpx.load(dst, checkpoint_id=path)
    flip_byte(file, off + 1)
    dcpx.load(dst, checkpoint_id=path)
    _assert_loaded(dst, src)


def test_missing_data_file_after_a_cached_load_is_reported_as_without_cache(tmp_path):
    path = tmp_path / "c"
    src = _state(0)
    _save(src, path)
    dst = _empty_like(src)
    dcpx.load(dst, checkpoint_id=path)
    dcpx.load(dst, checkpoint_id=path)
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            os.unlink(path / name)
    with pytest.raises(CorruptCheckpointError, match="is missing"):
        dcpx.load(dst, checkpoint_id=path)


def test_torch_written_checkpoint(tmp_path, parses):
    path = tmp_path / "c"
    src = _state(0)
    src["step"] = 12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(src, checkpoint_id=path, no_dist=True)
    for i in range(3):
        dst = _empty_like({k: v for k, v in src.items() if k != "step"})
        dst["step"] = 0
        dcpx.load(dst, checkpoint_id=path)
        assert dst["step"] == 12
        for k, v in src.items():
            if k != "step":
                assert_bit_equal(dst[k], v, k)
    assert parses[0] == 1
    assert _plans(path) == 1


def test_cache_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(_readplan, "MAX_CHECKPOINTS", 2)
    src = _state(0, n=4)
    for i in range(4):
        _save(src, tmp_path / str(i))
        dcpx.load(_empty_like(src), checkpoint_id=tmp_path / str(i))
    assert len(_readplan._cache) == 2


def test_c_reader_reads_unsorted_items_and_runs(tmp_path):
    """read_items groups adjacent archives into runs whatever the order of
    the items, and each lands in its own destination."""
    path = tmp_path / "c"
    src = _state(0, n=64, shape=(33,))
    src["big"] = torch.randn(300_000)  # an archive larger than a run's member limit
    _save(src, path)
    reader = dcpx.FileSystemReader(path)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    from dcpx.storage.reader import _TensorRead
    reads = []
    for index, info in reversed(list(md.storage_data.items())):
        ch = md.state_dict_metadata[index.fqn].chunks[0]
        reads.append(_TensorRead(index.fqn, info, ch.sizes, torch.float32,
                                 torch.empty(ch.sizes), None))
    reader.read_tensors(reads)
    for r in reads:
        assert_bit_equal(r.target, src[r.key], r.key)


def test_threads_loading_one_checkpoint_share_its_plan(tmp_path):
    """Loads on several threads into state dicts of one layout run the same
    cached plan at the same time (one of them on a copy of its items)."""
    import threading
    path = tmp_path / "c"
    src = _state(0, n=400, shape=(64,))
    _save(src, path)
    dcpx.load(_empty_like(src), checkpoint_id=path)
    errors = []

    def work():
        try:
            for _ in range(5):
                dst = _empty_like(src)
                dcpx.load(dst, checkpoint_id=path)
                _assert_loaded(dst, src)
        except BaseException as e:  # noqa: B902 - reported below
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert _plans(path) == 1


def test_loads_without_a_plan_keep_the_decoded_metadata(tmp_path, parses):
    """A layout that cannot be read through a plan (non-contiguous
    destinations: refused by the C plan) is planned from the C decoder's
    tables, for the keys it loads (dist.region_metadata): the file is
    parsed once, into the tables, and never into Metadata objects."""
    path = tmp_path / "c"
    src = _state(0)
    _save(src, path)
    dst = {k: torch.zeros(5, 3).t() for k in src}
    for _ in range(3):
        dcpx.load(dst, checkpoint_id=path)
        for k in src:
            assert_bit_equal(dst[k].contiguous(), src[k], k)
    assert parses[0] == 1
    ck = _readplan._cache[str(os.path.join(path, ".metadata"))]
    assert ck.index is not None and not ck.decoded
    assert _plans(path) == 0
