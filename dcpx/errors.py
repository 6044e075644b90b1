"""Exceptions raised by dcpx.

Every error about a checkpoint (these classes, and the OSErrors of staging,
writing, committing and reading, on this rank or reported from another)
names the checkpoint path and, where one is involved, the state-dict key
(fully qualified name), the data file and the rank.  Errors about the state
dict itself (a value that cannot be saved) name the key, as torch's do.

Catchable as torch's are: torch.distributed.checkpoint reports a failed
save or load as ``CheckpointException`` (a BaseException carrying
``failures``, ``{rank: (exception, traceback)}``), so every failure of
``dcpx.save`` / ``load`` / ``async_save``'s upload is one too:

* dcpx's own errors: CheckpointError subclasses torch's
  CheckpointException (and RuntimeError, as before);
* any other exception from the work of a save or load (an OSError from a
  write, a ValueError for a shape mismatch, a TypeError for a value that does
  not pickle) is raised as an instance of a class that is both its own class
  and CheckpointError (``CheckpointOSError``, ``CheckpointValueError``, ...):
  ``except OSError`` and ``except CheckpointException`` both catch it, and the
  message, errno and file name are the original's.
"""
from __future__ import annotations

import contextlib
import traceback
from concurrent.futures import Future
from typing import Any, Iterator, Optional

from torch.distributed.checkpoint.api import CheckpointException


__all__ = [
    "CheckpointError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "UnloadedKeysWarning",
    "UnsafeValueWarning",
]


def _rank() -> int:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # pragma: no cover - a broken or torn-down group
        pass
    return 0


class CheckpointError(RuntimeError, CheckpointException):
    """Base class of dcpx's checkpoint errors; a torch
    ``CheckpointException`` (and a RuntimeError).  ``str()`` is dcpx's
    message, not torch's traceback dump."""

    def __init__(self, *args: Any, failures: Optional[dict] = None) -> None:
        RuntimeError.__init__(self, *args)
        self._failures = failures

    __str__ = RuntimeError.__str__

    @property
    def failures(self) -> dict:
        """torch's ``{rank: (exception, traceback.StackSummary)}``: the
        exception this one stands for (itself for dcpx's own errors) on this
        process's rank."""
        failures = self.__dict__.get("_failures")
        if failures is None:
            return {_rank(): (self, traceback.extract_tb(self.__traceback__))}
        return failures

    def __reduce__(self) -> tuple:
        # failures hold this process's exceptions and tracebacks: not sent
        state = {k: v for k, v in self.__dict__.items() if k != "_failures"}
        return (type(self), self.args, state or None)


class IncompleteCheckpointError(FileNotFoundError, CheckpointError):
    """The checkpoint directory has no committed metadata: it does not exist,
    was never finished, or its save was interrupted before the commit.
    (FileNotFoundError first, so that errno and filename are kept.)"""


class CorruptCheckpointError(CheckpointError):
    """Checkpoint bytes are inconsistent: a CRC-32 mismatch, a truncated or
    malformed record, or metadata that contradicts the data files."""


class UnsupportedFormatError(CheckpointError):
    """The checkpoint is in a form this process cannot read (a stream
    transform not registered, or without its compression package); it is
    not damaged: the message says what to install or register."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A pickle in the checkpoint asks for something outside dcpx's
    allow-list (it could run code); it was not loaded."""


class UnloadedKeysWarning(UserWarning):
    """``dcpx.load``: the checkpoint holds keys inside an entry of the state
    dict (under its top-level key) that the state dict did not ask for, so
    they were not loaded: a freshly made optimizer's empty state, most
    often (docs/api.md, "Keys a load leaves out")."""


class UnsafeValueWarning(UserWarning):
    """A save wrote a non-tensor value that dcpx's safe loader will refuse
    (its type is not on the allow-list): the message names the key and how
    to make it load (docs/api.md, "Non-tensor values and safe loading")."""


# --------------------------------------------------------------------------
# other exceptions of a failed save / load, made catchable as torch's

_COMBINED: dict[type, type] = {}


def _combined(base: type) -> type:
    """The class that is both ``base`` and CheckpointError (one per base;
    CheckpointError itself for RuntimeError and Exception)."""
    if issubclass(CheckpointError, base):
        return CheckpointError
    cls = _COMBINED.get(base)
    if cls is None:
        cls = type(f"Checkpoint{base.__name__}", (base, CheckpointError),
                   {"__module__": __name__, "__reduce__": _reduce_combined, "_base": base,
                    "__doc__": f"A failed save or load that raised {base.__name__}."})
        _COMBINED[base] = cls
    return cls


def _instance(base: type, args: tuple, attrs: dict) -> CheckpointError:
    cls = _combined(base)
    try:
        w = cls(*args)
    except Exception:  # an __init__ whose arguments are not its args
        w = cls.__new__(cls, *args)  # (json.JSONDecodeError): attrs fill it
    for k, v in attrs.items():
        setattr(w, k, v)
    return w


