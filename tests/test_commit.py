"""The crash-safe commit (dcpx/filesystem.py's module docstring).

1. data files are written under names no committed ``.metadata`` refers to;
2. they are synced, then ``.metadata`` is written to a temporary name and
   atomically renamed over the old one;
3. only then are data files the new metadata does not reference deleted.

So at every instant the directory holds one complete checkpoint: the old one
until the rename, the new one after it.  torch's FileSystemWriter instead
rewrites ``__0_0.distcp`` in place, so a crash mid-save leaves the old
``.metadata`` pointing at new or partial data.
"""
import errno
import os
import re
import resource
import signal
import uuid

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.api import CheckpointException

import dcpx
import dcpx.filesystem
from conftest import assert_state_bit_equal, data_files, empty_like_state, make_tensor

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning"),
]


def state_v(version: int, gen) -> dict:
    """Same structure, different values per version."""
    return {"w": make_tensor((64, 32), torch.float32, gen),
            "big": make_tensor((300_000,), torch.float32, gen),
            "nested": {"b": make_tensor((5,), torch.int64, gen)},
            "step": version}


def load_state(path, like):
    dest = empty_like_state(like)
    dcpx.load(dest, checkpoint_id=path)
    return dest


def referenced_files(path) -> set:
    md = dcpx.FileSystemReader(path).read_metadata()
    return {info.relative_path for info in md.storage_data.values()}


def fail(*args, **kwargs):
    raise OSError(errno.EIO, "simulated crash")


# --------------------------------------------------------------------------
# (a) re-saving

def test_resave_uses_new_file_names_and_removes_the_old(ckpt, gen):
    dcpx.save(state_v(1, gen), checkpoint_id=ckpt)
    first = set(data_files(ckpt))
    v2 = state_v(2, gen)
    dcpx.save(v2, checkpoint_id=ckpt)
    second = set(data_files(ckpt))
    assert first and second
    assert not first & second, "a re-save must not write over committed data files"
    assert set(os.listdir(ckpt)) == {".metadata"} | referenced_files(ckpt)
    assert_state_bit_equal(load_state(ckpt, v2), v2)


@pytest.mark.parametrize("kw", [{"thread_count": 3}, {"single_file_per_rank": False}],
                         ids=["3-threads", "file-per-item"])
def test_resave_with_more_files_leaves_exactly_the_referenced_ones(ckpt, gen, kw):
    dcpx.save(state_v(1, gen), checkpoint_id=ckpt)
    v2 = state_v(2, gen)
    dcpx.save(v2, storage_writer=dcpx.FileSystemWriter(ckpt, **kw))
    assert set(os.listdir(ckpt)) == {".metadata"} | referenced_files(ckpt)
    assert len(data_files(ckpt)) > 1
    # and back to one file
    v3 = state_v(3, gen)
    dcpx.save(v3, checkpoint_id=ckpt)
    assert set(os.listdir(ckpt)) == {".metadata"} | referenced_files(ckpt)
    assert len(data_files(ckpt)) == 1
    assert_state_bit_equal(load_state(ckpt, v3), v3)


def test_resave_over_a_torch_checkpoint(ckpt, gen):
    tdcp.save(state_v(1, gen), checkpoint_id=ckpt)
    torch_files = set(data_files(ckpt))
    v2 = state_v(2, gen)
    dcpx.save(v2, checkpoint_id=ckpt)
    assert not torch_files & set(data_files(ckpt))
    assert set(os.listdir(ckpt)) == {".metadata"} | referenced_files(ckpt)
    dest = empty_like_state(v2)
    tdcp.load(dest, checkpoint_id=ckpt)
    assert_state_bit_equal(dest, v2)


def test_stale_temporary_metadata_is_cleaned_up(ckpt, gen):
    dcpx.save(state_v(1, gen), checkpoint_id=ckpt)
    stale = os.path.join(ckpt, ".metadata.tmp.0000-dead-save")
    with open(stale, "wb") as f:
        f.write(b"half a metadata")
    dcpx.save(state_v(2, gen), checkpoint_id=ckpt)
    assert not os.path.exists(stale)


