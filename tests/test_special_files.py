"""Special files in a checkpoint directory: FIFOs, symbolic links,
directories where dcpx expects a data file or ``.metadata``.

Load, ``python -m dcpx verify`` / ``inspect`` and the C reader open only
regular files, without following a link and without blocking, and refuse
anything else with ``CorruptCheckpointError`` naming the file.  Save never
writes through a link nor opens a FIFO: data files are created fresh
(whatever had the name is removed first, a link itself and never its
target), ``.metadata`` is renamed into place (which replaces a link, not its
target).  The checkpoint directory itself may be a link (``latest ->
step_100``).

A FIFO made ``load`` hang before: each call that might block runs on a
thread joined with a generous timeout; if it is still blocked, the FIFO is
opened from the other end to release it and the test fails (a regression
fails instead of hanging CI).
"""
from __future__ import annotations

import contextlib
import io
import os
import threading
import uuid

import pytest
import torch

import dcpx
import dcpx.filesystem
from dcpx.__main__ import main as cli
from conftest import assert_state_bit_equal, data_files, empty_like_state, make_tensor

HANG = 60.0  # seconds: a guard against hanging, never a timing assertion
#: a save's tag when uuid4 is fixed to _FIXED (tags are uuid4().hex[:16])
_FIXED = uuid.UUID("12345678-0000-4000-8000-000000000000")
_TAG = _FIXED.hex[:16]


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": make_tensor((64, 32), torch.float32, g),
            "big": make_tensor((300_000,), torch.float32, g),  # read in chunks
            "n": make_tensor((5,), torch.int64, g), "step": seed}


def load(path, like) -> dict:
    dest = empty_like_state(like)
    dcpx.load(dest, checkpoint_id=path)
    return dest


def _release(fifos) -> None:
    """Open each FIFO from both ends without blocking, which wakes whoever
    is blocked opening it."""
    for f in fifos:
        for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
            try:
                os.close(os.open(f, flags))
            except OSError:
                pass


