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


def commit(self: Committing, metadata: Metadata, data: Optional[bytes] = None) -> None:
    """Make the checkpoint visible atomically; see the module docstring.
    ``data`` is ``encode_metadata(metadata)`` if the caller has it."""
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
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    if self.sync_files:
                        os.fsync(fd)
                    ino = os.fstat(fd).st_ino
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
        stale = [n for n in names if _RANK_METADATA.match(n)]
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
            stale_data = _DATA_FILE.match(name) and name.startswith(own) and name not in keep
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
            m = _locks.SAVE_LOCK_RE.match(name)
            if m and m.group(1) != mine:
                is_dead(m.group(1))
    finally:
        for lk in held:  # removes the dead saves' lock files
            lk.release()
