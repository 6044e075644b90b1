"""The write of one save's data files, from the values to the C writer:

* payloads: what the C writer is handed for one value (a tensor as a DLPack
  export plus its storage type, after refusing what dcpx cannot save,
  naming the key; a staged copy as a host view of the staging buffer; a
  non-tensor value as the bytes torch writes) and the entry (index,
  payload, size) that places it in a data file;
* ``PendingWrite``: the data files being written by a C WriteJob
  (csrc/writer.c).  Their layout (offset and length of every entry) is
  known before the first byte is written, so the metadata is built and
  encoded while the writer threads run."""
from __future__ import annotations

import heapq
import io
import os
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from .. import _C
from ..formats.values import warn_if_refused
from ..formats.dtypes import (
    _TO_DLPACK, _needs_int_view, dlpack_export, dlpack_view, storage_type_name,
)


class WritingTo(Protocol):
    """What a pending write uses of its writer (a ``FileSystemWriter``,
    named by its parts: the writer imports this module)."""

    path: Path
    sync_files: bool
    thread_count: int


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


# dtype -> its storage type name, for the dtypes whose tensors DLPack
# exports as they are (filled as dtypes are met: check_saveable's answer).
_DIRECT: dict = {}
_STRIDED = torch.strided


def _direct_payload(t: torch.Tensor) -> Optional[tuple]:
    """The payload of a plain, dense CPU tensor of a dtype met before, from
    what one look at it proves (no check repeated, no per-dtype work);
    None for anything else (the checked path)."""
    tp = type(t)
    if ((tp is torch.Tensor or tp is torch.nn.Parameter) and _TO_DLPACK is not None
            and t.is_cpu and t.layout is _STRIDED and not t.is_nested
            and not t.is_quantized and not t.is_conj() and not t.is_neg()):
        stype = _DIRECT.get(t.dtype)
        if stype is not None:
            if t.requires_grad or tp is not torch.Tensor:
                t = t.detach()
            return (_TO_DLPACK(t), stype)
    return None


_DL_DTYPES: dict = {}


def dl_dtypes() -> dict:
    """{_C.dlpack_dtype_key: torch dtype} for _C.scan_plain: which torch
    dtype a DLPack export's dtype is, for every DLPack dtype that exactly
    one torch dtype exports as (built once, over every torch dtype: a
    DLPack dtype two of them share is left out, and then asked of the
    tensor)."""
    if not _DL_DTYPES and _TO_DLPACK is not None:
        seen: dict = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated dtypes say so when made
            for d in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
                try:
                    key = _C.dlpack_dtype_key(_TO_DLPACK(torch.empty(1, dtype=d)))
                except Exception:  # not exportable (or not creatable): asked of the tensor
                    continue
                if key >= 0:
                    seen.setdefault(key, set()).add(d)
        _DL_DTYPES.update({k: next(iter(ds)) for k, ds in seen.items() if len(ds) == 1})
        if not _DL_DTYPES:
            _DL_DTYPES[-1] = None  # built: nothing unambiguous
    return _DL_DTYPES


def _remember(dtype: torch.dtype, stype: str) -> None:
    if dtype not in _DIRECT and not _needs_int_view(dtype):
        _DIRECT[dtype] = stype


def tensor_payload(t: torch.Tensor, key: str) -> tuple:
    """(tensor, storage type) for the C writer, or a clear error naming key."""
    payload = _direct_payload(t)
    if payload is not None:
        return payload
    stype = check_saveable(t, key)
    _remember(t.dtype, stype)
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
    data = buf.getvalue()
    warn_if_refused(obj, key, data)  # a value dcpx's safe loader will refuse
    return data


class LazyItem(NamedTuple):
    """A value that ``FileSystemWriter.write_items`` reads only once it has
    decided which file it goes into: ``nbytes`` (its size, or an estimate for
    a non-tensor value) is what closes the current file before ``read()`` is
    called, so that at most one file's values are in memory at once."""
    nbytes: int
    read: Callable[[], Any]



class _Entry(NamedTuple):
    index: MetadataIndex
    payload: Any          # bytes, or (tensor, storage_type)
    nbytes: int
    # SAFETENSORS: a tensor's (dtype, shape) for the file's header
    # (dcpx.formats.safetensors); None otherwise
    meta: Any = None


def staged_payload(t: torch.Tensor, key: str) -> tuple:
    """A staged tensor (a contiguous host view of a staging buffer) for the
    C writer: no checks, no copies."""
    payload = _direct_payload(t)
    if payload is not None:
        return payload
    stype = storage_type_name(t.dtype)
    _remember(t.dtype, stype)
    return (dlpack_export(dlpack_view(t.detach())), stype)


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

    def __init__(self, writer: WritingTo, files: list[tuple[str, list[_Entry]]]):
        self._begin(writer, [name for name, _ in files],
                    [[e.payload for e in ents] for _, ents in files])
        self.files = files

    @classmethod
    def of_payloads(cls, writer: WritingTo, names: list[str],
                    payloads: list[list], base: Optional[torch.Tensor] = None) -> "PendingWrite":
        """The data files ``names[i]`` holding ``payloads[i]`` (the C
        writer's payloads, in order): for a caller that keeps which item
        each one is itself (dcpx.coordination.plan's SavePlan), so that no entry
        object is made per item.  ``files`` then has no entries, and
        ``results`` is not available.  ``base``: the buffer that base items
        ``(offset, nbytes, storage_type, shape)`` lie in (a stager's, kept
        unchanged until the write ends: csrc/writer.c)."""
        self = cls.__new__(cls)
        self._begin(writer, names, payloads, base)
        self.files = [(name, None) for name in names]
        return self

    def _begin(self, writer: WritingTo, names: list[str], payloads: list[list],
               base: Optional[torch.Tensor] = None) -> None:
        self.writer = writer
        self.paths = [str(writer.path / name) for name in names]
        self.job = _C.WriteJob(list(zip(self.paths, payloads)),
                               sync_files=writer.sync_files, threads=max(1, writer.thread_count),
                               base=base)
        self.layout = self.job.layout()  # per file: (offset, length) per entry
        self._results: Optional[list[WriteResult]] = None

    @property
    def results(self) -> list[WriteResult]:
        """torch's WriteResult per entry (built on first use)."""
        if self._results is None:
            if any(ents is None for _, ents in self.files):
                raise RuntimeError("dcpx: a PendingWrite of bare payloads has no results")
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

    def wait(self, results: bool = True) -> Optional[list[WriteResult]]:
        """Join the writer threads; on failure remove this save's files.
        Returns ``results`` (torch's WriteResults, one object pair per entry:
        not built when the caller has its own storage data, ``results=False``)."""
        try:
            self.job.wait()
        except BaseException:
            self.discard()
            raise
        finally:
            self.job.release()
        return self.results if results else None

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