def no_hang(fn, *fifos):
    """fn()'s result, or its exception raised here; fails if it blocks."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG)
    if t.is_alive():
        _release(fifos)
        t.join(HANG)
        pytest.fail(f"blocked for {HANG:.0f} s (on a FIFO?)")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def cli_run(*argv) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = cli(list(argv))
    return rc, out.getvalue() + err.getvalue()


@pytest.fixture
def saved(tmp_path):
    """A committed checkpoint, its state, and a directory outside it."""
    ckpt = tmp_path / "ckpt"
    sd = state(1)
    dcpx.save(sd, checkpoint_id=ckpt)
    outside = tmp_path / "outside"
    outside.mkdir()
    return ckpt, sd, outside


def _data_file(ckpt) -> str:
    [name] = data_files(ckpt)
    return str(ckpt / name)


# --------------------------------------------------------------------- load

def test_fifo_metadata_is_refused_promptly(saved):
    ckpt, sd, _ = saved
    md = ckpt / ".metadata"
    os.unlink(md)
    os.mkfifo(md)
    with pytest.raises(dcpx.CorruptCheckpointError, match=r"\.metadata: is a FIFO") as ei:
        no_hang(lambda: load(ckpt, sd), md)
    assert str(md) in str(ei.value)
    with pytest.raises(dcpx.CorruptCheckpointError, match="FIFO"):
        no_hang(lambda: dcpx.FileSystemReader(ckpt).read_metadata(), md)
    for cmd in ("verify", "inspect"):
        rc, text = no_hang(lambda: cli_run(cmd, str(ckpt)), md)
        assert rc != 0 and "FIFO" in text and str(md) in text, (cmd, text)


def test_fifo_data_file_is_refused_promptly(saved):
    ckpt, sd, _ = saved
    data = _data_file(ckpt)
    os.unlink(data)
    os.mkfifo(data)
    with pytest.raises(dcpx.CorruptCheckpointError, match="is a FIFO") as ei:
        no_hang(lambda: load(ckpt, sd), data)
    assert data in str(ei.value)
    rc, text = no_hang(lambda: cli_run("verify", str(ckpt)), data)
    assert rc != 0 and "FIFO" in text and data in text


def test_data_file_linked_to_elsewhere_is_refused(saved):
    """The link points at a valid copy of the data file: following it would
    load fine, but dcpx does not follow links inside a checkpoint."""
    ckpt, sd, outside = saved
    data = _data_file(ckpt)
    target = outside / "copy.distcp"
    os.replace(data, target)
    os.symlink(target, data)
    with pytest.raises(dcpx.CorruptCheckpointError, match="symbolic link") as ei:
        load(ckpt, sd)
    assert data in str(ei.value) and "'" in str(ei.value)  # names the file and a key
    rc, text = cli_run("verify", str(ckpt))
    assert rc != 0 and "symbolic link" in text
    rc, text = cli_run("inspect", str(ckpt))
    assert rc != 0 and "symbolic link" in text


def test_metadata_linked_to_elsewhere_is_refused(saved):
    ckpt, sd, outside = saved
    md = ckpt / ".metadata"
    os.replace(md, outside / "md")
    os.symlink(outside / "md", md)
    with pytest.raises(dcpx.CorruptCheckpointError, match=r"\.metadata: is a symbolic link"):
        load(ckpt, sd)


def test_directory_in_place_of_a_data_file_is_named(saved):
    ckpt, sd, _ = saved
    data = _data_file(ckpt)
    os.unlink(data)
    os.mkdir(data)
    with pytest.raises(dcpx.CorruptCheckpointError, match="is a directory") as ei:
        load(ckpt, sd)
    assert data in str(ei.value)
    rc, text = cli_run("verify", str(ckpt))
    assert rc != 0 and "is a directory" in text


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_c_reader_refuses_a_file_swapped_after_validation(saved, kind):
    """The C reader checks each file it opens itself (the Python checks
    before it could be raced): swap the data file between the metadata
    checks and the read."""
    ckpt, sd, outside = saved
    reader = dcpx.FileSystemReader(ckpt)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    data = _data_file(ckpt)
    os.replace(data, outside / "real")
    if kind == "symlink":
        os.symlink(outside / "real", data)
    elif kind == "fifo":
        os.mkfifo(data)
    else:
        os.mkdir(data)
    reads = []
    for index, info in md.storage_data.items():
        if index.offset is not None:
            chunk, dtype = reader.chunk_of(index)
            reads.append(dcpx.storage.reader._TensorRead(
                index.fqn, info, chunk, dtype, torch.empty(chunk, dtype=dtype), None))
    expect = {"symlink": "symbolic link", "fifo": "FIFO", "directory": "directory"}[kind]
    with pytest.raises(dcpx.CorruptCheckpointError, match=expect) as ei:
        no_hang(lambda: reader.read_tensors(reads), data)
    assert data in str(ei.value)


def test_linked_checkpoint_directory_works(tmp_path):
    """``latest -> step_100``: save, re-save, load, verify and inspect
    through the link; only files inside a checkpoint must be regular."""
    real = tmp_path / "step_100"
    latest = tmp_path / "latest"
    sd = state(2)
    dcpx.save(sd, checkpoint_id=real)
    os.symlink(real, latest)
    assert_state_bit_equal(load(latest, sd), sd)
    assert cli_run("verify", str(latest))[0] == 0
    assert cli_run("inspect", str(latest))[0] == 0
    sd3 = state(3)
    dcpx.save(sd3, checkpoint_id=latest)
    assert os.path.islink(latest)
    assert_state_bit_equal(load(real, sd3), sd3)
    os.symlink("step_100", tmp_path / "relative")
    assert_state_bit_equal(load(tmp_path / "relative", sd3), sd3)


# --------------------------------------------------------------------- save

def _plant(path, kind, outside):
    """Put a link to a file outside (returned, with its bytes), a FIFO or a
    directory at ``path``."""
    if kind == "symlink":
        target = outside / f"victim-{os.path.basename(path)}"
        target.write_bytes(b"not yours to overwrite")
        os.symlink(target, path)
        return target
    if kind == "fifo":
        os.mkfifo(path)
    return None


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-dir", "re-save"])
def test_save_replaces_a_link_or_fifo_where_it_writes_a_data_file(tmp_path, kind, fresh,
                                                                  monkeypatch):
    """Whatever has a data file's name is replaced by a new regular file:
    the link's target is untouched, a FIFO is not opened (no block)."""
    ckpt = tmp_path / "ckpt"
    outside = tmp_path / "outside"
    outside.mkdir()
    if not fresh:
        dcpx.save(state(1), checkpoint_id=ckpt)
    else:
        ckpt.mkdir()
    # Every save's data files carry its tag (docs/format.md): fix the save's
    # tag so that its names are known.
    fixed = uuid.UUID("12345678-0000-4000-8000-000000000000")
    names = [ckpt / f"__0_{_TAG}_{i}.distcp" for i in range(2)]
    targets = [_plant(n, kind, outside) for n in names]
    sd = state(4)
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)
    writer = dcpx.FileSystemWriter(ckpt, thread_count=2)
    no_hang(lambda: dcpx.save(sd, storage_writer=writer), *names)
    monkeypatch.undo()
    for n in names:
        assert os.path.isfile(n) and not os.path.islink(n), n
    for t in targets:
        if t is not None:
            assert t.read_bytes() == b"not yours to overwrite"
    assert_state_bit_equal(load(ckpt, sd), sd)


