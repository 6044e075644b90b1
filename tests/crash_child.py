#!/usr/bin/env python3
"""Crash-consistency harness: SIGKILL a process while it saves a checkpoint,
then check what the checkpoint directories hold.

Used by ``tests/test_crash.py`` and runnable on its own (docs/reliability.md):

    python tests/crash_child.py --harness sync --trials 500         # dcpx, like the test
    python tests/crash_child.py --harness all --trials 900 --json out.json
    python tests/crash_child.py --compare-torch --trials 500        # torch DCP vs dcpx

How a trial runs
----------------
A *zygote* process (``--zygote``) imports torch and dcpx once, then forks one
*trial child* per trial, so a trial costs a fork, not an interpreter start.
The trial child puts itself in its own process group and saves a state dict
whose every value is a function of a *generation* number (every tensor
holds random bytes seeded by (generation, key), every non-tensor value
spells the generation), so a load can be compared bit for bit with the
exact values of one generation and any mix of two generations is caught.

The child prints markers (``M <name> <CLOCK_MONOTONIC time>``) as it passes
points of interest: the start of the save ("go"), and, through wrappers
installed in the child only, planning, the C write job, metadata encoding,
the commit's ``os.open`` / ``fsync`` / ``os.replace`` / ``os.unlink`` calls,
async staging and upload completion.  It is killed with SIGKILL, the
whole process group at once (a PROCESS save's checkpoint process included),
either

* *timed*: by the parent, after a delay drawn uniformly over the calibrated
  duration of the save (measured on an uninterrupted run of the same
  configuration, times 1.15, so a few kills land after it finished), or
* *marker*: by itself, at the k-th point, k drawn uniformly over the points
  an uninterrupted run passes.

Half of the PROCESS trials kill the trial child alone instead (a training
process killed by the OOM killer, say): its checkpoint process lives on, may
finish and commit the save it was given, and must then exit by itself.

The zygote is a child subreaper: it reaps the trial child and everything the
child started, then says "idle".  Only then does the parent look at the
directories, so no process of the trial can still be writing.

Invariants checked after every kill (``Harness.check``):

* dir A held a committed generation ``old`` and was being re-saved with
  generation ``new``: ``dcpx.load`` gives exactly ``old`` or exactly ``new``;
* dir B was fresh and being saved with ``new`` (after A): exactly ``new``,
  or ``dcpx.IncompleteCheckpointError``; nothing else, no other exception;
* order and durability: B new implies A new; a save that returned (a
  future that completed, an ``os.replace`` of A's metadata that returned)
  before the kill implies new; a kill before A's commit started implies old;
* ``python -m dcpx verify`` (its ``main()`` in-process every trial, the real
  command line on samples) exits 0 exactly for the loadable directories.

A is never reset: each trial re-saves into whatever the previous trials left
(orphaned data files of killed saves, stale temporary metadata), and the
generations only grow, so an orphan can never pass for the expected data.
At the end one uninterrupted save must leave A with exactly ``.metadata``
and the files it references.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections import Counter
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TRIAL_TIMEOUT = 180.0   # seconds for one trial (fork, save, kill, reap); a hang is a failure
START_TIMEOUT = 300.0   # the zygote imports torch (slow under ASan on a loaded machine)

# ---------------------------------------------------------------------------
# The state dict of generation g (needs torch; imported lazily so that the
# parent-side helpers import cheaply).

# (path, shape, dtype name, transposed): a few MiB-sized tensors.  The
# transposed one is saved from a non-contiguous view (the writer gathers it).
BIG = [
    (("model", "embed.weight"), (1024, 1024), "float32", False),              # 4 MiB
    (("model", "head.weight"), (768, 1024), "bfloat16", False),               # 1.5 MiB
    (("model", "pos_ids"), (163840,), "int64", False),                        # 1.25 MiB
    (("optim", "state", "embed.weight", "exp_avg_sq"), (512, 1024), "float32", True),  # 2 MiB
]
SMALL_DTYPES = ["float32", "float16", "bfloat16", "int8", "int16", "int32", "int64",
                "uint8", "float64", "complex64", "bool"]
N_LAYERS = 60           # x 5 small tensors = 300 small tensors


def _small_specs():
    specs = []
    for i in range(N_LAYERS):
        for j, name in enumerate(("w", "b", "g", "s", "m")):
            dtype = SMALL_DTYPES[(i * 5 + j) % len(SMALL_DTYPES)]
            if j == 2:
                shape = ()                                      # 0-d
            elif j == 4 and i % 29 == 0:
                shape = (0, 4)                                  # empty
            elif j == 0:
                shape = (16, 1 + (i * 37) % 257)                # up to 16 KiB
            else:
                shape = (1 + (i * 37 + j * 101) % 3000,)
            specs.append((("model", f"layers.{i}.{name}"), shape, dtype, False))
    return specs


SPECS = BIG + _small_specs()


def _seed(gen: int, key: str) -> int:
    return zlib.crc32(f"{gen}|{key}".encode()) | (gen % 100_000) << 32


def _tensor(gen: Optional[int], path, shape, dtype_name, transposed):
    """The tensor of generation ``gen`` at ``path`` (zeros when gen is None)."""
    import torch
    dtype = getattr(torch, dtype_name)
    if transposed:
        shape = tuple(reversed(shape))
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if gen is None:
        raw = torch.zeros(nbytes, dtype=torch.uint8)
    else:
        g = torch.Generator().manual_seed(_seed(gen, ".".join(path)))
        raw = torch.randint(-2**63, 2**63 - 1, (-(-nbytes // 8),), dtype=torch.int64,
                            generator=g).view(torch.uint8)[:nbytes]
        if dtype == torch.bool:
            raw &= 1
    t = raw.view(dtype).reshape(shape)
    return t.t() if transposed else t


def _put(d: dict, path, value) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def make_state(gen: Optional[int]) -> dict:
    """Generation ``gen``'s state dict; ``gen=None`` gives a load template
    (zero tensors, None for every other value)."""
    sd: dict = {}
    for path, shape, dtype, transposed in SPECS:
        _put(sd, path, _tensor(gen, path, shape, dtype, transposed))

    def v(x):
        return None if gen is None else x

    g = gen or 0
    sd["optim"]["param_groups"] = [
        {"lr": v(1e-3 * g + k), "betas": v((0.9, 0.999 - g * 1e-6)), "name": v(f"group{k}-gen{g}"),
         "params": v(tuple(range(k * 3, k * 3 + 3 + g % 5)))} for k in range(3)]
    sd["extra"] = {"step": v(g), "tag": v(f"generation-{g}"),
                   "rng": v(zlib.crc32(str(g).encode()).to_bytes(4, "little") * (8 + g % 7))}
    for i in range(30):
        sd["extra"][f"cfg.layer{i}.scale"] = v(i + g / 7)
    return sd


def leaves(obj, prefix: str = ""):
    """(dotted key, leaf) pairs of a nested state dict, dicts and lists walked."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}{k}.")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], obj


