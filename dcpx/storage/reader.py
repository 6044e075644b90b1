"""FileSystemReader: torch's StorageReader protocol over dcpx's C reader:
CRC-checked reads into destination tensors (in place, via a bounded
temporary for dtype casts, or through a pinned buffer for CUDA), safe
loading of non-tensor values."""
from __future__ import annotations

import functools
import io
import os
import stat
import threading
import uuid
import warnings
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import _C
from ..formats import (
    transforms as _fmt_transforms, entries as _entries, metadata as _metadata, values as _values,
)
from ..formats.byteorder import archive_byteorder, swap_untyped
from ..formats.chunks import tiling_problem
from ..formats.safetensors import is_raw
from ..formats.dtypes import _TO_DLPACK, dlpack_view, storage_type_name
from ..formats.files import (
    check_zip_crcs,
    _check_dir, local_path, open_regular, read_regular, special_file_error,
    validate_checkpoint_id,
)
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, UnsupportedFormatError


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


def _byte_window(chunk: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
                 itemsize: int) -> Optional[tuple]:
    """``(lo, n)``: the bytes of the chunk's row-major image that the part
    ``[offsets, offsets + lengths)`` occupies, when they are one range (the
    trailing dimensions whole, the leading ones of length 1 but one); else
    None."""
    k = len(chunk) - 1
    while k >= 0 and offsets[k] == 0 and lengths[k] == chunk[k]:
        k -= 1
    if any(lengths[d] != 1 for d in range(k)):
        return None
    lo, stride, n = 0, itemsize, itemsize
    for d in range(len(chunk) - 1, -1, -1):
        lo += offsets[d] * stride
        stride *= chunk[d]
        n *= lengths[d]
    return lo, n


def _pipeline_refusal(r: _TensorRead) -> Optional[str]:
    """Why r cannot go to its CUDA target through the C load pipeline
    (csrc/cuda_pipeline.c), or None: the target must be a contiguous CUDA
    tensor of the saved dtype without a conj / neg bit, and what it takes
    of the saved chunk one range of its bytes (the whole chunk, or a part
    narrowed along the leading dimensions: a resharding read).  Refused
    reads keep the host temporary + ``target.copy_``."""
    t = r.target
    if getattr(r.info, "transform_descriptors", None):
        return "compressed record"
    if t.dtype != r.dtype:
        return "dtype cast"
    if t.is_conj() or t.is_neg():
        return "conj/neg view"
    if not t.is_contiguous():
        return "non-contiguous destination"
    if r.narrow is None:
        return None if t.shape == r.chunk else "shape differs"
    if _byte_window(r.chunk, *r.narrow, 1) is None:
        return "part of the chunk not one byte range"
    return None


#: bytes of the page-locked host ring that loads into CUDA tensors read
#: through (one per process, page-locked once and reused by every load;
#: csrc/cuda_pipeline.c cuts it into slots)
_PINNED_LOAD = 64 << 20
#: bytes of one slot of the ring (at most; a quarter of a smaller ring)
_SLOT = 4 << 20
_pinned_lock = threading.Lock()
_pinned_buffer: Optional[torch.Tensor] = None


def _pinned_load_buffer() -> torch.Tensor:
    """The process's load ring (_pinned_lock held), page-locked by the C
    CUDA path at first use; a refusal warns and leaves it pageable (the
    copies then wait for the driver's own staging).  Unregistered at
    interpreter exit (``_C.cuda_release_all``)."""
    global _pinned_buffer
    if _pinned_buffer is None:
        buf = torch.empty(_PINNED_LOAD, dtype=torch.uint8)
        try:
            _C.cuda_host_register(buf)  # False, with a RuntimeWarning, if refused
        except _C.CudaError as e:
            warnings.warn(f"{e}; loading through pageable memory", RuntimeWarning,
                          stacklevel=_values._outside_dcpx())
        _pinned_buffer = buf
    return _pinned_buffer


