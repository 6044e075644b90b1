"""A ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` passed to dcpx's save /
load is left set up as torch's save / load leave it, though dcpx plans
without it (its fast paths do the default planner's job themselves).

torch calls ``set_up_planner`` and the planning methods on the planner it is
given, and code reads the results afterwards (torch's own tests read
``planner.metadata.version`` after a load).  Done here only when a planner
object was passed (``planner=None`` costs nothing): after a load, the
attributes ``set_up_planner`` sets (``original_state_dict``, ``state_dict``,
``mappings``, ``metadata``, ``is_coordinator``); after a save, those of
``set_up_planner`` (``state_dict``, ``mappings``, ``is_coordinator``), the
plan (``plan``: this rank's, as ``finish_plan`` leaves it in one process,
the local plan with a process group) and, in one process, ``global_plan``
and ``metadata`` (the committed checkpoint's).  With a process group dcpx's
coordinator never sees the other ranks' plans as SavePlans, so
``global_plan`` is not set there (docs/migration.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata


def after_load(planner: Any, state_dict: dict, is_coordinator: bool, reader: Any) -> None:
    """Set up ``planner`` (a DefaultLoadPlanner dcpx did not call) as torch's
    load leaves it; ``state_dict`` is what was loaded (Statefuls as their
    state dicts), ``reader`` the set-up reader."""
    if type(planner) is not DefaultLoadPlanner:
        return
    from .flatten import flatten_state_dict
    planner.original_state_dict = state_dict
    flat, planner.mappings = flatten_state_dict(state_dict)
    planner.state_dict = flat
    planner.metadata = reader.read_metadata()
    planner.is_coordinator = is_coordinator


def after_save(planner: Any, state_dict: dict, metadata: Optional[Metadata],
               is_coordinator: bool, distributed: bool) -> None:
    """Set up ``planner`` (a DefaultSavePlanner dcpx did not call) as torch's
    save leaves it; ``state_dict`` is what was saved (Statefuls as their
    state dicts), ``metadata`` the committed checkpoint's."""
    if type(planner) is not DefaultSavePlanner:
        return
    from .stateful import _stateful_to_state_dict
    from .flatten import flatten_state_dict
    flat, planner.mappings = flatten_state_dict(_stateful_to_state_dict(state_dict))
    planner.state_dict = flat
    planner.is_coordinator = is_coordinator
    plan = dataclasses.replace(create_default_local_save_plan(flat, is_coordinator),
                               planner_data=planner.mappings)
    planner.plan = plan
    if distributed:
        return
    global_plan, _ = create_default_global_save_plan([plan])
    planner.global_plan = global_plan
    planner.plan = global_plan[0]
    if metadata is not None:
        planner.metadata = metadata
