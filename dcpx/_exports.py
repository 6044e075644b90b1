"""dcpx's public names: its API and the torch.distributed.checkpoint names it
re-exports.  ``import dcpx`` imports this module (and with it torch) on the
first use of any of these names, or at once when torch is already imported
(dcpx/__init__.py), so that ``dcpx --help`` and ``dcpx --version`` do not
import torch."""
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.stateful import Stateful

# torch.distributed.checkpoint's names that dcpx takes as torch's own objects:
# dcpx's save / load / storage accept torch's planners, plans and storage
# protocols, and dcpx's errors subclass CheckpointException (dcpx.errors).
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    StorageReader,
    StorageWriter,
    WriteItem,
    load_sharded_optimizer_state_dict,
)

from . import _C
from .api.save_load import load, save
from .api.async_save import AsyncCheckpointerType, AsyncSaveResponse, async_save
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from .filesystem import FileSystemReader, FileSystemWriter
from .manager.checkpoint_manager import CheckpointManager
from .staging import DefaultStager, StagingOptions, release_staging_buffers
from .api.compat import load_state_dict, save_state_dict, torch_public_names
# dcpx's own fsspec storage (fsspec itself is imported on first use): where
# an installed torch exports FsspecWriter / FsspecReader at the top level,
# ``dcpx.FsspecWriter`` must still be dcpx's (C writer, CRCs, commit last),
# not torch's taken by the loop below.
from .fsspec import FsspecReader, FsspecWriter

__all__ = [
    "save",
    "async_save",
    "load",
    "AsyncCheckpointerType",
    "AsyncSaveResponse",
    "CheckpointManager",
    "DefaultStager",
    "StagingOptions",
    "release_staging_buffers",
    "FileSystemWriter",
    "FileSystemReader",
    "FsspecWriter",
    "FsspecReader",
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
    "save_state_dict",
    "load_state_dict",
    "CheckpointException",
    "DefaultSavePlanner",
    "DefaultLoadPlanner",
    "SavePlan",
    "LoadPlan",
    "SavePlanner",
    "LoadPlanner",
    "ReadItem",
    "WriteItem",
    "StorageReader",
    "StorageWriter",
    "load_sharded_optimizer_state_dict",
]


def _take_torch_names() -> None:
    """Every other public name of the installed torch.distributed.checkpoint
    (the Hugging Face storage classes, names a newer torch adds): torch's
    object, so that ``import dcpx as dcp`` never lacks one."""
    import torch.distributed.checkpoint as tdcp
    g = globals()
    for name in torch_public_names():
        if name not in g:
            g[name] = getattr(tdcp, name)
            __all__.append(name)


_take_torch_names()
del _take_torch_names, torch_public_names
