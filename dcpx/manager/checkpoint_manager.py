"""dcpx.CheckpointManager: step folders, retention, resume from the newest
intact step, preemption.  Built on dcpx's public save / async_save / load
and on what dcpx knows about a checkpoint: a step is *committed* when its
``.metadata`` exists (written last, atomically: docs/reliability.md), and
*intact* when every record's CRC-32 checks.

Layout (torchtitan's, so either tool resumes the other's runs)::

    root/step-100/.metadata, __0_0.distcp, ...
    root/step-200/...

docs/manager.md has the API, the retention rules, what is guaranteed when
the process is killed, and the preemption recipes (SLURM, Kubernetes).
"""
from __future__ import annotations

import errno
import io
import os
import signal
import stat
import sys
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence, Union

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..api.save_load import load as _load, save as _save
from ..api.async_save import AsyncCheckpointerType, async_save as _async_save
from ..api.save_load import check_not_bootstrapping, wrap_state_dict
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    own_failure,
)
from .tiers import LocalTier
from ..filesystem import (  # noqa: F401  (DELETING_PREFIX, STEP_RE: the manager's names too)
    remove_renamed,
    DELETING_PREFIX,
    STEP_RE,
    DEAD,
    LIVE,
    LOCAL_PROTOCOLS,
    METADATA_FN,
    NO_LOCKS,
    UNKNOWN,
    FileSystemReader,
    info_mtime,
    local_path,
    local_step,
    save_lock_state,
    step_dir,
    url_protocol,
)

__all__ = ["CheckpointManager", "StepSkippedWarning"]

_METADATA = METADATA_FN
_MODES = {"sync": None, "async": AsyncCheckpointerType.THREAD,
          "process": AsyncCheckpointerType.PROCESS}


#: the reader keyword arguments ``load_options`` may hold
_LOAD_OPTIONS = ("allow_pickle", "thread_count", "verify")


def _check_load_options(options: Optional[dict]) -> dict:
    options = dict(options or {})
    unknown = sorted(set(options) - set(_LOAD_OPTIONS))
    if unknown:
        raise ValueError(f"dcpx.CheckpointManager: load_options takes {list(_LOAD_OPTIONS)} "
                         f"(FileSystemReader's keyword arguments), got {unknown}")
    return options


def _is_unsafe(e: BaseException) -> Optional[UnsafeCheckpointError]:
    """The UnsafeCheckpointError in ``e`` (itself, its cause, or one of a
    torch CheckpointException's failures), or None."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, UnsafeCheckpointError):
            return e
        for f in (getattr(e, "failures", None) or {}).values():
            inner = f[0] if isinstance(f, tuple) else f
            if isinstance(inner, UnsafeCheckpointError):
                return inner
        e, seen = e.__cause__, seen + 1
    return None


def _fault(e: BaseException) -> str:
    """Whose fault a failed load is: ``"step"`` (a corrupt record, a
    missing or unreadable file: an older step may load), ``"remote"``
    (another rank failed: dcpx raises a plain CheckpointError on the
    others) or ``"user"`` (the state dict: a key the checkpoint lacks, a
    shape that differs; or a value the safe loader refuses, in every
    step)."""
    if _is_unsafe(e):
        return "user"
    if isinstance(e, (CorruptCheckpointError, OSError)):
        return "step"
    if type(e) is CheckpointError:
        return "remote"
    return "user"


def _unsafe(e: UnsafeCheckpointError) -> UnsafeCheckpointError:
    """The refusal, with the manager's way to allow it; raised at once: the
    safe loader refuses a value of every step that holds it, and a refusal
    is not damage (older steps are not tried)."""
    out = UnsafeCheckpointError(
        f"dcpx.CheckpointManager: {e} With the manager, pass load_options={{'allow_pickle': "
        f"True}} (trusted checkpoints only), or register the type with "
        f"torch.serialization.add_safe_globals before the load.")
    out.global_name = getattr(e, "global_name", None)
    out.__cause__ = e
    return out


#: the user metadata of a step (``save(..., metadata=)``), in its folder
USER_METADATA_FN = "user_metadata.json"
_MAX_USER_METADATA = 64 << 20


def _user_metadata_bytes(metadata: Optional[dict]) -> Optional[bytes]:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise TypeError(f"dcpx.CheckpointManager.save: metadata must be a dict, got "
                        f"{type(metadata).__name__}")
    import json
    try:
        data = json.dumps(metadata, sort_keys=True, allow_nan=True).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"dcpx.CheckpointManager.save: metadata must be JSON-serializable "
                        f"(it is stored as {USER_METADATA_FN}): {e}") from None
    if len(data) > _MAX_USER_METADATA:  # step_metadata() would call it corrupt
        raise ValueError(f"dcpx.CheckpointManager.save: metadata is {len(data)} bytes as JSON; "
                         f"{USER_METADATA_FN} holds at most {_MAX_USER_METADATA} (save large "
                         f"data in the state dict instead); nothing was saved")
    return data


def _check_best(k: Optional[int], metric: Optional[str], mode: str) -> tuple:
    if (k is None) != (metric is None):
        raise ValueError("dcpx.CheckpointManager: keep_best_k and best_metric go together "
                         f"(got keep_best_k={k!r}, best_metric={metric!r})")
    if k is not None and int(k) < 1:
        raise ValueError(f"dcpx.CheckpointManager: keep_best_k must be at least 1, got {k!r}")
    if mode not in ("min", "max"):
        raise ValueError(f"dcpx.CheckpointManager: best_mode must be 'min' or 'max', got {mode!r}")
    return (None if k is None else int(k)), metric, mode


class StepSkippedWarning(UserWarning):
    """``CheckpointManager.load`` passed over a step: the message names it
    and says why (not committed, corrupt, a file missing...)."""


def _verify_checkpoint():
    """The CLI's ``verify`` (every record's CRC-32, every value), shared:
    the manager's full check is exactly what ``dcpx verify`` reports."""
    from ..cli.verify import verify_checkpoint
    return verify_checkpoint


