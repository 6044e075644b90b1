"""async_save(async_checkpointer_type=PROCESS) with any StorageWriter and any
planner (issue 10, item 7).  Before the fix dcpx raised NotImplementedError
for both; torch sends the writer and the planner to its checkpoint process.

Writers: a subclass of torch's FileSystemWriter defined here (always run;
it leaves a marker file, so the test sees that the user's class did the
writing), and torch's FsspecWriter on a local directory (if fsspec is
installed).  Planners: a DefaultSavePlanner subclass that renames every key
(observable in the checkpoint), with dcpx's writer and with the foreign
ones.  Stagers: none (the writer stages, or dcpx's per-call shared-memory
stager) and a long-lived dcpx DefaultStager with shared memory (its pages
are mapped by the checkpoint process, not copied).  Every checkpoint is
loaded with torch DCP and with dcpx, bit-exact.  A planner that does not
pickle fails on the upload future with an error naming its class.  The same
with a process group (gloo, 2 ranks) runs in test_dist_process_foreign.
"""
from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import dcpx
from conftest import assert_bit_equal

PROCESS = dcpx.AsyncCheckpointerType.PROCESS
MARKER = "written-by-MarkingWriter"


class MarkingWriter(tdcp.FileSystemWriter):
    """A user's StorageWriter: torch's, plus a marker file from write_data
    (which runs in the checkpoint process)."""

    def write_data(self, plan, planner):
        with open(os.path.join(str(self.path), MARKER), "w") as f:
            f.write(str(os.getpid()))
        return super().write_data(plan, planner)


class RenamingPlanner(DefaultSavePlanner):
    """Saves every key under ``renamed.<key>``."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        super().set_up_planner({f"renamed.{k}": v for k, v in state_dict.items()},
                               storage_meta, is_coordinator)


class LockedPlanner(DefaultSavePlanner):
    """A planner that holds a lock: it does not pickle."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(64, 33, generator=g),
            "h": torch.randn(100, generator=g).to(torch.bfloat16),
            "i": torch.arange(17, dtype=torch.int64),
            "step": 12}


def _writer(kind: str, path: str):
    if kind == "marking":
        return MarkingWriter(path)
    if kind == "fsspec":
        pytest.importorskip("fsspec")
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        return FsspecWriter(path)
    return dcpx.FileSystemWriter(path)


def _check_loads(path: str, renamed: bool) -> None:
    want = _state()
    pre = "renamed." if renamed else ""
    for load in (tdcp.load, dcpx.load):
        out = {f"{pre}w": torch.zeros(64, 33), f"{pre}h": torch.zeros(100, dtype=torch.bfloat16),
               f"{pre}i": torch.zeros(17, dtype=torch.int64), f"{pre}step": 0}
        load(out, checkpoint_id=path)
        for k in ("w", "h", "i"):
            assert_bit_equal(out[pre + k], want[k], f"{load.__module__}: {pre}{k}")
        assert out[pre + "step"] == 12


@pytest.mark.parametrize("stager", ["none", "shared"])
@pytest.mark.parametrize("writer,planner", [
    ("marking", None), ("marking", "renaming"), ("fsspec", None), ("fsspec", "renaming"),
    ("dcpx", "renaming"),
])
def test_process_upload_with_any_writer_and_planner(tmp_path, monkeypatch, writer, planner,
                                                   stager):
    from dcpx.api import process as _process
    sent = []
    send_buffer = _process._Worker._send_buffer
    monkeypatch.setattr(_process._Worker, "_send_buffer",
                        lambda self, buf: sent.append(buf.serial) or send_buffer(self, buf))
    path = str(tmp_path / "ckpt")
    sd = _state()
    st = dcpx.DefaultStager(dcpx.StagingOptions(False, True, False, False)) \
        if stager == "shared" else None
    try:
        for _ in range(2):  # the second save reuses the worker (and the stager's buffer)
            fut = dcpx.async_save(sd, storage_writer=_writer(writer, path),
                                  planner=RenamingPlanner() if planner else None,
                                  async_checkpointer_type=PROCESS, async_stager=st)
            md = fut.result(timeout=120)
            assert ("renamed.w" in md.state_dict_metadata) == bool(planner)
    finally:
        if st is not None:
            st.close()
    # dcpx's shared-memory staging: the checkpoint process maps the pages.
    assert bool(sent) == (stager == "shared" or (writer == "dcpx")), sent
    if writer == "marking":
        with open(os.path.join(path, MARKER)) as f:
            assert int(f.read()) != os.getpid(), "write_data ran in the training process"
    _check_loads(path, renamed=bool(planner))


def test_process_upload_planner_that_does_not_pickle(tmp_path):
    fut = dcpx.async_save(_state(), checkpoint_id=str(tmp_path / "ckpt"),
                          planner=LockedPlanner(), async_checkpointer_type=PROCESS)
    with pytest.raises(TypeError, match="LockedPlanner.*does not pickle"):
        fut.result(timeout=120)
    assert not os.path.exists(tmp_path / "ckpt" / ".metadata")
    # The checkpoint process is still usable.
    dcpx.async_save(_state(), checkpoint_id=str(tmp_path / "ok"), planner=RenamingPlanner(),
                    async_checkpointer_type=PROCESS).result(timeout=120)
    _check_loads(str(tmp_path / "ok"), renamed=True)
