"""Pieces: one rank's part of a step in the node-local tier, and the
persistent checkpoint assembled from them (docs/tiers.md).

A piece is an ordinary single-process dcpx checkpoint of one rank's state
dict (``.metadata`` with dcpx's trailer, data files whose records carry
their CRC-32s), in a folder whose path names everything a resume must
match::

    local_root/step-{N}/{save key}/rank-{R}-of-{W}/.metadata, __0_*.distcp

The save key (``r{run}-s{seq}``) is the same on every rank for one save and
new for every save, so pieces of two saves of one step never mix.  A piece
is committed when its ``.metadata`` is there: a rank's own piece by dcpx's
commit, a replica received from a partner by renaming its complete folder
into place.

The persistent step is written from the pieces, not from training memory:
each data record is copied as it is (its zip archive is position
independent and holds its own CRC-32s) into one file per rank, and the
merged ``.metadata`` -- the chunks of every rank, a chunk that several ranks
hold (a replicated tensor) written once -- commits it, as torch's planner
deduplicates a save.  This module touches files only; the collectives that
move pieces and metadata between ranks are dcpx.tiers'.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any, Optional

from . import _C, _locks, _metadata
from ._files import _fsync_dir, open_regular, read_regular
from .errors import CorruptCheckpointError

# \Z, not $: $ also matches before a final newline ("step-3\n", ".metadata\n")
STEP_RE = re.compile(r"^step-(0|[1-9][0-9]*)\Z")
KEY_RE = re.compile(r"^r[0-9a-f]{1,32}-s[0-9]{1,18}\Z")
PIECE_RE = re.compile(r"^rank-(0|[1-9][0-9]*)-of-([1-9][0-9]*)\Z")
_FILE_RE = re.compile(r"^(\.metadata|__\d+_[0-9a-f_]+\.distcp|__\d+_\d+\.distcp)\Z")
_INCOMING = ".incoming-"
_DELETING = ".deleting-"
#: records start at this alignment in a data file (docs/format.md)
_ALIGN = 64


def save_key(run: int, seq: int) -> str:
    return f"r{run:x}-s{seq}"


def key_order(key: str) -> tuple:
    """Keys sort by run, then by save: a later run's save is newer."""
    run, seq = key[1:].split("-s")
    return int(run, 16), int(seq)


def piece_dir(local_root: Path, step: int, key: str, rank: int, world: int) -> Path:
    return Path(local_root) / f"step-{int(step)}" / key / f"rank-{int(rank)}-of-{int(world)}"


def _subdirs(path: Path, pattern: "re.Pattern[str]") -> list:
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        m = pattern.match(name)
        if m is not None and not os.path.islink(path / name) and os.path.isdir(path / name):
            out.append((name, m))
    return out


def scan(local_root: Path) -> list:
    """Every committed piece under ``local_root``: ``(step, key, rank,
    world)`` tuples.  A folder named otherwise (a replica still arriving, a
    deletion in progress) and a piece without ``.metadata`` are not pieces."""
    root = Path(local_root)
    out = []
    for sname, sm in _subdirs(root, STEP_RE):
        for kname, _ in _subdirs(root / sname, KEY_RE):
            for pname, pm in _subdirs(root / sname / kname, PIECE_RE):
                rank, world = int(pm.group(1)), int(pm.group(2))
                if rank < world and os.path.isfile(root / sname / kname / pname / ".metadata"):
                    out.append((int(sm.group(1)), kname, rank, world))
    return sorted(out)


def step_dirs(local_root: Path) -> dict:
    """{step: folder} of the step folders under ``local_root``."""
    root = Path(local_root)
    return {int(m.group(1)): root / name for name, m in _subdirs(root, STEP_RE)}


def remove_tree(path: Path) -> None:
    """Remove a step, key or piece folder: renamed first (it stops being one
    at once; several ranks of a node may race, the rename picks one), then
    its files.  Gone already: nothing to do."""
    hidden = path.parent / f"{_DELETING}{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, hidden)
    except FileNotFoundError:
        return
    _remove(hidden)