def _not_a_step(manager: Any, name: str) -> None:
    """Say once per manager and name that ``name`` (named like a step, not a
    folder) is ignored."""
    seen = manager.__dict__.setdefault("_ignored_entries", set())
    if name in seen:
        return
    seen.add(name)
    warnings.warn(f"dcpx.CheckpointManager: {os.path.join(str(manager.root), name)} is named "
                  f"like a step but is not a folder (a file, a FIFO, a broken link or a "
                  f"link loop): ignored (not listed, loaded or deleted)", RuntimeWarning,
                  stacklevel=3)


# ------------------------------------------------------------------ storage

class _LocalRoot:
    """A root on the local file system: a step is deleted by renaming it to
    a ``.deleting-`` name first (atomic: it stops being a step at once),
    then removing the tree."""

    def __init__(self, root: Union[str, os.PathLike], reader_options: Optional[dict] = None) -> None:
        self.path = local_path(root)
        self.reader_options = dict(reader_options or {})

    def __str__(self) -> str:
        return str(self.path)

    def checkpoint_id(self, name: str) -> str:
        return str(self.path / name)

    def names(self) -> list[str]:
        try:
            return os.listdir(self.path)
        except FileNotFoundError:
            return []

    def exists(self) -> bool:
        return os.path.isdir(self.path)

    def committed(self, name: str) -> bool:
        return os.path.isfile(self.path / name / _METADATA)

    def is_step(self, name: str) -> bool:
        return local_step(self.path, name) is not None

    def newest_mtime(self, name: str) -> Optional[float]:
        """The newest modification time of the folder and the files in it
        (a save in progress touches them), None if it is gone."""
        d = self.path / name
        try:
            times = [d.stat().st_mtime]
            for entry in os.scandir(d):
                try:
                    times.append(entry.stat(follow_symlinks=False).st_mtime)
                except FileNotFoundError:
                    pass
            return max(times)
        except FileNotFoundError:
            return None

    def save_state(self, name: str) -> str:
        """Whether a dcpx save is writing into the folder, from its save
        lock files (``dcpx.save_lock_state``)."""
        return save_lock_state(self.path / name)

    def unhide(self, hidden: str, name: str) -> bool:
        """Undo :meth:`hide` (a save started in the folder meanwhile)."""
        try:
            os.rename(self.path / hidden, self.path / name)
        except OSError:
            return False
        return True

    def hide(self, name: str) -> Optional[str]:
        """Step 1 of a deletion: rename; returns the new name (None if the
        step is already gone)."""
        hidden = f"{DELETING_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path / name, self.path / hidden)
        except FileNotFoundError:
            return None
        return hidden

    def remove(self, hidden: str) -> None:
        remove_renamed(self.path / hidden)  # a step that was a link: the link alone goes

    def reader(self, name: str):
        return FileSystemReader(self.path / name, **self.reader_options)

    def write_file(self, name: str, fname: str, data: bytes) -> None:
        """Write ``name/fname`` atomically (a temporary file, then rename)."""
        d = self.path / name
        os.makedirs(d, exist_ok=True)
        tmp = d / f".{fname}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, d / fname)

    def remove_file(self, name: str, fname: str) -> None:
        """Remove ``name/fname`` if it is there."""
        try:
            os.unlink(self.path / name / fname)
        except FileNotFoundError:
            pass

    def read_file(self, name: str, fname: str) -> Optional[bytes]:
        """The file's bytes; None if absent.  A link or another non-regular
        file is refused, as inside a checkpoint (docs/reliability.md)."""
        path = self.path / name / fname
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CorruptCheckpointError(f"dcpx.CheckpointManager: {path}: cannot open it "
                                         f"(a link?): {e}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_USER_METADATA:
                raise CorruptCheckpointError(
                    f"dcpx.CheckpointManager: {path}: not a regular file of at most "
                    f"{_MAX_USER_METADATA} bytes")
            return f.read()


class _FsspecRoot:
    """A root on an fsspec store (``s3://``, ``memory://``...): no atomic
    rename of a folder there, so a step is deleted ``.metadata`` first (it
    stops being committed at once), then the rest."""

    def __init__(self, root: str, options: dict, reader_options: Optional[dict] = None) -> None:
        from ..fsspec import url_to_fs
        self.url = root.rstrip("/")
        self.options = options
        self.reader_options = dict(reader_options or {})
        self.fs, path = url_to_fs(root, options)
        self.root = path.rstrip("/") or path

    def __str__(self) -> str:
        return self.url

    def checkpoint_id(self, name: str) -> str:
        return f"{self.url}/{name}"

    def names(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def exists(self) -> bool:
        """The root holds something (an object store has no empty folders)."""
        return bool(self.names()) or self.fs.isdir(self.root)

    def committed(self, name: str) -> bool:
        return self.fs.isfile(f"{self.root}/{name}/{_METADATA}")

    def save_state(self, name: str) -> str:
        """No lock files on a store: nothing tells a live save from a dead one."""
        return NO_LOCKS

    def newest_mtime(self, name: str) -> Optional[float]:
        newest = None
        try:
            infos = self.fs.ls(f"{self.root}/{name}", detail=True)
        except FileNotFoundError:
            return None
        for info in infos:
            t = info_mtime(info)
            if t is not None:
                newest = max(newest or 0.0, t)
        return newest  # None: unknown, and such a step is never deleted

    def hide(self, name: str) -> Optional[str]:
        try:
            self.fs.rm(f"{self.root}/{name}/{_METADATA}")
        except FileNotFoundError:
            pass
        return name

    def remove(self, hidden: str) -> None:
        try:
            self.fs.rm(f"{self.root}/{hidden}", recursive=True)
        except FileNotFoundError:
            pass

    def reader(self, name: str):
        from ..fsspec import FsspecReader
        return FsspecReader(self.checkpoint_id(name), **self.reader_options, **self.options)

    def writer(self, name: str):
        from ..fsspec import FsspecWriter
        return FsspecWriter(self.checkpoint_id(name), **self.options)

    def write_file(self, name: str, fname: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self.root}/{name}/{fname}", data)

    def remove_file(self, name: str, fname: str) -> None:
        try:
            self.fs.rm_file(f"{self.root}/{name}/{fname}")
        except FileNotFoundError:
            pass

    def read_file(self, name: str, fname: str) -> Optional[bytes]:
        try:
            return self.fs.cat_file(f"{self.root}/{name}/{fname}")
        except FileNotFoundError:
            return None


# ------------------------------------------------------------------ manager

class CheckpointManager:
    """Saves ``root/step-{N}`` checkpoints every ``save_interval_steps``
    steps, keeps the newest ``keep_latest_k`` (and every step that is a
    multiple of ``keep_every_n_steps``), and resumes from the newest
    committed and intact step.

    ``async_mode``: ``"async"`` (dcpx.async_save, upload on a thread),
    ``"process"`` (async_save with a checkpoint process) or ``"sync"``
    (dcpx.save).  ``verify``: ``"commit"`` (default: the step's
    ``.metadata`` exists and parses with its checksum; the load itself
    checks the CRC-32 of every record it reads and falls back past a
    corrupt one) or ``"full"`` (also every record and value of the step, as
    ``dcpx verify``, before the state dict is touched; local roots).
    ``incomplete_grace_s``: where a step's save locks cannot tell whether
    a save is still writing into it (a URL root, a file system without
    flock, an uncommitted step without lock files: docs/manager.md), an
    uncommitted step older than the newest committed one is taken for an
    interrupted save and deleted by retention once untouched for this
    long (and a committed one holding save locks flock cannot check, once
    untouched for this long).  ``storage_options``: fsspec options for a
    URL root.  ``async_stager``: passed to every async_save
    (a ``DefaultStager`` you keep reuses its staging buffers).
    ``preemption``: install the preemption handler at once
    (:meth:`install_preemption_handler`).  ``load_options``: keyword
    arguments of the reader every load and check uses
    (``{"allow_pickle": True}`` for a trusted checkpoint holding values
    outside the safe-load list; ``thread_count``, ``verify``).
    ``keep_best_k``, ``best_metric``, ``best_mode``: retention also keeps
    the ``keep_best_k`` steps whose user metadata (``save(...,
    metadata=)``) has the best ``best_metric`` (``"min"`` or ``"max"``).

    ``local_root`` (docs/tiers.md): every save goes to this node-local
    folder first (``/dev/shm/job``, a local NVMe), each rank's piece is
    copied to ``replicas`` ranks of other nodes, and every
    ``persist_interval_steps`` steps (and on preemption) the step is
    written from the local tier to ``root`` as an ordinary DCP checkpoint;
    the local tier keeps ``keep_local_k`` steps, ``root`` is kept by the
    rules above.  ``node``: this rank's failure domain (default: host name
    and local_root); ``tier_timeout_s``: how long any message of the tier
    waits for a peer before a CheckpointError names it (default 300 s,
    docs/tiers.md "Failures").  :meth:`load` resumes from the newest step
    of this job's line that the pieces and replicas can assemble, or from
    ``root``.
    """

    def __init__(
        self,
        root: Union[str, os.PathLike],
        *,
        keep_latest_k: Optional[int] = None,
        keep_every_n_steps: Optional[int] = None,
        save_interval_steps: int = 1,
        async_mode: str = "async",
        process_group: Any = None,
        verify: str = "commit",
        incomplete_grace_s: float = 3600.0,
        storage_options: Optional[dict] = None,
        async_stager: Any = None,
        preemption: bool = False,
        preemption_signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1),
        preemption_deadline_s: Optional[float] = None,
        load_options: Optional[dict] = None,
        keep_best_k: Optional[int] = None,
        best_metric: Optional[str] = None,
        best_mode: str = "min",
        local_root: Union[str, os.PathLike, None] = None,
        replicas: int = 0,
        persist_interval_steps: Optional[int] = None,
        keep_local_k: int = 2,
        node: Optional[str] = None,
        tier_timeout_s: float = 300.0,
    ) -> None:
        check_not_bootstrapping("CheckpointManager")  # the main script run again by spawn
        if keep_latest_k is not None and int(keep_latest_k) < 1:
            raise ValueError(f"dcpx.CheckpointManager: keep_latest_k must be None (keep every "
                             f"step) or at least 1, got {keep_latest_k!r}")
        if keep_every_n_steps is not None and int(keep_every_n_steps) < 1:
            raise ValueError(f"dcpx.CheckpointManager: keep_every_n_steps must be None or at "
                             f"least 1, got {keep_every_n_steps!r}")
        if int(save_interval_steps) < 1:
            raise ValueError(f"dcpx.CheckpointManager: save_interval_steps must be at least 1, "
                             f"got {save_interval_steps!r}")
        if async_mode not in _MODES:
            raise ValueError(f"dcpx.CheckpointManager: async_mode must be one of "
                             f"{sorted(_MODES)}, got {async_mode!r}")
        if verify not in ("commit", "full"):
            raise ValueError(f"dcpx.CheckpointManager: verify must be 'commit' or 'full', "
                             f"got {verify!r}")
        self.load_options = _check_load_options(load_options)
        self.keep_best_k, self.best_metric, self.best_mode = _check_best(
            keep_best_k, best_metric, best_mode)
        proto = url_protocol(root)
        if proto is None or proto in LOCAL_PROTOCOLS:
            self._root: Any = _LocalRoot(root, self.load_options)
        else:
            self._root = _FsspecRoot(os.fsdecode(os.fspath(root)), dict(storage_options or {}),
                                     self.load_options)
            if verify == "full":
                raise ValueError(f"dcpx.CheckpointManager: verify='full' checks local "
                                 f"checkpoints only; {root!r} is a {proto}:// URL (the default "
                                 f"check still CRC-checks every record the load reads)")
        self.root = str(self._root)
        self.keep_latest_k = keep_latest_k
        self.keep_every_n_steps = keep_every_n_steps
        self.save_interval_steps = int(save_interval_steps)
        self.async_mode = async_mode
        self.process_group = process_group
        self.verify = verify
        self.incomplete_grace_s = float(incomplete_grace_s)
        self.async_stager = async_stager
        self._lock = threading.Lock()
        self._writing: set[int] = set()      # steps this process is saving
        self._pending: Optional[Future] = None  # the upload in flight
        self._pending_done = threading.Event()
        self._last_saved: Optional[int] = None
        self._retention = ThreadPoolExecutor(1, thread_name_prefix="dcpx-retention")
        self._retention_jobs: list[Future] = []
        self._closed = False
        self._preempted_signal: Optional[int] = None
        self._preempted_at: Optional[float] = None
        self._agreed_preempted = False
        self._handler_installed = False
        self._old_handlers: dict[int, Any] = {}
        self._watchdog: Optional[threading.Thread] = None
        self._watchdog_stop = threading.Event()
        self._tiers: Optional[LocalTier] = None
        if local_root is not None:
            self._tiers = LocalTier(self, local_root, replicas, persist_interval_steps,
                                    keep_local_k, node, tier_timeout_s)
        elif replicas or persist_interval_steps is not None:
            raise ValueError("dcpx.CheckpointManager: replicas and persist_interval_steps "
                             "need a local_root (the node-local tier)")
        if preemption:
            self.install_preemption_handler(preemption_signals, preemption_deadline_s)

    # -------------------------------------------------------------- steps
    def _dist(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _is_deleter(self) -> bool:
        """With a process group, only its rank 0 deletes."""
        if not self._dist():
            return True
        return dist.get_rank(self.process_group) == 0

    def _scan(self) -> tuple[list[int], list[int]]:
        """(committed steps, uncommitted steps), ascending."""
        committed, other = [], []
        for name in self._root.names():
            m = STEP_RE.match(name)
            if m is None:
                continue
            if not getattr(self._root, "is_step", lambda n: True)(name):
                _not_a_step(self, name)
                continue
            (committed if self._root.committed(name) else other).append(int(m.group(1)))
        return sorted(committed), sorted(other)

    def all_steps(self) -> list[int]:
        """Every committed step, ascending (a step without ``.metadata`` is
        being written or was interrupted; a step being deleted is renamed
        or has lost its ``.metadata`` first: neither is listed)."""
        return self._scan()[0]

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None.  Committed is not yet intact:
        :meth:`load` checks and falls back."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # --------------------------------------------------------------- save
    def save(self, step: int, state_dict: dict, force: bool = False,
             metadata: Optional[dict] = None, persist: Optional[bool] = None) -> Any:
        """Save ``state_dict`` as ``root/step-{step}`` if ``step`` is a
        multiple of ``save_interval_steps`` (or ``force``, or preempted).

        Returns what ``dcpx.async_save`` returns (a Future, or an
        AsyncSaveResponse whose staging the caller awaits before changing
        its tensors), the Metadata for ``async_mode="sync"``, or None when
        the interval skips the step.  The previous save is waited for
        first (its failure is raised here).  After preemption the save is
        waited for before returning: the caller may exit at once.

        ``metadata``: a JSON-serializable dict saved with the step
        (``user_metadata.json`` in its folder, written before the step
        commits), read back with :meth:`step_metadata` without loading any
        tensor; its ``best_metric`` value ranks the step for
        ``keep_best_k``.  A step saved again without ``metadata`` has none
        (the earlier save's file is removed).

        With a ``local_root``: the save goes to the local tier;
        ``persist`` (default: every ``persist_interval_steps`` steps, and
        after preemption) also writes it to ``root``, in the background."""
        meta_bytes = _user_metadata_bytes(metadata)
        step = int(step)
        if step < 0:
            raise ValueError(f"dcpx.CheckpointManager.save: step must be >= 0, got {step}")
        if self._closed:
            raise RuntimeError("dcpx.CheckpointManager.save: the manager is closed")
        preempted = self._sync_preempted()
        if not (force or preempted or step % self.save_interval_steps == 0):
            return None
        if self._tiers is not None:
            return self._save_tiered(step, state_dict, preempted, persist, meta_bytes)
        self.wait()
        if preempted and self._last_saved == step:
            return None  # the final checkpoint is the one just saved
        name = step_dir(step)
        state_dict, _ = wrap_state_dict(state_dict, "dcpx.CheckpointManager.save")
        with self._lock:
            self._writing.add(step)
        kw: dict[str, Any] = {"process_group": self.process_group}
        mode = _MODES[self.async_mode]
        try:
            if isinstance(self._root, _FsspecRoot):
                kw["storage_writer"] = self._root.writer(name)
            else:
                kw["checkpoint_id"] = self._root.checkpoint_id(name)
                # The step folder is made here, by every rank, before the save: a
                # multi-rank save then never depends on which rank creates it.
                os.makedirs(kw["checkpoint_id"], exist_ok=True)
            if self._is_deleter():  # before the step commits
                if meta_bytes is not None:
                    self._root.write_file(name, USER_METADATA_FN, meta_bytes)
                else:  # a step saved again: not the metadata of its earlier save
                    self._root.remove_file(name, USER_METADATA_FN)
            if mode is None:
                result = _save(state_dict, **kw)
                self._saved(step, None)
                return result
            result = _async_save(state_dict, async_checkpointer_type=mode,
                                 async_stager=self.async_stager, **kw)
        except BaseException:
            with self._lock:
                self._writing.discard(step)
            raise
        upload = getattr(result, "upload_completion", result)
        done = threading.Event()
        self._pending, self._pending_done = upload, done
        upload.add_done_callback(lambda f, step=step, done=done: self._saved(step, f, done))
        if preempted:
            self.wait()
        return result

    def _save_tiered(self, step: int, state_dict: dict, preempted: bool,
                     persist: Optional[bool], meta_bytes: Optional[bytes]) -> Any:
        tiers = self._tiers
        assert tiers is not None
        if preempted and self._last_saved == step:
            return None  # the final checkpoint is the one just persisted
        if persist is None:
            interval = tiers.persist_interval
            persist = preempted or (interval is not None and step % interval == 0)
        persist = bool(persist or preempted)
        state_dict, _ = wrap_state_dict(state_dict, "dcpx.CheckpointManager.save")
        if persist:
            with self._lock:
                self._writing.add(step)
        try:
            result = tiers.save(step, state_dict, _MODES[self.async_mode], self.async_stager,
                                persist, meta_bytes if self._is_deleter() else None)
        except BaseException:
            with self._lock:
                self._writing.discard(step)
            raise
        if preempted:
            self.wait()
        return result

    def local_steps(self) -> list[int]:
        """The steps this node's local tier holds a committed piece of
        (of this rank or a partner's), ascending; [] without a local_root.
        Which of them a resume can assemble is decided by :meth:`load`."""
        if self._tiers is None:
            return []
        return sorted({s for s, _, _, _ in self._tiers.scan()})

    def space_needed(self, piece_bytes: Optional[int] = None) -> dict:
        """The bytes each tier needs (docs/tiers.md, "Space") for pieces of
        ``piece_bytes`` per rank (default: the last piece this rank saved):
        ``local_per_node``, ``local_per_step_per_node``,
        ``persistent_per_step_at_most``.  Needs a ``local_root``."""
        if self._tiers is None:
            raise ValueError("dcpx.CheckpointManager.space_needed: no local_root (one tier: "
                             "a step needs what one save writes)")
        if piece_bytes is None:
            piece_bytes = self._tiers.last_piece_bytes
            if piece_bytes is None:
                raise ValueError("dcpx.CheckpointManager.space_needed: nothing saved yet; "
                                 "pass piece_bytes")
        return self._tiers.space_needed(int(piece_bytes))

    @property
    def tier_timings(self) -> dict:
        """Per step saved with a ``local_root``: seconds from the save()
        call until it returned (``blocked_s``; ``waited_s`` of it waiting for
        the previous step's local save), until the local piece committed
        (``local_s``), until every rank's piece was stored on its partners
        (``replicated_s``) and until the step committed under ``root``
        (``persisted_s``); and what happened to it (``local``,
        ``replication``, ``persistence``: "done", "skipped: ..." or
        "failed: ...", alike on every rank; ``sent_bytes``,
        ``reused_bytes``: this rank's replica bytes sent, and left out
        because the partner held them).  docs/tiers.md."""
        return {} if self._tiers is None else self._tiers.timings

    @property
    def last_resume(self) -> Optional[dict]:
        """How the last :meth:`load` with a ``local_root`` resumed:
        ``{"step", "tier"}``, tier ``"local"`` (every rank from its own
        node), ``"replica"`` (some rank fetched its piece from a partner)
        or ``"persistent"`` (from ``root``)."""
        return None if self._tiers is None else self._tiers.last_resume

    def _saved(self, step: int, fut: Optional[Future],
               done: Optional[threading.Event] = None) -> None:
        """A save ended (on the upload thread for async saves): forget it as
        in flight and, if it committed, queue a retention pass."""
        try:
            self._after_save(step, fut)
        finally:
            if done is not None:
                done.set()

    def _after_save(self, step: int, fut: Optional[Future]) -> None:
        with self._lock:
            self._writing.discard(step)
        if fut is not None and (fut.cancelled() or fut.exception() is not None):
            return
        self._last_saved = step
        if (self.keep_latest_k is not None and self._is_deleter()
                and not self._retention_closed()):
            try:
                job = self._retention.submit(self._retention_pass)
            except RuntimeError:  # shut down meanwhile
                return
            self._retention_jobs = [j for j in self._retention_jobs if not j.done()] + [job]

    def _retention_closed(self) -> bool:
        return getattr(self._retention, "_shutdown", False)

    def wait(self) -> None:
        """Wait for the save in flight to commit; raise its error if it failed.
        With a ``local_root``: its replication and persistence too."""
        if self._tiers is not None:
            self._tiers.wait_persisted()
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            finally:  # result() may return before the done-callback ran
                self._pending_done.wait()

    def wait_for_retention(self) -> None:
        """Wait for the queued retention passes (deletions) to finish."""
        for job in list(self._retention_jobs):
            job.result()

    def close(self) -> None:
        """Wait for the save in flight and for retention; remove the
        preemption handler.  The manager saves nothing after this."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._tiers is not None:
                self._tiers.close()
            self._retention.shutdown(wait=True)
            self.uninstall_preemption_handler()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the loop's own exception goes on; a failed save must not replace it
            self.close()
        except Exception as e:
            warnings.warn(f"dcpx.CheckpointManager: closing after {exc_type.__name__}: the save "
                          f"in flight failed too: {e}", RuntimeWarning)

    # ---------------------------------------------------------- retention
    def steps_to_delete(self) -> list[int]:
        """What a retention pass deletes now (see docs/manager.md)."""
        committed, uncommitted = self._scan()
        if not committed or self.keep_latest_k is None:
            return []
        keep = set(committed[-self.keep_latest_k:])
        keep.add(committed[-1])  # never the newest committed step
        # Nor the step this manager committed last: after a resume from an
        # older step (the newer ones corrupt, or a rollback), higher step
        # numbers from the earlier run would otherwise push it out, and the
        # retention pass right after its commit would delete the one step
        # known to be intact.
        if self._last_saved is not None and self._last_saved in committed:
            keep.add(self._last_saved)
        if self.keep_every_n_steps:
            keep.update(s for s in committed if s % self.keep_every_n_steps == 0)
        if self.keep_best_k:
            keep.update(self.best_steps(committed))
        with self._lock:
            keep |= self._writing
        now = time.time()

        def untouched(s: int) -> bool:
            mtime = self._root.newest_mtime(step_dir(s))
            return mtime is not None and now - mtime > self.incomplete_grace_s

        doomed = []
        for s in committed:
            if s in keep:
                continue
            state = self._root.save_state(step_dir(s))
            if state == LIVE:  # a save into it again, in progress
                continue
            if state == UNKNOWN and not untouched(s):  # no flock: cannot tell
                continue
            doomed.append(s)
        for s in uncommitted:  # interrupted saves, once surely not in progress
            if s in keep or s > committed[-1]:
                continue
            state = self._root.save_state(step_dir(s))
            if state == DEAD or (state != LIVE and untouched(s)):
                doomed.append(s)
        return sorted(doomed)

    def _retention_pass(self) -> list[int]:
        """A retention pass whose failure (a folder that cannot be renamed...)
        is a warning: it never fails a save, a wait or a load."""
        try:
            return self._apply_retention()
        except Exception as e:
            warnings.warn(f"dcpx.CheckpointManager: retention under {self.root} failed: "
                          f"{type(e).__name__}: {e}", RuntimeWarning)
            return []

    def _apply_retention(self) -> list[int]:
        """One retention pass (on the retention thread); returns the steps
        deleted.  Deletes nothing unless the newest committed step's
        metadata reads back (so the only intact step is never deleted)."""
        for name in self._root.names():  # deletions a kill interrupted
            if name.startswith(DELETING_PREFIX):
                self._root.remove(name)
        doomed = self.steps_to_delete()
        if not doomed:
            return []
        newest = self.latest_step()
        err = self._read_back_error(newest)
        if err is not None:
            # The step this manager committed last is kept too: if it reads
            # back, the pass leaves an intact step (else retention stopped
            # for good after a resume past a step whose .metadata is bad).
            last = self._last_saved
            if last is None or last == newest or self._read_back_error(last) is not None:
                warnings.warn(f"dcpx.CheckpointManager: retention deletes nothing: the newest "
                              f"committed step {newest} does not read back ({err})",
                              StepSkippedWarning)
                return []
        deleted = []
        for s in doomed:
            with self._lock:  # a save of this step cannot start meanwhile
                if s in self._writing:
                    continue
                hidden = self._root.hide(step_dir(s))
            if hidden is None:
                continue
            # A save that took its lock between the check and the rename:
            # give the folder back (else that save fails: its folder is gone).
            if (self._root.save_state(hidden) == LIVE
                    and self._root.unhide(hidden, step_dir(s))):
                continue
            self._root.remove(hidden)
            deleted.append(s)
        return deleted

    def _read_back_error(self, step: int) -> Optional[Exception]:
        """Why the step's metadata does not read back; None if it does."""
        try:
            self._root.reader(step_dir(step)).read_metadata()
        except Exception as e:
            return e
        return None

    # --------------------------------------------------------------- load
    def _check(self, step: int) -> Any:
        """None if the step passes the check, else why not (a string), or
        ``("unsafe", message)`` when the safe loader refused a value: the
        caller raises that on every rank (not damage: no older step)."""
        name = step_dir(step)
        try:
            self._root.reader(name).read_metadata()
        except UnsafeCheckpointError as e:
            return ("unsafe", str(_unsafe(e)))
        except Exception as e:
            return f"its .metadata does not read: {e}"
        if self.verify == "full":
            out = io.StringIO()
            found: list = []
            try:
                problems = _verify_checkpoint()(
                    self._root.checkpoint_id(name), out=out, errors=found,
                    allow_pickle=bool(self.load_options.get("allow_pickle")))
            except Exception as e:
                return f"the full check failed: {e}"
            refused = [e for _, e in found if isinstance(e, UnsafeCheckpointError)]
            if refused:  # not damage: the safe loader refused a value (raised, not skipped)
                return ("unsafe", str(_unsafe(refused[0])))
            if problems:
                lines = [ln.strip() for ln in out.getvalue().splitlines() if "BAD" in ln]
                return f"the full check found {problems} problem(s): " + "; ".join(lines[:3])
        return None

    def _candidates(self, step: Optional[int]) -> tuple[list[int], list[str]]:
        """(steps to try, newest first; why newer steps were skipped)."""
        committed, uncommitted = self._scan()
        if step is not None:
            return [int(step)], []
        notes = [f"{step_dir(s)}: not committed (no .metadata: the save was interrupted "
                 f"or is still in progress)"
                 for s in reversed(uncommitted) if not committed or s > committed[-1]]
        return list(reversed(committed)), notes

    def _agree(self, value: Any) -> Any:
        """Rank 0's value on every rank (no process group: the value)."""
        if not self._dist():
            return value
        box = [value]
        pg = self.process_group
        src = 0 if pg is None else dist.get_global_rank(pg, 0)
        dist.broadcast_object_list(box, src=src, group=pg)
        return box[0]

    def _all_gather(self, value: Any) -> list:
        if not self._dist():
            return [value]
        out = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(out, value, group=self.process_group)
        return out

    def _try_load(self, state_dict: dict, step: int) -> Optional[str]:
        """Load one step: None if it loaded (on every rank), else why the
        step is at fault.  An error of the state dict itself is raised."""
        kw: dict[str, Any] = {"process_group": self.process_group}
        if isinstance(self._root, _FsspecRoot) or self.load_options:
            kw["storage_reader"] = self._root.reader(step_dir(step))
        else:
            kw["checkpoint_id"] = self._root.checkpoint_id(step_dir(step))
        err: Optional[BaseException] = None
        kind = "ok"
        try:
            _load(state_dict, **kw)
        except (Exception, CheckpointException) as e:  # torch's is a BaseException
            if not isinstance(e, Exception):
                e = own_failure(e, dist.get_rank(self.process_group) if self._dist() else 0,
                                kw.get("checkpoint_id") or step_dir(step))
                if not isinstance(e, Exception):
                    raise
            err = e
            kind = _fault(e)
            if _is_unsafe(e):
                err = _unsafe(_is_unsafe(e))
        outcomes = self._all_gather((kind, None if err is None else str(err)))
        if all(k == "ok" for k, _ in outcomes):
            return None
        if any(k == "user" for k, _ in outcomes) or not any(k == "step" for k, _ in outcomes):
            if err is not None:
                raise err
            raise CheckpointError(f"dcpx.CheckpointManager: loading {step_dir(step)} failed on "
                                  f"another rank: " + "; ".join(m for _, m in outcomes if m))
        return "its load failed: " + next(m for k, m in outcomes if k == "step")

    def load(self, state_dict: dict, step: Optional[int] = None, *,
             root: Union[str, os.PathLike, None] = None,
             exclude: Sequence[str] = ()) -> Optional[int]:
        """Load the newest committed and intact step into ``state_dict`` in
        place (as dcpx.load) and return its number; or load ``step``.

        A step that fails the check, or whose load finds a corrupt record or
        a missing file, is passed over with a :class:`StepSkippedWarning`
        naming it and why, and the next older one is tried.  Returns None
        when the root has no committed step (a fresh run); raises
        ``CheckpointError`` listing every step and why when none loads.
        Errors of the state dict itself (a key the checkpoint lacks, a shape
        that differs) are raised at once.

        ``root``: load from another root (a pretrained run's, say) with this
        manager's checks and load options; this manager's steps are not
        touched.  ``exclude``: top-level keys of ``state_dict`` not to load
        (e.g. ``("optim",)`` to take only the weights); they are left as
        they are.  To load the model alone, pass a state dict holding only
        it: a checkpoint's other top-level entries are never asked for."""
        if root is not None or exclude:
            return self._load_other(state_dict, step, root, exclude)
        if self._tiers is None:
            return self._load_root(state_dict, step)
        target, wrapped = wrap_state_dict(state_dict, "dcpx.CheckpointManager.load")
        self.wait()
        self.wait_for_retention()

        def warn(msg: str) -> None:
            warnings.warn(f"dcpx.CheckpointManager.load: skipped {msg}", StepSkippedWarning,
                          stacklevel=4)

        got = self._tiers.resume(target, step, self.load_options, _fault, warn)
        if got is not None:
            for k in state_dict.keys() - wrapped:  # values dcpx.load replaced
                state_dict[k] = target[k]
            return got
        got = self._load_root(state_dict, step)
        self._tiers.resumed_from_persistent(got)
        return got

    def _load_root(self, state_dict: dict, step: Optional[int]) -> Optional[int]:
        """load() from ``root`` (see there)."""
        target, wrapped = wrap_state_dict(state_dict, "dcpx.CheckpointManager.load")
        self.wait()
        self.wait_for_retention()  # no step of ours is deleted under the load
        plan = self._candidates(step) if self._is_deleter() else None
        candidates, notes = self._agree(plan)
        for note in notes:
            warnings.warn(f"dcpx.CheckpointManager.load: skipped {note}", StepSkippedWarning,
                          stacklevel=3)
        if not candidates:
            return None
        failures = []
        for s in candidates:
            why = self._check(s) if self._is_deleter() else None  # rank 0 decides
            why = self._agree(why)
            if isinstance(why, tuple):  # ("unsafe", message): the same on every rank
                raise UnsafeCheckpointError(why[1])
            if why is None:
                why = self._try_load(target, s)
                if why is None:
                    for k in state_dict.keys() - wrapped:  # values dcpx.load replaced
                        state_dict[k] = target[k]
                    return s
            failures.append(f"{step_dir(s)}: {why}")
            if step is None:
                warnings.warn(f"dcpx.CheckpointManager.load: skipped {failures[-1]}"
                              f"{'' if s == candidates[-1] else '; trying an older step'}",
                              StepSkippedWarning, stacklevel=3)
        raise CheckpointError(f"dcpx.CheckpointManager: no step under {self.root} loads: "
                              + "; ".join(failures))

    # ------------------------------------- metadata, best steps, export, delete
    def step_metadata(self, step: int) -> dict:
        """The user metadata saved with ``step`` (``save(..., metadata=)``),
        without loading any tensor; ``{}`` if it was saved without."""
        data = self._root.read_file(step_dir(step), USER_METADATA_FN)
        if data is None:
            return {}
        import json
        try:
            out = json.loads(data)
        except ValueError as e:
            raise CorruptCheckpointError(
                f"dcpx.CheckpointManager: {self._root.checkpoint_id(step_dir(step))}/"
                f"{USER_METADATA_FN}: not JSON: {e}") from None
        if not isinstance(out, dict):
            raise CorruptCheckpointError(
                f"dcpx.CheckpointManager: {self._root.checkpoint_id(step_dir(step))}/"
                f"{USER_METADATA_FN}: not a JSON object")
        return out

    def _metric(self, step: int) -> Union[int, float, None]:
        try:
            v = self.step_metadata(step).get(self.best_metric)
        except Exception:  # unreadable: not ranked (the other retention rules apply)
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            return None
        # As it is: an int past float's range (10**400) ranks exactly
        # (Python compares ints and floats exactly); float() of it raised
        # OverflowError, and every retention pass failed from then on.
        return v

    def best_steps(self, steps: Optional[Sequence[int]] = None) -> list[int]:
        """The ``keep_best_k`` committed steps (of ``steps``, if given) with
        the best ``best_metric`` in their metadata, best first (ties: the
        newer step first).  Steps without a numeric value are not ranked."""
        if not self.keep_best_k:
            return []
        ranked = []
        for s in (self.all_steps() if steps is None else steps):
            v = self._metric(s)
            if v is not None:
                ranked.append((v if self.best_mode == "min" else -v, -s))
        return [-neg for _, neg in sorted(ranked)[:self.keep_best_k]]

    def _load_other(self, state_dict: dict, step: Optional[int], root: Any,
                    exclude: Sequence[str]) -> Optional[int]:
        """load() from another root and/or without some top-level keys."""
        if isinstance(exclude, str):
            exclude = (exclude,)
        missing = [k for k in exclude if k not in state_dict]
        if missing:
            raise KeyError(f"dcpx.CheckpointManager.load: exclude names {missing}, which the "
                           f"state dict does not hold (its keys: {sorted(state_dict)})")
        part = {k: v for k, v in state_dict.items() if k not in exclude}
        if root is None:
            got = self.load(part, step)
        else:
            opts = self._root.options if isinstance(self._root, _FsspecRoot) else None
            other = CheckpointManager(root, async_mode="sync", process_group=self.process_group,
                                      verify=self.verify, storage_options=opts,
                                      load_options=self.load_options)
            try:
                other._check_source(step)
                got = other.load(part, step)
            finally:
                other.close()
        for k, v in part.items():  # values dcpx.load replaced
            state_dict[k] = v
        return got

    def _check_source(self, step: Optional[int]) -> None:
        """A root named by ``load(root=...)`` must exist and, without
        ``step``, hold a committed step: loading from it is asked for, so an
        empty or mistyped root is an error, not a fresh run (torchtitan's
        ``initial_load_path`` likewise).  IncompleteCheckpointError (a
        FileNotFoundError) saying which."""
        if not self._root.exists():
            raise IncompleteCheckpointError(
                errno.ENOENT, f"dcpx.CheckpointManager.load: root={self.root!r} does not exist "
                              f"(mistyped?); nothing was loaded", self.root)
        if step is None:
            committed, uncommitted = self._scan()
            if not committed:
                also = (f" ({len(uncommitted)} uncommitted: interrupted or still being "
                        f"written)" if uncommitted else "")
                raise IncompleteCheckpointError(
                    errno.ENOENT, f"dcpx.CheckpointManager.load: root={self.root!r} holds no "
                                  f"committed step{also}; nothing was loaded", self.root)

    def export(self, dest: Union[str, os.PathLike], step: Optional[int] = None, *,
               prefix: str = "model", max_shard_size: Optional[str] = None,
               overwrite: bool = False) -> Optional[str]:
        """Write the tensors under ``prefix`` (the state dict's ``"model"``
        entry) of a committed step (the newest by default) as safetensors,
        keys without the prefix: the model's own state dict, for inference
        or the Hugging Face hub.  ``dest`` ending in ``.safetensors``: one
        file; else a directory holding ``model.safetensors``, or with
        ``max_shard_size`` (``"5GB"``) the shards and
        ``model.safetensors.index.json`` as Hugging Face names them.  Reads
        the step in bounded memory (``dcpx convert``).  With a process group
        rank 0 writes (the others return None); local roots only.  Returns
        what was written."""
        if isinstance(self._root, _FsspecRoot):
            raise ValueError(f"dcpx.CheckpointManager.export: reads local roots only; "
                             f"{self.root} is a URL (dcpx convert it after a download)")
        self.wait()
        if not self._is_deleter():
            return None
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"dcpx.CheckpointManager.export: no committed step "
                                      f"under {self.root}")
        elif not self._root.committed(step_dir(step)):
            raise CheckpointError(f"dcpx.CheckpointManager.export: {step_dir(step)} under "
                                  f"{self.root} is not a committed step")
        from ..cli.convert import convert
        out = os.fspath(dest)
        if not out.endswith(".safetensors") and max_shard_size is None:
            os.makedirs(out, exist_ok=True)
            out = os.path.join(out, "model.safetensors")
        pre = prefix.rstrip(".") + "."
        convert(self._root.checkpoint_id(step_dir(step)), out, to="safetensors",
                max_shard_size=max_shard_size, overwrite=overwrite, only=[pre],
                strip_prefix=pre, out=io.StringIO())
        return out

    def delete(self, step: int) -> bool:
        """Delete ``step`` (committed or not) now, as retention deletes: it
        stops being a step at once (renamed, or its ``.metadata`` removed
        first on a URL root), then its files go.  Refused (RuntimeError) for
        a step this process is saving or a dcpx save of any process is
        writing into.  False if there is no such step.  With a process
        group, call it on rank 0 (elsewhere it does nothing)."""
        step = int(step)
        if not self._is_deleter():
            return False
        name = step_dir(step)
        self.wait_for_retention()
        if name not in self._root.names():
            return False
        with self._lock:
            if step in self._writing:
                raise RuntimeError(f"dcpx.CheckpointManager.delete: {name} is being saved")
            if self._root.save_state(name) == LIVE:
                raise RuntimeError(f"dcpx.CheckpointManager.delete: a save is writing into "
                                   f"{self._root.checkpoint_id(name)}")
            hidden = self._root.hide(name)
        if hidden is None:
            return False
        if self._root.save_state(hidden) == LIVE and self._root.unhide(hidden, name):
            raise RuntimeError(f"dcpx.CheckpointManager.delete: a save started writing into "
                               f"{self._root.checkpoint_id(name)}; not deleted")
        self._root.remove(hidden)
        if self._last_saved == step:
            self._last_saved = None
        return True

    # --------------------------------------------------------- preemption
    @property
    def preempted(self) -> bool:
        """True once a preemption signal arrived, as of the last :meth:`save`
        call: a signal that comes after a save() call is seen at the next
        one, which writes the final checkpoint, so ``save(); if
        ckpt.preempted: break`` never leaves without it.  With a process
        group: once the signal arrived on any rank (the same on every rank,
        so that every rank writes the same final step and leaves the loop
        at the same step)."""
        return self._agreed_preempted

    def _sync_preempted(self) -> bool:
        """Take the signal into account (with a process group and the
        handler installed, agree on it: one all_reduce of one number per
        save() call)."""
        if self._agreed_preempted:
            return True
        if not (self._dist() and self._handler_installed):
            self._agreed_preempted = self._preempted_signal is not None
            return self._agreed_preempted
        import torch
        backend = str(dist.get_backend(self.process_group))
        device = "cuda" if ("nccl" in backend and "gloo" not in backend) else "cpu"
        flag = torch.tensor([int(self._preempted_signal or 0)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        if int(flag.item()):
            self._agreed_preempted = True
            if self._preempted_signal is None:
                self._preempted_signal = int(flag.item())
        return self._agreed_preempted

    @property
    def preemption_signal(self) -> Optional[int]:
        """The signal received (at once, before any save() call), or None."""
        return self._preempted_signal

    def _on_signal(self, signum: int, frame: Any) -> None:
        # A signal handler only records: the save runs on the training
        # thread (save() when preempted), never inside the handler.
        if self._preempted_signal is None:
            self._preempted_at = time.monotonic()
            self._preempted_signal = signum

    def install_preemption_handler(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1),
                                   deadline_s: Optional[float] = None) -> None:
        """On any of ``signals``, set :attr:`preempted` (nothing else in the
        handler).  The training loop calls :meth:`save` as usual: once
        preempted, the next call finishes the save in flight, saves that
        step even off the interval and waits for its commit; the loop then
        sees ``manager.preempted`` and exits.  With ``deadline_s``, a
        watchdog thread ends the process (exit status 128 + the signal) if
        the manager is not closed that many seconds after the signal: a
        save not committed by then leaves no ``.metadata``, and the previous
        step stays the newest.  Must be called from the main thread."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("dcpx.CheckpointManager: signal handlers can be installed "
                               "from the main thread only")
        self._handler_installed = True
        for sig in signals:
            if sig not in self._old_handlers:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        if deadline_s is not None and self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, args=(float(deadline_s),),
                                              name="dcpx-preemption-watchdog", daemon=True)
            self._watchdog.start()

    def uninstall_preemption_handler(self) -> None:
        """Restore the handlers that were there before."""
        self._watchdog_stop.set()
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)
            self._old_handlers.clear()

    def _watch(self, deadline_s: float) -> None:
        while not self._watchdog_stop.wait(0.1):
            at = self._preempted_at
            if at is not None and time.monotonic() - at > deadline_s:
                sig = self._preempted_signal or signal.SIGTERM
                msg = (f"dcpx.CheckpointManager: the final checkpoint did not commit within "
                       f"{deadline_s:g} s of signal {signal.Signals(sig).name}; exiting "
                       f"(step {self.latest_step()} is the newest committed)\n")
                try:
                    sys.stderr.write(msg)
                    sys.stderr.flush()
                finally:
                    os._exit(128 + int(sig))
