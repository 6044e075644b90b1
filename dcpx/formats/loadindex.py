"""The load index: a file beside ``.metadata`` (``.metadata.index``, which
torch never reads) from which one rank finds the saved chunks of the keys it
loads without reading or decoding the whole ``.metadata`` (issue 28 item 4;
layout: docs/format.md, "The load index").

At R ranks an FSDP key is saved in R chunks, and ``.metadata`` holds every
chunk of every key: 14 MB at 16,384 ranks x 6 tensors, read and decoded by
every rank.  With the index a rank reads about two 4 KiB blocks per key (its
head and fence of chunk starts, the leaf of rows that meets its region;
the key table, dtypes and file names are shared by its keys) and does work
in (its keys) x log(chunks per key).

``build_body(metadata)`` makes the body on rank 0 at commit (None when the
metadata holds anything the index cannot represent exactly: then no index
is written), ``header(body, md_crc, md_len)`` the 64 bytes before it that
name the ``.metadata`` it was made for by that file's trailer, and
``LoadIndex.open(directory)`` reads it: ``region(fqn, region)`` answers what
``_C.md_index_region`` answers from the decoded tables.

Everything read is checked before it is used: the header by its CRC-32 and
the ``.metadata`` trailer, each key row, key fence entry, key head, dtype
and file row by its own CRC-32, each fence block and each leaf of chunk
rows (at most 4 KiB) by the CRC-32 the level above holds, names by theirs;
every offset and length against the file's size; chunks inside their tensor, extents not negative, file names
plain, dtypes from an allow-list.  A problem found raises
``LoadIndexCorrupt`` naming the file (the caller plans from ``.metadata``
instead); a crafted index that passes every check can describe another
checkpoint than ``.metadata`` does, but cannot make a load read outside the
checkpoint's data files (names and extents are checked as ``.metadata``'s
are), allocate more than the file's size, or loop longer than its rows.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
import itertools
import math
import operator
import os
import stat
import struct
import sys
from array import array
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorStorageMetadata,
)

from .. import _C
from .files import METADATA_FN

#: the index's file name, beside ``.metadata`` (no name DCP uses)
INDEX_FN = METADATA_FN + ".index"

_MAGIC = b"DCPXLI1\0"
_BODY_MAGIC = b"DCPXLIB\0"
_VERSION = 1
_MD_MAGIC = b"DCPXMD1\0"           # the .metadata trailer (formats.metadata)
_MD_TRAILER = struct.Struct("<8sIQ")

# header: magic, version, md_crc, md_len, body_len, body_crc, nkeys,
# ndtypes, nfiles, nbytes, two reserved words (0); then its own CRC-32
_HDR = struct.Struct("<8sIIQQIIIIIII")
HEADER_LEN = _HDR.size + 4          # 64
# body head: magic, nkeys, ndtypes, nfiles, nbytes, reserved (0), CRC-32
_HEAD = struct.Struct("<8sIIIII")
_HEAD_LEN = _HEAD.size + 4          # 32
# key row: hash64(fqn), name_off, name_len, name_crc, kind, ndim, dtype,
# nchunks, area_off, file, offset, length; then its CRC-32
_KEY = struct.Struct("<QQIIBBHIQIQQ")
_KEY_W = _KEY.size + 4              # 64
_KEY_LEAF = 64                      # key rows per key fence entry
_KFENCE = struct.Struct("<Q")       # hash of the leaf's first row; CRC-32
_KFENCE_W = 12
_DTYPE_NAME_LEN = 28
_DTYPE_W = _DTYPE_NAME_LEN + 4      # name (NUL-padded), CRC-32
_FILE = struct.Struct("<QII")       # name_off, name_len, name_crc
_FILE_W = _FILE.size + 8            # + reserved (0), CRC-32
_BYTES_W = 8                        # key ordinal, CRC-32
_FENCE = struct.Struct("<QI")       # a fence entry: first start of a leaf / block, its CRC
_FENCE_W = _FENCE.size              # 12
_FENCE_BLOCK = 4096 // _FENCE_W     # fence entries per fence block (341)
_U32 = struct.Struct("<I")
_II = struct.Struct("<II")

_TENSOR, _BYTES = 1, 2
_MAX_DIMS = 64
_BLOCK = 4096
_LEAF_BYTES = 4096
_ALIGN_LEAVES = 8
_I64_MAX = (1 << 63) - 1
_I64_MIN = -(1 << 63)

_crc32 = _C.crc32


def _dtype_table() -> tuple:
    """({name: dtype}, {dtype: name}) over torch's dtypes, by their
    canonical names (``str(torch.float) == "torch.float32"``): a name read
    from an index is looked up here, never passed to getattr."""
    by_name: dict = {}
    for attr in dir(torch):
        obj = getattr(torch, attr, None)
        if isinstance(obj, torch.dtype):
            name = str(obj)
            if name.startswith("torch."):
                name = name[6:]
            if name.isascii() and 0 < len(name) <= _DTYPE_NAME_LEN:
                by_name[name] = obj
    return by_name, {d: n for n, d in by_name.items()}


_DTYPES, _DTYPE_NAMES = _dtype_table()


#: dcpx's data files carry the save's tag (``__{rank}_{tag}_{i}.distcp``,
#: 16 hex digits, new per save).  A body built with ``tag`` holds the names
#: with it replaced by this hole, and the header (version 2) holds the tag:
#: a later save of the same layout reuses the body under its own header.
_HOLE = "?" * 16
_TAGGED = 2     # the header's version for a body with tag holes


def _name_ok(name: str) -> bool:
    """A data file name as dcpx checks one: plain, inside the directory."""
    return (bool(name) and "/" not in name and "\\" not in name and "\0" not in name
            and name not in (".", ".."))


def _hash64(name: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little")


def _row_width(nd: int) -> int:
    """A chunk row: offsets, sizes, the running max of ends along dim 0,
    the position in the key's chunk list, file number + 1 (0: no storage
    entry), offset, length; all u64."""
    return 8 * (2 * nd + 5)


def _leaf_rows(width: int) -> int:
    return max(1, _LEAF_BYTES // width)


def _fixed_end(nkeys: int, ndtypes: int, nfiles: int, nbytes: int) -> int:
    """Where the fixed tables end (body offset): the tensor areas and the
    names follow."""
    nkf = -(-nkeys // _KEY_LEAF)
    return (_HEAD_LEN + _KEY_W * nkeys + _KFENCE_W * nkf + _DTYPE_W * ndtypes
            + _FILE_W * nfiles + _BYTES_W * nbytes)


class _Area(tuple):
    """Where the parts of a tensor key's area lie (body offsets), from its
    offset, dims and chunks alone (docs/format.md, "The load index"):

    * head: the tensor's size (nd x i64), the top fence (one entry per
      fence block: its first start, its CRC-32), the head's CRC-32;
    * fence blocks of up to 341 entries (one per leaf: its first start,
      its CRC-32), ``fstride`` bytes apart;
    * leaves of up to 4096 // row-width rows, ``stride`` bytes apart.

    A key of fewer than 8 leaves has them back to back after one fence
    block after its head.  A key of more starts its leaves at 4 KiB
    boundaries of the file, each padded to 4 KiB, and its fence blocks too
    when it has several; the builder places its area so that the head
    (and a single fence block with it) does not cross a boundary: a lookup
    reads one block of head and fence (two with several fence blocks) and
    one of rows."""

    __slots__ = ()

    def __new__(cls, area: int, nd: int, n: int) -> "_Area":
        w = _row_width(nd)
        per = _leaf_rows(w)
        nleaves = -(-n // per)
        nfb = max(1, -(-nleaves // _FENCE_BLOCK))
        head = 8 * nd + _FENCE_W * nfb + 4
        fence_at = area + head
        last_fb = nleaves - _FENCE_BLOCK * (nfb - 1)
        if nleaves < _ALIGN_LEAVES:
            fstride, stride = _FENCE_W * _FENCE_BLOCK, per * w
            rows_at = fence_at + _FENCE_W * nleaves
        else:
            fstride = stride = _BLOCK
            if nfb > 1:
                fence_at = _align(fence_at)
            rows_at = _align(fence_at + fstride * (nfb - 1) + _FENCE_W * last_fb)
        end = rows_at + stride * max(0, nleaves - 1) + w * (n - per * max(0, nleaves - 1))
        return tuple.__new__(cls, (head, fence_at, fstride, rows_at, stride, end, nleaves, nfb))


def _align(at: int) -> int:
    """The first body offset >= at that is a 4 KiB boundary of the file."""
    return at + (-(at + HEADER_LEN) % _BLOCK)


def _area_start(at: int, nd: int, n: int) -> int:
    """Where the builder puts a key's area at or after ``at``: a big key's
    head (and its fence block, when one) not across a 4 KiB boundary."""
    if n <= _SMALL:
        return at
    w = _row_width(nd)
    nleaves = -(-n // _leaf_rows(w))
    if nleaves < _ALIGN_LEAVES:
        return at
    head, _, _, _, _, _, _, nfb = _Area(at, nd, n)
    first = head + (_FENCE_W * nleaves if nfb == 1 else 0)
    if first <= _BLOCK and (at + HEADER_LEN) % _BLOCK + first > _BLOCK:
        return _align(at)
    return at


# --- building -----------------------------------------------------------------

class _Unrepresentable(Exception):
    pass


_OFFSETS = operator.attrgetter("offsets")
_SIZES = operator.attrgetter("sizes")
_REPEAT = itertools.repeat
_HAS_TD = "transform_descriptors" in {f.name for f in dataclasses.fields(_StorageInfo)}


def _column(objs: Any, attr: str) -> list:
    # one C-level pass per attribute (lists, not arrays: an array built
    # from an iterator costs 3x a list at scale)
    return list(map(operator.attrgetter(attr), objs))


class _Storage:
    """``storage_data`` as columns: per entry its key's fqn, offset and
    position hint (``MetadataIndex.index``), its file number, offset and
    length (entry -1: the sentinel of a chunk without an entry)."""

    def __init__(self, storage_data: dict, tag: Optional[str] = None) -> None:
        keys = list(storage_data)
        infos = list(storage_data.values())
        n = self.n = len(infos)
        if _HAS_TD and _column(infos, "transform_descriptors").count(None) != n:
            raise _Unrepresentable("a storage entry with transform descriptors")
        paths = _column(infos, "relative_path")
        names = dict.fromkeys(paths)
        for name in names:
            if type(name) is not str or not _name_ok(name) or _HOLE in name:
                raise _Unrepresentable(f"data file name {name!r}")
        self.files = list(names)
        if tag is not None:
            if len(tag) != 16 or not all(c in "0123456789abcdef" for c in tag):
                raise _Unrepresentable(f"a save tag {tag!r}")
            mark = f"_{tag}_"
            if not all(name.count(mark) == 1 for name in self.files):
                raise _Unrepresentable("a data file name without the save's tag")
        # file numbers from 1 (0: no storage entry, the sentinel at -1)
        number = dict(zip(self.files, range(1, len(self.files) + 1)))
        if tag is not None:
            self.files = [name.replace(mark, f"_{_HOLE}_") for name in self.files]
        self.file = list(map(number.__getitem__, paths))
        self.offset = _column(infos, "offset")
        self.length = _column(infos, "length")
        for col in (self.offset, self.length):
            # (types: the rows' arrays take ints only)
            if n and (min(col) < 0 or max(col) > _I64_MAX):
                raise _Unrepresentable("a storage offset or length")
        for col in (self.file, self.offset, self.length):
            col.append(0)
        self.fqns = _column(keys, "fqn")
        self.offs = _column(keys, "offset")
        self.hints = _column(keys, "index")
        # the entries of non-tensor values (offset None), by fqn (taken
        # out as their keys are found)
        self.values: dict = {}
        self.nvalues = self.offs.count(None)
        at = -1
        for _ in range(self.nvalues):
            at = self.offs.index(None, at + 1)
            self.values[self.fqns[at]] = at


def _fast_links(st: _Storage, tensors: list) -> Optional[dict]:
    """{fqn: the storage entry of each chunk} from the entries' position
    hints (``MetadataIndex.index``: a chunk's place in its key's list, as
    dcpx's and torch's planners set it), each link checked: the entry's
    fqn and offset are its chunk's (so it is the entry keyed (fqn,
    offsets), whatever its hint said), every chunk has one, no two share
    one.  None when any is missing or wrong (then _slow_links joins by
    (fqn, offsets))."""
    base: dict = {}
    total = 0
    for key in tensors:
        base[key.name_str] = total
        total += len(key.offs)
    if st.nvalues:
        sel = list(map(operator.is_not, st.offs, _REPEAT(None)))
        fqns = list(itertools.compress(st.fqns, sel))
        hints = list(itertools.compress(st.hints, sel))
        entries = list(itertools.compress(range(st.n), sel))
    else:
        fqns, hints, entries = st.fqns, st.hints, range(st.n)
    if len(fqns) != total:
        return None
    inv = [-1] * total
    try:
        gids = list(map(operator.add, map(base.__getitem__, fqns), hints))
        any(map(inv.__setitem__, gids, entries))
    except (KeyError, TypeError, IndexError):   # an entry of no tensor, no hint
        return None
    if inv.count(-1):
        return None          # two entries claimed one chunk: one has none
    links = {}
    offs = st.offs
    for key in tensors:
        b = base[key.name_str]
        n = len(key.offs)
        idx = inv[b:b + n]
        if (list(map(offs.__getitem__, idx)) != key.offs
                or list(map(st.fqns.__getitem__, idx)).count(key.name_str) != n):
            return None
        links[key.name_str] = idx
    return links


def _slow_links(st: _Storage, tensors: list) -> dict:
    """{fqn: the storage entry of each chunk (-1: none)}, joined by (fqn,
    offsets) as plan_reads looks a chunk's entry up."""
    entries = {(f, o): e for e, (f, o) in enumerate(zip(st.fqns, st.offs)) if o is not None}
    links = {}
    for key in tensors:
        n = len(key.offs)
        idx = list(map(entries.pop, zip(_REPEAT(key.name_str, n), key.offs), _REPEAT(-1, n)))
        if -1 in idx and len(set(key.offs)) != n:
            raise _Unrepresentable("two chunks at one offset")
        links[key.name_str] = idx
    if entries:
        raise _Unrepresentable("a storage entry that no chunk has")
    return links


