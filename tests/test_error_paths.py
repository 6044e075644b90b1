"""Every error names the checkpoint path (dcpx/errors.py's promise), in the
cases that did not: a staging failure in ``async_save`` (a bare OSError
from the buffer allocation or the memfd), a save that failed on another
rank ("failed on another rank", no path), and a single-rank group whose
commit fails (which said "another rank" about itself).
"""
from __future__ import annotations

import errno
import mmap
import os

import pytest
import torch
import torch.distributed as dist

import dcpx
from dcpx.staging import StagingOptions

from dist_helpers import spawn

TIMEOUT = 120


def _enomem(*args, **kwargs):
    raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))


def _check_names_path(err: BaseException, path) -> None:
    assert str(path) in str(err), f"{type(err).__name__}: {err}"
    # the original error is kept: same type and errno, and as the cause
    assert isinstance(err, OSError) and err.errno == errno.ENOMEM, repr(err)
    assert isinstance(err.__cause__, OSError), repr(err.__cause__)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_staging_allocation_failure_names_the_checkpoint(tmp_path, monkeypatch, kind):
    """Default stager (staged inside the call): the buffer cannot be mapped
    (THREAD: anonymous mmap; PROCESS: a memfd, which a checkpoint process
    can map)."""
    path = tmp_path / "ckpt"
    dcpx.release_staging_buffers()  # else a kept buffer of an earlier test is reused
    if kind == "thread":
        monkeypatch.setattr(mmap, "mmap", _enomem)
    else:
        monkeypatch.setattr(os, "memfd_create", _enomem)
    ktype = (dcpx.AsyncCheckpointerType.THREAD if kind == "thread"
             else dcpx.AsyncCheckpointerType.PROCESS)
    with pytest.raises(OSError) as ei:
        dcpx.async_save({"w": torch.ones(1000)}, checkpoint_id=path,
                        async_checkpointer_type=ktype)
    _check_names_path(ei.value, path)
    assert not (path / ".metadata").exists()


def test_async_staging_failure_names_the_checkpoint_on_both_futures(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    monkeypatch.setattr(mmap, "mmap", _enomem)
    with dcpx.DefaultStager(StagingOptions(False, False, True, False)) as stager:
        r = dcpx.async_save({"w": torch.ones(1000)}, checkpoint_id=path, async_stager=stager)
        for fut in (r.staging_completion, r.upload_completion):
            with pytest.raises(OSError) as ei:
                fut.result(timeout=TIMEOUT)
            _check_names_path(ei.value, path)


def test_staging_error_about_the_state_dict_is_unchanged(tmp_path):
    """Not an OSError: about the state dict, naming its key as save's do
    (tests/test_async.py::test_staging_error_names_the_key); passed as is."""
    err = ValueError("dcpx: cannot save 'k': whatever")

    class Broken:
        def stage(self, sd):
            raise err

    with pytest.raises(ValueError) as ei:
        dcpx.async_save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "c", async_stager=Broken())
    assert ei.value is err


# -- process groups ------------------------------------------------------------

def _save_fails_on_rank_1(rank, world_size, path):
    """Rank 1's write fails (its own OSError); rank 0 gets an error naming the
    checkpoint path and rank 1."""
    def fail(self, *args, **kwargs):
        raise OSError(errno.EIO, "simulated write failure")

    if rank == 1:
        dcpx.FileSystemWriter.write_entries = fail
    try:
        dcpx.save({f"w{rank}": torch.ones(10)}, checkpoint_id=path)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_failure_on_another_rank_names_the_checkpoint_and_the_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    r0, r1 = spawn(_save_fails_on_rank_1, 2, path)
    assert r1 is not None and "simulated write failure" in r1, r1
    assert r0 is not None and r0.startswith("CheckpointError"), r0
    assert path in r0 and "rank 1" in r0 and "simulated write failure" in r0, r0
    assert "another rank" not in r0, r0


def _commit_fails_single_rank(rank, world_size, path):
    def fail(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self.path / ".metadata"))

    dcpx.FileSystemWriter.commit = fail
    assert dist.is_initialized() and dist.get_world_size() == 1
    try:
        dcpx.save({"w": torch.ones(10)}, checkpoint_id=path)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_single_rank_group_commit_failure_names_the_checkpoint_not_another_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    [err] = spawn(_commit_fails_single_rank, 1, path)
    assert err is not None, "the save reported success although its commit failed"
    assert "another rank" not in err, err
    assert f"checkpoint at {path} failed" in err and "rank 0: commit" in err, err
    assert "Permission denied" in err, err
