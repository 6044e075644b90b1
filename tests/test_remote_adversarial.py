"""Saves to URLs and troubled local folders, reviewed adversarially: a save
that reports success loads (with dcpx and with torch DCP, bit-exact), lands
where its checkpoint_id says, and a failure leaves the previous checkpoint
loading bit-exact.

Checks (each after-save state is loaded by dcpx and torch into fresh state
dicts):

* ``file:///abs`` and the plain path name one checkpoint: saved through one
  form, loaded through the other; torch's FsspecWriter / FsspecReader on the
  ``file://`` URL interoperate with dcpx both ways.
* Repeated saves into one ``memory://`` / ``file://`` URL replace the old one;
  a save into a URL whose parent does not exist creates it.
* A failed re-save (a value that does not pickle; a write that raises ENOSPC
  on the N-th upload) raises, leaves no ``.metadata.tmp`` and the previous
  checkpoint loads bit-exact.
* ENOSPC writing a local ``.metadata.tmp``: the error is an OSError naming
  that file, and no file of the failed save is left.  Failed on main: the
  error named no file and the failed save's data files stayed, holding the
  space the retry needs on a full disk.
* A read-only directory (chmod 0o555, or a monkeypatched open raising
  PermissionError when running as root) raises PermissionError naming the
  directory's file, previous checkpoint intact.
* async_save (THREAD) through ``FsspecWriter("file:///dir")`` followed by a
  plain-path save into the same directory: the two are one directory's saves
  and run in turn.  Failed on main: they ran at once (their in-process turn
  keys were the URL and the resolved path), and the plain save's commit
  deleted the in-flight upload's data files, so the async_save reported
  success with a ``.metadata`` naming missing files.
"""
from __future__ import annotations

import errno
import os
import pickle
import threading
import uuid

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.api import CheckpointException

import dcpx
from conftest import assert_state_bit_equal

fsspec = pytest.importorskip("fsspec")
from dcpx.fsspec import FsspecWriter  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import (  # noqa: E402
    FsspecReader as TorchFsspecReader,
    FsspecWriter as TorchFsspecWriter,
)


def _state(seed=3):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 5, generator=g), "i": torch.arange(11, dtype=torch.int32) + seed,
            "h": torch.randn(7, generator=g).to(torch.bfloat16), "step": 40 + seed}


def _empty():
    return {"w": torch.zeros(6, 5), "i": torch.zeros(11, dtype=torch.int32),
            "h": torch.zeros(7, dtype=torch.bfloat16), "step": 0}


def _check(ckpt, sd):
    """dcpx and torch both load ``ckpt`` bit-exact into fresh state dicts."""
    out = _empty()
    dcpx.load(out, checkpoint_id=ckpt)
    assert_state_bit_equal(out, sd)
    theirs = _empty()
    if "://" in str(ckpt):
        reader = TorchFsspecReader(str(ckpt))
    else:
        reader = tdcp.FileSystemReader(str(ckpt))
    tdcp.load(theirs, storage_reader=reader, no_dist=True)
    assert_state_bit_equal(theirs, sd)


def _names(url):
    fs, root = fsspec.core.url_to_fs(url)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))


@pytest.fixture
def mem():
    fs = fsspec.filesystem("memory")
    root = f"/dcpx-adv-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    if fs.exists(root):
        fs.rm(root, recursive=True)


class Unpicklable:
    def __reduce__(self):
        raise pickle.PicklingError("injected: does not pickle")


# ------------------------------------------------------------ URL vs path

def test_file_url_and_plain_path_are_one_checkpoint(tmp_path):
    d = tmp_path / "ck"
    url = "file://" + str(d)
    sd1, sd2 = _state(1), _state(2)
    dcpx.save(sd1, checkpoint_id=url)
    _check(d, sd1)
    _check(url, sd1)
    dcpx.save(sd2, checkpoint_id=str(d))
    _check(url, sd2)
    assert not any(n.endswith(".distcp") and "__0_" in n and n not in
                   {si.relative_path for si in tdcp.FileSystemReader(str(d)).read_metadata()
                    .storage_data.values()} for n in os.listdir(d)), os.listdir(d)


def test_torch_fsspec_interop_on_file_url(tmp_path):
    url = "file://" + str(tmp_path / "a")
    sd = _state(4)
    tdcp.save(sd, storage_writer=TorchFsspecWriter(url), no_dist=True)
    _check(url, sd)
    url2 = "file://" + str(tmp_path / "b")
    dcpx.save(sd, storage_writer=FsspecWriter(url2))
    _check(url2, sd)
    _check(str(tmp_path / "b"), sd)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_resave_and_missing_parent(kind, mem, tmp_path):
    url = (mem + "/deep/er") if kind == "memory" else "file://" + str(tmp_path / "x" / "y" / "z")
    for seed in (1, 2, 3):
        dcpx.save(_state(seed), checkpoint_id=url)
        _check(url, _state(seed))
    if kind == "memory":
        names = _names(url)
        assert sum(n.endswith(".distcp") for n in names) == 1, names


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_unpicklable_resave_keeps_previous(kind, mem, tmp_path):
    url = mem if kind == "memory" else "file://" + str(tmp_path / "ck")
    sd = _state(1)
    dcpx.save(sd, checkpoint_id=url)
    before = _names(url)
    bad = dict(_state(2), step=Unpicklable())
    with pytest.raises((pickle.PicklingError, CheckpointException, dcpx.CheckpointError),
                       match="injected"):
        dcpx.save(bad, checkpoint_id=url)
    after = _names(url)
    assert not any(".tmp" in n for n in after), after
    assert [n for n in after if not n.startswith(".dcpx")] == \
        [n for n in before if not n.startswith(".dcpx")]
    _check(url, sd)


