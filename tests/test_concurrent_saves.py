"""Two saves into one checkpoint directory at once (issue 10, item 1).

The rule (docs/reliability.md, "Concurrent saves into one directory"):

* within a process, saves into one directory run one at a time in call
  order: a ``save`` after an ``async_save`` into the same directory waits for
  that upload's commit, whatever the checkpointer type and stager;
* across processes, a commit's cleanup never deletes a file that a live save
  may still reference (each save's lock file), and commits do not interleave
  (the directory's commit lock): the last save to commit is what the
  directory holds, complete;
* a PROCESS checkpoint process whose parent died does not commit over a
  checkpoint committed after its save was handed over.

Every test checks the invariant: each save that reported success has left
the directory loading bit-exactly as exactly one complete save, the last one
to commit.  Repetitions use random delays; ``DCPX_CONCURRENT_REPS`` (default
1) multiplies them for long runs.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

import dcpx
import dcpx.filesystem
from conftest import assert_state_bit_equal, pid_gone

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
]

REPS = max(1, int(os.environ.get("DCPX_CONCURRENT_REPS", "1")))
SEED = int(os.environ.get("DCPX_CONCURRENT_SEED", "0")) or random.randrange(1 << 30)
TIMEOUT = 120
THREAD = dcpx.AsyncCheckpointerType.THREAD
PROCESS = dcpx.AsyncCheckpointerType.PROCESS
TESTS = Path(__file__).resolve().parent
DCPX_ROOT = Path(dcpx.__file__).resolve().parents[1]  # the dcpx under test


def state(version: int, tensors: int = 6, numel: int = 1 << 15) -> dict:
    """A state dict whose every byte depends on ``version``."""
    g = torch.Generator().manual_seed(version)
    sd = {f"t{i}": torch.randn(numel, generator=g) for i in range(tensors)}
    sd["ids"] = torch.randint(0, 1 << 30, (37,), generator=g)
    sd["version"] = version
    return sd


def holds(path) -> int:
    """The version the checkpoint at ``path`` holds, checked bit for bit
    against that version's state (a mix of two saves fails)."""
    sdm = dcpx.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = sum(1 for k in sdm if k.startswith("t"))
    numel = sdm["t0"].size.numel()
    dest = {f"t{i}": torch.zeros(numel) for i in range(tensors)}
    dest["ids"] = torch.zeros(37, dtype=torch.int64)
    dest["version"] = -1
    dcpx.load(dest, checkpoint_id=path)
    assert_state_bit_equal(dest, state(dest["version"], tensors, numel))
    return dest["version"]


def assert_clean(path) -> None:
    """Nothing but the committed checkpoint is left: no data file of another
    save, no temporary metadata, no lock file."""
    md = dcpx.FileSystemReader(path).read_metadata()
    referenced = {info.relative_path for info in md.storage_data.values()}
    left = set(os.listdir(path)) - {".metadata"} - referenced
    assert not left, f"{path} holds {sorted(left)} besides its checkpoint"


def random_writer(path, rng: random.Random) -> dcpx.FileSystemWriter:
    """One, two or a file per item, with and without fsync."""
    return dcpx.FileSystemWriter(path, single_file_per_rank=rng.random() < 0.6,
                                 thread_count=rng.choice([1, 2]),
                                 sync_files=rng.random() < 0.3)


def upload_of(r):
    return r.upload_completion if isinstance(r, dcpx.AsyncSaveResponse) else r


@pytest.fixture
def rng(request):
    seed = SEED + zlib.crc32(request.node.name.encode()) % 1000
    print(f"DCPX_CONCURRENT_SEED base {SEED}, this test {seed}")
    return random.Random(seed)


# --------------------------------------------------------------------------
# 1. within one process: saves into one directory run in call order


@pytest.mark.parametrize("kind", [THREAD, PROCESS], ids=["thread", "process"])
@pytest.mark.parametrize("stager", ["per-call", "background"])
def test_sync_save_after_async_save_waits_for_it(tmp_path, rng, kind, stager):
    """A final ``save`` at the end of training while the last ``async_save``
    into the same directory still uploads: both succeed and the directory
    holds the final save (it was called last, so it commits last)."""
    st = (dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True,
                                                 use_shared_memory=kind == PROCESS))
          if stager == "background" else None)
    try:
        for rep in range(12 * REPS):
            d = tmp_path / f"d{rep % 3}"  # fresh at first, then over a checkpoint
            v1, v2 = 2 * rep + 1, 2 * rep + 2
            r = dcpx.async_save(state(v1), storage_writer=random_writer(d, rng),
                                async_checkpointer_type=kind, async_stager=st)
            time.sleep(rng.uniform(0, 0.005))
            dcpx.save(state(v2), storage_writer=random_writer(d, rng))
            upload_of(r).result(timeout=TIMEOUT)
            assert holds(d) == v2, f"rep {rep}"
            assert_clean(d)
    finally:
        if st is not None:
            st.close()


