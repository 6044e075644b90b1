"""FileSystemWriter: torch's StorageWriter protocol over dcpx's C writer.
The commit (metadata rename and cleanup) is dcpx.storage.commit."""
from __future__ import annotations

import dataclasses
import io
import os
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from . import commit as _commit, locks as _locks
from ..formats import (
    safetensors as _fmt_safetensors, transforms as _fmt_transforms, metadata as _metadata,
)
from ..formats.files import (
    DCP_VERSION, _check_dir, disagreeing_paths, local_path, validate_checkpoint_id,
)
from .pending import (
    LazyItem,
    PendingWrite,
    _buckets,
    _Entry,
    check_saveable,
    tensor_payload,
    value_payload,
)
from .._torchcompat import new_metadata, stamp_version
from ..errors import CheckpointError


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
    stamp_version(metadata, DCP_VERSION)
    return metadata



class _RankPath(NamedTuple):
    """A rank's checkpoint path, carried in its local SavePlan's
    ``storage_data`` to the coordinator (torch's generic save path), which
    refuses the save when the ranks disagree (see dcpx.coordination.dist.path_key)."""
    path: str


def _path_key(path: Any) -> str:
    return os.path.normpath(os.fspath(path))


class FileSystemWriter(StorageWriter):
    """Drop-in for ``torch.distributed.checkpoint.FileSystemWriter``.

    Honoured: ``single_file_per_rank``, ``sync_files`` (data files, metadata
    and the directory are fsynced), ``thread_count`` (C writer threads, one
    file each), ``overwrite``.  ``per_thread_copy_ahead`` and
    ``cache_staged_state_dict`` are accepted for compatibility; staging is
    done by dcpx's stager (see dcpx.staging).  ``serialization_format``
    (SAFETENSORS) and ``_extensions`` (stream transforms) write torch's
    other formats (docs/format.md).
    """

    _safetensors = False          # serialization_format=SAFETENSORS
    _extensions: Sequence = ()    # stream transforms, applied in order

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
        fmt = getattr(serialization_format, "value", serialization_format) or "torch_save"
        if fmt not in ("torch_save", "safetensors"):
            raise ValueError(f"dcpx: unknown serialization_format {serialization_format!r}")
        # torch's stream transforms (dcpx.formats.transforms) and SAFETENSORS
        # data files (dcpx.formats.safetensors); both are written through
        # write_entries, by torch's save path (fast_path_eligible is False)
        self._extensions = _fmt_transforms.check_extensions(_extensions)
        self._safetensors = fmt == "safetensors"
        if self._safetensors and self._extensions:
            raise NotImplementedError(
                "dcpx: SAFETENSORS with stream-transform _extensions is not supported (torch "
                "records transforms for tensors it writes untransformed); choose one")
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
        # This save's tag and lock (dcpx/storage/locks.py), from the choice of its
        # file names to the end of its commit.
        self._save_lock: Optional[_locks.FileLock] = None
        # Called under the commit lock before the rename: a message means
        # "do not commit" (the checkpoint process of a dead parent sets it).
        self._commit_check: Optional[Any] = None
        # Set by a single-process save for encode_metadata (dcpx.coordination.plan).
        self._splice: Optional[_metadata.Splice] = None

    def __getstate__(self) -> dict:
        # A save's lock (a descriptor) and commit check stay in this process.
        state = self.__dict__.copy()
        state["_save_lock"] = state["_commit_check"] = state["_splice"] = None
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
                entries.append(self._entry(item.index, payload, len(payload)))
            else:
                entries.append(self._tensor_entry(item.index, data))
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
        return validate_checkpoint_id(checkpoint_id)

    # -- dcpx's pieces ----------------------------------------------------
    def plain_format(self) -> bool:
        """TORCH_SAVE records without stream transforms: the format dcpx's
        own save paths (dcpx.coordination.plan, dcpx.coordination.dist) write.  Otherwise a save
        takes torch's path through ``write_data``."""
        return not self._safetensors and not self._extensions

    def _entry(self, index: MetadataIndex, payload: bytes, nbytes: int) -> _Entry:
        """A bytes item's entry: through the stream transforms, if any."""
        if self._extensions:
            payload, descs = _fmt_transforms.encode(payload, self._extensions)
            return _Entry(index, payload, len(payload), tuple(descs))
        return _Entry(index, payload, nbytes)

    def _tensor_entry(self, index: MetadataIndex, t: torch.Tensor) -> _Entry:
        """A tensor's entry in this writer's format: a TORCH_SAVE archive by
        the C writer; the tensor's raw bytes in a SAFETENSORS file (meta:
        dtype and shape for the header; dcpx.formats.safetensors); or the
        ``torch.save`` archive through the stream transforms."""
        fqn = index.fqn
        nbytes = t.numel() * t.element_size()
        if self._safetensors:
            _fmt_safetensors.name_of(t.dtype, fqn)
            return _Entry(index, tensor_payload(t, fqn), nbytes, (t.dtype, tuple(t.shape)))
        if self._extensions:
            check_saveable(t, fqn)
            t = t.detach().cpu()
            if (not t.is_contiguous() or t.storage_offset()
                    or t.untyped_storage().nbytes() != nbytes):
                t = t.clone(memory_format=torch.contiguous_format)  # as torch's loader
            buf = io.BytesIO()
            torch.save(t, buf)
            return self._entry(index, buf.getvalue(), nbytes)
        return _Entry(index, tensor_payload(t, fqn), nbytes)

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

    def write_entries(self, prefix: str, entries: Sequence[_Entry], first: int = 0,
                      groups: Optional[list] = None) -> PendingWrite:
        """Lay out entries into data files named ``{prefix}{i}.distcp``,
        ``i`` counting from ``first``.  ``groups``: which entries go into
        which file (lists of indices), when the caller's plan has it
        (dcpx.coordination.plan.file_groups, the same rule)."""
        if groups is not None:
            groups = [[entries[i] for i in g] for g in groups]
        elif self.single_file_per_rank:
            groups = [g for g in _buckets(entries, self.thread_count) if g] or [[]]
        else:
            groups = [[e] for e in entries]
        files = [(f"{prefix}{first + i}.distcp", g) for i, g in enumerate(groups)]
        if self._safetensors:
            return _SafetensorsWrite(self, files)
        pw = PendingWrite(self, files)
        if self._extensions:
            pw._results = [
                WriteResult(index=e.index, size_in_bytes=length, storage_data=_StorageInfo(
                    name, offset, length, transform_descriptors=list(e.meta) if e.meta else None))
                for (name, ents), lay in zip(files, pw.layout)
                for e, (offset, length) in zip(ents, lay)]
        return pw

    def write_payloads(self, names: list[str], payloads: list[list],
                       base=None) -> PendingWrite:
        """Lay out data files ``names[i]`` holding ``payloads[i]`` (C-writer
        payloads, in order), for a caller that knows each one's item itself
        (dcpx.coordination.plan.plan_local_save): the single-process save's counterpart
        of ``write_entries``.  ``base``: see ``PendingWrite.of_payloads``."""
        return PendingWrite.of_payloads(self, names, payloads, base)

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
                md = new_metadata(state_dict_metadata=sdm,
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
                # The save paths' own metadata (shared properties and
                # offsets: a compact .metadata for many tensors).
                md = sdm[fqn] = _metadata.tensor_metadata(
                    value, torch.cuda.is_initialized() and value.is_pinned())
                index = MetadataIndex(fqn, md.chunks[0].offsets, 0)
                entry = self._tensor_entry(index, value)
            else:
                payload = value_payload(value, fqn)
                sdm[fqn] = BytesStorageMetadata()
                index = MetadataIndex(fqn)
                entry = self._entry(index, payload, len(payload))
            nbytes = entry.nbytes
            if pending and pending + nbytes > file_bytes:
                flush()
            batch.append(entry)
            held.append((fqn, value))
            pending += nbytes
            del value, entry
        flush()
        return storage, sdm

    def encode_metadata(self, metadata: Metadata) -> bytes:
        # A single-process save's hint for reusing the last save's encoding
        # (dcpx.formats.metadata.Splice), if it left one for this metadata.
        splice, self._splice = getattr(self, "_splice", None), None
        return _metadata.dumps(metadata, splice)

    def commit(self, metadata: Metadata, data: Any = None) -> Optional[tuple]:
        """Make the checkpoint visible atomically (dcpx.storage.commit).  ``data``
        is ``encode_metadata(metadata)`` (bytes, or a formats.metadata.Spliced)
        if the caller has it.  Returns the identity of the file written."""
        return _commit.commit(self, metadata, data)

    def _discard_own(self) -> None:
        """Remove every data file of this save (all ranks'): it will not be
        committed."""
        _commit.discard_own(self)

    def _remove_unreferenced(self, metadata: Metadata, ino: Optional[int] = None) -> None:
        """Delete data files the new metadata does not reference (under the
        commit lock; dcpx.storage.commit)."""
        _commit.remove_unreferenced(self, metadata, ino)


class _SafetensorsWrite(PendingWrite):
    """The data files of a SAFETENSORS save: each file's bytes items, then
    its safetensors blob (header, then the tensors' bytes as raw C-writer
    items: no copy, csrc/writer.c); results as torch records them."""

    def __init__(self, writer: "FileSystemWriter", files: list) -> None:
        laid, places = [], []
        for name, ents in files:
            payloads, where = _fmt_safetensors.file_items(ents)
            laid.append(payloads)
            places.append(where)
        self._begin(writer, [name for name, _ in files], laid)
        self.files = files
        self._results = [
            WriteResult(index=e.index, size_in_bytes=info.length, storage_data=info)
            for (name, ents), lay, where in zip(files, self.layout, places)
            for e, info in zip(ents, _fmt_safetensors.storage_infos(name, lay, where))]
