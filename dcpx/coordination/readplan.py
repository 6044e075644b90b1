"""Load once, plan once: the parsed, checked metadata of recently loaded
checkpoints and, per destination layout, a compiled read plan.

Loading the same checkpoint again (the same ``.metadata`` file, byte for
byte) into a state dict of the same layout (the same keys in the same order,
each tensor of the same dtype and shape in contiguous host memory) reuses:

* the ``Metadata`` object: no unpickling, no ``_metadata._validate``, no
  per-entry storage checks (``FileSystemReader._validate_storage``);
* the read plan: a ``_C.read_plan`` capsule holding the files, each
  archive's extent and storage type, where its destination sits in the flat
  state dict, and the reads grouped into runs.  ``_C.read_plan_run`` takes
  each destination's current memory (DLPack, from the tensor the state dict
  holds now) and checks it against the plan; every archive is parsed and
  every tensor's bytes CRC-checked on every load, as without the cache.

What makes an entry valid (docs/design.md, "The read-plan cache"):

* the ``.metadata`` file is read on every load, and its bytes and identity
  (st_dev, st_ino, st_size, st_mtime_ns) must equal the cached ones: a new
  save (a new file renamed in), or a rewrite with the same size and mtime,
  misses;
* every data file checked so far has the identity (st_dev, st_ino,
  st_size, st_mode, st_mtime_ns) it had when its entries were checked, else
  the checkpoint is checked again from scratch;
* a destination that is not what the plan was made for (another type,
  dtype, shape, device, non-contiguous, a neg / conj bit) makes the run read
  nothing and the load plan again;
* a run that reports any failure (a CRC mismatch, a record the C reader
  leaves to torch) turns the plan off for that checkpoint: the load, and
  every later one, takes the uncached path, which raises exactly what a
  load without the cache would.

Each rank touches only the data files it reads (issue 28): opening a
checkpoint reads ``.metadata`` alone and checks what needs no file (names,
extents, types); ``need_files`` checks each data file when a load first
reads from it (found regular by lstat, no link, every extent the metadata
gives in it inside its size, and for the C decoder's tables a TORCH_SAVE
file: ``_entries.plain_zip_files``), and raises the error the whole
checkpoint's check would raise for it.  A data file that is not TORCH_SAVE
(SAFETENSORS) turns the checkpoint back to the general path: decoded,
every file checked and resolved (``_entries.resolve``) as before.

At most ``MAX_CHECKPOINTS`` checkpoints and ``MAX_PLANS`` layouts each are
kept (least recently used first out).  ``clear()`` empties the cache.
"""
from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from .. import _C
from ..formats import entries as _entries, metadata as _metadata, safetensors as _st
from ..formats import loadindex as _loadindex
from ..formats.safetensors import is_raw
from ..formats.dtypes import _TO_DLPACK, _needs_int_view, storage_type_name

MAX_CHECKPOINTS = 2
MAX_PLANS = 4

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

_lock = threading.Lock()
_cache: "OrderedDict[str, Checkpoint]" = OrderedDict()


def clear() -> None:
    """Forget every cached checkpoint and plan."""
    with _lock:
        _cache.clear()


class Plan:
    """A compiled read plan for one destination layout."""

    __slots__ = ("capsule", "byte_keys", "ran")

    def __init__(self, capsule: Any, byte_keys: list, ran: Optional[list] = None) -> None:
        self.capsule = capsule
        self.byte_keys = byte_keys
        # The failures of a run made as the plan was made (_indexed_plan):
        # run_plan reports them instead of running it again.
        self.ran = ran


