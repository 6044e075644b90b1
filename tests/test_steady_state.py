"""Issue 28 items 2 and 5: a save whose plan is unchanged on every rank
takes the steady-state path (fixed-size collectives, the layouts and the
encoded metadata of the last save reused), any change takes the full
exchange in the same save, and both write what torch loads bit-exact; a
DTensor's cached chunk is keyed by this rank's coordinate in its mesh."""
from __future__ import annotations

import os
import pickle
import re
import tempfile

import pytest
import torch

from dist_helpers import spawn

pytestmark = pytest.mark.dist


# ------------------------------------------------------------ item 5

def _rank_swap(rank: int, world: int, store_dir: str) -> list:
    """Join a 2-rank world as ``rank``, then a new one as the other rank:
    the DTensor chunk of the same (shape, mesh, placements) must move."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:  # torch 2.4: the private module only
        from torch.distributed._tensor import Shard, distribute_tensor

    from dcpx.coordination.plan import local_chunk
    out = []
    for run, r in enumerate((rank, 1 - rank)):
        store = dist.FileStore(os.path.join(store_dir, f"store{run}"), world)
        dist.init_process_group("gloo", store=store, rank=r, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        local, offsets, sizes = local_chunk(dt)
        out.append((r, tuple(offsets), tuple(sizes), local.tolist()))
        dist.destroy_process_group()
    return out


@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 5),
                    reason="torch 2.4 hangs joining a second process group in one process "
                           "after destroy_process_group (a rank waits in init_process_group)")
def test_shard_cache_follows_the_rank():
    with tempfile.TemporaryDirectory() as d:
        results = spawn(_rank_swap, 2, d, init_pg=False)
    for per_rank in results:
        for r, offsets, sizes, local in per_rank:
            assert offsets == (4 * r,), (r, offsets)
            assert sizes == (4,)
            assert local == [float(4 * r + i) for i in range(4)]


# ------------------------------------------------------------ item 2

WORLD = 2


def _state(rank: int, step: int, rows: int = 6, dtype=torch.float32, extra: bool = False,
           own_rows: int = 3, cfg: str = "x") -> dict:
    """A DTensor sharded over the ranks, replicated tensors, a rank-local
    one, non-tensor values; values depend on ``step``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from dtensor_api import Shard
    from dist_helpers import dtensor_of, full_value

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    sd = {
        "sh": dtensor_of(full_value(f"{step}.sh", (rows, 4), dtype), mesh, [Shard(0)]),
        "rep": full_value(f"{step}.rep", (5,), torch.bfloat16),
        f"own{rank}": full_value(f"{step}.own{rank}", (own_rows,)),
        "step": step,        # a bytes item whose pickle keeps its size
        "cfg": {"name": cfg},
    }
    if extra:
        sd["extra"] = full_value(f"{step}.extra", (7,))
    return sd


def _zeros(sd: dict) -> dict:
    from dtensor_api import DTensor
    from dist_helpers import dtensor_of

    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _zeros(v)
        elif isinstance(v, DTensor):
            out[k] = dtensor_of(torch.zeros(v.shape, dtype=v.dtype), v.device_mesh, v.placements)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def _assert_loaded(got: dict, exp: dict, what: str) -> None:
    from conftest import assert_bit_equal
    from dtensor_api import DTensor

    for k, v in exp.items():
        if isinstance(v, dict):
            _assert_loaded(got[k], v, f"{what}.{k}")
        elif isinstance(v, DTensor):
            assert_bit_equal(got[k].full_tensor(), v.full_tensor(), f"{what}.{k}")
        elif isinstance(v, torch.Tensor):
            assert_bit_equal(got[k], v, f"{what}.{k}")
        else:
            assert got[k] == v, f"{what}.{k}: {got[k]!r} != {v!r}"


