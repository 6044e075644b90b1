"""FileSystemWriter / FileSystemReader: torch's StorageWriter / StorageReader
protocols, backed by dcpx's C core.

They plug into torch's own ``dcp.save`` / ``dcp.load`` machinery (process
groups, DTensor planners, resharding), and dcpx's single-process fast path
(``dcpx._api``) calls the same pieces directly without torch's planners.

Commit protocol (docs/format.md has the full argument):

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
rewritten or partial data.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import heapq
import io
import os
import re
import stat
import threading
import uuid
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import _C, _locks, _metadata, _values
from ._dtypes import _TO_DLPACK, dlpack_export, dlpack_view, storage_type_name
from .errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
# A save's locks are part of the commit protocol (docs/format.md): tools that
# must tell a live save from a dead one (the CheckpointManager's retention)
# ask through these, not through dcpx._locks.
from ._locks import DEAD, LIVE, NO_LOCKS, UNKNOWN, save_lock_state  # noqa: F401

__all__ = ["FileSystemWriter", "FileSystemReader", "LazyItem"]

DCP_VERSION = "1.0.0"
#: the file whose presence commits a checkpoint (torch's ``.metadata``)
METADATA_FN = _metadata.METADATA_FN
_DATA_FILE = re.compile(r"^__\d+_.*\.distcp$")
_TMP_METADATA = re.compile(r"^(__\d+)?\.metadata\.tmp")
_TAGGED_DATA_FILE = re.compile(r"^__\d+_([0-9a-f]{16})_\d+\.distcp$")


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


def check_saveable(t: torch.Tensor, key: str) -> str:
    """The storage type name of a tensor dcpx can save, or a clear error
    naming the key."""
    if t.layout != torch.strided:
        raise TypeError(f"dcpx: cannot save {key!r}: {t.layout} tensors are not "
                        f"supported (convert with .to_dense())")
    if t.is_nested:
        raise TypeError(f"dcpx: cannot save {key!r}: nested tensors are not supported")
    if t.is_quantized:
        raise TypeError(f"dcpx: cannot save {key!r}: quantized tensors are not supported")
    if t.device.type == "meta":
        raise ValueError(f"dcpx: cannot save {key!r}: it is on the meta device "
                         f"and has no data")
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        if t.numel() and t.data_ptr() == 0:
            raise TypeError(f"dcpx: cannot save {key!r}: it is a {type(t).__name__} "
                            f"without storage (a wrapper tensor subclass); save the "
                            f"tensors it wraps")
    try:
        return storage_type_name(t.dtype)
    except TypeError as e:
        raise TypeError(f"dcpx: cannot save {key!r}: {e}") from None


def tensor_payload(t: torch.Tensor, key: str) -> tuple:
    """(tensor, storage type) for the C writer, or a clear error naming key."""
    stype = check_saveable(t, key)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return (dlpack_export(dlpack_view(t)), stype)


def value_payload(obj: Any, key: str) -> bytes:
    """A non-tensor value as the bytes item torch writes (``torch.save``),
    or a clear error naming the key."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except Exception as e:
        raise TypeError(f"dcpx: cannot save {key!r}: its value of type "
                        f"{type(obj).__name__} does not pickle: {e}") from e
    return buf.getvalue()


class LazyItem(NamedTuple):
    """A value that ``FileSystemWriter.write_items`` reads only once it has
    decided which file it goes into: ``nbytes`` (its size, or an estimate for
    a non-tensor value) is what closes the current file before ``read()`` is
    called, so that at most one file's values are in memory at once."""
    nbytes: int
    read: Callable[[], Any]


def complete_metadata(writer: StorageWriter, metadata: Metadata,
                      results: list[list[WriteResult]]) -> Metadata:
    """What a storage writer's ``finish`` adds to torch's global metadata
    before committing it: where each item went, the writer's storage meta and
    DCP's version (FileSystemWriter and dcpx.fsspec.FsspecWriter alike)."""
    storage_md = {}
    for wr_list in results:
        storage_md.update({wr.index: wr.storage_data for wr in wr_list})
    metadata.storage_data = storage_md
    metadata.storage_meta = writer.storage_meta()
    metadata.version = DCP_VERSION
    return metadata


class _Entry(NamedTuple):
    index: MetadataIndex
    payload: Any          # bytes, or (tensor, storage_type)
    nbytes: int


def _buckets(entries: Sequence[_Entry], n: int) -> list[list[_Entry]]:
    """torch's _split_by_size_and_type: bytes round-robin, tensors largest
    first onto the least-loaded bucket."""
    if n <= 1:
        return [list(entries)]
    out: list[list[_Entry]] = [[] for _ in range(n)]
    tensors = []
    nb = 0
    for e in entries:
        if isinstance(e.payload, bytes):
            out[nb % n].append(e)
            nb += 1
        else:
            tensors.append(e)
    tensors.sort(key=lambda e: e.nbytes, reverse=True)
    heap = [(0, i) for i in range(n)]
    for e in tensors:
        load, i = heapq.heappop(heap)
        out[i].append(e)
        heapq.heappush(heap, (load + e.nbytes, i))
    return out


