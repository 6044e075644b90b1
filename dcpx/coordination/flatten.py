"""flatten_state_dict(): torch's ``flatten_state_dict``, walked in C.

Every save and load flattens the caller's state dict first.  torch's
function (distributed/checkpoint/_nested_dict.py over _traverse.py) costs
a few microseconds per entry in Python; ``dcpx._C.flatten_state_dict``
walks the same containers by the same rules in one C pass and returns the
same keys, in the same order, the same object paths and the very same
value objects (csrc/flatten.c; docs/design.md, Walking the state dict).

Where the C walk cannot be sure to match torch, it returns None and
torch's own function runs instead: torch's pre-2.4 traversal
(``_version._derived_version == "2_3"``), a Mapping whose ``items()``
yields something other than pairs, a key whose ``str()`` is a str
subclass, nesting deeper than 100 levels (torch's recursion limit then says
where a RecursionError starts), or an ABC registry in which a builtin type
became a Mapping.
"""
from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint._nested_dict import (
    flatten_state_dict as _torch_flatten_state_dict,  # the fallback only
)

from .. import _C
from .._torchcompat import derived_version


def flatten_state_dict(state_dict: Any) -> tuple[dict[str, Any], dict[str, tuple]]:
    """``(flat, mappings)`` exactly as torch's ``flatten_state_dict``
    returns them."""
    derived = derived_version()
    if not (derived is not None and derived == "2_3"):
        out = _C.flatten_state_dict(state_dict)
        if out is not None:
            return out
    return _torch_flatten_state_dict(state_dict)
