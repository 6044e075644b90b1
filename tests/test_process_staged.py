"""AsyncCheckpointerType.PROCESS with a state dict staged into shared memory
(dcpx/api/process.py): the layout's description and mappings cross the pipe
once per layout, the checkpoint process keeps its views of the buffer and
their upload plan (``_StagedViews``), and the committed metadata comes back
as its .metadata bytes.  Every checkpoint loads bit-exact, with the
mappings of its own state dict, and the Metadata the future returns is the
committed one.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from dcpx.api import process as _process

PROCESS = dcpx.AsyncCheckpointerType.PROCESS


@pytest.fixture
def messages(monkeypatch):
    """The staged requests the parent sends: (layout serial, description
    sent?, mappings sent?)."""
    sent = []
    real = _process._Worker._staged_message

    def spy(self, config, layout):
        msg = real(self, config, layout)
        sent.append((msg[3], msg[4] is not None, msg[6] is not None))
        return msg
    monkeypatch.setattr(_process._Worker, "_staged_message", spy)
    return sent


def _save(sd, path, stager):
    resp = dcpx.async_save(sd, checkpoint_id=path, async_stager=stager,
                           async_checkpointer_type=PROCESS)
    return resp.upload_completion.result() if hasattr(resp, "upload_completion") \
        else resp.result()


def _check(md, sd, path) -> None:
    """The checkpoint at path holds sd (loaded by torch, nested as sd is),
    and md is its committed metadata."""
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else
               {kk: torch.zeros_like(vv) for kk, vv in v.items()} if isinstance(v, dict) else v)
           for k, v in sd.items()}
    tdcp.load(out, checkpoint_id=path)
    for k, v in sd.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                assert torch.equal(out[k][kk], vv), (k, kk)
        elif isinstance(v, torch.Tensor):
            assert torch.equal(out[k], v), k
    committed = dcpx.FileSystemReader(path).read_metadata()
    assert md.state_dict_metadata == committed.state_dict_metadata
    assert md.storage_data == committed.storage_data
    assert md.planner_data == committed.planner_data


def _sd(step: int, n: int = 12) -> dict:
    g = torch.Generator().manual_seed(step)
    sd = {f"w{i}": torch.randn(3, 2 + i, generator=g) for i in range(n)}
    sd["step"] = step
    sd["half"] = torch.randn(5, generator=g).half()
    return sd


def test_description_crosses_once_per_layout_and_checkpoints_load(tmp_path, messages):
    with dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=False)) as stager:
        for step in range(3):
            sd = _sd(step)
            _check(_save(sd, tmp_path / f"a{step}", stager), sd, tmp_path / f"a{step}")
        # another layout (a key added): described again, then not
        for step in range(3, 5):
            sd = _sd(step)
            sd["extra"] = torch.arange(7)
            _check(_save(sd, tmp_path / f"b{step}", stager), sd, tmp_path / f"b{step}")
    first, second = messages[0][0], messages[3][0]
    assert first != second
    assert messages == [(first, True, True), (first, False, False), (first, False, False),
                        (second, True, True), (second, False, False)]


def test_same_layout_other_nesting_sends_the_new_mappings(tmp_path, messages):
    """{"a.b": t} and {"a": {"b": t}} stage into one layout (same flat keys,
    same tensors); the checkpoint records each one's own nesting."""
    with dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=False)) as stager:
        flat = {"a.b": torch.randn(4), "c": torch.randn(2)}
        nested = {"a": {"b": torch.randn(4)}, "c": torch.randn(2)}
        for i, sd in enumerate((flat, nested, nested, flat)):
            md = _save(sd, tmp_path / f"c{i}", stager)
            _check(md, sd, tmp_path / f"c{i}")
            want = {"a.b": ("a", "b") if sd is nested else ("a.b",), "c": ("c",)}
            assert md.planner_data == want
    assert len({m[0] for m in messages}) == 1  # one layout throughout
    assert [m[2] for m in messages] == [True, True, False, True]


def test_two_stagers_alternating_keep_their_own_layouts(tmp_path, messages):
    one = dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True))
    two = dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True))
    try:
        for step in range(4):
            stager = (one, two)[step % 2]
            sd = _sd(step, n=6 + step % 2)  # the two have different layouts
            _check(_save(sd, tmp_path / f"d{step}", stager), sd, tmp_path / f"d{step}")
    finally:
        one.close()
        two.close()
    assert [m[1] for m in messages] == [True, True, False, False]


def test_a_new_buffer_after_release_is_described_again(tmp_path, messages):
    sd = _sd(1)
    with dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=False)) as stager:
        _check(_save(sd, tmp_path / "e0", stager), sd, tmp_path / "e0")
    with dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=False)) as stager:
        sd = _sd(2)
        _check(_save(sd, tmp_path / "e1", stager), sd, tmp_path / "e1")
        sd = _sd(3)
        _check(_save(sd, tmp_path / "e2", stager), sd, tmp_path / "e2")
    assert [m[1] for m in messages] == [True, True, False]


def test_encoded_reply_only_for_what_the_decoder_allows():
    from torch.distributed.checkpoint.metadata import Metadata
    md = Metadata(state_dict_metadata={}, planner_data={"x": ("x",), "l.0": ("l", 0)})
    assert _process._encoded(md) is not None
    odd = Metadata(state_dict_metadata={}, planner_data={"k": (("tuple", "key"),)})
    assert _process._encoded(odd) is None


def test_a_failed_save_does_not_lose_the_layout(tmp_path, messages):
    """The first save of a layout fails in the checkpoint process (a writer
    with overwrite=False over an existing checkpoint); the next save of that
    layout describes it again and succeeds."""
    dcpx.save({"x": torch.ones(1)}, checkpoint_id=tmp_path / "taken")
    with dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=False)) as stager:
        sd = _sd(1)
        resp = dcpx.async_save(sd, storage_writer=dcpx.FileSystemWriter(
            tmp_path / "taken", overwrite=False), async_stager=stager,
            async_checkpointer_type=PROCESS)
        with pytest.raises(Exception, match="already exists"):
            resp.result()
        sd = _sd(2)
        _check(_save(sd, tmp_path / "ok", stager), sd, tmp_path / "ok")
        sd = _sd(3)
        _check(_save(sd, tmp_path / "ok2", stager), sd, tmp_path / "ok2")
    assert [m[1] for m in messages] == [True, True, False]
