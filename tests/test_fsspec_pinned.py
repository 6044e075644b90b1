"""A URL load that reads in turns reads one version of each data file
(issue 31, item 2): torch's FsspecWriter rewrites ``__0_0.distcp`` in
place, and a save between two turns of a load used to hand back the values
of two saves, every record's CRC valid.  The load pins each data file's
version (size and version id / ETag / time, from the store's listing) and
refuses, naming the file, when it changes.  memory:// stands in for a
store; tests/test_fsspec_s3.py does the same against moto's S3 (ETags)."""
from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from dcpx import fsspec as dfs
from dcpx.filesystem import FileSystemReader

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def mem():
    fs = fsspec.filesystem("memory")
    root = f"/dcpx-pinned-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _state(v: float) -> dict:
    return {f"t{i}": torch.full((1 << 14,), v + i) for i in range(8)}   # 64 KiB each


def rewrite_between_turns(monkeypatch, url: str, save_again, **kw) -> list:
    """Load ``url`` in turns of 64 KiB; after the first turn ``save_again()``
    rewrites the checkpoint.  Returns the loaded state dict's values' first
    elements (the caller expects the load to raise)."""
    monkeypatch.setattr(dfs, "_TEMP_BUDGET", 64 << 10)
    real = FileSystemReader.read_data
    turns = []

    def turn(self, plan, planner):
        out = real(self, plan, planner)
        turns.append(len(plan.items))
        if len(turns) == 1:
            save_again()
        return out

    monkeypatch.setattr(FileSystemReader, "read_data", turn)
    out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    try:
        dcpx.load(out, storage_reader=dfs.FsspecReader(url, **kw))
    finally:
        monkeypatch.setattr(FileSystemReader, "read_data", real)
    return sorted({float(v[0]) - int(k[1:]) for k, v in out.items()})


def test_torch_resave_in_place_between_turns_is_refused(mem, monkeypatch):
    tdcp.save(_state(100.0), checkpoint_id=mem)      # torch's FsspecWriter
    names = sorted(p.rsplit("/", 1)[-1] for p in fsspec.filesystem("memory").ls(
        mem.removeprefix("memory://"), detail=False))
    assert "__0_0.distcp" in names, names          # torch's name, reused by every save
    with pytest.raises(dcpx.CorruptCheckpointError) as e:
        got = rewrite_between_turns(
            monkeypatch, mem, lambda: tdcp.save(_state(200.0), checkpoint_id=mem))
        pytest.fail(f"loaded values of saves {got} without an error")
    msg = str(e.value)
    assert f"{mem}/__0_0.distcp" in msg and "changed while it was being loaded" in msg, msg
    # once the save has finished, the load reads the new checkpoint whole
    out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    dcpx.load(out, checkpoint_id=mem)
    for k, v in _state(200.0).items():
        assert torch.equal(out[k], v), k


def test_dcpx_resave_between_turns_is_refused(mem, monkeypatch):
    """dcpx's own writer never rewrites a data file (a tag new per save), but
    deletes the replaced checkpoint's files after its commit: a load still
    reading them is refused with the file named, not a bare file-not-found."""
    dcpx.save(_state(100.0), checkpoint_id=mem)
    with pytest.raises(dcpx.CorruptCheckpointError, match="changed while it was being loaded"):
        rewrite_between_turns(monkeypatch, mem,
                              lambda: dcpx.save(_state(200.0), checkpoint_id=mem))


def test_untouched_checkpoint_loads_in_turns(mem, monkeypatch):
    """The pins cost a look per turn (an info per file read), nothing else."""
    tdcp.save(_state(100.0), checkpoint_id=mem)
    looks = []
    fs = fsspec.filesystem("memory")
    real = type(fs).info

    def counted(self, path, **kw):
        looks.append(path)
        return real(self, path, **kw)

    monkeypatch.setattr(type(fs), "info", counted)
    assert rewrite_between_turns(monkeypatch, mem, lambda: None) == [100.0]
    assert len(looks) >= 3 and all(p.endswith("__0_0.distcp") for p in looks), looks


def test_many_files_are_rechecked_with_one_listing(mem, monkeypatch):
    """More files in a turn than _INFO_MAX: one listing of the directory."""
    monkeypatch.setattr(dfs, "_INFO_MAX", 0)
    tdcp.save(_state(100.0), checkpoint_id=mem)
    with pytest.raises(dcpx.CorruptCheckpointError, match="changed while it was being loaded"):
        rewrite_between_turns(monkeypatch, mem,
                              lambda: tdcp.save(_state(200.0), checkpoint_id=mem))


def test_a_version_is_compared_on_what_both_looks_give():
    """S3's listing has no VersionId and times finer than a HEAD's: the
    strongest field both give decides (the ETag); sizes always count."""
    from datetime import datetime, timezone
    listed = {"size": 10, "ETag": '"abc"', "LastModified": datetime(2026, 1, 1, 0, 0, 0, 123000,
                                                                    tzinfo=timezone.utc)}
    head = {"size": 10, "ETag": '"abc"', "VersionId": "v1",
            "LastModified": datetime(2026, 1, 1, tzinfo=timezone.utc)}
    assert dfs._same(dfs._stamp(listed), dfs._stamp(head))
    assert not dfs._same(dfs._stamp(listed), dfs._stamp({**head, "ETag": '"abd"'}))
    assert not dfs._same(dfs._stamp(listed), dfs._stamp({**head, "size": 11}))
    # memory://: a timestamp in its listing, a datetime in its info
    t = datetime(2026, 1, 1, 0, 0, 1, 5, tzinfo=timezone.utc)
    assert dfs._same(dfs._stamp({"size": 1, "created": t.timestamp()}),
                     dfs._stamp({"size": 1, "created": t}))
    assert dfs._same(dfs._stamp({"size": 1}), dfs._stamp({"size": 1, "mtime": 5.0}))
