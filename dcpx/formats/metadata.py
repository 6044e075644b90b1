"""The ``.metadata`` file: building it quickly, writing it with an integrity
trailer, and reading it without running code from the checkpoint.

The file is ``pickle.dump(Metadata)`` exactly as torch's FileSystemWriter
writes it, so ``torch.distributed.checkpoint.load`` reads it.  dcpx appends a
trailer after the pickle's STOP opcode (``pickle.load`` stops there and never
sees it)::

    b"DCPXMD1\\0" + u32 crc32(pickle bytes) + u64 len(pickle bytes)

so a flipped byte in the metadata is caught on load.  Files without the
trailer (written by torch) are read as they are.

Reading uses an Unpickler whose ``find_class`` admits only the classes that
DCP metadata is made of (torch's metadata dataclasses, ``torch.Size``,
dtypes, layouts, paths and plain containers); anything else, e.g. a crafted
``os.system`` reduce, raises UnsafeCheckpointError before it is called.
"""
from __future__ import annotations

import copyreg
import functools
import io
import pathlib
import pickle
import struct
from typing import Any, NamedTuple, Optional

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from .. import _C
from .._torchcompat import METADATA_FIELDS
from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from .files import METADATA_FN  # noqa: F401  (the file this module reads and writes)
_TRAILER_MAGIC = b"DCPXMD1\0"
_TRAILER = struct.Struct("<8sIQ")

# --- building ---------------------------------------------------------------

_PROPS: dict = {}
_ZERO_OFFSETS: dict = {}


def properties(dtype: torch.dtype, requires_grad: bool,
               pinned: bool) -> _md.TensorProperties:
    """Shared TensorProperties per (dtype, requires_grad, pinned): the pickle
    then stores each distinct one once, which makes the metadata of a
    20,000-tensor checkpoint several times cheaper to write and read."""
    key = (dtype, requires_grad, pinned)
    p = _PROPS.get(key)
    if p is None:
        p = _md.TensorProperties(dtype=dtype, layout=torch.strided,
                                 requires_grad=requires_grad,
                                 memory_format=torch.contiguous_format,
                                 pin_memory=pinned)
        _PROPS[key] = p
    return p


def tensor_properties(t: torch.Tensor, pinned: bool) -> _md.TensorProperties:
    return properties(t.dtype, t.requires_grad, pinned)


def zero_offsets(ndim: int) -> torch.Size:
    z = _ZERO_OFFSETS.get(ndim)
    if z is None:
        z = _ZERO_OFFSETS[ndim] = torch.Size([0] * ndim)
    return z


def tensor_metadata(t: torch.Tensor, pinned: bool) -> _md.TensorStorageMetadata:
    """Metadata of a whole (unsharded) tensor saved as one chunk."""
    size = t.size()
    chunk = _md.ChunkStorageMetadata(offsets=zero_offsets(len(size)), sizes=size)
    return _md.TensorStorageMetadata(properties=tensor_properties(t, pinned),
                                     size=size, chunks=[chunk])


