"""``dcpx convert SRC DST``: between a DCP checkpoint, a single
``torch.save`` file and safetensors (one file, or shards with the Hugging
Face ``model.safetensors.index.json``), in every direction.

Streaming, with bounded memory: a checkpoint larger than RAM converts.  The
output's layout (keys, dtypes, shapes, offsets) is known from the input's
metadata before any tensor is read; then tensors are read one at a time
(for a DCP input: each key's chunks, DTensor / FSDP shards included, read
into one consolidated tensor) and written out before the next is read.

* safetensors output: the header, then each tensor's bytes, written here
  (the ``safetensors`` library's writers take the whole state dict at once);
  inputs are read with ``safetensors.safe_open``.  Outputs load with
  ``safetensors.torch.load_file``.
* ``torch.save`` output: a zip archive written record by record with the
  writer ``torch.save`` itself uses (``torch._C.PyTorchFileWriter``: 64-byte
  aligned records, CRC-32s); the ``data.pkl`` record is the pickle
  ``torch.save`` writes for the same flat dict (tensors as
  ``_rebuild_tensor_v2/v3`` of a persistent storage key), built before the
  data.  Loads with ``torch.load(weights_only=True)``.
* DCP output: dcpx's C writer, one data file per 64 MiB of tensors (or per
  tensor when larger), then the ``.metadata`` commit.

Keys are flattened FQNs (``a.b.c``), as DCP stores them.  Non-tensor
values: safetensors cannot hold them; string values go into the header's
``__metadata__`` under their key, every other one is skipped with a warning
naming it.  ``__metadata__`` always has ``"format": "pt"`` (what
``transformers`` checks).
"""
from __future__ import annotations

import collections
import ctypes
import functools
import io
import json
import os
import pickle
import re
import secrets
import stat
import struct
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from ._common import (
    METADATA_FN,
    SAFETENSORS_INDEX,
    CliError,
    Entry,
    Source,
    dtype_name,
    human,
    need_safetensors,
    open_source,
    progress,
    warn,
)

HELP = "convert between DCP, torch.save and safetensors (single or sharded), streaming"

#: bytes of tensors gathered into one DCP data file (one tensor when larger)
DCP_FILE_BYTES = 64 << 20

_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000000' -> bytes (decimal units as Hugging
    Face's ``max_shard_size``, binary ones with 'i')."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise CliError(f"cannot read the size {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    n, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary else 1000
    return int(n * base ** " KMGT".index(unit or " "))


def output_format(dst: str, to: Optional[str], sharded: bool) -> str:
    if to:
        return to
    if dst.endswith(".safetensors"):
        return "safetensors"
    if dst.endswith(_TORCH_SUFFIXES):
        return "torch"
    return "safetensors" if sharded else "dcp"


# -- bytes of a tensor, without a copy ------------------------------------