def _bits(t):
    import torch
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


class Expected:
    """The leaves of generation g, ready for bit-exact comparison (a few cached)."""

    def __init__(self) -> None:
        self._cache: dict = {}

    def __call__(self, gen: int) -> dict:
        if gen not in self._cache:
            if len(self._cache) >= 4:
                self._cache.pop(min(self._cache))
            self._cache[gen] = {k: _describe_leaf(v) for k, v in leaves(make_state(gen))}
        return self._cache[gen]


def _describe_leaf(v):
    import torch
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape), _bits(v).clone())
    return ("value", type(v), v)


def _same(got, want) -> bool:
    import torch
    if want[0] == "tensor":
        return (isinstance(got, torch.Tensor) and got.dtype == want[1]
                and tuple(got.shape) == want[2] and torch.equal(_bits(got), want[3]))
    return type(got) is want[1] and got == want[2]


def match_generation(loaded: dict, expected: Expected, candidates: dict) -> tuple:
    """(label, detail): the label of the candidate generation the loaded state
    equals exactly, or "wrong" with which keys matched what."""
    got = dict(leaves(loaded))
    for label, gen in candidates.items():
        want = expected(gen)
        if got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want):
            return label, ""
    parts = []
    for label, gen in candidates.items():
        want = expected(gen)
        ok = [k for k in want if k in got and _same(got[k], want[k])]
        bad = [k for k in want if k not in ok]
        parts.append(f"{len(ok)}/{len(want)} keys equal generation {gen} ({label}); "
                     f"first differing: {bad[:4]}")
    return "wrong", "; ".join(parts)


# ---------------------------------------------------------------------------
# Trial child (runs in a process forked by the zygote)

_real_write = os.write


def _mark(name: str, extra: str = "") -> None:
    _real_write(1, f"M {name} {time.monotonic():.6f} {extra}\n".encode())


class _Points:
    """Counts the points the save passes; kills the process group at the
    k-th one (marker mode)."""

    def __init__(self, kill_at: int) -> None:
        self.kill_at = kill_at
        self.n = 0
        self.lock = threading.Lock()

    def __call__(self, name: str) -> None:
        with self.lock:
            self.n += 1
            n = self.n
        if n == self.kill_at:
            _mark("kill", name)
            os.killpg(0, signal.SIGKILL)
            time.sleep(60)  # never reached
        _mark(name)


def _label(name: str) -> str:
    """Markers name the checkpoint directory: "A", or "B" for any B<n>."""
    return "B" if name.startswith("B") else name


def _dirname(p) -> str:
    return _label(Path(os.fsdecode(p)).parent.name)


def _wrap(owner, attr: str, before, after=None) -> None:
    real = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        before(args)
        result = real(*args, **kwargs)
        if after is not None:
            after(args)
        return result

    setattr(owner, attr, wrapper)


def _install_dcpx_points(point: _Points) -> None:
    import dcpx.api.save_load
    import dcpx.filesystem as fs

    def at(name, where=None):
        return lambda args: point(f"{name}:{where(args)}" if where else name)

    writer_dir = lambda args: _label(Path(args[0].path).name)  # noqa: E731
    _wrap(dcpx.api.save_load, "plan_local_save", at("plan", writer_dir), at("planned", writer_dir))
    job_dir = lambda args: _label(Path(args[0].writer.path).name)  # noqa: E731
    _wrap(fs.PendingWrite, "start", at("write-start", job_dir))
    _wrap(fs.PendingWrite, "wait", at("write-wait", job_dir), at("written", job_dir))
    _wrap(fs.FileSystemWriter, "encode_metadata", at("encode", writer_dir),
          at("encoded", writer_dir))
    _wrap(fs.FileSystemWriter, "commit", at("commit", writer_dir), at("committed", writer_dir))
    _wrap(fs.FileSystemWriter, "_remove_unreferenced", at("cleanup", writer_dir),
          at("cleaned", writer_dir))
    # The commit's system calls (dcpx calls them through the os module).
    _wrap(os, "open", at("open", lambda a: _label(Path(os.fsdecode(a[0])).name)
                         if os.path.isdir(a[0]) else _dirname(a[0])))  # (fsync of a directory)
    _wrap(os, "fsync", at("fsync"))
    _wrap(os, "replace", at("rename", lambda a: _dirname(a[1])),
          at("renamed", lambda a: _dirname(a[1])))
    _wrap(os, "unlink", at("unlink", lambda a: _dirname(a[0])))


