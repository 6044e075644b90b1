"""What CheckpointManager saves and loads for a model, an optimizer, an LR
scheduler, or a list of them, at the top level of the state dict.

Through DCP's Stateful protocol alone, ``{"model": model, "optim": optim}``
resumes with an empty optimizer state: a freshly made optimizer's
``state_dict()`` holds no ``state`` entries, so the load asks for none and
loads none, without a word (torch DCP behaves the same).  torchtitan avoids
it with wrappers over ``torch.distributed.checkpoint.state_dict``; the
manager does what they do (docs/manager.md, "What the state dict may hold"):

* an ``nn.Module`` (or a list of them, the parts of a pipeline) is saved as
  ``get_model_state_dict`` of each part, merged (torchtitan's
  ``ModelWrapper``), and loaded with ``set_model_state_dict``;
* an optimizer (or a list of them) as ``get_optimizer_state_dict`` of the
  part whose parameters it steps, flattened and keyed by parameter name
  (torchtitan's ``OptimizersContainer``); those functions create a fresh
  optimizer's state first, so a resume asks for (and loads) all of it.  The
  part must be in the state dict too: otherwise the optimizer is refused,
  naming its key;
* a list of other Stateful objects (LR schedulers) as ``{"0": sd0, "1":
  sd1, ...}``; a single one goes through the Stateful protocol as before.

FSDP2 / DTensor models work as they do with those torch functions.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["wrap_state_dict"]


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _merge(where: str, what: str, dicts: list) -> dict:
    """One dict of the parts' dicts, whose keys must not collide."""
    if len(dicts) == 1:
        return dicts[0]
    out: dict = {}
    for i, d in enumerate(dicts):
        for k, v in d.items():
            if k in out:
                raise ValueError(
                    f"{where}: the {what} in the list share the key {k!r} (part {i} and an "
                    f"earlier one): a list is saved as one state dict, as the stages of one "
                    f"pipeline-parallel model are (torchtitan's ModelWrapper); give separate "
                    f"models their own top-level keys ({{'gen': gen, 'disc': disc}})")
            out[k] = v
    return out


class ModelState(Stateful):
    """One model, or the parts of one, as torchtitan's ``ModelWrapper``."""

    def __init__(self, parts: list, where: str = "dcpx") -> None:
        self.parts = parts
        self.where = where

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return _merge(self.where, "models", [get_model_state_dict(p) for p in self.parts])

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )
        strict = len(self.parts) == 1  # each part takes its own keys of the merged dict
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=strict))


class OptimizerState(Stateful):
    """Optimizers, each with the model part it steps, as torchtitan's
    ``OptimizersContainer`` (flattened, keyed by parameter name)."""

    def __init__(self, pairs: list, where: str = "dcpx") -> None:
        self.pairs = pairs  # [(model part, optimizer)]
        self.where = where

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return _merge(self.where, "optimizers",
                      [get_optimizer_state_dict(m, o, options=_options()) for m, o in self.pairs])

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        for model, optim in self.pairs:
            set_optimizer_state_dict(model, optim, state_dict, options=_options())


class ListState(Stateful):
    """A list of Stateful objects (LR schedulers...), as ``{"0": sd0, ...}``."""

    def __init__(self, items: list) -> None:
        self.items = items

    def state_dict(self) -> dict:
        return {str(i): x.state_dict() for i, x in enumerate(self.items)}

    def load_state_dict(self, state_dict: dict) -> None:
        for i, x in enumerate(self.items):
            x.load_state_dict(state_dict[str(i)])


def _items(value: Any, cls: type) -> Optional[list]:
    """The value as a non-empty list of ``cls`` instances, or None."""
    if isinstance(value, cls):
        return [value]
    if (isinstance(value, (list, tuple)) and value
            and all(isinstance(v, cls) for v in value)):
        return list(value)
    return None


def _owner(optim: torch.optim.Optimizer, parts: list) -> Optional[torch.nn.Module]:
    """The model part holding every parameter ``optim`` steps."""
    wanted = {id(p) for g in optim.param_groups for p in g["params"]}
    for part in parts:
        if wanted <= {id(p) for p in part.parameters()}:
            return part
    return None


def wrap_state_dict(state_dict: dict, where: str) -> tuple[dict, set]:
    """(a new dict with the models, optimizers and lists of Stateful objects
    at its top level replaced as the module docstring says, the keys
    replaced).  Raises ValueError for an optimizer whose model is not in
    the state dict."""
    parts: list = []
    for value in state_dict.values():
        modules = _items(value, torch.nn.Module)
        if modules is not None:
            parts.extend(modules)
    out, wrapped = dict(state_dict), set()
    for key, value in state_dict.items():
        modules = _items(value, torch.nn.Module)
        if modules is not None:
            out[key] = ModelState(modules, where)
            wrapped.add(key)
            continue
        optims = _items(value, torch.optim.Optimizer)
        if optims is not None:
            pairs = []
            for i, optim in enumerate(optims):
                owner = _owner(optim, parts)
                if owner is None:
                    name = repr(key) if len(optims) == 1 else f"{key!r}[{i}]"
                    raise ValueError(
                        f"{where}: {name} is an optimizer whose parameters belong to no "
                        f"nn.Module in the state dict; put the model in it too (e.g. "
                        f"{{'model': model, {key!r}: optim}}): the optimizer's state is saved "
                        f"keyed by parameter name (torch.distributed.checkpoint.state_dict."
                        f"get_optimizer_state_dict), which needs the model, and a fresh "
                        f"optimizer's own state_dict() asks for none of its state on resume")
                pairs.append((owner, optim))
            out[key] = OptimizerState(pairs, where)
            wrapped.add(key)
            continue
        if (isinstance(value, (list, tuple)) and value
                and all(isinstance(v, Stateful) and not isinstance(v, torch.Tensor)
                        for v in value)):
            out[key] = ListState(list(value))
            wrapped.add(key)
    return out, wrapped


#: types whose instances are never Stateful (no state_dict / load_state_dict)
_NEVER_STATEFUL = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, bytes,
                             type(None), dict, list, tuple})
def is_stateful(obj: Any) -> bool:
    """isinstance(obj, Stateful) without the runtime-Protocol cost for the
    common case (tensors, numbers, strings), which costs ~10 us per call."""
    if type(obj) in _NEVER_STATEFUL:
        return False
    if isinstance(obj, (torch.Tensor, int, float, str, bytes, type(None))):
        return False
    return isinstance(obj, Stateful)


def _stateful_to_state_dict(state_dict: dict) -> dict:
    """A new dict: each top-level Stateful value replaced by its
    state_dict().  A state dict holding only types that never are Stateful
    is copied as it is, without a Python call per entry."""
    if _NEVER_STATEFUL.issuperset(map(type, state_dict.values())):
        return dict(state_dict)
    return {k: (v.state_dict() if is_stateful(v) else v)
            for k, v in state_dict.items()}