def _slot_bytes() -> int:
    return max(4096, min(_SLOT, _PINNED_LOAD // 4 // 64 * 64))


def _add_stats(into: dict, stats: dict) -> None:
    for k, v in stats.items():
        if isinstance(v, int) and not isinstance(v, bool) and k not in (
                "threads", "slots", "slot_bytes", "devices"):
            into[k] = into.get(k, 0) + v
        else:
            into[k] = v


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
      ``thread_count``: C reader threads (default: up to 4 of the CPUs; for
        loads into CUDA tensors, the load pipeline's, up to 8).
      ``verify``: check each tensor record's CRC-32 (default True).
      ``allow_pickle``: load non-tensor values with full pickle instead of
        torch's ``weights_only`` allow-list (default False: a checkpoint can
        never run code on load unless you trust it and say so).
    """

    def __init__(self, path: Union[str, os.PathLike], _extension_registry: Any = None,
                 thread_count: Optional[int] = None, verify: bool = True,
                 allow_pickle: bool = False) -> None:
        super().__init__()
        self._lazy: Any = None  # a dcpx.coordination.readplan.Checkpoint set up for, not yet decoded
        self.path = local_path(path)
        self.thread_count = thread_count or min(4, os.cpu_count() or 1)
        # the CUDA load pipeline's readers: as given, else up to 8
        self._pipeline_threads = thread_count or min(8, os.cpu_count() or 1)
        #: what loads into CUDA tensors did through this reader (summed over
        #: its loads): tensors and bytes through the pipeline, tensors
        #: through a host temporary and torch's copy_ with the reasons, and
        #: the pipeline's own counts (csrc/cuda_pipeline.c)
        self.cuda_load_stats: dict = {}
        self.verify = verify
        self.allow_pickle = allow_pickle
        # torch's ExtensionRegistry (stream transforms: dcpx.formats.transforms)
        self._extension_registry = _extension_registry
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
        path, data, _ = self._read_metadata_file(kwargs.get("rank"))
        md = _metadata.loads(data, str(path))
        self._stamp(md)
        return md

    def _read_metadata_file(self, rank: Optional[int]) -> tuple:
        """(path, bytes, os.stat_result) of the checkpoint's ``.metadata``
        (``__{rank}.metadata`` when rank is given), read through one
        descriptor of the regular file."""
        name = _metadata.METADATA_FN if rank is None else f"__{rank}{_metadata.METADATA_FN}"
        path = self.path / name
        _check_dir(self.path, create=False)
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            if not self.path.exists():
                raise IncompleteCheckpointError(
                    2, f"dcpx: no checkpoint at {self.path}: the directory does not exist",
                    str(self.path)) from None
            raise IncompleteCheckpointError(
                2, f"dcpx: checkpoint at {self.path} is incomplete: it has no {name} "
                   f"(the save never committed, or was interrupted)", str(path)) from None
        try:
            st = os.fstat(fd)
            parts, got = [], 0
            while got < st.st_size:
                part = os.pread(fd, st.st_size - got, got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
        finally:
            os.close(fd)
        return path, b"".join(parts), st

    def _stamp(self, md: Metadata) -> None:
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        self._validate_storage(metadata)
        # SAFETENSORS entries resolved to the tensors' bytes (dcpx.formats.entries)
        self._set_up_checked(_entries.resolve(self.path, metadata), kwargs.get("rank"),
                             kwargs.get("use_collectives", True))

    def _set_up_checked(self, metadata: Metadata, rank: Optional[int],
                        use_collectives: bool) -> None:
        """set_up_storage_reader for metadata whose storage entries were
        checked already."""
        self.storage_data = metadata.storage_data
        self._state_dict_metadata = metadata.state_dict_metadata
        self._chunks = None
        self.rank = rank
        self.use_collectives = use_collectives

    def _set_up_cached(self, ck: Any, rank: Optional[int], use_collectives: bool) -> None:
        """Set up for a checkpoint of dcpx.coordination.readplan's cache, checked
        already: its Metadata (``storage_data``, the state dict metadata)
        is decoded only if something here asks for it."""
        self._lazy = ck
        self._chunks = None
        self.rank = rank
        self.use_collectives = use_collectives

    def _decode_lazy(self) -> None:
        ck, self._lazy = self._lazy, None
        md = ck.metadata
        self._stamp(md)
        self._storage_data = md.storage_data
        self._sdm = md.state_dict_metadata

    @property
    def storage_data(self) -> dict:  # type: ignore[override]
        if self._lazy is not None:
            self._decode_lazy()
        return self._storage_data

    @storage_data.setter
    def storage_data(self, value: dict) -> None:
        self._lazy = None
        self._storage_data = value

    @property
    def _state_dict_metadata(self) -> dict:
        if self._lazy is not None:
            self._decode_lazy()
        return self._sdm

    @_state_dict_metadata.setter
    def _state_dict_metadata(self, value: dict) -> None:
        self._sdm = value

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
            chunk, dtype = self.chunk_of(req.storage_index)
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
        return validate_checkpoint_id(checkpoint_id)

    # -- dcpx's pieces ----------------------------------------------------
    def _validate_storage(self, metadata: Metadata, files: bool = True,
                          stats: Optional[dict] = None) -> None:
        """Reject paths that escape the directory and impossible extents
        before anything is read.  ``files`` False: only what needs no file
        (names, offsets, transforms), for a load that checks each data file
        as it first reads it (dcpx.coordination.readplan.need_files).
        ``stats``: filled with each data file's lstat, by name."""
        for _, error in self._storage_problems(metadata, files, stats):
            raise error

    def check_storage(self, metadata: Metadata) -> list[tuple[MetadataIndex, Exception]]:
        """Every storage entry of ``metadata`` that cannot be read, without
        reading any data: a data file named outside the directory, missing or
        not a regular file, an extent past the end of its file (truncated), a
        stream transform.  One ``(index, error)`` per bad entry, in order;
        ``error`` is the exception loading would raise for it.  Empty when
        every entry can be read (``set_up_storage_reader`` raises the first)."""
        return list(self._storage_problems(metadata))

    def _storage_problems(self, metadata: Metadata, files: bool = True,
                          stats: Optional[dict] = None):
        sizes: dict[str, int] = {}  # data files found regular, by name
        for index, info in metadata.storage_data.items():
            try:
                self._check_entry(index, info, sizes, files, stats)
            except Exception as e:  # noqa: B902 - each is the entry's own error
                yield index, e

    def _check_entry(self, index: Any, info: Any, sizes: dict[str, int], files: bool = True,
                     stats: Optional[dict] = None) -> None:
        if not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(f"{self.path}: bad storage entry for {index}")
        rel = info.relative_path
        if rel not in sizes:
            if (not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel
                    or rel in (".", "..") or "\0" in rel):
                raise CorruptCheckpointError(
                    f"{self.path}: metadata names data file {rel!r} outside the "
                    f"checkpoint directory (refused)")
        if not files:
            if (not isinstance(info.offset, int) or not isinstance(info.length, int)
                    or info.offset < 0 or info.length < 0):
                raise CorruptCheckpointError(
                    f"{self.path / rel}: key {getattr(index, 'fqn', index)!r}: extent "
                    f"[{info.offset}, +{info.length}) is not a place in a file")
        elif rel not in sizes:
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
            if stats is not None:
                stats[rel] = st
        if files and (not isinstance(info.offset, int) or not isinstance(info.length, int)
                or info.offset < 0 or info.length < 0
                or info.offset + info.length > sizes[rel]):
            raise CorruptCheckpointError(
                f"{self.path / rel}: key {getattr(index, 'fqn', index)!r}: extent "
                f"[{info.offset}, +{info.length}) lies outside the file "
                f"({sizes[rel]} bytes; truncated?)")
        if getattr(info, "transform_descriptors", None):
            _fmt_transforms.extensions_for(
                info.transform_descriptors, self.registry(),
                f"{self.path / rel}: key {getattr(index, 'fqn', index)!r}")

    def registry(self) -> Any:
        """The ExtensionRegistry that undoes stream transforms: the one
        given as ``_extension_registry``, else torch's default."""
        if self._extension_registry is None:
            self._extension_registry = _fmt_transforms.default_registry()
        return self._extension_registry

    def read_record(self, key: str, info: _StorageInfo, limit: Optional[int] = None,
                    why: str = "") -> bytes:
        """A record's bytes as written before any stream transform (the
        ``torch.save`` archive or bytes item), read whole.  A transformed
        record is inflated to at most ``limit`` bytes (``why``: where that
        limit comes from), default: a value's (``_fmt_transforms.value_limit``,
        none with ``allow_pickle``); past it, InflatesTooFar."""
        path = self.path / info.relative_path
        data = read_regular(path, info.offset, info.length)
        if len(data) != info.length:
            raise CorruptCheckpointError(f"{path}: key {key!r}: file is truncated")
        if getattr(info, "transform_descriptors", None):
            if limit is None and not self.allow_pickle:
                limit = _fmt_transforms.value_limit(info.length)
                why = (f" ({_fmt_transforms.VALUE_RATIO} times its stored size, at least "
                       f"{_fmt_transforms.VALUE_FLOOR}: the most a value may inflate to unless "
                       f"the checkpoint is trusted, allow_pickle=True)")
            data = _fmt_transforms.decode(data, info.transform_descriptors, self.registry(),
                                          f"{path}: key {key!r}", self.verify, limit, why)
        return data

    def read_tensor_record(self, key: str, info: _StorageInfo, chunk: Sequence[int],
                           dtype: torch.dtype) -> bytes:
        """A tensor chunk's record (``chunk``: its sizes, ``dtype``: its
        saved dtype, as the metadata gives them), inflated to at most the
        chunk's bytes plus an archive's records (_fmt_transforms.tensor_limit)."""
        numel = 1
        for n in chunk:
            numel *= int(n)
        nbytes = numel * dtype.itemsize
        return self.read_record(key, info, _fmt_transforms.tensor_limit(nbytes, len(chunk)),
                                f" (the metadata's {tuple(int(n) for n in chunk)} {dtype} chunk "
                                f"is {nbytes} bytes, in a torch.save archive)")

    def read_chunk(self, index: MetadataIndex) -> torch.Tensor:
        """The saved chunk at storage ``index`` (a key and a chunk's offsets)
        of the metadata this reader was set up with, in its saved shape and
        dtype, CRC-checked (``verify``)."""
        chunk, dtype = self.chunk_of(index)
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
            mine_md = Metadata(state_dict_metadata=sdm_all, storage_data=mine)
            self._validate_storage(mine_md)
            storage = _entries.resolve(self.path, mine_md).storage_data  # SAFETENSORS entries
        sdm = sdm_all[fqn]
        if not isinstance(sdm, TensorStorageMetadata):
            info = storage.get(MetadataIndex(fqn))
            if info is None:
                raise CorruptCheckpointError(f"{self.path}: metadata has no storage entry "
                                             f"for {fqn!r}")
            return self.load_value(fqn, info)
        problem = tiling_problem(sdm.size, sdm.chunks)
        if problem is not None:
            # Assembled into fresh memory: an overlap leaves other elements
            # unwritten (torch.empty's garbage), a gap the same.
            raise CorruptCheckpointError(f"{self.path}: key {fqn!r} of size "
                                         f"{tuple(sdm.size)}: {problem}")
        full = torch.empty(sdm.size, dtype=sdm.properties.dtype)
        reads = []
        for ch in sdm.chunks:
            info = storage.get(MetadataIndex(fqn, ch.offsets))
            if info is None:
                raise CorruptCheckpointError(
                    f"{self.path}: metadata has no storage entry for {fqn!r} at offset "
                    f"{tuple(ch.offsets)}")
            target = full[tuple(slice(o, o + n) for o, n in zip(ch.offsets, ch.sizes))]
            reads.append(_TensorRead(fqn, info, ch.sizes, sdm.properties.dtype, target, None))
        self.read_tensors(reads)
        return full

    def chunk_of(self, index: MetadataIndex) -> tuple:
        """(sizes, dtype) of the saved chunk ``index`` names, from the
        metadata this reader was set up with (what a compressed record may
        inflate to at most: ``dcpx verify`` asks too)."""
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

    def read_bytes(self, key: str, info: _StorageInfo, check: bool = True,
                   limit: Optional[int] = None) -> Any:
        """The raw bytes of a bytes item, after checking (unless ``check`` is
        False or allow_pickle is set) that they unpickle under the allow-list
        (dcpx.formats.values; ``load_value`` reads and unpickles in one pass).
        ``limit``: read_record's."""
        path = self.path / info.relative_path
        data = self.read_record(key, info, limit)
        if self.verify:
            check_zip_crcs(data, f"{path}: key {key!r}")
        if check and not self.allow_pickle:
            _values.loads(data, f"{path}: key {key!r}")
        return data

    def load_value(self, key: str, info: _StorageInfo, limit: Optional[int] = None) -> Any:
        """A non-tensor value, read, CRC-checked and unpickled once: under
        the allow-list of code-free types (dcpx.formats.values, docs/api.md), or
        with full pickle if the reader was built with allow_pickle=True.
        ``limit``: read_record's."""
        data = self.read_bytes(key, info, check=False, limit=limit)
        return _values.loads(data, f"{self.path / info.relative_path}: key {key!r}",
                             allow_pickle=self.allow_pickle)

    def read_tensors(self, reads: Sequence[_TensorRead]) -> None:
        """Read tensor chunks into their targets: straight into the target's
        memory when it is contiguous host memory of the saved shape and dtype,
        else through a temporary of the saved chunk (saved dtype), then
        ``target.copy_(chunk narrowed)``: torch's own read_data step, which
        also casts to the target's dtype.  A CUDA target the load pipeline
        takes (``_pipeline_refusal``) goes through the page-locked ring and
        dcpx's stream instead (``_read_to_devices``).  Temporaries are held for at most
        ``_TEMP_BUDGET`` bytes of chunks at a time (or one chunk if larger)."""
        direct, staged, device = [], [], []
        for r in reads:
            if r.target.dtype != r.dtype:
                check_castable(r.key, r.dtype, r.target)
            if _reads_in_place(r):
                direct.append(r)
            elif r.target.device.type == "cuda":
                why = _pipeline_refusal(r)
                if why is None:
                    device.append(r)
                else:
                    self._count_torch_copy(why)
                    staged.append(r)
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

    def _count_torch_copy(self, why: str) -> None:
        st = self.cuda_load_stats
        st["torch_copy"] = st.get("torch_copy", 0) + 1
        reasons = st.setdefault("torch_copy_reasons", {})
        reasons[why] = reasons.get(why, 0) + 1

    def _read_to_devices(self, reads: Sequence[_TensorRead]) -> None:
        """Reads into CUDA tensors by the C load pipeline
        (``_C.cuda_load_pipeline``, csrc/cuda_pipeline.c): several reader
        threads read the archives into the slots of the process's
        page-locked ring (``_PINNED_LOAD`` bytes, one load at a time), each
        slot's host-to-device copies are queued on dcpx's stream as soon as
        it is read and CRC-checked, and a slot is refilled once its event
        says its copies are done.  dcpx's stream first waits for the work
        queued so far on each device's current stream, which waits for the
        copies in turn.  Records the pipeline leaves to torch.load are
        loaded so and copied with ``copy_``."""
        files: dict[str, int] = {}
        items = []
        batched = _C.cuda_batch_copies() is not None  # no allocation keys needed
        total, stypes = 0, {}
        for r in reads:
            t = r.target
            lo, n = 0, r.chunk.numel() * r.dtype.itemsize
            if r.narrow is not None:
                lo, n = _byte_window(r.chunk, *r.narrow, r.dtype.itemsize)
            total += n
            view = dlpack_view(t)
            dst = _TO_DLPACK(view) if _TO_DLPACK is not None and type(view) is torch.Tensor \
                else view
            alloc = 0
            if not batched and type(t) is torch.Tensor:
                alloc = t.untyped_storage().data_ptr()
            fidx = files.setdefault(r.info.relative_path, len(files))
            stype = stypes.get(r.dtype)
            if stype is None:
                stype = stypes[r.dtype] = storage_type_name(r.dtype)
            items.append((fidx, r.info.offset, r.info.length, "" if is_raw(r.info) else stype,
                          tuple(r.chunk), r.dtype.itemsize, dst, lo, r.key, alloc))
        consumers = [(dev.index, torch.cuda.current_stream(dev).cuda_stream)
                     for dev in {r.target.device for r in reads}]
        with _pinned_lock:
            ring = _pinned_load_buffer()
            failures, stats = _C.cuda_load_pipeline(
                [str(self.path / p) for p in files], items, ring,
                consumer_streams=consumers, threads=self._pipeline_threads,
                verify=self.verify, slot_bytes=_slot_bytes())
        st = self.cuda_load_stats
        st["pipeline"] = st.get("pipeline", 0) + len(reads)
        st["pipeline_bytes"] = st.get("pipeline_bytes", 0) + total
        st["pipeline_loads"] = st.get("pipeline_loads", 0) + 1
        _add_stats(st.setdefault("pipeline_stats", {}), stats)
        later = []
        for i, code, err, msg in failures:
            r = reads[i]
            if code == 1:  # valid archive in a form the C reader leaves to torch
                later.append(r)
                continue
            where = f"{self.path / r.info.relative_path}: key {r.key!r}"
            if code == 3 and err:
                raise OSError(err, f"dcpx: {where}: {msg}: {os.strerror(err)}",
                              str(self.path / r.info.relative_path))
            raise CorruptCheckpointError(f"{where}: {msg}")
        for r in later:
            self._count_torch_copy("torch-only record")
            src = self._fallback_read(r)
            if r.narrow is not None:
                for dim, (start, length) in enumerate(zip(*r.narrow)):
                    src = src.narrow(dim, start, length)
            r.target.copy_(src)

    def _read_batch(self, direct: Sequence[_TensorRead], staged: Sequence[_TensorRead]) -> None:
        """One C read of ``direct`` reads (into their targets) and ``staged``
        ones (into temporaries, then copied into their targets)."""
        files: dict[str, int] = {}
        items: list = []
        later: dict[int, torch.Tensor] = {}  # item index -> its temporary
        reads = [*direct, *staged]
        transformed = []
        for n, r in enumerate(reads):
            dest = r.target if n < len(direct) else torch.empty(r.chunk, dtype=r.dtype)
            if n >= len(direct):
                later[n] = dest
            if getattr(r.info, "transform_descriptors", None):
                # a compressed record: decoded and loaded here, not by C
                transformed.append(n)
                items.append((0, 0, 0, None, None))
                continue
            fidx = files.setdefault(r.info.relative_path, len(files))
            items.append((fidx, r.info.offset, r.info.length, dlpack_view(dest),
                          "" if is_raw(r.info) else storage_type_name(r.dtype)))
        if transformed:
            skip = set(transformed)
            keep = [i for i in range(len(items)) if i not in skip]
            got = _C.read_items([str(self.path / p) for p in files], [items[i] for i in keep],
                                threads=self.thread_count, verify=self.verify) if keep else []
            failures = [(keep[i], *rest) for i, *rest in got]
            failures += [(i, 1, 0, "") for i in transformed]
            for i in transformed:
                items[i] = (0, 0, 0, later.get(i, reads[i].target), None)
        else:
            paths = [str(self.path / p) for p in files]
            failures = _C.read_items(paths, items, threads=self.thread_count,
                                     verify=self.verify)
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
        if getattr(r.info, "transform_descriptors", None):
            try:
                raw = self.read_tensor_record(r.key, r.info, r.chunk, r.dtype)
                if self.verify:
                    check_zip_crcs(raw, f"{path}: key {r.key!r}")
            except CorruptCheckpointError as e:
                if (r.info.length != r.chunk.numel() * r.dtype.itemsize
                        or isinstance(e, _fmt_transforms.InflatesTooFar)):
                    raise
                # torch's SAFETENSORS writer with _extensions records an empty
                # compressed frame per tensor and the tensor's byte count
                # (its bytes are in the untransformed safetensors blob after
                # them): a layout neither torch's reader nor dcpx's loads
                raise UnsupportedFormatError(
                    f"dcpx: {path}: key {r.key!r}: the record is a transformed one of exactly "
                    f"the tensor's byte count: torch writes this for SAFETENSORS together with "
                    f"_extensions, which neither torch nor dcpx can load (re-save with one of "
                    f"the two); if the checkpoint was not written so, it is damaged: {e}") from None
        else:
            raw = read_regular(path, r.info.offset, r.info.length)
        try:
            t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CorruptCheckpointError(f"{path}: key {r.key!r}: cannot load tensor "
                                         f"record: {e}") from e
        if isinstance(t, torch.Tensor):  # torch.load leaves untyped storages unswapped
            swap_untyped([t], archive_byteorder(raw))
        if not isinstance(t, torch.Tensor) or t.shape != r.chunk or t.dtype != r.dtype:
            raise CorruptCheckpointError(
                f"{path}: key {r.key!r}: record holds "
                f"{getattr(t, 'dtype', type(t))}{tuple(getattr(t, 'shape', ()))}, "
                f"metadata says {r.dtype}{tuple(r.chunk)}")
        return t
