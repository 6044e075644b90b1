"""async_save without a stager, called again and again (issue 10, item 12):
torchtitan's async mode calls ``dcp.async_save(sd, checkpoint_id=...)`` every
N steps.  dcpx keeps the staging buffers of such calls (staging._StagerPool)
instead of allocating and pre-faulting one per call: reused while the layout
stays, a second one while the previous upload still reads the first, at most
two per kind, released on a layout change, by release_staging_buffers() and
at exit.  Every checkpoint holds the values of its own call.
"""
import os
import sys
import threading

import pytest
import torch

import dcpx
from dcpx.staging import _pool
from test_async import (
    KINDS,
    PROCESS,
    THREAD,
    TIMEOUT,
    _assert_checkpoint_holds,
    _snapshot,
    _uploads_held,
)


def _kind_key(kind):
    return "process" if kind == PROCESS else "thread"


def _stats(kind):
    return _pool.stats()[_kind_key(kind)]


def _state(value, n=4096):
    return {"w": torch.full((n,), float(value)), "b": torch.full((7,), float(value)),
            "step": int(value), "nested": {"m": torch.full((3, 5), float(value))}}


def _fill(sd, value):
    sd["w"].fill_(value)
    sd["b"].fill_(value)
    sd["nested"]["m"].fill_(value)
    sd["step"] = int(value)


@pytest.fixture(autouse=True)
def _fresh_pool():
    dcpx.release_staging_buffers()
    yield
    dcpx.release_staging_buffers()


@pytest.mark.parametrize("kind", KINDS)
def test_buffer_is_reused_across_calls(tmp_path, kind):
    sd = _state(0)
    for i in range(6):
        _fill(sd, i)
        want = _snapshot(sd)
        r = dcpx.async_save(sd, checkpoint_id=tmp_path / f"c{i}", async_checkpointer_type=kind)
        _fill(sd, -1)  # after the call returns: not the checkpoint's
        r.result(timeout=TIMEOUT)
        _assert_checkpoint_holds(tmp_path / f"c{i}", sd, want)
    st = _stats(kind)
    assert st["alloc_count"] == 1, st  # one allocation for six calls
    assert st["buffers"] == 1 and st["stagers"] == 1, st


@pytest.mark.parametrize("kind", KINDS)
def test_second_call_during_first_upload_uses_a_second_buffer(tmp_path, monkeypatch, kind):
    """The first upload still reads buffer 1 when the second call comes: the
    second stages into buffer 2 without waiting, and mutations after each
    return reach neither checkpoint."""
    sd = _state(1)
    with _uploads_held(monkeypatch, kind) as (gate, finished):
        want1 = _snapshot(sd)
        r1 = dcpx.async_save(sd, checkpoint_id=tmp_path / "c1", async_checkpointer_type=kind)
        _fill(sd, 2)
        want2 = _snapshot(sd)
        r2 = dcpx.async_save(sd, checkpoint_id=tmp_path / "c2", async_checkpointer_type=kind)
        _fill(sd, -7)
        assert finished == []
        assert _stats(kind)["buffers"] == 2
        gate.set()
        r1.result(timeout=TIMEOUT)
        r2.result(timeout=TIMEOUT)
    _assert_checkpoint_holds(tmp_path / "c1", sd, want1)
    _assert_checkpoint_holds(tmp_path / "c2", sd, want2)
    # Both uploads done: later calls reuse the two buffers, allocate nothing.
    for i in range(3, 6):
        _fill(sd, i)
        want = _snapshot(sd)
        dcpx.async_save(sd, checkpoint_id=tmp_path / f"c{i}",
                        async_checkpointer_type=kind).result(timeout=TIMEOUT)
        _assert_checkpoint_holds(tmp_path / f"c{i}", sd, want)
    st = _stats(kind)
    assert st["alloc_count"] == 2 and st["buffers"] == 2, st


@pytest.mark.parametrize("kind", KINDS)
def test_third_call_with_two_uploads_in_flight_waits_for_the_oldest(tmp_path, kind):
    """At most two buffers: with both leased, the next call waits for the
    older upload (uploads run in call order) and reuses its buffer."""
    sd = _state(0, n=1 << 16)
    results, wants = [], []
    for i in range(8):  # back to back, never waiting
        _fill(sd, i)
        wants.append(_snapshot(sd))
        results.append(dcpx.async_save(sd, checkpoint_id=tmp_path / f"c{i}",
                                       async_checkpointer_type=kind))
        _fill(sd, -3)
        assert _stats(kind)["buffers"] <= 2
    for i, r in enumerate(results):
        r.result(timeout=TIMEOUT)
        _assert_checkpoint_holds(tmp_path / f"c{i}", sd, wants[i])
    assert _stats(kind)["alloc_count"] <= 2