def _install_torch_points(point: _Points) -> None:
    import torch.distributed.checkpoint as tdcp

    writer_dir = lambda args: _label(Path(args[0].path).name)  # noqa: E731
    at = lambda name, where=None: (lambda a: point(f"{name}:{where(a)}" if where else name))  # noqa: E731
    _wrap(tdcp.FileSystemWriter, "write_data", at("write", writer_dir), at("written", writer_dir))
    _wrap(tdcp.FileSystemWriter, "finish", at("commit", writer_dir), at("committed", writer_dir))
    _wrap(os, "fsync", at("fsync"))
    _wrap(os, "rename", at("rename", lambda a: _dirname(a[1])),
          at("renamed", lambda a: _dirname(a[1])))
    _wrap(os, "unlink", at("unlink", lambda a: _dirname(a[0])))


def _scramble(sd: dict) -> None:
    """What training does to its state once staging completed."""
    import torch
    for _, v in leaves(sd):
        if isinstance(v, torch.Tensor):
            v.zero_()
    sd["extra"]["step"] = -1
    sd["optim"]["param_groups"][0]["lr"] = -1.0


def run_trial_child(cfg: dict) -> None:
    """Save generation cfg["gen"] into cfg["A"] (re-save) and then cfg["B"]
    (fresh) with cfg["api"], printing markers; then wait to be killed."""
    import torch
    import warnings
    warnings.simplefilter("ignore")
    point = _Points(cfg.get("kill_at", 0))
    lib, api = cfg["lib"], cfg["api"]
    A, B = cfg["A"], cfg.get("B")
    sd = make_state(cfg["gen"])
    if lib == "torch":
        import torch.distributed.checkpoint as tdcp
        _install_torch_points(point)

        def save(path):  # FileSystemWriter(path) with sync_files=True is tdcp.save(sd, path)
            tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(
                path, sync_files=cfg["sync_files"], thread_count=cfg["threads"],
                single_file_per_rank=not cfg["per_item"]))
        point("go")
        save(A)
        point("saved:A")
        if B:
            save(B)
            point("saved:B")
    else:
        import dcpx
        _install_dcpx_points(point)
        if cfg.get("mutate") == "inplace":
            # Self-test of the harness: data files always get the untagged
            # names, so a re-save rewrites the committed files in place (as
            # torch's writer does).  The harness must report it.
            dcpx.FileSystemWriter._tag = lambda self: ""

        def writer(path):
            return dcpx.FileSystemWriter(path, sync_files=cfg["sync_files"],
                                         thread_count=cfg["threads"],
                                         single_file_per_rank=not cfg["per_item"])
        if api == "sync":
            point("go")
            dcpx.save(sd, storage_writer=writer(A))
            point("saved:A")
            if B:
                dcpx.save(sd, storage_writer=writer(B))
                point("saved:B")
        else:
            kind = dcpx.AsyncCheckpointerType[api.upper()]
            if kind == dcpx.AsyncCheckpointerType.PROCESS:
                # Start the checkpoint process first (it imports torch: seconds).
                dcpx.async_save({"x": torch.zeros(4)}, checkpoint_id=cfg["warm"],
                                async_checkpointer_type=kind).result(TRIAL_TIMEOUT)
            sd_b = make_state(cfg["gen"]) if B else None
            stager = dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True))
            point("go")
            # A: a user-held stager staging in the background; B: the per-call
            # stager, staging inside the call.  Both scrambled once staged.
            ra = dcpx.async_save(sd, storage_writer=writer(A), async_stager=stager,
                                 async_checkpointer_type=kind)
            ra.staging_completion.result(TRIAL_TIMEOUT)
            point("staged:A")
            _scramble(sd)
            if B:
                rb = dcpx.async_save(sd_b, storage_writer=writer(B), async_checkpointer_type=kind)
                point("staged:B")
                _scramble(sd_b)
            ra.upload_completion.result(TRIAL_TIMEOUT)
            point("saved:A")
            if B:
                rb.result(TRIAL_TIMEOUT)
                point("saved:B")
    _mark("done", str(point.n))
    while True:  # killed by the parent
        signal.pause()


# ---------------------------------------------------------------------------
# Zygote

def _prctl(option: int, arg: int) -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(option, arg, 0, 0, 0)


PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def zygote_main() -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)   # die with the parent
    _prctl(PR_SET_CHILD_SUBREAPER, 1)          # adopt orphans: reap a trial's every process
    import warnings
    warnings.simplefilter("ignore")
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import dcpx  # noqa: F401
    import dcpx.api.process  # noqa: F401
    _real_write(1, b"Z ready\n")
    stdin = os.fdopen(0, "r")
    for line in stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            return
        pid = os.fork()
        if pid == 0:  # trial child
            try:
                os.setpgid(0, 0)
                _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                run_trial_child(cmd["cfg"])
            except BaseException as e:
                traceback.print_exc()
                sys.stderr.flush()
                _real_write(1, f"E {type(e).__name__}: {e}".replace("\n", " ")[:3000].encode()
                            + b"\n")
            os._exit(3)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # the child did it first
        _real_write(1, f"Z pid {pid}\n".encode())
        while True:  # the trial child and everything it started (we are their subreaper)
            try:
                p, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            _real_write(1, f"Z exit {p} {status}\n".encode())
        _real_write(1, b"Z idle\n")


# ---------------------------------------------------------------------------
# Parent side

class HarnessError(AssertionError):
    pass


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONWARNINGS"] = "ignore"
    return env