def test_async_save_does_not_write_through_a_link(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    target = _plant(ckpt / f"__0_{_TAG}_0.distcp", "symlink", outside)
    sd = state(5)
    monkeypatch.setattr(uuid, "uuid4", lambda: _FIXED)
    dcpx.async_save(sd, checkpoint_id=ckpt).result(timeout=HANG)
    monkeypatch.undo()
    assert target.read_bytes() == b"not yours to overwrite"
    assert_state_bit_equal(load(ckpt, sd), sd)


def test_save_with_a_directory_where_a_data_file_goes_names_it(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    doomed = ckpt / f"__0_{_TAG}_0.distcp"
    os.mkdir(doomed)
    monkeypatch.setattr(uuid, "uuid4", lambda: _FIXED)
    with pytest.raises(IsADirectoryError) as ei:
        dcpx.save(state(6), checkpoint_id=ckpt)
    monkeypatch.undo()
    assert ei.value.filename == str(doomed)
    assert not (ckpt / ".metadata").exists()


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_metadata_link_or_fifo_is_replaced_by_the_rename(tmp_path, kind):
    """The commit renames the new ``.metadata`` over whatever has the name:
    a link itself is replaced (its target untouched), a FIFO too."""
    ckpt = tmp_path / "ckpt"
    outside = tmp_path / "outside"
    outside.mkdir()
    sd = state(7)
    dcpx.save(state(1), checkpoint_id=ckpt)
    os.unlink(ckpt / ".metadata")
    target = _plant(ckpt / ".metadata", kind, outside)
    no_hang(lambda: dcpx.save(sd, checkpoint_id=ckpt), ckpt / ".metadata")
    assert os.path.isfile(ckpt / ".metadata") and not os.path.islink(ckpt / ".metadata")
    if target is not None:
        assert target.read_bytes() == b"not yours to overwrite"
    assert_state_bit_equal(load(ckpt, sd), sd)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_temporary_metadata_is_never_written_through_a_link_or_fifo(tmp_path, kind, monkeypatch):
    """``.metadata.tmp.<save id>`` is created with O_EXCL: a link or FIFO
    already there (only possible on purpose: the id is a fresh uuid4) fails
    the save, before anything is written through it or blocks."""
    ckpt = tmp_path / "ckpt"
    outside = tmp_path / "outside"
    outside.mkdir()
    ckpt.mkdir()
    fixed = uuid.UUID("12345678-0000-4000-8000-000000000000")
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)
    tmp = ckpt / f".metadata.tmp.{fixed}"
    target = _plant(tmp, kind, outside)
    with pytest.raises(FileExistsError):
        no_hang(lambda: dcpx.save(state(8), checkpoint_id=ckpt), tmp)
    if target is not None:
        assert target.read_bytes() == b"not yours to overwrite"
    assert not (ckpt / ".metadata").exists()