class PendingWrite:
    """Data files being written by a C WriteJob; their layout is already
    known, so the metadata can be built while the bytes go out."""

    def __init__(self, writer: "FileSystemWriter", files: list[tuple[str, list[_Entry]]]):
        self.writer = writer
        self.files = files
        self.paths = [str(writer.path / name) for name, _ in files]
        self.job = _C.WriteJob(
            [(p, [e.payload for e in ents]) for p, (_, ents) in zip(self.paths, files)],
            sync_files=writer.sync_files, threads=max(1, writer.thread_count))
        self.layout = self.job.layout()  # per file: (offset, length) per entry
        self._results: Optional[list[WriteResult]] = None

    @property
    def results(self) -> list[WriteResult]:
        """torch's WriteResult per entry (built on first use)."""
        if self._results is None:
            self._results = [
                WriteResult(index=e.index, size_in_bytes=length,
                            storage_data=_StorageInfo(name, offset, length))
                for (name, ents), lay in zip(self.files, self.layout)
                for e, (offset, length) in zip(ents, lay)
            ]
        return self._results

    def start(self) -> "PendingWrite":
        self.job.start()
        return self

    def wait(self) -> list[WriteResult]:
        """Join the writer threads; on failure remove this save's files."""
        try:
            self.job.wait()
        except BaseException:
            self.discard()
            raise
        finally:
            self.job.release()
        return self.results

    def abort(self) -> None:
        """Stop the writer threads and remove this save's files."""
        self.job.cancel()
        try:
            self.job.wait()
        except OSError:
            pass
        finally:
            self.job.release()
        self.discard()

    def discard(self) -> None:
        """Best effort: never let cleanup hide the error that caused it."""
        for p in self.paths:
            try:
                os.unlink(p)
            except OSError:
                pass


class _RankPath(NamedTuple):
    """A rank's checkpoint path, carried in its local SavePlan's
    ``storage_data`` to the coordinator (torch's generic save path), which
    refuses the save when the ranks disagree (see dcpx._dist.path_key)."""
    path: str


def _path_key(path: Any) -> str:
    return os.path.normpath(os.fspath(path))