class _Pickler(pickle.Pickler):
    """pickle.Pickler that stores a _StorageInfo as a constructor call
    ``_StorageInfo(path, offset, length)`` instead of torch's Python
    ``__getstate__`` dict: the same object on load (torch's and dcpx's), a
    fifth less time and space for many-tensor checkpoints."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is _StorageInfo and getattr(obj, "transform_descriptors", None) is None:
            return (_StorageInfo, (obj.relative_path, obj.offset, obj.length))
        return NotImplemented


_PROTOCOL = min(pickle.HIGHEST_PROTOCOL, 5)


class Splice(NamedTuple):
    """What a single-process save (dcpx.coordination.plan.plan_local_save) tells the
    encoder about its Metadata, so that a save of an unchanged layout
    reuses the encoding of the last one ("Reuse of the encoded body" below).

    ``names``: the data file names, the very str objects that
    ``storage_data``'s _StorageInfo hold; ``cell``: the plan's one-item
    cache, ``[None]`` or ``[(layout, middle)]``; ``layout``: this save's
    (offset, length) per item, per file; ``middle``: the cached encoding
    that is valid for this save (its plan, mappings and layout), or None."""
    metadata: _md.Metadata
    names: tuple
    cell: list
    layout: list
    middle: Optional[bytes]


# Reuse of the encoded body.  A save whose plan is reused has the same
# Metadata as the plan's last save except for the data file names (new tag
# per save) and storage_meta (checkpoint path, save id).  Such a save's
# pickle is written in csrc/mdpickle.c's split form: the file names first
# (memo 0..n-1), then the Metadata without storage_meta (the middle, which
# refers to the names only by memo index), then storage_meta as a second
# BUILD of the same object.  The middle is cached in the plan and, while
# the layout stays the same, copied instead of encoded (~2 us per tensor);
# it loads, with torch's pickle.load or dcpx's reader, to the same object.
# The fields in the order the installed torch's Metadata sets them.
_FIELDS = list(METADATA_FIELDS)


def dumps(metadata: _md.Metadata, splice: Optional[Splice] = None) -> bytes:
    """The .metadata file's bytes: the pickle, written by the C encoder
    (csrc/mdpickle.c) when the object graph is made of DCP metadata types
    only, else by Python's pickler; then the trailer.  ``splice``: see
    Splice (ignored unless it is for this very ``metadata``)."""
    body = None
    if splice is not None and splice.metadata is metadata:
        body = _split_body(metadata, splice)
    if body is None:
        body = _c_body(metadata)
    if body is None:
        body = _python_body(metadata)
    return body + _TRAILER.pack(_TRAILER_MAGIC, _C.crc32(body), len(body))


def _split_parts(metadata: _md.Metadata) -> tuple | None:
    """(head, tail) of the split form: the Metadata less its storage_meta,
    and that storage_meta; None when the C encoder would decline (another
    class, other fields)."""
    global _KINDS
    if type(metadata) is not _md.Metadata or list(vars(metadata)) != _FIELDS:
        return None
    if _KINDS is None:
        _KINDS = _c_kinds()
    head = _md.Metadata.__new__(_md.Metadata)
    state = vars(head)
    state.update(vars(metadata))
    return head, {"storage_meta": state.pop("storage_meta")}


def _split_body(metadata: _md.Metadata, splice: Splice) -> bytes | None:
    """The pickle in the split form, from the cached middle when the splice
    has one; caches the middle otherwise.  None: the C encoder declined."""
    parts = _split_parts(metadata)
    if parts is None:
        return None
    head, tail = parts
    if splice.middle is not None:
        out = _C.dump_metadata(head, _KINDS, _PROTOCOL, names=splice.names, tail=tail,
                               middle=splice.middle)
        return None if out is None else out[0]
    out = _C.dump_metadata(head, _KINDS, _PROTOCOL, names=splice.names, tail=tail)
    if out is None:
        return None
    body, start, end = out
    middle = body[start:end]
    # The middle names the files only by memo index; if one is written out
    # in it (not the very object given as a name), it is not reusable.
    if not any(n.encode("utf-8", "surrogatepass") in middle for n in splice.names):
        splice.cell[0] = (splice.layout, middle)
    return body


def split_dumps(metadata: _md.Metadata, names: tuple,
                middle: Optional[bytes] = None) -> tuple[bytes, Optional[bytes], int] | None:
    """A multi-rank save's .metadata bytes in the split form ("Reuse of the
    encoded body" above; dcpx.coordination.dist, "Steady-state saves"):
    (data, middle, where the middle starts in data), the middle reusable by a later save with as many data
    files, the same plan and the same layouts (None when it is not: a
    name is also a key or a planner_data string, so it is written out in
    full).  ``names``: the data file names, the very str objects that
    ``storage_data``'s _StorageInfo hold, in the order of every rank's
    files.  With ``middle`` given, ``metadata``'s fields but storage_meta
    are not looked at.  None: the C encoder declined (the caller encodes
    the usual way)."""
    parts = _split_parts(metadata)
    if parts is None:
        return None
    head, tail = parts
    if middle is not None:
        out = _C.dump_metadata(head, _KINDS, _PROTOCOL, names=names, tail=tail, middle=middle)
        if out is None:
            return None
        body, start = out[0], out[1]
    else:
        out = _C.dump_metadata(head, _KINDS, _PROTOCOL, names=names, tail=tail)
        if out is None:
            return None
        body, start, end = out
        middle = body[start:end]
        # The middle names a file only by memo index unless a string equal
        # to a name is another object in it: a key, a planner_data part.
        named = set(names)
        if not named.isdisjoint(metadata.state_dict_metadata) or any(
                p in named for path in (metadata.planner_data or {}).values()
                if type(path) is tuple for p in path if type(p) is str):
            middle = None
    return body + _TRAILER.pack(_TRAILER_MAGIC, _C.crc32(body), len(body)), middle, start


class FileRegion(NamedTuple):
    """Where an earlier .metadata file of this process holds a middle: the
    file, the middle's offset in it, and the file's identity when it was
    written ((st_dev, st_ino, st_size, st_mtime_ns)); a copy from it is
    taken only while the file is still that one (dcpx.storage.commit)."""
    path: str
    offset: int
    identity: tuple


class Spliced(NamedTuple):
    """A .metadata file's bytes as ``pre + middle + post``, ``post`` ending
    with the trailer.  The commit writes ``pre`` and ``post`` and copies
    ``middle`` from ``source`` where it can (``copy_file_range``: no pass
    over the bytes in this process; a reflink on XFS, btrfs, or a
    server-side copy on NFS 4.2), writing it from memory otherwise."""
    pre: bytes
    middle: bytes
    post: bytes
    source: Optional[FileRegion]

    def __bytes__(self) -> bytes:
        return b"".join((self.pre, self.middle, self.post))

    def size(self) -> int:
        return len(self.pre) + len(self.middle) + len(self.post)


def steady_dumps(metadata: _md.Metadata, names: tuple, middle: bytes, middle_crc: int,
                 source: Optional[FileRegion] = None) -> Optional[Spliced]:
    """split_dumps with a cached ``middle`` (whose CRC-32 is ``middle_crc``)
    as a Spliced: only the names and storage_meta are encoded, and the
    trailer's CRC is combined from the parts' (the middle is not read).
    ``pre + middle + post`` is split_dumps(metadata, names, middle)[0].
    None: the C encoder declined."""
    parts = _split_parts(metadata)
    if parts is None:
        return None
    head, tail = parts
    out = _C.dump_metadata(head, _KINDS, _PROTOCOL, names=names, tail=tail, middle=b"")
    if out is None:
        return None
    body, at, _ = out
    pre, post = body[:at], body[at:]
    crc = _C.crc32_combine(_C.crc32_combine(_C.crc32(pre), middle_crc, len(middle)),
                           _C.crc32(post), len(post))
    size = len(pre) + len(middle) + len(post)
    return Spliced(pre, middle, post + _TRAILER.pack(_TRAILER_MAGIC, crc, size),
                   source)


def _python_body(metadata: Any) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=_PROTOCOL).dump(metadata)
    return out.getvalue()


def _c_body(metadata: Any) -> bytes | None:
    """The pickle from csrc/mdpickle.c, or None when the graph holds an
    object outside its closed set of types."""
    global _KINDS
    if _KINDS is None:
        _KINDS = _c_kinds()
    return _C.dump_metadata(metadata, _KINDS, _PROTOCOL)


# Kinds of csrc/mdpickle.c (see its header comment).
_KIND_PLAIN, _KIND_GETSTATE, _KIND_STORAGE, _KIND_SIZE, _KIND_REDUCE = range(5)
_KINDS: dict | None = None


def _new_and_state(cls: type) -> bool:
    """cls pickles as object.__reduce_ex__ does it: copyreg.__newobj__
    (cls.__new__(cls), NEWOBJ) then the state, BUILD."""
    return (cls not in copyreg.dispatch_table
            and cls.__reduce_ex__ is object.__reduce_ex__
            and cls.__reduce__ is object.__reduce__
            and not hasattr(cls, "__getnewargs_ex__")
            and not hasattr(cls, "__getnewargs__")
            and not any("__slots__" in vars(c) for c in cls.__mro__))


def _c_kinds() -> dict:
    """{type: (kind, reducer)} for the C encoder: each type only if it still
    pickles the way its kind writes it (checked here, once per process, so
    that a torch that changes a reduction gets Python's pickler instead)."""
    default_getstate = getattr(object, "__getstate__", None)
    kinds: dict = {}
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                 "StorageMeta"):
        cls = getattr(_md, name, None)
        if cls is None or not _new_and_state(cls):
            continue
        if getattr(cls, "__getstate__", None) is default_getstate:
            kinds[cls] = (_KIND_PLAIN, None)
        else:
            kinds[cls] = (_KIND_GETSTATE, None)
    if _new_and_state(_StorageInfo):
        kinds[_StorageInfo] = (_KIND_STORAGE, None)
    size = torch.Size([2, 3])
    if torch.Size not in copyreg.dispatch_table and \
            size.__reduce_ex__(_PROTOCOL) == (torch.Size, ((2, 3),)):
        kinds[torch.Size] = (_KIND_SIZE, None)
    for cls in (torch.dtype, torch.layout, torch.memory_format,
                getattr(_md, "_MEM_FORMAT_ENCODING", None), pathlib.PurePosixPath,
                pathlib.PosixPath, pathlib.PureWindowsPath):
        if cls is not None:
            kinds[cls] = (_KIND_REDUCE, copyreg.dispatch_table.get(cls))
    return kinds