class Checkpoint:
    """One ``.metadata`` file as parsed and checked, and its plans.

    After a load through a plan, a cached checkpoint keeps its bytes, not
    its ``Metadata`` objects (~20 per tensor): ``release()`` drops them
    inside the load's GC pause, so that they are neither kept in memory
    nor scanned by the collector when the pause ends; ``metadata`` decodes
    them again when a load has to plan (another layout).  A load planned by
    ``_dist.plan_reads`` (casts, resharding, CUDA) keeps them for the next
    one."""

    __slots__ = ("ident", "raw", "where", "_md", "files", "plans", "no_plan", "byte_index",
                 "whole_index", "no_direct", "index", "_nkeys", "names", "lazy", "_by_file",
                 "lidx", "_demote", "extents")

    def __init__(self, ident: Optional[tuple], raw: bytes, metadata: Optional[Metadata],
                 files: dict, where: str = "", index: Any = None,
                 names: Optional[list] = None, lazy: bool = False) -> None:
        self.ident = ident            # None: not cached (metadata kept as given)
        self.raw = raw
        self.where = where
        self._md: Optional[Metadata] = metadata
        self.files = files            # data file name -> identity when checked
        # lazy: the data files are checked as a load first reads each
        # (need_files), not when the checkpoint is opened
        self.lazy = lazy
        self.names = names            # the C tables' data files, in their order
        self._by_file: Optional[dict] = None  # name -> its storage entries
        self.plans: OrderedDict = OrderedDict()
        self.no_plan = False          # a plan run failed: plan every load
        self.no_direct: OrderedDict = OrderedDict()  # layouts read_plan refused
        self.byte_index: Optional[dict] = None
        self.whole_index: Optional[dict] = None
        # _C.md_index's tables (csrc/mdindex.c), when it decoded the file:
        # then no Metadata object is made unless something asks for one.
        self.index = index
        self._nkeys: Optional[int] = None
        # The load index (formats/loadindex.py) when the checkpoint was
        # opened through it: .metadata is not read until something needs
        # more than the index answers (demote).  extents: per data file,
        # the end of the furthest extent looked up (need_files checks it).
        self.lidx: Any = None
        self._demote: Any = None
        self.extents: dict = {}

    def key_count(self) -> int:
        """How many keys the checkpoint holds (without decoding the
        Metadata again once it was released: call it before a load)."""
        if self.lidx is not None:
            return self.lidx.key_count()
        n = self._nkeys
        if n is None:
            if self._md is None and self.index is not None:
                n = _C.md_index_len(self.index)
            else:
                n = len(self.metadata.state_dict_metadata)
            self._nkeys = n
        return n

    def keys(self) -> set:
        """Every key of the checkpoint (decoded for this call only)."""
        if self.lidx is not None:
            try:
                return self.lidx.keys()
            except _loadindex.LoadIndexCorrupt:
                self.demote()
        md = self._md if self._md is not None else _metadata.loads(
            self.raw, self.where, indexed=self.index is not None)
        return set(md.state_dict_metadata)

    @property
    def decoded(self) -> bool:
        """Whether the ``Metadata`` objects are held (decoded, or given)."""
        return self._md is not None

    @property
    def metadata(self) -> Metadata:
        if self.lidx is not None:
            self.demote()
        md = self._md
        if md is None:  # the same bytes, checked when first cached
            md = self._md = _metadata.loads(self.raw, self.where,
                                            indexed=self.index is not None)
        return md

    def release(self) -> None:
        if self.ident is not None:
            self._md = None
            self.whole_index = None
            self._by_file = None

    def whole_chunks(self) -> dict:
        """fqn -> storage info of every non-empty tensor saved as one
        chunk covering all of it."""
        if self.whole_index is None:
            sdm = self.metadata.state_dict_metadata
            index = {}
            for k, v in self.metadata.storage_data.items():
                md = sdm.get(k.fqn)
                if type(md) is TensorStorageMetadata and len(md.chunks) == 1:
                    ch = md.chunks[0]
                    # k.offset None (a non-tensor's index) is not the
                    # chunk's, even for a 0-d tensor: torch and plan_reads
                    # look the chunk up by MetadataIndex(fqn, offsets)
                    if (ch.sizes == md.size and not any(ch.offsets)
                            and k.offset is not None
                            and tuple(k.offset) == tuple(ch.offsets)
                            and md.size.numel() > 0):
                        index[k.fqn] = v
            self.whole_index = index
        return self.whole_index

    def entries_in(self, names: list) -> Metadata:
        """The Metadata restricted to the storage entries in data files
        ``names`` (the state dict metadata whole)."""
        if self._by_file is None:
            by: dict = {}
            for k, v in self.metadata.storage_data.items():
                by.setdefault(getattr(v, "relative_path", None), {})[k] = v
            self._by_file = by
        storage: dict = {}
        for name in names:
            storage.update(self._by_file.get(name, {}))
        return Metadata(state_dict_metadata=self.metadata.state_dict_metadata,
                        storage_data=storage)

    @property
    def regions(self) -> bool:
        """Whether ``region`` answers (the load index, or the C tables
        while the Metadata is not decoded)."""
        return self.lidx is not None or (self.index is not None and self._md is None)

    def demote(self) -> None:
        """Read and check ``.metadata`` now, as a checkpoint opened without
        the load index is (the index found damaged, or something asked for
        more than it answers), and take that state in place."""
        fn, self._demote = self._demote, None
        idx, self.lidx = self.lidx, None
        if idx is not None:
            idx.close()
        if fn is not None:
            fn(self)

    def region(self, fqn: str, region: Optional[tuple]) -> Any:
        """Key ``fqn`` as one rank's plan needs it, from the C decoder's
        tables (``_C.md_index_region``): None (no such key), () (a
        non-tensor value), or (dtype, size, chunks, infos) with only the
        saved chunks that meet ``region`` ((offsets, sizes); None: no
        chunks).  Raises LookupError without tables, or once the
        ``Metadata`` was decoded (plan from it then)."""
        if self.lidx is not None:
            try:
                got = self.lidx.region(fqn, region)
            except _loadindex.LoadIndexCorrupt:
                self.demote()
                raise Demoted() from None
            if got:
                self._extents(got[3])
            return got
        if self.index is None or self._md is not None:
            raise LookupError("dcpx: no C tables to look a region up in")
        return _C.md_index_region(self.index, fqn, region, ChunkStorageMetadata, torch.Size,
                                  _StorageInfo)

    def _extents(self, infos) -> None:
        ends = self.extents
        for info in infos:
            if info is not None:
                end = info.offset + info.length
                if end > ends.get(info.relative_path, -1):
                    ends[info.relative_path] = end

    def byte_info(self) -> dict:
        """fqn -> storage info of every non-tensor value."""
        if self.byte_index is None and self.lidx is not None:
            try:
                self.byte_index = self.lidx.byte_info()
                self._extents(self.byte_index.values())
            except _loadindex.LoadIndexCorrupt:
                self.demote()
        if self.byte_index is None and self.index is not None:
            self.byte_index = _C.md_index_bytes(self.index, _StorageInfo)
        if self.byte_index is None:
            self.byte_index = {k.fqn: v for k, v in self.metadata.storage_data.items()
                               if k.offset is None}
        return self.byte_index


