"""The process that tests/test_fork.py runs: it uses dcpx, forks, and checks
both sides.  One scenario per run:

    python tests/fork_child.py SCENARIO DIR

SCENARIO is when the fork happens:

* ``idle``: after a sync save, a THREAD async_save with a long-lived
  background-staging stager, loads and a multi-threaded staging copy, all
  finished;
* ``staging``: while that stager's dcpx-stage thread is staging (it holds
  the stager's lock, with the collector paused), held there by a value
  whose ``__deepcopy__`` waits;
* ``plan``: while a THREAD upload is planning, before its C writer threads
  start: the upload has not read the shared staging buffer yet, so a child
  that staged into the same pages would change the parent's checkpoint;
* ``write``: while a THREAD upload encodes its metadata, its C writer
  threads started (a 48 MiB tensor, fsync'd: usually still writing);
* ``process``: after PROCESS saves, with the checkpoint process alive.

The child then does everything a training process would (``child_work``):
load the parent's checkpoint, save, async_save with the inherited stager
and with a per-call one, load each back bit for bit, PROCESS in the
``process`` scenario, and exits through the normal interpreter exit
(atexit, executor joins).  The parent bounds the wait for the child (a hang
is a failure), then finishes its in-flight save, loads it bit for bit, and
saves again with the same stager (and, for ``process``, the same checkpoint
process).  Prints ``fork: ok`` and exits 0 when everything held; otherwise
the first failure, on either side, decides the exit status.
"""
from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback

import torch

import dcpx
import dcpx.api.process
from dcpx import _C

CHILD_TIMEOUT = 90  # s: the whole child, under a loaded CI machine
WAIT = 60           # s: any one future


def state(seed: int, big_mib: int = 4) -> dict:
    """A training state; the same structure for every seed (so a stager
    would reuse its buffer), different bytes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"embed": torch.randn(big_mib << 18, generator=g),
                  "w": torch.randn(64, 48, generator=g).t(),   # gathered
                  "ids": torch.randint(0, 2**62, (33,), generator=g)},
        "optim": {"state": {0: {"exp_avg": torch.randn(64, 48, generator=g)}},
                  "lr": 0.1 * seed},
        "step": seed,
    }


def snapshot(v):
    if isinstance(v, dict):
        return {k: snapshot(x) for k, x in v.items()}
    return v.clone() if isinstance(v, torch.Tensor) else v


def blank(v):
    if isinstance(v, dict):
        return {k: blank(x) for k, x in v.items()}
    return torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else None


def mutate(sd: dict) -> None:
    """Training goes on: every tensor and value changes."""
    sd["model"]["embed"].add_(1)
    sd["model"]["w"].mul_(-2)
    sd["model"]["ids"].add_(7)
    sd["optim"]["state"][0]["exp_avg"].sub_(3)
    sd["optim"]["lr"] += 1
    sd["step"] += 1000


def same(got, want, where: str) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {set(got)} != {set(want)}"
        for k in want:
            same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got.contiguous().view(torch.uint8),
                           want.contiguous().view(torch.uint8)), f"{where}: bytes differ"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def check(path, want, where: str) -> None:
    out = blank(want)
    dcpx.load(out, checkpoint_id=path)
    same(out, want, where)


def writer(path, **kw):
    kw.setdefault("sync_files", False)
    return dcpx.FileSystemWriter(path, **kw)


def upload_of(response):
    if isinstance(response, dcpx.AsyncSaveResponse):
        response.staging_completion.result(timeout=WAIT)
        return response.upload_completion
    return response


class Gate:
    """A point the parent's dcpx thread reaches and waits at until opened."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()

    def hold(self) -> None:
        self.reached.set()
        if not self.opened.wait(WAIT):
            raise TimeoutError("gate never opened")