class FileSystemWriter(StorageWriter):
    """Drop-in for ``torch.distributed.checkpoint.FileSystemWriter``.

    Honoured: ``single_file_per_rank``, ``sync_files`` (data files, metadata
    and the directory are fsynced), ``thread_count`` (C writer threads, one
    file each), ``overwrite``.  ``per_thread_copy_ahead`` and
    ``cache_staged_state_dict`` are accepted for compatibility; staging is
    done by dcpx's stager (see dcpx.staging).
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Optional[Sequence[Any]] = None,
        serialization_format: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if _extensions:
            raise NotImplementedError("dcpx: stream-transform _extensions are not supported")
        if serialization_format is not None and getattr(serialization_format, "value",
                                                        serialization_format) != "torch_save":
            raise NotImplementedError(
                f"dcpx: serialization_format {serialization_format} is not supported "
                f"(only TORCH_SAVE)")
        if int(thread_count) < 1:
            raise ValueError(f"dcpx: thread_count must be >= 1, got {thread_count}")
        self.path = local_path(path)
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = int(thread_count)
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.cache_staged_state_dict = cache_staged_state_dict
        self.overwrite = overwrite
        self.save_id = str(uuid.uuid4())
        self.rank: Optional[int] = None
        self.is_coordinator = True
        self.use_collectives = True
        # This save's tag and lock (dcpx/_locks.py), from the choice of its
        # file names to the end of its commit.
        self._save_lock: Optional[_locks.FileLock] = None
        # Called under the commit lock before the rename: a message means
        # "do not commit" (the checkpoint process of a dead parent sets it).
        self._commit_check: Optional[Any] = None

    def __getstate__(self) -> dict:
        # A save's lock (a descriptor) and commit check stay in this process.
        state = self.__dict__.copy()
        state["_save_lock"] = state["_commit_check"] = None
        return state

    # -- StorageWriter protocol ------------------------------------------
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        self._release_tag()
        if checkpoint_id:
            self.path = local_path(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.rank is not None and not self.use_collectives:
            self._prepare_dir()
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(self._prefix(self.rank)))
        else:
            # The directory is made in write_data, once the coordinator has
            # checked that every rank names the same one (prepare_global_plan).
            self._prepare_dir(create=False)
            plan = dataclasses.replace(plan, storage_data=_RankPath(_path_key(self.path)))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        from ._dist import disagreeing_paths
        refusal = disagreeing_paths([p.storage_data.path if isinstance(p.storage_data, _RankPath)
                                     else None for p in plans])
        if refusal is not None:
            raise CheckpointError(refusal)
        plans = [dataclasses.replace(p, storage_data=None)
                 if isinstance(p.storage_data, _RankPath) else p for p in plans]
        tag = self._tag()
        return [
            dataclasses.replace(p, storage_data=_StoragePrefix(self._prefix(i, tag)))
            if p.storage_data is None else p
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        self._prepare_dir()
        entries = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                payload = data.getvalue()
                entries.append(_Entry(item.index, payload, len(payload)))
            else:
                payload = tensor_payload(data, item.index.fqn)
                entries.append(_Entry(item.index, payload,
                                      data.numel() * data.element_size()))
        results = self.write_entries(plan.storage_data.prefix, entries).start().wait()
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.commit(complete_metadata(self, metadata, results))

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> Union[str, os.PathLike]:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        if isinstance(checkpoint_id, Path):
            return True
        if "://" in str(checkpoint_id):
            return False
        return True

    # -- dcpx's pieces ----------------------------------------------------
    def _metadata_path(self) -> Path:
        if self.rank is not None and not self.use_collectives:
            return self.path / f"__{self.rank}{_metadata.METADATA_FN}"
        return self.path / _metadata.METADATA_FN

    def _prepare_dir(self, create: bool = True) -> None:
        _check_dir(self.path, create=create)
        if self._metadata_path().exists() and not self.overwrite:
            raise RuntimeError(
                f"Checkpoint already exists and self.overwrite={self.overwrite}: {self.path}")

    def _tag(self) -> str:
        """This save's tag: new per save, so that no data file another save
        (committed or live) refers to is touched; its lock file is held
        until the commit (or ``_release_tag``)."""
        lk = self._save_lock
        if lk is None or lk.fd < 0 or lk.path.parent != self.path:
            self._release_tag()
            # The lock file lives in the directory.  Callers take the tag only
            # once the ranks agree on the path (docs/design.md, "Every rank
            # must name the same directory"), so making it here is in order.
            _check_dir(self.path, create=True)
            self._save_lock = lk = _locks.claim_save(self.path)
        return lk.tag

    def _release_tag(self) -> None:
        """The save is over (committed or failed): drop its lock."""
        lk, self._save_lock = self._save_lock, None
        if lk is not None:
            lk.release()

    def _committed_id(self) -> Optional[tuple]:
        """Identity of the committed metadata file (None if there is none):
        changes with every commit (a new inode is renamed in)."""
        try:
            st = os.stat(self._metadata_path())
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def _prefix(self, rank: int, tag: Optional[str] = None) -> str:
        if tag is None:
            tag = self._tag()
        return f"__{rank}_{tag}_" if tag else f"__{rank}_"

    def write_entries(self, prefix: str, entries: Sequence[_Entry], first: int = 0) -> PendingWrite:
        """Lay out entries into data files named ``{prefix}{i}.distcp``,
        ``i`` counting from ``first``."""
        if self.single_file_per_rank:
            groups = [g for g in _buckets(entries, self.thread_count) if g] or [[]]
        else:
            groups = [[e] for e in entries]
        files = [(f"{prefix}{first + i}.distcp", g) for i, g in enumerate(groups)]
        return PendingWrite(self, files)

    def write_items(self, items: Iterable[tuple[str, Any]], *,
                    planner_data: Optional[Mapping[str, tuple]] = None,
                    file_bytes: int = 64 << 20,
                    written: Optional[Callable[[str, Any], None]] = None) -> Metadata:
        """Save ``(fqn, value)`` pairs as one checkpoint, streaming: values
        are gathered into batches of at most ``file_bytes`` (a larger value
        alone), each batch is written by the C writer before the next value
        is read, and the save commits as any dcpx save does (its turn in the
        directory, its lock file, ``.metadata`` renamed in last).

        A value is a tensor (saved whole, one chunk), any other value
        (``torch.save``'d, as ``dcpx.save`` does), or a ``LazyItem`` (read
        once its batch is chosen).  ``planner_data``: fqn -> the nested path
        it came from (default ``(fqn,)``).  ``written(fqn, value)`` is called
        once a value's file is written (to give back its memory).  On failure
        before the commit, this save's data files are removed.  Returns the
        committed metadata."""
        with _locks.turn(self):
            self.set_up_storage_writer(True)
            committing = False
            try:
                self._prepare_dir()
                storage, sdm = self._write_batches(items, file_bytes, written)
                pd = planner_data or {}
                md = Metadata(state_dict_metadata=sdm,
                              planner_data={k: tuple(pd.get(k, (k,))) for k in sdm},
                              storage_data=storage, storage_meta=self.storage_meta(),
                              version=DCP_VERSION)
                committing = True
                self.commit(md)
                return md
            except BaseException:
                if not committing:
                    self._discard_own()
                raise
            finally:
                self._release_tag()

    def _write_batches(self, items: Iterable[tuple[str, Any]], file_bytes: int,
                       written: Optional[Callable[[str, Any], None]]) -> tuple[dict, dict]:
        """write_items' loop: (storage_data, state_dict_metadata)."""
        prefix = self._prefix(0)
        sdm: dict[str, Any] = {}
        storage: dict = {}
        batch: list[_Entry] = []
        held: list = []  # (fqn, value) of the batch, handed to ``written`` once written
        nfiles = pending = 0

        def flush() -> None:
            nonlocal batch, held, nfiles, pending
            if not batch:
                return
            pw = self.write_entries(prefix, batch, first=nfiles)
            storage.update({r.index: r.storage_data for r in pw.start().wait()})
            nfiles += len(pw.files)
            batch, pending = [], 0
            done, held = held[::-1], []
            while done:
                fqn, v = done.pop()
                if written is not None:
                    written(fqn, v)
                del v  # the batch's values go one by one, nothing else holds them

        for fqn, value in items:
            if isinstance(value, LazyItem):
                if pending and pending + value.nbytes > file_bytes:
                    flush()  # before reading it: one batch in memory
                value = value.read()
            if fqn in sdm:
                raise ValueError(f"dcpx: key {fqn!r} is given twice")
            if isinstance(value, torch.Tensor):
                nbytes = value.numel() * value.element_size()
                payload: Any = tensor_payload(value, fqn)
                # The save paths' own metadata (shared properties and
                # offsets: a compact .metadata for many tensors).
                md = sdm[fqn] = _metadata.tensor_metadata(value, value.is_pinned())
                index = MetadataIndex(fqn, md.chunks[0].offsets, 0)
            else:
                payload = value_payload(value, fqn)
                nbytes = len(payload)
                sdm[fqn] = BytesStorageMetadata()
                index = MetadataIndex(fqn)
            if pending and pending + nbytes > file_bytes:
                flush()
            batch.append(_Entry(index, payload, nbytes))
            held.append((fqn, value))
            pending += nbytes
            del value, payload
        flush()
        return storage, sdm

    def encode_metadata(self, metadata: Metadata) -> bytes:
        return _metadata.dumps(metadata)

    def commit(self, metadata: Metadata, data: Optional[bytes] = None) -> None:
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
                    os.replace(tmp, final)
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except FileNotFoundError:
                        pass
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

    def _discard_own(self) -> None:
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

    def _remove_unreferenced(self, metadata: Metadata, ino: Optional[int] = None) -> None:
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