class _Key:
    __slots__ = ("name_str", "name", "hash", "kind", "ndim", "dtype", "nchunks", "area", "file",
                 "offset", "length", "m", "offs", "szs")


def _chunk_rows(key: _Key, size: tuple, idx: list, st: _Storage) -> tuple:
    """(the rows of the key's chunks sorted by offsets[0] (stably), as
    bytes; their starts in that order).  Every field is a u64: an array
    of them refuses a negative value, or one that is not an int."""
    offs, szs = key.offs, key.szs
    n, nd = len(offs), len(size)
    if n and not set(map(len, offs)) | set(map(len, szs)) <= {nd}:
        raise _Unrepresentable("a chunk of another number of dimensions")
    flat_off = list(itertools.chain.from_iterable(offs))
    flat_sz = list(itertools.chain.from_iterable(szs))
    cols = [flat_off[d::nd] for d in range(nd)] + [flat_sz[d::nd] for d in range(nd)]
    for d in range(1, nd):
        # inside the tensor (dim 0: by its running max of ends, below);
        # a dim no chunk splits is the common case, counted in C
        if cols[d].count(0) != n or cols[nd + d].count(size[d]) != n:
            if max(map(operator.add, cols[d], cols[nd + d])) > size[d]:
                raise _Unrepresentable("a chunk outside its tensor")
    k = 2 * nd + 5
    pos = None
    if nd:
        ends = list(map(operator.add, cols[0], cols[nd]))
        if any(map(operator.gt, cols[0], itertools.islice(cols[0], 1, None))):
            pos = sorted(range(n), key=cols[0].__getitem__)
            cols = [list(map(c.__getitem__, pos)) for c in cols]
            ends = list(map(ends.__getitem__, pos))
            idx = list(map(idx.__getitem__, pos))
        if any(map(operator.gt, ends, itertools.islice(ends, 1, None))):
            ends = list(itertools.accumulate(ends, max))
        if n and ends[-1] > size[0]:
            raise _Unrepresentable("a chunk outside its tensor")
    else:
        ends = [0] * n
    cols += [ends, list(range(n)) if pos is None else pos,
             list(map(st.file.__getitem__, idx)), list(map(st.offset.__getitem__, idx)),
             list(map(st.length.__getitem__, idx))]
    rows = array("Q", bytes(8 * n * k))
    for j, c in enumerate(cols):
        rows[j::k] = array("Q", c)
    if sys.byteorder != "little":
        rows.byteswap()
    return rows.tobytes(), cols[0] if nd else ends