_SIZES: dict = {}


def interned_size(dims: tuple) -> torch.Size:
    """One torch.Size object per distinct shape, so that the metadata pickle
    stores each shape once (later uses are memo references)."""
    s = _SIZES.get(dims)
    if s is None:
        if len(_SIZES) > 65536:
            _SIZES.clear()
        s = _SIZES[dims] = torch.Size(dims)
    return s


# --- reading ----------------------------------------------------------------

def _allowed() -> dict:
    allow = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
        ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "slice"): slice,
    }
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                 "StorageMeta", "_MEM_FORMAT_ENCODING"):
        if hasattr(_md, name):
            allow[("torch.distributed.checkpoint.metadata", name)] = getattr(_md, name)
    for name in dir(torch):
        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            allow[("torch", name)] = obj
    # Older torch wrote the sharded tensor module's TensorProperties (and its
    # memory-format enum) into .metadata; torch still loads it as that class.
    # Its __setstate__ takes the same 5-tuple and runs no other code.
    try:
        from torch.distributed._shard.sharded_tensor import metadata as st_md
    except ImportError:  # a torch without it
        st_md = None
    for name in ("TensorProperties", "MEM_FORMAT_ENCODING"):
        if hasattr(st_md, name):
            allow[("torch.distributed._shard.sharded_tensor.metadata", name)] = \
                getattr(st_md, name)
    return allow


