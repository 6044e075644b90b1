"""Unit tests of dcpx's multi-process planning (dcpx/coordination/dist.py) that need no
process group: the coordinator's dedup and metadata, load-time overlap
search, coverage checks, and the lazily decoded Metadata of non-coordinator
ranks.  The spawned multi-rank tests are in test_dist_*.py."""
import dataclasses
import pickle
import random
import time

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from dcpx.coordination import dist as _dist
from dcpx.formats import metadata as _metadata
from dcpx.errors import CheckpointError


def item(fqn, offsets=(0,), sizes=(4,), size=(4,), dtype=torch.float32, nbytes=None):
    if offsets is None:
        return _dist.LocalItem(fqn, None, None, None, None, False, False, nbytes or 10)
    n = nbytes if nbytes is not None else 4 * int(torch.Size(sizes).numel())
    return _dist.LocalItem(fqn, tuple(offsets), tuple(sizes), tuple(size), dtype, False, False, n)


def test_replicated_items_written_once_and_balanced():
    items = [item(f"p{i}", sizes=(100 * (i + 1),), size=(100 * (i + 1),)) for i in range(40)]
    plan = _dist.global_plan([items] * 4, [{}] * 4)
    written = sorted(i for a in plan.assign for i in a)
    assert written == list(range(40))                       # each item exactly once
    loads = [sum(items[i].nbytes for i in a) for a in plan.assign]
    assert max(loads) - min(loads) <= max(it.nbytes for it in items)   # greedy balance
    assert all(len(md.chunks) == 1 for md in plan.state_dict_metadata.values())


def test_sharded_chunks_kept_per_rank_and_replicas_deduped():
    # rank r holds row-shard r of "w" (4 ranks) and a replica of "b" and of a bytes value.
    plans = [[item("w", (2 * r, 0), (2, 3), (8, 3)), item("b"), item("step", None)]
             for r in range(4)]
    plan = _dist.global_plan(plans, [{"w": ("w",)}] * 4)
    w = plan.state_dict_metadata["w"]
    assert [tuple(c.offsets) for c in w.chunks] == [(0, 0), (2, 0), (4, 0), (6, 0)]
    assert all(0 in a for a in plan.assign)                 # every rank writes its shard
    holders_b = [r for r, a in enumerate(plan.assign) if 1 in a]
    holders_s = [r for r, a in enumerate(plan.assign) if 2 in a]
    assert len(holders_b) == 1 and len(holders_s) == 1
    assert isinstance(plan.state_dict_metadata["step"], BytesStorageMetadata)
    assert plan.index[(0, 0)] == MetadataIndex("w", torch.Size([0, 0]))
    assert plan.planner_data == {"w": ("w",)}


@pytest.mark.parametrize("other", [
    item("w", sizes=(4,), size=(4,), dtype=torch.float16),   # dtype differs
    item("w", sizes=(4,), size=(5,)),                        # global size differs
    item("w", None),                                         # tensor vs value
])
def test_ranks_disagreeing_about_a_key_is_an_error_naming_it(other):
    with pytest.raises(CheckpointError, match="'w'"):
        _dist.global_plan([[item("w")], [other]], [{}, {}])


def _chunks_1d(bounds):
    return [ChunkStorageMetadata(offsets=torch.Size([a, 0]), sizes=torch.Size([b - a, 8]))
            for a, b in zip(bounds, bounds[1:])]


def test_chunk_index_matches_brute_force():
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, 999), rng.randint(10, 60)))
        chunks = _chunks_1d([0] + cuts + [1000])
        rng.shuffle(chunks)
        idx = _dist._ChunkIndex(chunks)
        for _ in range(20):
            lo = rng.randrange(0, 1000)
            hi = rng.randrange(lo + 1, 1001)
            want = {tuple(c.offsets) for c in chunks
                    if c.offsets[0] < hi and c.offsets[0] + c.sizes[0] > lo}
            got = {tuple(c.offsets) for c in idx.overlapping(lo, hi)}
            assert got == want


def _metadata_for(chunks, size):
    md = TensorStorageMetadata(properties=_metadata.properties(torch.float32, False, False),
                               size=torch.Size(size), chunks=chunks)
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    storage = {MetadataIndex("w", c.offsets): _StorageInfo("__0_0.distcp", 0, 1) for c in chunks}
    return Metadata(state_dict_metadata={"w": md}, storage_data=storage)


class _Reader:
    path = "ckpt"


