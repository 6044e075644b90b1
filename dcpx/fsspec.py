"""FsspecWriter / FsspecReader: dcpx checkpoints on any fsspec store
(``s3://``, ``gs://``, ``memory://``, ...), the names and on-store layout of
torch's ``torch.distributed.checkpoint._fsspec_filesystem``.

``dcpx.save`` / ``load`` / ``async_save`` pick these for a ``checkpoint_id``
that is a URL of a protocol other than ``file://`` (``dcpx.api.save_load._storage_for``,
as torch's ``_storage_setup``).  Checkpoints are interchangeable with torch's
FsspecWriter / FsspecReader on the same URL, both ways.

What dcpx keeps (docs/reliability.md, "Remote URLs", has the guarantees per
store):

* **Writing**: the data files are written by dcpx's C writer (torch.save
  records, each with its CRC-32) into a local temporary directory
  (``tempfile``: ``TMPDIR``), then uploaded under names no committed
  ``.metadata`` refers to (a tag new per save).  Only after every upload has
  succeeded is ``.metadata`` written, to ``.metadata.tmp.<save_id>`` and
  moved to ``.metadata``; then the data files of the checkpoint it replaced
  are deleted.  A failed save deletes its uploads and leaves the previous
  checkpoint as it was.
* **Reading**: ``.metadata`` is parsed with dcpx's safe unpickler (and its
  checksum verified when dcpx wrote it); the byte ranges the load needs are
  fetched into sparse local files and read by dcpx's C reader, which
  verifies each record's CRC-32; non-tensor values load under the
  ``weights_only`` allow-list unless ``allow_pickle=True``.  In turns of
  ``_TEMP_BUDGET`` bytes of records, each freed before the next: local
  space at most twice that (or twice the largest record), memory at most
  ``_FETCH_BATCH`` of fetched bytes.  A save checks its local staging
  space (``staging_bytes``) before it writes.
* **async_save** stages with dcpx's stager (the writer is not its own
  stager).  A ``memory://`` store lives in one process: a writer for it
  refuses to be pickled, so it cannot be sent to a PROCESS checkpoint
  process (where it would write into that process's own, lost, memory).

fsspec is imported on first use; without it (or without the protocol's
backend, e.g. s3fs) the error names the protocol and what to install.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .formats import safetensors as _fmt_safetensors, metadata as _metadata
from .errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from .filesystem import (
    FileSystemReader,
    FileSystemWriter,
    complete_metadata,
    url_protocol,
)

__all__ = ["FsspecWriter", "FsspecReader"]

#: Byte ranges closer than this are fetched as one request.
_MERGE_GAP = 1 << 20
#: At most this many bytes are held in memory per batch of ranged reads.
_FETCH_BATCH = 64 << 20
#: A load reads the plan in turns of at most this many bytes of records
#: (one record when larger): each turn's ranges are fetched into the sparse
#: local files, read into their destinations, then freed (fetched bytes,
#: gaps merged in included, are at most twice a turn's records).
_TEMP_BUDGET = 256 << 20
#: A save's local staging space, per data record, on top of its bytes
#: (the record's zip headers and pickle, alignment).
_RECORD_OVERHEAD = 4 << 10
#: What names one version of an object in a store's listing or ``info``,
#: strongest first: a version id (GCS generation, S3 VersionId on a
#: versioned bucket), the ETag (S3, Azure, GCS), a time (local mtime, S3
#: LastModified, memory:// created).  A load pins each data file to these
#: and its size (``_stamp``) and compares the strongest that both the pin
#: and a later look give (``_same``: S3's listing has no VersionId, and
#: its LastModified is finer than a HEAD's).
_VERSION_KEYS = ("generation", "VersionId", "version_id", "ETag", "etag", "mtime",
                 "LastModified", "last_modified", "modified", "updated", "created")
#: A turn re-checks up to this many files with one ``info`` each, more with
#: one listing of the directory.
_INFO_MAX = 8


def _stamp(entry: dict) -> tuple:
    """(size, ((field, value), ...)): an object's version as an fsspec
    listing or info entry gives it (times as seconds)."""
    fields = []
    for key in _VERSION_KEYS:
        value = entry.get(key)
        if value is not None:
            if hasattr(value, "timestamp"):
                value = value.timestamp()
            fields.append((key, str(value)))
    return entry.get("size"), tuple(fields)


def _same(pin: tuple, now: tuple) -> bool:
    """Whether two stamps name one version: the sizes, then the strongest
    field both have (sizes alone where they share none)."""
    if pin[0] != now[0]:
        return False
    theirs = dict(now[1])
    for key, value in pin[1]:
        if key in theirs:
            return theirs[key] == value
    return True


def _describe(stamp: tuple, other: Optional[tuple] = None) -> str:
    """A stamp for a message: its size and its field that ``other`` shares."""
    shared = dict(other[1]) if other is not None else {}
    field = next(((k, v) for k, v in stamp[1] if other is None or k in shared), None)
    return f"{stamp[0]} bytes" + (f", {field[0]} {field[1]}" if field else "")


def url_to_fs(url: Union[str, os.PathLike], options: dict) -> tuple:
    """(fsspec filesystem, path within it) for ``url``, or an error that names
    the protocol and what to install."""
    url = os.fsdecode(os.fspath(url))
    proto = url_protocol(url) or "file"
    try:
        from fsspec.core import url_to_fs as _url_to_fs
    except ImportError as e:
        raise ImportError(
            f"dcpx: checkpoint {url!r} is a {proto}:// URL, and dcpx stores URLs "
            f"through fsspec, which is not installed (pip install fsspec)") from e
    try:
        return _url_to_fs(url, **options)
    except ImportError as e:
        raise ImportError(
            f"dcpx: checkpoint {url!r}: the fsspec backend for {proto}:// is not "
            f"installed ({e})") from e
    except ValueError as e:
        raise UnknownProtocolError(
            f"dcpx: checkpoint {url!r}: fsspec knows no protocol {proto!r} ({e}). Cannot "
            f"detect which StorageReader or StorageWriter to use. Please specify the "
            f"storage_reader/storage_writer.") from e


class UnknownProtocolError(RuntimeError, ValueError):
    """A checkpoint URL whose protocol fsspec does not know: a RuntimeError,
    as torch's save / load raise there ("Cannot detect which StorageReader
    or StorageWriter to use"), and a ValueError, as dcpx raised before."""