class Trial:
    def __init__(self) -> None:
        self.markers: list = []   # (name, time)
        self.t_go: Optional[float] = None
        self.t_kill: Optional[float] = None
        self.how = ""             # "timed", "marker", "after-done"
        self.points: Optional[int] = None  # points passed, when "done" was reached
        self.status: Optional[int] = None
        self.error: Optional[str] = None

    @property
    def duration(self) -> Optional[float]:
        done = [t for n, t in self.markers if n == "done"]
        return done[0] - self.t_go if done and self.t_go is not None else None

    def seen(self, name: str) -> bool:
        """Whether what marker ``name`` stands for had happened when the child
        died.  Every marker it printed was printed before it died (some after
        the parent took t_kill, before the signal arrived: they count).  A kill
        *at* a point (marker mode) happens in the point's hook: after the
        action for the "-ed" points (AFTER_POINTS), before it for the others."""
        return any(n == name or (n == f"kill:{name}" and name.split(":")[0] in AFTER_POINTS)
                   for n, _ in self.markers)

    @property
    def phase(self) -> str:
        """How far the save had got when it was killed (see PHASES)."""
        reached = max((_PHASE_OF.get(n.removeprefix("kill:"), 0) for n, _ in self.markers),
                      default=0)
        return PHASES[reached][0]


# Markers (see _install_dcpx_points / _install_torch_points / run_trial_child)
# whose hook runs after the action they name.
AFTER_POINTS = {"planned", "written", "encoded", "committed", "cleaned", "renamed", "saved",
                "staged"}

# Coarse phases of A's save, in order, and the markers that show each was
# reached.  B's markers only count from B's planning on: in async modes B
# is staged while A uploads.  A PROCESS save's upload runs in the checkpoint
# process, which has no markers: its kills before "saved:A" count as staging.
PHASES = [
    ("before the save", []),
    ("staging / planning", ["go", "staged:A", "plan:A", "planned:A"]),
    ("writing data", ["write-start:A", "write:A", "encode:A", "encoded:A", "write-wait:A"]),
    ("commit: before rename", ["written:A", "commit:A", "open:A"]),
    ("commit: rename", ["rename:A"]),
    ("cleanup of old files", ["renamed:A", "cleanup:A", "unlink:A", "cleaned:A"]),
    ("A saved; B in progress", ["committed:A", "saved:A", "plan:B", "planned:B",
                                "write-start:B", "encode:B", "encoded:B", "write-wait:B",
                                "written:B", "commit:B", "open:B", "rename:B", "renamed:B",
                                "cleanup:B", "cleaned:B", "committed:B"]),
    ("all saved", ["saved:B", "done"]),
]
_PHASE_OF = {m: i for i, (_, ms) in enumerate(PHASES) for m in ms}


