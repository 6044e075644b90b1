"""Multi-process test harness for dcpx's distributed path (gloo on CPU).

Each rank is a fresh interpreter (``python tests/dist_helpers.py --child``,
as torchrun would start it, not a fork of the pytest process, which may hold
threads and dcpx state of earlier tests).  The parent

* picks a free TCP port per run (``MASTER_PORT``; a run whose rank 0 lost
  the port to another process is retried on a new one),
* passes the job (the function, given as module + name, and its arguments)
  and gets each rank's result back through files in a job directory,
* joins with a hard timeout: a rank that does not finish in time gets
  SIGUSR1 (``faulthandler`` prints every thread's stack into its log), then
  the ranks are SIGKILLed, and the test fails with those stacks, never
  stalls CI,
* re-raises a child's exception in the parent as :class:`ChildError`, with
  the child's traceback and the tail of its output.

Children run with ``OMP_NUM_THREADS=1`` (4 ranks on a 2-core machine) and
die with the parent (``PR_SET_PDEATHSIG``).

Two ways to use it:

``spawn(fn, world_size, *args)``
    run ``fn(rank, world_size, *args)`` on every rank (process group already
    initialised unless ``init_pg=False``); returns the per-rank return values
    or raises.  ``spawn_outcomes`` returns :class:`Outcome` objects instead
    of raising, for tests where a rank is meant to die.

``CheckSession(world_size, [check_a, check_b, ...])``
    run many checks in one spawn (interpreter starts are the cost: ~2.5 s of
    CPU per rank to import torch).  Each ``check(ctx)`` runs on every rank, in
    order; after each one the ranks meet at a barrier and every rank's
    outcome is written to the job directory at once, so a check that fails or
    hangs is reported by name while the earlier checks keep their results.
    ``session.assert_ok("check_a")`` raises the failure of that check (each
    rank's traceback), or the reason it did not run.  Test modules hold one
    session per module in a fixture and one pytest test per check.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

#: seconds a whole run may take before it is killed and the test fails
JOIN_TIMEOUT = float(os.environ.get("DCPX_DIST_TIMEOUT", "240"))
#: the process-group timeout children use (a collective that waits for a
#: dead or stuck peer raises after this long)
PG_TIMEOUT = float(os.environ.get("DCPX_DIST_PG_TIMEOUT", "30"))


class ChildError(AssertionError):
    """A rank raised, died, or did not finish; the message has its traceback
    (or its stacks at the timeout) and the tail of its output."""


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# parent side


@dataclasses.dataclass
class Outcome:
    """What one rank did."""

    rank: int
    exitcode: Optional[int]          # None: killed by the harness at the timeout
    ok: bool                         # returned normally
    value: Any = None                # its return value
    error: Optional[str] = None      # "ExcType: message" if it raised
    error_type: Optional[str] = None
    traceback: Optional[str] = None
    log: str = ""                    # tail of its stdout + stderr
    timed_out: bool = False

    def describe(self, seen: Optional[dict] = None) -> str:
        """Human-readable account; ``seen`` (traceback -> rank) shortens a
        traceback another rank already showed."""
        if self.ok:
            return f"rank {self.rank}: ok"
        if self.timed_out:
            head = (f"rank {self.rank}: did not finish within the timeout (killed; its "
                    f"threads' stacks at the timeout are in its output below)")
        elif self.error is not None:
            tb = self.traceback
            if seen is not None:
                if tb in seen:
                    tb = f"(same traceback as rank {seen[tb]})\n"
                else:
                    seen[tb] = self.rank
            head = f"rank {self.rank} raised {self.error}\n--- child traceback ---\n{tb}"
        else:
            head = f"rank {self.rank}: exited with code {self.exitcode} without a result"
        if self.log.strip():
            head += f"\n--- rank {self.rank} output (tail) ---\n{self.log}"
        return head


def _tail(path: Path, n: int = 6000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    text = data[-n:].decode(errors="replace")
    return ("...\n" if len(data) > n else "") + text


def _child_env(port: int, world_size: int, rank: int, extra: Optional[dict]) -> dict:
    env = dict(os.environ)
    env.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join(
            [str(TESTS), str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]),
        "PYTHONFAULTHANDLER": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("PYTEST_CURRENT_TEST", None)
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def _fn_ref(fn: Callable) -> tuple:
    """(module name, qualified name, the module's directory) of ``fn``."""
    mod = fn.__module__
    path = getattr(sys.modules.get(mod), "__file__", None)
    if mod == "__main__":
        mod = Path(path).stem
    return mod, fn.__qualname__, str(Path(path).resolve().parent) if path else None


def _launch(jobdir: Path, world_size: int, port: int, env: Optional[dict]) -> list:
    procs = []
    for rank in range(world_size):
        log = open(jobdir / f"rank{rank}.log", "wb")
        try:
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--child", str(jobdir), str(rank)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=_child_env(port, world_size, rank, env), cwd=str(REPO),
                start_new_session=True))
        finally:
            log.close()
    return procs


