"""``dcpx verify CKPT``: read every record of a DCP checkpoint and check it."""
from __future__ import annotations

import sys
from typing import Optional

from ._common import progress

HELP = "check every record of a checkpoint (CRC-32s, values, extents)"


def _check_archive(reader: FileSystemReader, index, info) -> int:
    """CRC-check every record of a tensor's zip archive, not only the ones
    load reads (load checks data.pkl and the tensor bytes); the number of
    records that carry no CRC.  A SAFETENSORS tensor has no archive (its
    header was checked when the reader was set up: docs/format.md); a
    compressed one is decompressed first."""
    from ..filesystem import check_zip_crcs, is_raw, read_regular
    info = reader.storage_data.get(index, info)  # as resolved (dcpx.formats.entries)
    if is_raw(info):
        return 0
    if getattr(info, "transform_descriptors", None):
        chunk, dtype = reader.chunk_of(index)  # inflated to the chunk's bytes at most
        raw = reader.read_tensor_record(index.fqn, info, chunk, dtype)
    else:
        raw = read_regular(reader.path / info.relative_path, info.offset, info.length)
    return check_zip_crcs(raw, f"{reader.path / info.relative_path} at offset {info.offset}")


def verify_checkpoint(path: str, out=None, *, show_progress: bool = False,
                      errors: Optional[list] = None, allow_pickle: bool = False) -> int:
    """Read every tensor chunk (CRC-checked), CRC-check every other record of
    its archive, and load every value (weights_only); report each problem,
    one line each, and keep going.  Returns the number of problems.

    Raises IncompleteCheckpointError / NotADirectoryError when there is no
    checkpoint at ``path`` at all (exit status 2).  ``errors``: a list that
    gets each problem as (what, exception); ``allow_pickle``: the reader's
    (CheckpointManager's ``load_options``)."""
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    from ..errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
    from ..filesystem import FileSystemReader, check_zip_crcs

    out = out or sys.stdout  # looked up per call: redirect_stdout works
    reader = FileSystemReader(path, allow_pickle=allow_pickle)
    problems = 0

    def bad(what: str, e: BaseException) -> None:
        nonlocal problems
        problems += 1
        if errors is not None:
            errors.append((what, e))
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
    try:
        reader.set_up_storage_reader(
            Metadata(state_dict_metadata=md.state_dict_metadata, storage_data=good,
                     planner_data=md.planner_data, storage_meta=md.storage_meta), True)
    except CheckpointError as e:  # a SAFETENSORS header that is malformed (dcpx.formats.entries)
        bad("data files", e)
        print(f"{path}: 0 records verified, {problems} problem(s)", file=out)
        return problems

    checked = 0
    crcless: dict = {}  # key -> records written without a zip CRC-32
    bar = progress(sum(info.length for info in good.values()), "verify", enabled=show_progress)
    with bar:
        for index, info in good.items():
            sdm = md.state_dict_metadata.get(index.fqn)
            try:
                if isinstance(sdm, TensorStorageMetadata):
                    reader.read_chunk(index)
                    n = _check_archive(reader, index, info)
                else:
                    n = check_zip_crcs(reader.read_bytes(index.fqn, info), "")
                if n:
                    crcless[index.fqn] = crcless.get(index.fqn, 0) + n
                checked += 1
            except Exception as e:
                bad(index.fqn, e)
            bar.update(info.length)
    if crcless:
        keys = sorted(crcless)
        print(f"  NO CRC: {sum(crcless.values())} zip record(s) of {len(keys)} key(s) carry "
              f"no CRC-32 (absent, not wrong: written with torch.serialization."
              f"set_crc32_options(False)), so their bytes were not checked: "
              f"{', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}", file=out)
    status = "OK" if problems == 0 else f"{problems} problem(s)"
    print(f"{path}: {checked} records verified, {status}", file=out)
    return problems


def add_parser(sub, **common) -> None:
    p = sub.add_parser("verify", help=HELP, description=HELP + ".", **common)
    p.add_argument("checkpoint")
    p.set_defaults(run=run)


def run(args) -> int:
    return 1 if verify_checkpoint(args.checkpoint, show_progress=True) else 0
