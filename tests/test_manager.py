"""dcpx.CheckpointManager (issue 13): step folders, the save interval,
retention (keep_latest_k, keep_every_n_steps, never the newest committed
step, never one being written), resume from the newest committed and intact
step with a warning for what was skipped, deletions a kill interrupts,
random SIGKILLs during saves and deletions, two ranks, preemption, and a
memory:// root.

DCPX_MANAGER_KILL_TRIALS sets the number of random-kill trials (default 120,
~20 s on a loaded 2-core machine)."""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import re
import signal
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import dcpx
from dcpx.manager import DELETING_PREFIX, CheckpointManager, StepSkippedWarning

from dist_helpers import spawn

KILL_TRIALS = int(os.environ.get("DCPX_MANAGER_KILL_TRIALS", "120"))


def _state(step: int) -> dict:
    return {"w": torch.full((64, 64), float(step)), "b": torch.arange(100) + step,
            "step": step, "nested": {"m": torch.full((3,), float(step))}}


def _empty() -> dict:
    return _state(-1)


def _step_of(sd: dict) -> int:
    """The step a loaded state dict was saved at; checks it is consistent."""
    step = sd["step"]
    assert torch.equal(sd["w"], torch.full((64, 64), float(step)))
    assert torch.equal(sd["b"], torch.arange(100) + step)
    assert torch.equal(sd["nested"]["m"], torch.full((3,), float(step)))
    return step


def _data_file(step_dir: Path) -> Path:
    return next(p for p in step_dir.iterdir() if p.name.endswith(".distcp"))


def _flip_byte_in_w(step_dir: Path, fqn: str = "w") -> None:
    """Flip one byte in the middle of the record of ``fqn`` (inside its
    tensor bytes), so the record's CRC-32 no longer matches."""
    md = dcpx.FileSystemReader(step_dir).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    f = step_dir / info.relative_path
    raw = bytearray(f.read_bytes())
    pos = info.offset + info.length // 2
    raw[pos] ^= 0x40
    f.write_bytes(bytes(raw))


# ------------------------------------------------------------------ interval

@pytest.mark.parametrize("mode", ["sync", "async"])
def test_interval_and_layout(tmp_path, mode):
    with CheckpointManager(tmp_path, save_interval_steps=3, async_mode=mode) as m:
        results = {s: m.save(s, _state(s)) for s in range(1, 11)}
        m.wait()
        assert [s for s, r in results.items() if r is not None] == [3, 6, 9]
        if mode == "sync":
            assert isinstance(results[3], dcpx.Metadata)
        else:
            assert results[3].result() is not None
        assert m.save(10, _state(10), force=True) is not None
    assert sorted(os.listdir(tmp_path)) == ["step-10", "step-3", "step-6", "step-9"]
    m = CheckpointManager(tmp_path)
    assert m.all_steps() == [3, 6, 9, 10] and m.latest_step() == 10
    sd = _empty()
    assert m.load(sd) == 10 and _step_of(sd) == 10
    assert m.load(sd, step=6) == 6 and _step_of(sd) == 6