ORDERS = [(THREAD, PROCESS), (PROCESS, THREAD), (THREAD, THREAD), (PROCESS, PROCESS)]


@pytest.mark.parametrize("first,second", ORDERS,
                         ids=[f"{a.value}-{b.value}" for a, b in ORDERS])
def test_async_save_after_async_save_commits_in_call_order(tmp_path, rng, first, second):
    """Two ``async_save`` calls into one directory with different stagers
    (the per-call default, or a user's background stager), any mix of THREAD
    and PROCESS: both succeed, the later call's save is what stays."""
    stagers = [None, dcpx.DefaultStager(dcpx.StagingOptions(True, True, False, False))]
    try:
        for rep in range(8 * REPS):
            d = tmp_path / f"d{rep % 3}"
            v1, v2 = 2 * rep + 1, 2 * rep + 2
            r1 = dcpx.async_save(state(v1), storage_writer=random_writer(d, rng),
                                 async_checkpointer_type=first,
                                 async_stager=rng.choice(stagers))
            time.sleep(rng.uniform(0, 0.01))
            r2 = dcpx.async_save(state(v2), storage_writer=random_writer(d, rng),
                                 async_checkpointer_type=second, async_stager=None)
            upload_of(r1).result(timeout=TIMEOUT)
            upload_of(r2).result(timeout=TIMEOUT)
            assert holds(d) == v2, f"rep {rep}"
            assert_clean(d)
    finally:
        stagers[1].close()


def test_async_saves_from_two_threads_do_not_wait_for_each_other_forever(tmp_path, monkeypatch):
    """Regression: thread A takes its turn for D, thread B takes the next one
    and queues its upload first; the one upload thread would then run B's
    upload, which waits for A's turn, while A's upload is queued behind it.
    Taking the turn and queueing the upload are one step."""
    import dcpx.storage.locks
    real = dcpx.storage.locks.gate

    def slow_gate(staged, turn):
        if threading.current_thread().name == "A":
            time.sleep(0.3)  # between A's turn and A's upload being queued
        return real(staged, turn)

    monkeypatch.setattr(dcpx.storage.locks, "gate", slow_gate)
    d = tmp_path / "ckpt"
    futures = {}

    def save(name: str, v: int) -> None:
        futures[name] = dcpx.async_save(state(v), checkpoint_id=d)

    a = threading.Thread(target=save, args=("A", 1), name="A")
    a.start()
    time.sleep(0.1)
    b = threading.Thread(target=save, args=("B", 2), name="B")
    b.start()
    a.join(TIMEOUT)
    b.join(TIMEOUT)
    futures["A"].result(timeout=30)
    futures["B"].result(timeout=30)
    assert holds(d) == 2
    assert_clean(d)


class RecordingWriter(dcpx.FileSystemWriter):
    """Appends ``(CLOCK_MONOTONIC ns, version)`` to ``log`` right after its
    ``.metadata`` rename, inside the commit (under the commit lock, so the
    log's order is the rename order, across processes too)."""

    def __init__(self, path, version, log, **kw):
        super().__init__(path, **kw)
        self.version, self.log = version, log

    def _remove_unreferenced(self, *args, **kwargs):
        self.log(time.monotonic_ns(), self.version)
        return super()._remove_unreferenced(*args, **kwargs)