@functools.lru_cache(maxsize=None)
def _allowed_globals() -> dict:
    """The Unpickler's allow-list, built once (the C decoder's globals are
    a subset of it, by the same objects)."""
    return _allowed()


class SafeUnpickler(pickle.Unpickler):
    """Unpickler that resolves only allow-listed globals."""

    def __init__(self, f, what: str):
        super().__init__(f)
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed_globals().get((module, name))
        if obj is None:
            raise UnsafeCheckpointError(
                f"{self._what}: refusing to load global {module}.{name}: it "
                f"is not a DCP metadata type (the file may be crafted to run "
                f"code)")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._what}: unexpected persistent id")


def _body_len(data: bytes, path: str) -> int:
    """Bytes of the pickle in a .metadata file's bytes, after checking
    dcpx's trailer when there is one."""
    if len(data) >= _TRAILER.size and data[-_TRAILER.size:-_TRAILER.size + 8] == _TRAILER_MAGIC:
        _, crc, n = _TRAILER.unpack(data[-_TRAILER.size:])
        body = len(data) - _TRAILER.size
        if n != body or _C.crc32(memoryview(data)[:body]) != crc:
            raise CorruptCheckpointError(
                f"{path}: metadata checksum mismatch (the file is corrupted)")
        return body
    return len(data)