_SMALL = 16     # keys of at most this many chunks: packed row by row


def _small_area(key: _Key, size: tuple, idx: list, st: _Storage, ordinal: int) -> bytes:
    """_tensor_area's bytes for a key of few chunks (one leaf, back to
    back), without its column passes: a key of one chunk (DDP, a single
    process) costs a few struct calls instead of dozens of list passes."""
    nd = len(size)
    offs, szs = key.offs, key.szs
    n = len(offs)
    for o, z in zip(offs, szs):
        if len(o) != nd or len(z) != nd:
            raise _Unrepresentable("a chunk of another number of dimensions")
        for d in range(nd):
            if o[d] + z[d] > size[d]:
                raise _Unrepresentable("a chunk outside its tensor")
    order = sorted(range(n), key=lambda j: offs[j][0]) if nd > 0 and n > 1 else range(n)
    row = _unpacker(2 * nd + 5)
    rows = []
    top = 0
    for j in order:
        o, z, e = offs[j], szs[j], idx[j]
        if nd:
            top = max(top, o[0] + z[0])
        rows.append(row.pack(*o, *z, top, j, st.file[e], st.offset[e], st.length[e]))
    data = b"".join(rows)
    start = offs[order[0]][0] if n and nd else 0
    fence = _FENCE.pack(start, _crc32(data)) if n else b""
    head = struct.pack(f"<{nd}q", *size) + _FENCE.pack(start, _crc32(fence))
    return b"".join((head, _U32.pack(_crc32(head, ordinal)), fence, data))