def test_threads_saving_into_one_directory(tmp_path, rng):
    """Three threads save (sync or async) into one directory at the same
    moment, round after round: every save succeeds and the directory holds
    the last one committed, and nothing else."""
    log, lock, errors = [], threading.Lock(), []

    def record(ns, version):
        with lock:
            log.append((ns, version))

    def worker(d, v: int, seed: int, barrier) -> None:
        r = random.Random(seed)
        try:
            w = RecordingWriter(d, v, record, single_file_per_rank=r.random() < 0.5,
                                sync_files=False)
            sd = state(v)
            barrier.wait(TIMEOUT)
            time.sleep(r.uniform(0, 0.003))
            if r.random() < 0.5:
                dcpx.save(sd, storage_writer=w)
            else:
                upload_of(dcpx.async_save(
                    sd, storage_writer=w, async_checkpointer_type=THREAD)).result(timeout=TIMEOUT)
        except BaseException as e:  # reported below
            errors.append(f"version {v}: {type(e).__name__}: {e}")

    for rep in range(12 * REPS):
        d = tmp_path / f"d{rep % 2}"  # fresh at first, then over a checkpoint
        del log[:]
        barrier = threading.Barrier(3)
        threads = [threading.Thread(target=worker,
                                    args=(d, 10 * rep + t, rng.randrange(1 << 30), barrier))
                   for t in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(TIMEOUT)
        assert not errors, errors
        assert len(log) == 3
        assert holds(d) == max(log)[1], f"rep {rep}: not the last save to commit"
        assert_clean(d)


# --------------------------------------------------------------------------
# 2. across processes


def _process_saves(d: str, first: int, n: int, seed: int, logfile: str) -> None:
    """A forked child: ``n`` saves of versions first.. into ``d``."""
    torch.set_num_threads(1)  # torch's OpenMP pool is not fork-safe
    r = random.Random(seed)
    out = open(logfile, "a")

    def record(ns, version):
        out.write(f"{ns} {version}\n")
        out.flush()

    try:
        for i in range(n):
            v = first + i
            w = RecordingWriter(d, v, record, single_file_per_rank=r.random() < 0.5,
                                sync_files=r.random() < 0.2)
            time.sleep(r.uniform(0, 0.02))
            if r.random() < 0.7:
                dcpx.save(state(v), storage_writer=w)
            else:
                upload_of(dcpx.async_save(state(v), storage_writer=w)).result(timeout=TIMEOUT)
    except BaseException as e:
        print(f"child {os.getpid()}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


def test_processes_saving_into_one_directory(tmp_path, rng):
    """Three processes keep saving into one directory at the same time: each
    save succeeds, a commit's cleanup never removes another live save's files
    or temporary metadata, and the directory holds the last one committed,
    complete (and nothing else)."""
    ctx = mp.get_context("fork")
    for rep in range(3 * REPS):
        d = tmp_path / f"d{rep}"
        if rep % 2:
            dcpx.save(state(1), checkpoint_id=d)  # over a committed checkpoint
        logs = [str(tmp_path / f"log{rep}.{c}") for c in range(3)]
        procs = [ctx.Process(target=_process_saves,
                             args=(str(d), 1000 * (c + 1), 5, rng.randrange(1 << 30), logs[c]))
                 for c in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT)
            if p.exitcode is None:
                p.kill()
        assert [p.exitcode for p in procs] == [0, 0, 0], f"rep {rep}: a save failed"
        commits = sorted((int(a), int(b)) for f in logs
                         for a, b in (line.split() for line in open(f)))
        assert len(commits) == 15
        assert holds(d) == commits[-1][1], f"rep {rep}: not the last save to commit"
        assert_clean(d)


def _group_saves(rank: int, world_size: int, d: str, log: str, n: int, seed: int) -> None:
    """A rank of a 2-rank gloo group: ``n`` saves into ``d`` (each rank
    writes part of every save under the coordinator's tag; the coordinator
    commits)."""
    r = random.Random(seed)
    out = open(log, "a")

    def record(ns, version):
        out.write(f"{ns} {version}\n")
        out.flush()

    Path(d + f".started{rank}").touch()
    for i in range(n):
        v = 5000 + i
        time.sleep(r.uniform(0, 0.02))
        w = RecordingWriter(d, v, record, single_file_per_rank=r.random() < 0.5,
                            sync_files=False)
        if i % 2:
            dcpx.save(state(v), storage_writer=w)
        else:
            dcpx.async_save(state(v), storage_writer=w).result(timeout=TIMEOUT)


@pytest.mark.dist
def test_process_group_and_another_process_saving_into_one_directory(tmp_path, rng):
    """A 2-rank process group keeps saving into one directory while an
    unrelated process (this one) does too: every save succeeds, the ranks of
    one save never block each other on a lock, and the directory holds the
    last save committed, complete."""
    from dist_helpers import spawn
    d = str(tmp_path / "ckpt")
    log = str(tmp_path / "log")
    done = threading.Event()
    result: list = []

    def group() -> None:
        try:
            spawn(_group_saves, 2, d, log, 8 * REPS, rng.randrange(1 << 30))
        except BaseException as e:  # reported below
            result.append(e)
        finally:
            done.set()

    th = threading.Thread(target=group)
    th.start()
    deadline = time.monotonic() + TIMEOUT
    while not os.path.exists(d + ".started1") and not done.is_set():
        assert time.monotonic() < deadline, "the group did not start"
        time.sleep(0.01)
    ours = 0

    def record(ns, version):
        with open(log, "a") as f:
            f.write(f"{ns} {version}\n")

    while not done.is_set():
        v = 9000 + ours
        time.sleep(rng.uniform(0, 0.02))
        dcpx.save(state(v), storage_writer=RecordingWriter(
            d, v, record, single_file_per_rank=rng.random() < 0.5, sync_files=False))
        ours += 1
    th.join(TIMEOUT)
    if result:
        raise result[0]
    commits = sorted((int(a), int(b)) for a, b in (line.split() for line in open(log)))
    assert len(commits) == 8 * REPS + ours
    print(f"group saves {8 * REPS}, this process's {ours}")
    assert holds(d) == commits[-1][1]
    assert_clean(d)


# --------------------------------------------------------------------------
# 3. a restarted job while the dead job's checkpoint process still uploads

_ORPHAN_PARENT = textwrap.dedent("""
    import json, sys, time
    import torch
    sys.path.insert(0, sys.argv[2])
    import dcpx
    from test_concurrent_saves import state
    d = sys.argv[1]
    PROCESS = dcpx.AsyncCheckpointerType.PROCESS
    dcpx.async_save({"w": torch.ones(3)}, checkpoint_id=d + ".warm",
                    async_checkpointer_type=PROCESS).result(timeout=120)
    print(json.dumps({"worker": dcpx._process._worker.proc.pid}), flush=True)
    sys.stdin.readline()   # go
    big = state(7, tensors=64, numel=1 << 18)   # 64 MiB, a file per tensor, fsync'd
    r = dcpx.async_save(big, storage_writer=dcpx.FileSystemWriter(
        d, single_file_per_rank=False, sync_files=True), async_checkpointer_type=PROCESS)
    print("submitted", flush=True)
    r.result(timeout=120)
    print("done", flush=True)
    time.sleep(120)
""")


def test_orphaned_checkpoint_process_does_not_commit_over_a_newer_save(tmp_path, rng):
    """The training process dies while its PROCESS checkpoint process writes
    a save; the restarted job saves into the same directory and reports
    success.  Whatever the interleaving, the directory then holds the
    restarted job's save: the orphan commits only if nothing was committed
    there after its save was handed over, and never deletes the new save's
    files (nor the new save the orphan's, while it may still commit)."""
    reps = 2 * REPS
    procs = []
    for rep in range(reps):
        d = tmp_path / f"d{rep}"
        dcpx.save(state(1), checkpoint_id=d)  # the checkpoint the job resumed from
        p = subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT, str(d),
                              str(TESTS)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(DCPX_ROOT)})
        procs.append((d, p))
    outcomes = []
    try:
        for rep, (d, p) in enumerate(procs):
            worker = json.loads(p.stdout.readline())["worker"]
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "submitted", p.stderr.read()
            time.sleep(rng.uniform(0.02, 0.15))  # the upload takes 0.2 to 1 s here
            p.kill()  # the training process dies; its checkpoint process lives on
            p.wait(TIMEOUT)
            new = 100 + rep  # the restarted job's (small) save, done before the orphan's
            dcpx.save(state(new), storage_writer=dcpx.FileSystemWriter(d, sync_files=False))
            deadline = time.monotonic() + TIMEOUT
            while not pid_gone(worker) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not pid_gone(worker):
                os.kill(worker, signal.SIGKILL)
                pytest.fail(f"the orphaned checkpoint process {worker} did not exit")
            refused = "not committed" in p.stderr.read()
            got = holds(d)
            outcomes.append((got, "orphan refused" if refused else "orphan did not commit after"))
            assert got == new, f"rep {rep}: the restarted job's save was replaced by {got}"
            assert_clean(d)
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print("outcomes", outcomes)