class Demoted(Exception):
    """A region lookup found the load index damaged: the checkpoint now
    answers from ``.metadata``; what was looked up so far is looked up
    again."""


def _file_ident(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mode, st.st_mtime_ns)


def _files_unchanged(directory, files: dict) -> bool:
    for name, ident in files.items():
        try:
            if _file_ident(os.lstat(directory / name)) != ident:
                return False
        except OSError:
            return False
    return True


def checkpoint(reader, rank: Optional[int] = None, use_index: bool = True) -> Checkpoint:
    """The checkpoint ``reader`` points at (its ``__{rank}.metadata`` when
    rank is given), checked as ``read_metadata`` + ``set_up_storage_reader``
    check it: from the cache when its files are unchanged.  With a load
    index made for its ``.metadata`` (formats/loadindex.py), that file is
    not read until something needs more than the index answers."""
    if rank is None and use_index:
        ck = _from_load_index(reader)
        if ck is not None:
            return ck
    path, raw, st = reader._read_metadata_file(rank)
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    key = str(path)
    with _lock:
        ck = _cache.get(key)
        if ck is not None:
            _cache.move_to_end(key)
    if (ck is not None and ck.ident == ident and ck.raw == raw
            and _files_unchanged(reader.path, ck.files)):
        return ck
    ck = _indexed(reader, raw, ident, key)
    if ck is not None:
        _remember(key, ck)
        return ck
    md = _metadata.loads(raw, key)
    if not _st.candidates(md):
        # no entry that could be a SAFETENSORS blob: no data file needed
        # until a load reads from it (need_files)
        reader._validate_storage(md, files=False)
        ck = Checkpoint(ident, raw, md, {}, key, lazy=True)
        _remember(key, ck)
        return ck
    return _general(reader, raw, md, key, ident)


