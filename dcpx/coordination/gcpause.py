"""paused_gc(): pause the cyclic garbage collector around allocation-heavy
phases.

Planning a 20,000-tensor save, flattening its state dict, or unpickling its
metadata allocates ~10 objects per tensor.  Every few hundred allocations
trigger a collection, and the older generations' passes scan every live
object (the model and optimizer included), so the collector costs more than
the work itself: reading a 20,000-tensor .metadata takes 3.9x as long with
it (benchmarks/bench_metadata.py; docs/design.md).  None of these phases
creates reference cycles that must be collected before it ends.

The collector's switch is process-wide and these phases run on several
threads (the caller's, dcpx-stage, dcpx-upload), so pauses are counted: the
collector is switched off by the first and back on (if it was on) by the
last.  A process forked while another thread is inside a pause would
inherit the collector switched off for good, since that thread does not
exist in the child; the child therefore drops the pauses it inherits.
"""
import contextlib
import gc
import os
import threading

_lock = threading.Lock()
_depth = 0          # phases in progress, all threads
_restore = False    # whether the collector was on before the first


@contextlib.contextmanager
def paused_gc():
    global _depth, _restore
    with _lock:
        if _depth == 0:
            _restore = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth = max(0, _depth - 1)  # 0 if a fork in the phase reset it
            if _depth == 0 and _restore:
                gc.enable()


def _after_fork_in_child() -> None:
    global _lock, _depth
    _lock = threading.Lock()  # may have been held by a thread that is gone
    if _depth:  # pauses of threads the child does not have
        _depth = 0
        if _restore:
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