def test_enospc_on_upload_keeps_previous(mem, monkeypatch):
    sd = _state(1)
    dcpx.save(sd, checkpoint_id=mem)
    before = _names(mem)
    fs = fsspec.filesystem("memory")
    real = type(fs).put_file
    calls = []

    def put_file(self, lpath, rpath, *a, **k):
        calls.append(rpath)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", rpath)
        return real(self, lpath, rpath, *a, **k)

    monkeypatch.setattr(type(fs), "put_file", put_file)
    w = FsspecWriter(mem, single_file_per_rank=False)
    with pytest.raises((OSError, CheckpointException)) as e:
        dcpx.save(_state(2), storage_writer=w)
    assert "No space left" in str(e.value) and "distcp" in str(e.value)
    monkeypatch.undo()
    assert _names(mem) == before
    _check(mem, sd)


def test_enospc_writing_local_metadata_names_it_and_frees_the_data(tmp_path, monkeypatch):
    """Failed on main: the error named no file, and the failed save's data
    files stayed (on a full disk, holding the space the retry needs)."""
    d = tmp_path / "ck"
    url = "file://" + str(d)
    sd = _state(1)
    dcpx.save(sd, checkpoint_id=url)
    before = sorted(n for n in os.listdir(d) if not n.startswith(".dcpx"))

    def write(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(OSError) as e:
        dcpx.save(_state(2), checkpoint_id=url)
    monkeypatch.undo()
    assert e.value.errno == errno.ENOSPC
    assert str(d / ".metadata.tmp.") in str(e.value.filename), e.value
    assert str(d / ".metadata.tmp.") in str(e.value)
    after = sorted(n for n in os.listdir(d) if not n.startswith(".dcpx"))
    assert after == before, (before, after)
    _check(url, sd)
    dcpx.save(_state(3), checkpoint_id=url)  # the retry commits
    _check(d, _state(3))


def test_read_only_directory(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    sd = _state(1)
    dcpx.save(sd, checkpoint_id="file://" + str(d))
    if os.geteuid() != 0:
        os.chmod(d, 0o555)
        try:
            with pytest.raises((PermissionError, CheckpointException, dcpx.CheckpointError)) as e:
                dcpx.save(_state(2), checkpoint_id="file://" + str(d))
        finally:
            os.chmod(d, 0o755)
        assert str(d) in str(e.value)
    else:
        real = os.open

        def deny(path, flags, *a, **k):
            if str(path).startswith(str(d)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", deny)
        with pytest.raises((PermissionError, CheckpointException, dcpx.CheckpointError)) as e:
            dcpx.save(_state(2), checkpoint_id="file://" + str(d))
        monkeypatch.undo()
        assert "Permission denied" in str(e.value) or "EACCES" in str(e.value)
    _check(d, sd)


def test_process_async_save_refuses_memory_url(mem):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    with pytest.raises(ValueError, match="in-memory"):
        dcpx.async_save(_state(1), checkpoint_id=mem,
                        async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()


# ------------------------------------------------------------ turns

def test_fsspec_file_url_async_and_plain_path_save_take_turns(tmp_path, monkeypatch):
    """Failed on main: the plain-path save ran during the upload of the
    file:// async_save, its commit deleted that upload's data files, and the
    async_save then committed a .metadata naming missing files."""
    d = tmp_path / "ck"
    d.mkdir()
    release = threading.Event()
    real = FsspecWriter._upload

    def slow_upload(self, tmp, names):
        real(self, tmp, names)
        release.wait(30)

    monkeypatch.setattr(FsspecWriter, "_upload", slow_upload)
    sd1, sd2 = _state(1), _state(2)
    f1 = dcpx.async_save(sd1, storage_writer=FsspecWriter("file://" + str(d)))
    err = []

    def plain():
        try:
            dcpx.save(sd2, checkpoint_id=str(d))
        except BaseException as e:  # reported below
            err.append(e)

    t = threading.Thread(target=plain)
    t.start()
    t.join(2)  # on main the plain save finishes here, while the upload waits
    release.set()
    f1.result()
    t.join(30)
    assert not t.is_alive() and not err, err
    _check(d, sd2)  # the later call committed last


def test_async_thread_unpicklable_resave_keeps_previous_memory(mem):
    sd = _state(1)
    dcpx.async_save(sd, checkpoint_id=mem).result()
    _check(mem, sd)
    before = _names(mem)
    with pytest.raises((pickle.PicklingError, CheckpointException, dcpx.CheckpointError),
                       match="injected"):
        dcpx.async_save(dict(_state(2), step=Unpicklable()), checkpoint_id=mem).result()
    assert _names(mem) == before
    _check(mem, sd)
