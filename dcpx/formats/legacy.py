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
container in the state dict being loaded (empty ones included), found by
a lookup per dotted segment (``_container_at``).  A load of a
current-layout checkpoint pays one dict lookup per bytes item.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable, Optional

_ABSENT = object()


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


def _longest_key(node: Mapping, cache: dict) -> int:
    """Length of node's longest flattened key name (computed once a call)."""
    n = cache.get(id(node))
    if n is None:
        n = cache[id(node)] = max((len(str(k)) for k in node), default=0)
    return n


def _container_at(root: Any, fqn: str, cache: dict) -> bool:
    """Whether ``fqn`` leads from ``root`` to a Mapping or a list (empty
    ones included).  Each dotted segment is looked up as a key; where it
    is not one, the segments that follow are joined to it (a key may hold
    dots) up to the length of the node's longest key: the keys come from
    the checkpoint, and this bounds the work a crafted one can cause."""
    segs = fqn.split(".")
    node, i = root, 0
    while i < len(segs):
        key, j = segs[i], i + 1
        child = _child(node, key)
        if child is _ABSENT and isinstance(node, Mapping):
            cap = _longest_key(node, cache)
            while j < len(segs) and len(key) < cap:
                key += "." + segs[j]
                j += 1
                child = _child(node, key)
                if child is not _ABSENT:
                    break
        if child is _ABSENT:
            return False
        node, i = child, j
    return isinstance(node, (Mapping, list))


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


def legacy_layout(original: dict, flat: dict, byte_keys: Iterable[str]
                  ) -> Optional[tuple[dict, dict]]:
    """(flat, mappings) of the 2.3 flattening of ``original`` when torch's
    DefaultLoadPlanner would load the checkpoint through it (its
    ``2_3`` fallback); None to keep ``flat``.  ``byte_keys``: the keys of
    the checkpoint's bytes items."""
    missing = [k for k in byte_keys if k not in flat]
    cache: dict = {}
    if not missing or not any(_container_at(original, k, cache) for k in missing):
        return None
    old_flat, old_mappings = flatten_v2_3(original)
    if any(k in old_flat for k in missing):
        return old_flat, old_mappings
    return None
