"""dcpx.save / dcpx.load: torch.distributed.checkpoint's signatures and
semantics.

Two paths, one format:

* **fast path** (no process group in use, default planner, dcpx storage):
  dcpx flattens the state dict by torch's ``flatten_state_dict`` rules (one C
  walk, ``coordination/flatten.py``; torch's own function where it cannot be sure), builds
  the metadata itself in one pass (no SavePlan / WriteItem objects, no
  planner round trips) and hands the tensors to the C writer or reader.
* **generic path** (a process group, a custom planner, DTensor / sharded
  values, or a foreign storage object): torch's ``dcp.save`` / ``dcp.load``
  drive the plan, with dcpx's FileSystemWriter / FileSystemReader doing the
  I/O.  Semantics are torch's by construction.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

# torch's own save / load, captured once from their defining modules: a
# script may replace torch.distributed.checkpoint.save / load (and the
# state_dict_saver / state_dict_loader attributes) with dcpx's, and the
# generic path below must not then call dcpx again (RecursionError).
from torch.distributed.checkpoint.state_dict_loader import load as _torch_load
from torch.distributed.checkpoint.state_dict_saver import save as _torch_save
from torch.distributed.checkpoint.stateful import Stateful

from ..coordination import dist as _dist, plan as _plan, planner_state as _planner_state
from . import guard as _guard
from .. import _torchcompat
from ..storage import locks as _locks
from .bc import positional_storage
from ..formats.files import LOCAL_PROTOCOLS, url_protocol
from ..coordination.flatten import flatten_state_dict
from ..coordination.gcpause import paused_gc
from .guard import check_not_bootstrapping  # noqa: F401  (also CheckpointManager's)
from ..storage.pending import tensor_payload
from ..coordination.plan import plan_local_save
from ..coordination.stateful import (  # noqa: F401  (wrap_state_dict: CheckpointManager's, dcpx.manager)
    _NEVER_STATEFUL, _stateful_to_state_dict, is_stateful, wrap_state_dict)
from ..storage.reader import FileSystemReader
from .._torchcompat import NO_DIST_WARNING, any_checkpointable_tensor, torch_kwargs
from ..coordination.unasked import warn_unloaded
from ..storage.writer import FileSystemWriter
from ..errors import checkpoint_errors, own_failure


__all__ = ["save", "load"]

_PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


def _dist_in_use(no_dist: bool) -> bool:
    return not no_dist and dist.is_available() and dist.is_initialized()


def as_state_dict(state_dict: Any, what: str) -> dict:
    """The state dict a save takes: a dict (or subclass) as it is, any other
    Mapping (a ``collections.UserDict``, which torch's save takes too) as a
    dict of its items; anything else is a TypeError."""
    if isinstance(state_dict, dict):
        return state_dict
    if isinstance(state_dict, Mapping):
        return dict(state_dict.items())
    raise TypeError(f"{what}: state_dict must be a dict, got {type(state_dict).__name__}")


def _is_plain_or_value(obj: Any) -> bool:
    """A value a single-process save or load plans itself (dcpx.coordination.plan.plannable)."""
    return _plan.plannable(obj, False)


def _storage_for(storage, checkpoint_id, reader: bool):
    """The given writer/reader reset to checkpoint_id, or dcpx's own for it:
    the one place where a checkpoint_id picks its storage, as torch's
    ``_storage_setup`` does.  Local paths and ``file://`` / ``local://`` URLs
    go to FileSystemWriter / FileSystemReader, any other URL (``s3://``,
    ``memory://``, ...) to dcpx.fsspec's FsspecWriter / FsspecReader."""
    if storage is None:
        if checkpoint_id is None:
            name = "storage_reader" if reader else "storage_writer"
            raise RuntimeError(f"`checkpoint_id` must be specified if {name} is None.")
        proto = url_protocol(checkpoint_id)
        if proto is None or proto in LOCAL_PROTOCOLS:
            return (FileSystemReader if reader else FileSystemWriter)(checkpoint_id)
        from ..fsspec import FsspecReader, FsspecWriter
        return (FsspecReader if reader else FsspecWriter)(checkpoint_id)
    if checkpoint_id is not None:
        storage.reset(checkpoint_id)
    return storage


def _writer_for(storage_writer, checkpoint_id):
    return _storage_for(storage_writer, checkpoint_id, reader=False)


def _reader_for(storage_reader, checkpoint_id):
    return _storage_for(storage_reader, checkpoint_id, reader=True)


# --------------------------------------------------------------------- save

def _default_planner(planner) -> bool:
    """None, or torch's default planner with default settings (as user code
    often passes it explicitly): dcpx's fast path does exactly its job."""
    if planner is None:
        return True
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        DefaultSavePlanner,
    )
    if type(planner) is DefaultSavePlanner:
        return (planner.flatten_state_dict and planner.flatten_sharded_tensors
                and not getattr(planner, "_enable_plan_caching", False))
    if type(planner) is DefaultLoadPlanner:
        return planner.flatten_state_dict and planner.flatten_sharded_tensors
    return False


def fast_path_eligible(storage_writer, planner, no_dist: bool) -> bool:
    """dcpx plans the save itself: one process, default planner, dcpx storage."""
    return (_default_planner(planner) and not _dist_in_use(no_dist)
            and isinstance(storage_writer, FileSystemWriter) and storage_writer.plain_format())


@checkpoint_errors()  # a failure is a torch CheckpointException (dcpx.errors)
def save_local(writer: FileSystemWriter, flat: dict, mappings: dict,
               prepare=tensor_payload, before_commit=None, scanned=None) -> Metadata:
    """Plan, write and commit a flat single-process state dict.  The metadata
    is encoded while the C threads write; the GIL is released while they
    finish.  ``before_commit()``, if given, runs once the data files are
    written; if it raises, they are removed and nothing is committed.
    ``scanned``: see ``plan_local_save``."""
    try:
        with paused_gc():
            started = _start_local(writer, flat, mappings, prepare, scanned)
    except BaseException:
        writer._release_tag()
        raise
    return _finish_local(writer, *started, before_commit=before_commit)


def _start_local(writer: FileSystemWriter, flat: dict, mappings: dict, prepare,
                 scanned=None) -> tuple:
    """save_local's first half (call it with the collector paused): plan,
    start the C writer threads, build and encode the metadata while they
    write.  (Metadata, PendingWrite, encoded metadata)."""
    local = plan_local_save(writer, flat, mappings, prepare, scanned)
    pending = local.pending.start()
    try:
        metadata = local.metadata()
        data = writer.encode_metadata(metadata)
    except BaseException:
        writer._splice = None
        pending.abort()
        raise
    return metadata, pending, data


def _save_fast(writer: FileSystemWriter, state_dict: dict, planner, no_dist: bool):
    """dcpx.save's single-process path, or None where it does not apply.
    Flattening, planning and encoding run in one pause of the collector:
    one collection of what they allocated afterwards, not one per phase."""
    with paused_gc():
        fast = fast_path_state(state_dict, writer, planner, no_dist)
        if fast is None:
            return None
        with checkpoint_errors():
            try:
                started = _start_local(writer, *fast, tensor_payload)
            except BaseException:
                writer._release_tag()
                raise
        # Freed before the collector resumes, so that it does not scan the
        # flattening's objects (one key-path tuple per tensor).
        del fast
    return _finish_local(writer, *started)


@checkpoint_errors()
def _finish_local(writer: FileSystemWriter, metadata: Metadata, pending, data: bytes,
                  before_commit=None) -> Metadata:
    """save_local's second half: wait for the C writer threads, then
    ``before_commit()`` (if it raises, the data files are removed and
    nothing is committed), then commit."""
    try:
        pending.wait(results=False)
        if before_commit is not None:
            try:
                before_commit()
            except BaseException:
                pending.discard()
                raise
        writer.commit(metadata, data)
    finally:
        writer._release_tag()  # a failed save's lock (commit releases its own)
        writer._splice = None  # unused if a subclass's encode_metadata did not take it
    return metadata


def fast_path_state(state_dict: dict, storage_writer, planner, no_dist: bool):
    """(flat, mappings) when the fast path applies, else None."""
    if not fast_path_eligible(storage_writer, planner, no_dist):
        return None
    flat, mappings = flatten_state_dict(_stateful_to_state_dict(state_dict))
    if (_PLAIN_TENSOR_TYPES.issuperset(map(type, flat.values()))
            and not any_checkpointable_tensor(flat.values())):
        return flat, mappings  # the common case, without a call per value
    for key, v in flat.items():
        if not _plan.plannable(v, False):
            if v.is_nested:  # jagged nested tensors are subclasses
                raise TypeError(f"dcpx: cannot save {key!r}: nested tensors are not supported")
            return None
    return flat, mappings


def dist_path_eligible(storage_writer, planner, no_dist: bool) -> bool:
    """dcpx coordinates the ranks itself: a process group in use, default
    planner, dcpx storage."""
    return (_default_planner(planner) and _dist_in_use(no_dist)
            and isinstance(storage_writer, FileSystemWriter) and storage_writer.plain_format())


def dist_path_state(state_dict: dict, storage_writer, planner, no_dist: bool):
    """(flat, mappings) when dcpx coordinates a multi-process save itself
    (default planner, dcpx storage, plain tensors / DTensors / non-tensors),
    else None."""
    if not dist_path_eligible(storage_writer, planner, no_dist):
        return None
    flat, mappings = flatten_state_dict(_stateful_to_state_dict(state_dict))
    if not all(_plan.plannable(v, True) for v in flat.values()):
        return None
    return flat, mappings


@positional_storage("storage_writer")  # save(sd, writer): torch warns and goes on
def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: Union[str, os.PathLike, None] = None,
    storage_writer=None,
    planner=None,
    process_group=None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Metadata:
    """Save a state dict; same signature and semantics as
    ``torch.distributed.checkpoint.save``.  Returns the checkpoint Metadata."""
    _guard.check_not_bootstrapping("save")  # the main script run again by spawn
    state_dict = as_state_dict(state_dict, "dcpx.save")
    writer = _writer_for(storage_writer, checkpoint_id)
    # Saves into one directory run one at a time, in call order: this one
    # starts once earlier ones (an async_save's upload) have finished.
    with _locks.turn(writer):
        metadata = _save_fast(writer, state_dict, planner, no_dist)
        if metadata is not None:
            if planner is not None:  # set up as torch's save leaves it
                _planner_state.after_save(planner, state_dict, metadata, True, False)
            return metadata
        if _torchcompat.group_for_no_dist(_torch_save, no_dist, process_group):
            no_dist = False  # torch 2.4-2.6: a group of this rank alone instead
        with paused_gc():
            sharded = dist_path_state(state_dict, writer, planner, no_dist)
        if sharded is not None:
            metadata = _dist.save(writer, *sharded, group=process_group,
                                  use_collectives=use_collectives)
            if planner is not None:
                _planner_state.after_save(planner, state_dict, metadata,
                                          writer.is_coordinator, True)
            return metadata
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
            return _torch_save(state_dict, storage_writer=writer, planner=planner,
                               process_group=process_group,
                               **torch_kwargs(_torch_save, "save", no_dist=no_dist,
                                              use_collectives=use_collectives))


# --------------------------------------------------------------------- load

@positional_storage("storage_reader")  # load(sd, reader): torch warns and goes on
def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: Union[str, os.PathLike, None] = None,
    storage_reader=None,
    planner=None,
    process_group=None,
    no_dist: bool = False,
) -> None:
    """Load a checkpoint into ``state_dict`` in place; same signature and
    semantics as ``torch.distributed.checkpoint.load``.  Tensor data is CRC
    checked, and non-tensor values are unpickled under torch's weights_only
    allow-list unless the reader was built with ``allow_pickle=True``."""
    _guard.check_not_bootstrapping("load")
    if not isinstance(state_dict, dict) and not isinstance(state_dict, MutableMapping):
        raise TypeError(f"dcpx.load: state_dict must be a dict, got {type(state_dict).__name__}")
    reader = _reader_for(storage_reader, checkpoint_id)
    # An async_save into this directory still uploading: its commit first.
    _locks.wait_for_saves(reader)
    distributed = _dist_in_use(no_dist)
    keys = _torchcompat.load_key_order(state_dict.keys(), distributed)
    values = list(map(state_dict.__getitem__, keys))
    if _NEVER_STATEFUL.issuperset(map(type, values)):  # the common case, at C speed
        stateful_sd, any_stateful = dict(zip(keys, values)), False
    else:
        stateful_sd = {k: (v.state_dict() if is_stateful(v) else v)
                       for k, v in zip(keys, values)}
        any_stateful = True
    del values
    partial = getattr(planner, "allow_partial_load", False)
    # One GC pause over the flattening and the local load: the ~2 objects
    # per tensor they make are freed before it ends, so that its end does
    # not start a collection that scans them (dcpx/coordination/gcpause.py).
    with paused_gc():
        flat, mappings = flatten_state_dict(stateful_sd)
        fast = (_default_planner(planner) and isinstance(reader, FileSystemReader)
                and _all_fast(flat.values(), distributed))
        if fast and not distributed:
            with checkpoint_errors():
                ck = _dist.open_checkpoint(reader)
                count = ck.key_count()
                _dist.load_flat(flat, mappings, stateful_sd, reader, ck, partial)
            if not partial:  # keys the state dict did not ask for (dcpx/coordination/unasked.py)
                warn_unloaded(ck, count, flat, keys, reader.path)
            del ck
            flat = mappings = None
    if fast and distributed:
        _dist.load(reader, flat, mappings, stateful_sd, process_group, partial)
    elif not fast:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
            try:
                _torch_load(stateful_sd, storage_reader=reader, planner=planner,
                            process_group=process_group,
                            **torch_kwargs(_torch_load, "load", no_dist=no_dist))
            except CheckpointException as e:
                # torch's bare CheckpointException (a BaseException): this
                # rank's own error instead (a URL's CorruptCheckpointError...)
                rank = dist.get_rank(process_group) if distributed else 0
                w = own_failure(e, rank, getattr(reader, "checkpoint_id", None) or checkpoint_id)
                if w is e:
                    raise
                w.__suppress_context__ = True
                raise w  # noqa: B904 (torch's dump of the same error is not its cause)
    if fast and planner is not None:  # set up as torch's load leaves it
        _planner_state.after_load(planner, stateful_sd,
                                  not distributed or dist.get_rank(process_group) == 0, reader)
    if not any_stateful and type(state_dict) is dict:
        state_dict.update(stateful_sd)
        return
    # As torch: through the state dict's own __setitem__ (a dict subclass,
    # a UserDict), and a Stateful is loaded in place, never replaced.
    for k in keys:
        elem = state_dict[k]
        if is_stateful(elem):
            elem.load_state_dict(stateful_sd[k])
        else:
            state_dict[k] = stateful_sd[k]


def _all_fast(values, distributed: bool) -> bool:
    """Every flat value is one dcpx's own load path handles (plain tensors,
    DTensors when distributed, non-tensors): decided per type when no value
    is a tensor subclass, per value otherwise."""
    if (all(t in _PLAIN_TENSOR_TYPES or not issubclass(t, torch.Tensor)
            for t in set(map(type, values)))
            and not any_checkpointable_tensor(values)):
        return True
    return all(_plan.plannable(v, distributed) for v in values)