def _remove(path: Path) -> None:
    """A folder and its files; a link (to a folder) itself only, never what
    it points at (rmtree refuses a link, which ignore_errors left behind)."""
    import shutil
    if os.path.islink(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    else:
        shutil.rmtree(path, ignore_errors=True)


def remove_debris(local_root: Path) -> None:
    """Folders a killed transfer or deletion left (``.incoming-``,
    ``.deleting-``), at any level of ``local_root``."""
    root = Path(local_root)
    stack = [root]
    for sname, _ in _subdirs(root, STEP_RE):
        stack.append(root / sname)
        stack += [root / sname / k for k, _ in _subdirs(root / sname, KEY_RE)]
    for d in stack:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if name.startswith((_INCOMING, _DELETING)):
                _remove(d / name)


def piece_bytes(piece: Path) -> int:
    """The bytes of a piece's files."""
    total = 0
    try:
        for entry in os.scandir(piece):
            if _FILE_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    except FileNotFoundError:
        return 0
    return total


# ------------------------------------------------------------ moving pieces
#
# A piece moves between ranks as an index (JSON: each file's name, size and
# CRC-32) and then the files' bytes, sent straight from the sender's files
# (mapped, read-only) and received straight into the receiver's new files
# (mapped, shared): no buffer holds a copy of the piece on either side.

#: most bytes one received file may claim (a corrupt index is refused, not allocated)
_MAX_FILE = 1 << 46


def _close_maps(maps: list) -> None:
    """Unmap; a mapping a tensor still exports (a send in flight) is freed
    with the tensor instead."""
    for mm in maps:
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass


class Outgoing:
    """A committed piece's files, mapped for sending; ``index`` is what the
    receiver checks them by.  Close it (or use ``with``) after the sends."""

    def __init__(self, piece: Path) -> None:
        import mmap
        self.maps: list = []
        self.index: list = []
        names = sorted(n for n in os.listdir(piece) if _FILE_RE.match(n))
        if ".metadata" not in names:
            raise CorruptCheckpointError(f"{piece}: not a committed piece (no .metadata)")
        try:
            for n in names:
                fd = open_regular(piece / n)
                try:
                    size = os.fstat(fd).st_size
                    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
                finally:
                    os.close(fd)
                self.maps.append(mm)
                self.index.append([n, size, _C.crc32(mm) if mm is not None else 0])
        except BaseException:
            self.close()
            raise

    def views(self) -> list:
        """One read-only buffer per file of the index (None: an empty file)."""
        return self.maps

    def close(self) -> None:
        _close_maps(self.maps)
        self.maps = []

    def __enter__(self) -> "Outgoing":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def encode_index(index: list) -> bytes:
    return json.dumps(index).encode()


def decode_index(data: Any, what: str) -> list:
    """The index a sender sent, checked: every name a checkpoint file name
    (nothing else is ever written), sizes and CRCs integers, a ``.metadata``."""
    try:
        index = json.loads(bytes(data))
    except ValueError as e:
        raise CorruptCheckpointError(f"{what}: the piece's index is not JSON: {e}") from None
    ok = isinstance(index, list)
    for entry in index if ok else ():
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and _FILE_RE.match(entry[0]) and all(isinstance(x, int) for x in entry[1:])
                and 0 <= entry[1] <= _MAX_FILE and 0 <= entry[2] < 1 << 32):
            raise CorruptCheckpointError(f"{what}: the piece's index holds {entry!r}, not "
                                         f"(checkpoint file name, size, CRC-32)")
    names = [e[0] for e in index] if ok else []
    if not ok or ".metadata" not in names or len(set(names)) != len(names):
        raise CorruptCheckpointError(f"{what}: the piece's index is not a piece's")
    return index


