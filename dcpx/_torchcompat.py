"""Every difference between the torch versions dcpx supports, in one place.

The rest of dcpx imports what differs between torch versions from here and
never compares torch versions itself.  Each entry says which torch versions
it covers; where possible it tests for the feature rather than the version
(try-import, hasattr).  Entries are grouped: newer torch (2.9 and later)
first, older torch (2.4 - 2.8) after.
"""
from __future__ import annotations

import dataclasses as _dc
from concurrent.futures import Future
from enum import Enum as _Enum
from typing import Any, Iterable

from torch.distributed.checkpoint import metadata as _md

# ---------------------------------------------------------------- torch >= 2.9

# CheckpointableTensor (torch 2.14+, torch.distributed.checkpoint.protocol): a
# plain torch.Tensor carrying ``global_shape`` / ``global_offsets`` /
# ``local_offsets`` / ``local_sizes`` is saved and loaded by torch's planner
# as shards of a larger global tensor, not as a tensor of its own shape.
# dcpx's own planner does not do that, so such values take torch's planner
# (``dcpx.coordination.plan.plain_tensor`` is False for them).  torch 2.4 - 2.13 have no
# such protocol: a tensor is what its shape says there.
try:
    from torch.distributed.checkpoint.protocol import (
        _is_checkpointable_tensor as _torch_is_checkpointable,
    )
except ImportError:  # torch 2.4 - 2.13
    _torch_is_checkpointable = None

HAS_CHECKPOINTABLE_TENSOR = _torch_is_checkpointable is not None


def is_checkpointable_tensor(obj: Any) -> bool:
    """Whether the installed torch's planner treats ``obj`` as a
    CheckpointableTensor (always False before torch 2.14).  The hasattr test
    first: torch's runtime Protocol check costs ~100x more per tensor."""
    return (_torch_is_checkpointable is not None and hasattr(obj, "global_offsets")
            and _torch_is_checkpointable(obj))


def any_checkpointable_tensor(values: Iterable[Any]) -> bool:
    """Whether any of ``values`` is a CheckpointableTensor (never before
    torch 2.14, without looking at the values)."""
    if _torch_is_checkpointable is None:
        return False
    return any(hasattr(v, "global_offsets") and _torch_is_checkpointable(v) for v in values)


def copy_checkpointable_attrs(src: Any, dst: Any) -> None:
    """Give a staged copy ``dst`` of a CheckpointableTensor ``src`` its shard
    attributes, as torch 2.14's stager does
    (``protocol._copy_checkpointable_tensor_metadata``)."""
    for name in ("global_shape", "global_offsets", "local_offsets", "local_sizes"):
        setattr(dst, name, getattr(src, name))


# --------------------------------------------------------------------------
# torch 2.4-2.8
# --------------------------------------------------------------------------


# torch 2.4 has no torch.distributed.checkpoint._version (torch 2.5 added
# it, with the pre-2.4 "2_3" traversal to fall back to): always None there.
try:
    from torch.distributed.checkpoint import _version as _dcp_version
except ImportError:
    _dcp_version = None


def derived_version():
    """``torch.distributed.checkpoint._version._derived_version``: the
    checkpoint layout torch is loading (``"2_3"`` for the pre-2.4 one), or
    None (always None where torch has no ``_version`` module)."""
    return None if _dcp_version is None else _dcp_version._derived_version


# torch 2.4-2.8: Metadata has no ``version`` field (torch 2.9 added it and
# writes "1.0.0"); a checkpoint of such a torch carries none.
METADATA_FIELDS = tuple(f.name for f in _dc.fields(_md.Metadata))


def new_metadata(**fields: Any) -> _md.Metadata:
    """``Metadata(**fields)`` without the fields the installed torch's
    Metadata lacks (``version`` before torch 2.9), so that .metadata holds
    what that torch itself writes."""
    return _md.Metadata(**{k: v for k, v in fields.items() if k in METADATA_FIELDS})


def stamp_version(metadata: _md.Metadata, version: str) -> None:
    """Set ``metadata.version`` where the installed torch's Metadata has it
    (torch >= 2.9); nothing on torch 2.4-2.8."""
    if "version" in METADATA_FIELDS:
        metadata.version = version


# torch 2.4: DTensor lives in the private torch.distributed._tensor only
# (torch 2.5 made torch.distributed.tensor public).
try:
    from torch.distributed.tensor import DTensor
except ImportError:
    try:
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
    except ImportError:  # torch built without distributed
        DTensor = None  # type: ignore[assignment,misc]


# torch 2.4: DTensor has no __create_chunk_list__ (torch 2.5 added it);
# torch 2.4's planner computes the chunk with _create_chunk_from_dtensor.
def dtensor_chunk(dt: Any) -> _md.ChunkStorageMetadata:
    """The one chunk (global offsets, sizes) that DTensor ``dt`` holds on
    this rank, as the installed torch's planner computes it."""
    make = getattr(dt, "__create_chunk_list__", None)
    if make is not None:
        (chunk,) = make()
        return chunk
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_from_dtensor
    return _create_chunk_from_dtensor(dt)