def _from_load_index(reader) -> Optional[Checkpoint]:
    """The checkpoint as its load index answers, or None (no index, or
    not one made for this ``.metadata``: the caller reads ``.metadata``).
    Not cached (the index is opened again by each load: its header and
    the trailer of ``.metadata``), and planned by ``plan_reads`` on every
    load (no_plan: the direct plan needs the C tables)."""
    try:
        idx = _loadindex.LoadIndex.open(reader.path)
    except OSError:
        return None  # no .metadata: the caller raises what it raises
    if idx is None:
        return None
    ck = Checkpoint(None, b"", None, {}, str(reader.path / _metadata.METADATA_FN), lazy=True)
    ck.lidx = idx
    ck.no_plan = True

    def demote(ck: Checkpoint) -> None:
        fresh = checkpoint(reader, None, use_index=False)
        for name in ("raw", "_md", "index", "names", "lazy", "no_plan"):
            setattr(ck, name, getattr(fresh, name))
        ck.files = dict(fresh.files)
        ck.byte_index = ck.whole_index = ck._by_file = None
        ck._nkeys = None
        reader._set_up_cached(ck, reader.rank, reader.use_collectives)
    ck._demote = demote
    return ck


def _general(reader, raw: bytes, md: Metadata, key: str, ident: Optional[tuple]) -> Checkpoint:
    """The checkpoint checked whole: every data file, the SAFETENSORS
    entries resolved."""
    reader._validate_storage(md)
    resolved = _entries.resolve(reader.path, md)
    if resolved is not md:
        # SAFETENSORS entries, resolved from the data files' headers: not
        # cached (ident None: every load reads and checks the headers again)
        return Checkpoint(None, raw, resolved, {})
    names = {info.relative_path for info in md.storage_data.values()}
    files = {}
    for name in names:
        try:
            files[name] = _file_ident(os.lstat(reader.path / name))
        except OSError:  # gone since it was checked: do not cache
            ck = Checkpoint(None, raw, md, {})
            ck.no_plan = True
            return ck
    ck = Checkpoint(ident, raw, md, files, key)
    _remember(key, ck)
    return ck


def _remember(key: str, ck: Checkpoint) -> None:
    with _lock:
        _cache[key] = ck
        _cache.move_to_end(key)
        while len(_cache) > MAX_CHECKPOINTS:
            _cache.popitem(last=False)


def _indexed(reader, raw: bytes, ident: tuple, key: str) -> Optional[Checkpoint]:
    """The checkpoint as the C decoder reads it (csrc/mdindex.c): its
    tables, checked as ``_metadata.loads`` and ``_validate_storage`` check
    the Metadata without its files (need_files checks each as a load
    first reads it).  None when the decoder leaves the file to Python:
    the caller then decodes and checks it, and raises what it finds."""
    found = _metadata.index(raw, key)
    if found is None:
        return None
    index, names = found
    # the data files: checked as a load reads each (need_files)
    return Checkpoint(ident, raw, None, {}, key, index, names, lazy=True)


