"""dcpx: a C-accelerated drop-in replacement for torch.distributed.checkpoint.

    import dcpx as dcp          # instead of torch.distributed.checkpoint

Same API, same on-disk format (checkpoints load with either library), with
a C core for the I/O, CRC-32 integrity checks on load, a crash-safe commit
and safe loading of untrusted checkpoints.  See docs/ for details.
"""
import sys as _sys
import threading as _threading

from .version import __version__  # noqa: F401

#: set while dcpx._exports is being imported (by the thread holding _lock)
_loading = False
_lock = _threading.RLock()


def _load() -> None:
    """Import dcpx's API (and torch): dcpx._exports, whose names become this
    package's: what ``import dcpx`` imported at once before it was lazy, in
    the same order."""
    global _loading
    if "__all__" in globals():
        return
    with _lock:    # another thread's first use waits for this one's
        if "__all__" in globals() or _loading:
            return
        _loading = True
        try:
            from . import _exports
        finally:
            _loading = False
        g = globals()
        for name in _exports.__all__:
            g[name] = getattr(_exports, name)
        g["__all__"] = _exports.__all__


def __getattr__(name: str):
    """A submodule (dcpx._C, dcpx.cli): imports it; a public name (dcpx.save,
    dcpx.CheckpointManager, the torch names): loads them all."""
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name != "__all__":
        import importlib
        import importlib.util
        if importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
    _load()
    if name in globals():
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    _load()
    return sorted(globals())


# Where torch is imported already, importing dcpx's API costs little: do it
# now, as an eager package would.
if "torch" in _sys.modules:
    _load()
