"""Storage: a save's files written and committed, a load's records read,
on one process's side of a checkpoint (torch's StorageWriter /
StorageReader protocols, over the C core).

* ``writer``: ``FileSystemWriter`` (public as ``dcpx.filesystem``);
  ``pending``: what the C writer is handed for each value and the data files
  in flight; ``commit``: the atomic commit and its cleanup; ``locks``: saves
  into one directory (turns within a process, file locks across processes);
* ``reader``: ``FileSystemReader``: CRC-checked reads into destination
  tensors, safe loading of values;
* ``steps``: a run's ``step-N`` folders; ``pieces``: the node-local tier's
  per-rank pieces and the persistent step assembled from them.

Imports: ``dcpx.formats`` and the base (``dcpx.errors``, ``dcpx._C``,
``dcpx._torchcompat``) only: nothing of ranks or plans
(tests/test_import_layers.py).  A new storage backend's reads and writes go
here; which backend a ``checkpoint_id`` takes is chosen in ``dcpx.api``.
"""
