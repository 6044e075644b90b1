"""Coordination: what a save writes and a load reads, and how the ranks
agree on it.

* ``flatten``: a state dict walked by torch's ``flatten_state_dict`` rules
  (in C); ``stateful``: models, optimizers and other ``Stateful`` values at
  the top of a state dict; ``planner_state``: a torch planner passed to
  dcpx left as torch leaves it;
* ``plan``: one planner for one process and for several ranks: each value's
  payload, the items a rank writes, the global plan (dedup, balance, the
  tensor metadata);
* ``dist``: the collectives of a multi-rank save (plans gathered, write
  assignments scattered, file layouts gathered, the commit broadcast) and
  load (read plans, resharding, one status all_gather);
* ``readplan``: parsed metadata and compiled read plans, kept for the next
  load of the same checkpoint; ``unasked``: the warning for keys a load
  left out; ``gcpause``: the cyclic collector paused around allocation-heavy
  phases.

Imports: ``dcpx.storage``, ``dcpx.formats`` and the base only
(tests/test_import_layers.py).  A new collective, or a new way for ranks
to agree on a plan, goes here.
"""