class SlowCopy:
    """A plain value whose deepcopy (done by the stager, on the dcpx-stage
    thread, holding the stager's lock) waits at a gate; it stages as 7."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def __deepcopy__(self, memo):
        self.gate.hold()
        return 7


class GatedWriter(dcpx.FileSystemWriter):
    """dcpx's writer, stopping at `where` on the upload thread:
    "plan" (write_entries / write_payloads: before the C writer threads start) or
    "write" (encode_metadata: they have started)."""

    def __init__(self, path, where: str, gate: Gate, **kw) -> None:
        super().__init__(path, **kw)
        self.where, self.gate = where, gate

    def write_entries(self, *a, **kw):
        if self.where == "plan":
            self.gate.hold()
        return super().write_entries(*a, **kw)

    def write_payloads(self, *a, **kw):  # the single-process path's write_entries
        if self.where == "plan":
            self.gate.hold()
        return super().write_payloads(*a, **kw)

    def encode_metadata(self, *a, **kw):
        if self.where == "write":
            self.gate.hold()
        return super().encode_metadata(*a, **kw)


# ----------------------------------------------------------------- child

def child_work(root: str, inherited: dcpx.DefaultStager, parent_ckpt: str,
               parent_want: dict, process: bool) -> None:
    # torch's OpenMP pool is not fork-safe: its CPU ops hang in a child forked
    # after the parent ran parallel ones, dcpx or not.  torch's DataLoader
    # workers do the same first thing.
    torch.set_num_threads(1)
    assert gc.isenabled(), "the collector is off in the child (a parent thread had paused it)"
    check(parent_ckpt, parent_want, "child: parent's checkpoint")
    sd = state(101)
    dcpx.save(sd, storage_writer=writer(f"{root}/child_sync", thread_count=2))
    check(f"{root}/child_sync", snapshot(sd), "child: save")
    for i, stager in enumerate([inherited, None]):
        sd = state(102 + i)  # the parent's structure: a reused buffer would be shared
        want = snapshot(sd)
        path = f"{root}/child_async{i}"
        upload = upload_of(dcpx.async_save(sd, storage_writer=writer(path), async_stager=stager))
        mutate(sd)
        upload.result(timeout=WAIT)
        check(path, want, f"child: async_save ({'inherited' if stager else 'per-call'} stager)")
    if process:
        sd = state(104)
        dcpx.async_save(sd, storage_writer=writer(f"{root}/child_process"),
                        async_checkpointer_type=dcpx.AsyncCheckpointerType.PROCESS
                        ).result(timeout=WAIT)
        check(f"{root}/child_process", snapshot(sd), "child: PROCESS async_save")
    src = [torch.randn(1 << 16) for _ in range(4)]
    dst = [torch.empty(1 << 16) for _ in range(4)]
    _C.copy_into(list(zip(src, dst)), threads=2)
    assert all(torch.equal(s, d) for s, d in zip(src, dst)), "child: copy_into"
    inherited.close()


def fork_and_check(root, inherited, parent_ckpt, parent_want, process=False) -> float:
    """Fork; the child runs child_work and exits normally (its status says
    how it went); the parent waits at most CHILD_TIMEOUT."""
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            child_work(root, inherited, parent_ckpt, parent_want, process)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            status = 3
        sys.exit(status)  # the normal exit: atexit handlers, thread joins
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > CHILD_TIMEOUT:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError(f"the forked child hung (killed after {CHILD_TIMEOUT} s)")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0, \
        f"the forked child failed (exit {os.waitstatus_to_exitcode(status)}; its stderr is above)"
    return time.monotonic() - t0


# ---------------------------------------------------------------- parent

def run(scenario: str, root: str) -> None:
    sd = state(1)
    dcpx.save(sd, storage_writer=writer(f"{root}/sync", thread_count=2))
    stager = dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True))
    upload_of(dcpx.async_save(sd, storage_writer=writer(f"{root}/warm"),
                              async_stager=stager)).result(timeout=WAIT)
    check(f"{root}/warm", snapshot(sd), "parent: warm-up")
    base = snapshot(sd)

    if scenario == "process":
        kind = dcpx.AsyncCheckpointerType.PROCESS
        upload_of(dcpx.async_save(sd, storage_writer=writer(f"{root}/p0"),
                                  async_checkpointer_type=kind, async_stager=stager)
                  ).result(timeout=WAIT)
        worker = dcpx.api.process._worker.proc.pid
        fork_and_check(root, stager, f"{root}/p0", base, process=True)
        mutate(sd)
        want = snapshot(sd)
        upload_of(dcpx.async_save(sd, storage_writer=writer(f"{root}/p1"),
                                  async_checkpointer_type=kind, async_stager=stager)
                  ).result(timeout=WAIT)
        check(f"{root}/p1", want, "parent: PROCESS save after the fork")
        assert dcpx.api.process._worker.proc.pid == worker, \
            "the parent's checkpoint process was replaced: the child's exit stopped it"
        stager.close()
        return

    if scenario == "idle":
        _C.copy_into([(torch.randn(1 << 20), torch.empty(1 << 20))], threads=2)
        fork_and_check(root, stager, f"{root}/sync", base)
        path, want, upload = f"{root}/after", None, None
    else:
        gate = Gate()
        mutate(sd)
        want = snapshot(sd)
        path = f"{root}/inflight"
        if scenario == "staging":
            sd["slow"] = SlowCopy(gate)  # staged as 7
            want["slow"] = 7
            response = dcpx.async_save(sd, storage_writer=writer(path), async_stager=stager)
        else:
            if scenario == "write":
                sd["model"]["embed"] = torch.randn(48 << 18)
                want["model"]["embed"] = sd["model"]["embed"].clone()
            w = GatedWriter(path, scenario, gate, sync_files=True)
            response = dcpx.async_save(sd, storage_writer=w, async_stager=stager)
            response.staging_completion.result(timeout=WAIT)
            mutate(sd)  # training goes on while the upload is held
        assert gate.reached.wait(WAIT), "the upload never reached the gate"
        try:
            fork_and_check(root, stager, f"{root}/sync", base)
        finally:
            gate.opened.set()
        upload = response.upload_completion
        upload.result(timeout=WAIT)
        check(path, want, f"parent: the save in flight at the fork ({scenario})")
        sd.pop("slow", None)
    # the same stager (and buffer) serves the parent's next save
    mutate(sd)
    want = snapshot(sd)
    upload_of(dcpx.async_save(sd, storage_writer=writer(f"{root}/next"),
                              async_stager=stager)).result(timeout=WAIT)
    check(f"{root}/next", want, "parent: next save with the same stager")
    assert gc.isenabled()
    stager.close()


def main() -> int:
    scenario, root = sys.argv[1], sys.argv[2]
    try:
        run(scenario, root)
    except Exception:  # not SystemExit: that is the child leaving (fork_and_check)
        traceback.print_exc()
        return 1
    print("fork: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
