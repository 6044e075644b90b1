"""Failure across ranks (issue #4, part 6): when one rank fails, every rank
gets an exception (none hangs) and nothing is committed.

Write failures are real ones, made in the failing rank only by lowering its
``RLIMIT_FSIZE``: with ``SIGXFSZ`` ignored, its writes past the limit fail
with ``EFBIG`` ("File too large"), whatever code does the writing; with
``SIGXFSZ`` at its default, the kernel kills the rank in the middle of
writing its data file.

2 ranks, one spawn, a check per pytest test (directory ``A`` holds a
committed checkpoint ``v1`` throughout):

* ``dcpx.save`` fails on rank 1, then on rank 0 (the coordinator): the
  failing rank raises its own ``OSError`` (EFBIG), the other a
  ``dcpx.CheckpointError`` naming the failed rank; ``A/.metadata`` is
  untouched, no data file is left behind, ``v1`` still loads bit-exactly;
  into a fresh directory: no ``.metadata`` at all (load raises
  ``IncompleteCheckpointError``);
* ``async_save`` (a Future; and an ``AsyncSaveResponse`` from a long-lived
  ``DefaultStager``): the error comes on the upload future of every rank,
  same checks, and the stager saves fine afterwards;
* a planning error on one rank (a value it cannot save): every rank raises;
* a load that fails on one rank (a corrupted record only it reads): every
  rank raises;
* after all that, save / async_save / load still work in the same process
  group.

Ranks that die (one spawn each; the process-group timeout is 30 s, the join
timeout bounds everything else): rank 1 killed by SIGXFSZ while its sync
save / async upload writes, and rank 1 calling ``os._exit(1)`` while its
async upload is in flight.  Rank 0 must raise (on the call / on the upload
future), ``A/.metadata`` must be unchanged, and ``A`` must still load
bit-exactly (in the pytest process, without a process group).
"""
from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import signal
import time

import pytest
import torch
import torch.distributed as dist

import dcpx
from conftest import assert_bit_equal
from dist_helpers import (
    CheckSession,
    PG_TIMEOUT,
    dtensor_of,
    full_value,
    read_metadata,
    spawn_outcomes,
    storage_entries,
)

pytestmark = pytest.mark.dist

ROWS = 512          # "w": (512, 256) float32 sharded over 2 ranks: 256 KiB each
LIMIT = 64 * 1024   # the failing rank's file size limit


def expected(version: int) -> dict:
    return {"w": full_value(f"fail.w.{version}", (ROWS, 256)),
            "b": full_value(f"fail.b.{version}", (16,)),
            "version": version}