def _join(procs: list, deadline: float) -> list:
    """Wait for all; at the deadline dump the stacks of those still running
    (SIGUSR1 -> faulthandler) and kill them.  Returns per-rank timed_out."""
    timed_out = [False] * len(procs)
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    alive = [i for i, p in enumerate(procs) if p.poll() is None]
    if alive:
        for i in alive:
            timed_out[i] = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[i].pid, signal.SIGUSR1)
        time.sleep(1.5)
        for i in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(procs[i].pid, signal.SIGKILL)
    for i, p in enumerate(procs):
        p.wait()
        # Anything the rank started (a checkpoint process) goes with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    return timed_out


def _collect(jobdir: Path, procs: list, timed_out: list) -> list:
    outs = []
    for rank, p in enumerate(procs):
        o = Outcome(rank=rank, exitcode=None if timed_out[rank] else p.returncode, ok=False,
                    log=_tail(jobdir / f"rank{rank}.log"), timed_out=timed_out[rank])
        res = jobdir / f"result.{rank}.pkl"
        if res.exists():
            with open(res, "rb") as f:
                kind, payload = pickle.load(f)
            if kind == "ok":
                o.ok, o.value = True, payload
            else:
                o.error_type, o.error, o.traceback = payload
        outs.append(o)
    return outs


