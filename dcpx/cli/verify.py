"""``dcpx verify CKPT``: read every record of a DCP checkpoint and check it."""
from __future__ import annotations

import sys

from ._common import progress

HELP = "check every record of a checkpoint (CRC-32s, values, extents)"


def _check_archive(reader: FileSystemReader, info) -> None:
    """CRC-check every record of a tensor's zip archive, not only the ones
    load reads (load checks data.pkl and the tensor bytes)."""
    from ..filesystem import check_zip_crcs, read_regular
    raw = read_regular(reader.path / info.relative_path, info.offset, info.length)
    check_zip_crcs(raw, f"{reader.path / info.relative_path} at offset {info.offset}")


def verify_checkpoint(path: str, out=None, *, show_progress: bool = False) -> int:
    """Read every tensor chunk (CRC-checked), CRC-check every other record of
    its archive, and load every value (weights_only); report each problem,
    one line each, and keep going.  Returns the number of problems.

    Raises IncompleteCheckpointError / NotADirectoryError when there is no
    checkpoint at ``path`` at all (exit status 2)."""
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    from ..errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
    from ..filesystem import FileSystemReader

    out = out or sys.stdout  # looked up per call: redirect_stdout works
    reader = FileSystemReader(path)
    problems = 0

    def bad(what: str, e: BaseException) -> None:
        nonlocal problems
        problems += 1
        msg = str(e) if isinstance(e, (CheckpointError, OSError)) else f"{type(e).__name__}: {e}"
        print(f"  BAD {what}: {msg}", file=out)

    try:
        md = reader.read_metadata()
    except (IncompleteCheckpointError, NotADirectoryError):
        raise
    except Exception as e:  # a corrupt, unsafe or unreadable .metadata
        bad(".metadata", e)
        print(f"{path}: 0 records verified, {problems} problem(s)", file=out)
        return problems

    # Every key the metadata declares needs its storage entries.
    for fqn, sdm in md.state_dict_metadata.items():
        if isinstance(sdm, TensorStorageMetadata):
            wanted = [MetadataIndex(fqn, ch.offsets) for ch in sdm.chunks]
        else:
            wanted = [MetadataIndex(fqn)]
        for index in wanted:
            if index not in md.storage_data:
                bad(fqn, CorruptCheckpointError(
                    f"{reader.path}: metadata has no storage entry for {fqn!r}"
                    + (f" at offset {tuple(index.offset)}" if index.offset is not None else "")))

    # Every missing file and every bad extent is reported (the reader's
    # set-up stops at the first), then the readable entries are read.
    refused = set()
    for index, e in reader.check_storage(md):
        bad(getattr(index, "fqn", repr(index)), e)
        refused.add(index)
    good = {index: info for index, info in md.storage_data.items() if index not in refused}
    reader.set_up_storage_reader(
        Metadata(state_dict_metadata=md.state_dict_metadata, storage_data=good,
                 planner_data=md.planner_data, storage_meta=md.storage_meta), True)

    checked = 0
    bar = progress(sum(info.length for info in good.values()), "verify", enabled=show_progress)
    with bar:
        for index, info in good.items():
            sdm = md.state_dict_metadata.get(index.fqn)
            try:
                if isinstance(sdm, TensorStorageMetadata):
                    reader.read_chunk(index)
                    _check_archive(reader, info)
                else:
                    reader.read_bytes(index.fqn, info)
                checked += 1
            except Exception as e:
                bad(index.fqn, e)
            bar.update(info.length)
    status = "OK" if problems == 0 else f"{problems} problem(s)"
    print(f"{path}: {checked} records verified, {status}", file=out)
    return problems


def add_parser(sub, **common) -> None:
    p = sub.add_parser("verify", help=HELP, description=HELP + ".", **common)
    p.add_argument("checkpoint")
    p.set_defaults(run=run)


def run(args) -> int:
    return 1 if verify_checkpoint(args.checkpoint, show_progress=True) else 0