class Incoming:
    """A piece being received into a new folder beside ``dest``: each file
    created at its size and mapped, so the bytes land in it directly;
    :meth:`commit` checks every file's CRC-32, syncs and renames the folder
    to ``dest`` (it appears complete or not at all); a piece already there
    (the same save's, received again) is replaced.  Without a commit,
    :meth:`close` removes the folder."""

    def __init__(self, dest: Path, index: list, what: str, sync: bool = True) -> None:
        import mmap
        self.dest, self.index, self.what, self.sync = Path(dest), index, what, sync
        os.makedirs(self.dest.parent, exist_ok=True)
        self.tmp = self.dest.parent / f"{_INCOMING}{self.dest.name}-{uuid.uuid4().hex[:8]}"
        os.mkdir(self.tmp)
        self.maps: list = []
        self.fds: list = []
        try:
            for name, size, _ in index:
                fd = os.open(self.tmp / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             0o644)
                self.fds.append(fd)
                if size:
                    # Reserved now: a full disk is an OSError here, never a
                    # SIGBUS when the mapping is written.
                    os.posix_fallocate(fd, 0, size)
                self.maps.append(mmap.mmap(fd, size) if size else None)
        except BaseException:
            self.close()
            raise

    def views(self) -> list:
        """One writable buffer per file of the index (None: an empty file)."""
        return self.maps

    def commit(self) -> None:
        for (name, size, crc), mm in zip(self.index, self.maps):
            if mm is not None and _C.crc32(mm) != crc:
                raise CorruptCheckpointError(f"{self.what}: {name} arrived with another CRC-32 "
                                             f"than it was sent with (damaged in transfer)")
        for mm in self.maps:
            if mm is not None and self.sync:
                mm.flush()
        for fd in self.fds:
            if self.sync:
                os.fsync(fd)
        self._release()
        if self.sync:
            _fsync_dir(self.tmp)
        if os.path.isdir(self.dest):
            remove_tree(self.dest)
        os.rename(self.tmp, self.dest)
        self.tmp = None
        if self.sync:
            _fsync_dir(self.dest.parent)

    def _release(self) -> None:
        _close_maps(self.maps)
        for fd in self.fds:
            os.close(fd)
        self.maps, self.fds = [], []

    def close(self) -> None:
        self._release()
        if self.tmp is not None:
            import shutil
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


# ---------------------------------------------------- the persistent step

def read_metadata(piece: Path) -> Any:
    """The piece's Metadata (dcpx's safe unpickler, trailer checked)."""
    path = Path(piece) / ".metadata"
    return _metadata.loads(read_regular(path), str(path))


def _chunk_key(index: Any) -> tuple:
    off = index.offset
    return (index.fqn, None if off is None else tuple(off))


def assign(metas: list) -> list:
    """Which rank writes which item of the persistent step: a list, per
    rank, of the keys (``MetadataIndex``) of its piece it writes.  An item
    that several ranks hold (a replicated tensor, a value every rank saved
    under one key: torch's ``dedup_save_plans`` keeps one of them too) goes
    to the rank with the fewest bytes so far; the sizes and dtypes of one
    key must agree across ranks."""
    owners: dict = {}
    order: list = []
    sizes: dict = {}
    for rank, md in enumerate(metas):
        for fqn, tmd in md.state_dict_metadata.items():
            shape = (type(tmd).__name__, tuple(getattr(tmd, "size", ()) or ()),
                     str(getattr(getattr(tmd, "properties", None), "dtype", None)))
            if sizes.setdefault(fqn, (shape, rank))[0] != shape:
                first, r0 = sizes[fqn]
                raise CorruptCheckpointError(
                    f"{fqn!r}: rank {r0} saved {first}, rank {rank} saved {shape}: the ranks' "
                    f"pieces of one step disagree")
        for index, info in md.storage_data.items():
            key = _chunk_key(index)
            if key not in owners:
                owners[key] = []
                order.append(key)
            owners[key].append((rank, index, info.length))
    load = [0] * len(metas)
    out: list = [[] for _ in metas]
    for key in order:
        rank, index, length = min(owners[key], key=lambda c: (load[c[0]], c[0]))
        load[rank] += length
        out[rank].append(index)
    return out


def _copy_range(src_fd: int, dst: Any, offset: int, length: int) -> None:
    buf = 8 << 20
    while length > 0:
        data = os.pread(src_fd, min(buf, length), offset)
        if not data:
            raise CorruptCheckpointError(f"a data file ends {length} bytes early")
        dst.write(data)
        offset += len(data)
        length -= len(data)