def _port_lost(outs: Sequence[Outcome]) -> bool:
    text = " ".join((o.error or "") + (o.traceback or "") for o in outs if not o.ok)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def spawn_outcomes(fn: Callable, world_size: int, *args: Any, timeout: float = JOIN_TIMEOUT,
                   pg_timeout: float = PG_TIMEOUT, init_pg: bool = True,
                   backend: str = "gloo", env: Optional[dict] = None,
                   jobdir: Optional[os.PathLike] = None, **kwargs: Any) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh
    processes, after ``init_process_group(backend, timeout=pg_timeout)``
    unless ``init_pg`` is false; returns one :class:`Outcome` per rank,
    whatever happened."""
    module, qualname, moddir = _fn_ref(fn)
    base = Path(jobdir) if jobdir is not None else Path(tempfile.mkdtemp(prefix="dcpx-dist-"))
    for attempt in range(3):
        job = base / f"job{attempt}"
        job.mkdir(parents=True, exist_ok=True)
        port = free_port()
        with open(job / "job.pkl", "wb") as f:
            pickle.dump({"module": module, "qualname": qualname, "moddir": moddir,
                         "world_size": world_size,
                         "args": args, "kwargs": kwargs, "pg_timeout": pg_timeout,
                         "init_pg": init_pg, "backend": backend}, f)
        procs = _launch(job, world_size, port, env)
        try:
            timed_out = _join(procs, time.monotonic() + timeout)
        except BaseException:  # KeyboardInterrupt: leave nothing behind
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            raise
        outs = _collect(job, procs, timed_out)
        if not (init_pg and _port_lost(outs)):
            return outs
    return outs


def raise_failures(outs: Sequence[Outcome], what: str = "") -> None:
    bad = [o for o in outs if not o.ok]
    if bad:
        # The first rank that raised is usually the cause; the others often
        # only report that a peer went away.
        bad.sort(key=lambda o: (o.error is None, o.timed_out, o.rank))
        head = f"{what}: " if what else ""
        summary = ", ".join(
            f"rank {o.rank} " + ("timed out" if o.timed_out else
                                 (o.error_type or f"exit {o.exitcode}")) for o in bad)
        seen: dict = {}
        raise ChildError(f"{head}{len(bad)} of {len(outs)} ranks failed ({summary})\n\n"
                         + "\n\n".join(o.describe(seen) for o in bad))


def spawn(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list:
    """Like :func:`spawn_outcomes`, but returns the ranks' return values and
    raises :class:`ChildError` if any rank failed."""
    outs = spawn_outcomes(fn, world_size, *args, **kwargs)
    raise_failures(outs, f"{_fn_ref(fn)[1]} on {world_size} ranks")
    return [o.value for o in outs]


# --------------------------------------------------------------------------
# many checks per spawn


@dataclasses.dataclass
class CheckContext:
    """What a check gets: its rank, the world size, a directory shared by all
    ranks (the same path on each), and a dict that lives across the checks
    of the run on this rank."""

    rank: int
    world_size: int
    workdir: Path
    state: dict

    def path(self, *parts: str) -> str:
        """A path under the shared directory (not created)."""
        return str(self.workdir.joinpath(*parts))


def _run_checks(rank: int, world_size: int, module: str, names: list, workdir: str,
                resultdir: str, barrier_timeout: float) -> None:
    import torch.distributed as dist

    mod = importlib.import_module(module)
    ctx = CheckContext(rank, world_size, Path(workdir), {})
    resdir = Path(resultdir)
    for i, name in enumerate(names):
        err = None
        try:
            getattr(mod, name)(ctx)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            err = (type(e).__name__, f"{type(e).__name__}: {e}", traceback.format_exc())
        _write_atomic(resdir / f"{name}.{rank}.pkl", err)
        # Everyone finishes check i before anyone starts check i+1; a rank
        # that is stuck in check i (or died) makes this raise on the others.
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=barrier_timeout),
                                   wait_all_ranks=True)
        except Exception as e:
            for later in names[i + 1:]:
                _write_atomic(resdir / f"{later}.{rank}.pkl",
                              ("NotRun", f"not run: the ranks lost step after {name!r}: {e}",
                               ""))
            raise


def _write_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)


class CheckSession:
    """Runs ``checks`` (functions ``check(ctx)`` defined at module level of
    one module) in order on ``world_size`` ranks, in one spawn, on first use.
    """

    def __init__(self, world_size: int, checks: Sequence[Callable], workdir: os.PathLike,
                 name: str = "", timeout: float = JOIN_TIMEOUT, env: Optional[dict] = None,
                 pg_timeout: float = PG_TIMEOUT) -> None:
        """``workdir``: the directory shared by the ranks (``ctx.workdir``);
        several sessions may share one if each has its own ``name``."""
        self.world_size = world_size
        self.names = [c.__name__ for c in checks]
        self.module = _fn_ref(checks[0])[0]
        self.workdir = Path(workdir)
        self.own = self.workdir / f"_session{'_' + name if name else ''}"
        self.resdir = self.own / "results"
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self.env = env
        self._outs: Optional[list] = None
        self.elapsed = 0.0

    def run(self) -> "CheckSession":
        if self._outs is None:
            self.resdir.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            self._outs = spawn_outcomes(_run_checks, self.world_size, self.module, self.names,
                                        str(self.workdir), str(self.resdir), self.pg_timeout,
                                        timeout=self.timeout, pg_timeout=self.pg_timeout,
                                        env=self.env, jobdir=self.own / "job")
            self.elapsed = time.monotonic() - t0
        return self

    def assert_ok(self, name: str) -> None:
        """Raise the failure of check ``name`` on any rank, with tracebacks."""
        assert name in self.names, name
        self.run()
        resdir = self.resdir
        failures, missing = [], []
        for rank in range(self.world_size):
            f = resdir / f"{name}.{rank}.pkl"
            if not f.exists():
                missing.append(rank)
                continue
            with open(f, "rb") as fh:
                err = pickle.load(fh)
            if err is not None:
                failures.append((rank, err))
        if failures:
            failures.sort(key=lambda x: (x[1][0] == "NotRun", x[0]))
            raise ChildError(
                f"check {name!r} failed on rank(s) {[r for r, _ in failures]} of "
                f"{self.world_size}:\n\n" + "\n\n".join(
                    f"rank {r}: {msg}\n--- child traceback ---\n{tb}"
                    for r, (_, msg, tb) in failures))
        if missing:
            outs = [o for o in self._outs if o.rank in missing]
            raise ChildError(
                f"check {name!r} did not finish on rank(s) {missing} of {self.world_size} "
                f"(a rank hung, crashed or timed out in it or before it):\n\n"
                + "\n\n".join(o.describe() for o in outs))


# --------------------------------------------------------------------------
# child side


def _die_with_parent() -> None:
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _child_main(jobdir: str, rank: int) -> None:
    import faulthandler

    _die_with_parent()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    job_path = Path(jobdir)
    with open(job_path / "job.pkl", "rb") as f:
        job = pickle.load(f)
    result: tuple
    if job["moddir"] and job["moddir"] not in sys.path:
        sys.path.insert(0, job["moddir"])
    try:
        mod = importlib.import_module(job["module"])
        fn = mod
        for part in job["qualname"].split("."):
            fn = getattr(fn, part)
        world_size = job["world_size"]
        if job["init_pg"]:
            import torch.distributed as dist
            dist.init_process_group(
                job["backend"], rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=job["pg_timeout"]))
        value = fn(rank, world_size, *job["args"], **job["kwargs"])
        result = ("ok", value)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("err", (type(e).__name__, f"{type(e).__name__}: {e}", traceback.format_exc()))
    try:
        _write_atomic(job_path / f"result.{rank}.pkl", result)
    except Exception:  # an unpicklable return value
        _write_atomic(job_path / f"result.{rank}.pkl",
                      ("err", ("PicklingError", "the return value does not pickle",
                               traceback.format_exc())))
    sys.stdout.flush()
    sys.stderr.flush()
    if job["init_pg"] and result[0] == "ok":
        import torch.distributed as dist
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    # Skip interpreter teardown (non-daemon upload threads of a failed save
    # would keep a failed rank alive); results are already on disk.
    os._exit(0 if result[0] == "ok" else 1)


# --------------------------------------------------------------------------
# values and checkpoints (used by the children and the parent alike)


def full_value(name: str, shape: Sequence[int], dtype: Any = None) -> Any:
    """The deterministic global value of tensor ``name``: the same on every
    rank and in the parent, random bytes (floats with NaN / inf / -0.0 in
    their first elements, see conftest.make_tensor) so that a chunk landing
    at the wrong offset, or a conversion, cannot go unnoticed."""
    import zlib

    import torch
    from conftest import make_tensor

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return make_tensor(tuple(shape), dtype or torch.float32, gen)


def dtensor_of(full: Any, mesh: Any, placements: Sequence[Any]) -> Any:
    """``full`` laid out on ``mesh``: every rank holds the same ``full``, so
    no communication is needed (and no dtype limits of gloo apply)."""
    from dtensor_api import distribute_held

    return distribute_held(full, mesh, placements)


def read_metadata(path: os.PathLike, rank: Optional[int] = None) -> Any:
    """The checkpoint's Metadata as torch's own reader unpickles it (not
    dcpx's), so the checks do not trust the code under test."""
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(path))
    return reader.read_metadata() if rank is None else reader.read_metadata(rank=rank)