def _dense(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous host memory holding its own values (a copy only when
    it is not already: strided, or a lazily conjugated / negated view)."""
    t = t.detach().cpu()
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg().contiguous()
    return t


def _write_tensor(f, t: torch.Tensor) -> None:
    t = _dense(t)
    n = t.numel() * t.element_size()
    if n:
        f.write((ctypes.c_char * n).from_address(t.data_ptr()))


def _check(key: str, t: Any, e: Entry) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != e.dtype or tuple(t.shape) != e.shape:
        raise CliError(f"key {key!r}: read {getattr(t, 'dtype', type(t).__name__)}"
                       f"{list(getattr(t, 'shape', ()))}, its metadata says "
                       f"{dtype_name(e.dtype)}{list(e.shape)}")
    return t


def _create_tmp(path: Path) -> tuple[Path, int]:
    """(name, descriptor) of a new file beside ``path``, for writing what
    is then renamed to ``path``: ``.NAME.tmp.PID.RANDOM``, created with
    ``O_EXCL | O_NOFOLLOW``, so that nothing planted at the name (a link
    to a file outside the output's folder, a FIFO, a file) is ever opened:
    the next random name is tried instead."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            return tmp, os.open(tmp, flags, 0o644)
        except FileExistsError:
            continue
    raise CliError(f"{path.parent}: cannot create a temporary file there (16 names tried "
                   f"were taken)")


def _write_file(path: Path, data: bytes) -> None:
    """``data`` into ``path``, whole or not at all (a new temporary file,
    synced, renamed over ``path``: a link at ``path`` is replaced, not
    followed)."""
    tmp, fd = _create_tmp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


# -- safetensors ----------------------------------------------------------

def _st_names() -> dict:
    need_safetensors()
    from safetensors.torch import _TYPES
    return {dtype: name for name, dtype in _TYPES.items()}


def _split_values(src: Source, entries: dict) -> tuple[list, dict]:
    """(tensor entries, string metadata) for a safetensors output; warns
    about every value it skips."""
    tensors = [e for e in entries.values() if e.is_tensor]
    if any(e.key == "__metadata__" for e in tensors):
        raise CliError("a tensor named '__metadata__' cannot be saved in safetensors (the "
                       "header's own metadata has that name): rename it, or leave it out "
                       "with --only")
    meta: dict[str, str] = {"format": "pt"}
    skipped = []
    for e in entries.values():
        if e.is_tensor:
            continue
        v = src.read(e.key)
        if isinstance(v, str) and e.key not in meta:
            meta[e.key] = v
        else:
            skipped.append(f"{e.key} ({type(v).__name__})")
    if skipped:
        warn(f"safetensors holds only tensors (and string metadata): skipped "
             f"{len(skipped)} value(s): {', '.join(skipped)}")
    names = _st_names()
    bad = [f"{e.key} ({dtype_name(e.dtype)})" for e in tensors if e.dtype not in names]
    if bad:
        raise CliError(f"safetensors has no dtype for: {', '.join(bad)} (it supports "
                       f"{', '.join(sorted(dtype_name(d) for d in names))})")
    return tensors, meta


def _write_safetensors_file(src: Source, path: Path, tensors: list, meta: dict, bar) -> int:
    names = _st_names()
    header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    off = 0
    for e in tensors:
        header[e.key] = {"dtype": names[e.dtype], "shape": list(e.shape),
                         "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)   # the data starts 8-byte aligned, as the library writes it
    tmp, fd = _create_tmp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for e in tensors:
                t = _check(e.key, src.read(e.key), e)
                _write_tensor(f, t)
                src.release(e.key, t)
                del t
                bar.update(e.nbytes)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    return off


def _unlink(p: Path) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def to_safetensors(src: Source, dst: Path, max_shard: Optional[int], bar_on: bool,
                   output: Optional["_DirOutput"] = None) -> str:
    entries = src.entries()
    tensors, meta = _split_values(src, entries)
    total = sum(e.nbytes for e in tensors)
    with progress(total, "convert", enabled=bar_on) as bar:
        if max_shard is None:
            _write_safetensors_file(src, dst, tensors, meta, bar)
            return f"{len(tensors)} tensors ({human(total)}) -> {dst}"
        assert output is not None
        shards: list[list[Entry]] = [[]]
        size = 0
        for e in tensors:
            if shards[-1] and size + e.nbytes > max_shard:
                shards.append([])
                size = 0
            shards[-1].append(e)
            size += e.nbytes
        n = len(shards)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        output.claim(names + [SAFETENSORS_INDEX])     # before anything is written
        weight_map = {}
        for name, group in zip(names, shards):
            _write_safetensors_file(src, dst / name, group, meta, bar)
            weight_map.update({e.key: name for e in group})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_file(dst / SAFETENSORS_INDEX, (json.dumps(index, indent=2) + "\n").encode())
        output.done(names + [SAFETENSORS_INDEX])
        return f"{len(tensors)} tensors ({human(total)}) in {n} shard(s) -> {dst}"


# -- torch.save -----------------------------------------------------------

class _TensorRef:
    """Stands for a tensor in data.pkl; pickles as torch.save pickles it.
    ``mem``: what is in memory, for a tensor held inside a non-tensor value
    (a tuple holding a tensor): the tensor itself (contiguous), or the
    storage torch's own reduce of a tensor subclass named; None for the
    source's tensors, read when their record is written."""
    __slots__ = ("key", "dtype", "shape", "mem", "requires_grad")

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple,
                 mem: Any = None, requires_grad: bool = False):
        self.key, self.dtype, self.shape, self.mem = key, dtype, shape, mem
        self.requires_grad = requires_grad

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class _StorageRef:
    __slots__ = ("key", "stype", "numel")

    def __init__(self, key: str, stype: Any, numel: int):
        self.key, self.stype, self.numel = key, stype, numel


def _strides(shape: tuple) -> tuple:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


class _Pickler(pickle.Pickler):
    """torch.save's pickler, for tensors that are not in memory: the same
    reduce (torch.Tensor._reduce_ex_internal) and persistent ids
    (torch.serialization._save).  Inside a value, a plain tensor is pickled
    the same way (one dense record of its own bytes); anything else
    (a ``Parameter``, whose reduce names its ``.data``, a plain tensor;
    other subclasses) reduces as torch.save reduces it, the storages it
    names becoming records as torch.save makes them."""

    def __init__(self, f):
        super().__init__(f, protocol=2)   # torch.serialization.DEFAULT_PROTOCOL
        self.order: list[_TensorRef] = []
        self._storages: dict[int, str] = {}   # storage._cdata -> its record's key
        self._v3 = torch.storage._new_dtypes()
        self._legacy = torch.storage._dtype_to_storage_type_map()

    def reducer_override(self, obj):
        if type(obj) is torch.Tensor:
            # a tensor inside a non-tensor value: a record of its own, as
            # torch.save writes it.  Only a plain tensor: a Parameter's own
            # reduce (torch._utils._rebuild_parameter of its .data) keeps
            # it a Parameter, as torch.save does.
            if obj.layout != torch.strided or obj.is_quantized or obj.device.type != "cpu":
                return NotImplemented
            t = obj.detach().resolve_conj().resolve_neg().contiguous()
            obj = _TensorRef(None, t.dtype, tuple(t.shape), t, obj.requires_grad)
        if not isinstance(obj, _TensorRef):
            return NotImplemented
        key = str(len(self.order))
        self.order.append(obj)
        numel = 1
        for s in obj.shape:
            numel *= s
        hooks = collections.OrderedDict()
        if obj.dtype in self._v3 or obj.dtype not in self._legacy:
            st = _StorageRef(key, torch.UntypedStorage, numel * obj.dtype.itemsize)
            return (torch._utils._rebuild_tensor_v3,
                    (st, 0, tuple(obj.shape), _strides(obj.shape), obj.requires_grad, hooks,
                     obj.dtype))
        st = _StorageRef(key, getattr(torch, self._legacy[obj.dtype]), numel)
        return (torch._utils._rebuild_tensor_v2,
                (st, 0, tuple(obj.shape), _strides(obj.shape), obj.requires_grad, hooks))

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            return ("storage", obj.stype, obj.key, "cpu", obj.numel)
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            # a storage that torch's own reduce of a tensor named (a tensor
            # subclass, a tensor on another device): as torch.save's
            # persistent_id names it (pickle's default would embed its
            # bytes through torch.storage._load_from_bytes, which
            # torch.load(weights_only=True) refuses)
            if isinstance(obj, torch.storage.TypedStorage):
                st, stype, numel = (obj._untyped_storage, getattr(torch, obj._pickle_storage_type()),
                                    obj._size())
            else:
                st, stype, numel = obj, torch.UntypedStorage, obj.nbytes()
            key = self._storages.get(st._cdata)
            if key is None:
                key = self._storages[st._cdata] = str(len(self.order))
                self.order.append(_TensorRef(None, torch.uint8, (st.nbytes(),), st))
            return ("storage", stype, key, torch.serialization.location_tag(st), numel)
        return None


def _weights_only_refusal(v: Any) -> Optional[str]:
    """Why ``torch.load(weights_only=True)`` would refuse the value (dcpx's
    own allow-list also admits numpy arrays, deques, Namespaces, ...), or
    None."""
    buf = io.BytesIO()
    torch.save(v, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()
        found = [ln.strip() for ln in first if "GLOBAL" in ln or "Unsupported" in ln]
        return (found[0] if found else f"{type(v).__name__}")[:200]
    return None


def _storage_bytes(t: torch.Tensor) -> Any:
    """The untyped storage holding exactly the bytes of ``t`` (contiguous):
    its own storage, or a slice of it, which shares its memory."""
    st = t.untyped_storage()
    n = t.numel() * t.element_size()
    off = t.storage_offset() * t.element_size()
    return st if off == 0 and st.nbytes() == n else st[off:off + n]


def _check_loads(tmp: Path, dst: Path) -> None:
    """The finished file loads with torch.load(weights_only=True) (mapped,
    so no tensor data is read)."""
    try:
        got = torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
        del got
    except Exception as e:
        raise CliError(f"{dst}: the written file does not load with torch.load("
                       f"weights_only=True): {e}") from e


def to_torch(src: Source, dst: Path, bar_on: bool) -> str:
    from ..filesystem import (check_saveable, torch_file_writer, torch_save_alignment,
                              torch_save_header)
    entries = src.entries()
    obj: dict[str, Any] = {}
    skipped = []
    for e in entries.values():
        if e.is_tensor:
            check_saveable(torch.empty(0, dtype=e.dtype), e.key)
            obj[e.key] = _TensorRef(e.key, e.dtype, e.shape)
        else:
            v = src.read(e.key)
            why = _weights_only_refusal(v)
            if why:
                skipped.append(f"{e.key} ({why})")
            else:
                obj[e.key] = v
    if skipped:
        warn(f"torch.load(weights_only=True) would refuse these values, so they are "
             f"skipped: {'; '.join(skipped)} (a DCP output keeps them)")
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(obj)
    order = p.order
    data = buf.getvalue()
    total = sum(r.nbytes if r.mem is not None else entries[r.key].nbytes for r in order)
    align = torch_save_alignment()
    tmp, fd = _create_tmp(dst)
    try:
        with os.fdopen(fd, "wb") as f, progress(total, "convert", enabled=bar_on) as bar:
            w = torch_file_writer(f, align)
            ended = False
            try:
                w.write_record("data.pkl", data, len(data))
                for name, text in torch_save_header(align):
                    w.write_record(name, text, len(text))
                w.write_record("byteorder", sys.byteorder, len(sys.byteorder))
                for i, ref in enumerate(order):
                    if ref.mem is not None:   # a tensor (or storage) inside a value
                        st = (_storage_bytes(ref.mem) if isinstance(ref.mem, torch.Tensor)
                              else ref.mem.cpu())
                        w.write_record(f"data/{i}", st, ref.nbytes)
                        bar.update(ref.nbytes)
                        continue
                    e = entries[ref.key]
                    t = _dense(_check(e.key, src.read(e.key), e))
                    # This tensor's bytes only, from its own memory (a view
                    # of a larger storage needs no copy): a slice of its
                    # storage shares that memory.  A storage, as torch.save
                    # passes it (a data pointer is deprecated: torch warns).
                    w.write_record(f"data/{i}", _storage_bytes(t), e.nbytes)
                    src.release(e.key, t)
                    del t
                    bar.update(e.nbytes)
                ended = True
                w.write_end_of_file()
            finally:
                # A writer left unfinished writes its end in its destructor,
                # after the file is closed, and aborts the process: end it
                # here (the file is removed on an error).
                if not ended:
                    try:
                        w.write_end_of_file()
                    except Exception:
                        pass
                del w
            f.flush()
            os.fsync(f.fileno())
        _check_loads(tmp, dst)
        os.replace(tmp, dst)
    except BaseException:
        _unlink(tmp)
        raise
    n = sum(r.mem is None for r in order)
    return f"{n} tensors, {len(obj) - n} other values ({human(total)}) -> {dst}"


# -- DCP --------------------------------------------------------------------

def to_dcp(src: Source, dst: Path, bar_on: bool, output: "_DirOutput") -> str:
    from ..filesystem import FileSystemWriter, LazyItem
    entries = src.entries()
    output.claim([])
    total = sum(e.nbytes for e in entries.values() if e.is_tensor)

    with progress(total, "convert", enabled=bar_on) as bar:
        def read(e: Entry) -> Any:
            v = src.read(e.key)
            if not e.is_tensor:
                return v
            t = _check(e.key, v, e)
            bar.update(e.nbytes)
            return t

        def release(key: str, v: Any) -> None:  # once its file is written
            if isinstance(v, torch.Tensor):
                src.release(key, v)

        # each value is read only once the previous file is written (if it
        # would not fit): one file's tensors in memory
        items = ((e.key, LazyItem(e.nbytes, functools.partial(read, e)))
                 for e in entries.values())
        md = FileSystemWriter(dst).write_items(items, planner_data=src.paths(),
                                               file_bytes=DCP_FILE_BYTES, written=release)
    files = sorted({info.relative_path for info in md.storage_data.values()})
    output.done([METADATA_FN] + files)
    nfiles = len(files)
    n_t = sum(1 for e in entries.values() if e.is_tensor)
    return (f"{n_t} tensors, {len(entries) - n_t} other values ({human(total)}) in "
            f"{nfiles} data file(s) -> {dst}")


# -- what a directory output may replace or remove ------------------------

#: convert's record of the files it wrote into a directory output (DCP,
#: sharded safetensors): what a later ``--overwrite`` may replace or remove
MANIFEST = ".dcpx-convert.json"
#: the names a directory output of convert has: a manifest naming any other
#: file is not believed for it (a crafted one never makes convert delete a
#: config.json)
_OURS = re.compile(r"^(\.metadata|__\d+_(?:[0-9a-f]{16}_)?\d+\.distcp|"
                   r"model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)\Z")


def _dcp_would_touch(name: str) -> bool:
    """A file that a DCP save into the folder replaces or removes (its
    ``.metadata``, data files and temporary metadata of other saves)."""
    from ..filesystem import replaced_by_a_save
    return replaced_by_a_save(name)


#: files that loaders take before a sharded safetensors folder's index:
#: ``transformers`` loads ``model.safetensors`` first, dcpx's own input
#: detection a ``.metadata``
_SHADOWS_SHARDS = ("model.safetensors", METADATA_FN)


class _DirOutput:
    """A directory output of ``convert`` (a DCP checkpoint, sharded
    safetensors) and what it may touch there.

    ``claim(names)``, before anything is written, refuses every existing
    file the new output would replace (its ``names``; for DCP, any file a
    DCP save replaces or removes) or that loaders would take in its place,
    unless an earlier convert wrote it: its manifest (``MANIFEST``) names
    it and it is still that file (a regular file, not a link, of the size
    and modification time recorded).  ``done(names)``, once the output is
    complete, removes the files of the earlier convert that the new output
    did not replace, and records the new output's files.  Nothing else in
    the folder is touched; the folder is opened without following a link
    (a symlinked output folder is never entered to remove anything)."""

    def __init__(self, dst: Path, fmt: str):
        self.dst, self.fmt = dst, fmt
        # a link to an (empty: convert checked) folder: written into, never
        # removed from (no earlier files are believed there)
        self.linked = dst.is_symlink()
        self.earlier = {} if self.linked else self._read_manifest()

    def _dir_fd(self) -> int:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            return os.open(self.dst, flags if self.linked else flags | os.O_NOFOLLOW)
        except OSError as e:
            raise CliError(f"{self.dst}: cannot open the output folder without following "
                           f"a link: {e.strerror}") from None

    def _read_manifest(self) -> dict:
        """name -> (size, mtime_ns) of the files an earlier convert recorded
        (None, None: it was writing them when it stopped); {} when there
        is no manifest or it cannot be read."""
        if not self.dst.is_dir():
            return {}
        dfd = self._dir_fd()
        try:
            fd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=dfd)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    return {}
                got = json.loads(f.read(1 << 20))
        except (OSError, ValueError, RecursionError):
            return {}
        finally:
            os.close(dfd)
        out = {}
        files = got.get("files") if isinstance(got, dict) else None
        for name, rec in (files.items() if isinstance(files, dict) else ()):
            if (isinstance(name, str) and _OURS.match(name) and isinstance(rec, list)
                    and len(rec) == 2 and all(x is None or type(x) is int for x in rec)):
                out[name] = tuple(rec)
        return out

    def _is_earlier(self, name: str, st: os.stat_result) -> bool:
        rec = self.earlier.get(name)
        if rec is None or not stat.S_ISREG(st.st_mode):
            return False
        size, mtime = rec
        return size is None or (st.st_size == size and st.st_mtime_ns == mtime)

    def _entries(self) -> dict:
        """name -> lstat of each entry of the folder ({} when there is none)."""
        if not self.dst.exists():
            return {}
        dfd = self._dir_fd()
        try:
            out = {}
            for name in os.listdir(dfd):
                try:
                    out[name] = os.lstat(name, dir_fd=dfd)
                except FileNotFoundError:
                    pass
            return out
        finally:
            os.close(dfd)

    def claim(self, names: list) -> None:
        present = self._entries()
        if self.fmt == "dcp":
            touched = [n for n in present if _dcp_would_touch(n)]
        else:
            touched = [n for n in present if n in names or n in _SHADOWS_SHARDS]
        foreign = sorted(n for n in touched if not self._is_earlier(n, present[n]))
        if foreign:
            why = {"model.safetensors": " (transformers loads it before the index)",
                   METADATA_FN: " (dcpx would read the folder as a DCP checkpoint)"}
            shown = [n + (why.get(n, "") if n not in names else "") for n in foreign[:10]]
            more = f" and {len(foreign) - 10} more" if len(foreign) > 10 else ""
            what = ("a DCP save there replaces or removes" if self.fmt == "dcp" else
                    "the output replaces or that would stand in its way")
            raise CliError(
                f"{self.dst}: holds {len(foreign)} file(s) {what} that no earlier `dcpx "
                f"convert` into this folder wrote (its {MANIFEST} does not name them, as "
                f"they are now): {', '.join(shown)}{more}. --overwrite replaces and removes "
                f"only what convert wrote: remove them yourself, or convert into another folder")
        self.dst.mkdir(parents=True, exist_ok=True)
        # until done(): the earlier files and the ones about to be written
        pending = dict(self.earlier)
        pending.update({n: (None, None) for n in names})
        self._write_manifest(pending)

    def done(self, names: list) -> None:
        dfd = self._dir_fd()
        removed = []
        try:
            # the earlier output's files this one did not replace (its
            # .metadata / index first: never one that names removed files)
            for name in sorted(set(self.earlier) - set(names),
                               key=lambda n: (n not in (METADATA_FN, SAFETENSORS_INDEX), n)):
                try:
                    st = os.lstat(name, dir_fd=dfd)
                except FileNotFoundError:
                    continue
                if self._is_earlier(name, st):
                    os.unlink(name, dir_fd=dfd)
                    removed.append(name)
            record = {}
            for name in names:
                st = os.lstat(name, dir_fd=dfd)
                record[name] = (st.st_size, st.st_mtime_ns)
        finally:
            os.close(dfd)
        self._write_manifest(record)
        if removed:
            warn(f"--overwrite: removed {len(removed)} file(s) an earlier convert wrote into "
                 f"{self.dst}: {', '.join(removed)}")

    def _write_manifest(self, files: dict) -> None:
        doc = {"written_by": "dcpx convert", "format": self.fmt,
               "files": {n: list(files[n]) for n in sorted(files)}}
        _write_file(self.dst / MANIFEST, (json.dumps(doc, indent=1) + "\n").encode())


class _Selected(Source):
    """The keys of ``src`` that start with one of ``only`` (all when empty),
    renamed without ``strip`` (e.g. export ``model.*`` of a training
    checkpoint as the model's own state dict)."""

    def __init__(self, src: Source, only: list, strip: Optional[str]):
        self.src, self.kind, self.path = src, src.kind, src.path
        self._map: dict[str, str] = {}
        for k in src.entries():
            if only and not any(k.startswith(p) for p in only):
                continue
            new = k[len(strip):] if strip and k.startswith(strip) else k
            if not new:
                raise CliError(f"--strip-prefix {strip!r} leaves the key {k!r} empty")
            if new in self._map:
                raise CliError(f"keys {self._map[new]!r} and {k!r} both become {new!r}")
            self._map[new] = k
        if not self._map:
            raise CliError(f"no key starts with {' or '.join(map(repr, only))}")

    def entries(self) -> dict[str, Entry]:
        e = self.src.entries()
        return {new: e[old]._replace(key=new) for new, old in self._map.items()}

    def paths(self) -> dict[str, tuple]:
        return {new: (new,) for new in self._map}

    def read(self, key: str) -> Any:
        return self.src.read(self._map[key])

    def release(self, key: str, value: Any) -> None:
        self.src.release(self._map[key], value)


def convert(src_path: str, dst_path: str, *, to: Optional[str] = None,
            src_format: Optional[str] = None, max_shard_size: Optional[str] = None,
            overwrite: bool = False, only: Optional[list] = None,
            strip_prefix: Optional[str] = None, show_progress: bool = False, out=None) -> int:
    out = out or sys.stdout
    max_shard = parse_size(max_shard_size) if max_shard_size else None
    fmt = output_format(dst_path, to, max_shard is not None)
    if max_shard is not None and fmt != "safetensors":
        raise CliError("--max-shard-size is for safetensors output")
    if max_shard is not None and max_shard <= 0:
        raise CliError("--max-shard-size must be positive")
    dst = Path(dst_path)
    in_dir = fmt == "dcp" or (fmt == "safetensors" and max_shard is not None)
    if dst.exists() and not overwrite and (not dst.is_dir() or any(dst.iterdir())):
        raise CliError(f"{dst}: exists (pass --overwrite to replace it)")
    if not in_dir and dst.is_dir():
        if fmt == "safetensors":
            raise CliError(f"{dst}: is a directory; a single safetensors output is a file "
                           f"(or pass --max-shard-size for shards in a directory)")
        raise CliError(f"{dst}: is a directory; a torch.save output is a file")
    if in_dir and dst.exists() and not dst.is_dir():
        raise CliError(f"{dst}: is a file; a {fmt} output is a directory (convert into "
                       f"another path, or remove the file yourself)")
    if in_dir and dst.is_symlink() and any(dst.iterdir()):
        raise CliError(f"{dst}: is a symbolic link to a folder that is not empty: --overwrite "
                       f"never removes anything through a link (name the folder itself: "
                       f"{os.path.realpath(dst)})")
    src = open_source(src_path, src_format)
    if overwrite and dst.exists() and dst.resolve() == Path(src_path).resolve():
        raise CliError(f"{dst}: is the input; convert into another path")
    if only or strip_prefix:
        src = _Selected(src, list(only or []), strip_prefix)
    output = _DirOutput(dst, fmt) if in_dir else None
    if fmt == "safetensors":
        what = to_safetensors(src, dst, max_shard, show_progress, output)
    elif fmt == "torch":
        what = to_torch(src, dst, show_progress)
    else:
        assert output is not None
        what = to_dcp(src, dst, show_progress, output)
    print(f"{src.kind} {src_path}: {what}", file=out)
    return 0


def add_parser(sub, **common) -> None:
    p = sub.add_parser("convert", help=HELP, description=HELP + ".", **common)
    p.add_argument("src", help="a DCP directory, a torch.save file, a .safetensors file, "
                               "or a directory / index.json of safetensors shards")
    p.add_argument("dst")
    p.add_argument("--to", choices=["dcp", "torch", "safetensors"],
                   help="output format (default: from DST: *.safetensors or "
                        "--max-shard-size: safetensors; *.pt, *.pth, *.bin, *.ckpt: "
                        "torch; otherwise a DCP directory)")
    p.add_argument("--from", dest="src_format", choices=["dcp", "torch", "safetensors"],
                   help="input format (default: detected)")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="safetensors shards of at most SIZE (e.g. 5GB) each in directory DST, "
                        "with model.safetensors.index.json (a tensor larger than SIZE gets "
                        "a shard of its own)")
    p.add_argument("--only", action="append", metavar="PREFIX",
                   help="convert only the keys that start with PREFIX (repeatable)")
    p.add_argument("--strip-prefix", metavar="PREFIX",
                   help="remove PREFIX from the start of the keys that have it")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing DST: a file DST itself; in a folder DST only "
                        "what an earlier convert wrote there (its .dcpx-convert.json names "
                        "it); any other file the output would replace is an error naming it")
    p.set_defaults(run=run)


def run(args) -> int:
    return convert(args.src, args.dst, to=args.to, src_format=args.src_format,
                   max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                   only=args.only, strip_prefix=args.strip_prefix, show_progress=True)