def test_plan_reads_cost_grows_with_overlaps_not_with_all_chunks():
    """4096 saved row chunks loaded by 4096 row-regions: with the index each
    region scans its one overlapping chunk (a scan of all chunks per region
    would be 16.7 M chunk tests)."""
    n = 4096
    md = _metadata_for(_chunks_1d(list(range(n + 1))), (n, 8))
    reads_total, cache = 0, {}
    t0 = time.perf_counter()
    for r in range(n):
        region = ChunkStorageMetadata(offsets=torch.Size([r, 0]), sizes=torch.Size([1, 8]))
        cands = _dist._candidates(md.state_dict_metadata["w"], cache, "w",
                                  region.offsets, region.sizes)
        reads_total += len(cands)
    elapsed = time.perf_counter() - t0
    assert reads_total == n             # exactly the overlapping chunk, each time
    assert elapsed < 5.0                # generous; brute force checks 16.7 M pairs



def test_plan_reads_resharding_regions_and_coverage(monkeypatch):
    """A [10, 4] tensor saved as row chunks [0,3) [3,7) [7,10).  Read whole:
    each chunk straight into its rows.  Read as the region rows [2, 8) (a
    DTensor shard): the middle chunk whole, the outer two narrowed to rows
    [2,3) and [7,8), each into the right rows of the shard."""
    chunks = [ChunkStorageMetadata(offsets=torch.Size([a, 0]), sizes=torch.Size([b - a, 4]))
              for a, b in [(0, 3), (3, 7), (7, 10)]]
    md = _metadata_for(chunks, (10, 4))
    dest = torch.zeros(10, 4)
    reads, byte_keys = _dist.plan_reads(_Reader(), md, {"w": dest}, False)
    assert byte_keys == [] and [r.narrow for r in reads] == [None, None, None]
    assert [r.target.data_ptr() for r in reads] == [dest[a].data_ptr() for a in (0, 3, 7)]

    shard = torch.zeros(6, 4)
    monkeypatch.setattr(_dist, "local_chunk",
                        lambda obj: (shard, torch.Size([2, 0]), torch.Size([6, 4])))
    reads, _ = _dist.plan_reads(_Reader(), md, {"w": dest}, False)
    got = sorted((tuple(r.chunk), r.narrow, r.target.data_ptr(), tuple(r.target.shape))
                 for r in reads)
    row = shard.stride(0) * shard.element_size()
    p = shard.data_ptr()
    assert got == sorted([
        ((3, 4), ((2, 0), (1, 4)), p, (1, 4)),            # rows 2 of chunk [0,3)
        ((4, 4), None, p + 1 * row, (4, 4)),              # chunk [3,7) whole
        ((3, 4), ((0, 0), (1, 4)), p + 5 * row, (1, 4)),  # row 7 of chunk [7,10)
    ])
    # Chunks that do not cover the region: refused, naming the key.
    md.state_dict_metadata["w"].chunks = chunks[:2]
    with pytest.raises(CheckpointError, match="'w'.*cover|cover.*'w'"):
        _dist.plan_reads(_Reader(), md, {"w": dest}, False)


def test_lazy_metadata_decodes_on_first_use_and_pickles_as_metadata():
    items = [item("a"), item("v", None)]
    plan = _dist.global_plan([items], [{"a": ("a",)}])
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    md = Metadata(state_dict_metadata=plan.state_dict_metadata, planner_data=plan.planner_data,
                  storage_data={plan.index[(0, i)]: _StorageInfo("f", i, 1) for i in range(2)})
    data = _metadata.dumps(md)
    lazy = _dist._LazyMetadata(data, "x/.metadata")
    assert "_dcpx_encoded" in lazy.__dict__
    assert isinstance(lazy, Metadata)
    assert lazy.storage_data == md.storage_data     # a field with a class default first
    assert "_dcpx_encoded" not in lazy.__dict__
    for f in dataclasses.fields(Metadata):
        assert getattr(lazy, f.name) == getattr(md, f.name), f.name
    again = pickle.loads(pickle.dumps(_dist._LazyMetadata(data, "x")))
    assert type(again) is Metadata and again == md
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    broken = _dist._LazyMetadata(bytes(bad), "x/.metadata")
    with pytest.raises(Exception, match="x/.metadata"):
        broken.storage_data


def test_metadata_pickle_is_torch_loadable_and_smaller():
    """dcpx's pickler writes _StorageInfo as a constructor call; plain pickle
    (torch's reader) gets equal objects."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    items = [item(f"p{i}") for i in range(100)]
    plan = _dist.global_plan([items], [{}])
    md = Metadata(state_dict_metadata=plan.state_dict_metadata,
                  storage_data={plan.index[(0, i)]: _StorageInfo("__0_0.distcp", 64 * i, 60)
                                for i in range(100)})
    data = _metadata.dumps(md)
    plain = pickle.dumps(md, protocol=5)
    assert pickle.loads(data) == md
    assert len(data) < len(plain)
