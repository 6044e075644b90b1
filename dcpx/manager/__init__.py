"""dcpx.CheckpointManager: step folders, retention, resume from the newest
intact step, preemption, and the node-local tier (docs/manager.md,
docs/tiers.md).  A client of dcpx's public API, as torchtitan's
checkpointer is of torch's.

* ``checkpoint_manager``: ``CheckpointManager`` and its roots (a local
  folder, an fsspec store);
* ``tiers``: the node-local tier: the local save, replicas on partner
  nodes, the persistent step, resume from what the nodes hold.

Imports: the API layer (``dcpx.api``, ``dcpx.filesystem``, ``dcpx.fsspec``)
and the CLI's checks (``dcpx.cli.verify``, ``dcpx.cli.convert``), and what
lies below them (tests/test_import_layers.py).
"""
from .checkpoint_manager import (  # noqa: F401
    DELETING_PREFIX,
    STEP_RE,
    USER_METADATA_FN,
    CheckpointManager,
    StepSkippedWarning,
    local_step,
)

__all__ = ["CheckpointManager", "StepSkippedWarning"]