def _validate_url(checkpoint_id: Union[str, os.PathLike]) -> bool:
    """torch's FsspecWriter.validate_checkpoint_id: not a Path, and a URL
    (or path) fsspec resolves."""
    if isinstance(checkpoint_id, Path):
        return False
    try:
        from fsspec.core import url_to_fs as _url_to_fs
        _url_to_fs(checkpoint_id)
    except (ImportError, ValueError):
        return False
    return True


class _Store:
    """The fsspec filesystem and root of one checkpoint URL."""

    def __init__(self, url: Union[str, os.PathLike], options: dict) -> None:
        self.url = os.fsdecode(os.fspath(url))
        self.options = options
        self.fs, root = url_to_fs(self.url, options)
        self.root = root.rstrip("/") or root

    def join(self, name: str) -> str:
        return f"{self.root}/{name}"

    def where(self, name: str) -> str:
        """A file's URL, for messages."""
        return f"{self.url.rstrip('/')}/{name}"

    @property
    def turn_key(self) -> str:
        """The key of this store's directory for in-process turns
        (``_locks.dir_key``): the resolved local directory on the local file
        system (so that ``file:///d`` and a plain-path save into ``d`` take
        turns), else the protocol and the root as fsspec resolves it."""
        proto = self.fs.protocol
        protos = (proto,) if isinstance(proto, str) else tuple(proto)
        if "file" in protos:
            return os.path.realpath(self.root)
        return f"{protos[0]}://{self.root}"

    @property
    def process_local(self) -> bool:
        """An in-memory store another process cannot see."""
        proto = self.fs.protocol
        return "memory" in ((proto,) if isinstance(proto, str) else tuple(proto))

    def read_committed(self, name: str) -> Optional[Metadata]:
        """The committed metadata named ``name``, or None if there is none
        (or it cannot be parsed: its data files are then left alone)."""
        try:
            return _metadata.loads(self.fs.cat_file(self.join(name)), self.where(name))
        except (FileNotFoundError, CheckpointError):
            return None

    def listing(self) -> dict:
        """{name: fsspec entry} of the files directly under the root, listed
        now (the store's listing cache dropped first); {} when the root does
        not exist."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries}

    def remove(self, names) -> None:
        """Best effort: never let cleanup hide the error that caused it."""
        for name in names:
            try:
                self.fs.rm(self.join(name))
            except Exception:
                pass


class FsspecWriter(StorageWriter):
    """Drop-in for torch's ``FsspecWriter``: dcpx's C writer, CRC-32 per
    record and a commit that writes ``.metadata`` last (module docstring).

    ``single_file_per_rank``, ``thread_count`` (C writer threads and
    concurrent uploads) and ``overwrite`` are honoured; ``sync_files`` and
    ``per_thread_copy_ahead`` are accepted (what an upload guarantees is the
    store's: docs/reliability.md).  Further keyword arguments are fsspec
    storage options (``anon=``, ``endpoint_url=``, ...), as in torch.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        overwrite: bool = True,
        _extensions: Optional[Sequence[Any]] = None,
        serialization_format: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        # The same refusals as FileSystemWriter (extensions, formats, threads).
        FileSystemWriter(".", single_file_per_rank, False, thread_count,
                         _extensions=_extensions, serialization_format=serialization_format)
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = int(thread_count)
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.overwrite = overwrite
        self.store = _Store(path, kwargs)
        self.path = self.store.url
        self.save_id = str(uuid.uuid4())
        self.rank: Optional[int] = None
        self.is_coordinator = True
        self.use_collectives = True

    def check_crosses_processes(self) -> None:
        """Refuse to be used from another process when the store is this
        process's memory (async_save with PROCESS calls this first)."""
        if self.store.process_local:
            raise ValueError(
                f"dcpx: {self.path} is an in-memory fsspec store, which only this "
                f"process can see: it cannot be saved from a checkpoint process "
                f"(AsyncCheckpointerType.PROCESS); use AsyncCheckpointerType.THREAD")

    def __getstate__(self) -> dict:
        self.check_crosses_processes()  # pickled for another process
        return dict(self.__dict__)

    # -- StorageWriter protocol ------------------------------------------
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id:
            self.store = _Store(checkpoint_id, self.store.options)
            self.path = self.store.url
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.overwrite and self.store.fs.exists(self.store.join(self._metadata_name())):
            raise RuntimeError(
                f"Checkpoint already exists and self.overwrite={self.overwrite}: {self.path}")
        self.store.fs.makedirs(self.store.root, exist_ok=True)
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(
                f"__{self.rank}_{uuid.uuid4().hex[:8]}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # A tag new per save, always: no upload ever overwrites a data file
        # that a committed .metadata (or another save in flight) refers to.
        tag = uuid.uuid4().hex[:8]
        return [
            dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_{tag}_"))
            if p.storage_data is None else p
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        with tempfile.TemporaryDirectory(prefix="dcpx-fsspec-") as tmp:
            _check_staging_space(tmp, plan, self.path)
            local = FileSystemWriter(tmp, self.single_file_per_rank, sync_files=False,
                                     thread_count=self.thread_count)
            results: list[WriteResult] = local.write_data(plan, planner).wait()
            names = sorted({r.storage_data.relative_path for r in results})
            self._upload(tmp, names)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.commit(complete_metadata(self, metadata, results))

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> Union[str, os.PathLike]:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return _validate_url(checkpoint_id)

    # -- dcpx's pieces ----------------------------------------------------
    def _metadata_name(self) -> str:
        if self.rank is not None and not self.use_collectives:
            return f"__{self.rank}{_metadata.METADATA_FN}"
        return _metadata.METADATA_FN

    def _upload(self, tmp: str, names: list[str]) -> None:
        """Upload this rank's data files; on failure remove what was sent."""
        fs, store = self.store.fs, self.store

        def put(name: str) -> None:
            fs.put_file(os.path.join(tmp, name), store.join(name))

        try:
            if self.thread_count > 1 and len(names) > 1:
                with ThreadPoolExecutor(min(self.thread_count, len(names)),
                                        thread_name_prefix="dcpx-fsspec-put") as ex:
                    for f in [ex.submit(put, n) for n in names]:
                        f.result()
            else:
                for n in names:
                    put(n)
        except BaseException:
            store.remove(names)
            raise

    def commit(self, metadata: Metadata) -> None:
        """Write ``.metadata`` last: to a temporary name, then moved into
        place; then delete the data files of the checkpoint it replaced."""
        store = self.store
        name = self._metadata_name()
        tmp_name = f"{name}.tmp.{self.save_id}"
        keep = {si.relative_path for si in metadata.storage_data.values()}
        try:
            data = _metadata.dumps(metadata)
            previous = store.read_committed(name)
            store.fs.pipe_file(store.join(tmp_name), data)
        except BaseException:
            # Nothing committed: this save's files (every rank's: their names
            # are this save's own) would never be referenced.
            store.remove([tmp_name] + sorted(keep))
            raise
        try:
            store.fs.mv(store.join(tmp_name), store.join(name))
        except BaseException:
            # The move may have happened (a copy, then a failed delete): the
            # data files stay, only the temporary name goes.
            store.remove([tmp_name])
            raise
        if previous is not None:
            store.remove({si.relative_path for si in previous.storage_data.values()
                          if getattr(si, "relative_path", None)} - keep)


class FsspecReader(StorageReader):
    """Drop-in for torch's ``FsspecReader``.  dcpx's keyword arguments
    ``thread_count``, ``verify`` and ``allow_pickle`` mean what they mean for
    dcpx's FileSystemReader; further keyword arguments are fsspec storage
    options, as in torch."""

    def __init__(self, path: Union[str, os.PathLike], thread_count: Optional[int] = None,
                 verify: bool = True, allow_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__()
        self.store = _Store(path, kwargs)
        self.path = self.store.url
        self.thread_count = thread_count
        self.verify = verify
        self.allow_pickle = allow_pickle
        self.storage_data: dict = {}
        self.load_id = str(uuid.uuid4())
        self.rank: Optional[int] = None
        self.use_collectives = True
        self.is_coordinator = True
        self._metadata: Optional[Metadata] = None
        self._sizes: dict[str, int] = {}
        # each data file's version when the load began (_stamp), re-checked
        # at each turn; the listing read_metadata took before .metadata
        self._pins: dict[str, tuple] = {}
        self._listing: Optional[dict] = None

    # -- StorageReader protocol ------------------------------------------
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        self.storage_data = {}
        self._metadata = None
        self._listing = None
        self._pins = {}
        if checkpoint_id:
            self.store = _Store(checkpoint_id, self.store.options)
            self.path = self.store.url
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = _metadata.METADATA_FN if rank is None else f"__{rank}{_metadata.METADATA_FN}"
        store = self.store
        # The data files' versions are pinned from a listing taken before
        # .metadata is read (a listing cached before the save is dropped):
        # a data file rewritten in place after this is refused at the next
        # turn (_check_pins), not read as part of this checkpoint.
        self._listing = store.listing()
        try:
            data = store.fs.cat_file(store.join(name))
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                2, f"dcpx: no checkpoint at {self.path}: it has no {name} (the save "
                   f"never committed, was interrupted, or the URL is wrong)",
                store.where(name)) from None
        md = _metadata.loads(data, store.where(name))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata
        self.storage_data = metadata.storage_data
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        self._sizes = self._file_sizes(metadata)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Fetch the byte ranges the plan needs into sparse local files of
        the remote files' sizes, then read them with dcpx's FileSystemReader
        (CRC-32 verified, weights_only values, its error messages with this
        URL in place of the local directory)."""
        assert self._metadata is not None, "set_up_storage_reader was not called"
        with tempfile.TemporaryDirectory(prefix="dcpx-fsspec-") as tmp:
            self._sparse_files(tmp)
            headers = self._fetch_safetensors_headers(tmp)
            self._check_pins(headers)
            local = FileSystemReader(tmp, thread_count=self.thread_count, verify=self.verify,
                                     allow_pickle=self.allow_pickle)
            try:
                local.set_up_storage_reader(self._metadata, self.is_coordinator,
                                            rank=self.rank, use_collectives=self.use_collectives)
                self._free(tmp, headers)  # parsed: their space goes back
                # In turns of _TEMP_BUDGET bytes, in the plan's order: the
                # local space and memory a load needs are bounded, not the
                # size of what it loads.
                # The local reader's entries are resolved (a SAFETENSORS
                # tensor's to its own bytes, dcpx.formats.entries): fetch those.
                resolved = local.storage_data
                for items in self._turns(plan.items):
                    touched = self._fetch(tmp, [resolved[r.storage_index] for r in items])
                    self._check_pins(touched)  # what was fetched is the pinned version
                    local.read_data(dataclasses.replace(plan, items=items), planner).wait()
                    self._free(tmp, touched)
            except (CheckpointError, OSError) as e:
                raise _renamed(e, tmp, self.path.rstrip("/")) from None
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self) -> Union[str, os.PathLike]:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return _validate_url(checkpoint_id)

    # -- dcpx's pieces ----------------------------------------------------
    def _file_sizes(self, metadata: Metadata) -> dict[str, int]:
        """The size of every data file the metadata names, from one listing;
        names that would leave the checkpoint's directory are refused."""
        store = self.store
        names = set()
        for index, info in metadata.storage_data.items():
            rel = getattr(info, "relative_path", None)
            if (not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel
                    or rel in (".", "..") or "\0" in rel):
                raise CorruptCheckpointError(
                    f"{self.path}: metadata names data file {rel!r} outside the "
                    f"checkpoint directory (refused)")
            names.add(rel)
        listing = self._listing if self._listing is not None else store.listing()
        self._listing = None  # a later load of this reader lists again
        sizes, pins = {}, {}
        for rel in names:
            entry = listing.get(rel)
            size = None if entry is None else entry.get("size")
            if size is None:
                raise CorruptCheckpointError(
                    f"{self.path}: data file {rel} is missing ({store.where(rel)})")
            sizes[rel] = int(size)
            pins[rel] = _stamp(entry)
        self._pins = pins
        return sizes

    def _check_pins(self, names) -> None:
        """Refuse the load when a data file in ``names`` is no longer the
        version it was when the load began (size and version id / ETag /
        time, as the store gives them): another save rewrote it in place
        (torch's FsspecWriter reuses ``__0_0.distcp``) or removed it, and
        what this load read would mix two saves, every record's CRC valid.
        One ``info`` per file (a HEAD on S3), or one listing of the
        directory for more than _INFO_MAX files."""
        names = sorted(n for n in names if n in self._pins)
        if not names:
            return
        store = self.store
        if len(names) > _INFO_MAX:
            listing = store.listing()
            entries = {rel: listing.get(rel) for rel in names}
        else:
            entries = {}
            for rel in names:
                store.fs.invalidate_cache(store.join(rel))
                try:
                    entries[rel] = store.fs.info(store.join(rel))
                except FileNotFoundError:
                    entries[rel] = None
        for rel in names:
            pin = self._pins[rel]
            entry = entries[rel]
            now = None if entry is None else _stamp(entry)
            if now is not None and _same(pin, now):
                continue
            got = "it is gone" if now is None else f"now {_describe(now, pin)}"
            raise CorruptCheckpointError(
                f"{store.where(rel)}: data file {rel} changed while it was being "
                f"loaded ({_describe(pin, now)} when the load began, {got}): another save "
                f"rewrote or removed it (torch's FsspecWriter rewrites its data files in "
                f"place), so what was read could mix two saves; the load is refused: load "
                f"again once the save has finished")

    def _sparse_files(self, tmp: str) -> None:
        """Every data file as a local sparse file of its size (no space)."""
        for rel, size in self._sizes.items():
            with open(os.path.join(tmp, rel), "wb") as f:
                f.truncate(size)

    def _fetch_safetensors_headers(self, tmp: str) -> set:
        """The headers of the SAFETENSORS blobs the metadata may hold (its
        u64 length, then the JSON), fetched before the local reader is set
        up: it recognises and checks the format there (dcpx.formats.entries), and
        they are freed once it is.  Together at most what the metadata
        allows them (``_fmt_safetensors.header_budget``): a longer one is
        not fetched, and the local reader refuses it, as a truncated one.
        Returns the names of the files written."""
        blobs = _fmt_safetensors.candidates(self._metadata) if self._metadata else set()
        budget = _fmt_safetensors.header_budget(self._metadata, len(blobs)) if blobs else 0
        fetched = set()
        for rel, off in sorted(blobs):
            size = self._sizes.get(rel, 0)
            if not isinstance(off, int) or off < 0 or off + 9 > size:
                continue
            self._fetch_batch(tmp, [(rel, off, off + 9)])
            fetched.add(rel)
            with open(os.path.join(tmp, rel), "rb") as f:
                f.seek(off)
                head = f.read(9)
            n = int.from_bytes(head[:8], "little")
            if not _fmt_safetensors.looks_like_blob(head) or n > min(
                    budget, _fmt_safetensors.MAX_HEADER, size - off - 8):
                continue
            budget -= n
            for start in range(off + 9, off + 8 + n, _FETCH_BATCH):
                self._fetch_batch(tmp, [(rel, start, min(off + 8 + n, start + _FETCH_BATCH))])
        return fetched

    def _free(self, tmp: str, names) -> None:
        """Give back the space of the ranges fetched into ``names`` (the
        files stay, sparse, at their sizes)."""
        for rel in names:
            p = os.path.join(tmp, rel)
            os.truncate(p, 0)
            os.truncate(p, self._sizes[rel])

    def _turns(self, items: list) -> list:
        """``items`` in order, cut into turns of at most _TEMP_BUDGET bytes
        of records (a larger record is a turn of its own)."""
        turns: list = [[]]
        held = 0
        for item in items:
            n = getattr(self.storage_data.get(item.storage_index), "length", 0)
            n = n if isinstance(n, int) and n > 0 else 0
            if turns[-1] and held + n > _TEMP_BUDGET:
                turns.append([])
                held = 0
            turns[-1].append(item)
            held += n
        return [t for t in turns if t]

    def _fetch(self, tmp: str, infos: list) -> set:
        """Fetch the ranges in ``infos`` into the sparse local files (merged
        when the gap is small: at most 1 MiB and at most the next range's
        size, so that what is fetched is at most twice what is needed; in
        bounded batches); returns the names of the files written."""
        ranges: dict[str, list] = {}
        for info in infos:
            if isinstance(info.offset, int) and isinstance(info.length, int) and info.length > 0:
                end = min(info.offset + info.length, self._sizes.get(info.relative_path, 0))
                if end > info.offset:  # else the local reader reports the bad extent
                    ranges.setdefault(info.relative_path, []).append((info.offset, end))
        pieces = []
        for rel, spans in ranges.items():
            spans.sort()
            merged = [list(spans[0])]
            for lo, hi in spans[1:]:
                if lo <= merged[-1][1] + min(_MERGE_GAP, hi - lo):
                    merged[-1][1] = max(merged[-1][1], hi)
                else:
                    merged.append([lo, hi])
            for lo, hi in merged:
                for start in range(lo, hi, _FETCH_BATCH):
                    pieces.append((rel, start, min(hi, start + _FETCH_BATCH)))
        batch: list = []
        held = 0
        for piece in pieces + [None]:
            if piece is not None and (not batch or held + piece[2] - piece[1] <= _FETCH_BATCH):
                batch.append(piece)
                held += piece[2] - piece[1]
                continue
            if batch:
                self._fetch_batch(tmp, batch)
            batch, held = ([piece], piece[2] - piece[1]) if piece is not None else ([], 0)
        return set(ranges)

    def _fetch_batch(self, tmp: str, batch: list) -> None:
        store = self.store
        try:
            datas = store.fs.cat_ranges([store.join(r) for r, _, _ in batch],
                                        [s for _, s, _ in batch], [e for _, _, e in batch],
                                        on_error="raise")
        except FileNotFoundError:
            self._check_pins({r for r, _, _ in batch})  # removed by another save
            raise
        for (rel, start, end), data in zip(batch, datas):
            if len(data) != end - start:
                self._check_pins({rel})
                raise CorruptCheckpointError(
                    f"{store.where(rel)}: read {len(data)} of the {end - start} bytes at "
                    f"offset {start} (the file is shorter than its listing: changed "
                    f"while loading?)")
            fd = os.open(os.path.join(tmp, rel), os.O_WRONLY)
            try:
                view = memoryview(data)
                off = start
                while view:
                    n = os.pwrite(fd, view, off)
                    view, off = view[n:], off + n
            finally:
                os.close(fd)


def staging_bytes(plan: SavePlan) -> int:
    """The local space a save of ``plan`` through FsspecWriter stages before
    it uploads: every tensor chunk's bytes plus _RECORD_OVERHEAD per item
    (non-tensor values count that only: their pickles are made while
    writing)."""
    total = 0
    for item in plan.items:
        td = getattr(item, "tensor_data", None)
        if td is not None:
            n = 1
            for s in td.chunk.sizes:
                n *= int(s)
            total += n * td.properties.dtype.itemsize
        total += _RECORD_OVERHEAD
    return total


def _check_staging_space(tmp: str, plan: SavePlan, url: str) -> None:
    """Refuse, before writing anything, a save whose local staging needs
    more than the free space where ``tmp`` is."""
    need = staging_bytes(plan)
    try:
        free = shutil.disk_usage(tmp).free
    except OSError:
        return
    if need > free:
        raise OSError(errno.ENOSPC,
                      f"dcpx: saving to {url} stages this rank's data files locally "
                      f"before uploading them: {need} bytes, and {os.path.dirname(tmp)} "
                      f"has {free} free (set TMPDIR to a larger file system)",
                      os.path.dirname(tmp))


def _renamed(e: BaseException, tmp: str, url: str) -> BaseException:
    """The same error with the local staging directory replaced by the URL."""
    if isinstance(e, OSError) and e.errno is not None:
        filename = e.filename.replace(tmp, url) if isinstance(e.filename, str) else e.filename
        return type(e)(e.errno, (e.strerror or "").replace(tmp, url), filename)
    try:
        new = type(e)(str(e).replace(tmp, url))
    except Exception:
        return e
    new.__dict__.update({k: v for k, v in e.__dict__.items() if k not in new.__dict__})
    return new
