"""async_save after a collective timeout (issue 10, item 5).

A rank that does not join a save within the group's timeout makes that save
fail on every rank; a job that catches the error and trains on must get its
next checkpoint.  Before the fix dcpx kept reusing its own gloo group after a
collective on it had timed out, and every later async_save failed at once.

Each run: 2 ranks, process-group timeout SHORT_PG_TIMEOUT.  Rank 0 starts
save ``v2`` alone; rank 1 is alive but late: it calls the same async_save
only after rank 0's upload future has failed (a flag file), so its save
fails too.  Then both ranks save ``v3``, which must succeed on both and load
bit-exactly.  Variants: THREAD and PROCESS; the timeout on the first
async_save of the job (the group is being made) or after a good one.

Also checked: ``async_save()`` itself returns (as torch's THREAD does); the
failure comes on the upload future.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import dcpx
from conftest import assert_bit_equal
from dist_helpers import spawn_outcomes

pytestmark = pytest.mark.dist

SHORT_PG_TIMEOUT = 4.0
PEER_WAIT = 60.0


def _state(version: int) -> dict:
    return {"w": torch.arange(256, dtype=torch.float32) * version, "step": version}


def _wait_for(flag: str) -> None:
    end = time.monotonic() + PEER_WAIT
    while not os.path.exists(flag):
        assert time.monotonic() < end, f"test setup: {flag} never appeared"
        time.sleep(0.05)


def _raise(flag: str) -> None:
    with open(flag, "w"):
        pass


def _save(path: str, version: int, kind: str):
    """(upload future or None, exception async_save() raised or None)."""
    t = (dcpx.AsyncCheckpointerType.PROCESS if kind == "process"
         else dcpx.AsyncCheckpointerType.THREAD)
    try:
        return dcpx.async_save(_state(version), checkpoint_id=path,
                               async_checkpointer_type=t), None
    except Exception as e:  # noqa: BLE001 - reported
        return None, e


def _outcome(fut) -> str:
    try:
        fut.result(timeout=PEER_WAIT)
    except BaseException as e:  # noqa: BLE001 - reported
        return f"{type(e).__name__}: {e}"[:400]
    return "ok"


def _timeout_then_good_save(rank, world_size, path, kind, first):
    rep = {}
    if not first:
        fut, err = _save(path + "/v1", 1, kind)
        assert err is None, f"v1: {err!r}"
        rep["v1"] = _outcome(fut)
        dist.barrier()
    if rank == 1:
        _wait_for(path + ".rank0_failed")  # late, alive
    fut, err = _save(path + "/v2", 2, kind)
    rep["v2_sync_error"] = None if err is None else f"{type(err).__name__}: {err}"[:400]
    rep["v2"] = "not submitted" if fut is None else _outcome(fut)
    _raise(path + f".rank{rank}_failed")
    if rank == 0:
        _wait_for(path + ".rank1_failed")
    dist.barrier()   # the training's own group is fine: the job trains on
    fut, err = _save(path + "/v3", 3, kind)
    rep["v3_sync_error"] = None if err is None else f"{type(err).__name__}: {err}"[:400]
    rep["v3"] = "not submitted" if fut is None else _outcome(fut)
    if rep["v3"] == "ok":
        out = {"w": torch.zeros(256), "step": None}
        dcpx.load(out, checkpoint_id=path + "/v3")
        assert_bit_equal(out["w"], _state(3)["w"], "w")
        rep["v3_loaded_step"] = out["step"]
    # And once more, on the rebuilt group.
    fut, err = _save(path + "/v4", 4, kind)
    rep["v4"] = f"sync {err!r}" if fut is None else _outcome(fut)
    return rep


@pytest.mark.parametrize("kind,first", [("thread", False), ("process", False),
                                        ("thread", True)],
                         ids=["thread", "process", "thread-first-save"])
def test_async_save_recovers_after_a_collective_timeout(tmp_path, kind, first):
    path = str(tmp_path / "ckpt")
    outs = spawn_outcomes(_timeout_then_good_save, 2, path, kind, first,
                          pg_timeout=SHORT_PG_TIMEOUT, timeout=PEER_WAIT + 120)
    for o in outs:
        assert o.ok, o.describe()
    reps = [o.value for o in outs]
    for r, rep in enumerate(reps):
        if not first:
            assert rep["v1"] == "ok", f"rank {r}: test setup: v1 failed: {rep}"
        assert rep["v2_sync_error"] is None, (
            f"rank {r}: async_save() raised {rep['v2_sync_error']}; torch reports a "
            f"coordination failure on the upload future")
        assert rep["v2"] != "ok", f"rank {r}: v2 succeeded although the ranks never met: {rep}"
    for r, rep in enumerate(reps):
        assert rep["v3_sync_error"] is None and rep["v3"] == "ok", (
            f"rank {r}: the save after the timeout failed (all ranks took part): {rep}")
        assert rep["v3_loaded_step"] == 3, rep
        assert rep["v4"] == "ok", f"rank {r}: the save after that failed: {rep}"


def _one_rank_fails_after_the_collectives(rank, world_size, path):
    """Rank 1's save fails after the save's collectives went fine (injected
    after dcpx's coordination returned), so rank 0 sees success.  Both must
    still rebuild at the next save (else they would meet on different
    groups and that save would hang until the timeout)."""
    from dcpx.coordination import dist as _dist

    def pg_now():
        (group,) = _dist._async_groups.values()
        return group.pg

    dcpx.async_save(_state(1), checkpoint_id=path + "/v1").result(timeout=60)
    first = pg_now()
    original = _dist.save

    def failing_save(*a, **k):
        md = original(*a, **k)
        raise RuntimeError("injected after the collectives")

    if rank == 1:
        _dist.save = failing_save
    try:
        v2 = _outcome(dcpx.async_save(_state(2), checkpoint_id=path + "/v2"))
    finally:
        _dist.save = original
    v3 = _outcome(dcpx.async_save(_state(3), checkpoint_id=path + "/v3"))
    return {"v2": v2, "v3": v3, "rebuilt": pg_now() is not first}


def test_ranks_rebuild_together_when_only_one_saw_the_failure(tmp_path):
    outs = spawn_outcomes(_one_rank_fails_after_the_collectives, 2, str(tmp_path / "c"),
                          pg_timeout=SHORT_PG_TIMEOUT, timeout=120)
    for o in outs:
        assert o.ok, o.describe()
    r0, r1 = (o.value for o in outs)
    assert r0["v2"] == "ok" and "injected" in r1["v2"], f"test setup: {r0}, {r1}"
    assert r0["v3"] == "ok" and r1["v3"] == "ok", (r0, r1)
    assert r0["rebuilt"] and r1["rebuilt"], (
        f"only the rank that saw the failure rebuilt the group: {r0}, {r1}")


def _thread_and_process_interleaved(rank, world_size, path):
    """THREAD and PROCESS uploads run on different threads; on one group
    they must still take their turns in call order."""
    futs = []
    for i in range(3):
        for kind in ("thread", "process"):
            v = 10 * i + (kind == "process")
            fut, err = _save(f"{path}/v{v}", v, kind)
            assert err is None, repr(err)
            futs.append((v, fut))
    out = {}
    for v, fut in futs:
        out[v] = _outcome(fut)
    for v in out:
        if out[v] == "ok":
            sd = {"w": torch.zeros(256), "step": None}
            dcpx.load(sd, checkpoint_id=f"{path}/v{v}")
            assert_bit_equal(sd["w"], _state(v)["w"], f"v{v}")
    return out


def test_thread_and_process_uploads_take_turns_on_one_group(tmp_path):
    outs = spawn_outcomes(_thread_and_process_interleaved, 2, str(tmp_path / "c"),
                          timeout=180)
    for o in outs:
        assert o.ok, o.describe()
    for o in outs:
        assert all(v == "ok" for v in o.value.values()), o.value