def write_records(piece: Path, md: Any, keys: list, out: Any, out_name: str) -> dict:
    """Copy the records ``keys`` of the piece into ``out`` (a binary file
    object, written from its start), each at a 64-byte aligned offset as
    dcpx writes them; returns ``{MetadataIndex: _StorageInfo}`` for the
    persistent step's metadata (``out_name`` its file)."""
    by_file: dict = {}
    for k in keys:
        by_file.setdefault(md.storage_data[k].relative_path, []).append(k)
    entries = {}
    pos = 0
    for rel, ks in by_file.items():
        if "/" in rel or rel.startswith(".") or not _FILE_RE.match(rel):
            raise CorruptCheckpointError(f"{piece}: its metadata names the data file {rel!r}")
        fd = open_regular(Path(piece) / rel)
        try:
            for k in sorted(ks, key=lambda k: md.storage_data[k].offset):
                info = md.storage_data[k]
                pad = (info.offset - pos) % _ALIGN  # keep the record's alignment
                if pad:
                    out.write(b"\0" * pad)
                    pos += pad
                _copy_range(fd, out, info.offset, info.length)
                entries[k] = dataclasses.replace(info, relative_path=out_name, offset=pos)
                pos += info.length
        finally:
            os.close(fd)
    return entries


def merge(metas: list, entries: list, checkpoint_id: str, save_id: str) -> Any:
    """The persistent step's Metadata: every rank's chunks that ``entries``
    (per rank, from :func:`write_records`) hold, in rank order."""
    from torch.distributed.checkpoint import metadata as md_mod
    sdm: dict = {}
    planner: dict = {}
    storage: dict = {}
    for md, written in zip(metas, entries):
        for k, v in (md.planner_data or {}).items():
            planner.setdefault(k, v)
        for index, info in written.items():
            storage[index] = info
            tmd = md.state_dict_metadata[index.fqn]
            if isinstance(tmd, md_mod.TensorStorageMetadata):
                if index.fqn not in sdm:
                    sdm[index.fqn] = md_mod.TensorStorageMetadata(tmd.properties, tmd.size, [])
                chunk = next(c for c in tmd.chunks if tuple(c.offsets) == tuple(index.offset))
                sdm[index.fqn].chunks.append(chunk)
            else:
                sdm.setdefault(index.fqn, tmd)
    for md in metas:  # tensors with no chunk (empty everywhere) keep their entry
        for fqn, tmd in md.state_dict_metadata.items():
            sdm.setdefault(fqn, tmd)
    kw: dict = {"state_dict_metadata": sdm, "planner_data": planner, "storage_data": storage}
    fields = {f.name for f in dataclasses.fields(md_mod.Metadata)}
    if "storage_meta" in fields and hasattr(md_mod, "StorageMeta"):
        kw["storage_meta"] = md_mod.StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id)
    if "version" in fields and getattr(metas[0], "version", None) is not None:
        kw["version"] = metas[0].version
    return md_mod.Metadata(**kw)


def data_file_name(rank: int, tag: str) -> str:
    return f"__{int(rank)}_{tag}_0.distcp"


def claim(step_dir: Path) -> Any:
    """A save lock in the persistent step's folder while this rank writes
    into it (the manager's retention sees a live save)."""
    return _locks.claim_save(Path(step_dir))


def commit_metadata(step_dir: Path, md: Any, sync: bool = True) -> None:
    """Write the merged ``.metadata`` atomically (temporary file, fsync,
    rename under the folder's commit lock): the persistent step commits."""
    step_dir = Path(step_dir)
    data = _metadata.dumps(md)
    tmp = step_dir / f".metadata.tmp.{uuid.uuid4().hex}"
    with _locks.dir_lock(step_dir):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, step_dir / ".metadata")
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if sync:
            _fsync_dir(step_dir)


def encode_metadata(md: Any) -> bytes:
    """``.metadata`` bytes with dcpx's trailer (for a URL root)."""
    return _metadata.dumps(md)


def is_enospc(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def free_bytes(path: Path) -> Optional[int]:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
