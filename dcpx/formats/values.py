"""Unpickling the non-tensor values of a checkpoint without running code
from it.

A non-tensor value (an int, a dict of step counters, ``np.random.get_state()``,
an ``argparse.Namespace`` of hyper-parameters, ...) is stored as a
``torch.save`` archive, as torch DCP stores it.  Loading one means running a
pickle, and a pickle can call any function it names (``os.system``).  dcpx
decodes it in one pass with ``torch.load`` and an Unpickler whose
``find_class`` resolves only these globals (docs/api.md, "Non-tensor values
and safe loading", has the list and the reasons):

* what torch's ``weights_only`` loader allows by default (tensors, storages,
  dtypes, devices, ``OrderedDict``, ``set``, ``complex``, ``bytes``, ...);
* what the user allowed with ``torch.serialization.add_safe_globals`` or
  inside ``with torch.serialization.safe_globals([...])`` (read at each
  load, as torch reads it);
* dcpx's own narrow list of code-free types that training state is made of:
  numpy arrays, scalars and dtypes (under both ``numpy.core`` and
  ``numpy._core`` names, so that numpy 1.x and 2.x checkpoints load with
  either), ``frozenset``, ``collections.deque``, ``argparse.Namespace`` and
  ``io.BytesIO`` (bytes and a position only).

Anything else raises UnsafeCheckpointError naming the exact global and both
ways to allow it, before the global is looked up.  Modules torch blocks even
when allow-listed (``os``, ``sys``, ...) stay blocked.
"""
from __future__ import annotations

import _compat_pickle
import argparse
import collections
import io
import os
import pickle
import types
from typing import Any, Optional

import torch

from .byteorder import swap_value
from ..errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["loads", "dcpx_safe_globals"]

#: modules torch's weights_only loader refuses even when allow-listed
_BLOCKED_MODULES = frozenset(("sys", "os", "posix", "nt"))


def _numpy_globals() -> dict[str, Any]:
    """numpy's code-free globals, keyed by every name a numpy 1.x or 2.x
    pickle uses for them; empty without numpy."""
    try:
        import numpy as np
    except ImportError:
        return {}
    # The functions are taken from the objects' own __reduce__, so they are
    # the installed numpy's whatever its module layout.
    reconstruct = np.empty(0).__reduce__()[0]
    scalar = np.float64(0).__reduce__()[0]
    out: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[f"{mod}._reconstruct"] = reconstruct
        out[f"{mod}.scalar"] = scalar
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25
    if dtypes is not None:
        for name in dir(dtypes):
            cls = getattr(dtypes, name)
            if isinstance(cls, type) and issubclass(cls, np.dtype):
                out[f"numpy.dtypes.{name}"] = cls
    return out