def test_unrelated_files_are_left_alone(ckpt, gen):
    os.makedirs(ckpt)
    for name in ("notes.txt", "model.distcp", "__x.distcp.bak"):
        with open(os.path.join(ckpt, name), "w") as f:
            f.write("mine")
    dcpx.save(state_v(1, gen), checkpoint_id=ckpt)
    dcpx.save(state_v(2, gen), checkpoint_id=ckpt)
    for name in ("notes.txt", "model.distcp", "__x.distcp.bak"):
        assert os.path.exists(os.path.join(ckpt, name))


# --------------------------------------------------------------------------
# (b) a crash before the commit leaves the old checkpoint

@pytest.mark.parametrize("where", ["commit", "os.replace"])
def test_crash_before_commit_keeps_the_old_checkpoint(ckpt, gen, monkeypatch, where):
    v1 = state_v(1, gen)
    dcpx.save(v1, checkpoint_id=ckpt)
    old_listing = set(os.listdir(ckpt))

    with monkeypatch.context() as m:
        if where == "commit":
            m.setattr(dcpx.filesystem.FileSystemWriter, "commit", fail)
        else:
            m.setattr(os, "replace", fail)
        with pytest.raises(OSError, match="simulated crash"):
            dcpx.save(state_v(2, gen), checkpoint_id=ckpt)

    # The old .metadata and every file it names are untouched ...
    assert old_listing <= set(os.listdir(ckpt))
    assert not any(".tmp" in n for n in os.listdir(ckpt)), "temporary metadata left behind"
    assert_state_bit_equal(load_state(ckpt, v1), v1)
    # ... torch reads it too ...
    dest = empty_like_state(v1)
    tdcp.load(dest, checkpoint_id=ckpt)
    assert_state_bit_equal(dest, v1)
    # ... and the next successful save collects the orphaned data files.
    v3 = state_v(3, gen)
    dcpx.save(v3, checkpoint_id=ckpt)
    assert set(os.listdir(ckpt)) == {".metadata"} | referenced_files(ckpt)
    assert_state_bit_equal(load_state(ckpt, v3), v3)


def test_crash_in_the_first_save_leaves_no_checkpoint(ckpt, gen, monkeypatch):
    monkeypatch.setattr(dcpx.filesystem.FileSystemWriter, "commit", fail)
    with pytest.raises(OSError, match="simulated crash"):
        dcpx.save(state_v(1, gen), checkpoint_id=ckpt)
    monkeypatch.undo()
    with pytest.raises(dcpx.IncompleteCheckpointError):
        dcpx.load(empty_like_state(state_v(1, gen)), checkpoint_id=ckpt)


def test_torch_writer_is_not_crash_safe_for_contrast(ckpt, gen, monkeypatch):
    """The same crash with torch's own writer: its re-save rewrites the data
    files the committed metadata points at.  (Documents why dcpx exists; if
    a future torch is crash-safe, this is skipped.)"""
    v1, v2 = state_v(1, gen), state_v(2, gen)
    tdcp.save(v1, checkpoint_id=ckpt)
    monkeypatch.setattr(tdcp.FileSystemWriter, "finish", fail)
    with pytest.raises(CheckpointException):  # torch's wrapper (a BaseException)
        tdcp.save(v2, checkpoint_id=ckpt)
    monkeypatch.undo()
    dest = empty_like_state(v1)
    tdcp.load(dest, checkpoint_id=ckpt)
    try:
        assert_state_bit_equal(dest, v1)
    except AssertionError:
        # the "old" checkpoint now yields the crashed save's tensors
        assert_state_bit_equal(dest["w"], v2["w"])
        return
    pytest.skip("this torch's FileSystemWriter kept the old checkpoint intact")


# --------------------------------------------------------------------------
# (c) what is not a checkpoint

def test_data_files_without_metadata_are_incomplete(ckpt, gen, monkeypatch):
    monkeypatch.setattr(dcpx.filesystem.FileSystemWriter, "commit", lambda *a, **k: None)
    dcpx.save(state_v(1, gen), checkpoint_id=ckpt)  # data written, never committed
    monkeypatch.undo()
    assert data_files(ckpt) and not os.path.exists(os.path.join(ckpt, ".metadata"))
    with pytest.raises(dcpx.IncompleteCheckpointError) as ei:
        dcpx.load({"w": torch.zeros(64, 32)}, checkpoint_id=ckpt)
    assert ckpt in str(ei.value)
    assert isinstance(ei.value, dcpx.CheckpointError)
    assert isinstance(ei.value, FileNotFoundError)