def check_zip_crcs(raw: bytes, where: str) -> None:
    """CRC-check every record of a torch.save archive held in memory."""
    try:
        bad = zipfile.ZipFile(io.BytesIO(raw)).testzip()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
        raise CorruptCheckpointError(f"{where}: bad zip archive: {e}") from None
    if bad is not None:
        raise CorruptCheckpointError(f"{where}: record {bad} fails its CRC-32")


def _torch_load_bytes(planner: LoadPlanner) -> bool:
    """The planner's load_bytes is DefaultLoadPlanner's, which unpickles
    the value with full pickle (weights_only=False) and stores it."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    return (type(planner).load_bytes is DefaultLoadPlanner.load_bytes
            and hasattr(planner, "flatten_state_dict") and hasattr(planner, "state_dict"))


def _set_value(planner: LoadPlanner, req: Any, value: Any) -> None:
    """What DefaultLoadPlanner.load_bytes does with the value it unpickled,
    given the value dcpx has already unpickled under its allow-list."""
    from torch.distributed.checkpoint._traverse import set_element
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[req.dest_index.fqn], value)
    else:
        planner.state_dict[req.dest_index.fqn] = value
#: bytes of saved-dtype temporaries (casting or resharding reads) alive at
#: once during a load; a chunk larger than this is read alone
_TEMP_BUDGET = 64 << 20


@functools.lru_cache(maxsize=None)
def _cast_error(saved: torch.dtype, dest: torch.dtype, device: torch.device) -> Optional[str]:
    """Why ``Tensor.copy_`` (torch's load step) refuses saved -> dest, or None."""
    try:
        torch.zeros(1, dtype=dest, device=device).copy_(torch.zeros(1, dtype=saved))
    except (RuntimeError, TypeError) as e:  # NotImplementedError is a RuntimeError
        return f"{type(e).__name__}: {e}"
    return None


def check_castable(key: str, saved: torch.dtype, target: torch.Tensor) -> None:
    """Refuse, naming the key, a dtype pair torch's load refuses too."""
    why = _cast_error(saved, target.dtype, target.device)
    if why is not None:
        raise TypeError(f"dcpx: cannot load {key!r}: the checkpoint holds {saved}, the "
                        f"destination is {target.dtype}, and torch cannot convert "
                        f"between them ({why})")


class _TensorRead(NamedTuple):
    key: str
    info: _StorageInfo
    chunk: torch.Size          # shape of the saved chunk
    dtype: torch.dtype         # saved dtype
    target: torch.Tensor       # where the (narrowed) data goes
    narrow: Optional[tuple]    # (storage_offsets, lengths) within the chunk


def _reads_to_device(r: _TensorRead) -> bool:
    """Whether r's chunk can go to its CUDA target by the C load path
    (csrc/cuda_load.c): a contiguous CUDA tensor of the saved shape and
    dtype.  Casting or narrowing reads keep the temporary + ``copy_``."""
    t = r.target
    return (r.narrow is None and t.dtype == r.dtype and t.shape == r.chunk
            and t.device.type == "cuda" and t.is_contiguous()
            and not t.is_conj() and not t.is_neg())


#: bytes of the page-locked host buffer that loads into CUDA tensors read
#: through (one per process, page-locked once and reused by every load); a
#: chunk larger than this is read into a pageable temporary of its own
_PINNED_LOAD = 64 << 20
_pinned_lock = threading.Lock()
_pinned_buffer: Optional[torch.Tensor] = None


def _pinned_load_buffer() -> torch.Tensor:
    """The process's load bounce buffer (_pinned_lock held), page-locked by
    the C CUDA path at first use; a refusal warns and leaves it pageable.
    Unregistered at interpreter exit (``_C.cuda_release_all``)."""
    global _pinned_buffer
    if _pinned_buffer is None:
        buf = torch.empty(_PINNED_LOAD, dtype=torch.uint8)
        try:
            _C.cuda_host_register(buf)  # False, with a RuntimeWarning, if refused
        except _C.CudaError as e:
            warnings.warn(f"{e}; loading through pageable memory", RuntimeWarning,
                          stacklevel=3)
        _pinned_buffer = buf
    return _pinned_buffer


def _reads_in_place(r: _TensorRead) -> bool:
    """Whether the C reader can read r's chunk straight into its target:
    contiguous host memory of the saved shape and dtype."""
    t = r.target
    return (r.narrow is None and t.dtype == r.dtype and t.shape == r.chunk
            and t.device.type == "cpu" and t.is_contiguous()
            and not t.is_conj() and not t.is_neg())


class FileSystemReader(StorageReader):
    """Drop-in for ``torch.distributed.checkpoint.FileSystemReader``.

    Extra keyword arguments (dcpx's own):
      ``thread_count``: C reader threads (default: up to 4 of the CPUs).
      ``verify``: check each tensor record's CRC-32 (default True).
      ``allow_pickle``: load non-tensor values with full pickle instead of
        torch's ``weights_only`` allow-list (default False: a checkpoint can
        never run code on load unless you trust it and say so).
    """

    def __init__(self, path: Union[str, os.PathLike], _extension_registry: Any = None,
                 thread_count: Optional[int] = None, verify: bool = True,
                 allow_pickle: bool = False) -> None:
        super().__init__()
        self.path = local_path(path)
        self.thread_count = thread_count or min(4, os.cpu_count() or 1)
        self.verify = verify
        self.allow_pickle = allow_pickle
        self.storage_data: dict = {}
        self.load_id = str(uuid.uuid4())
        self.rank: Optional[int] = None
        self.use_collectives = True
        self._chunks: Optional[dict] = None
        self._state_dict_metadata: dict = {}

    # -- StorageReader protocol ------------------------------------------
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        self.storage_data = {}
        self._chunks = None
        if checkpoint_id:
            self.path = local_path(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = _metadata.METADATA_FN if rank is None else f"__{rank}{_metadata.METADATA_FN}"
        path = self.path / name
        _check_dir(self.path, create=False)
        try:
            data = read_regular(path)
        except FileNotFoundError:
            if not self.path.exists():
                raise IncompleteCheckpointError(
                    2, f"dcpx: no checkpoint at {self.path}: the directory does not exist",
                    str(self.path)) from None
            raise IncompleteCheckpointError(
                2, f"dcpx: checkpoint at {self.path} is incomplete: it has no {name} "
                   f"(the save never committed, or was interrupted)", str(path)) from None
        md = _metadata.loads(data, str(path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self._state_dict_metadata = metadata.state_dict_metadata
        self._chunks = None
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        self._validate_storage(metadata)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        reads, tensor_reqs = [], []
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                if _torch_load_bytes(planner):  # it would unpickle the bytes again
                    _set_value(planner, req, self.load_value(req.storage_index.fqn, info))
                else:
                    planner.load_bytes(req, io.BytesIO(self.read_bytes(req.storage_index.fqn,
                                                                       info)))
                continue
            chunk, dtype = self._chunk_of(req.storage_index)
            target = planner.resolve_tensor(req).detach()
            full = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == tuple(chunk)
            reads.append(_TensorRead(req.storage_index.fqn, info, chunk, dtype, target,
                                     None if full else (req.storage_offsets, req.lengths)))
            tensor_reqs.append((req, target))
        self.read_tensors(reads)
        for req, target in tensor_reqs:
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self) -> Union[str, os.PathLike]:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return FileSystemWriter.validate_checkpoint_id(checkpoint_id)

    # -- dcpx's pieces ----------------------------------------------------
    def _validate_storage(self, metadata: Metadata) -> None:
        """Reject paths that escape the directory and impossible extents
        before anything is read."""
        for _, error in self._storage_problems(metadata):
            raise error

    def check_storage(self, metadata: Metadata) -> list[tuple[MetadataIndex, Exception]]:
        """Every storage entry of ``metadata`` that cannot be read, without
        reading any data: a data file named outside the directory, missing or
        not a regular file, an extent past the end of its file (truncated), a
        stream transform.  One ``(index, error)`` per bad entry, in order;
        ``error`` is the exception loading would raise for it.  Empty when
        every entry can be read (``set_up_storage_reader`` raises the first)."""
        return list(self._storage_problems(metadata))

    def _storage_problems(self, metadata: Metadata):
        sizes: dict[str, int] = {}  # data files found regular, by name
        for index, info in metadata.storage_data.items():
            try:
                self._check_entry(index, info, sizes)
            except Exception as e:  # noqa: B902 - each is the entry's own error
                yield index, e

    def _check_entry(self, index: Any, info: Any, sizes: dict[str, int]) -> None:
        if not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(f"{self.path}: bad storage entry for {index}")
        rel = info.relative_path
        if rel not in sizes:
            if (not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel
                    or rel in (".", "..") or "\0" in rel):
                raise CorruptCheckpointError(
                    f"{self.path}: metadata names data file {rel!r} outside the "
                    f"checkpoint directory (refused)")
            try:
                st = os.lstat(self.path / rel)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"{self.path}: data file {rel} is missing (needed by key "
                    f"{getattr(index, 'fqn', index)!r})") from None
            if not stat.S_ISREG(st.st_mode):
                raise special_file_error(
                    self.path / rel, st.st_mode,
                    f"data file (needed by key {getattr(index, 'fqn', index)!r}) ")
            sizes[rel] = st.st_size
        if (not isinstance(info.offset, int) or not isinstance(info.length, int)
                or info.offset < 0 or info.length < 0
                or info.offset + info.length > sizes[rel]):
            raise CorruptCheckpointError(
                f"{self.path / rel}: key {getattr(index, 'fqn', index)!r}: extent "
                f"[{info.offset}, +{info.length}) lies outside the file "
                f"({sizes[rel]} bytes; truncated?)")
        if getattr(info, "transform_descriptors", None):
            raise NotImplementedError(
                f"dcpx: {self.path / rel} uses stream transforms "
                f"{info.transform_descriptors}; load it with torch.distributed.checkpoint")

    def read_chunk(self, index: MetadataIndex) -> torch.Tensor:
        """The saved chunk at storage ``index`` (a key and a chunk's offsets)
        of the metadata this reader was set up with, in its saved shape and
        dtype, CRC-checked (``verify``)."""
        chunk, dtype = self._chunk_of(index)
        info = self.storage_data.get(index)
        if info is None:
            raise CorruptCheckpointError(
                f"{self.path}: metadata has no storage entry for {index.fqn!r} at offset "
                f"{tuple(index.offset)}")
        out = torch.empty(chunk, dtype=dtype)
        self.read_tensors([_TensorRead(index.fqn, info, chunk, dtype, out, None)])
        return out

    def read_key(self, fqn: str, metadata: Optional[Metadata] = None) -> Any:
        """The whole saved value of key ``fqn``: a tensor with every chunk
        (DTensor / sharded saves) read straight into its place in the result
        (CRC-checked), or a non-tensor value (as ``load_value``).  Uses the
        metadata the reader was set up with, or ``metadata`` (whose entries
        for ``fqn`` are checked first, as ``set_up_storage_reader`` does).
        Raises CorruptCheckpointError, naming the key, for a missing entry or
        chunks that do not tile the tensor."""
        if metadata is None:
            sdm_all, storage = self._state_dict_metadata, self.storage_data
        else:
            sdm_all, storage = metadata.state_dict_metadata, metadata.storage_data
            mine = {i: v for i, v in storage.items() if getattr(i, "fqn", None) == fqn}
            self._validate_storage(Metadata(state_dict_metadata=sdm_all, storage_data=mine))
        sdm = sdm_all[fqn]
        if not isinstance(sdm, TensorStorageMetadata):
            info = storage.get(MetadataIndex(fqn))
            if info is None:
                raise CorruptCheckpointError(f"{self.path}: metadata has no storage entry "
                                             f"for {fqn!r}")
            return self.load_value(fqn, info)
        full = torch.empty(sdm.size, dtype=sdm.properties.dtype)
        covered = 0
        reads = []
        for ch in sdm.chunks:
            info = storage.get(MetadataIndex(fqn, ch.offsets))
            if info is None:
                raise CorruptCheckpointError(
                    f"{self.path}: metadata has no storage entry for {fqn!r} at offset "
                    f"{tuple(ch.offsets)}")
            if any(o < 0 or o + n > size for o, n, size in zip(ch.offsets, ch.sizes, sdm.size)):
                raise CorruptCheckpointError(
                    f"{self.path}: chunk of {fqn!r} at {tuple(ch.offsets)} size "
                    f"{tuple(ch.sizes)} lies outside its size {tuple(sdm.size)}")
            target = full[tuple(slice(o, o + n) for o, n in zip(ch.offsets, ch.sizes))]
            reads.append(_TensorRead(fqn, info, ch.sizes, sdm.properties.dtype, target, None))
            covered += ch.sizes.numel()
        if covered != sdm.size.numel():
            raise CorruptCheckpointError(
                f"{self.path}: the chunks of {fqn!r} hold {covered} elements, its size "
                f"{tuple(sdm.size)} has {sdm.size.numel()} (overlapping or missing shards)")
        self.read_tensors(reads)
        return full

    def _chunk_of(self, index: MetadataIndex) -> tuple:
        if self._chunks is None:
            self._chunks = {}
            for fqn, md in self._state_dict_metadata.items():
                if isinstance(md, TensorStorageMetadata):
                    for ch in md.chunks:
                        self._chunks[(fqn, tuple(ch.offsets))] = (ch.sizes, md.properties.dtype)
        try:
            return self._chunks[(index.fqn, tuple(index.offset))]
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.path}: no chunk of {index.fqn!r} at offset {tuple(index.offset)}") from None

    def read_bytes(self, key: str, info: _StorageInfo, check: bool = True) -> Any:
        """The raw bytes of a bytes item, after checking (unless ``check`` is
        False or allow_pickle is set) that they unpickle under the allow-list
        (dcpx._values; ``load_value`` reads and unpickles in one pass)."""
        path = self.path / info.relative_path
        data = read_regular(path, info.offset, info.length)
        if len(data) != info.length:
            raise CorruptCheckpointError(f"{path}: key {key!r}: file is truncated")
        if self.verify:
            check_zip_crcs(data, f"{path}: key {key!r}")
        if check and not self.allow_pickle:
            _values.loads(data, f"{path}: key {key!r}")
        return data

    def load_value(self, key: str, info: _StorageInfo) -> Any:
        """A non-tensor value, read, CRC-checked and unpickled once: under
        the allow-list of code-free types (dcpx._values, docs/api.md), or
        with full pickle if the reader was built with allow_pickle=True."""
        data = self.read_bytes(key, info, check=False)
        return _values.loads(data, f"{self.path / info.relative_path}: key {key!r}",
                             allow_pickle=self.allow_pickle)

    def read_tensors(self, reads: Sequence[_TensorRead]) -> None:
        """Read tensor chunks into their targets: straight into the target's
        memory when it is contiguous host memory of the saved shape and dtype,
        else through a temporary of the saved chunk (saved dtype), then
        ``target.copy_(chunk narrowed)``: torch's own read_data step, which
        also casts to the target's dtype.  A contiguous CUDA target of the
        saved shape and dtype goes through the page-locked load buffer and
        dcpx's stream instead (``_read_to_devices``).  Temporaries are held for at most
        ``_TEMP_BUDGET`` bytes of chunks at a time (or one chunk if larger)."""
        direct, staged, device = [], [], []
        for r in reads:
            if r.target.dtype != r.dtype:
                check_castable(r.key, r.dtype, r.target)
            if _reads_in_place(r):
                direct.append(r)
            elif _reads_to_device(r):
                device.append(r)
            else:
                staged.append(r)
        if device:
            self._read_to_devices(device)
        batch: list = []
        nbytes = 0
        for r in staged:
            size = r.chunk.numel() * r.dtype.itemsize
            if batch and nbytes + size > _TEMP_BUDGET:
                self._read_batch(direct, batch)
                direct, batch, nbytes = [], [], 0
            batch.append(r)
            nbytes += size
        if direct or batch:
            self._read_batch(direct, batch)

    def _read_to_devices(self, reads: Sequence[_TensorRead]) -> None:
        """Reads into contiguous CUDA tensors of the saved dtype and shape:
        the C readers read each chunk into the process's page-locked load
        buffer (``_PINNED_LOAD`` bytes, one load at a time), then
        ``_C.cuda_copy_from_host`` copies it to the device on dcpx's own
        stream, after the work queued so far on each device's current
        stream and before that stream's later work (events).  The buffer
        is used as two halves: while one half's copies run, the next batch
        is read into the other; before a half is read into again, its
        copies are waited for (``_C.cuda_wait``).  A chunk larger than a
        half goes through the whole buffer once both halves are idle, one
        larger than the buffer through a pageable temporary of its own."""
        def copy(batch: list, wait: bool) -> Any:
            # The host slices are the reads' targets: contiguous CPU, same
            # dtype and shape, so _read_batch reads straight into them (and
            # handles torch-only records and errors, naming the key).
            self._read_batch([r._replace(target=h) for r, h in batch], [])
            pairs = []
            for r, h in batch:
                t = dlpack_view(r.target)
                if _TO_DLPACK is not None and type(t) is torch.Tensor:
                    t = _TO_DLPACK(t)
                pairs.append((t, dlpack_view(h), r.key))
            consumers = [(dev.index, torch.cuda.current_stream(dev).cuda_stream)
                         for dev in {r.target.device for r, _ in batch}]
            return _C.cuda_copy_from_host(pairs, consumer_streams=consumers, wait=wait)

        pending: list = [None, None]  # per half: its copies in flight

        def idle(i: int) -> None:
            p, pending[i] = pending[i], None
            if p is not None:
                _C.cuda_wait(p)

        def start(i: int, batch: list) -> None:
            idle(i)  # never read into a half whose copies still run
            pending[i] = copy(batch, wait=False)

        with _pinned_lock:
            buf = _pinned_load_buffer()
            half = _PINNED_LOAD // 2 // 64 * 64
            halves = (buf[:half], buf[half:2 * half])
            try:
                cur, batch, used = 0, [], 0
                for r in reads:
                    size = r.chunk.numel() * r.dtype.itemsize
                    if size > _PINNED_LOAD:
                        copy([(r, torch.empty(r.chunk, dtype=r.dtype))], wait=True)
                        continue
                    if size > half:
                        if batch:
                            start(cur, batch)
                            cur, batch, used = cur ^ 1, [], 0
                        idle(cur ^ 1)
                        idle(cur)
                        copy([(r, buf[:size].view(r.dtype).view(r.chunk))], wait=True)
                        continue
                    off = -(-used // 64) * 64
                    if off + size > half:
                        start(cur, batch)
                        cur, batch, off = cur ^ 1, [], 0
                    host = halves[cur][off:off + size].view(r.dtype).view(r.chunk)
                    batch.append((r, host))
                    used = off + size
                if batch:
                    start(cur, batch)
                idle(cur ^ 1)  # the older first: its error is the earlier one
                idle(cur)
            except BaseException:
                # Nothing may still copy out of the buffer once the lock is
                # released: wait for both halves; the first error is raised.
                for i in (0, 1):
                    try:
                        idle(i)
                    except _C.CudaError:
                        pass
                raise

    def _read_batch(self, direct: Sequence[_TensorRead], staged: Sequence[_TensorRead]) -> None:
        """One C read of ``direct`` reads (into their targets) and ``staged``
        ones (into temporaries, then copied into their targets)."""
        files: dict[str, int] = {}
        items: list = []
        later: dict[int, torch.Tensor] = {}  # item index -> its temporary
        reads = [*direct, *staged]
        for n, r in enumerate(reads):
            dest = r.target if n < len(direct) else torch.empty(r.chunk, dtype=r.dtype)
            if n >= len(direct):
                later[n] = dest
            fidx = files.setdefault(r.info.relative_path, len(files))
            items.append((fidx, r.info.offset, r.info.length, dlpack_view(dest),
                          storage_type_name(r.dtype)))
        paths = [str(self.path / p) for p in files]
        failures = _C.read_items(paths, items, threads=self.thread_count, verify=self.verify)
        for i, code, err, msg in failures:
            r = reads[i]
            dest = items[i][3]
            if code == 1:  # valid archive in a form the C reader leaves to torch
                t = self._fallback_read(r)
                if i in later:
                    # copy_ from torch.load's tensor itself, with the record's
                    # strides, as torch does: a cast's result can depend on
                    # the source layout (NaN to bfloat16: 0x7fc0 strided,
                    # 0xffff vectorised)
                    later[i] = t
                else:
                    dest.copy_(t.view(dest.dtype) if dest.dtype != t.dtype else t)
                continue
            where = f"{self.path / r.info.relative_path}: key {r.key!r}"
            if code == 3 and err:
                raise OSError(err, f"dcpx: {where}: {msg}: {os.strerror(err)}",
                              str(self.path / r.info.relative_path))
            raise CorruptCheckpointError(f"{where}: {msg}")
        for i, src in later.items():
            r = reads[i]
            if r.narrow is not None:
                for dim, (start, length) in enumerate(zip(*r.narrow)):
                    src = src.narrow(dim, start, length)
            r.target.copy_(src)

    def _fallback_read(self, r: _TensorRead) -> torch.Tensor:
        """The record loaded by torch.load (checked against the metadata)."""
        path = self.path / r.info.relative_path
        raw = read_regular(path, r.info.offset, r.info.length)
        try:
            t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CorruptCheckpointError(f"{path}: key {r.key!r}: cannot load tensor "
                                         f"record: {e}") from e
        if not isinstance(t, torch.Tensor) or t.shape != r.chunk or t.dtype != r.dtype:
            raise CorruptCheckpointError(
                f"{path}: key {r.key!r}: record holds "
                f"{getattr(t, 'dtype', type(t))}{tuple(getattr(t, 'shape', ()))}, "
                f"metadata says {r.dtype}{tuple(r.chunk)}")
        return t
