"""Command-line tools for DCP checkpoints (dcpx's or torch's).

    python -m dcpx inspect CHECKPOINT     what is in it: keys, dtypes, shapes, files
    python -m dcpx verify CHECKPOINT      read every record and check its CRC-32,
                                          one line for each problem found

Both read the metadata with dcpx's safe unpickler: inspecting or verifying
an untrusted checkpoint never runs code from it.

Exit status: 0 the checkpoint is sound (verify: every record read and
checked); 1 the checkpoint has problems (verify reports every one, one line
each, naming the key and the file: a corrupt or unreadable .metadata, a
missing, truncated or unreadable data file, a CRC-32 mismatch, a value that
does not unpickle); 2 no checkpoint to check: a usage error, or the path
does not exist, is not a directory, or has no .metadata (never committed).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Optional, Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from .filesystem import FileSystemReader, _TensorRead, check_zip_crcs, read_regular


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def inspect_checkpoint(path: str, limit: int, out=None) -> int:
    out = out or sys.stdout  # looked up per call: redirect_stdout works
    reader = FileSystemReader(path)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    files: dict[str, int] = defaultdict(int)
    for info in md.storage_data.values():
        files[info.relative_path] += info.length
    tensors = {k: v for k, v in md.state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata)}
    nbytes = sum(v.size.numel() * torch.empty((), dtype=v.properties.dtype).element_size()
                 for v in tensors.values())
    print(f"checkpoint {path}", file=out)
    print(f"  version {md.version}, {len(tensors)} tensors ({_human(nbytes)}), "
          f"{len(md.state_dict_metadata) - len(tensors)} other values, "
          f"{len(files)} data files ({_human(sum(files.values()))})", file=out)
    shown = 0
    for key, v in sorted(md.state_dict_metadata.items()):
        if shown == limit:
            print(f"  ... {len(md.state_dict_metadata) - limit} more (use --limit)", file=out)
            break
        if isinstance(v, TensorStorageMetadata):
            dtype = str(v.properties.dtype).removeprefix("torch.")
            chunks = f", {len(v.chunks)} chunks" if len(v.chunks) != 1 else ""
            print(f"  {key}: {dtype}{list(v.size)}{chunks}", file=out)
        elif isinstance(v, BytesStorageMetadata):
            print(f"  {key}: (pickled value)", file=out)
        shown += 1
    return 0


def _check_archive(reader: FileSystemReader, info) -> None:
    """CRC-check every record of a tensor's zip archive, not only the ones
    load reads (load checks data.pkl and the tensor bytes)."""
    raw = read_regular(reader.path / info.relative_path, info.offset, info.length)
    check_zip_crcs(raw, f"{reader.path / info.relative_path} at offset {info.offset}")


def verify_checkpoint(path: str, out=None) -> int:
    """Read every tensor chunk (CRC-checked), CRC-check every other record of
    its archive, and load every value (weights_only); report each problem,
    one line each, and keep going.  Returns the number of problems.

    Raises IncompleteCheckpointError / NotADirectoryError when there is no
    checkpoint at ``path`` at all (exit status 2)."""
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

    # Validate each entry on its own (the reader stops at the first bad one)
    # so that every missing file and every bad extent is reported.
    good = {}
    for index, info in md.storage_data.items():
        try:
            reader._validate_storage(Metadata(state_dict_metadata=md.state_dict_metadata,
                                              storage_data={index: info}))
            good[index] = info
        except Exception as e:
            bad(getattr(index, "fqn", repr(index)), e)
    reader.set_up_storage_reader(
        Metadata(state_dict_metadata=md.state_dict_metadata, storage_data=good,
                 planner_data=md.planner_data, storage_meta=md.storage_meta), True)

    checked = 0
    for index, info in good.items():
        sdm = md.state_dict_metadata.get(index.fqn)
        try:
            if isinstance(sdm, TensorStorageMetadata):
                chunk, dtype = reader._chunk_of(index)
                target = torch.empty(chunk, dtype=dtype)
                reader.read_tensors([_TensorRead(index.fqn, info, chunk, dtype, target, None)])
                _check_archive(reader, info)
            else:
                reader.read_bytes(index.fqn, info)
            checked += 1
        except Exception as e:
            bad(index.fqn, e)
    status = "OK" if problems == 0 else f"{problems} problem(s)"
    print(f"{path}: {checked} records verified, {status}", file=out)
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    exit_status = __doc__.split("\n\n")[-1].strip()
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="dcpx", description=__doc__.split("\n\n")[0],
                                epilog=exit_status, formatter_class=fmt)
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("inspect", help="list what a checkpoint holds",
                        epilog=exit_status, formatter_class=fmt)
    pi.add_argument("checkpoint")
    pi.add_argument("--limit", type=int, default=50, help="keys to list (default 50)")
    pv = sub.add_parser("verify", help="check every record of a checkpoint",
                        epilog=exit_status, formatter_class=fmt)
    pv.add_argument("checkpoint")
    args = p.parse_args(argv)  # usage errors: exit status 2 (argparse)
    try:
        if args.cmd == "inspect":
            return inspect_checkpoint(args.checkpoint, args.limit)
        return 1 if verify_checkpoint(args.checkpoint) else 0
    except (IncompleteCheckpointError, NotADirectoryError) as e:
        print(f"dcpx {args.cmd}: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError, ValueError) as e:
        print(f"dcpx {args.cmd}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
