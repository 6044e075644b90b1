"""dcpx.load of a directory an async_save of this process is still
uploading into waits for that upload (issue 22, item 2: the README's first
snippet failed with IncompleteCheckpointError), and only for that
directory's saves."""
from __future__ import annotations

import threading
import time

import torch

import dcpx
from dcpx.api import async_save as _async


def _hold_uploads() -> threading.Event:
    """Block the upload thread until the event is set: an upload queued
    after this is in flight, deterministically."""
    go = threading.Event()
    _async._uploader().submit(go.wait, 30)
    return go


def test_load_waits_for_async_save_into_same_directory(tmp_path):
    ckpt = tmp_path / "step_200"
    state = {"w": torch.arange(6.0), "step": 200}
    go = _hold_uploads()
    fut = dcpx.async_save(state, checkpoint_id=ckpt)
    threading.Timer(0.3, go.set).start()
    out = {"w": torch.zeros(6), "step": 0}
    t0 = time.monotonic()
    dcpx.load(out, checkpoint_id=ckpt)  # main: IncompleteCheckpointError (no .metadata yet)
    assert time.monotonic() - t0 >= 0.25
    assert fut.done() and fut.exception() is None
    assert torch.equal(out["w"], torch.arange(6.0)) and out["step"] == 200


def test_load_of_another_directory_does_not_wait(tmp_path):
    dcpx.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "a")
    go = _hold_uploads()
    try:
        fut = dcpx.async_save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "b")
        out = {"w": torch.zeros(3)}
        dcpx.load(out, checkpoint_id=tmp_path / "a")  # returns while b's upload is held
        assert not fut.done() and torch.equal(out["w"], torch.ones(3))
    finally:
        go.set()
    fut.result()


def test_readme_first_snippet(tmp_path, monkeypatch):
    """The README's first block, as written."""
    monkeypatch.chdir(tmp_path)
    dcp = dcpx
    state_dict = {"w": torch.randn(512, 512), "step": 7}
    dcp.save(state_dict, checkpoint_id="ckpt/step_100")
    future = dcp.async_save(state_dict, checkpoint_id="ckpt/step_200")
    future.result()
    dcp.load(state_dict, checkpoint_id="ckpt/step_200")
