"""DCP's SAFETENSORS serialization format (torch's
``FileSystemWriter(..., serialization_format=SerializationFormat.SAFETENSORS)``),
read and written as torch 2.13's ``filesystem.py`` lays it out:

* a data file holds its bytes items first (``torch.save`` bytes, as in the
  TORCH_SAVE format), then one safetensors blob: an 8-byte little-endian
  header length, a JSON header (padded with spaces to a multiple of 8),
  then every tensor's bytes, packed, in the header's ``data_offsets``;
* the header's ``__metadata__`` holds ``DCP_SHARDING_INFO`` (JSON: each
  key's ``saved_offsets``, its chunk's offsets), ``DCP_VERSION`` and
  ``format: pt``;
* ``.metadata`` is torch's usual pickle; each tensor's ``_StorageInfo`` has
  the blob's start as ``offset`` and its byte count as ``length`` (torch's
  ``_write_item``), so several tensors share one offset.

Safetensors has no checksum: what a load checks instead is listed in
docs/format.md ("SAFETENSORS data files").  This module does no rank
coordination (it never imports dcpx.coordination.dist)."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from .files import open_regular
from ..errors import CorruptCheckpointError

#: safetensors dtype names, in the order of safetensors' ``Dtype`` enum
#: (its writer lays tensors out by this order, descending, then by name).
_ORDER = ["BOOL", "F4", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
          "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64",
          "I64", "U64"]
_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "I16": "int16",
    "U16": "uint16", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32",
    "F32": "float32", "C64": "complex64", "F64": "float64", "I64": "int64", "U64": "uint64",
}
#: safetensors dtype name <-> torch dtype (those this torch has)
DTYPES = {k: getattr(torch, v) for k, v in _NAMES.items() if hasattr(torch, v)}
_TO_NAME = {v: k for k, v in DTYPES.items()}
_RANK = {k: i for i, k in enumerate(_ORDER)}

#: torch's keys in the header's __metadata__ (torch/distributed/checkpoint/_hf_utils.py)
SHARDING_KEY = "DCP_SHARDING_INFO"
VERSION_KEY = "DCP_VERSION"
#: safetensors refuses headers larger than this (100 MB); so does dcpx
MAX_HEADER = 100_000_000
#: A checkpoint's headers may hold, per tensor chunk its metadata declares,
#: at most this many bytes, plus _PER_KEY_BYTE per byte of the key (UTF-8)
#: and _PER_DIM per dimension (torch's and dcpx's writers need about half:
#: the key and its chunk's shape in the entry, again JSON-escaped twice in
#: DCP_SHARDING_INFO), plus HEADER_SLACK per header (``__metadata__``,
#: padding).  A longer header is refused before it is read (``header_budget``).
_PER_CHUNK = 256
_PER_KEY_BYTE = 16
_PER_DIM = 64
HEADER_SLACK = 64 << 10


@dataclass
class RawInfo(_StorageInfo):
    """A tensor chunk's bytes themselves, at [offset, offset + length) of
    its data file (resolved from a safetensors header); read as they are,
    with no record around them (csrc/reader.c, storage type "")."""


def is_raw(info: Any) -> bool:
    return isinstance(info, RawInfo)


def name_of(dtype: torch.dtype, key: str) -> str:
    """The safetensors dtype name of ``dtype``, or a TypeError naming key."""
    name = _TO_NAME.get(dtype)
    if name is None:
        raise TypeError(f"dcpx: cannot save {key!r} in the SAFETENSORS format: safetensors "
                        f"has no dtype for {dtype} (save it with SerializationFormat.TORCH_SAVE)")
    return name


# ------------------------------------------------------------------ writing

def header(tensors: Sequence[tuple[str, torch.dtype, tuple, tuple]]) -> tuple[bytes, dict]:
    """The blob's head (length + JSON header, padded) for ``tensors``:
    ``(fqn, dtype, shape, chunk offsets)`` each, laid out as safetensors
    lays them out (dtype descending, then name).  Returns (head bytes,
    {fqn: (begin, end) within the data}), begin/end relative to the data."""
    order = sorted(tensors, key=lambda t: (-_RANK[name_of(t[1], t[0])], t[0]))
    sharding = {fqn: {"saved_offsets": list(off)} for fqn, _, _, off in tensors}
    hdr: dict = {"__metadata__": {
        SHARDING_KEY: json.dumps(sharding),   # torch: json.dumps(metadata_dict)
        VERSION_KEY: "1.0",                    # str(HF_DCP_VERSION)
        "format": "pt",
    }}
    spans, pos = {}, 0
    for fqn, dtype, shape, _ in order:
        n = dtype.itemsize
        for d in shape:
            n *= d
        spans[fqn] = (pos, pos + n)
        hdr[fqn] = {"dtype": name_of(dtype, fqn), "shape": list(shape),
                    "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(hdr, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, spans


def file_items(entries: Sequence[Any]) -> tuple[list, list]:
    """One data file's C-writer payloads in the SAFETENSORS layout, from its
    entries (dcpx.storage.pending._Entry; a tensor's ``meta`` is (dtype, shape)):
    the bytes items, the blob's head, then each tensor's bytes as a raw item
    (storage type "", packed, no record: csrc/writer.c).  Returns
    (payloads, places): places[i] says where entry i's storage info points:
    ("item", payload index) or ("blob", head payload index, data length)."""
    byte_ents = [(i, e) for i, e in enumerate(entries) if e.meta is None]
    tens = [(i, e) for i, e in enumerate(entries) if e.meta is not None]
    payloads, places = [], [None] * len(entries)
    for i, e in byte_ents:
        places[i] = ("item", len(payloads))
        payloads.append(e.payload)
    head, spans = header([(e.index.fqn, e.meta[0], tuple(e.meta[1]), tuple(e.index.offset))
                          for _, e in tens])
    hi = len(payloads)
    payloads.append(head)
    by_fqn = {e.index.fqn: (i, e) for i, e in tens}
    if len(by_fqn) != len(tens):
        raise ValueError("dcpx: the SAFETENSORS format holds one chunk per key in a data "
                         "file; a plan put two chunks of one key in one file")
    for fqn in sorted(spans, key=lambda f: spans[f][0]):
        i, e = by_fqn[fqn]
        places[i] = ("blob", hi, e.nbytes)
        payloads.append((e.payload[0], ""))
    return payloads, places


def storage_infos(name: str, layout: Sequence[tuple[int, int]], places: list) -> list:
    """Each entry's _StorageInfo, from the file's layout (the C writer's
    (offset, length) per payload) and ``file_items``' places: a tensor's is
    (blob start, its byte count), as torch writes it."""
    out = []
    for kind, p, *n in places:
        off, length = layout[p]
        out.append(_StorageInfo(name, off, length if kind == "item" else n[0]))
    return out


# ------------------------------------------------------------------ reading

def chunk_at(sdm: dict, by_key: dict, fqn: str, offsets) -> Optional[object]:
    """The chunk of tensor ``fqn`` starting at ``offsets`` (the first, when
    the metadata repeats one), or None; ``by_key`` caches each key's
    offsets-to-chunk map, so that a key's many chunks are looked up in
    constant time each (issue 21: nothing quadratic in a key's chunks)."""
    chunks = by_key.get(fqn)
    if chunks is None:
        chunks = by_key[fqn] = {}
        md = sdm.get(fqn)
        if isinstance(md, TensorStorageMetadata):
            for ch in md.chunks:
                chunks.setdefault(tuple(ch.offsets), ch)
    return chunks.get(tuple(offsets))


def candidates(metadata: Metadata) -> set:
    """The (file, offset) pairs that may start a safetensors blob: where a
    tensor entry's length is exactly its chunk's byte count (a TORCH_SAVE
    record is always longer: its zip records surround the bytes), or where
    two tensor entries start.  Nothing is read."""
    sdm = metadata.state_dict_metadata
    seen, out, by_key = set(), set(), {}
    for index, info in metadata.storage_data.items():
        if (index.offset is None or not isinstance(info, _StorageInfo)
                or getattr(info, "transform_descriptors", None)):
            continue
        where = (info.relative_path, info.offset)
        if where in seen:
            out.add(where)
            continue
        seen.add(where)
        ch = chunk_at(sdm, by_key, index.fqn, index.offset)
        if ch is not None and info.length == (ch.sizes.numel()
                                              * sdm[index.fqn].properties.dtype.itemsize):
            out.add(where)
    return out


def header_budget(metadata: Metadata, headers: int) -> int:
    """The most bytes the safetensors headers of ``metadata``'s checkpoint
    may hold together, ``headers`` of them at most: what its tensor chunks
    need (_PER_CHUNK, _PER_KEY_BYTE, _PER_DIM) plus HEADER_SLACK each.  A
    header padded or stuffed with entries past this would cost memory (and
    a URL load local space) out of proportion to the checkpoint; nothing
    is read."""
    total = HEADER_SLACK * int(headers)
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            key = len(str(fqn).encode("utf-8", "surrogatepass"))
            total += len(md.chunks) * (_PER_CHUNK + _PER_KEY_BYTE * key
                                       + _PER_DIM * len(md.size))
    return total


def looks_like_blob(head: bytes) -> bool:
    """Whether 9 bytes read at an entry's offset start a safetensors blob
    (a header length below 4 GiB, then '{'), not a zip record ('PK\\3\\4',
    then torch's version and flags, never four zero bytes)."""
    return len(head) >= 9 and head[4:8] == b"\0\0\0\0" and head[8:9] == b"{"


class Blob:
    """One safetensors blob's parsed and checked header."""

    def __init__(self, path: Path, offset: int, entries: dict, meta: dict, data_start: int):
        self.path, self.offset = path, offset
        self.header_len = data_start - offset - 8  # the JSON's bytes
        self.entries = entries          # key -> (dtype name, shape, begin, end)
        self.meta = meta
        self.data_start = data_start    # file offset of data_offsets' 0


def _pread(fd: int, n: int, off: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = os.pread(fd, n - got, off + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_blob(path: Path, offset: int, limit: Optional[int] = None) -> Blob:
    """Parse and check the safetensors header at ``offset`` of ``path``
    (refused unread when longer than ``limit``, what header_budget leaves):
    the length lies inside the file, the header is a JSON object, every
    tensor's dtype is known, its shape is a list of non-negative ints, its
    data_offsets [begin, end] lie inside the data and hold exactly
    numel * itemsize bytes, and no two tensors' bytes overlap.  Raises
    CorruptCheckpointError naming the file (and the key)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        head = _pread(fd, 8, offset)
        if len(head) < 8:
            raise CorruptCheckpointError(
                f"{path}: safetensors header at offset {offset}: the file ends before its "
                f"length (truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or n > size - offset - 8:
            raise CorruptCheckpointError(
                f"{path}: safetensors header at offset {offset} says it is {n} bytes long; "
                f"the file has {size - offset - 8} after it (truncated or corrupt)")
        if limit is not None and n > limit:
            raise CorruptCheckpointError(
                f"{path}: safetensors header at offset {offset} says it is {n} bytes long; "
                f"the checkpoint's metadata leaves its headers {max(limit, 0)} bytes (per tensor "
                f"chunk {_PER_CHUNK} + {_PER_KEY_BYTE} per byte of its key + {_PER_DIM} per "
                f"dimension, {HEADER_SLACK} per header): refused before reading it (padded "
                f"or forged)")
        text = _pread(fd, n, offset + 8)
    finally:
        os.close(fd)
    try:
        hdr = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:   # too deep: RecursionError
        raise CorruptCheckpointError(f"{path}: safetensors header at offset {offset} is not "
                                     f"valid JSON: {e}") from None
    if not isinstance(hdr, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header at offset {offset} is not "
                                     f"a JSON object")
    meta = hdr.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(f"{path}: safetensors header at offset {offset}: "
                                     f"__metadata__ is not a map of strings")
    data_start = offset + 8 + n
    data_len = size - data_start
    entries = {}
    for key, e in hdr.items():
        where = f"{path}: safetensors header at offset {offset}: key {key!r}"
        if not isinstance(e, dict):
            raise CorruptCheckpointError(f"{where}: entry is not a JSON object")
        dt, shape, span = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dt not in DTYPES:
            raise CorruptCheckpointError(f"{where}: unknown dtype {dt!r}")
        if (not isinstance(shape, list)
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise CorruptCheckpointError(f"{where}: bad shape {shape!r}")
        if (not isinstance(span, list) or len(span) != 2
                or not all(type(x) is int for x in span)
                or not 0 <= span[0] <= span[1] <= data_len):
            raise CorruptCheckpointError(
                f"{where}: data_offsets {span!r} lie outside the {data_len} data bytes "
                f"(truncated or corrupt)")
        numel = 1
        for d in shape:
            numel *= d
        if span[1] - span[0] != numel * DTYPES[dt].itemsize:
            raise CorruptCheckpointError(
                f"{where}: data_offsets {span!r} hold {span[1] - span[0]} bytes; {dt} "
                f"{shape} needs {numel * DTYPES[dt].itemsize}")
        entries[key] = (dt, tuple(shape), span[0], span[1])
    last_end, last_key = 0, None
    for key, (_, _, b, e) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if b < last_end and e > b:
            raise CorruptCheckpointError(
                f"{path}: safetensors header at offset {offset}: the bytes of key {key!r} "
                f"overlap those of {last_key!r}")
        if e > last_end:
            last_end, last_key = e, key
    return Blob(path, offset, entries, meta, data_start)


def resolve_entry(blob: Blob, index: MetadataIndex, info: _StorageInfo,
                  dtype: torch.dtype, sizes: tuple, sharding: Optional[dict]) -> RawInfo:
    """The RawInfo of a tensor chunk in ``blob``, after checking that the
    header agrees with ``.metadata``: the key is there, with its dtype, its
    chunk's shape, its byte count (``info.length``) and, when the header
    records them, its chunk's offsets."""
    key = index.fqn
    where = f"{blob.path}: key {key!r}"
    got = blob.entries.get(key)
    if got is None:
        raise CorruptCheckpointError(f"{where}: not in the safetensors header at offset "
                                     f"{blob.offset}, which the metadata points at")
    dt, shape, b, e = got
    if DTYPES[dt] != dtype:
        raise CorruptCheckpointError(f"{where}: safetensors header says {dt}, the metadata "
                                     f"{dtype}")
    if shape != tuple(sizes):
        raise CorruptCheckpointError(f"{where}: safetensors header says shape {list(shape)}, "
                                     f"the metadata {list(sizes)}")
    if e - b != info.length:
        raise CorruptCheckpointError(f"{where}: the metadata says {info.length} bytes, the "
                                     f"safetensors header {e - b}")
    if sharding is not None:
        saved = sharding.get(key, {}).get("saved_offsets") if isinstance(
            sharding.get(key), dict) else None
        if saved is not None and not (isinstance(saved, list)
                                      and all(type(x) is int for x in saved)):
            raise CorruptCheckpointError(
                f"{where}: {SHARDING_KEY} in the safetensors header at offset {blob.offset} "
                f"gives saved_offsets {str(saved)[:80]}, not a list of integers")
        if saved is not None and saved != list(index.offset):
            raise CorruptCheckpointError(
                f"{where}: safetensors header says the chunk starts at {list(saved)}, the "
                f"metadata {list(index.offset)}")
    return RawInfo(info.relative_path, blob.data_start + b, e - b)


def sharding_info(blob: Blob) -> Optional[dict]:
    raw = blob.meta.get(SHARDING_KEY)
    if raw is None:
        return None
    try:
        got = json.loads(raw)
    except (ValueError, RecursionError):   # nested too deep: RecursionError
        got = None
    if not isinstance(got, dict):
        raise CorruptCheckpointError(f"{blob.path}: safetensors header at offset "
                                     f"{blob.offset}: {SHARDING_KEY} is not a JSON object")
    return got