def loads(data: bytes, path: str, indexed: bool = False) -> _md.Metadata:
    """Parse a .metadata file's bytes; verify dcpx's trailer when present.
    ``indexed``: the C decoder (``index``) accepted these very bytes, and
    it checks the graph as ``_validate`` does (tests/test_mdindex.py holds
    it to that: whatever it accepts, ``_validate`` accepts with the same
    meaning), so the graph is not walked again here: at 16,384 ranks that
    walk was about a quarter of a DTensor load's planning per rank."""
    n = _body_len(data, path)
    body = data if n == len(data) else data[:n]
    try:
        _C.check_pickle(body)
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: metadata is not a safe pickle: {e}") from None
    try:
        md = SafeUnpickler(io.BytesIO(body), path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"{path}: cannot parse metadata: {e!r}") from e
    if indexed:
        return md
    try:
        _validate(md)
    except (AttributeError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: malformed DCP metadata: {e}") from None
    return md


def _validate(md: Any) -> None:
    """Check the unpickled object graph has the types and shapes the loader
    relies on (a crafted pickle can build allowed classes without their
    fields, or with fields of other types).

    The unpickler builds only the allow-listed classes themselves, never
    subclasses, so exact type tests are used (cheaper than isinstance), and
    a TensorProperties shared by many tensors (dcpx writes one per distinct
    dtype) is checked once."""
    if not isinstance(md, _md.Metadata):
        raise TypeError(f"the file holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise TypeError("state_dict_metadata and storage_data must be dicts")
    TSM, BSM, CSM = _md.TensorStorageMetadata, _md.BytesStorageMetadata, _md.ChunkStorageMetadata
    Size, TP = torch.Size, _md.TensorProperties
    old_tp = _allowed_globals().get(("torch.distributed._shard.sharded_tensor.metadata",
                                     "TensorProperties"), TP)
    good_props: set = set()
    for fqn, m in md.state_dict_metadata.items():
        if type(fqn) is not str:
            raise TypeError(f"key {fqn!r} is not a string")
        tm = type(m)
        if tm is TSM:
            p, size, chunks = m.properties, m.size, m.chunks
            if id(p) not in good_props:
                if not ((type(p) is TP or type(p) is old_tp)
                        and isinstance(p.dtype, torch.dtype)):
                    raise TypeError(f"tensor metadata of {fqn!r} is malformed")
                good_props.add(id(p))  # p stays alive in md while this runs
            if not (type(size) is Size and type(chunks) is list):
                raise TypeError(f"tensor metadata of {fqn!r} is malformed")
            ndim = len(size)
            for ch in chunks:
                if type(ch) is not CSM:
                    raise ValueError(f"chunk of {fqn!r} lies outside its tensor")
                off, sz = ch.offsets, ch.sizes
                if not (type(off) is Size and type(sz) is Size
                        and len(off) == len(sz) == ndim):
                    raise ValueError(f"chunk of {fqn!r} lies outside its tensor")
                if sz == size and not any(off) and (not ndim or min(size) >= 0):
                    continue  # the whole tensor as one chunk
                if not all(0 <= o and 0 <= n and o + n <= s for o, n, s in
                           zip(off, sz, size)):
                    raise ValueError(f"chunk of {fqn!r} lies outside its tensor")
        elif tm is not BSM:
            raise TypeError(f"metadata of {fqn!r} is a {type(m).__name__}")
    MI, SI = _md.MetadataIndex, _StorageInfo
    for index, info in md.storage_data.items():
        if not (type(index) is MI and type(index.fqn) is str
                and type(info) is SI and type(info.relative_path) is str
                and type(info.offset) is int and type(info.length) is int):
            raise TypeError(f"storage entry {index!r} is malformed")


# --- reading into a load's tables (csrc/mdindex.c) -------------------------

# Global kinds of csrc/mdindex.c (G_*).
_G_CLASSES = {"Metadata": 1, "TensorStorageMetadata": 2, "BytesStorageMetadata": 3,
              "ChunkStorageMetadata": 4, "TensorProperties": 5, "MetadataIndex": 6,
              "StorageMeta": 7}
_G_SI, _G_SIZE, _G_GET_LAYOUT, _G_MEMFMT_ENC, _G_PATH, _G_DTYPE, _G_OPAQUE = range(8, 15)
_INDEX_TABLES: tuple | None = None


def _dict_state(cls: type) -> bool:
    """cls unpickles as NEWOBJ then BUILD of its __dict__ (no __setstate__)."""
    return _new_and_state(cls) and not hasattr(cls, "__setstate__")


def _tp_state() -> bool:
    """TensorProperties unpickles through its __setstate__ of the 5-tuple
    (dtype, layout, requires_grad, memory-format encoding, pin_memory)."""
    TP = _md.TensorProperties
    if not (_new_and_state(TP) and "__setstate__" in vars(TP)
            and hasattr(_md, "_MEM_FORMAT_ENCODING")):
        return False
    try:
        p = TP(dtype=torch.float32)
        state = p.__getstate__()
        q = TP.__new__(TP)
        q.__setstate__(state)
        return (type(state) is tuple and len(state) == 5 and q == p
                and state[3] == _md._MEM_FORMAT_ENCODING(0))
    except Exception:  # a torch whose TensorProperties changed: Python's path
        return False


def _index_tables() -> tuple:
    """(globals, dtypes) for _C.md_index: the globals of the Unpickler's
    allow-list that the C decoder knows how to use, each as (kind, index),
    and per dtype (torch.dtype, its archive storage type, or None when it
    is not read in place)."""
    from .dtypes import _needs_int_view, storage_type_name
    allowed = _allowed_globals()
    mod = "torch.distributed.checkpoint.metadata"
    glob: dict = {}
    for name, kind in _G_CLASSES.items():
        cls = getattr(_md, name, None)
        if cls is not None and (_tp_state() if name == "TensorProperties" else _dict_state(cls)):
            glob[(mod, name)] = (kind, 0)
    glob[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = (_G_SI, 0)
    glob[("torch", "Size")] = (_G_SIZE, 0)
    glob[("torch.serialization", "_get_layout")] = (_G_GET_LAYOUT, 0)
    glob[(mod, "_MEM_FORMAT_ENCODING")] = (_G_MEMFMT_ENC, 0)
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        glob[("pathlib", name)] = (_G_PATH, 0)
    dtypes: list = []
    for (module, name), obj in allowed.items():
        if module != "torch":
            continue
        if isinstance(obj, torch.dtype):
            try:
                stype = None if _needs_int_view(obj) else storage_type_name(obj)
            except TypeError:
                stype = None
            glob[(module, name)] = (_G_DTYPE, len(dtypes))
            dtypes.append((obj, stype))
        elif isinstance(obj, (torch.layout, torch.memory_format)):
            glob[(module, name)] = (_G_OPAQUE, 0)
    # _StorageInfo(path, offset, length) as the decoder reads that REDUCE,
    # and _get_layout("torch.strided"); else neither is decoded in C.
    try:
        info = _StorageInfo("f", 1, 2)
        ok = (_dict_state(_StorageInfo) and info.relative_path == "f" and info.offset == 1
              and info.length == 2 and getattr(info, "transform_descriptors", None) is None
              and torch.serialization._get_layout("torch.strided") is torch.strided)
    except Exception:  # a torch whose _StorageInfo changed: Python's path
        ok = False
    # Only what the Unpickler resolves, to the same objects.
    glob = {k: v for k, v in glob.items()
            if k in allowed and (ok or v[0] not in (_G_SI, _G_GET_LAYOUT))}
    return glob, dtypes


def index(data: bytes, path: str):
    """(index, data file names) of a .metadata file's bytes from the C
    decoder (csrc/mdindex.c), trailer checked; None when it leaves the file
    to ``loads`` (anything it does not fully understand, including every
    malformed or unsafe pickle: ``loads`` raises the error)."""
    global _INDEX_TABLES
    n = _body_len(data, path)
    if _INDEX_TABLES is None:
        _INDEX_TABLES = _index_tables()
    return _C.md_index(data, n, *_INDEX_TABLES)
