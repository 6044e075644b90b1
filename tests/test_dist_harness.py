"""The multi-process harness itself (tests/dist_helpers.py): a rank's
exception reaches the parent with its traceback, and a rank that hangs
fails the test at the join timeout, with its stack, instead of stalling."""
from __future__ import annotations

import time

import pytest

from dist_helpers import ChildError, spawn

pytestmark = pytest.mark.dist


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError(f"boom from rank {rank}")
    return rank * 10


def _hang_on_rank_0(rank, world_size):
    if rank == 0:
        time.sleep(600)  # a "deadlock"
    return rank


def test_child_exception_is_reraised_with_its_traceback():
    with pytest.raises(ChildError) as info:
        spawn(_raise_on_rank_1, 2, init_pg=False, timeout=60)
    msg = str(info.value)
    assert "rank 1 raised ValueError: boom from rank 1" in msg, msg
    assert "_raise_on_rank_1" in msg and "child traceback" in msg, msg
    assert "rank 0" not in msg.split("\n")[0].split("(")[1], msg  # rank 0 was fine


def test_hang_fails_at_the_join_timeout_with_the_stack():
    t0 = time.monotonic()
    with pytest.raises(ChildError) as info:
        spawn(_hang_on_rank_0, 2, init_pg=False, timeout=4)
    assert time.monotonic() - t0 < 30, "the harness did not stop the hung rank in time"
    msg = str(info.value)
    assert "rank 0 timed out" in msg, msg
    assert "_hang_on_rank_0" in msg, f"no stack of the hung rank in:\n{msg}"
