"""The commit: how a save becomes the checkpoint, atomically.

1. Data files are written under names no other save uses:
   ``__{rank}_{tag}_{i}.distcp``, ``tag`` new per save, its lock file
   ``.dcpx.{tag}.lock`` held by the committing process meanwhile.
2. Each data file is fsynced (``sync_files``), then the directory.
3. Under the directory's commit lock (``.dcpx.lock``), ``.metadata`` is
   written to a temporary name, fsynced, and renamed over the old one
   (atomic), then the directory is fsynced.
4. Still under it, data files that the new metadata does not reference are
   deleted, except those of saves still live (their lock is held).

A crash before step 3 leaves the previous checkpoint (or none) intact; after
it, the new one is complete.  There is never a ``.metadata`` that points at
rewritten or partial data.  docs/format.md has the full argument.

The functions take the FileSystemWriter whose save they commit (``self``);
the writer's ``commit`` / ``_discard_own`` / ``_remove_unreferenced``
methods call them (subclasses and tests override those methods)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Protocol

from torch.distributed.checkpoint.metadata import Metadata

from . import locks as _locks
from ..formats.loadindex import INDEX_FN
from ..formats.metadata import Spliced
from ..formats.files import (
    METADATA_FN, _DATA_FILE, _RANK_METADATA, _TAGGED_DATA_FILE, _TMP_METADATA, _fsync_dir,
)
from ..errors import CheckpointError


class Committing(Protocol):
    """What the commit uses of the writer whose save it commits (a
    ``FileSystemWriter``; named here by its parts so that this module does
    not import the writer that imports it)."""

    path: Path
    rank: int
    save_id: str
    sync_files: bool
    use_collectives: bool
    _save_lock: Any

    def _metadata_path(self) -> Path: ...
    def encode_metadata(self, metadata: Metadata) -> bytes: ...
    _commit_check: Optional[Any]
    def _discard_own(self) -> None: ...
    def _remove_unreferenced(self, metadata: Metadata, *args: Any) -> None: ...
    def _release_tag(self) -> None: ...


#: bytes of .metadata middles copied from an earlier file / written from
#: memory by this process (tests and benchmarks look at them)
MIDDLE_BYTES = {"copied": 0, "written": 0}


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _copy_middle(fd: int, data: Spliced) -> None:
    """Write ``data.middle`` at fd's position: copied in the kernel from
    ``data.source`` while that file is the one written (its identity
    before and after the copy), else from memory.  When the middle lies
    at the same offset modulo the block size in both files (the usual
    case: names of the same lengths), the partial blocks at its ends are
    written from memory and the whole blocks between copied, so that a
    file system that shares blocks (XFS, btrfs) shares them instead of
    copying them."""
    n = len(data.middle)
    start = os.lseek(fd, 0, os.SEEK_CUR)
    mid = memoryview(data.middle)
    lo = hi = 0  # [lo, hi): the part of the middle the kernel copied
    src = data.source
    if src is not None and n and hasattr(os, "copy_file_range"):
        try:
            sfd = os.open(src.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            sfd = -1
        if sfd >= 0:
            try:
                if (_identity(os.fstat(sfd)) == src.identity
                        and src.offset + n <= src.identity[2]):
                    bs = max(512, os.fstat(fd).st_blksize)
                    end = n
                    if (src.offset - start) % bs == 0 and n >= 2 * bs:
                        lo = (-start) % bs
                        end = lo + (n - lo) // bs * bs
                        _write_all(fd, mid[:lo])
                    hi = lo
                    while hi < end:
                        k = os.copy_file_range(sfd, fd, end - hi, src.offset + hi)
                        if k <= 0:
                            break
                        hi += k
                    if _identity(os.fstat(sfd)) != src.identity:
                        lo = hi = 0  # written to meanwhile: all from memory
            except OSError:
                pass  # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP: the rest from memory
            finally:
                os.close(sfd)
    if hi <= lo:  # nothing copied: all from memory
        lo = hi = 0
    # bytes [0, lo) were written before the copy, [lo, hi) copied
    os.lseek(fd, start + hi, os.SEEK_SET)
    _write_all(fd, mid[hi:])
    MIDDLE_BYTES["copied"] += hi - lo
    MIDDLE_BYTES["written"] += n - (hi - lo)


def _write_metadata(fd: int, data: Any) -> None:
    if isinstance(data, Spliced):
        _write_all(fd, data.pre)
        _copy_middle(fd, data)
        _write_all(fd, data.post)
        if os.fstat(fd).st_size != data.size():
            raise OSError(f"dcpx: the metadata file has {os.fstat(fd).st_size} bytes, "
                          f"not {data.size()}")
    else:
        _write_all(fd, data)


def commit(self: Committing, metadata: Metadata, data: Any = None) -> tuple:
    """Make the checkpoint visible atomically; see the module docstring.
    ``data`` is ``encode_metadata(metadata)`` (bytes, or a Spliced) if the
    caller has it.  Returns the written file's identity (st_dev, st_ino,
    st_size, st_mtime_ns): a later save may copy from it (FileRegion)."""
    final = self._metadata_path()
    tmp = final.with_name(f"{final.name}.tmp.{self.save_id}")
    if data is None:
        data = self.encode_metadata(metadata)
    try:
        if self.sync_files:
            _fsync_dir(self.path)  # the data files' directory entries
        with _locks.dir_lock(self.path):  # commits never interleave
            refused = self._commit_check(self) if self._commit_check else None
            if refused:
                self._discard_own()
                raise CheckpointError(refused)
            replacing = False
            try:
                # O_EXCL: a fresh file, never through a link or into a FIFO
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             0o644)
                try:
                    _write_metadata(fd, data)
                    if self.sync_files:
                        os.fsync(fd)
                    written = _identity(os.fstat(fd))
                    ino = written[1]
                finally:
                    os.close(fd)
                replacing = True
                os.replace(tmp, final)
            except BaseException as e:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                if not replacing:
                    # Nothing committed: this save's data files would never be
                    # referenced, and on a full disk they would keep the space
                    # the next save needs.
                    self._discard_own()
                    if isinstance(e, OSError) and e.errno and e.filename is None:
                        raise OSError(e.errno, e.strerror, str(tmp)) from e
                raise
            if self.sync_files:
                _fsync_dir(self.path)
            self._remove_unreferenced(metadata, ino)
            # Still under the commit lock: the next commit's cleanup
            # finds this save finished and may remove its files once
            # they are superseded.
            self._release_tag()
    finally:
        self._release_tag()
    return written

def write_index(directory: Path, save_id: str, data: Any, sync: bool) -> tuple:
    """Write the load index (bytes, or a Spliced whose middle may be
    copied from an earlier index) beside ``.metadata``: a temporary name
    first (one the stale-temporary cleanup removes), renamed over the old
    index.  Returns the file's identity.  Written after ``.metadata``: an
    index is used only beside the ``.metadata`` whose trailer it names, so
    any crash leaves either a matching pair or an index that is ignored."""
    final = Path(directory) / INDEX_FN
    tmp = final.with_name(f"{METADATA_FN}.tmp.{save_id}.index")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            _write_metadata(fd, data)
            if sync:
                os.fsync(fd)
            written = _identity(os.fstat(fd))
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return written


def remove_index(directory: Path) -> None:
    """A save that writes no load index removes the last one (it would be
    ignored, being made for another ``.metadata``, but it takes space)."""
    try:
        os.unlink(Path(directory) / INDEX_FN)
    except FileNotFoundError:
        pass


def discard_own(self: Committing) -> None:
    """Remove every data file of this save (all ranks'): it will not be
    committed."""
    if self._save_lock is None:
        return
    for name in os.listdir(self.path):
        m = _TAGGED_DATA_FILE.match(name)
        if m and m.group(1) == self._save_lock.tag:
            try:
                os.unlink(self.path / name)
            except FileNotFoundError:
                pass

def _supersede_other_mode(self: Committing, names: list, own: str) -> None:
    """The directory held a checkpoint saved the other way (with or
    without collectives) before this one: its metadata goes, before the
    data files it references are deleted below.  A use_collectives=False
    save removes a ``.metadata`` (``load`` would read that first, and its
    data files of this rank are deleted below: the save that succeeded would
    not load); a collective save removes ``__{rank}.metadata`` files (their
    data files are deleted below; ``load`` reads ``.metadata`` first)."""
    if own == "__":
        stale = [n for n in names if n.endswith(".metadata") and _RANK_METADATA.match(n)]
    else:
        stale = [n for n in names if n == METADATA_FN]
    for name in stale:
        try:
            os.unlink(self.path / name)
        except FileNotFoundError:
            pass
    if stale and self.sync_files:
        _fsync_dir(self.path)  # gone before any file they reference


def remove_unreferenced(self: Committing, metadata: Metadata,
                        ino: Optional[int] = None) -> None:
    """Delete data files the new metadata does not reference, except
    those of saves that may still be live (docs/reliability.md,
    "Concurrent saves into one directory"), and stale temporary
    metadata.  Runs under the commit lock."""
    if ino is not None:
        try:
            if os.stat(self._metadata_path()).st_ino != ino:
                return  # another commit won (only without working locks)
        except FileNotFoundError:
            return
    # A steady-state save's Metadata (dcpx.coordination.dist) names its data
    # files itself, without being decoded.
    keep = getattr(metadata, "_dcpx_files", None)
    if keep is None:
        keep = {si.relative_path for si in metadata.storage_data.values()}
    own = f"__{self.rank}_" if (self.rank is not None and not self.use_collectives) else "__"
    mine = self._save_lock.tag if self._save_lock is not None else None
    dead: dict[str, bool] = {}
    held: list = []

    def is_dead(tag: str) -> bool:
        if tag not in dead:
            dead[tag], lk = _locks.probe(self.path / _locks.save_lock_name(tag))
            if lk is not None:
                held.append(lk)
        return dead[tag]

    try:
        names = os.listdir(self.path)
        _supersede_other_mode(self, names, own)
        for name in names:
            if name in keep:  # most names, at scale: no pattern to match
                continue
            stale_data = _DATA_FILE.match(name) and name.startswith(own)
            if stale_data:
                m = _TAGGED_DATA_FILE.match(name)
                if m and m.group(1) != mine and not is_dead(m.group(1)):
                    continue  # a live save's file
            if stale_data or (_TMP_METADATA.match(name) and self.save_id not in name
                              and own == "__"):
                try:
                    os.unlink(self.path / name)
                except FileNotFoundError:
                    pass
        for name in names:  # locks of saves that died before writing
            m = _locks.SAVE_LOCK_RE.match(name) if name.startswith(".dcpx.") else None
            if m and m.group(1) != mine:
                is_dead(m.group(1))
    finally:
        for lk in held:  # removes the dead saves' lock files
            lk.release()