def _oserror_attrs(e: BaseException) -> dict:
    if isinstance(e, OSError):  # args hold (errno, strerror) only
        return {k: getattr(e, k) for k in ("filename", "filename2")
                if getattr(e, k) is not None}
    return {}


def _reduce_combined(self: CheckpointError) -> tuple:
    """Pickles (the checkpoint process sends its errors to its parent) as
    the base class's args and attributes; failures are this process's."""
    attrs = {k: v for k, v in self.__dict__.items() if k != "_failures"}
    attrs.update(_oserror_attrs(self))
    return (_instance, (type(self)._base, self.args, attrs))


def as_checkpoint_error(e: BaseException) -> BaseException:
    """``e`` if it is a CheckpointException (dcpx's or torch's) or not an
    Exception; else an equivalent exception that is also a CheckpointError
    (same class via subclassing, args, attributes, traceback and cause),
    whose ``failures`` hold ``e``."""
    if isinstance(e, CheckpointException) or not isinstance(e, Exception):
        return e
    summary = traceback.extract_tb(e.__traceback__)
    try:
        attrs = dict(e.__dict__)
        attrs.update(_oserror_attrs(e))
        w: CheckpointError = _instance(type(e), e.args, attrs)
        w.__cause__ = e.__cause__
    except Exception:  # a class that cannot be subclassed
        w = CheckpointError(f"{type(e).__name__}: {e}")
        w.__cause__ = e
    w.__suppress_context__ = True  # the context is e itself
    w._failures = {_rank(): (e, summary)}
    return w.with_traceback(e.__traceback__)


@contextlib.contextmanager
def checkpoint_errors() -> Iterator[None]:
    """Raise what fails inside as a CheckpointException
    (as_checkpoint_error).  Also a decorator."""
    try:
        yield
    except Exception as e:
        w = as_checkpoint_error(e)
        if w is e:
            raise
        raise w  # noqa: B904 (the cause is e's own)


def checkpoint_future(fut: Future) -> Future:
    """A Future with ``fut``'s outcome, its exception as_checkpoint_error'd
    (async_save's upload future)."""
    out: Future = Future()

    def relay(f: Future) -> None:
        if f.cancelled():
            out.cancel()
            return
        e = f.exception()
        if e is None:
            out.set_result(f.result())
        else:
            out.set_exception(as_checkpoint_error(e))

    fut.add_done_callback(relay)
    return out


def staging_error(e: BaseException, writer) -> BaseException:
    """A stager's OSError (its buffer allocation, memfd or mapping failed),
    naming the checkpoint it was staging for: a stager does not know the
    path.  Same type and errno, the original as its ``__cause__``.  Other
    errors pass unchanged: they are about the state dict (a tensor that
    cannot be saved) and name its key, as ``save``'s do."""
    where = getattr(writer, "path", None) or getattr(writer, "checkpoint_id", None)
    if not isinstance(e, OSError) or e.errno is None or where is None or str(where) in str(e):
        return e
    try:
        new = type(e)(e.errno, f"dcpx: staging for the checkpoint at {where} failed: "
                               f"{e.strerror or e}",
                      *(() if e.filename is None else (e.filename,)))
    except Exception:
        return e
    new.__cause__ = e
    return new


def own_failure(e: BaseException, rank: int, where: object) -> BaseException:
    """What torch's own ``load`` (the generic path: a URL's FsspecReader, a
    custom planner) raised, as dcpx raises it: torch reports every failure
    as a bare ``CheckpointException`` (a BaseException, which ``except
    Exception`` misses) holding each rank's error in ``failures``.  Returns
    this rank's own error (``rank``: its rank in the load's group), as a
    CheckpointError (as_checkpoint_error: a CorruptCheckpointError stays
    one), with torch's ``failures`` kept; a plain CheckpointError naming the
    ranks and their errors when only other ranks failed; ``e`` itself when
    it is not torch's bare CheckpointException or holds nothing usable."""
    if not isinstance(e, CheckpointException) or isinstance(e, CheckpointError):
        return e
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return e
    mine = failures.get(rank)
    inner = mine[0] if isinstance(mine, tuple) and mine else mine
    if isinstance(inner, Exception):
        w = as_checkpoint_error(inner)
        if isinstance(w, CheckpointError):
            w._failures = failures
        return w
    if inner is not None:  # a BaseException of its own (KeyboardInterrupt...)
        return e
    parts = []
    for r, f in sorted(failures.items(), key=lambda kv: str(kv[0])):
        exc = f[0] if isinstance(f, tuple) and f else f
        parts.append(f"rank {r}: {type(exc).__name__}: {exc}")
    return CheckpointError(f"dcpx: loading {where} failed on another rank: " + "; ".join(parts),
                           failures=failures)