def test_nonexistent_path_is_incomplete(tmp_path):
    missing = str(tmp_path / "never-saved")
    with pytest.raises(dcpx.IncompleteCheckpointError) as ei:
        dcpx.load({"w": torch.zeros(2)}, checkpoint_id=missing)
    assert missing in str(ei.value)
    assert not os.path.exists(missing)  # load never creates anything


def test_incomplete_checkpoint_error_has_oserror_fields(tmp_path):
    """It is a FileNotFoundError with the usual fields, so ``except
    FileNotFoundError`` code written for torch keeps working."""
    missing = str(tmp_path / "never-saved")
    with pytest.raises(dcpx.IncompleteCheckpointError) as ei:
        dcpx.load({}, checkpoint_id=missing)
    assert ei.value.errno == errno.ENOENT
    assert ei.value.filename == missing
    assert str(ei.value).startswith("[Errno 2]")


@pytest.mark.parametrize("op", ["save", "load"])
def test_path_that_is_a_regular_file(tmp_path, op):
    f = tmp_path / "file"
    f.write_bytes(b"not a checkpoint")
    with pytest.raises((NotADirectoryError, dcpx.CheckpointError)) as ei:
        getattr(dcpx, op)({"w": torch.zeros(2)}, checkpoint_id=str(f))
    assert str(f) in str(ei.value)
    assert f.read_bytes() == b"not a checkpoint"


# --------------------------------------------------------------------------
# (d) overwrite=False

def test_overwrite_false_refuses_an_existing_checkpoint(ckpt, gen):
    v1 = state_v(1, gen)
    dcpx.save(v1, storage_writer=dcpx.FileSystemWriter(ckpt, overwrite=False))  # fresh: fine
    before = sorted(os.listdir(ckpt))
    with pytest.raises(RuntimeError, match="already exists"):
        dcpx.save(state_v(2, gen), storage_writer=dcpx.FileSystemWriter(ckpt, overwrite=False))
    assert sorted(os.listdir(ckpt)) == before
    assert_state_bit_equal(load_state(ckpt, v1), v1)


# --------------------------------------------------------------------------
# (e) a failed save leaves nothing new behind

def test_unsupported_tensor_mid_list_writes_nothing(ckpt, gen):
    v1 = state_v(1, gen)
    dcpx.save(v1, checkpoint_id=ckpt)
    before = sorted(os.listdir(ckpt))
    bad = {"a": torch.ones(1000), "m": torch.randn(4, 4).to_sparse(), "z": torch.ones(3)}
    with pytest.raises(TypeError, match="'m'"):
        dcpx.save(bad, checkpoint_id=ckpt)
    assert sorted(os.listdir(ckpt)) == before
    assert_state_bit_equal(load_state(ckpt, v1), v1)


def test_write_error_during_resave(ckpt, gen, monkeypatch):
    """A real write error from the C writer threads (EFBIG: the file size
    limit, with SIGXFSZ ignored, for the duration of the save): the save
    fails naming the file, its partial files are removed, and the old
    checkpoint is intact.  (This used a data file name pointed at /dev/full;
    dcpx no longer writes through links: tests/test_special_files.py.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if not hasattr(signal, "SIGXFSZ") or (hard != resource.RLIM_INFINITY and hard <= 1 << 20):
        pytest.skip("RLIMIT_FSIZE not usable here")
    v1 = state_v(1, gen)
    dcpx.save(v1, checkpoint_id=ckpt)
    before = sorted(os.listdir(ckpt))

    fixed = uuid.UUID("12345678-0000-4000-8000-000000000000")
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # "big" is 1.2 MB
    try:
        with pytest.raises(OSError) as ei:
            dcpx.save(state_v(2, gen),
                      storage_writer=dcpx.FileSystemWriter(ckpt, thread_count=2))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert ei.value.errno == errno.EFBIG
    assert re.fullmatch(re.escape(os.path.join(ckpt, f"__0_{fixed.hex[:16]}_")) + r"\d\.distcp",
                        ei.value.filename), ei.value.filename
    assert ei.value.filename in str(ei.value)
    monkeypatch.undo()

    assert sorted(os.listdir(ckpt)) == before
    assert_state_bit_equal(load_state(ckpt, v1), v1)