class _PickledBytesIO(io.BytesIO):
    """What ``_io.BytesIO`` in a value's pickle resolves to (torch's DCP
    stores an ``io.BytesIO`` value as a ``torch.save`` of it; its own load
    unpickles it).  A BytesIO's pickled state is (its bytes, its position,
    its ``__dict__``); a ``__dict__`` holding anything would shadow its
    methods with whatever the checkpoint put there, so only an empty one is
    taken.  ``loads`` hands back a plain ``io.BytesIO`` for a value that is
    one; nested in a container it stays this subclass, which pickles again
    as a plain ``io.BytesIO``."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        if not (type(state) is tuple and len(state) == 3 and type(state[0]) is bytes
                and type(state[1]) is int and state[1] >= 0 and state[2] in (None, {})):
            raise pickle.UnpicklingError(
                "io.BytesIO: its pickled state is not (bytes, position, no attributes)")
        super().__setstate__((state[0], state[1], None))

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return io.BytesIO, (), (self.getvalue(), self.tell(), None)


def _plain_bytesio(value: Any) -> Any:
    if type(value) is _PickledBytesIO:
        out = io.BytesIO(value.getvalue())
        out.seek(value.tell())
        return out
    return value


_DCPX_GLOBALS: Optional[dict[str, Any]] = None


def dcpx_safe_globals() -> dict[str, Any]:
    """dcpx's own additions to torch's weights_only allow-list, by the
    ``module.name`` a pickle names them with."""
    global _DCPX_GLOBALS
    if _DCPX_GLOBALS is None:
        g = _numpy_globals()
        g["builtins.frozenset"] = frozenset
        g["builtins.bytes"] = bytes  # b"" (and an empty array's data) pickles as bytes()
        g["collections.deque"] = collections.deque
        # A plain attribute bag: unpickling it is object.__new__ plus a
        # __dict__ update (no __init__, no __setstate__); its values pass
        # this same allow-list.
        g["argparse.Namespace"] = argparse.Namespace
        # An in-memory byte buffer: bytes and a position (_PickledBytesIO).
        g["_io.BytesIO"] = _PickledBytesIO
        _DCPX_GLOBALS = g
    return _DCPX_GLOBALS


def _torch_default_globals() -> dict[str, Any]:
    from torch import _weights_only_unpickler
    return _weights_only_unpickler._get_allowed_globals()


def _user_globals() -> dict[str, Any]:
    """What add_safe_globals / safe_globals allowed, named as torch names
    them (``{__module__}.{__qualname__}``, or the name given in a tuple)."""
    out: dict[str, Any] = {}
    for g in torch.serialization.get_safe_globals():
        if isinstance(g, tuple):
            out[g[1]] = g[0]
        else:
            out[f"{g.__module__}.{g.__qualname__}"] = g
    return out


class _Refused(pickle.UnpicklingError):
    """find_class met a global outside the allow-list (turned into an
    UnsafeCheckpointError by loads(), which knows the whole value)."""

    def __init__(self, name: str, blocked: bool) -> None:
        super().__init__(name)
        self.name = name
        self.blocked = blocked


def _other_unsafe(data: bytes, first: str) -> list[str]:
    """Every other global of the value outside the allow-list (a static scan,
    torch's get_unsafe_globals_in_checkpoint), so that one error lists all
    that an add_safe_globals call needs; [] if the scan cannot tell."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:
        return []
    ours = dcpx_safe_globals()
    return sorted(g for g in found if g not in ours and g != first)


def _refusal(where: str, refused: _Refused, data: bytes) -> UnsafeCheckpointError:
    full = refused.name
    if refused.blocked:
        msg = (f"{where}: refusing to unpickle global {full}: its module is blocked "
               f"(torch refuses os, sys, posix and nt even when allow-listed). If you "
               f"trust this checkpoint, load it with FileSystemReader(path, allow_pickle=True).")
    else:
        names = ", ".join([full] + _other_unsafe(data, full))
        msg = (f"{where}: refusing to unpickle global {full}: it is not on the allow-list "
               f"of code-free types (docs/api.md, \"Non-tensor values and safe loading\"), "
               f"so loading it could run code from the checkpoint. If you trust this "
               f"checkpoint, load it with FileSystemReader(path, allow_pickle=True), or "
               f"allow what this value names: torch.serialization.add_safe_globals([{names}]) "
               f"(or inside `with torch.serialization.safe_globals([{names}]):`).")
    err = UnsafeCheckpointError(msg)
    err.global_name = full
    return err


_BASE: Optional[dict[str, Any]] = None


def _base_globals() -> dict[str, Any]:
    """torch's default weights_only globals plus dcpx's (user additions are
    read per load, as torch reads them)."""
    global _BASE
    if _BASE is None:
        base = dict(_torch_default_globals())
        base.update(dcpx_safe_globals())
        _BASE = base
    return _BASE


class _Unpickler(pickle.Unpickler):
    """Resolves allow-listed globals only (``torch.load`` subclasses it)."""

    def __init__(self, file, **kw: Any) -> None:
        super().__init__(file, **kw)
        self._base = _base_globals()
        self._user = _user_globals()

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names, mapped as torch's weights_only loader maps them
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        if module in _BLOCKED_MODULES:
            raise _Refused(full, blocked=True)
        obj = self._base.get(full)
        if obj is None:
            obj = self._user.get(full)
            if obj is None:
                raise _Refused(full, blocked=False)
        return obj


def _load_restricted(file, **kw: Any) -> Any:
    """``pickle.load`` with the restrictions (torch's legacy, non-zip format
    uses it; loads() refuses that format before torch gets there)."""
    return _Unpickler(file, **kw).load()


#: the stand-in for the ``pickle`` module given to ``torch.load``
_restricted_pickle = types.ModuleType("dcpx.formats.values.restricted_pickle")
_restricted_pickle.Unpickler = _Unpickler  # type: ignore[attr-defined]
_restricted_pickle.load = _load_restricted  # type: ignore[attr-defined]
_restricted_pickle.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]


