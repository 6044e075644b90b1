"""The node-local tier's public names (docs/tiers.md): ``LocalTierFullError``
and ``Topology``.  The tier itself is ``dcpx.manager.tiers``, behind
``dcpx.CheckpointManager(local_root=...)``."""
from .manager.tiers import LocalTierFullError, Topology  # noqa: F401

__all__ = ["LocalTierFullError", "Topology"]
