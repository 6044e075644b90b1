"""checkpoint_id given as a URL (issue 10, item 3): routed as torch routes
it (file:// and plain paths to dcpx's FileSystemWriter / Reader, any other
protocol to dcpx.fsspec's FsspecWriter / Reader), with dcpx's commit order,
CRC checks and safe loading kept, interchangeable with torch's fsspec
storage both ways, and never a local directory named after a URL."""
from __future__ import annotations

import importlib.util
import os
import sys
import uuid

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import dcpx
from conftest import assert_state_bit_equal

fsspec = pytest.importorskip("fsspec")


def _state():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(6, 5, generator=g), "i": torch.arange(11, dtype=torch.int32),
            "h": torch.randn(7, generator=g).to(torch.bfloat16), "step": 41,
            "nested": {"m": torch.randn(2, 3, generator=g), "name": "run-7"}}


def _empty():
    return {"w": torch.zeros(6, 5), "i": torch.zeros(11, dtype=torch.int32),
            "h": torch.zeros(7, dtype=torch.bfloat16), "step": 0,
            "nested": {"m": torch.zeros(2, 3), "name": ""}}


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """An empty working directory; the test ends by checking that nothing
    (no ``s3:`` / ``memory:`` directory) was created in it."""
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)
    yield d
    assert all(":" not in n for n in os.listdir(d)), os.listdir(d)


@pytest.fixture
def mem(cwd):
    """A fresh memory:// URL, removed afterwards; the working directory stays
    empty."""
    fs = fsspec.filesystem("memory")
    root = f"/dcpx-test-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    if fs.exists(root):
        fs.rm(root, recursive=True)
    assert os.listdir(cwd) == []


def _inner(exc):
    """The error itself: torch's planning wraps a storage error in a
    CheckpointException (as it does for torch's own FsspecReader)."""
    if isinstance(exc, CheckpointException):
        (exc, _), = exc.failures.values()
    return exc


def _names(url):
    fs, root = fsspec.core.url_to_fs(url)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))


# ------------------------------------------------------------ round trips

def test_save_load_memory_url(mem):
    sd = _state()
    dcpx.save(sd, checkpoint_id=mem)
    names = _names(mem)
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names), names
    out = _empty()
    dcpx.load(out, checkpoint_id=mem)
    assert_state_bit_equal(out, sd)


def test_async_save_thread_memory_url(mem):
    sd, expected = _state(), _state()
    fut = dcpx.async_save(sd, checkpoint_id=mem)
    for v in (sd["w"], sd["i"]):
        v.add_(1)  # after staging: the checkpoint holds the values of the call
    fut.result(timeout=60)
    assert ".metadata" in _names(mem)
    out = _empty()
    dcpx.load(out, checkpoint_id=mem)
    assert_state_bit_equal(out, expected)


def test_async_save_with_async_stager_memory_url(mem):
    sd = _state()
    with dcpx.DefaultStager() as stager:
        for _ in range(2):  # the stager's buffer reused for the second save
            resp = dcpx.async_save(sd, checkpoint_id=mem, async_stager=stager)
            resp.staging_completion.result(timeout=60)
            resp.upload_completion.result(timeout=60)
    assert ".metadata" in _names(mem)
    out = _empty()
    dcpx.load(out, checkpoint_id=mem)
    assert_state_bit_equal(out, sd)


def test_async_save_process_memory_url_refused(mem):
    """A memory:// store cannot be seen from a checkpoint process: a clear
    error, and nothing written."""
    with pytest.raises(ValueError, match="memory.*THREAD"):
        dcpx.async_save(_state(), checkpoint_id=mem,
                        async_checkpointer_type=dcpx.AsyncCheckpointerType.PROCESS).result(60)
    assert not fsspec.filesystem("memory").exists(mem[len("memory://"):])


def test_resave_replaces_data_files(mem):
    sd = _state()
    for step in range(3):
        sd["step"] = step
        dcpx.save(sd, checkpoint_id=mem, storage_writer=None)
    from dcpx.fsspec import FsspecReader
    md = FsspecReader(mem).read_metadata()
    referenced = {si.relative_path for si in md.storage_data.values()}
    assert set(_names(mem)) == referenced | {".metadata"}
    out = _empty()
    dcpx.load(out, checkpoint_id=mem)
    assert_state_bit_equal(out, sd)


