"""dcpx: a C-accelerated drop-in replacement for torch.distributed.checkpoint.

    import dcpx as dcp          # instead of torch.distributed.checkpoint

Same API, same on-disk format (checkpoints load with either library), with
a C core for the I/O, CRC-32 integrity checks on load, a crash-safe commit
and safe loading of untrusted checkpoints.  See docs/ for details.
"""
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.stateful import Stateful

from . import _C
from ._api import load, save
from ._async import AsyncCheckpointerType, AsyncSaveResponse, async_save
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from .filesystem import FileSystemReader, FileSystemWriter
from .staging import DefaultStager, StagingOptions, release_staging_buffers

__version__ = "0.1.0"

__all__ = [
    "save",
    "async_save",
    "load",
    "AsyncCheckpointerType",
    "AsyncSaveResponse",
    "DefaultStager",
    "StagingOptions",
    "release_staging_buffers",
    "FileSystemWriter",
    "FileSystemReader",
    "Stateful",
    "Metadata",
    "MetadataIndex",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "CheckpointError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "UnsafeCheckpointError",
]