def need_files(reader, ck: Checkpoint, names) -> bool:
    """Check the data files ``names`` of ``ck`` that no load checked yet,
    before this rank reads them, as opening the checkpoint checked every
    file before issue 28: each found regular (no link), every extent in it
    inside its size; raises the error that check raises (naming the file
    and a key).  With the C decoder's tables each must be a TORCH_SAVE
    file too: if one is not, ``ck`` turns to the general path (decoded,
    every file checked, SAFETENSORS entries resolved, not cached; the
    reader set up again) and the answer is False: what was planned from
    ``ck`` must be planned again."""
    todo = [n for n in dict.fromkeys(names) if n not in ck.files]
    if not ck.lazy or not todo:
        return True
    if ck.lidx is not None:
        stats = {}
        for name in todo:
            try:
                st = os.lstat(reader.path / name)
            except OSError:
                break
            if not stat.S_ISREG(st.st_mode) or st.st_size < ck.extents.get(name, 0):
                break
            stats[name] = st
        else:
            if _entries.plain_zip_files(reader.path, todo, [stats[n].st_size for n in todo]):
                for name in todo:
                    ck.files[name] = _file_ident(stats[name])
                return True
        # a file missing, not regular, too short or not TORCH_SAVE: the
        # checks of .metadata say what is wrong, and what was planned from
        # the index is planned again
        ck.demote()
        need_files(reader, ck, names)
        return False
    if ck.index is None:
        stats: dict = {}
        reader._validate_storage(ck.entries_in(todo), stats=stats)
        for name in todo:
            ck.files[name] = _file_ident(stats[name])
        return True
    stats, sizes = {}, {}
    for name in todo:
        try:
            st = os.lstat(reader.path / name)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            break
        stats[name] = st
        sizes[name] = st.st_size
    else:
        if _C.md_index_check(ck.index, [sizes.get(n) for n in ck.names]):
            if not _entries.plain_zip_files(reader.path, todo, [sizes[n] for n in todo]):
                _to_general(reader, ck)  # SAFETENSORS (or unreadable: it says why)
                return False
            for name in todo:
                ck.files[name] = _file_ident(stats[name])
            return True
    # a file missing, not regular, or too short: the checks' own error
    reader._validate_storage(ck.entries_in(todo))
    _to_general(reader, ck)  # changed since: the general path says what it finds
    return False


def _to_general(reader, ck: Checkpoint) -> None:
    """Turn ``ck`` (lazily checked) into what the general path makes of
    the same bytes, in place, and set ``reader`` up for it again."""
    md = _metadata.loads(ck.raw, ck.where)
    general = _general(reader, ck.raw, md, ck.where, ck.ident)
    with _lock:
        if _cache.get(ck.where) is ck:
            del _cache[ck.where]
        ck.plans.clear()
    ck.ident, ck._md, ck.files, ck.index, ck.names = None, general.metadata, general.files, None, None
    ck.lazy, ck.byte_index, ck.whole_index, ck._by_file = False, None, None, None
    ck.no_plan = general.no_plan
    reader._set_up_cached(ck, reader.rank, reader.use_collectives)


def cacheable(reader) -> bool:
    """Whether ``reader`` reads metadata and sets itself up as dcpx's
    FileSystemReader does (a subclass may override either)."""
    from ..storage.reader import FileSystemReader
    cls = type(reader)
    return (isinstance(reader, FileSystemReader)
            and cls.read_metadata is FileSystemReader.read_metadata
            and cls.set_up_storage_reader is FileSystemReader.set_up_storage_reader
            and cls.read_tensors is FileSystemReader.read_tensors
            and "read_metadata" not in vars(reader)
            and "set_up_storage_reader" not in vars(reader))


def get_plan(ck: Checkpoint, key: tuple) -> Optional[Plan]:
    with _lock:
        plan = ck.plans.get(key)
        if plan is not None:
            ck.plans.move_to_end(key)
        return plan


def put_plan(ck: Checkpoint, key: tuple, plan: Optional[Plan]) -> None:
    if plan is None or ck.ident is None:
        return
    with _lock:
        if ck.no_plan:
            return
        ck.plans[key] = plan
        ck.plans.move_to_end(key)
        while len(ck.plans) > MAX_PLANS:
            ck.plans.popitem(last=False)


def drop_plan(ck: Checkpoint, key: tuple, failed: bool) -> None:
    """Forget the plan for ``key``; all of them, for good, if a run failed."""
    with _lock:
        ck.plans.pop(key, None)
        if failed:
            ck.no_plan = True
            ck.plans.clear()