def test_multiple_files_and_threads(mem):
    from dcpx.fsspec import FsspecWriter
    sd = _state()
    dcpx.save(sd, storage_writer=FsspecWriter(mem, single_file_per_rank=False, thread_count=3))
    assert sum(n.endswith(".distcp") for n in _names(mem)) == 6  # one file per item
    out = _empty()
    dcpx.load(out, checkpoint_id=mem)
    assert_state_bit_equal(out, sd)
    part = {"w": torch.zeros(6, 5)}  # a partial load fetches what it needs
    dcpx.load(part, checkpoint_id=mem, planner=DefaultLoadPlanner(allow_partial_load=True))
    assert_state_bit_equal(part["w"], sd["w"])


# ------------------------------------------------------------ interop

def test_torch_reads_dcpx_memory_url(mem):
    sd = _state()
    dcpx.save(sd, checkpoint_id=mem)
    out = _empty()
    tdcp.load(out, checkpoint_id=mem)  # torch's FsspecReader
    assert_state_bit_equal(out, sd)


def test_dcpx_reads_torch_memory_url(mem):
    sd = _state()
    tdcp.save(sd, checkpoint_id=mem)  # torch's FsspecWriter
    out = _empty()
    dcpx.load(out, checkpoint_id=mem)
    assert_state_bit_equal(out, sd)


def test_writer_pickles_for_another_process_unless_in_memory(mem, tmp_path):
    """What a PROCESS checkpoint process would receive: a writer for a store
    other processes can reach pickles and saves; a memory:// one refuses."""
    import pickle

    from dcpx.fsspec import FsspecReader, FsspecWriter
    with pytest.raises(ValueError, match="memory.*THREAD"):
        pickle.dumps(FsspecWriter(mem))
    w = pickle.loads(pickle.dumps(FsspecWriter(str(tmp_path / "ck"), thread_count=2)))
    sd = _state()
    dcpx.save(sd, storage_writer=w)
    out = _empty()
    dcpx.load(out, storage_reader=FsspecReader(str(tmp_path / "ck")))
    assert_state_bit_equal(out, sd)


def test_validate_checkpoint_id_as_torch():
    from pathlib import Path

    from dcpx.fsspec import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as TorchFsspecWriter
    for cid in ("memory://a", "s3://b/c" if importlib.util.find_spec("s3fs") else "gcs-no://x",
                "file:///tmp/x", "rel/path", Path("/tmp/x"), "nosuchproto://x"):
        try:
            expected = TorchFsspecWriter.validate_checkpoint_id(cid)
        except ImportError:
            expected = False
        assert FsspecWriter.validate_checkpoint_id(cid) == expected, cid
        assert FsspecReader.validate_checkpoint_id(cid) == expected, cid
        if not isinstance(cid, Path) and "://" in cid:  # URLs: never the local writer's
            assert dcpx.FileSystemWriter.validate_checkpoint_id(cid) is False
            assert tdcp.FileSystemWriter.validate_checkpoint_id(cid) is False


# ------------------------------------------------------------ file://

def test_file_urls_are_local_paths(cwd, tmp_path):
    sd = _state()
    absolute = tmp_path / "abs"
    dcpx.save(sd, checkpoint_id=f"file://{absolute}")
    assert (absolute / ".metadata").is_file()
    dcpx.save(sd, checkpoint_id="file://rel/ckpt")  # relative to the working directory
    assert (cwd / "rel" / "ckpt" / ".metadata").is_file()
    for where in (absolute, f"file://{absolute}", cwd / "rel" / "ckpt"):
        out = _empty()
        dcpx.load(out, checkpoint_id=where)
        assert_state_bit_equal(out, sd)
    out = _empty()
    tdcp.load(out, checkpoint_id=f"file://{absolute}")  # torch, through fsspec
    assert_state_bit_equal(out, sd)
    assert os.listdir(cwd) == ["rel"]


def test_filesystem_writer_reader_given_urls(cwd, tmp_path):
    w = dcpx.FileSystemWriter(f"file://{tmp_path}/x")
    assert str(w.path) == f"{tmp_path}/x"
    w.reset("local:///tmp/y")
    assert str(w.path) == "/tmp/y"
    assert str(dcpx.FileSystemReader(f"file://{tmp_path}/x").path) == f"{tmp_path}/x"
    for url in ("s3://bucket/ckpt", "memory://ckpt", "gs://b/c"):
        with pytest.raises(ValueError, match=url.split(":")[0] + "://.*FsspecWriter"):
            dcpx.FileSystemWriter(url)
        with pytest.raises(ValueError, match="not a local path"):
            dcpx.FileSystemReader(url)
        with pytest.raises(ValueError, match="not a local path"):
            w.reset(url)
    with pytest.raises(ValueError, match="not a local path"):
        dcpx.save(_state(), checkpoint_id="memory://x", storage_writer=dcpx.FileSystemWriter(tmp_path))
    assert os.listdir(cwd) == []