class Zygote:
    """The zygote process and the parent's end of its pipes."""

    def __init__(self, workdir: Path) -> None:
        self.errpath = Path(workdir) / "zygote.stderr"
        self.errfile = open(self.errpath, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--zygote"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errfile,
            env=child_env(), cwd=str(REPO))
        self.lines: queue.Queue = queue.Queue()
        self.broken = False
        threading.Thread(target=self._read, daemon=True).start()
        line = self._get(START_TIMEOUT)
        if line != "Z ready":
            raise HarnessError(f"zygote did not start: {line!r}; stderr: {self.stderr_tail()}")

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace").rstrip("\n"))
        self.lines.put(None)

    def _get(self, timeout: float) -> Optional[str]:
        try:
            line = self.lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return "TIMEOUT"
        if line is None:
            raise HarnessError(f"zygote died (rc {self.proc.poll()}); "
                               f"stderr: {self.stderr_tail()}")
        return line

    def _drain(self) -> None:
        """After a failed trial: read up to the zygote's "idle", so that the
        next trial starts in step (or mark the zygote unusable)."""
        end = time.monotonic() + 60
        while time.monotonic() < end:
            line = self._get(end - time.monotonic())
            if line == "Z idle":
                return
            if line == "TIMEOUT":
                break
        self.broken = True

    def stderr_tail(self, n: int = 3000) -> str:
        self.errfile.flush()
        try:
            return self.errpath.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def run(self, cfg: dict, kill_after: Optional[float] = None) -> Trial:
        """Run one trial child.  ``kill_after``: seconds after its "go" marker
        to SIGKILL its process group; None: when it is done (or when it kills
        itself, cfg["kill_at"]).  Returns once all its processes are reaped."""
        if self.broken:
            raise HarnessError("the zygote is out of step after an earlier failure")
        trial = Trial()
        self.proc.stdin.write((json.dumps({"cmd": "run", "cfg": cfg}) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + TRIAL_TIMEOUT
        pgid = None
        kill_time = None

        trainer_only = cfg.get("kill_scope") == "trainer"

        def kill(how: str) -> None:
            if trial.t_kill is None:
                trial.t_kill, trial.how = time.monotonic(), how
                try:
                    if trainer_only and how == "timed":
                        # The trial child alone: a PROCESS save's checkpoint
                        # process lives on (and may still commit).
                        trial.how = "timed, trainer only"
                        os.kill(pgid, signal.SIGKILL)
                    else:
                        os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        while True:
            now = time.monotonic()
            if kill_time is not None and trial.t_kill is None and now >= kill_time:
                kill("timed")
                continue
            wait = deadline - now
            if kill_time is not None and trial.t_kill is None:
                wait = min(wait, kill_time - now)
            line = self._get(wait)
            if line == "TIMEOUT":
                if time.monotonic() >= deadline:
                    if pgid is not None:
                        kill("timeout")
                    self._drain()
                    raise HarnessError(f"trial did not finish within {TRIAL_TIMEOUT} s "
                                       f"(markers {trial.markers[-8:]}); cfg {cfg}; "
                                       f"stderr: {self.stderr_tail()}")
                continue
            kind, _, rest = line.partition(" ")
            if kind == "Z":
                what, *args = rest.split()
                if what == "pid":
                    pgid = int(args[0])
                elif what == "exit" and pgid is not None and int(args[0]) == pgid:
                    trial.status = int(args[1])
                elif what == "idle":
                    break
            elif kind == "M":
                name, t, *extra = rest.split(" ")
                t = float(t)
                if name == "kill":  # the child killed itself at a marker
                    trial.t_kill, trial.how = t, "marker"
                    trial.markers.append((f"kill:{extra[0]}", t))
                    continue
                trial.markers.append((name, t))
                if name == "go":
                    trial.t_go = t
                    if kill_after is not None:
                        kill_time = t + kill_after
                elif name == "done":
                    trial.points = int(extra[0])
                    kill("after-done")
            elif kind == "E":
                trial.error = rest
                if pgid is not None:
                    kill("error")
        if trial.error is not None:
            raise HarnessError(f"trial child failed: {trial.error}; cfg {cfg}; "
                               f"stderr: {self.stderr_tail()}")
        if trial.status is None or not (os.WIFSIGNALED(trial.status)
                                        and os.WTERMSIG(trial.status) == signal.SIGKILL):
            raise HarnessError(f"trial child was not killed by SIGKILL (status "
                               f"{trial.status}); cfg {cfg}; stderr: {self.stderr_tail()}")
        return trial

    def close(self) -> None:
        try:
            self.proc.stdin.write(b'{"cmd": "exit"}\n')
            self.proc.stdin.flush()
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.errfile.close()


# -- checking directories ----------------------------------------------------

def load_outcome(path, expected: Expected, candidates: dict, loader: str = "dcpx") -> tuple:
    """(label, detail) of loading ``path`` with dcpx or torch: a candidate
    label, "incomplete" (dcpx.IncompleteCheckpointError), "wrong" (loaded
    data equal to no candidate), or "raised" (any other exception)."""
    import warnings
    import dcpx
    dest = make_state(None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if loader == "dcpx":
                dcpx.load(dest, checkpoint_id=path)
            else:  # torch prints the traceback of a failed load to stderr: keep it quiet
                import logging
                import torch.distributed.checkpoint as tdcp
                logging.disable(logging.CRITICAL)
                try:
                    with contextlib.redirect_stderr(io.StringIO()):
                        tdcp.load(dest, checkpoint_id=path)
                finally:
                    logging.disable(logging.NOTSET)
    except dcpx.IncompleteCheckpointError as e:
        return "incomplete", str(e)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        return "raised", f"{type(e).__name__}: {e}"
    return match_generation(dest, expected, candidates)


def verify_inprocess(path) -> int:
    """``python -m dcpx verify path``'s exit status, via its main()."""
    import dcpx.__main__ as cli
    out = io.StringIO()
    # verify_checkpoint's ``out=sys.stdout`` default is bound at import time,
    # so redirect_stdout alone does not silence it.
    defaults = cli.verify_checkpoint.__defaults__
    cli.verify_checkpoint.__defaults__ = (out,)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return cli.main(["verify", str(path)])
    finally:
        cli.verify_checkpoint.__defaults__ = defaults


def verify_cli(path) -> int:
    return subprocess.run([sys.executable, "-m", "dcpx", "verify", str(path)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env=child_env(), timeout=START_TIMEOUT).returncode


def referenced(path) -> set:
    import dcpx
    md = dcpx.FileSystemReader(path).read_metadata()
    return {info.relative_path for info in md.storage_data.values()}


# -- the dcpx harness ----------------------------------------------------------

# (dir, outcome) pairs checked once per harness with the real command line
CLI_KEYS = {("A", "old"), ("A", "new"), ("B", "new"), ("B", "incomplete")}

# Writer configurations, with weights: (sync_files, thread_count, file per item)
CONFIGS = [((False, 1, False), 3), ((False, 2, False), 3), ((False, 2, True), 1),
           ((True, 1, False), 2)]
# PROCESS trials cost a checkpoint process start each (seconds): fewer
# configurations, so fewer calibration runs.
PROCESS_CONFIGS = [((False, 2, False), 2), ((True, 1, False), 1)]


class Harness:
    """Kill-and-check trials of dcpx saves with one API ("sync", "thread",
    "process"), re-saving into one directory A all along."""

    def __init__(self, zygote: Zygote, root: Path, api: str, seed: int,
                 cli_keys=CLI_KEYS, marker_share: float = 0.35,
                 mutate: Optional[str] = None) -> None:
        import dcpx
        self.z, self.root, self.api = zygote, Path(root), api
        self.rng = random.Random(f"{seed}-{api}")
        self.seed = seed
        self.expected = Expected()
        self.marker_share = 0.0 if api == "process" else marker_share
        self.cli_todo = set(cli_keys)   # (dir, outcome) pairs to check once with the CLI
        self.mutate = mutate            # see run_trial_child
        self.A = self.root / "A"
        self.gen_A = 1                    # the generation committed in A
        self.next_gen = 2
        dcpx.save(make_state(1), storage_writer=dcpx.FileSystemWriter(self.A, sync_files=False))
        self.calibration: dict = {}       # config -> (duration, points)
        self.durations: dict = {}         # config -> [(duration, points)] of complete runs
        self.n = 0
        self.counts: Counter = Counter()
        self.phases: Counter = Counter()
        self.failures: list = []
        self.started = time.monotonic()

    def _cfg(self, config, gen: int, B: Path, kill_at: int = 0) -> dict:
        sync_files, threads, per_item = config
        return dict(lib="dcpx", api=self.api, gen=gen, A=str(self.A), B=str(B),
                    warm=str(self.root / "warm"), sync_files=sync_files, threads=threads,
                    per_item=per_item, kill_at=kill_at, mutate=self.mutate)

    def _calibrated(self, config) -> tuple:
        if config not in self.calibration:
            if self.calibration and self.api == "process":
                # A PROCESS calibration run costs a checkpoint process start:
                # start from another configuration's figures (its duration is
                # mostly staging and the pipe); completed runs refine them.
                d = max(d for d, _ in self.calibration.values())
                p = max(p for _, p in self.calibration.values())
                self.calibration[config] = (d, p)
                self.durations[config] = [(d, p)]
            else:
                # An uninterrupted run (killed once it is done): also a trial.
                self.calibration[config] = (None, None)
                trial = self.trial(config, calibrate=True)
                self.calibration[config] = (trial.duration, trial.points)
                self.durations[config] = [(trial.duration, trial.points)]
        return self.calibration[config]

    def run(self, trials: int) -> None:
        configs = PROCESS_CONFIGS if self.api == "process" else CONFIGS
        weights = [w for _, w in configs]
        for _ in range(trials):
            config = self.rng.choices([c for c, _ in configs], weights)[0]
            self.trial(config)

    def trial(self, config, calibrate: bool = False) -> Trial:
        gen = self.next_gen
        self.next_gen += 1
        B = self.root / f"B{self.n}"
        kill_after, kill_at = None, 0
        if not calibrate:
            duration, points = self._calibrated(config)
            if self.rng.random() < self.marker_share:
                kill_at = self.rng.randint(1, points)
            else:
                kill_after = self.rng.uniform(0, 1.15 * duration)
        cfg = self._cfg(config, gen, B, kill_at)
        if self.api == "process" and kill_after is not None and self.rng.random() < 0.5:
            cfg["kill_scope"] = "trainer"
        trial = self.z.run(cfg, kill_after)
        self.n += 1
        if calibrate:
            self.counts["calibration"] += 1
        self.check(trial, cfg, config)
        if trial.duration is not None and not calibrate:
            # A run that completed: keep the window and the number of points
            # up to date (medians over the complete runs: how many unlinks a
            # cleanup does depends on what earlier kills left behind).
            self.durations[config].append((trial.duration, trial.points))
            ds = sorted(d for d, _ in self.durations[config])
            ps = sorted(p for _, p in self.durations[config])
            self.calibration[config] = (ds[len(ds) // 2], ps[len(ps) // 2])
        shutil.rmtree(B, ignore_errors=True)
        return trial

    def check(self, trial: Trial, cfg: dict, config) -> None:
        old, new = self.gen_A, cfg["gen"]
        B = Path(cfg["B"])
        a, a_detail = load_outcome(self.A, self.expected, {"old": old, "new": new})
        b, b_detail = load_outcome(B, self.expected, {"new": new})
        problems = []
        if a not in ("old", "new"):
            problems.append(f"A (re-save of generation {old} with {new}): {a}: "
                            f"{a_detail[:1000]}")
        if b not in ("new", "incomplete"):
            problems.append(f"B (fresh save of generation {new}): {b}: {b_detail[:1000]}")
        if b == "new" and a != "new":
            problems.append(f"B was committed but A was not (A: {a})")
        # Durability / ordering, from what the child passed before the kill.
        if a == "old" and (trial.seen("saved:A") or trial.seen("renamed:A")):
            problems.append("A's save returned (or its metadata rename did) before the "
                            "kill, yet A holds the old generation")
        if b != "new" and trial.seen("saved:B"):
            problems.append("B's save returned before the kill, yet B is not loadable")
        if self.api != "process":  # (a PROCESS save commits in the checkpoint process)
            for name, outcome in (("A", a), ("B", b)):
                if outcome == "new" and not trial.seen(f"rename:{name}"):
                    problems.append(f"{name} holds the new generation though its metadata "
                                    f"was never renamed into place")
        # python -m dcpx verify agrees (exit 0 exactly for the loadable ones).
        for name, path, outcome in (("A", self.A, a), ("B", B, b)):
            loadable = outcome in ("old", "new")
            rc = verify_inprocess(path)
            if (rc == 0) != loadable or (outcome == "incomplete" and rc != 2):
                problems.append(f"dcpx verify {name} exits {rc} but load gave {outcome}")
            if (name, outcome) in self.cli_todo and path.exists():
                self.cli_todo.discard((name, outcome))
                cli = verify_cli(path)
                if cli != rc:
                    problems.append(f"`python -m dcpx verify {name}` exits {cli}, main() {rc}")
        self.counts[f"A:{a}"] += 1
        self.counts[f"B:{b}"] += 1
        self.counts[f"kill:{trial.how}"] += 1
        self.phases[trial.phase] += 1
        if problems:
            self.failures.append(
                f"trial {self.n - 1} (api {self.api}, seed {self.seed}, config "
                f"sync_files/threads/per_item={config}, kill {trial.how} at phase "
                f"{trial.phase!r}, last markers {[n for n, _ in trial.markers][-6:]}): "
                + " | ".join(problems))
        if a == "new":
            self.gen_A = new

    def finish(self) -> None:
        """One uninterrupted save: A must end with exactly its .metadata and
        the data files it references (orphans of killed saves collected)."""
        config = (False, 1, False)
        gen = self.next_gen
        self.next_gen += 1
        B = self.root / "Bfinal"
        trial = self.z.run(self._cfg(config, gen, B))
        if trial.how != "after-done":
            self.failures.append(f"final save did not finish: {trial.how}")
            return
        a, detail = load_outcome(self.A, self.expected, {"new": gen})
        if a != "new":
            self.failures.append(f"final save: A is {a}: {detail}")
            return
        left = set(os.listdir(self.A))
        want = {".metadata"} | referenced(self.A)
        if left != want:
            self.failures.append(f"after a complete re-save A holds {sorted(left - want)} "
                                 f"besides its checkpoint (missing: {sorted(want - left)})")
        shutil.rmtree(B, ignore_errors=True)

    def summary(self) -> dict:
        c = self.counts
        return {
            "api": self.api, "seed": self.seed, "trials": self.n,
            "seconds": round(time.monotonic() - self.started, 1),
            "kills": {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("kill:")},
            "A (re-save)": {k[2:]: v for k, v in c.items() if k.startswith("A:")},
            "B (fresh dir)": {k[2:]: v for k, v in c.items() if k.startswith("B:")},
            "phases": {name: self.phases[name] for name, _ in PHASES if self.phases[name]},
            "failures": len(self.failures),
        }


def format_summary(s: dict) -> str:
    return (f"dcpx crash harness [{s['api']}] seed {s['seed']}: {s['trials']} trials in "
            f"{s['seconds']} s; kills {s['kills']}; A (re-save) {s['A (re-save)']}; "
            f"B (fresh) {s['B (fresh dir)']}; phases {s['phases']}; failures {s['failures']}")


def run_harness(api: str, trials: int, seed: int, root: Optional[Path] = None,
                zygote: Optional[Zygote] = None, cli_keys=CLI_KEYS) -> tuple:
    """Returns (summary, failures)."""
    own_root = root is None
    root = Path(tempfile.mkdtemp(prefix=f"dcpx-crash-{api}-")) if own_root else Path(root)
    z = zygote or Zygote(root)
    try:
        h = Harness(z, root / api, api, seed, cli_keys=cli_keys)
        h.run(trials)
        h.finish()
        return h.summary(), h.failures
    finally:
        if zygote is None:
            z.close()
        if own_root:
            shutil.rmtree(root, ignore_errors=True)


# -- torch DCP vs dcpx: the same kills, recorded, not asserted ---------------------

def _exception_kind(detail: str) -> str:
    """"CorruptCheckpointError", or for torch's CheckpointException (which
    wraps a traceback) "CheckpointException(RuntimeError)"."""
    head = detail.split(":", 1)[0]
    if "Traceback" in detail:
        lines = [ln for ln in detail.splitlines() if ln.strip()]
        inner = lines[-1].strip().split(":", 1)[0] if lines else "?"
        return f"{head}({inner.rsplit('.', 1)[-1]})"
    return head


def _exception_message(detail: str) -> str:
    if "Traceback" in detail:
        lines = [ln for ln in detail.splitlines() if ln.strip()]
        detail = f"{detail.split(':', 1)[0]} <- {lines[-1].strip()}"
    return " ".join(detail.split())[:300]


def run_compare(lib: str, trials: int, seed: int, sync_files: bool, root: Path,
                zygote: Zygote, kill: str = "timed", threads: int = 1,
                per_item: bool = False, keep: Optional[str] = None) -> dict:
    """Re-save generation 2 over a pristine committed generation 1 (written by
    the same library and writer settings) and SIGKILL the saver, at a
    uniformly random time over the re-save ("timed") or at a uniformly
    random one of the points it passes ("marker"); then load with both
    loaders.  Records; asserts nothing.  ``keep``: a directory to copy the
    checkpoints the two loaders judge differently into."""
    import warnings
    expected = Expected()
    rng = random.Random(f"{seed}-compare-{lib}-{kill}")
    base = root / f"{lib}-{kill}-{threads}-{int(per_item)}-{int(sync_files)}"
    pristine, A = base / "pristine", base / "A"   # markers name "A"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if lib == "torch":
            import torch.distributed.checkpoint as tdcp
            tdcp.save(make_state(1), storage_writer=tdcp.FileSystemWriter(
                pristine, sync_files=sync_files, thread_count=threads,
                single_file_per_rank=not per_item))
        else:
            import dcpx
            dcpx.save(make_state(1), storage_writer=dcpx.FileSystemWriter(
                pristine, sync_files=sync_files, thread_count=threads,
                single_file_per_rank=not per_item))
    cfg = dict(lib=lib, api="sync", gen=2, A=str(A), B=None, sync_files=sync_files,
               threads=threads, per_item=per_item, kill_at=0)

    def fresh_copy():
        shutil.rmtree(A, ignore_errors=True)
        shutil.copytree(pristine, A)

    calibration = []
    for _ in range(2):  # uninterrupted re-saves
        fresh_copy()
        calibration.append(zygote.run(cfg))
    window = 1.15 * max(t.duration for t in calibration)
    points = max(t.points for t in calibration)
    other_lib = "dcpx" if lib == "torch" else "torch"
    tallies = {lib: Counter(), other_lib: Counter()}
    when = Counter()
    examples: dict = {}
    disagreements: list = []   # trials the two loaders judged differently
    started = time.monotonic()
    for i in range(trials):
        fresh_copy()
        if kill == "marker":
            trial = zygote.run(dict(cfg, kill_at=rng.randint(1, points)))
        else:
            trial = zygote.run(cfg, rng.uniform(0, window))
        when["after the metadata rename" if trial.seen("renamed:A")
             else "before the metadata rename"] += 1
        labels = {}
        for loader, tally in tallies.items():
            label, detail = load_outcome(A, expected, {"old": 1, "new": 2}, loader)
            if label == "raised" and re.search(r"No such file or directory: '[^']*/\.metadata'",
                                               detail):
                label = "incomplete"  # torch's way of saying there is no .metadata
            if label == "raised":
                label = f"raised {_exception_kind(detail)}"
            tally[label] += 1
            labels[loader] = (label, detail)
            if label not in ("old", "new", "incomplete"):
                examples.setdefault(f"{loader} load: {label}", _exception_message(detail))
        verdicts = {label if label in ("old", "new", "wrong", "incomplete") else "raised"
                    for label, _ in labels.values()}
        if len(verdicts) > 1 and keep:
            shutil.copytree(A, Path(keep) / f"{base.name}-trial{i}")
        if len(verdicts) > 1 and len(disagreements) < 5:  # (both raising is agreement)
            disagreements.append({loader: f"{label}: {_exception_message(detail)}"
                                  for loader, (label, detail) in labels.items()}
                                 | {"phase": [n for n, _ in trial.markers][-4:],
                                    "files": sorted((f, os.path.getsize(A / f))
                                                    for f in os.listdir(A))})
    own = tallies[lib]
    return {"writer": lib, "kill": kill, "trials": trials, "seed": seed,
            "sync_files": sync_files, "thread_count": threads,
            "single_file_per_rank": not per_item,
            "window_s": round(window, 3), "points": points,
            "seconds": round(time.monotonic() - started, 1),
            "kill landed": dict(when),
            f"loaded with {lib}": dict(own), f"loaded with {other_lib}": dict(tallies[other_lib]),
            "not loadable as old or new": sum(v for k, v in own.items()
                                              if k not in ("old", "new")),
            "wrong data": own.get("wrong", 0),
            "examples": examples, "loaders disagree": disagreements}


def _print_compare(r: dict) -> None:
    other = "dcpx" if r["writer"] == "torch" else "torch"
    how = (f"uniform over {r['window_s']} s" if r["kill"] == "timed"
           else f"at one of {r['points']} points")
    n = max(1, r["trials"])
    print(f"\n== writer {r['writer']} (sync_files={r['sync_files']}, thread_count="
          f"{r['thread_count']}, single_file_per_rank={r['single_file_per_rank']}): "
          f"{r['trials']} kills {how}, seed {r['seed']}, {r['seconds']} s")
    print(f"   kill landed: {r['kill landed']}")
    print(f"   loaded with {r['writer']}: {r['loaded with ' + r['writer']]}")
    print(f"   loaded with {other}: {r['loaded with ' + other]}")
    bad, wrong = r["not loadable as old or new"], r["wrong data"]
    print(f"   previous checkpoint lost (raises, refused, or wrong data): {bad} of "
          f"{r['trials']} ({100 * bad / n:.1f} %); silently wrong data: {wrong} "
          f"({100 * wrong / n:.1f} %)")
    for k, v in r["examples"].items():
        print(f"   e.g. {k}: {v}")
    for d in r["loaders disagree"]:
        print(f"   loaders disagree: {d}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    mode.add_argument("--harness", choices=["sync", "thread", "process", "all"],
                      help="dcpx kill-and-check trials (what tests/test_crash.py runs)")
    mode.add_argument("--compare-torch", action="store_true",
                      help="the same kills against torch DCP's writer and dcpx's; records "
                           "outcomes, asserts nothing")
    p.add_argument("--trials", type=int, default=100,
                   help="trials (per API for --harness all, per library for --compare-torch)")
    p.add_argument("--seed", type=int, default=int(os.environ.get("DCPX_CRASH_SEED", "1")))
    p.add_argument("--sync-files", type=int, default=1, choices=[0, 1],
                   help="--compare-torch: the writers' sync_files (default 1: torch's default)")
    p.add_argument("--libs", default="torch,dcpx", help="--compare-torch: writers to run")
    p.add_argument("--kill", default="timed", choices=["timed", "marker"],
                   help="--compare-torch: kill at a uniform time (default) or at a "
                        "uniformly chosen point of the save")
    p.add_argument("--threads", type=int, default=1,
                   help="--compare-torch: the writers' thread_count (default 1, torch's)")
    p.add_argument("--per-item", action="store_true",
                   help="--compare-torch: single_file_per_rank=False (a file per item)")
    p.add_argument("--keep-disagreements", metavar="DIR",
                   help="--compare-torch: copy checkpoints the two loaders judge differently "
                        "into DIR")
    p.add_argument("--json", help="also write the results as JSON to this file")
    args = p.parse_args(argv)
    if str(REPO) not in sys.path:  # run as a script: dcpx from this checkout
        sys.path.insert(0, str(REPO))
    if args.zygote:
        zygote_main()
        return 0
    root = Path(tempfile.mkdtemp(prefix="dcpx-crash-"))
    results, failed = [], False
    z = Zygote(root)
    try:
        if args.harness:
            apis = ["sync", "thread", "process"] if args.harness == "all" else [args.harness]
            for api in apis:
                s, failures = run_harness(api, args.trials, args.seed, root, z)
                print(format_summary(s), flush=True)
                for f in failures:
                    print("FAIL", f)
                failed |= bool(failures)
                s["failure_messages"] = failures
                results.append(s)
        else:
            for lib in args.libs.split(","):
                r = run_compare(lib, args.trials, args.seed, bool(args.sync_files), root, z,
                                args.kill, args.threads, args.per_item, args.keep_disagreements)
                _print_compare(r)
                results.append(r)
    finally:
        z.close()
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv,
                "cpus": os.cpu_count(), "python": sys.version.split()[0]}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1,
                                              default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