def _is_torchscript(data: bytes) -> bool:
    """torch.load(weights_only=False) hands a TorchScript archive to
    torch.jit.load, which runs its code; a DCP value never is one.  Checked
    with torch's own zip reader and test; the byte search spares that for
    values that do not contain the record's name."""
    if b"constants.pkl" not in data:
        return False
    try:
        with torch.serialization._open_zipfile_reader(io.BytesIO(data)) as zf:
            return torch.serialization._is_torchscript_zip(zf)
    except Exception:  # not a zip torch can open: torch.load fails the same way
        return False


def _forced_weights_only() -> bool:
    """TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 makes every torch.load weights_only
    (and refuses a pickle_module): the user asked for torch's own list."""
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")


def loads(data: bytes, where: str, allow_pickle: bool = False) -> Any:
    """The value a ``torch.save`` archive holds, unpickled once.  ``where``
    (the file and key) starts every error message.  With ``allow_pickle``
    any pickle is run (trusted checkpoints only)."""
    if allow_pickle:
        return swap_value(torch.load(io.BytesIO(data), weights_only=False), data)
    if data[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{where}: the value is not a torch.save zip archive")
    if _is_torchscript(data):
        raise UnsafeCheckpointError(
            f"{where}: the value is a TorchScript archive, whose loading runs its code; "
            f"if you trust this checkpoint, load it with FileSystemReader(path, "
            f"allow_pickle=True)")
    try:
        # torch.load swaps the typed storages of a big-endian archive, not
        # the untyped ones (uint16/32/64, float8...): swap_value does, as
        # dcpx swaps a tensor item's (dcpx/formats/byteorder.py)
        if _forced_weights_only():
            return swap_value(torch.load(io.BytesIO(data), weights_only=True), data)
        return swap_value(_plain_bytesio(torch.load(io.BytesIO(data), weights_only=False,
                                                    pickle_module=_restricted_pickle)), data)
    except _Refused as e:
        raise _refusal(where, e, data) from None
    except pickle.UnpicklingError as e:
        if _forced_weights_only():  # torch's own refusal; its message names the global
            raise UnsafeCheckpointError(
                f"{where}: TORCH_FORCE_WEIGHTS_ONLY_LOAD is set and torch's weights_only "
                f"loader refused the value: {e}") from None
        raise CorruptCheckpointError(f"{where}: cannot unpickle the value: {e}") from e
    except Exception as e:
        raise CorruptCheckpointError(
            f"{where}: cannot unpickle the value: {type(e).__name__}: {e}") from e


# ------------------------------------------------------------ at save time

#: types whose pickles name no global (and containers of them, see _walk)
_PLAIN = frozenset((int, float, bool, str, bytes, type(None)))
_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))
_CONTAINERS = frozenset((dict, list, tuple))
_warned_keys: set = set()
#: (key, signature) of values whose scan found nothing refused
_passed: set = set()
#: (key, type) of values without a signature (too large to walk, numpy
#: arrays of objects) whose scan found nothing refused
_passed_unsigned: set = set()
_MAX_PASSED = 4096


