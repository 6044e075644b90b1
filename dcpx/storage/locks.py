"""Saves into one checkpoint directory: turns within a process, file locks
across processes (docs/reliability.md, "Concurrent saves into one directory").

Within a process every save into a directory takes a *turn* when it is
called (``dcpx.save``) or submitted (``dcpx.async_save``), and touches the
directory only once every earlier save into it has finished (committed or
failed): a plain ``save`` after an ``async_save`` into the same directory
waits for that upload.

Across processes (and hosts, where the file system keeps ``flock`` coherent)
two lock files in the directory protect what a live save may still use:

* ``.dcpx.<tag>.lock``: a save's own lock, held shared by the process that
  commits it (the coordinator of a multi-rank save) from before any of its
  data files (``__<rank>_<tag>_<i>.distcp``) exists until its commit or
  failure.  A commit's cleanup removes another save's data files only when it
  can take this lock exclusively (its owner is gone) or the lock file no
  longer exists.
* ``.dcpx.lock``: held exclusively from writing the temporary metadata to the
  end of the cleanup, so that commits (rename + cleanup) never interleave.

Both files are removed by their holder when it is done; one left by a killed
process is harmless (torch and dcpx read only ``.metadata`` and the files it
names) and is removed by the next commit's cleanup.  flock locks die with
the process, so a crash never leaves a directory locked.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import threading
import uuid
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

DIR_LOCK = ".dcpx.lock"


def save_lock_name(tag: str) -> str:
    return f".dcpx.{tag}.lock"


# ------------------------------------------------------------ in-process turns

class Ticket:
    """One save's place in its directory's queue."""

    __slots__ = ("key", "before", "callbacks", "finished", "__weakref__")

    def __init__(self, key: str, before: set) -> None:
        self.key = key
        self.before = before          # earlier tickets not finished yet
        self.callbacks: list = []     # run once ``before`` is empty
        self.finished = False


_cond = threading.Condition()
_queues: dict[str, list[Ticket]] = {}
_held = threading.local()
# Held by async_save from taking a turn to queueing its upload, so that each
# upload executor's queue is in turn order (else two threads' uploads could
# each wait for the other's turn on one executor thread).
_submit = threading.Lock()


@contextlib.contextmanager
def submitting() -> Iterator[None]:
    lock = _submit
    with lock:
        yield


def dir_key(writer: Any) -> Optional[str]:
    """The directory a writer saves into (resolved), or None if unknown."""
    key = getattr(getattr(writer, "store", None), "turn_key", None)
    if isinstance(key, str):  # dcpx.fsspec's writers: file:///d is d
        return key
    path = getattr(writer, "path", None)
    if not isinstance(path, (str, os.PathLike)):
        return None
    s = os.fspath(path)
    if isinstance(s, bytes):
        s = os.fsdecode(s)
    return s if "://" in s else os.path.realpath(s)


def enter(key: Optional[str]) -> Optional[Ticket]:
    """Take a turn for directory ``key`` (None: no ordering)."""
    if key is None:
        return None
    with _cond:
        q = _queues.setdefault(key, [])
        t = Ticket(key, set(q))
        q.append(t)
    return t


def finish(t: Optional[Ticket]) -> None:
    """The save holding ``t`` is done (committed or failed): later ones go."""
    if t is None:
        return
    fire: list[Callable] = []
    with _cond:
        if t.finished:
            return
        t.finished = True
        q = _queues.get(t.key, [])
        if t in q:
            q.remove(t)
        if not q:
            _queues.pop(t.key, None)
        for u in q:
            if t in u.before:
                u.before.discard(t)
                if not u.before:
                    fire.extend(u.callbacks)
                    u.callbacks = []
        _cond.notify_all()
    for cb in fire:
        cb()


def wait(t: Optional[Ticket]) -> None:
    """Block until every earlier save into the directory has finished."""
    if t is None:
        return
    with _cond:
        while t.before:
            _cond.wait()


def _held_keys() -> set:
    keys = getattr(_held, "keys", None)
    if keys is None:
        keys = _held.keys = set()
    return keys


@contextlib.contextmanager
def turn(writer: Any) -> Iterator[None]:
    """A synchronous save's turn: wait for earlier saves into the same
    directory, hold the turn while the body runs.  Re-entrant on a thread
    (a save that, through torch, ends in dcpx.save again)."""
    key = dir_key(writer)
    if key is None or key in _held_keys():
        yield
        return
    t = enter(key)
    try:
        wait(t)
        with holding(key):
            yield
    finally:
        finish(t)


def wait_for_saves(reader: Any) -> None:
    """A load: wait until every save into the reader's directory that this
    process started before the call (an ``async_save``'s upload) has
    finished, so that the load reads what that save committed.  Costs one
    dict lookup while no save is in flight; never waits on a turn this
    thread holds."""
    if not _queues:
        return
    key = dir_key(reader)
    if key is None or key in _held_keys():
        return
    with _cond:
        pending = list(_queues.get(key, ()))
        while any(not t.finished for t in pending):
            _cond.wait()


@contextlib.contextmanager
def holding(key: Optional[str]) -> Iterator[None]:
    """Mark this thread as running the save that holds ``key``'s turn."""
    keys = _held_keys()
    if key is None or key in keys:
        yield
        return
    keys.add(key)
    try:
        yield
    finally:
        keys.discard(key)


def run_holding(key: Optional[str], fn: Callable, *args: Any) -> Any:
    with holding(key):
        return fn(*args)


def gate(staged: Any, t: Optional[Ticket]) -> Any:
    """``staged`` (a state dict or a Future of one), or, while an earlier
    save into the same directory is unfinished, a Future of it that
    completes only after that save: the upload waits for it before it
    touches the directory."""
    if t is None:
        return staged
    with _cond:
        if not t.before:
            return staged
        out: Future = Future()
        t.callbacks.append(lambda: _relay(staged, out))
    return out


def _relay(staged: Any, out: Future) -> None:
    if not isinstance(staged, Future):
        out.set_result(staged)
        return

    def done(f: Future) -> None:
        try:
            out.set_result(f.result())
        except BaseException as e:  # noqa: B902 - relayed to the upload
            out.set_exception(e)
    staged.add_done_callback(done)


# ------------------------------------------------------------ file locks

# flock errors that mean "this file system does not do locks": dcpx then
# treats a save lock file's existence as "live" (docs/reliability.md).
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
_live_locks: "weakref.WeakSet[FileLock]" = weakref.WeakSet()


def _flock(fd: int, op: int) -> bool:
    """flock; False when the file system does not support it."""
    try:
        fcntl.flock(fd, op)
    except OSError as e:
        if e.errno in _UNSUPPORTED:
            return False
        raise
    return True


class FileLock:
    """A flock'd lock file, removed by ``release``."""

    def __init__(self, path: Path, fd: int, locked: bool, tag: str = "") -> None:
        self.path = path
        self.fd = fd
        self.locked = locked
        self.tag = tag
        _live_locks.add(self)

    def release(self, unlink: bool = True) -> None:
        """Remove the lock file (while still holding it, so nobody can take
        it over), then drop the lock.  Idempotent."""
        if self.fd < 0:
            return
        try:
            if unlink:
                try:
                    os.unlink(self.path)
                except OSError:  # gone already, or not ours to remove (sticky dir)
                    pass
        finally:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __del__(self) -> None:
        # A save abandoned without commit or failure (an exception inside
        # torch's planning): drop the lock; its lock file, now unlocked,
        # marks the save dead for the next cleanup.
        if self.fd >= 0:
            try:
                self.release(unlink=False)
            except Exception:  # noqa: BLE001 - also at interpreter exit
                pass


def _open(path: Path, flags: int) -> int:
    """Open read-write, or read-only for a lock file another user left
    (flock needs no write access on a local file system)."""
    try:
        return os.open(path, flags, 0o644)
    except PermissionError:
        return os.open(path, (flags & ~os.O_RDWR) | os.O_RDONLY, 0o644)


def lock_file(path: Path, shared: bool, create_new: bool = False) -> Optional[FileLock]:
    """Lock ``path`` (created if missing), blocking.  None when
    ``create_new`` and the file was taken over by a cleanup before it was
    locked (pick another name).  Raises FileExistsError when ``create_new``
    and the file exists."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    if create_new:
        flags |= os.O_EXCL
    while True:
        fd = _open(path, flags)
        try:
            locked = _flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            st = os.fstat(fd)
            try:
                cur = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                cur = None
        except BaseException:
            os.close(fd)
            raise
        if st.st_nlink and cur is not None and (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
            return FileLock(path, fd, locked)
        # Removed (or replaced) by its previous holder between our open and
        # our lock: that file is no lock any more.
        os.close(fd)
        if create_new:
            return None


def claim_save(directory: Path) -> FileLock:
    """A new save's tag and its lock, held shared until the save ends."""
    for _ in range(64):
        tag = uuid.uuid4().hex[:16]
        try:
            lk = lock_file(directory / save_lock_name(tag), shared=True, create_new=True)
        except FileExistsError:
            continue
        if lk is not None:
            lk.tag = tag
            return lk
    raise RuntimeError(f"dcpx: could not create a save lock in {directory}")


@contextlib.contextmanager
def dir_lock(directory: Path) -> Iterator[None]:
    """The directory's commit lock, held exclusively."""
    lk = lock_file(directory / DIR_LOCK, shared=False)
    assert lk is not None
    try:
        yield
    finally:
        lk.release()


def _probe(path: Path) -> tuple[Optional[bool], Optional[FileLock]]:
    """(dead, lock) for the save lock at ``path``: dead True (the file is
    gone, or its lock can be taken exclusively: returned held), False (a
    live save holds it) or None (cannot tell: not openable, or this file
    system does not do flock)."""
    try:
        fd = _open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True, None
    except OSError:
        return None, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        return (False if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None), None
    return True, FileLock(path, fd, True)


def probe(path: Path) -> tuple[bool, Optional[FileLock]]:
    """(dead, lock): whether no live save holds the save lock at ``path``.
    A dead one is returned held exclusively, for the caller to remove once
    it has removed that save's files.  Cannot tell (no locks here): not
    dead, keep that save's files."""
    dead, lk = _probe(path)
    return bool(dead), lk


#: what :func:`save_lock_state` finds in a directory
LIVE, DEAD, NO_LOCKS, UNKNOWN = "live", "dead", "no-locks", "unknown"
#: a save's lock file name (save_lock_name); the commit cleanup matches it too
SAVE_LOCK_RE = re.compile(r"^\.dcpx\.([0-9a-f]{16})\.lock$")


def save_lock_state(directory: Path) -> str:
    """Whether a save is still writing into ``directory``, from its save
    locks (``.dcpx.<tag>.lock``), without waiting:

    * ``LIVE``: a save lock is held: a live save (in any process, this one
      included) is writing there;
    * ``DEAD``: there are save locks and every one can be taken (their
      saves finished, failed or were killed);
    * ``NO_LOCKS``: no save lock (a save that ended cleanly, or a writer
      that takes none: torch's, or a save about to take its lock);
    * ``UNKNOWN``: a save lock that cannot be checked (flock does not work
      on this file system, or the file cannot be opened) and none live.

    The locks it takes to check are dropped before it returns (the files
    stay: their removal is the commit cleanup's)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return NO_LOCKS
    state = NO_LOCKS
    for name in names:
        if SAVE_LOCK_RE.match(name) is None:
            continue
        dead, lk = _probe(Path(directory) / name)
        if lk is not None:
            lk.release(unlink=False)
        elif dead:
            continue  # removed meanwhile by its save, done: no evidence either way
        if dead is False:
            return LIVE
        if dead is None:
            state = UNKNOWN
        elif state == NO_LOCKS:
            state = DEAD
    return state


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's other threads: their turns
    will never finish here, and the lock files the parent holds are the
    parent's (flock locks are shared by inherited descriptors: closing the
    child's copies leaves the parent's locks in place)."""
    global _cond, _queues, _held, _submit
    _cond = threading.Condition()
    _queues = {}
    _held = threading.local()
    _submit = threading.Lock()
    for lk in list(_live_locks):
        if lk.fd >= 0:
            fd, lk.fd = lk.fd, -1
            try:
                os.close(fd)
            except OSError:
                pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