def test_bad_arguments(tmp_path):
    for kw in ({"keep_latest_k": 0}, {"keep_every_n_steps": 0}, {"save_interval_steps": 0},
               {"async_mode": "thread"}, {"verify": "crc"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            CheckpointManager(tmp_path, **kw)


def test_empty_root_loads_nothing(tmp_path):
    m = CheckpointManager(tmp_path / "none")
    assert m.all_steps() == [] and m.latest_step() is None
    assert m.load(_empty()) is None


def test_foreign_names_ignored(tmp_path):
    """torchtitan's step-{N} only: other names (step_100, step-x, step-007) are not steps."""
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        m.save(5, _state(5))
    for name in ("step_100", "step-x", "step-", "step-007", "step--1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(b"junk")
    assert CheckpointManager(tmp_path).all_steps() == [5]


# ----------------------------------------------------------------- retention

@pytest.mark.parametrize("mode", ["sync", "async"])
def test_retention_keep_latest_and_every_n(tmp_path, mode):
    with CheckpointManager(tmp_path, keep_latest_k=2, keep_every_n_steps=10,
                           save_interval_steps=2, async_mode=mode) as m:
        for s in range(1, 27):
            m.save(s, _state(s))
            if s == 14:
                m.wait()
                m.wait_for_retention()
                assert m.all_steps() == [10, 12, 14]
    assert CheckpointManager(tmp_path).all_steps() == [10, 20, 24, 26]
    assert sorted(os.listdir(tmp_path)) == ["step-10", "step-20", "step-24", "step-26"]


def test_retention_keeps_uncommitted_young_and_deletes_stale(tmp_path):
    """A step without .metadata may be written by another process: kept
    while young; an old one below the newest committed step is deleted."""
    with CheckpointManager(tmp_path, keep_latest_k=1, async_mode="sync") as m:
        m.save(1, _state(1))
    for s in (2, 3):  # interrupted saves
        d = tmp_path / f"step-{s}"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x" * 100)
    (tmp_path / "step-9").mkdir()  # newer than any committed step
    with CheckpointManager(tmp_path, keep_latest_k=1, async_mode="sync",
                           incomplete_grace_s=600) as m:
        m.save(4, _state(4))
        m.wait_for_retention()
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-3", "step-4", "step-9"]
    old = time.time() - 3600
    for p in [tmp_path / "step-2", tmp_path / "step-2" / "__0_0.distcp"]:
        os.utime(p, (old, old))
    with CheckpointManager(tmp_path, keep_latest_k=1, async_mode="sync",
                           incomplete_grace_s=600) as m:
        m.save(5, _state(5))
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-5", "step-9"]


def test_retention_never_deletes_step_being_written(tmp_path):
    """A step this process is saving is not deleted even when retention
    would (an older step number saved again)."""
    with CheckpointManager(tmp_path, keep_latest_k=1, async_mode="sync") as m:
        for s in (1, 2, 3):
            m.save(s, _state(s))
        m.wait_for_retention()
        with m._lock:
            m._writing.add(2)
        (tmp_path / "step-2").mkdir()
        (tmp_path / "step-2" / "__0_0.distcp").write_bytes(b"partial")
        assert 2 not in m.steps_to_delete()
        m._writing.discard(2)
    assert CheckpointManager(tmp_path).all_steps() == [3]


def test_retention_keeps_all_without_keep_latest_k(tmp_path):
    with CheckpointManager(tmp_path, async_mode="async") as m:
        for s in range(6):
            m.save(s, _state(s))
    assert CheckpointManager(tmp_path).all_steps() == list(range(6))


def test_retention_spares_all_when_newest_unreadable(tmp_path):
    """The newest committed step's .metadata does not read back: retention
    deletes nothing (it could be deleting the only intact step)."""
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        for s in (1, 2):
            m.save(s, _state(s))
    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-3" / ".metadata").write_bytes(b"not a checkpoint")
    m = CheckpointManager(tmp_path, keep_latest_k=1)
    with pytest.warns(StepSkippedWarning, match="deletes nothing.*step 3"):
        assert m._apply_retention() == []
    assert m.all_steps() == [1, 2, 3]


def test_retention_failure_is_a_warning(tmp_path, monkeypatch):
    """A deletion that fails (here: the rename) warns; saves and loads go on."""
    from dcpx import manager as mgr

    def refuse(self, name):
        raise PermissionError(13, "Permission denied", name)

    monkeypatch.setattr(mgr._LocalRoot, "hide", refuse)
    with pytest.warns(RuntimeWarning, match="retention under .* failed: PermissionError"):
        with CheckpointManager(tmp_path, keep_latest_k=1, async_mode="async") as m:
            for s in (1, 2, 3):
                m.save(s, _state(s))
            sd = _empty()
            assert m.load(sd) == 3 and _step_of(sd) == 3
    assert m.all_steps() == [1, 2, 3]


def test_interrupted_deletion_ignored_and_cleaned(tmp_path):
    """A deletion killed after the rename (or half way through removing the
    files) leaves a .deleting- folder: never a step, removed next pass."""
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        for s in (1, 2, 3):
            m.save(s, _state(s))
        hidden = m._root.hide("step-1")             # killed right after the rename
        assert hidden.startswith(DELETING_PREFIX)
        hidden2 = m._root.hide("step-2")            # killed half way through removing
        _data_file(tmp_path / hidden2).unlink()
        assert m.all_steps() == [3] and m.latest_step() == 3
        sd = _empty()
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # nothing skipped: nothing to warn about
            assert m.load(sd) == 3
    m = CheckpointManager(tmp_path, keep_latest_k=5, async_mode="sync")
    m.save(4, _state(4))
    m.close()
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-4"]


# ------------------------------------------- retention and other processes' saves

# A save in another process, paused (SIGSTOP) right after it took its save
# lock (dcpx/storage/locks.py): from then until its commit or failure it is live.
PAUSED_SAVE_CHILD = r"""
import os, signal, sys
import torch
import dcpx
from dcpx import _locks

claim = _locks.claim_save

def claim_and_pause(directory):
    lk = claim(directory)
    print("locked", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)   # paused mid-save, its lock held
    return lk

_locks.claim_save = claim_and_pause
dcpx.save({"w": torch.full((64, 64), float(sys.argv[2]))}, checkpoint_id=sys.argv[1])
print("saved", flush=True)
"""


def _paused_save(step_dir: Path, value: int):
    """A child process saving into ``step_dir``, stopped with its lock held."""
    import subprocess
    p = subprocess.Popen([sys.executable, "-c", PAUSED_SAVE_CHILD, str(step_dir), str(value)],
                         stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(dcpx.__file__).parents[1])})
    assert p.stdout.readline() == "locked\n"
    return p


def _make_old(d: Path) -> None:
    old = time.time() - 7200
    for p in [d, *d.iterdir()]:
        os.utime(p, (old, old))


def test_retention_never_deletes_live_save_of_another_process(tmp_path):
    """An uncommitted step a live save in another process holds the lock of
    is never deleted, even untouched past the grace period."""
    with CheckpointManager(tmp_path, keep_latest_k=1, async_mode="sync") as m:
        m.save(1, _state(1))
    child = _paused_save(tmp_path / "step-2", 2)
    try:
        _make_old(tmp_path / "step-2")
        with CheckpointManager(tmp_path, keep_latest_k=1, async_mode="sync",
                               incomplete_grace_s=0) as m:
            for s in (3, 4):
                m.save(s, _state(s))
                m.wait_for_retention()
                assert sorted(os.listdir(tmp_path)) == ["step-2", f"step-{s}"]
                assert 2 not in m.steps_to_delete()
    finally:
        child.kill()
        child.wait()
    assert (tmp_path / "step-2").is_dir() and not (tmp_path / "step-2" / ".metadata").exists()


def test_retention_deletes_save_of_killed_process_at_once(tmp_path):
    """A save SIGKILLed mid-way leaves an uncommitted step whose lock
    nobody holds: the next pass deletes it without waiting for the grace
    period (1 h here)."""
    with CheckpointManager(tmp_path, keep_latest_k=1, async_mode="sync") as m:
        m.save(1, _state(1))
    child = _paused_save(tmp_path / "step-2", 2)
    child.kill()
    child.wait()
    assert any(n.startswith(".dcpx.") for n in os.listdir(tmp_path / "step-2"))  # its dead lock
    with CheckpointManager(tmp_path, keep_latest_k=1, async_mode="sync") as m:
        assert m.steps_to_delete() == []  # newer than the newest committed step
        m.save(3, _state(3))
        m.wait_for_retention()
        assert sorted(os.listdir(tmp_path)) == ["step-3"]


def test_retention_never_deletes_committed_step_being_saved_again(tmp_path):
    """A committed step beyond keep_latest_k that a live save in another
    process is writing into again is kept; once that save has committed,
    the step loads as that save and the next pass deletes it."""
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        for s in (1, 2):
            m.save(s, _state(s))
    child = _paused_save(tmp_path / "step-1", 77)
    try:
        with CheckpointManager(tmp_path, keep_latest_k=1, async_mode="sync") as m:
            m.save(3, _state(3))
            m.wait_for_retention()
            assert m.all_steps() == [1, 3]
            child.send_signal(signal.SIGCONT)
            assert child.stdout.readline() == "saved\n"
            assert child.wait() == 0
            sd = {"w": torch.zeros(64, 64)}
            dcpx.load(sd, checkpoint_id=str(tmp_path / "step-1"))
            assert torch.equal(sd["w"], torch.full((64, 64), 77.0))
            assert m.steps_to_delete() == [1]
            m.save(4, _state(4))
    finally:
        child.kill()
        child.wait()
    assert CheckpointManager(tmp_path).all_steps() == [4]


def test_retention_gives_folder_back_to_save_that_locked_it_meanwhile(tmp_path, monkeypatch):
    """A save that takes its lock between the pass's check and its rename:
    the pass sees the lock held in the renamed folder and renames it back."""
    from dcpx.storage import locks as _locks
    from dcpx import manager as mgr

    with CheckpointManager(tmp_path, async_mode="sync") as m:
        for s in (1, 2):
            m.save(s, _state(s))
    real_hide = mgr._LocalRoot.hide
    held = []

    def lock_then_hide(self, name):
        held.append(_locks.claim_save(self.path / name))  # a save starts right now
        return real_hide(self, name)

    monkeypatch.setattr(mgr._LocalRoot, "hide", lock_then_hide)
    m = CheckpointManager(tmp_path, keep_latest_k=1)
    assert m._apply_retention() == []
    assert [lk.path.parent.name for lk in held] == ["step-1"]
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-2"]
    assert (tmp_path / "step-1" / held[0].path.name).exists()
    held[0].release()                                      # that save ended
    monkeypatch.setattr(mgr._LocalRoot, "hide", real_hide)
    assert m._apply_retention() == [1]
    assert sorted(os.listdir(tmp_path)) == ["step-2"]


def test_retention_without_flock_falls_back_to_grace_period(tmp_path, monkeypatch):
    """Where flock fails (ENOLCK: a file system without locks) a save lock
    file cannot be checked: a step holding one is deleted only once
    untouched for incomplete_grace_s, committed or not; a lock nobody holds
    on a file system with flock is dead at once."""
    import errno as errno_
    import fcntl
    from dcpx.storage import locks as _locks

    with CheckpointManager(tmp_path, async_mode="sync") as m:
        for s in (1, 3):
            m.save(s, _state(s))
    for name in ("step-1", "step-2"):  # a killed save's lock left behind
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        (d / f".dcpx.{uuid.uuid4().hex[:16]}.lock").write_bytes(b"")
    (tmp_path / "step-2" / f"__0_{'0' * 16}_0.distcp").write_bytes(b"x" * 100)
    real_flock = fcntl.flock

    def no_locks(fd, op):
        raise OSError(errno_.ENOLCK, "No locks available")

    monkeypatch.setattr(_locks.fcntl, "flock", no_locks)
    m = CheckpointManager(tmp_path, keep_latest_k=1, async_mode="sync", incomplete_grace_s=600)
    assert m.steps_to_delete() == []
    _make_old(tmp_path / "step-2")
    assert m.steps_to_delete() == [2]
    _make_old(tmp_path / "step-1")
    assert m.steps_to_delete() == [1, 2]
    monkeypatch.setattr(_locks.fcntl, "flock", real_flock)
    for name in ("step-1", "step-2"):
        os.utime(tmp_path / name)
        for p in (tmp_path / name).iterdir():
            os.utime(p)
    assert m.steps_to_delete() == [1, 2]  # flock works: both locks are dead
    assert m._apply_retention() == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["step-3"]


# ---------------------------------------------------------------- resume

def test_half_written_step_skipped_with_warning(tmp_path):
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        m.save(10, _state(10))
        m.save(20, _state(20))
    d = tmp_path / "step-30"  # killed before its commit: data, no .metadata
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(_data_file(tmp_path / "step-20").read_bytes()[:1000])
    m = CheckpointManager(tmp_path)
    assert m.latest_step() == 20 and m.all_steps() == [10, 20]
    sd = _empty()
    with pytest.warns(StepSkippedWarning, match=r"step-30: not committed"):
        assert m.load(sd) == 20
    assert _step_of(sd) == 20


@pytest.mark.parametrize("verify", ["commit", "full"])
def test_fallback_past_corrupt_newest(tmp_path, verify):
    """A flipped byte in the newest step's tensor data: the default check
    (the load's own CRC-32 check of every record it reads) and the full
    check (every record, before the state dict is touched) both fall back
    to the older step, with a warning naming the step and the reason."""
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        for s in (1, 2, 3):
            m.save(s, _state(s))
    _flip_byte_in_w(tmp_path / "step-3")
    m = CheckpointManager(tmp_path, verify=verify)
    sd = _empty()
    reason = "the full check found 1 problem" if verify == "full" else "its load failed"
    with pytest.warns(StepSkippedWarning, match=rf"step-3: {reason}.*(CRC|checksum).*older step"):
        assert m.load(sd) == 2
    assert _step_of(sd) == 2
    with pytest.raises(dcpx.CheckpointError, match=r"step-3: .*(CRC|checksum)"):
        m.load(_empty(), step=3)  # an explicit step: no fallback


def test_full_check_catches_what_load_does_not_read(tmp_path):
    """A corrupt record of a key the state dict does not ask for: the
    default check loads the step (the load never reads that record), the
    full check falls back."""
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        m.save(1, _state(1))
        m.save(2, _state(2))
    _flip_byte_in_w(tmp_path / "step-2")
    sd = _empty()
    del sd["w"]
    # the state dict asks for a subset of the checkpoint's keys, as DCP allows
    assert CheckpointManager(tmp_path).load(sd) == 2 and sd["step"] == 2
    sd = _empty()
    del sd["w"]
    with pytest.warns(StepSkippedWarning, match="step-2: the full check"):
        assert CheckpointManager(tmp_path, verify="full").load(sd) == 1


def test_no_step_loads_clear_error(tmp_path):
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        for s in (1, 2):
            m.save(s, _state(s))
    _flip_byte_in_w(tmp_path / "step-1")
    _data_file(tmp_path / "step-2").unlink()
    with pytest.warns(StepSkippedWarning):
        with pytest.raises(dcpx.CheckpointError, match=r"no step under .* loads: step-2: .*; step-1: "):
            CheckpointManager(tmp_path).load(_empty())


def test_state_dict_errors_not_taken_for_corruption(tmp_path):
    """A key the checkpoint lacks is the caller's error: raised at once, no
    fallback to older steps."""
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        m.save(1, _state(1))
        m.save(2, _state(2))
    sd = _empty()
    sd["extra"] = torch.zeros(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepSkippedWarning)
        with pytest.raises(Exception, match="extra"):
            CheckpointManager(tmp_path).load(sd)


def test_torchtitan_layout_written_by_torch_loads(tmp_path):
    """A run whose step folders torch DCP wrote (torchtitan's layout)."""
    import torch.distributed.checkpoint as tdcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in (100, 200):
            tdcp.save(_state(s), checkpoint_id=str(tmp_path / f"step-{s}"))
    m = CheckpointManager(tmp_path)
    sd = _empty()
    assert m.all_steps() == [100, 200] and m.load(sd) == 200 and _step_of(sd) == 200


# ------------------------------------------------------------- memory:// root

def test_memory_url_root():
    fsspec = pytest.importorskip("fsspec")
    root = f"memory://dcpx-manager-{uuid.uuid4().hex}"
    try:
        with CheckpointManager(root, keep_latest_k=2, save_interval_steps=2) as m:
            for s in range(1, 9):
                m.save(s, _state(s))
        m = CheckpointManager(root)
        assert m.all_steps() == [6, 8]
        sd = _empty()
        assert m.load(sd) == 8 and _step_of(sd) == 8
        # A deletion killed after removing .metadata: the step is gone for the manager.
        m._root.hide("step-8")
        sd = _empty()
        assert m.all_steps() == [6]
        with pytest.warns(StepSkippedWarning, match="step-8: not committed"):
            assert m.load(sd) == 6
        with pytest.raises(ValueError, match="verify='full'.*memory://"):
            CheckpointManager(root, verify="full")
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(root.split("://", 1)[1]):
            fs.rm(root.split("://", 1)[1], recursive=True)


def test_process_mode(tmp_path):
    with CheckpointManager(tmp_path, keep_latest_k=1, async_mode="process") as m:
        for s in (1, 2, 3):
            m.save(s, _state(s))
    m = CheckpointManager(tmp_path)
    sd = _empty()
    assert m.all_steps() == [3] and m.load(sd) == 3 and _step_of(sd) == 3


# ------------------------------------------------------------ random kills

def _kill_child(root: str) -> None:
    """Resume, then save every step (keep 1: a deletion after every commit)
    until SIGKILLed."""
    try:
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        m = CheckpointManager(root, keep_latest_k=1, async_mode="async")
        sd = _empty()
        step = m.load(sd)
        step = _step_of(sd) if step is not None else 0
        while True:
            step += 1
            m.save(step, _state(step))
    finally:
        os._exit(3)  # only reached by an error: the parent sees exit status 3


def test_random_kills_never_leave_zero_loadable_steps(tmp_path):
    """SIGKILL a process that saves every step with keep_latest_k=1 at a
    random moment, many times: every step listed as committed passes the
    full check (a killed save or deletion never leaves a step that looks
    complete and is not), and once a step committed, some step always loads,
    with the values of its step."""
    ctx = mp.get_context("fork")
    rng = random.Random(int(os.environ.get("DCPX_MANAGER_KILL_SEED", "13")))
    committed_once = False
    seen = {"uncommitted step": 0, "deletion under way": 0, "clean": 0}
    last = 0
    for trial in range(KILL_TRIALS):
        p = ctx.Process(target=_kill_child, args=(str(tmp_path),))
        p.start()
        time.sleep(rng.uniform(0.0, 0.25) if committed_once else rng.uniform(0.2, 0.6))
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL, f"trial {trial}: child exited with {p.exitcode}"
        names = os.listdir(tmp_path)
        if any(n.startswith(DELETING_PREFIX) for n in names):
            seen["deletion under way"] += 1
        elif any(not (tmp_path / n / ".metadata").exists() for n in names):
            seen["uncommitted step"] += 1
        else:
            seen["clean"] += 1
        m = CheckpointManager(tmp_path, verify="full")
        for s in m.all_steps():  # a step that looks complete is complete (committed => intact)
            assert m._check(s) is None, f"trial {trial}: step-{s}: {m._check(s)}"
        sd = _empty()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StepSkippedWarning)
            step = m.load(sd)
        if committed_once:
            assert step is not None, f"trial {trial}: no loadable step left: {sorted(names)}"
        if step is not None:
            committed_once = True
            assert _step_of(sd) == step >= last, f"trial {trial}: went back from {last} to {step}"
            last = step
    print(f"\n{KILL_TRIALS} kills, newest step {last}; state at the kill: {seen}")
    assert committed_once


