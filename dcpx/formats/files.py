"""Where a checkpoint's files are and how they are opened: the file names
of the format, local paths and URLs, and opening checkpoint files as
regular files only (no link followed, never blocking on a FIFO); and the
CRC check of a torch.save archive held in memory (a reader's, a tier
replica's and ``dcpx verify``'s)."""
from __future__ import annotations

import errno
import io
import os
import re
import stat
import zipfile
from pathlib import Path
from typing import Optional, Union

from ..errors import CorruptCheckpointError


DCP_VERSION = "1.0.0"
#: the file whose presence commits a checkpoint (torch's ``.metadata``)
METADATA_FN = ".metadata"
_DATA_FILE = re.compile(r"^__\d+_.*\.distcp$")
_TMP_METADATA = re.compile(r"^(__\d+)?\.metadata\.tmp")
_RANK_METADATA = re.compile(r"^__\d+\.metadata$")  # a use_collectives=False save's
_TAGGED_DATA_FILE = re.compile(r"^__\d+_([0-9a-f]{16})_\d+\.distcp$")


def replaced_by_a_save(name: str) -> bool:
    """Whether a DCP save into a folder replaces or removes the file
    ``name`` there: its ``.metadata``, data files, temporary metadata and a
    ``use_collectives=False`` save's per-rank metadata (``dcpx convert``
    refuses to replace such a file it did not write)."""
    return (name == METADATA_FN or bool(_DATA_FILE.match(name))
            or bool(_RANK_METADATA.match(name)) or bool(_TMP_METADATA.match(name)))


def _fsync_dir(path: Union[str, Path]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device"}


def special_file_error(path: Union[str, Path], mode: int,
                       what: str = "") -> CorruptCheckpointError:
    """The error for a checkpoint file that is not a regular file (a FIFO
    would block a read, a link would read or write a file elsewhere)."""
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    why = ("dcpx follows no symbolic links inside a checkpoint directory"
           if stat.S_ISLNK(mode) else "not a regular file")
    return CorruptCheckpointError(f"{path}: {what}is {kind} ({why}; refused)")


def open_regular(path: Union[str, Path]) -> int:
    """A read-only descriptor of the regular file ``path``, opened without
    following a link or blocking on a FIFO (csrc/files.c does the same for
    the C reader).  The checkpoint directory itself may be a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO):  # ENXIO: a socket
            raise
        mode = os.lstat(path).st_mode
        if stat.S_ISREG(mode):
            raise
        raise special_file_error(path, mode) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise special_file_error(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Union[str, Path], offset: int = 0, length: int = -1) -> bytes:
    """``length`` bytes at ``offset`` of a regular checkpoint file (all of
    it from ``offset`` if length < 0); fewer only if the file is shorter."""
    fd = open_regular(path)
    try:
        if length < 0:
            length = max(0, os.fstat(fd).st_size - offset)
        parts, got = [], 0
        while got < length:
            part = os.pread(fd, length - got, offset + got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)
    finally:
        os.close(fd)


def _check_dir(path: Path, create: bool) -> None:
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            20, "dcpx: checkpoint path exists and is not a directory", str(path))
    if create:
        path.mkdir(parents=True, exist_ok=True)


#: URL protocols that name the local file system (fsspec's LocalFileSystem).
LOCAL_PROTOCOLS = ("file", "local")


def url_protocol(checkpoint_id: Union[str, os.PathLike]) -> Optional[str]:
    """The protocol of a URL checkpoint_id (``"s3"`` for ``s3://b/k``), or
    None for a local path.  As torch's FileSystem.validate_checkpoint_id: a
    ``Path`` is always local, a string is a URL when it contains ``://``."""
    if isinstance(checkpoint_id, Path):
        return None
    s = os.fspath(checkpoint_id)
    if isinstance(s, bytes):
        s = os.fsdecode(s)
    if "://" not in s:
        return None
    return s.split("://", 1)[0]


def validate_checkpoint_id(checkpoint_id: Union[str, os.PathLike]) -> bool:
    """torch's ``FileSystemWriter`` / ``FileSystemReader.validate_checkpoint_id``:
    a Path, or a string that is not a URL."""
    return isinstance(checkpoint_id, Path) or "://" not in str(checkpoint_id)


def local_path(path: Union[str, os.PathLike]) -> Path:
    """The local directory a FileSystemWriter / FileSystemReader path names:
    a plain path, or a ``file://`` / ``local://`` URL with the protocol
    stripped as fsspec strips it (``file:///abs`` is ``/abs``, ``file://rel``
    is ``rel`` under the working directory).  Any other URL is refused:
    dcpx never makes a local directory named after a URL (``s3:``)."""
    proto = url_protocol(path)
    if proto is None:
        return Path(path)
    if proto in LOCAL_PROTOCOLS:
        return Path(os.fsdecode(os.fspath(path)).split("://", 1)[1])
    raise ValueError(
        f"dcpx: {os.fsdecode(os.fspath(path))!r} is a {proto}:// URL, not a local path: "
        f"FileSystemWriter / FileSystemReader store only on the local file system. Pass "
        f"the URL as checkpoint_id without a storage object, or use "
        f"dcpx.fsspec.FsspecWriter / FsspecReader")


def disagreeing_paths(paths: list, limit: int = 8) -> Optional[str]:
    """None when every rank that reported a path reported the same one;
    else an error message naming the paths and which ranks have which."""
    by_path: dict = {}
    for r, p in enumerate(paths):
        if p is not None:
            by_path.setdefault(p, []).append(r)
    if len(by_path) <= 1:
        return None
    groups = sorted(by_path.items(), key=lambda kv: kv[1][0])
    shown = "; ".join(f"{_ranks_text(rs)}: {p!r}" for p, rs in groups[:limit])
    if len(groups) > limit:
        shown += f"; and {len(groups) - limit} other paths"
    return (f"dcpx: the ranks were given {len(groups)} different checkpoint paths "
            f"({shown}); every rank must save into the same directory (a per-rank "
            f"timestamp or hostname in checkpoint_id?). Nothing was written.")


def _ranks_text(ranks: list) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return "ranks " + ",".join(runs)


def check_zip_crcs(raw: bytes, where: str) -> int:
    """CRC-check every record of a torch.save archive held in memory.

    A record whose CRC field is 0 while it holds data has no CRC: torch
    writes it so with ``torch.serialization.set_crc32_options(False)``, and
    torch.load reads it.  Such records are not checked (there is nothing to
    check them against); returns how many there were."""
    absent, bad = 0, None
    try:
        z = zipfile.ZipFile(io.BytesIO(raw))
        for info in z.infolist():  # as ZipFile.testzip, less the CRC-less records
            if info.CRC == 0 and info.file_size > 0:
                absent += 1
                continue
            try:
                with z.open(info) as f:  # BadZipFile on a CRC mismatch
                    while f.read(1 << 20):
                        pass
            except zipfile.BadZipFile:
                bad = info.filename
                break
    except Exception as e:  # noqa: BLE001
        # Bytes in memory, so any error is the archive's: besides BadZipFile,
        # a flipped bit in a header gives NotImplementedError (compression
        # method, version), RuntimeError (the encrypted flag), zlib.error...
        raise CorruptCheckpointError(f"{where}: bad zip archive: {type(e).__name__}: {e}") from None
    if bad is not None:
        raise CorruptCheckpointError(f"{where}: record {bad} fails its CRC-32")
    return absent