def _walk(obj: Any, budget: int = 1000) -> tuple:
    """(plain, signature) of a value: plain when made of plain values,
    lists, tuples, dicts and plain tensors only (whose pickles name only
    allow-listed globals); the signature (the types of the other values met,
    numpy dtypes included) stands for the globals its pickle names, None
    when it cannot (a numpy array of objects, more than ``budget`` values)."""
    stack, sig = [obj], []
    while stack:
        budget -= 1
        if budget < 0:
            return False, None
        o = stack.pop()
        t = type(o)
        if t in _PLAIN or t in _PLAIN_TENSORS:
            continue
        if t in _CONTAINERS:
            stack.extend(o.values() if t is dict else o)
            if t is dict:
                stack.extend(o.keys())
            continue
        dtype = getattr(o, "dtype", None)
        if dtype is not None and getattr(dtype, "hasobject", False):
            return False, None
        sig.append((t, dtype) if dtype is not None else t)
    return not sig, tuple(sig)


def refused_globals(data: bytes) -> Optional[list[str]]:
    """The globals of a ``torch.save`` archive that ``loads`` would refuse
    (a static scan: torch's get_unsafe_globals_in_checkpoint, which knows
    torch's list and the user's, less dcpx's additions); None if the scan
    cannot tell."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:
        return None
    ours = dcpx_safe_globals()
    return sorted(g for g in found if g not in ours)


def warn_if_refused(obj: Any, key: str, data: bytes) -> None:
    """At save time: warn (UnsafeValueWarning, once per key and process) if
    dcpx's safe loader will refuse the value just pickled as ``data``.
    Plain values cost a type lookup or a walk of their containers; others a
    static scan of the pickle, once per key and kind of value (per key and
    type for a value too large to walk, whose kind the walk cannot tell)."""
    if type(obj) in _PLAIN or key in _warned_keys:
        return
    plain, sig = _walk(obj)
    if plain:
        return
    cached, seen = ((key, sig), _passed) if sig is not None else ((key, type(obj)), _passed_unsigned)
    if cached in seen:
        return
    if _forced_weights_only():
        return  # torch's own list applies at load; not second-guessed here
    names = refused_globals(data)
    if not names:
        if len(seen) >= _MAX_PASSED:
            seen.clear()
        seen.add(cached)
        return
    _warned_keys.add(key)
    import warnings
    from ..errors import UnsafeValueWarning
    shown = ", ".join(names)
    warnings.warn(
        f"dcpx.save: the value of {key!r} (a {type(obj).__module__}.{type(obj).__qualname__}) "
        f"pickles {shown}, which dcpx's safe loader refuses (loading it could run code): the "
        f"save goes on, but its load will raise UnsafeCheckpointError. Save a value made of "
        f"allow-listed types instead (e.g. rng.get_state() for a numpy RandomState; docs/api.md, "
        f"\"Non-tensor values and safe loading\"), or at load time allow it with "
        f"torch.serialization.add_safe_globals([{shown}]), or load with allow_pickle=True if you "
        f"trust the checkpoint (FileSystemReader(path, allow_pickle=True); "
        f"CheckpointManager(..., load_options={{'allow_pickle': True}})).",
        UnsafeValueWarning, stacklevel=_outside_dcpx())


def _outside_dcpx() -> int:
    """The stacklevel of the first caller outside the dcpx package (passing
    over contextlib's frames too: a context manager used as a decorator,
    ``@checkpoint_errors()``, puts one between dcpx's)."""
    # the package's folder (this module is dcpx/formats/values.py)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    import contextlib
    import sys
    ctx = os.path.abspath(contextlib.__file__)
    f, level = sys._getframe(1), 1
    while f is not None:
        name = os.path.abspath(f.f_code.co_filename)
        if not (name.startswith(here) or name == ctx):
            break
        f, level = f.f_back, level + 1
    return level