def chunk_table(md: Any) -> dict:
    """{fqn: sorted [(offsets, sizes)]} for the tensor entries of Metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {fqn: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)
            for fqn, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def storage_entries(md: Any) -> list:
    """[(fqn, offsets or None, relative_path, offset, length)] of Metadata's
    storage_data."""
    return sorted(((k.fqn, None if k.offset is None else tuple(k.offset), v.relative_path,
                    v.offset, v.length) for k, v in md.storage_data.items()),
                  key=lambda e: (e[0], e[1] or (), e[2], e[3]))


def data_file_bytes(path: os.PathLike) -> dict:
    """{data file name: size} of the ``*.distcp`` files in a directory."""
    return {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path))
            if n.endswith(".distcp")}


def count_archives(path: os.PathLike) -> int:
    """How many torch.save archives (records) the data files hold, found by
    their zip end-of-central-directory records: a value written twice is
    counted twice even when the metadata references one copy."""
    n = 0
    for name in data_file_bytes(path):
        with open(os.path.join(path, name), "rb") as f:
            n += f.read().count(b"PK\x05\x06")
    return n


def record_tensor(path: os.PathLike, relative_path: str, offset: int, length: int) -> Any:
    """The tensor stored in one record, read with torch.load (not dcpx)."""
    import io

    import torch

    with open(os.path.join(path, relative_path), "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    return torch.load(io.BytesIO(raw), weights_only=True)


def chunk_of(full: Any, offsets: Sequence[int], sizes: Sequence[int]) -> Any:
    t = full
    for dim, (o, n) in enumerate(zip(offsets, sizes)):
        t = t.narrow(dim, o, n)
    return t


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--child":
    sys.path[:0] = [str(TESTS), str(REPO)]
    _child_main(sys.argv[2], int(sys.argv[3]))