def state(version: int, zeros: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from dtensor_api import Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    exp = expected(version)
    if zeros:
        return {"w": dtensor_of(torch.zeros(ROWS, 256), mesh, [Shard(0)]),
                "b": torch.zeros(16), "version": None}
    return {"w": dtensor_of(exp["w"], mesh, [Shard(0)]), "b": exp["b"], "version": version}


def assert_holds(path: str, version: int) -> None:
    """Collective: the checkpoint at ``path`` loads as exactly ``version``."""
    sd = state(version, zeros=True)
    dcpx.load(sd, checkpoint_id=path)
    exp = expected(version)
    assert_bit_equal(sd["w"].full_tensor(), exp["w"], f"{path}: w")
    assert_bit_equal(sd["b"], exp["b"], f"{path}: b")
    assert sd["version"] == version, f"{path}: version {sd['version']} != {version}"


@contextlib.contextmanager
def file_size_limit(active: bool, kill: bool = False):
    """On this rank only (``active``): writes past LIMIT bytes fail with
    EFBIG, or (``kill``) the kernel kills the process with SIGXFSZ."""
    if not active:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_DFL if kill else signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


def snapshot(path: str) -> tuple:
    """(.metadata bytes or None, sorted directory listing)."""
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            md = f.read()
    except FileNotFoundError:
        md = None
    return md, sorted(os.listdir(path)) if os.path.isdir(path) else []


def errno_in_chain(e: BaseException, code: int) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == code:
            return True
        e = e.__cause__ or e.__context__
    return False


def assert_failed_everywhere(err: BaseException, failing: int, rank: int, what: str) -> None:
    """The failing rank raised its own OSError(EFBIG); the others an
    exception that names it."""
    assert err is not None, f"{what}: rank {rank} got no exception (rank {failing} failed)"
    if rank == failing:
        assert errno_in_chain(err, errno.EFBIG), (
            f"{what}: the failing rank {rank} raised {type(err).__name__}: {err}, "
            f"not its own OSError(EFBIG)")
    else:
        assert isinstance(err, dcpx.CheckpointError), (
            f"{what}: rank {rank} raised {type(err).__name__}: {err}; expected "
            f"dcpx.CheckpointError naming rank {failing}")
        assert f"rank {failing}" in str(err), (
            f"{what}: rank {rank}'s error does not name the failed rank {failing}: {err}")


def _try(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - what the check is about
        if isinstance(e, KeyboardInterrupt):
            raise
        return e
    return None


# --------------------------------------------------------------------------
# checks (2 ranks, in order)


def check_commit_v1(ctx):
    dcpx.save(state(1), checkpoint_id=ctx.path("A"))
    dist.barrier()
    assert_holds(ctx.path("A"), 1)


def _sync_failure(ctx, failing: int, path: str, version: int) -> None:
    before = snapshot(path)
    dist.barrier()
    with file_size_limit(ctx.rank == failing):
        err = _try(lambda: dcpx.save(state(version), checkpoint_id=path))
    dist.barrier()
    assert_failed_everywhere(err, failing, ctx.rank, f"dcpx.save failing on rank {failing}")
    after = snapshot(path)
    assert after[0] == before[0], f"{path}/.metadata changed although rank {failing} failed"
    assert after[1] == before[1], (
        f"the failed save left files behind or removed some: {before[1]} -> {after[1]}")


def check_sync_save_fails_on_rank_1(ctx):
    _sync_failure(ctx, 1, ctx.path("A"), 2)
    assert_holds(ctx.path("A"), 1)


def check_sync_save_fails_on_coordinator(ctx):
    _sync_failure(ctx, 0, ctx.path("A"), 3)
    assert_holds(ctx.path("A"), 1)


def check_sync_save_fails_into_fresh_directory(ctx):
    path = ctx.path("fresh")
    _sync_failure(ctx, 1, path, 2)
    assert snapshot(path)[0] is None, "a .metadata appeared although rank 1 failed"
    err = _try(lambda: dcpx.load(state(2, zeros=True), checkpoint_id=path))
    assert isinstance(err, dcpx.IncompleteCheckpointError), (
        f"loading a never-committed directory raised {type(err).__name__}: {err}")


def _async_failure(ctx, failing: int, path: str, version: int, stager=None) -> None:
    before = snapshot(path)
    dist.barrier()
    with file_size_limit(ctx.rank == failing):
        ret = dcpx.async_save(state(version), checkpoint_id=path, async_stager=stager)
        if isinstance(ret, dcpx.AsyncSaveResponse):
            staging_err = _try(lambda: ret.staging_completion.result(timeout=60))
            assert staging_err is None, f"rank {ctx.rank}: staging failed: {staging_err!r}"
            ret = ret.upload_completion
        err = _try(lambda: ret.result(timeout=PG_TIMEOUT + 30))
    dist.barrier()
    assert_failed_everywhere(err, failing, ctx.rank,
                             f"async_save failing on rank {failing} (upload future)")
    after = snapshot(path)
    assert after[0] == before[0], f"{path}/.metadata changed although rank {failing} failed"
    assert after[1] == before[1], (
        f"the failed save left files behind or removed some: {before[1]} -> {after[1]}")


def check_async_save_fails_on_rank_1(ctx):
    _async_failure(ctx, 1, ctx.path("A"), 4)
    assert_holds(ctx.path("A"), 1)


def _stager_save(stager, version, path):
    ret = dcpx.async_save(state(version), checkpoint_id=path, async_stager=stager)
    (ret.upload_completion if isinstance(ret, dcpx.AsyncSaveResponse) else ret
     ).result(timeout=60)
    dist.barrier()
    assert_holds(path, version)


def check_async_save_with_stager_fails_then_succeeds(ctx):
    """A long-lived DefaultStager (shared memory, async staging): its buffer
    is made by a first, good save (the file size limit would also stop the
    memfd from growing; staging failures are another test), then uploads
    fail on rank 1 and on rank 0, then it saves fine again."""
    with dcpx.DefaultStager() as stager:
        _stager_save(stager, 5, ctx.path("stager_ok"))
        _async_failure(ctx, 1, ctx.path("A"), 6, stager)
        assert_holds(ctx.path("A"), 1)
        _async_failure(ctx, 0, ctx.path("A"), 7, stager)
        assert_holds(ctx.path("A"), 1)
        _stager_save(stager, 8, ctx.path("stager_ok"))
        assert stager.alloc_count == 1, f"{stager.alloc_count} buffers for one structure"


def check_planning_fails_on_one_rank(ctx):
    """Rank 1 holds a value it cannot save (a sparse tensor)."""
    path = ctx.path("A")
    before = snapshot(path)
    sd = state(11)
    sd["extra"] = torch.eye(3).to_sparse() if ctx.rank == 1 else torch.eye(3)
    err = _try(lambda: dcpx.save(sd, checkpoint_id=path))
    dist.barrier()
    assert err is not None, f"rank {ctx.rank}: no exception although rank 1 cannot save 'extra'"
    if ctx.rank == 1:
        assert isinstance(err, TypeError) and "extra" in str(err), (
            f"rank 1 raised {type(err).__name__}: {err}")
    else:
        assert isinstance(err, dcpx.CheckpointError) and "rank 1" in str(err), (
            f"rank 0 raised {type(err).__name__}: {err}")
    assert snapshot(path) == before, "the failed save changed the directory"
    assert_holds(path, 1)


def check_load_fails_on_one_rank(ctx):
    """A corrupted record that only rank 1 reads (its own shard of "w")."""
    src, path = ctx.path("A"), ctx.path("corrupt")
    if ctx.rank == 0:
        shutil.copytree(src, path)
        md = read_metadata(path)
        [(_, _, rel, off, length)] = [e for e in storage_entries(md)
                                      if e[0] == "w" and e[1] == (ROWS // 2, 0)]
        with open(os.path.join(path, rel), "r+b") as f:  # a byte of the tensor data
            f.seek(off + length - 2048)
            b = f.read(1)
            f.seek(off + length - 2048)
            f.write(bytes([b[0] ^ 0x40]))
    dist.barrier()
    err = _try(lambda: dcpx.load(state(1, zeros=True), checkpoint_id=path))
    assert err is not None, f"rank {ctx.rank}: the load of a corrupted shard raised nothing"
    if ctx.rank == 1:
        assert isinstance(err, dcpx.CorruptCheckpointError), f"{type(err).__name__}: {err}"
    else:
        assert isinstance(err, dcpx.CheckpointError) and "rank 1" in str(err), (
            f"rank 0 raised {type(err).__name__}: {err}")


def check_everything_works_afterwards(ctx):
    path = ctx.path("A")
    dcpx.save(state(9), checkpoint_id=path)
    dist.barrier()
    assert_holds(path, 9)
    ret = dcpx.async_save(state(10), checkpoint_id=path)
    ret.result(timeout=60)
    dist.barrier()
    assert_holds(path, 10)
    files = {e[2] for e in storage_entries(read_metadata(path))}
    data = {n for n in os.listdir(path) if n.endswith(".distcp")}
    assert data == files, f"unreferenced data files left in {path}: {sorted(data - files)}"


CHECKS = [check_commit_v1, check_sync_save_fails_on_rank_1,
          check_sync_save_fails_on_coordinator, check_sync_save_fails_into_fresh_directory,
          check_async_save_fails_on_rank_1, check_async_save_with_stager_fails_then_succeeds,
          check_planning_fails_on_one_rank, check_load_fails_on_one_rank,
          check_everything_works_afterwards]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return CheckSession(2, CHECKS, tmp_path_factory.mktemp("failure")).run()


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_failure_2_ranks(session, check):
    session.assert_ok(check)


# --------------------------------------------------------------------------
# a rank dies


def _die_during_save(rank, world_size, path, how):
    """Commit v1, then save v2 while rank 1 dies.  Rank 0 returns what it
    saw; rank 1 must not return at all."""
    dcpx.save(state(1), checkpoint_id=path)
    dist.barrier()
    before = snapshot(path)
    dist.barrier()
    t0 = time.monotonic()
    if how == "sync":
        with file_size_limit(rank == 1, kill=True):
            err = _try(lambda: dcpx.save(state(2), checkpoint_id=path))
    else:
        with file_size_limit(rank == 1 and how == "async-killed", kill=True):
            fut = dcpx.async_save(state(2), checkpoint_id=path)
            if rank == 1 and how == "async-exit":
                os._exit(1)  # the training process dies, its upload in flight
            err = _try(lambda: fut.result(timeout=PG_TIMEOUT + 30))
    elapsed = time.monotonic() - t0
    if rank == 1:
        return {"survived": True, "error": repr(err)}
    after = snapshot(path)
    return {"error": None if err is None else f"{type(err).__name__}: {err}",
            "elapsed": elapsed, "metadata_unchanged": after[0] == before[0],
            "had_metadata": before[0] is not None}


@pytest.mark.parametrize("how", ["sync", "async-killed", "async-exit"])
def test_rank_dies_during_save(tmp_path, how):
    path = str(tmp_path / "A")
    outs = spawn_outcomes(_die_during_save, 2, path, how, timeout=PG_TIMEOUT + 90)
    r0, r1 = outs
    assert not r1.ok, (
        f"test setup: rank 1 was meant to die during the save but finished: {r1.value}")
    want = -signal.SIGXFSZ if how != "async-exit" else 1
    assert r1.exitcode == want, (
        f"test setup: rank 1 ended with {r1.describe()} instead of exit code {want}")
    assert r0.ok, f"rank 0 did not come back from the save:\n{r0.describe()}"
    rep = r0.value
    assert rep["had_metadata"], "test setup: v1 was not committed"
    assert rep["error"] is not None, (
        f"rank 0's {how} save returned normally although rank 1 died during it")
    assert rep["metadata_unchanged"], ".metadata changed although rank 1 died during the save"
    # The directory still holds exactly v1 (loaded here, without a process group).
    exp = expected(1)
    sd = {"w": torch.zeros(ROWS, 256), "b": torch.zeros(16), "version": None}
    dcpx.load(sd, checkpoint_id=path)
    assert_bit_equal(sd["w"], exp["w"], "w")
    assert_bit_equal(sd["b"], exp["b"], "b")
    assert sd["version"] == 1


# --------------------------------------------------------------------------
# a peer that fails (or is stuck) before the upload's collectives
#
# The other rank stays alive (a training process goes on), waiting for a flag
# file that rank 0 writes once its upload future has resolved, for at most
# PEER_WAIT seconds; a rank 0 that waits for it anyway is told by how long
# it took.

SHORT_PG_TIMEOUT = 4.0
PEER_WAIT = 10.0


def _wait_for_flag(flag: str) -> None:
    end = time.monotonic() + PEER_WAIT
    while time.monotonic() < end and not os.path.exists(flag):
        time.sleep(0.05)


def _raise_flag(flag: str) -> None:
    with open(flag, "w"):
        pass


def _staging_fails_on_rank_1(rank, world_size, path):
    """Rank 1's async staging fails (its new shared-memory staging buffer
    cannot grow past its file size limit: EFBIG), after both committed v1."""
    dcpx.save(state(1), checkpoint_id=path)
    dist.barrier()
    before = snapshot(path)
    flag = path + ".rank0_done"
    t0 = time.monotonic()
    with dcpx.DefaultStager() as stager, file_size_limit(rank == 1):
        ret = dcpx.async_save(state(2), checkpoint_id=path, async_stager=stager)
        staging_err = _try(lambda: ret.staging_completion.result(timeout=60))
        err = _try(lambda: ret.upload_completion.result(timeout=60))
    elapsed = time.monotonic() - t0
    if rank == 0:
        _raise_flag(flag)
    else:
        _wait_for_flag(flag)
    return {"staging_error": repr(staging_err), "error": repr(err), "elapsed": elapsed,
            "failed": err is not None,
            "efbig": err is not None and errno_in_chain(err, errno.EFBIG),
            "metadata_unchanged": snapshot(path)[0] == before[0]}


def test_async_staging_fails_on_one_rank(tmp_path):
    """Rank 1's staging fails: every rank's upload future raises, promptly
    (well within the process-group timeout), and nothing is committed."""
    path = str(tmp_path / "A")
    outs = spawn_outcomes(_staging_fails_on_rank_1, 2, path, pg_timeout=SHORT_PG_TIMEOUT,
                          timeout=PEER_WAIT + 90)
    for o in outs:
        assert o.ok, o.describe()
    r0, r1 = (o.value for o in outs)
    assert r1["efbig"], f"test setup: rank 1's upload did not fail with EFBIG: {r1}"
    assert r0["failed"], f"rank 0's upload succeeded although rank 1 could not stage: {r0}"
    assert r0["metadata_unchanged"] and r1["metadata_unchanged"], (r0, r1)
    assert r0["elapsed"] < SHORT_PG_TIMEOUT * 0.75, (
        f"rank 0's upload failed only after {r0['elapsed']:.1f} s (process-group timeout "
        f"{SHORT_PG_TIMEOUT} s, rank 1 alive for up to {PEER_WAIT} s): it waited for rank 1, "
        f"which had failed at staging; rank 0 got {r0['error']}")


def _staging_fails_on_rank_1_foreign(rank, world_size, path, kind):
    """As _staging_fails_on_rank_1, with a storage writer of the user's (torch's
    FileSystemWriter subclassed): the other rank runs torch's save, whose
    collectives must learn of rank 1's failure."""
    from test_process_foreign import MarkingWriter

    ckpt = (dcpx.AsyncCheckpointerType.PROCESS if kind == "process"
            else dcpx.AsyncCheckpointerType.THREAD)
    dcpx.save(state(1), checkpoint_id=path)
    dist.barrier()
    before = snapshot(path)
    flag = path + ".rank0_done"
    t0 = time.monotonic()
    with dcpx.DefaultStager() as stager, file_size_limit(rank == 1):
        ret = dcpx.async_save(state(2), storage_writer=MarkingWriter(path), async_stager=stager,
                              async_checkpointer_type=ckpt)
        err = _try(lambda: ret.upload_completion.result(timeout=60))
    elapsed = time.monotonic() - t0
    if rank == 0:
        _raise_flag(flag)
    else:
        _wait_for_flag(flag)
    return {"error": repr(err)[:400], "elapsed": elapsed, "failed": err is not None,
            "efbig": err is not None and errno_in_chain(err, errno.EFBIG),
            "metadata_unchanged": snapshot(path)[0] == before[0]}


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_async_staging_fails_on_one_rank_with_a_foreign_writer(tmp_path, kind):
    """Rank 1's staging fails while the save goes through torch's planner
    (a user's StorageWriter): rank 0 is told through torch's own
    collectives and fails at once instead of waiting out the group timeout."""
    path = str(tmp_path / "A")
    outs = spawn_outcomes(_staging_fails_on_rank_1_foreign, 2, path, kind,
                          pg_timeout=SHORT_PG_TIMEOUT, timeout=PEER_WAIT + 90)
    for o in outs:
        assert o.ok, o.describe()
    r0, r1 = (o.value for o in outs)
    assert r1["efbig"], f"test setup: rank 1's upload did not fail with EFBIG: {r1}"
    assert r0["failed"], f"rank 0's upload succeeded although rank 1 could not stage: {r0}"
    assert "rank 1" in r0["error"] or "EFBIG" in r0["error"] or "File too large" in r0["error"], r0
    assert r0["metadata_unchanged"] and r1["metadata_unchanged"], (r0, r1)
    assert r0["elapsed"] < SHORT_PG_TIMEOUT * 0.75, (
        f"rank 0's upload failed only after {r0['elapsed']:.1f} s (group timeout "
        f"{SHORT_PG_TIMEOUT} s): it waited for rank 1, which had failed at staging; "
        f"rank 0 got {r0['error']}")


def _peer_skips_async_save(rank, world_size, path, api):
    """Both ranks async-save once; then only rank 0 does (rank 1 is "stuck":
    alive, not saving).  Returns how long rank 0 waited for its error."""
    import torch.distributed.checkpoint as tdcp

    save = dcpx.async_save if api == "dcpx" else tdcp.async_save
    sd = {"x": torch.full((1000,), float(rank))}
    save(sd, checkpoint_id=path + "/first").result(timeout=60)
    dist.barrier()
    flag = path + ".rank0_done"
    if rank == 1:
        _wait_for_flag(flag)
        return None
    t0 = time.monotonic()
    err = _try(lambda: save(sd, checkpoint_id=path + "/second").result(timeout=60))
    elapsed = time.monotonic() - t0
    _raise_flag(flag)
    return {"error": None if err is None else f"{type(err).__name__}: {err}"[:300],
            "elapsed": elapsed}


@pytest.mark.parametrize("api", [
    "torch",
    "dcpx",
])
def test_async_save_stuck_peer_fails_after_the_group_timeout(tmp_path, api):
    """torch's behaviour (the reference run): the upload future raises once
    the process-group timeout has passed; dcpx must do the same."""
    path = str(tmp_path / "ckpt")
    outs = spawn_outcomes(_peer_skips_async_save, 2, path, api, pg_timeout=SHORT_PG_TIMEOUT,
                          timeout=PEER_WAIT + 90)
    for o in outs:
        assert o.ok, o.describe()
    rep = outs[0].value
    assert rep["error"] is not None, f"{api}: rank 0's lone async_save succeeded: {rep}"
    assert rep["elapsed"] < SHORT_PG_TIMEOUT + 4, (
        f"{api}: rank 0's upload failed only after {rep['elapsed']:.1f} s although the "
        f"process-group timeout is {SHORT_PG_TIMEOUT} s (rank 1 stayed alive for up to "
        f"{PEER_WAIT} s without saving); error: {rep['error']}")