# ------------------------------------------------------------ errors

def test_unknown_protocol(cwd):
    with pytest.raises(ValueError, match="nosuchproto"):
        dcpx.save(_state(), checkpoint_id="nosuchproto://b/c")
    with pytest.raises(ValueError, match="nosuchproto"):
        dcpx.load(_empty(), checkpoint_id="nosuchproto://b/c")
    with pytest.raises(ValueError, match="nosuchproto"):
        dcpx.async_save(_state(), checkpoint_id="nosuchproto://b/c")


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None, reason="s3fs is installed")
def test_backend_not_installed(cwd):
    for call in (lambda: dcpx.save(_state(), checkpoint_id="s3://bucket/ckpt"),
                 lambda: dcpx.load(_empty(), checkpoint_id="s3://bucket/ckpt"),
                 lambda: dcpx.async_save(_state(), checkpoint_id="s3://bucket/ckpt")):
        with pytest.raises(ImportError, match=r"s3://.*s3fs"):
            call()


def test_fsspec_not_installed(cwd, monkeypatch):
    for name in [m for m in sys.modules if m == "fsspec" or m.startswith("fsspec.")]:
        monkeypatch.setitem(sys.modules, name, None)  # import fsspec now fails
    for call in (lambda: dcpx.save(_state(), checkpoint_id="s3://bucket/ckpt"),
                 lambda: dcpx.load(_empty(), checkpoint_id="memory://ckpt"),
                 lambda: dcpx.async_save(_state(), checkpoint_id="gs://b/ckpt")):
        with pytest.raises(ImportError, match=r"://.*pip install fsspec"):
            call()


def _data_file(url):
    return next(n for n in _names(url) if n.endswith(".distcp"))


def test_corrupt_data_is_caught_and_names_the_url(mem):
    sd = _state()
    dcpx.save(sd, checkpoint_id=mem)
    fs, root = fsspec.core.url_to_fs(mem)
    path = f"{root}/{_data_file(mem)}"
    from dcpx.fsspec import FsspecReader
    md = FsspecReader(mem).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    raw = bytearray(fs.cat_file(path))
    raw[info.offset + info.length - 30] ^= 0x40  # inside w's tensor bytes
    fs.pipe_file(path, bytes(raw))
    with pytest.raises((dcpx.CorruptCheckpointError, CheckpointException)) as e:
        dcpx.load(_empty(), checkpoint_id=mem)
    err = _inner(e.value)
    assert isinstance(err, dcpx.CorruptCheckpointError), repr(err)
    assert f"{mem}/" in str(err) and "'w'" in str(err) and "dcpx-fsspec-" not in str(err), str(err)


