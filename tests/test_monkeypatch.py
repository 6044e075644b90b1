"""A script that replaces torch.distributed.checkpoint's save / load /
async_save with dcpx's (as Lightning users switch backends) must still be
able to reach every dcpx path that hands the plan to torch (a custom
planner, a foreign storage writer / reader): dcpx calls torch's original
functions, captured at import, never the (replaced) module attributes
(issue 10, item 8)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

import dcpx
from conftest import assert_state_bit_equal


class MySavePlanner(DefaultSavePlanner):
    pass


class MyLoadPlanner(DefaultLoadPlanner):
    pass


@pytest.fixture
def patched(monkeypatch):
    """torch DCP's entry points replaced by dcpx's, module attributes and
    package attributes alike."""
    for mod in (tdcp, state_dict_saver):
        monkeypatch.setattr(mod, "save", dcpx.save)
        monkeypatch.setattr(mod, "async_save", dcpx.async_save)
    for mod in (tdcp, state_dict_loader):
        monkeypatch.setattr(mod, "load", dcpx.load)
    assert tdcp.save is dcpx.save and state_dict_loader.load is dcpx.load


def _state():
    g = torch.Generator().manual_seed(8)
    return {"w": torch.randn(5, 7, generator=g), "b": torch.arange(9, dtype=torch.int16),
            "step": 12, "nested": {"m": torch.randn(3, generator=g)}}


def _empty_like(sd):
    return {"w": torch.zeros(5, 7), "b": torch.zeros(9, dtype=torch.int16), "step": 0,
            "nested": {"m": torch.zeros(3)}}


def test_custom_planners_after_patching(patched, tmp_path):
    sd = _state()
    tdcp.save(sd, checkpoint_id=tmp_path, planner=MySavePlanner())
    out = _empty_like(sd)
    tdcp.load(out, checkpoint_id=tmp_path, planner=MyLoadPlanner())
    assert_state_bit_equal(out, sd)


def test_foreign_storage_after_patching(patched, tmp_path):
    sd = _state()
    writer = tdcp.FileSystemWriter(tmp_path)  # torch's own: foreign to dcpx
    assert not isinstance(writer, dcpx.FileSystemWriter)
    state_dict_saver.save(sd, storage_writer=writer)
    out = _empty_like(sd)
    state_dict_loader.load(out, storage_reader=tdcp.FileSystemReader(tmp_path))
    assert_state_bit_equal(out, sd)


def test_async_save_custom_planner_after_patching(patched, tmp_path):
    sd = _state()
    fut = tdcp.async_save(sd, checkpoint_id=tmp_path, planner=MySavePlanner())
    fut.result(timeout=60)
    out = _empty_like(sd)
    dcpx.load(out, checkpoint_id=tmp_path)
    assert_state_bit_equal(out, sd)


def test_async_save_foreign_writer_after_patching(patched, tmp_path):
    sd = _state()
    fut = state_dict_saver.async_save(sd, storage_writer=tdcp.FileSystemWriter(tmp_path))
    fut.result(timeout=60)
    out = _empty_like(sd)
    tdcp.load(out, checkpoint_id=tmp_path, planner=MyLoadPlanner())
    assert_state_bit_equal(out, sd)
