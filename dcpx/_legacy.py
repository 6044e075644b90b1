"""Checkpoints in the layout torch 2.0-2.3 wrote: torch's ``2_3`` fallback.

Before torch 2.4, ``flatten_state_dict`` stopped at any container holding
no tensor (``_traverse.traverse_state_dict_v_2_3``): an optimizer's
``param_groups`` list, a scheduler's state dict, any dict of plain values
was saved as *one* bytes item under its path (``optim.param_groups``),
where torch >= 2.4 flattens it down to its leaves
(``optim.param_groups.0.lr``, ...).  torch loads the old layout through a
fallback in ``DefaultLoadPlanner.create_local_plan``: when the checkpoint
holds keys the state dict's flattening lacks, it flattens the state dict
again the 2.3 way, and uses that flattening if any of its keys is among
the missing ones.  ``legacy_layout`` is that decision, for dcpx's own load
path (``_dist._load_flat``).

The keys that only the 2.3 flattening has are paths of containers that
hold no tensor, which the 2.3 writer saved as bytes items: so only the
checkpoint's bytes items missing from the flattening are looked at, and
torch's flattening runs again only when one of them is the path of a
container in the state dict being loaded: found by one lookup per dotted
segment (empty containers included), or, for keys that hold dots, as a
prefix of a non-tensor leaf's path (an empty container under a dotted key
is the one case this misses).  A load of a current-layout checkpoint pays
one dict lookup per bytes item.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable, Optional

import torch

_ABSENT = object()
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _child(node: Any, key: str) -> Any:
    """node's entry whose flattened name (``str(key)``) is ``key``."""
    if isinstance(node, Mapping):
        try:
            if key in node:
                return node[key]
        except TypeError:
            pass
        if key.isdigit():
            try:
                return node[int(key)] if int(key) in node else _ABSENT
            except TypeError:
                return _ABSENT
        return _ABSENT
    if isinstance(node, list) and key.isdigit() and int(key) < len(node):
        return node[int(key)]
    return _ABSENT


def _container_at(node: Any, fqn: str) -> bool:
    """Whether ``fqn``, one key per dotted segment, leads from ``node`` to
    a Mapping or a list (empty ones included).  One lookup per segment:
    the keys come from the checkpoint, so no split is tried twice."""
    for seg in fqn.split("."):
        node = _child(node, seg)
        if node is _ABSENT:
            return False
    return isinstance(node, (Mapping, list))


def _leaf_container(flat: dict, mappings: dict, missing: list) -> bool:
    """Whether a missing key is the path of a container above a non-tensor
    leaf of the flattening (its keys may hold dots: ``_container_at``
    cannot split them).  Only the non-tensor leaves are looked at: a
    container the 2.3 flattening keeps whole holds no tensor."""
    if set(map(type, flat.values())).issubset(_PLAIN):
        return False
    wanted = set(missing)
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            continue
        path = mappings[key]
        for i in range(1, len(path)):
            if ".".join(map(str, path[:i])) in wanted:
                return True
    return False


def flatten_v2_3(state_dict: dict) -> tuple[dict, dict]:
    """torch's ``flatten_state_dict`` with ``_version._derived_version ==
    "2_3"``, without setting that process-wide flag."""
    from torch.distributed.checkpoint._traverse import traverse_state_dict_v_2_3
    flat: dict = {}
    mappings: dict = {}

    def flat_copy(path: tuple, value: Any) -> None:
        fqn = ".".join(map(str, path))
        if fqn in flat:
            raise ValueError(f"duplicated flatten key {fqn}")
        flat[fqn] = value
        mappings[fqn] = path

    traverse_state_dict_v_2_3(state_dict, flat_copy)
    return flat, mappings


def legacy_layout(original: dict, flat: dict, mappings: dict, byte_keys: Iterable[str]
                  ) -> Optional[tuple[dict, dict]]:
    """(flat, mappings) of the 2.3 flattening of ``original`` when torch's
    DefaultLoadPlanner would load the checkpoint through it (its
    ``2_3`` fallback); None to keep ``flat``.  ``byte_keys``: the keys of
    the checkpoint's bytes items."""
    missing = [k for k in byte_keys if k not in flat]
    if not missing or not (any(_container_at(original, k) for k in missing)
                           or _leaf_container(flat, mappings, missing)):
        return None
    old_flat, old_mappings = flatten_v2_3(original)
    if any(k in old_flat for k in missing):
        return old_flat, old_mappings
    return None
