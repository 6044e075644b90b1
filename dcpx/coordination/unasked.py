"""dcpx.load's warning for keys a load left out: the checkpoint holds keys
under a top-level key of the state dict that the state dict did not ask for
(``optim.state.0.exp_avg`` when ``{"optim": optim}`` holds a freshly made
optimizer, whose ``state_dict()`` is empty).  torch's load skips them
without a word; the resume then goes on with a fresh optimizer state.

Cheap where nothing was left out, which is the common case: without
``allow_partial_load`` every key asked for is in the checkpoint (else the
load fails), so keys were left out exactly when the checkpoint holds more
keys than were asked for; one comparison of two counts (the checkpoint's
count is kept with its cached metadata).  Only then are the keys listed
(which decodes the whole ``.metadata`` where the fast path had read only
its index) and compared.
"""
from __future__ import annotations

import warnings
from typing import Iterable

from ..formats.values import _outside_dcpx
from ..errors import UnloadedKeysWarning

__all__ = ["warn_unloaded"]

_SHOWN = 5


def left_out(ckpt_keys: Iterable[str], asked: dict, top_keys: Iterable) -> dict:
    """{top-level key: sorted keys of the checkpoint under it not asked for}."""
    prefixes = sorted((str(k) for k in top_keys), key=len, reverse=True)
    out: dict = {}
    for key in ckpt_keys:
        if key in asked:
            continue
        for p in prefixes:  # the longest top-level key the checkpoint key is under
            if key.startswith(p) and (len(key) == len(p) or key[len(p)] == "."):
                out.setdefault(p, []).append(key)
                break
    return {p: sorted(v) for p, v in out.items()}


def warn_unloaded(ck, count: int, flat: dict, top_keys: Iterable, where) -> None:
    """Warn (UnloadedKeysWarning) if the checkpoint ``ck`` (``count`` keys,
    ``ck.key_count()`` taken before the load) holds keys under a top-level
    key of the state dict that ``flat`` did not ask for.  The warning names
    the first caller outside dcpx (the line that called dcpx.load, or
    CheckpointManager.load), however many dcpx frames lie between."""
    if count <= len(flat):
        return
    found = left_out(ck.keys(), flat, top_keys)
    for prefix, keys in found.items():
        shown = ", ".join(repr(k) for k in keys[:_SHOWN])
        more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
        warnings.warn(
            f"dcpx.load: {where}: the checkpoint holds {len(keys)} key(s) under {prefix!r} that "
            f"the state dict did not ask for, so they were not loaded: {shown}{more}. A freshly "
            f"made optimizer's state_dict() is empty and asks for none of its state: resume "
            f"with dcpx.CheckpointManager, or load get_state_dict(model, optim) and apply it with "
            f"set_state_dict (torch.distributed.checkpoint.state_dict). To load part of an entry "
            f"on purpose, pass planner=DefaultLoadPlanner(allow_partial_load=True) (docs/api.md, "
            f"\"Keys a load leaves out\").", UnloadedKeysWarning, stacklevel=_outside_dcpx())
