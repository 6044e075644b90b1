"""Ranks that disagree on ``checkpoint_id`` (issue 10, item 4).

A per-rank timestamp in the path is the common mistake: before the fix every
rank reported success, one directory was unloadable and another committed
checkpoint was overwritten into a mix of two saves.  Now the coordinator
compares the ranks' paths in the first collective and every rank raises
``CheckpointError`` naming the paths (which ranks have which) before
anything is written: no directory is created, a committed checkpoint at one
of the paths is left byte-for-byte as it was.

Covered: ``dcpx.save`` (dcpx's own coordination), ``dcpx.save`` with a
custom planner (torch's generic path with dcpx's writer), ``async_save``
THREAD and PROCESS.  Paths that differ only lexically (``A/``, ``A//./``)
are the same directory and save normally.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import dcpx
from conftest import assert_bit_equal
from dist_helpers import CheckSession

pytestmark = pytest.mark.dist


class _Planner(DefaultSavePlanner):
    """Any planner other than the default one: torch drives the save."""


def _state(rank: int, version: int) -> dict:
    return {"w": torch.arange(64, dtype=torch.float32) * version + rank,
            "step": version}


def _listing(path: str) -> dict:
    """{name: bytes} of a directory, or None if it does not exist."""
    if not os.path.isdir(path):
        return None
    out = {}
    for n in sorted(os.listdir(path)):
        with open(os.path.join(path, n), "rb") as f:
            out[n] = f.read()
    return out


def _disagree(ctx, how: str) -> None:
    """Rank 0 saves into ``kept`` (a committed checkpoint, shared by both
    ranks' earlier save), rank 1 into a fresh per-rank directory; every rank
    must raise, naming both paths, and nothing may change on disk."""
    kept = ctx.path(f"{how}-kept")
    dcpx.save(_state(0, 1), checkpoint_id=kept)   # both ranks: a good checkpoint
    dist.barrier()
    mine = kept if ctx.rank == 0 else ctx.path(f"{how}-rank{ctx.rank}-20260101T0000")
    before = _listing(kept)
    err = None
    try:
        if how == "sync":
            dcpx.save(_state(ctx.rank, 2), checkpoint_id=mine)
        elif how == "generic":
            dcpx.save(_state(ctx.rank, 2), checkpoint_id=mine, planner=_Planner())
        else:
            kind = (dcpx.AsyncCheckpointerType.PROCESS if how == "process"
                    else dcpx.AsyncCheckpointerType.THREAD)
            fut = dcpx.async_save(_state(ctx.rank, 2), checkpoint_id=mine,
                                  async_checkpointer_type=kind)
            fut.result(timeout=60)
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is one
        err = e
    dist.barrier()
    assert err is not None, f"{how}: rank {ctx.rank} saved into {mine!r} although the " \
                            f"other rank named another directory"
    text = str(err)
    other = ctx.path(f"{how}-rank1-20260101T0000")
    assert kept in text and other in text, (
        f"{how}: rank {ctx.rank}'s error does not name both paths: "
        f"{type(err).__name__}: {text}")
    assert "rank 0" in text and "rank 1" in text, f"{how}: ranks not named: {text}"
    if how != "generic":  # torch wraps the coordinator's error in its own
        assert isinstance(err, dcpx.CheckpointError), f"{how}: {type(err).__name__}: {text}"
    assert not os.path.exists(other), f"{how}: {other} was created: {os.listdir(other)}"
    assert _listing(kept) == before, f"{how}: the committed checkpoint in {kept} changed"
    out = {"w": torch.zeros(64), "step": None}
    dcpx.load(out, checkpoint_id=kept)
    assert_bit_equal(out["w"], _state(0, 1)["w"], "w")
    assert out["step"] == 1


def check_sync_save_refuses(ctx):
    _disagree(ctx, "sync")


def check_generic_path_refuses(ctx):
    _disagree(ctx, "generic")


def check_async_thread_refuses(ctx):
    _disagree(ctx, "thread")


def check_async_process_refuses(ctx):
    _disagree(ctx, "process")


def check_lexically_equal_paths_save(ctx):
    """``A/`` and ``A//./`` name one directory: the save goes ahead."""
    base = ctx.path("same")
    mine = base + "/" if ctx.rank == 0 else base + "//./"
    dcpx.save(_state(ctx.rank, 3), checkpoint_id=mine)
    fut = dcpx.async_save(_state(ctx.rank, 4), checkpoint_id=mine)
    fut.result(timeout=60)
    out = {"w": torch.zeros(64), "step": None}
    dcpx.load(out, checkpoint_id=base)
    assert out["step"] == 4


CHECKS = [check_sync_save_refuses, check_generic_path_refuses, check_async_thread_refuses,
          check_async_process_refuses, check_lexically_equal_paths_save]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return CheckSession(2, CHECKS, tmp_path_factory.mktemp("paths")).run()


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_disagreeing_paths_2_ranks(session, check):
    session.assert_ok(check)


def test_error_text_groups_ranks_by_path():
    from dcpx.formats.files import disagreeing_paths

    assert disagreeing_paths(["/a", "/a", None]) is None
    msg = disagreeing_paths(["/a", "/b", "/a", "/a", "/c", "/c"])
    assert "ranks 0,2-3: '/a'" in msg and "rank 1: '/b'" in msg and "ranks 4-5: '/c'" in msg
    many = disagreeing_paths([f"/ckpt/{r}" for r in range(100)])
    assert "rank 99" not in many and "and 92 other paths" in many
