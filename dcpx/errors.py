"""Exceptions raised by dcpx.

Every error about a checkpoint (these classes, and the OSErrors of staging,
writing, committing and reading, on this rank or reported from another)
names the checkpoint path and, where one is involved, the state-dict key
(fully qualified name), the data file and the rank.  Errors about the state
dict itself (a value that cannot be saved) name the key, as torch's do.
"""

__all__ = [
    "CheckpointError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
]


class CheckpointError(RuntimeError):
    """Base class of dcpx's checkpoint errors."""


class IncompleteCheckpointError(FileNotFoundError, CheckpointError):
    """The checkpoint directory has no committed metadata: it does not exist,
    was never finished, or its save was interrupted before the commit.
    (FileNotFoundError first, so that errno and filename are kept.)"""


class CorruptCheckpointError(CheckpointError):
    """Checkpoint bytes are inconsistent: a CRC-32 mismatch, a truncated or
    malformed record, or metadata that contradicts the data files."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A pickle in the checkpoint asks for something outside dcpx's
    allow-list (it could run code); it was not loaded."""