def direct_plan(reader, ck: Checkpoint, flat: dict, allow_partial_load: bool,
                key: tuple) -> Optional[Plan]:
    """A plan for loading ``flat`` when every tensor in it is read whole and
    in place: a plain host tensor of its saved dtype and shape, saved as one
    chunk, neither empty nor a neg / conj view.  None otherwise (and for
    every error case), so that ``_dist.plan_reads`` plans it and raises
    what torch would."""
    if _TO_DLPACK is None or key in ck.no_direct:
        return None
    if ck.index is not None:
        return _indexed_plan(reader, ck, flat, allow_partial_load, key)
    sdm = ck.metadata.state_dict_metadata
    whole = ck.whole_chunks()
    files: dict = {}
    items, byte_keys = [], []
    for pos, (fqn, obj) in enumerate(flat.items()):
        md = sdm.get(fqn)
        if md is None:
            if allow_partial_load:
                continue
            return None
        if type(md) is not TensorStorageMetadata:
            byte_keys.append(fqn)
            continue
        info = whole.get(fqn)
        dtype = md.properties.dtype
        if (info is None or type(obj) not in _PLAIN_TYPES or obj.dtype is not dtype
                or obj.shape != md.size or _needs_int_view(dtype)):
            return None
        if getattr(info, "transform_descriptors", None):
            return None  # compressed records are read by _dist.plan_reads' path
        fidx = files.get(info.relative_path)
        if fidx is None:
            fidx = files[info.relative_path] = len(files)
        items.append((fidx, info.offset, info.length,
                      "" if is_raw(info) else storage_type_name(dtype), pos))
    if byte_keys:
        ck.byte_info()  # kept by release()
    # The Metadata objects are not needed any more: released before the
    # plan's arrays are allocated, so that the two do not add up at the
    # load's peak of memory.
    sdm = whole = md = info = obj = None
    need_files(reader, ck, list(files))  # (not the C tables': no turn to the general path)
    ck.release()
    paths = _paths(reader, files)
    capsule = _C.read_plan(paths, items, list(flat.values()), _TO_DLPACK, _PLAIN_TYPES)
    if capsule is None:  # e.g. CUDA or non-contiguous destinations: do not try again
        _no_direct(ck, key)
        return None
    return Plan(capsule, byte_keys)


def _paths(reader, names) -> list:
    """The data files' paths: names the metadata checks hold no separator
    (md_index, _validate_storage), joined as ``str(reader.path / name)``
    joins them, without a pathlib object per file (R of them at R ranks)."""
    base = os.path.join(str(reader.path), "")
    return [base + name for name in names]


def _no_direct(ck: Checkpoint, key: tuple) -> None:
    with _lock:
        ck.no_direct[key] = True
        while len(ck.no_direct) > MAX_PLANS:
            ck.no_direct.popitem(last=False)


def _indexed_plan(reader, ck: Checkpoint, flat: dict, allow_partial_load: bool,
                  key: tuple) -> Optional[Plan]:
    """direct_plan from the C decoder's tables (_C.read_plan_md): the same
    tests per key, in C, with no Metadata object.  The plan is run as it
    is made, through the destinations it has just taken (a fresh
    checkpoint's load exports each tensor once, not twice); run_plan
    returns that run's failures."""
    names = ck.names
    paths = _paths(reader, names)
    got = _C.read_plan_md(ck.index, paths, list(flat), list(flat.values()), _TO_DLPACK,
                          _PLAIN_TYPES, allow_partial_load, threads=reader.thread_count,
                          verify=reader.verify,
                          check=lambda used: need_files(reader, ck, [names[f] for f in used]))
    if got is None:
        return None
    if got is False:  # e.g. CUDA or non-contiguous destinations: do not try again
        _no_direct(ck, key)
        return None
    capsule, byte_keys, failures = got
    return Plan(capsule, byte_keys, failures)


def run_plan(reader, plan: Plan, flat: dict) -> Optional[list]:
    """Read every tensor of ``plan`` into ``flat``'s tensors.  None when a
    destination is not what the plan was made for (nothing was read), else
    the C reader's failures (empty: all read and checked)."""
    if plan.ran is not None:
        failures, plan.ran = plan.ran, None
        return failures
    return _C.read_plan_run(plan.capsule, list(flat.values()), _TO_DLPACK, _PLAIN_TYPES,
                            threads=reader.thread_count, verify=reader.verify)
