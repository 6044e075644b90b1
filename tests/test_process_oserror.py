"""AsyncCheckpointerType.PROCESS: an OSError that is not the pipe to the
checkpoint process breaking (a FileExistsError or ENOSPC from the save
itself, reported by the checkpoint process or met in this one) is raised
at once, as it is; only a broken pipe (EOFError, BrokenPipeError,
ConnectionError) or a dead process waits for the process to end, to tell
whether it stopped because the main script ran again in it
(dcpx/api/process.py, ``_Worker._raise_if_unguarded``)."""
from __future__ import annotations

import errno

import pytest
import torch

import dcpx
from dcpx.api import process as _process

PROCESS = dcpx.AsyncCheckpointerType.PROCESS


def _save(sd, **kw):
    resp = dcpx.async_save(sd, async_checkpointer_type=PROCESS, **kw)
    return resp.upload_completion.result() if hasattr(resp, "upload_completion") \
        else resp.result()


@pytest.fixture
def joins(tmp_path, monkeypatch):
    """The started checkpoint process's join() calls (a save first starts it)."""
    _save({"x": torch.ones(2)}, checkpoint_id=tmp_path / "warm")
    proc = _process._worker.proc
    calls = []
    real = proc.join
    monkeypatch.setattr(proc, "join", lambda *a: calls.append(a) or real(*a))
    return calls


def test_an_oserror_of_the_save_in_the_checkpoint_process_is_raised_without_waiting(tmp_path,
                                                                                   joins):
    (tmp_path / "file").write_bytes(b"")  # a checkpoint directory under a file
    with pytest.raises(OSError) as info:
        _save({"x": torch.ones(2)}, checkpoint_id=tmp_path / "file" / "ckpt")
    assert info.value.errno == errno.ENOTDIR, info.value
    assert joins == []  # it waited 5 s for the (alive) process to end
    assert _process._worker.proc.is_alive()
    _save({"x": torch.ones(2)}, checkpoint_id=tmp_path / "after")  # the process goes on


def test_an_oserror_in_this_process_is_raised_as_it_is(tmp_path, joins, monkeypatch):
    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(_process._Worker, "_sync_cwd", full)
    with pytest.raises(OSError) as info:
        _save({"x": torch.ones(2)}, checkpoint_id=tmp_path / "full")
    assert info.value.errno == errno.ENOSPC and joins == []


def test_a_broken_pipe_still_waits_for_the_process(tmp_path, joins, monkeypatch):
    def broken(self):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")
    monkeypatch.setattr(_process._Worker, "_sync_cwd", broken)
    with pytest.raises(RuntimeError, match="the checkpoint process died"):
        _save({"x": torch.ones(2)}, checkpoint_id=tmp_path / "broken")
    assert joins == [(5,)]