def test_truncated_and_missing_data_files(mem):
    dcpx.save(_state(), checkpoint_id=mem)
    fs, root = fsspec.core.url_to_fs(mem)
    path = f"{root}/{_data_file(mem)}"
    raw = fs.cat_file(path)
    fs.pipe_file(path, raw[: len(raw) // 2])
    for problem in ("outside the file", "missing"):
        with pytest.raises((dcpx.CorruptCheckpointError, CheckpointException)) as e:
            dcpx.load(_empty(), checkpoint_id=mem)
        err = _inner(e.value)
        assert isinstance(err, dcpx.CorruptCheckpointError), repr(err)
        assert problem in str(err) and mem in str(err), str(err)
        if fs.exists(path):
            fs.rm(path)


def test_no_checkpoint_at_url(mem):
    with pytest.raises((FileNotFoundError, CheckpointException)) as e:
        dcpx.load(_empty(), checkpoint_id=mem)
    assert f"no checkpoint at {mem}" in str(e.value)


class Custom:
    def __init__(self, v):
        self.v = v


def test_unsafe_value_refused_unless_allowed(mem):
    from dcpx.fsspec import FsspecReader
    dcpx.save({"c": Custom(3), "t": torch.ones(2)}, checkpoint_id=mem)
    with pytest.raises((dcpx.UnsafeCheckpointError, CheckpointException)) as e:
        dcpx.load({"c": None, "t": torch.zeros(2)}, checkpoint_id=mem)
    err = _inner(e.value)
    assert isinstance(err, dcpx.UnsafeCheckpointError) and "allow_pickle" in str(err), repr(err)
    out = {"c": None, "t": torch.zeros(2)}
    dcpx.load(out, storage_reader=FsspecReader(mem, allow_pickle=True))
    assert isinstance(out["c"], Custom) and out["c"].v == 3


# ------------------------------------------------------------ commit order

def test_metadata_is_written_last_and_a_failed_save_keeps_the_old_one(mem, monkeypatch):
    sd = _state()
    dcpx.save(sd, checkpoint_id=mem)
    before = _names(mem)
    fs = fsspec.filesystem("memory")
    ops = []
    real_put, real_mv = type(fs).put_file, type(fs).mv

    def put_file(self, lpath, rpath, *a, **k):
        ops.append(("put", rpath))
        if len([o for o in ops if o[0] == "put"]) == 2:
            raise OSError(5, "injected upload failure")
        return real_put(self, lpath, rpath, *a, **k)

    def mv(self, p1, p2, *a, **k):
        ops.append(("mv", p2))
        return real_mv(self, p1, p2, *a, **k)

    monkeypatch.setattr(type(fs), "put_file", put_file)
    monkeypatch.setattr(type(fs), "mv", mv)
    from dcpx.fsspec import FsspecWriter
    sd2 = {k: (v + 1 if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    with pytest.raises((OSError, CheckpointException), match="injected"):
        dcpx.save(sd2, storage_writer=FsspecWriter(mem, single_file_per_rank=False))
    assert not any(o[0] == "mv" for o in ops)  # never committed
    assert _names(mem) == before  # its uploads removed, the old checkpoint intact
    out = _empty()
    dcpx.load(out, checkpoint_id=mem)
    assert_state_bit_equal(out, sd)

    ops.clear()

    def put_file_ok(self, lpath, rpath, *a, **k):
        ops.append(("put", rpath))
        return real_put(self, lpath, rpath, *a, **k)

    monkeypatch.setattr(type(fs), "put_file", put_file_ok)
    dcpx.save(sd2, storage_writer=FsspecWriter(mem, single_file_per_rank=False))
    kinds = [o[0] for o in ops]
    assert kinds[-1] == "mv" and ops[-1][1].endswith("/.metadata") and "mv" not in kinds[:-1]
    out = _empty()
    dcpx.load(out, checkpoint_id=mem)
    assert_state_bit_equal(out, sd2)


@pytest.mark.parametrize("failing", ["pipe_file", "mv"])
def test_failed_commit_keeps_the_old_checkpoint(mem, monkeypatch, failing):
    """Writing or moving .metadata fails: the save raises, the previous
    checkpoint loads bit-exactly, no temporary metadata is left, and (when
    nothing can have been committed) neither is any file of the failed save."""
    sd = _state()
    dcpx.save(sd, checkpoint_id=mem)
    before = _names(mem)
    fs = fsspec.filesystem("memory")

    def fail(self, *a, **k):
        raise OSError(28, f"injected {failing} failure")

    monkeypatch.setattr(type(fs), failing, fail)
    sd2 = {k: (v + 1 if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    with pytest.raises((OSError, CheckpointException), match="injected"):
        dcpx.save(sd2, checkpoint_id=mem)
    monkeypatch.undo()
    after = _names(mem)
    assert not any(".tmp." in n for n in after), after
    if failing == "pipe_file":
        assert after == before
    out = _empty()
    dcpx.load(out, checkpoint_id=mem)
    assert_state_bit_equal(out, sd)


# ------------------------------------------------------------ process group

def _two_rank_fsspec(rank, world_size, path):
    """Each rank saves its own tensor plus a replicated one through
    FsspecWriter (fsspec's local file system: memory:// does not cross
    processes), then loads them back; torch's FsspecReader reads it too."""
    import torch
    import torch.distributed.checkpoint as tdcp

    import dcpx
    from dcpx.fsspec import FsspecReader, FsspecWriter
    sd = {f"r{r}": torch.full((3,), float(r)) for r in range(world_size)}
    sd["shared"] = torch.arange(5.0)
    dcpx.save(sd, storage_writer=FsspecWriter(path))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcpx.load(out, storage_reader=FsspecReader(path))
    theirs = {k: torch.zeros_like(v) for k, v in sd.items()}
    tdcp.load(theirs, storage_reader=tdcp.FileSystemReader(path))
    return all(torch.equal(out[k], sd[k]) and torch.equal(theirs[k], sd[k]) for k in sd)


@pytest.mark.dist
def test_process_group_save_load(tmp_path):
    from dist_helpers import spawn
    assert spawn(_two_rank_fsspec, 2, str(tmp_path / "ckpt")) == [True, True]