def _save(path: str, sd: dict) -> str:
    """Save; load back with dcpx and torch (bit-exact); "steady" or "full"
    as every rank saw it (the same on all, checked)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp

    import dcpx
    from dcpx.coordination import dist as _dist

    before = getattr(_dist, "STEADY_SAVES", [0])[0]
    gathers = []
    gather = _dist._Group.gather

    def rec(self, obj):
        gathers.append(obj)
        return gather(self, obj)

    _dist._Group.gather = rec
    try:
        md = dcpx.save(sd, checkpoint_id=path)
    finally:
        _dist._Group.gather = gather
    steady = getattr(_dist, "STEADY_SAVES", [0])[0] == before + 1
    # the steady path gathers nothing (its collectives are of fixed size)
    assert steady == (not gathers), (steady, gathers[:1])
    mine = "steady" if steady else "full"
    # the returned Metadata is the committed one, on every rank
    committed = tdcp.FileSystemReader(path).read_metadata()
    assert md.state_dict_metadata == committed.state_dict_metadata
    assert md.storage_data == committed.storage_data
    assert md.planner_data == committed.planner_data
    for lib in (dcpx, tdcp):
        got = _zeros(sd)
        lib.load(got, checkpoint_id=path)
        _assert_loaded(got, sd, f"{lib.__name__} {path}")
    out = [None] * WORLD
    dist.all_gather_object(out, mine)
    assert len(set(out)) == 1, out
    return out[0]


def _fresh() -> None:
    import torch.distributed as dist
    from dcpx.coordination import dist as _dist
    _dist.clear_exchange_cache()
    dist.barrier()


def check_unchanged_plan_is_steady(ctx):
    _fresh()
    r = ctx.rank
    assert _save(ctx.path("u0"), _state(r, 0)) == "full"
    for step in (1, 2, 3):
        assert _save(ctx.path(f"u{step}"), _state(r, step)) == "steady", step
    # the same state by the full exchange (nothing cached): the same
    # .metadata but for the save's tag and save_id
    _fresh()
    assert _save(ctx.path("x3"), _state(r, 3)) == "full"
    if r == 0:
        _same_metadata(ctx.path("u3"), ctx.path("x3"))


def _tag(path: str) -> str:
    names = [n for n in os.listdir(path) if n.endswith(".distcp")]
    tags = {re.match(r"__\d+_(.+)_\d+\.distcp$", n).group(1) for n in names}
    assert len(tags) == 1, tags
    return tags.pop()


def _same_metadata(steady: str, full: str) -> None:
    import torch.distributed.checkpoint as tdcp

    from dcpx.formats import metadata as _metadata
    a = open(os.path.join(steady, ".metadata"), "rb").read()
    b = open(os.path.join(full, ".metadata"), "rb").read()
    # both trailers (CRC, length) are right: dcpx's reader checks them
    ma = _metadata.loads(a, steady)
    mb = _metadata.loads(b, full)
    ta, tb = _tag(steady), _tag(full)
    ida = tdcp.FileSystemReader(steady).read_metadata().storage_meta.save_id
    idb = tdcp.FileSystemReader(full).read_metadata().storage_meta.save_id
    assert ma.storage_meta.save_id == ida and mb.storage_meta.save_id == idb
    assert len(ta) == len(tb) and len(ida) == len(idb)
    body_a = a[:-16]
    body_b = b[:-16].replace(tb.encode(), ta.encode()).replace(idb.encode(), ida.encode())
    # storage_meta's checkpoint_id (a path, pickled by its parts)
    body_b = body_b.replace(os.path.basename(full).encode(), os.path.basename(steady).encode())
    if body_a != body_b:
        i = next((i for i, (x, y) in enumerate(zip(body_a, body_b)) if x != y),
                 min(len(body_a), len(body_b)))
        raise AssertionError(f"{len(body_a)} vs {len(body_b)} bytes, first difference at {i}: "
                             f"{body_a[i - 40:i + 40]!r} vs {body_b[i - 40:i + 40]!r}")


def check_changes_take_the_full_path(ctx):
    r = ctx.rank
    changes = {
        "key": dict(extra=True),                   # a new key
        "shape": dict(rows=8),                     # a changed shape
        "dtype": dict(dtype=torch.float64),        # a changed dtype
        "rank": dict(own_rows=3 + r),              # one rank's plan changes
        "bytes": dict(cfg="x" * 5000),             # a bytes value's pickled size
    }
    for name, kw in changes.items():
        _fresh()
        assert _save(ctx.path(f"{name}0"), _state(r, 0)) == "full", name
        assert _save(ctx.path(f"{name}1"), _state(r, 1)) == "steady", name
        assert _save(ctx.path(f"{name}2"), _state(r, 2, **kw)) == "full", (name, 2)
        # the changed plan is steady from its next save on
        assert _save(ctx.path(f"{name}3"), _state(r, 3, **kw)) == "steady", (name, 3)


def check_failed_steady_save_then_recovers(ctx):
    """A rank that fails to write in a steady-state save fails the save on
    every rank (nothing committed); the next save takes the full path."""
    import torch.distributed as dist

    import dcpx
    from dcpx.storage.writer import FileSystemWriter
    _fresh()
    r = ctx.rank
    assert _save(ctx.path("f0"), _state(r, 0)) == "full"
    assert _save(ctx.path("f1"), _state(r, 1)) == "steady"
    write = FileSystemWriter.write_entries

    def broken(self, *args, **kwargs):
        raise OSError("disk on fire")

    if r == 1:
        FileSystemWriter.write_entries = broken
    try:
        with pytest.raises(Exception, match="disk on fire"):
            dcpx.save(_state(r, 2), checkpoint_id=ctx.path("f2"))
    finally:
        FileSystemWriter.write_entries = write
    assert not os.path.exists(os.path.join(ctx.path("f2"), ".metadata"))
    dist.barrier()
    assert _save(ctx.path("f3"), _state(r, 3)) == "full"
    assert _save(ctx.path("f4"), _state(r, 4)) == "steady"


def check_steady_metadata_is_copied_from_the_last_file(ctx):
    """Rank 0 writes a steady-state save's .metadata from the last file
    that holds the encoded middle (copy_file_range: the bytes never pass
    through the process) while that file is the one it wrote; a removed
    or rewritten file is not trusted: the bytes come from memory.  Every
    checkpoint loads bit-exact in both libraries (_save)."""
    import shutil

    import torch.distributed as dist
    from conftest import kernel_copies
    from dcpx.storage.commit import MIDDLE_BYTES
    _fresh()
    r = ctx.rank
    copies = kernel_copies(ctx.path("")) if r == 0 else None

    def moved(step: int, **kw) -> tuple:
        before = dict(MIDDLE_BYTES)
        assert _save(ctx.path(f"m{step}"), _state(r, step)) == kw.pop("path", "steady"), step
        return (MIDDLE_BYTES["copied"] - before["copied"],
                MIDDLE_BYTES["written"] - before["written"])

    assert moved(0, path="full") == (0, 0)
    for step in (1, 2):  # from m0's file, then m1's
        copied, written = moved(step)
        if r == 0:
            # (the partial blocks at the middle's ends may be written)
            assert copied + written > 0 and (copied > 0) == copies, (step, copied, written, copies)
            assert not copies or written < 2 * 65536, (step, copied, written)
        else:
            assert (copied, written) == (0, 0)
    # retention removed the last step: its file is gone
    if r == 0:
        shutil.rmtree(ctx.path("m2"))
    dist.barrier()
    copied, written = moved(3)
    if r == 0:
        assert copied == 0 and written > 0, (copied, written)
    copied, written = moved(4)  # from m3's file again
    if r == 0:
        assert (copied > 0) == copies, (copied, written)
        # the last file rewritten in place (same size): not the one written
        meta = os.path.join(ctx.path("m4"), ".metadata")
        size = os.path.getsize(meta)
        with open(meta, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0xFF]))
        st = os.stat(meta)
        os.utime(meta, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    dist.barrier()
    copied, written = moved(5)
    if r == 0:
        assert copied == 0 and written > 0, (copied, written)


def check_a_load_index_is_written_and_used(ctx):
    """With the load index's thresholds at their least, a full save writes
    one beside .metadata and each steady-state save one for its own file
    (the body reused); loads through it read no .metadata and are
    bit-exact (and torch's, which ignores it: _save); a full save under
    the default thresholds removes the last one."""
    import dcpx
    import torch.distributed as dist
    from dcpx.coordination import dist as _dist
    from dcpx.formats import loadindex as _li
    from dcpx.storage.reader import FileSystemReader
    _fresh()
    r = ctx.rank
    saved = (_dist.LOAD_INDEX_MIN_ENTRIES, _dist.LOAD_INDEX_MIN_PER_KEY)
    real = FileSystemReader._read_metadata_file
    reads = [0]

    def counted(self, rank):
        reads[0] += 1
        return real(self, rank)
    _dist.LOAD_INDEX_MIN_ENTRIES, _dist.LOAD_INDEX_MIN_PER_KEY = 1, 0
    try:
        for step, how in ((0, "full"), (1, "steady"), (2, "steady")):
            path = ctx.path(f"i{step}")
            assert _save(path, _state(r, step)) == how, step
            idx = _li.LoadIndex.open(path)
            assert idx is not None, step
            idx.close()
            FileSystemReader._read_metadata_file = counted
            try:
                reads[0] = 0
                got = _zeros(_state(r, step))
                dcpx.load(got, checkpoint_id=path)
            finally:
                FileSystemReader._read_metadata_file = real
            assert reads[0] == 0, (step, reads[0])
            _assert_loaded(got, _state(r, step), f"indexed {path}")
    finally:
        _dist.LOAD_INDEX_MIN_ENTRIES, _dist.LOAD_INDEX_MIN_PER_KEY = saved
    _fresh()
    assert _save(ctx.path("i2"), _state(r, 3)) == "full"
    dist.barrier()
    assert not os.path.exists(os.path.join(ctx.path("i2"), _li.INDEX_FN))


CHECKS = [check_unchanged_plan_is_steady, check_changes_take_the_full_path,
          check_failed_steady_save_then_recovers,
          check_steady_metadata_is_copied_from_the_last_file,
          check_a_load_index_is_written_and_used]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from dist_helpers import CheckSession
    return CheckSession(WORLD, CHECKS, tmp_path_factory.mktemp("steady")).run()


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_steady_state(session, check):
    session.assert_ok(check)


def test_a_writer_subclass_with_its_own_commit_gets_the_metadata_as_bytes(tmp_path,
                                                                         monkeypatch):
    """A FileSystemWriter subclass that overrides ``commit`` (to upload
    the bytes, say) is handed ``bytes`` by a steady-state save, as by every
    other save, not the spliced parts."""
    from dcpx.coordination import dist as _dist
    from dcpx.formats import metadata as _metadata
    from dcpx.storage import commit as _commit
    from dcpx.storage.writer import FileSystemWriter

    got = []
    real = _commit.commit
    # what FileSystemWriter.commit hands the commit, for both writers
    monkeypatch.setattr(_commit, "commit", lambda w, m, d=None: (got.append(type(d)),
                                                                 real(w, m, d))[1])

    class Uploading(FileSystemWriter):
        def commit(self, metadata, data=None):
            return super().commit(metadata, data)

    names = ("__0_aa_0.distcp",)
    md = _dist.new_metadata(state_dict_metadata={}, planner_data={}, storage_data={},
                            storage_meta=None, version=_dist.DCP_VERSION)
    data, middle, _ = _metadata.split_dumps(md, names)
    st = _dist._Steady(1, 1, str(tmp_path), (), 1, [], "aa", None, None, (1,), middle,
                       None, None)
    for cls, want in ((Uploading, bytes), (FileSystemWriter, _metadata.Spliced)):
        got.clear()
        w = cls(tmp_path / cls.__name__, sync_files=False)
        w.set_up_storage_writer(True, rank=0, use_collectives=True)
        outcome, _, _, _ = _dist._commit_steady(w, st, w._tag())
        w._release_tag()
        assert outcome[0] == "ok", outcome
        assert got == [want], (cls, got)
