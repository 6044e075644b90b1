"""Differences between torch versions that dcpx depends on, in one place.

dcpx imports some of torch.distributed.checkpoint's private modules and
follows its behaviour; where those moved or changed between torch versions,
the difference is resolved here, by feature tests (try-import, hasattr)
rather than version comparisons, and the rest of dcpx uses the names below.
Each entry says which torch versions it covers.

Entries are grouped by who keeps them: newer torch (2.9 and later) first,
older torch (2.4 - 2.8) after.
"""
from __future__ import annotations

from typing import Any, Iterable

# ---------------------------------------------------------------- torch >= 2.9

# CheckpointableTensor (torch 2.14+, torch.distributed.checkpoint.protocol): a
# plain torch.Tensor carrying ``global_shape`` / ``global_offsets`` /
# ``local_offsets`` / ``local_sizes`` is saved and loaded by torch's planner
# as shards of a larger global tensor, not as a tensor of its own shape.
# dcpx's own planner does not do that, so such values take torch's planner
# (``dcpx._plan.plain_tensor`` is False for them).  torch 2.4 - 2.13 have no
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


# ---------------------------------------------------------------- torch <= 2.8