@pytest.mark.parametrize("kind", KINDS)
def test_layout_change_releases_the_old_buffers(tmp_path, monkeypatch, kind):
    small, large = _state(1), _state(2, n=1 << 15)
    with _uploads_held(monkeypatch, kind) as (gate, _):
        r1 = dcpx.async_save(small, checkpoint_id=tmp_path / "a1", async_checkpointer_type=kind)
        r2 = dcpx.async_save(small, checkpoint_id=tmp_path / "a2", async_checkpointer_type=kind)
        gate.set()
        r1.result(timeout=TIMEOUT)
        r2.result(timeout=TIMEOUT)
    assert _stats(kind)["buffers"] == 2
    want = _snapshot(large)
    dcpx.async_save(large, checkpoint_id=tmp_path / "b",
                    async_checkpointer_type=kind).result(timeout=TIMEOUT)
    _assert_checkpoint_holds(tmp_path / "b", large, want)
    st = _stats(kind)
    # Only the new layout's buffer is left: the other stager was released.
    assert st["buffers"] == 1 and st["stagers"] == 1, st
    assert st["bytes"] >= (1 << 15) * 4 and st["bytes"] < (1 << 15) * 4 + 4096, st


@pytest.mark.parametrize("kind", KINDS)
def test_release_staging_buffers_frees_them_and_later_calls_allocate_again(tmp_path, kind):
    sd = _state(3)
    dcpx.async_save(sd, checkpoint_id=tmp_path / "c1",
                    async_checkpointer_type=kind).result(timeout=TIMEOUT)
    stager = _pool._stagers[kind == PROCESS][0]
    buffer = stager._layout.buffer
    assert _stats(kind)["bytes"] > 0
    dcpx.release_staging_buffers()
    assert _stats(kind) == {"stagers": 0, "buffers": 0, "bytes": 0, "alloc_count": 0}
    assert stager._closed and buffer.mm is None and buffer.fd == -1
    _fill(sd, 4)
    want = _snapshot(sd)
    dcpx.async_save(sd, checkpoint_id=tmp_path / "c2",
                    async_checkpointer_type=kind).result(timeout=TIMEOUT)
    _assert_checkpoint_holds(tmp_path / "c2", sd, want)
    assert _stats(kind)["alloc_count"] == 1


def test_release_waits_for_the_upload_reading_a_buffer(tmp_path, monkeypatch):
    sd = _state(5)
    want = _snapshot(sd)
    with _uploads_held(monkeypatch, THREAD) as (gate, finished):
        r = dcpx.async_save(sd, checkpoint_id=tmp_path / "c")
        done = threading.Event()
        t = threading.Thread(target=lambda: (dcpx.release_staging_buffers(), done.set()))
        t.start()
        assert not done.wait(0.2)  # still blocked: the upload reads the buffer
        gate.set()
        t.join(TIMEOUT)
        assert done.is_set() and r.done() and finished == ["c"]
    r.result(timeout=TIMEOUT)
    _assert_checkpoint_holds(tmp_path / "c", sd, want)


def test_a_failed_staging_leaves_the_pool_usable(tmp_path):
    bad = {"w": torch.zeros(4, dtype=torch.float32).to_sparse()}
    with pytest.raises(Exception):
        dcpx.async_save(bad, checkpoint_id=tmp_path / "bad")
    sd = _state(6)
    want = _snapshot(sd)
    dcpx.async_save(sd, checkpoint_id=tmp_path / "c").result(timeout=TIMEOUT)
    _assert_checkpoint_holds(tmp_path / "c", sd, want)
    assert _stats(THREAD)["stagers"] == 1


def test_calls_from_several_threads_at_once_each_hold_their_own_values(tmp_path):
    """Threads calling async_save without a stager at the same moment never
    stage into one buffer; the pool stays bounded."""
    errors, per_thread, rounds = [], 4, 5
    barrier = threading.Barrier(per_thread)

    def run(t):
        try:
            sd = _state(0, n=1 << 14)
            for i in range(rounds):
                v = 100 * t + i
                _fill(sd, v)
                want = _snapshot(sd)
                barrier.wait(TIMEOUT)
                path = tmp_path / f"t{t}-{i}"
                r = dcpx.async_save(sd, checkpoint_id=path)
                _fill(sd, -1)
                r.result(timeout=TIMEOUT)
                _assert_checkpoint_holds(path, sd, want)
                assert _stats(THREAD)["stagers"] <= _pool.MAX
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(t,)) for t in range(per_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT)
    assert not errors, errors


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_allocates_its_own_buffer(tmp_path):
    sd = _state(7)
    dcpx.async_save(sd, checkpoint_id=tmp_path / "parent1").result(timeout=TIMEOUT)
    parent_buffer = _pool._stagers[False][0]._layout.buffer
    pid = os.fork()
    if pid == 0:  # child: a save of its own, with the pooled stagers reset
        code = 1
        try:
            torch.set_num_threads(1)
            _fill(sd, 8)
            want = _snapshot(sd)
            dcpx.async_save(sd, checkpoint_id=tmp_path / "child").result(timeout=TIMEOUT)
            _assert_checkpoint_holds(tmp_path / "child", sd, want)
            stager = _pool._stagers[False][0]
            code = 0 if stager._layout.buffer is not parent_buffer else 2
        except BaseException as e:  # noqa: BLE001 - the exit status reports it
            print(f"child: {type(e).__name__}: {e}", file=sys.stderr)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    _fill(sd, 9)
    want = _snapshot(sd)
    dcpx.async_save(sd, checkpoint_id=tmp_path / "parent2").result(timeout=TIMEOUT)
    _assert_checkpoint_holds(tmp_path / "parent2", sd, want)
    assert _pool._stagers[False][0]._layout.buffer is parent_buffer