# ---------------------------------------------------------------- two ranks

def _two_ranks(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    from dcpx import manager as mgr

    hidden = []
    orig = mgr._LocalRoot.hide
    mgr._LocalRoot.hide = lambda self, name: hidden.append(name) or orig(self, name)
    warnings.simplefilter("ignore")
    with CheckpointManager(root, keep_latest_k=2, async_mode="async") as m:
        for s in range(1, 6):
            st = _state(s)
            st["w"] = st["w"][rank * 32:(rank + 1) * 32].clone()  # each rank its own values
            st = {f"r{rank}": st, "step": s}
            m.save(s, st)
    dist.barrier()
    steps = CheckpointManager(root).all_steps()
    if rank == 0:
        _flip_byte_in_w(Path(root) / "step-5", "r0.w")
    dist.barrier()
    sd = {f"r{rank}": _empty(), "step": -1}
    sd[f"r{rank}"]["w"] = torch.zeros(32, 64)
    caught = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        loaded = CheckpointManager(root).load(sd)
        caught = [str(x.message) for x in w if issubclass(x.category, StepSkippedWarning)]
    return {"hidden": hidden, "steps": steps, "loaded": loaded, "step": sd["step"],
            "w": float(sd[f"r{rank}"]["w"][0, 0]), "warnings": caught}


@pytest.mark.dist
def test_two_ranks_one_deleter_same_step(tmp_path):
    r0, r1 = spawn(_two_ranks, 2, str(tmp_path))
    assert r0["steps"] == r1["steps"] == [4, 5]
    assert sorted(r0["hidden"]) == ["step-1", "step-2", "step-3"] and r1["hidden"] == []
    # step 5's data is corrupt (the file rank 0 wrote): both ranks fall back to 4
    assert r0["loaded"] == r1["loaded"] == 4 and r0["step"] == r1["step"] == 4
    assert r0["w"] == r1["w"] == 4.0
    assert any("step-5" in w for w in r0["warnings"]) and any("step-5" in w for w in r1["warnings"])


# --------------------------------------------------------------- preemption

PREEMPT_CHILD = r"""
import os, sys, time, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[3])
import torch
from test_manager import _state
from dcpx import CheckpointManager
root, mode = sys.argv[1], sys.argv[2]
m = CheckpointManager(root, save_interval_steps=5, keep_latest_k=2, preemption=True,
                      preemption_deadline_s=3.0)
step = 0
while True:
    step += 1
    time.sleep(0.02)            # a training step
    if mode == "stuck" and m.preemption_signal is not None:
        time.sleep(60)          # a loop that never gets to its save: the deadline ends it
    m.save(step, _state(step))
    if step == 7:
        print("ready", flush=True)
    if m.preempted:
        m.close()
        print(f"final {step}", flush=True)
        sys.exit(0)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_final_checkpoint(tmp_path, sig):
    import subprocess
    p = subprocess.Popen([sys.executable, "-c", PREEMPT_CHILD, str(tmp_path), "ok",
                          str(Path(__file__).parent)],
                         stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(dcpx.__file__).parents[1])})
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.13)  # a few steps on, most likely off the interval
    p.send_signal(sig)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    final = int(re.search(r"final (\d+)", out).group(1))
    m = CheckpointManager(tmp_path)
    sd = _empty()
    assert m.latest_step() == final and m.load(sd) == final and _step_of(sd) == final
    assert len(m.all_steps()) <= 2


def test_preemption_deadline(tmp_path):
    import subprocess
    p = subprocess.Popen([sys.executable, "-c", PREEMPT_CHILD, str(tmp_path), "stuck",
                          str(Path(__file__).parent)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(dcpx.__file__).parents[1])})
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, (out, err)
    assert "did not commit within 3 s of signal SIGTERM" in err
    assert CheckpointManager(tmp_path).latest_step() == 5


def test_handler_only_sets_flag(tmp_path):
    """The handler records the signal and does nothing else; the next save()
    writes the final step; close() restores the previous handler."""
    before = signal.getsignal(signal.SIGUSR1)
    m = CheckpointManager(tmp_path, preemption=True, async_mode="sync")
    assert not m.preempted
    os.kill(os.getpid(), signal.SIGUSR1)
    assert m.preemption_signal == signal.SIGUSR1
    assert m.all_steps() == []  # nothing saved by the handler itself
    # preempted is as of the last save(): a signal after the loop's save() and
    # before its check is seen at the next save(), which writes the final step
    assert not m.preempted
    assert m.save(3, _state(3)) is not None and m.preempted
    m.close()
    assert signal.getsignal(signal.SIGUSR1) is before
    assert CheckpointManager(tmp_path).all_steps() == [3]


# ------------------------------------------------------------ docs recipe

def _recipe_code() -> str:
    text = (Path(__file__).resolve().parents[1] / "docs" / "manager.md").read_text()
    block = text.split("<!-- recipe: fsdp2 -->", 1)[1]
    return block.split("```python\n", 1)[1].split("```", 1)[0]


def _run_recipe(rank: int, world: int, workdir: str, code: str) -> dict:
    import torch.distributed as dist
    from dtensor_api import DTensor

    warnings.simplefilter("ignore")
    ns: dict = {}
    exec(compile(code, "docs/manager.md (recipe)", "exec"), ns)

    def weights(model):
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in model.state_dict().items()}

    model, start_a = ns["train"](os.path.join(workdir, "a"), 10)
    ref = weights(model)
    _, start_b = ns["train"](os.path.join(workdir, "b"), 10, stop_after=6)  # the job ends after step 6
    dist.barrier()
    after_stop = CheckpointManager(os.path.join(workdir, "b")).all_steps()
    model, start_c = ns["train"](os.path.join(workdir, "b"), 10)
    resumed = weights(model)
    dist.barrier()
    same = all(torch.equal(ref[k].view(torch.uint8), resumed[k].view(torch.uint8)) for k in ref)
    return {"same": same, "starts": [start_a, start_b, start_c], "after_stop": after_stop,
            "final": CheckpointManager(os.path.join(workdir, "b")).all_steps()}


@pytest.mark.dist
def test_fsdp2_recipe_from_docs(tmp_path):
    for r in spawn(_run_recipe, 2, str(tmp_path), _recipe_code()):
        assert r == {"same": True, "starts": [0, 0, 6], "after_stop": [4, 6], "final": [8, 10]}


def _two_ranks_preempted(rank: int, world: int, root: str) -> dict:
    """Only rank 1 gets the signal (after its step 3): both ranks agree on
    it at the next save(), write the same final step and stop together."""
    warnings.simplefilter("ignore")
    with CheckpointManager(root, save_interval_steps=5, preemption=True,
                           preemption_signals=(signal.SIGUSR1,)) as m:
        for step in range(1, 100):
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
            m.save(step, {f"r{rank}": _state(step)})
            if m.preempted:
                break
    return {"stopped": step, "steps": CheckpointManager(root).all_steps(),
            "signal": m.preemption_signal}


@pytest.mark.dist
def test_two_ranks_preemption_agreed(tmp_path):
    r0, r1 = spawn(_two_ranks_preempted, 2, str(tmp_path))
    assert r0 == r1 == {"stopped": 3, "steps": [3], "signal": signal.SIGUSR1}