def _tensor_area(key: _Key, idx: list, st: _Storage, ordinal: int, area: int) -> bytes:
    """The key's area at body offset ``area`` (_Area)."""
    size = tuple(key.m.size)
    nd = len(size)
    if nd > _MAX_DIMS:
        raise _Unrepresentable("more than 64 dimensions")
    if (any(type(s) is not int or not 0 <= s <= _I64_MAX for s in size)
            or math.prod(size) >= 1 << 64):
        raise _Unrepresentable("a tensor size")
    key.ndim = nd
    key.nchunks = len(key.offs)
    if key.nchunks <= min(_SMALL, _leaf_rows(_row_width(nd))):
        return _small_area(key, size, idx, st, ordinal)
    data, starts = _chunk_rows(key, size, idx, st)
    n = len(starts)
    head_len, fence_at, fstride, rows_at, stride, end, nleaves, nfb = _Area(area, nd, n)
    w = _row_width(nd)
    per = _leaf_rows(w)
    step = per * w
    mv = memoryview(data)
    fence = bytearray(_FENCE_W * nleaves)
    for leaf in range(nleaves):
        _FENCE.pack_into(fence, _FENCE_W * leaf, starts[leaf * per],
                         _crc32(mv[leaf * step:(leaf + 1) * step]))
    fv = memoryview(fence)
    fstep = _FENCE_W * _FENCE_BLOCK
    head = bytearray(struct.pack(f"<{nd}q", *size))
    for j in range(nfb):
        first = starts[j * _FENCE_BLOCK * per] if n else 0
        head += _FENCE.pack(first, _crc32(fv[j * fstep:(j + 1) * fstep]))
    head += _U32.pack(_crc32(head, ordinal))
    parts = [head]
    at = area + head_len
    for j in range(nfb):
        block_at = fence_at + fstride * j
        parts += (bytes(block_at - at), fv[j * fstep:(j + 1) * fstep])
        at = block_at + len(parts[-1])
    for leaf in range(nleaves):
        leaf_at = rows_at + stride * leaf
        parts += (bytes(leaf_at - at), mv[leaf * step:(leaf + 1) * step])
        at = leaf_at + len(parts[-1])
    assert at == end
    out = b"".join(parts)
    fv.release()
    mv.release()
    return out


def build_body(metadata: Any, tag: Optional[str] = None) -> Optional[bytes]:
    """The index body of ``metadata`` (a torch ``Metadata``), or None when
    it holds anything the index cannot represent exactly (a storage entry
    with transform descriptors, or whose key is not in
    ``state_dict_metadata``, or that no chunk has; a tensor of more than
    64 dimensions, of a dtype not torch's, with a chunk outside it or two
    chunks at one offset; a non-tensor value without exactly one storage
    entry; a value of another kind): the caller then writes no index."""
    try:
        return _build(metadata, tag)
    except (_Unrepresentable, TypeError, ValueError, OverflowError, AttributeError,
            struct.error):
        return None


def _build(metadata: Any, tag: Optional[str] = None) -> bytes:
    sdm = metadata.state_dict_metadata
    st = _Storage(metadata.storage_data, tag)
    if not all(map(sdm.__contains__, st.fqns)):
        raise _Unrepresentable("a storage entry of no key")
    keys: list = []
    tensors: list = []
    for fqn, m in sdm.items():
        if type(fqn) is not str:
            raise _Unrepresentable("a key that is not a str")
        key = _Key()
        key.name_str = fqn
        key.name = fqn.encode("utf-8")
        key.hash = _hash64(key.name)
        key.m = m
        key.ndim = key.nchunks = key.area = key.file = key.offset = key.length = key.dtype = 0
        if type(m) is TensorStorageMetadata:
            key.kind = _TENSOR
            key.offs = list(map(_OFFSETS, m.chunks))
            key.szs = list(map(_SIZES, m.chunks))
            tensors.append(key)
        elif type(m) is BytesStorageMetadata:
            key.kind = _BYTES
            e = st.values.pop(fqn, None)
            if e is None:
                raise _Unrepresentable("a non-tensor value without its storage entry")
            key.file, key.offset, key.length = st.file[e] - 1, st.offset[e], st.length[e]
        else:
            raise _Unrepresentable(f"a value of type {type(m).__name__}")
        keys.append(key)
    if st.values:
        raise _Unrepresentable("a storage entry without offset of a tensor")
    links = _fast_links(st, tensors)
    if links is None:
        links = _slow_links(st, tensors)
    keys.sort(key=lambda k: (k.hash, k.name))
    dtypes: dict = {}
    for key in keys:
        if key.kind == _TENSOR:
            name = _DTYPE_NAMES.get(getattr(key.m.properties, "dtype", None))
            if name is None:
                raise _Unrepresentable("a dtype not torch's")
            key.dtype = dtypes.setdefault(name, len(dtypes))
    if len(dtypes) > 0xFFFF or len(keys) >= 1 << 32 or len(st.files) >= 1 << 32:
        raise _Unrepresentable("too many keys, dtypes or files")
    nbytes = len(keys) - len(tensors)
    areas_at = _fixed_end(len(keys), len(dtypes), len(st.files), nbytes)
    areas: list = []
    at = areas_at
    for ordinal, key in enumerate(keys):
        if key.kind == _TENSOR:
            start = _area_start(at, len(key.m.size), len(key.offs))
            if start != at:
                areas.append(bytes(start - at))
            area = _tensor_area(key, links[key.name_str], st, ordinal, start)
            key.area = start
            areas.append(area)
            at = start + len(area)
    return _assemble(keys, list(dtypes), st.files, nbytes, areas, at - areas_at)