# torch 2.4-2.6: no AsyncCheckpointerType (torch 2.7 added it); torch
# 2.4-2.8: no AsyncSaveResponse (torch 2.9).  dcpx's async_save has both
# (its PROCESS checkpointer and asynchronous staging work on every torch):
# torch's classes where torch has them, so that isinstance checks against
# torch's hold, else dcpx's own with torch's fields and values.
try:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
except ImportError:
    class AsyncCheckpointerType(_Enum):  # type: ignore[no-redef]
        THREAD = "thread"
        PROCESS = "process"
try:
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
except ImportError:
    @_dc.dataclass
    class AsyncSaveResponse:  # type: ignore[no-redef]
        staging_completion: Future
        upload_completion: Future


# torch 2.4-2.6: save() / load() have no ``no_dist`` (torch 2.7 added it;
# before, they infer it: no process group means no_dist; False, the
# default, infers it on every torch); torch 2.4-2.10:
# save() has no ``use_collectives``.  dcpx passes torch's implementation
# only what the installed torch knows: a value torch would infer anyway is
# dropped; any other raises TypeError as that torch's own call would.
def torch_kwargs(fn: Any, name: str, **kw: Any) -> dict:
    """``kw`` less the keyword arguments torch's ``fn`` lacks, where their
    value is what that torch does anyway (``no_dist`` False or no process
    group, ``use_collectives=True``); TypeError for any other value."""
    import inspect

    import torch.distributed as dist
    params = inspect.signature(fn).parameters
    out = {}
    for k, v in kw.items():
        if k in params:
            out[k] = v
            continue
        if k == "no_dist" and (not v or not (dist.is_available() and dist.is_initialized())):
            continue  # the default (inferred), or what torch infers
        if k == "use_collectives" and v:
            continue
        raise TypeError(f"{name}() got an unexpected keyword argument {k!r} "
                        f"(torch {_torch_version()} has no {k}={v!r})")
    return out


# torch 2.4-2.6: save() has no ``no_dist``.  A save with ``no_dist=True``
# and a process group of this rank alone, which dcpx's single-process path
# does not take (DTensors), goes on that group there (dcpx's coordinated
# path, else torch's save): the same save, touching no other rank.  (On
# later torch, no_dist=True goes on as it is.)
def group_for_no_dist(fn: Any, no_dist: bool, group: Any) -> bool:
    """Whether ``group``, a process group of this rank alone, stands for
    ``no_dist=True`` because torch's ``fn`` lacks no_dist."""
    import inspect

    import torch.distributed as dist
    if not no_dist or group is None or "no_dist" in inspect.signature(fn).parameters:
        return False
    try:
        return dist.is_initialized() and dist.get_world_size(group) == 1
    except (ValueError, RuntimeError):  # not a group torch knows
        return False


# torch 2.4-2.6: load() without torch.distributed in use takes the state
# dict's keys in their own order (with it: the keys gathered from every
# rank, sorted); later torch sorts them always (pytorch#145998, which also
# added ``checkpoint.utils._assert_same_keys``: the feature tested).  The
# order shows where saved chunks overlap: the later read wins.
def load_key_order(keys: Iterable[Any], distributed: bool) -> list:
    """The order in which the installed torch's load() takes the top-level
    keys of a state dict."""
    from torch.distributed.checkpoint import utils as _dcp_utils
    if distributed or hasattr(_dcp_utils, "_assert_same_keys"):
        return sorted(keys)
    return list(keys)


# torch.save's zip writer, ``torch._C.PyTorchFileWriter``: torch 2.4-2.5
# take (file), 2.6 (file, compute_crc32), 2.7 and later (file,
# compute_crc32, storage_alignment); every one writes CRCs and aligns
# records at 64 bytes unless told otherwise.  torch.save writes the
# ``.format_version`` and ``.storage_alignment`` records from 2.7 on.
def torch_save_alignment() -> int:
    """The record alignment of the installed torch's ``torch.save`` (64
    where torch has no setting for it: 2.4-2.6)."""
    import torch
    get = getattr(torch.serialization, "_get_storage_alignment", None)
    return int(get()) if get is not None else 64


def torch_save_header(align: int) -> list:
    """The records the installed torch's ``torch.save`` writes after
    ``data.pkl`` and before ``byteorder``: ``.format_version`` and
    ``.storage_alignment`` from torch 2.7 (with the alignment setting),
    none before."""
    import torch
    if not hasattr(torch.serialization, "_get_storage_alignment"):
        return []
    return [(".format_version", "1"), (".storage_alignment", str(align))]


def torch_file_writer(f: Any, align: int) -> Any:
    """A ``PyTorchFileWriter`` over the open file ``f`` that writes record
    CRCs and aligns records at ``align`` bytes, as the installed torch's
    ``torch.save`` does."""
    import torch
    for args in ((f, True, align), (f, True), (f,)):
        try:
            return torch._C.PyTorchFileWriter(*args)
        except TypeError:
            continue
    raise TypeError(f"torch {_torch_version()}: no PyTorchFileWriter constructor dcpx knows")


def _torch_version() -> str:
    import torch
    return torch.__version__


# torch 2.4-2.7: save / load without a process group warn "torch.distributed
# is unavailable or uninitialized, assuming ..."; later torch says "is
# disabled, unavailable or uninitialized".  The pattern matches both.
NO_DIST_WARNING = r".*torch\.distributed is (disabled|unavailable)"
