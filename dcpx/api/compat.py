"""The rest of ``torch.distributed.checkpoint``'s namespace.

* ``save_state_dict`` / ``load_state_dict``: torch's deprecated forms of
  save / load, with torch's semantics (a storage object, reset without a
  checkpoint id; no Stateful handling; ``no_dist`` not inferred; a
  ``coordinator_rank``), on dcpx's save / load where those semantics are
  theirs, on torch's own implementation otherwise.
* ``torch_public_names()``: the public names the installed torch's package
  exports, which ``dcpx/__init__.py`` makes sure dcpx has (torch's object
  where dcpx has none of its own).
"""
from __future__ import annotations

import types
import warnings
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as _tdcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import (
    _load_state_dict as _torch_load_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import (
    _save_state_dict as _torch_save_state_dict,
)

from .save_load import is_stateful, load, save

__all__ = ["save_state_dict", "load_state_dict", "torch_public_names"]


def torch_public_names() -> list[str]:
    """torch.distributed.checkpoint's public names in the installed torch:
    its ``__all__`` if it has one, else its attributes not starting with an
    underscore, modules aside."""
    names = getattr(_tdcp, "__all__", None)
    if names is None:
        names = [n for n in dir(_tdcp) if not n.startswith("_")]
    return sorted(n for n in names
                  if not isinstance(getattr(_tdcp, n, None), types.ModuleType))


def _dcpx_semantics(state_dict: dict, coordinator_rank: int,
                    no_dist: bool) -> bool:
    """dcpx's save / load do exactly what torch's deprecated form does:
    rank 0 coordinates, no top-level Stateful (torch's deprecated forms pickle
    it as a value), and a process group exists unless no_dist (torch's raise
    "Default process group has not been initialized" otherwise)."""
    if coordinator_rank != 0 or not isinstance(state_dict, dict):
        return False
    if any(is_stateful(v) for v in state_dict.values()):
        return False
    return no_dist or (dist.is_available() and dist.is_initialized())


def save_state_dict(
    state_dict: dict[str, Any],
    storage_writer: Any,
    process_group: Optional[Any] = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: Optional[Any] = None,
) -> Metadata:
    """Deprecated (as in torch): use :func:`dcpx.save`.  Same signature and
    semantics as ``torch.distributed.checkpoint.save_state_dict``."""
    warnings.warn("`save_state_dict` is deprecated and will be removed in future "
                  "versions.Please use `save` instead.", FutureWarning, stacklevel=2)
    storage_writer.reset()
    if _dcpx_semantics(state_dict, coordinator_rank, no_dist):
        return save(state_dict, storage_writer=storage_writer, planner=planner,
                    process_group=process_group, no_dist=no_dist)
    return _torch_save_state_dict(state_dict, storage_writer, process_group,
                                  coordinator_rank, no_dist, planner)


def load_state_dict(
    state_dict: dict[str, Any],
    storage_reader: Any,
    process_group: Optional[Any] = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: Optional[Any] = None,
) -> None:
    """Deprecated (as in torch): use :func:`dcpx.load`.  Same signature and
    semantics as ``torch.distributed.checkpoint.load_state_dict``."""
    warnings.warn("`load_state_dict` is deprecated and will be removed in future "
                  "versions. Please use `load` instead.", FutureWarning, stacklevel=2)
    storage_reader.reset()
    if _dcpx_semantics(state_dict, coordinator_rank, no_dist):
        load(state_dict, storage_reader=storage_reader, planner=planner,
             process_group=process_group, no_dist=no_dist)
        return None
    return _torch_load_state_dict(state_dict, storage_reader, process_group,
                                  coordinator_rank, no_dist, planner)