def _assemble(keys: list, dtypes: list, files: list, nbytes: int, areas: list,
              area_len: int) -> bytes:
    nkeys = len(keys)
    areas_at = _fixed_end(nkeys, len(dtypes), len(files), nbytes)
    heap_at = areas_at + area_len
    heap: list = []
    heap_len = 0
    key_rows = bytearray(_KEY_W * nkeys)
    byte_rows = bytearray()
    for i, key in enumerate(keys):
        name_off = heap_at + heap_len
        heap.append(key.name)
        heap_len += len(key.name)
        area = key.area if key.kind == _TENSOR else 0
        at = i * _KEY_W
        _KEY.pack_into(key_rows, at, key.hash, name_off, len(key.name), _crc32(key.name),
                       key.kind, key.ndim, key.dtype, key.nchunks, area, key.file,
                       key.offset, key.length)
        _U32.pack_into(key_rows, at + _KEY.size,
                       _crc32(memoryview(key_rows)[at:at + _KEY.size], i))
        if key.kind == _BYTES:
            byte_rows += _U32.pack(i) + _U32.pack(_crc32(_U32.pack(i), len(byte_rows) // _BYTES_W))
    kfence = bytearray()
    for leaf in range(-(-nkeys // _KEY_LEAF)):
        entry = _KFENCE.pack(keys[leaf * _KEY_LEAF].hash)
        kfence += entry + _U32.pack(_crc32(entry, leaf))
    dtype_rows = bytearray()
    for i, name in enumerate(dtypes):
        raw = name.encode("ascii").ljust(_DTYPE_NAME_LEN, b"\0")
        dtype_rows += raw + _U32.pack(_crc32(raw, i))
    file_rows = bytearray()
    for i, name in enumerate(files):
        raw = name.encode("utf-8")
        row = _FILE.pack(heap_at + heap_len, len(raw), _crc32(raw)) + _U32.pack(0)
        file_rows += row + _U32.pack(_crc32(row, i))
        heap.append(raw)
        heap_len += len(raw)
    head = _HEAD.pack(_BODY_MAGIC, nkeys, len(dtypes), len(files), nbytes, 0)
    return b"".join([head, _U32.pack(_crc32(head)), key_rows, kfence, dtype_rows, file_rows,
                     byte_rows] + areas + heap)


def header(body: bytes, md_crc: int, md_len: int, body_crc: Optional[int] = None,
           tag: Optional[str] = None) -> bytes:
    """The 64 bytes before ``body`` in the file: the index is for the
    ``.metadata`` whose trailer holds (md_crc, md_len).  ``body_crc``: the
    body's CRC-32 when the caller has it (a steady-state save reuses the
    body).  ``tag``: the save's tag, for a body built with one (its data
    file names have a hole where the tag goes)."""
    if len(body) < _HEAD_LEN:
        raise ValueError("dcpx: not a load index body")
    magic, nkeys, ndtypes, nfiles, nbytes, _ = _HEAD.unpack_from(body)
    (crc,) = _U32.unpack_from(body, _HEAD.size)
    if magic != _BODY_MAGIC or crc != _crc32(memoryview(body)[:_HEAD.size]):
        raise ValueError("dcpx: not a load index body")
    if body_crc is None:
        body_crc = _crc32(body)
    version, r0, r1 = _VERSION, 0, 0
    if tag is not None:
        version = _TAGGED
        r0, r1 = _II.unpack(bytes.fromhex(tag))
    hdr = _HDR.pack(_MAGIC, version, md_crc, md_len, len(body), body_crc, nkeys, ndtypes,
                    nfiles, nbytes, r0, r1)
    return hdr + _U32.pack(_crc32(hdr))


# --- reading ------------------------------------------------------------------

class LoadIndexCorrupt(ValueError):
    """The load index is damaged (or crafted) where a lookup read it: plan
    from ``.metadata`` instead."""


class _Blocks:
    """The file read with pread through a small cache of 4 KiB blocks,
    counting the bytes read."""

    __slots__ = ("fd", "size", "path", "cache", "bytes_read")

    _KEEP = 256     # blocks kept (1 MiB)

    def __init__(self, fd: int, size: int, path: str) -> None:
        self.fd = fd
        self.size = size
        self.path = path
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.bytes_read = HEADER_LEN + _MD_TRAILER.size   # read by open

    def read(self, off: int, n: int) -> bytes:
        if off < 0 or n < 0 or off + n > self.size:
            raise LoadIndexCorrupt(f"{self.path}: a read outside the file ({off}, {n})")
        if n == 0:
            return b""
        first, last = off // _BLOCK, (off + n - 1) // _BLOCK
        if first == last:
            b = self.cache.get(first)
            if b is None:
                b = self._blocks(first, first)[0]
            at = off - first * _BLOCK
            return b[at:at + n]
        data = b"".join(self._blocks(first, last))
        at = off - first * _BLOCK
        return data[at:at + n]

    def _blocks(self, first: int, last: int) -> list:
        cache = self.cache
        out = []
        b = first
        while b <= last:
            got = cache.get(b)
            if got is not None:
                cache.move_to_end(b)
                out.append(got)
                b += 1
                continue
            end = b
            while end < last and (end + 1) not in cache:
                end += 1
            start = b * _BLOCK
            want = min((end + 1) * _BLOCK, self.size) - start
            try:
                data = os.pread(self.fd, want, start)
            except OSError as e:
                raise LoadIndexCorrupt(f"{self.path}: cannot read: {e}") from None
            self.bytes_read += len(data)
            if len(data) != want:
                raise LoadIndexCorrupt(f"{self.path}: the file shrank")
            for i in range(b, end + 1):
                blk = data[(i - b) * _BLOCK:(i - b + 1) * _BLOCK]
                cache[i] = blk
                out.append(blk)
            while len(cache) > self._KEEP:
                cache.popitem(last=False)
            b = end + 1
        return out


def _open_regular(name: str, dir_fd: int) -> Optional[tuple]:
    """(fd, size) of the regular file ``name`` in ``dir_fd`` (no link
    followed, no FIFO waited on); None when it is not one."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _md_trailer(dir_fd: int) -> Optional[tuple]:
    """(crc, len) of ``.metadata``'s dcpx trailer; None without one.
    FileNotFoundError when there is no ``.metadata``."""
    got = _open_regular(METADATA_FN, dir_fd)
    if got is None:
        return None
    fd, size = got
    try:
        if size < _MD_TRAILER.size:
            return None
        tail = os.pread(fd, _MD_TRAILER.size, size - _MD_TRAILER.size)
    finally:
        os.close(fd)
    if len(tail) != _MD_TRAILER.size:
        return None
    magic, crc, n = _MD_TRAILER.unpack(tail)
    if magic != _MD_MAGIC or n != size - _MD_TRAILER.size:
        return None
    return crc, n


class LoadIndex:
    """An open load index (``LoadIndex.open``)."""

    def __init__(self, blocks: _Blocks, nkeys: int, ndtypes: int, nfiles: int,
                 nbytes: int, body_len: int) -> None:
        self._b = blocks
        self.path = blocks.path
        self.nkeys = nkeys
        self.ndtypes = ndtypes
        self.nfiles = nfiles
        self.nbytes = nbytes
        self.body_len = body_len
        self._keys_at = _HEAD_LEN
        self._nkf = -(-nkeys // _KEY_LEAF)
        self._kfence_at = self._keys_at + _KEY_W * nkeys
        self._dtypes_at = self._kfence_at + _KFENCE_W * self._nkf
        self._files_at = self._dtypes_at + _DTYPE_W * ndtypes
        self._bytes_at = self._files_at + _FILE_W * nfiles
        self._fixed_end = self._bytes_at + _BYTES_W * nbytes
        self._file_names: dict = {}
        self._tag: Optional[str] = None   # the save's tag, for the names' holes
        self._dtype_objs: dict = {}
        self._rows: dict = {}      # key rows checked

    # -- opening

    @classmethod
    def open(cls, directory: Any) -> Optional["LoadIndex"]:
        """The index in ``directory``, or None when there is none, it is not
        for the ``.metadata`` there (by that file's trailer; a ``.metadata``
        without one never matches) or its header is malformed.
        FileNotFoundError when the directory or its ``.metadata`` is
        missing."""
        dfd = os.open(os.fspath(directory), os.O_RDONLY | os.O_DIRECTORY
                      | getattr(os, "O_CLOEXEC", 0))
        try:
            try:
                got = _open_regular(INDEX_FN, dfd)
            except OSError:
                return None
            if got is None:
                return None
            fd, size = got
            keep = False
            try:
                path = os.path.join(os.fspath(directory), INDEX_FN)
                hdr = cls._header(fd, size)
                if hdr is None:
                    return None
                md_crc, md_len, body_len, nkeys, ndtypes, nfiles, nbytes, tag = hdr
                try:
                    trailer = _md_trailer(dfd)
                except FileNotFoundError:
                    raise
                except OSError:      # not a file dcpx reads: the load says why
                    return None
                if trailer != (md_crc, md_len):
                    return None
                keep = True
                ix = cls(_Blocks(fd, size, path), nkeys, ndtypes, nfiles, nbytes, body_len)
                ix._tag = tag
                return ix
            finally:
                if not keep:
                    os.close(fd)
        finally:
            os.close(dfd)

    @staticmethod
    def _header(fd: int, size: int) -> Optional[tuple]:
        if size < HEADER_LEN:
            return None
        try:
            raw = os.pread(fd, HEADER_LEN, 0)
        except OSError:
            return None
        if len(raw) != HEADER_LEN:
            return None
        (magic, version, md_crc, md_len, body_len, _body_crc, nkeys, ndtypes, nfiles, nbytes,
         r0, r1) = _HDR.unpack_from(raw)
        (crc,) = _U32.unpack_from(raw, _HDR.size)
        if (magic != _MAGIC or version not in (_VERSION, _TAGGED)
                or crc != _crc32(raw[:_HDR.size])
                or (version == _VERSION and (r0 or r1)) or body_len != size - HEADER_LEN
                or nbytes > nkeys or _fixed_end(nkeys, ndtypes, nfiles, nbytes) > body_len):
            return None
        tag = _II.pack(r0, r1).hex() if version == _TAGGED else None
        return md_crc, md_len, body_len, nkeys, ndtypes, nfiles, nbytes, tag

    def close(self) -> None:
        fd, self._b.fd = self._b.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> "LoadIndex":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        b = getattr(self, "_b", None)
        if b is not None and b.fd >= 0:
            self.close()

    @property
    def bytes_read(self) -> int:
        """Bytes read from the index file so far."""
        return self._b.bytes_read

    # -- checked reads

    def _bad(self, what: str) -> LoadIndexCorrupt:
        return LoadIndexCorrupt(f"{self.path}: load index corrupt: {what}")

    def _body(self, off: int, n: int) -> bytes:
        if off < 0 or n < 0 or off + n > self.body_len:
            raise self._bad(f"a reference outside the body ({off}, {n})")
        return self._b.read(HEADER_LEN + off, n)

    def _name(self, off: int, n: int, crc: int) -> bytes:
        raw = self._body(off, n)
        if _crc32(raw) != crc:
            raise self._bad("a name's CRC")
        return raw

    def _key_row(self, i: int) -> tuple:
        """Key row i, checked: (hash, name_off, name_len, name_crc, kind,
        ndim, dtype, nchunks, area_off, file, offset, length)."""
        row = self._rows.get(i)
        if row is not None:
            return row
        if not 0 <= i < self.nkeys:
            raise self._bad(f"key {i}")
        raw = self._body(self._keys_at + _KEY_W * i, _KEY_W)
        if _crc32(raw[:_KEY.size], i) != _U32.unpack_from(raw, _KEY.size)[0]:
            raise self._bad(f"key row {i}'s CRC")
        row = _KEY.unpack_from(raw)
        (_h, name_off, name_len, _nc, kind, nd, dtype, n, area, f, off, length) = row
        if name_off + name_len > self.body_len:
            raise self._bad(f"key row {i}'s name")
        if kind == _TENSOR:
            if nd > _MAX_DIMS or dtype >= self.ndtypes or area < self._fixed_end:
                raise self._bad(f"key row {i}")
            if _Area(area, nd, n)[5] > self.body_len:
                raise self._bad(f"key row {i}'s chunks")
        elif kind == _BYTES:
            if f >= self.nfiles or off > _I64_MAX or length > _I64_MAX:
                raise self._bad(f"key row {i}")
        else:
            raise self._bad(f"key row {i}'s kind")
        if len(self._rows) < 65536:
            self._rows[i] = row
        return row

    def _key_hash(self, leaf: int) -> int:
        raw = self._body(self._kfence_at + _KFENCE_W * leaf, _KFENCE_W)
        if _crc32(raw[:8], leaf) != _U32.unpack_from(raw, 8)[0]:
            raise self._bad(f"key fence entry {leaf}'s CRC")
        return _KFENCE.unpack_from(raw)[0]

    def _find(self, fqn: str) -> Optional[tuple]:
        """(ordinal, row) of key fqn; None when there is none."""
        name = fqn.encode("utf-8")
        h = _hash64(name)
        # the leaf whose first hash is the last one < h, then its rows
        lo, hi = 0, self._nkf
        while lo < hi:
            mid = (lo + hi) // 2
            if self._key_hash(mid) < h:
                lo = mid + 1
            else:
                hi = mid
        leaf = lo - 1
        if leaf < 0:
            i = 0
        else:
            lo = leaf * _KEY_LEAF
            hi = min(lo + _KEY_LEAF, self.nkeys)
            while lo < hi:
                mid = (lo + hi) // 2
                if self._key_row(mid)[0] < h:
                    lo = mid + 1
                else:
                    hi = mid
            i = lo
        while i < self.nkeys:
            row = self._key_row(i)
            if row[0] != h:
                return None
            if row[2] == len(name) and self._name(row[1], row[2], row[3]) == name:
                return i, row
            i += 1
        return None

    def _dtype(self, i: int) -> torch.dtype:
        d = self._dtype_objs.get(i)
        if d is None:
            raw = self._body(self._dtypes_at + _DTYPE_W * i, _DTYPE_W)
            if _crc32(raw[:_DTYPE_NAME_LEN], i) != _U32.unpack_from(raw, _DTYPE_NAME_LEN)[0]:
                raise self._bad(f"dtype {i}'s CRC")
            d = _DTYPES.get(raw[:_DTYPE_NAME_LEN].rstrip(b"\0").decode("ascii", "replace"))
            if d is None:
                raise self._bad(f"dtype {i}: not one of this torch's")
            self._dtype_objs[i] = d
        return d

    def _file(self, i: int) -> str:
        name = self._file_names.get(i)
        if name is None:
            if not 0 <= i < self.nfiles:
                raise self._bad(f"file {i}")
            raw = self._body(self._files_at + _FILE_W * i, _FILE_W)
            if _crc32(raw[:_FILE_W - 4], i) != _U32.unpack_from(raw, _FILE_W - 4)[0]:
                raise self._bad(f"file row {i}'s CRC")
            off, n, crc = _FILE.unpack_from(raw)
            try:
                name = self._name(off, n, crc).decode("utf-8")
            except UnicodeDecodeError:
                raise self._bad(f"file {i}'s name") from None
            if self._tag is not None:
                hole = f"_{_HOLE}_"
                if name.count(hole) != 1:
                    raise self._bad(f"data file name {name!r} (no place for the save's tag)")
                name = name.replace(hole, f"_{self._tag}_")
            if not _name_ok(name) or _HOLE in name:
                raise self._bad(f"data file name {name!r}")
            self._file_names[i] = name
        return name

    def _key_name(self, row: tuple) -> str:
        try:
            return self._name(row[1], row[2], row[3]).decode("utf-8")
        except UnicodeDecodeError:
            raise self._bad("a key's name") from None

    # -- lookups

    def key_count(self) -> int:
        return self.nkeys

    def keys(self) -> set:
        """Every key (reads the whole key table and the keys' names)."""
        return {self._key_name(self._key_row(i)) for i in range(self.nkeys)}

    def byte_info(self) -> dict:
        """fqn -> _StorageInfo of every non-tensor value."""
        out = {}
        for j in range(self.nbytes):
            raw = self._body(self._bytes_at + _BYTES_W * j, _BYTES_W)
            if _crc32(raw[:4], j) != _U32.unpack_from(raw, 4)[0]:
                raise self._bad(f"value {j}'s CRC")
            row = self._key_row(_U32.unpack_from(raw)[0])
            if row[4] != _BYTES:
                raise self._bad(f"value {j} is not one")
            out[self._key_name(row)] = _StorageInfo(self._file(row[9]), row[10], row[11])
        return out

    def region(self, fqn: str, region: Optional[tuple]) -> Any:
        """As ``_C.md_index_region(index, fqn, region, ChunkStorageMetadata,
        torch.Size, _StorageInfo)`` answers from ``.metadata``: None (no
        such key), () (a non-tensor value), or (dtype, size, chunks, infos)
        with the key's saved chunks that meet ``region`` ((offsets, sizes);
        None: none) in every dimension, in their order in ``.metadata``,
        each one's storage entry (None where it has none).  ValueError or
        TypeError for a malformed region; LoadIndexCorrupt when the index
        is found damaged."""
        if not isinstance(fqn, str):
            raise TypeError(f"region() argument 1 must be str, not {type(fqn).__name__}")
        got = self._find(fqn)
        if got is None:
            return None
        ordinal, row = got
        if row[4] == _BYTES:
            return ()
        nd = row[5]
        bounds = None if region is None else _region_bounds(region, nd)
        key = _Chunks(self, fqn, ordinal, nd, row[7], row[8])
        dtype = self._dtype(row[6])
        hits = [] if bounds is None else key.meeting(*bounds)
        hits.sort(key=operator.itemgetter(0))
        chunks, infos = [], []
        for _, off, sz, f, soff, slen in hits:
            chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(sz)))
            infos.append(None if f == 0 else _StorageInfo(self._file(f - 1), soff, slen))
        return dtype, torch.Size(key.size), chunks, infos


def _as_i64(v: Any) -> int:
    """PyLong_AsLongLong: an int (or __index__), OverflowError outside
    int64, TypeError for anything else."""
    i = operator.index(v)
    if not _I64_MIN <= i <= _I64_MAX:
        raise OverflowError("Python int too large to convert to C long long")
    return i


def _region_bounds(region: Any, nd: int) -> Optional[tuple]:
    """(lo, hi) per dimension as md_index_region reads a region; None when
    it has another number of dimensions (no chunk meets it)."""
    if not (isinstance(region, tuple) and len(region) == 2 and isinstance(region[0], tuple)
            and isinstance(region[1], tuple) and len(region[0]) == len(region[1])):
        raise ValueError("dcpx: md_index_region: region is (offsets, sizes), two tuples of "
                         "ints of one length")
    o, s = region
    if len(o) != nd:
        return None
    lo, hi = [], []
    for k in range(nd):
        a = _as_i64(o[k])
        b = _as_i64(s[k])
        lo.append(a)
        e = a + b
        hi.append(e if _I64_MIN <= e <= _I64_MAX else _I64_MAX)
    return lo, hi


_STRUCTS: dict = {}


def _unpacker(n: int) -> struct.Struct:
    s = _STRUCTS.get(n)
    if s is None:
        if len(_STRUCTS) > 4096:
            _STRUCTS.clear()
        s = _STRUCTS[n] = struct.Struct(f"<{n}Q")
    return s


class _Chunks:
    """One key's chunks: its head read and checked at once, its fence
    blocks and leaves of rows when a lookup needs them, each checked by
    the CRC-32 the level above holds; each row used checked against the
    tensor's size."""

    __slots__ = ("ix", "fqn", "nd", "n", "size", "k", "width", "per", "area", "top",
                 "fences", "leaves")

    def __init__(self, ix: LoadIndex, fqn: str, ordinal: int, nd: int, n: int,
                 area: int) -> None:
        self.ix, self.fqn, self.nd, self.n = ix, fqn, nd, n
        self.k = 2 * nd + 5
        self.width = 8 * self.k
        self.per = _leaf_rows(self.width)
        self.area = a = _Area(area, nd, n)
        raw = ix._body(area, a[0])
        if _crc32(raw[:-4], ordinal) != _U32.unpack_from(raw, a[0] - 4)[0]:
            raise ix._bad(f"key {fqn!r}: its head's CRC")
        self.size = struct.unpack_from(f"<{nd}q", raw)
        if any(s < 0 for s in self.size):
            raise ix._bad(f"key {fqn!r}: its size")
        self.top = [_FENCE.unpack_from(raw, 8 * nd + _FENCE_W * j) for j in range(a[7])]
        self.fences: dict = {}
        self.leaves: dict = {}

    def _fence(self, j: int) -> list:
        """Fence block j: [(first start, CRC-32) of each of its leaves]."""
        got = self.fences.get(j)
        if got is None:
            _, fence_at, fstride, _, _, _, nleaves, _ = self.area
            cnt = min(_FENCE_BLOCK, nleaves - _FENCE_BLOCK * j)
            raw = self.ix._body(fence_at + fstride * j, _FENCE_W * cnt)
            if _crc32(raw) != self.top[j][1]:
                raise self.ix._bad(f"key {self.fqn!r}: fence block {j}'s CRC")
            got = self.fences[j] = list(_FENCE.iter_unpack(raw))
        return got

    def _leaf(self, leaf: int) -> tuple:
        """The leaf's rows as one tuple of ints, k per row."""
        got = self.leaves.get(leaf)
        if got is None:
            crc = self._fence(leaf // _FENCE_BLOCK)[leaf % _FENCE_BLOCK][1]
            first = leaf * self.per
            cnt = min(self.per, self.n - first)
            raw = self.ix._body(self.area[3] + self.area[4] * leaf, self.width * cnt)
            if _crc32(raw) != crc:
                raise self.ix._bad(f"key {self.fqn!r}: chunk rows {first}-{first + cnt - 1}'s CRC")
            got = self.leaves[leaf] = _unpacker(self.k * cnt).unpack(raw)
        return got

    def _row(self, j: int) -> tuple:
        """Row j (sorted order), checked: (pos, offsets, sizes, file + 1,
        offset, length, maxend)."""
        leaf, r = divmod(j, self.per)
        vals = self._leaf(leaf)
        nd, k = self.nd, self.k
        a = r * k
        off = vals[a:a + nd]
        sz = vals[a + nd:a + 2 * nd]
        maxend, pos, f, soff, slen = vals[a + 2 * nd:a + k]
        for d in range(nd):
            if off[d] + sz[d] > self.size[d]:     # (u64s: none is negative)
                raise self.ix._bad(f"key {self.fqn!r}: a chunk outside the tensor")
        if pos >= self.n or f > self.ix.nfiles or soff > _I64_MAX or slen > _I64_MAX:
            raise self.ix._bad(f"key {self.fqn!r}: chunk row {j}")
        return pos, off, sz, f, soff, slen, maxend

    def meeting(self, lo: list, hi: list) -> list:
        """(pos, offsets, sizes, file + 1, offset, length) of every chunk
        that meets [lo, hi) in every dimension, in no particular order:
        the last row whose start is < hi[0] found by bisection (top fence,
        fence block, leaf), then the rows before it while their running
        max of ends is > lo[0]."""
        nd, n = self.nd, self.n
        if nd == 0:
            return [self._row(j)[:6] for j in range(n)]
        if n == 0:
            return []
        h0, l0 = hi[0], lo[0]
        j = bisect.bisect_left([t[0] for t in self.top], h0) - 1
        if j < 0:
            return []
        fence = self._fence(j)
        leaf = j * _FENCE_BLOCK + bisect.bisect_left([e[0] for e in fence], h0) - 1
        if leaf < 0:
            return []
        a = leaf * self.per
        b = min(a + self.per, n)
        while a < b:
            mid = (a + b) // 2
            if self._row(mid)[1][0] < h0:
                a = mid + 1
            else:
                b = mid
        out = []
        j = a - 1
        while j >= 0:
            row = self._row(j)
            if row[6] <= l0:
                break
            off, sz = row[1], row[2]
            for d in range(nd):
                if max(lo[d], off[d]) >= min(hi[d], off[d] + sz[d]):
                    break
            else:
                out.append(row[:6])
            j -= 1
        return out
