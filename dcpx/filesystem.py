"""FileSystemWriter / FileSystemReader: torch's StorageWriter / StorageReader
protocols, backed by dcpx's C core (the public home of both, as
``torch.distributed.checkpoint.filesystem`` is torch's).

They plug into torch's own ``dcp.save`` / ``dcp.load`` machinery (process
groups, DTensor planners, resharding), and dcpx's own planner
(``dcpx.api.save_load``, ``dcpx.coordination.dist``) calls the same pieces directly.

The code lives in one module per concern, in the order a tensor passes
through them (docs/design.md, "Python modules"):

* ``dcpx.storage.pending``: what the C writer is handed for each value, and the
  data files being written (``PendingWrite``);
* ``dcpx.storage.writer``: ``FileSystemWriter``;
* ``dcpx.storage.commit``: the atomic commit and cleanup;
* ``dcpx.storage.reader``: ``FileSystemReader``;
* ``dcpx.formats.files``: file names, paths and opening checkpoint files.
"""
from .storage.commit import commit  # noqa: F401
from .formats.files import (  # noqa: F401
    _DATA_FILE,
    _TAGGED_DATA_FILE,
    _TMP_METADATA,
    DCP_VERSION,
    LOCAL_PROTOCOLS,
    METADATA_FN,
    _check_dir,
    _fsync_dir,
    local_path,
    open_regular,
    read_regular,
    replaced_by_a_save,
    special_file_error,
    url_protocol,
)

# A save's locks are part of the commit protocol (docs/format.md): tools that
# must tell a live save from a dead one (the CheckpointManager's retention)
# ask through these, not through dcpx.storage.locks.
from .storage.locks import DEAD, LIVE, NO_LOCKS, UNKNOWN, save_lock_state  # noqa: F401
from .storage.pending import (  # noqa: F401
    LazyItem,
    PendingWrite,
    _buckets,
    _Entry,
    check_saveable,
    staged_payload,
    tensor_payload,
    value_payload,
)
from .formats.byteorder import (
    archive_byteorder, swap_untyped, tensors_within,
)  # noqa: F401  (the CLI's torch.save source)
from .coordination.flatten import flatten_state_dict  # noqa: F401  (the CLI reads torch.save files by it)
from .formats.safetensors import is_raw  # noqa: F401  (a SAFETENSORS tensor's resolved entry)
from .formats.files import check_zip_crcs  # noqa: F401  (dcpx verify, the tier)
from ._C import crc32  # noqa: F401  (the tier's checked messages)
from .storage.reader import FileSystemReader, check_castable  # noqa: F401
from ._torchcompat import (  # noqa: F401  (convert's torch.save writer)
    torch_file_writer, torch_save_alignment, torch_save_header)
from .storage.writer import FileSystemWriter, _path_key, _RankPath, complete_metadata  # noqa: F401


__all__ = ["FileSystemWriter", "FileSystemReader", "LazyItem"]

# Pickles and reprs name the public module (the classes live in storage.writer /
# storage.reader): a pickled writer (PROCESS checkpointing) stays loadable.
FileSystemWriter.__module__ = FileSystemReader.__module__ = LazyItem.__module__ = __name__

# A run's step folders (dcpx.CheckpointManager, its tier, dcpx ls).
from .storage.steps import (  # noqa: E402,F401
    DELETING_PREFIX, STEP_RE, info_mtime, local_step, remove_renamed, step_dir)

# The node-local tier's files (pieces, and the persistent step assembled
# from them): dcpx.manager.tiers moves them between ranks, dcpx.storage.pieces writes them.
from .storage import pieces  # noqa: E402,F401
