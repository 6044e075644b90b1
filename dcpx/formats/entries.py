"""Which on-disk format each storage entry of a checkpoint uses, and the
entries as the readers read them.  One module per format:

* TORCH_SAVE records (a ``torch.save`` zip per item): csrc/reader.c,
  ``formats.files.check_zip_crcs``;
* SAFETENSORS data files: ``dcpx.formats.safetensors``;
* stream transforms (``_extensions``, ZStandard): ``dcpx.formats.transforms``.

``resolve`` maps a checkpoint's metadata to the storage entries the readers
use: a safetensors tensor entry (torch records the blob's start and the
byte count) becomes a ``RawInfo`` of the tensor's own bytes, after its
header is checked against the metadata; every other entry is kept.  None
of this imports rank coordination (dcpx.coordination.dist)."""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Sequence

from torch.distributed.checkpoint.metadata import Metadata

from . import safetensors as st
from .files import open_regular
from ..errors import CorruptCheckpointError

_EOCD = b"PK\x05\x06"


def plain_zip_files(directory: Path, names: Sequence[str], sizes: Sequence[int]) -> bool:
    """Whether every data file (``names[i]``, of ``sizes[i]`` bytes, found
    regular by lstat) ends with a zip end-of-central-directory record (no
    comment), as every TORCH_SAVE data file does: its last item is a
    ``torch.save`` archive.  A SAFETENSORS file ends with tensor bytes or
    its header, a transformed one with a compressed stream.  False when a
    file cannot be read (the caller's general path says why).  One open and
    one 22-byte read per file, no link followed, never blocking on a FIFO."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for name, size in zip(names, sizes):
        if size < 22:
            return False
        try:
            fd = os.open(directory / name, flags)
        except OSError:
            return False
        try:
            tail = os.pread(fd, 22, size - 22)
        except OSError:
            return False
        finally:
            os.close(fd)
        if len(tail) != 22 or tail[:4] != _EOCD or tail[20:22] != b"\0\0":
            return False
    return True


def resolve(directory: Path, metadata: Metadata) -> Metadata:
    """``metadata`` with its SAFETENSORS tensor entries resolved to the
    tensors' own bytes (a shallow copy), or ``metadata`` itself when it has
    none.  The entries must have passed the reader's storage checks (file
    names, extents).  Raises CorruptCheckpointError naming the file and key
    for a header that is malformed or disagrees with the metadata."""
    cands = st.candidates(metadata)
    if not cands:
        return metadata
    blobs = {}
    budget = st.header_budget(metadata, len(cands))  # headers longer: refused unread
    for rel, off in sorted(cands):
        path = directory / rel
        fd = open_regular(path)
        try:
            head = os.pread(fd, 9, off)
        finally:
            os.close(fd)
        if st.looks_like_blob(head):
            blob = blobs[(rel, off)] = st.read_blob(path, off, budget)
            budget -= blob.header_len
        # else: a TORCH_SAVE record; the C reader says what is wrong with it
    if not blobs:
        return metadata
    sdm = metadata.state_dict_metadata
    storage = dict(metadata.storage_data)
    sharding = {k: st.sharding_info(b) for k, b in blobs.items()}
    by_key: dict = {}
    for index, info in metadata.storage_data.items():
        if index.offset is None:
            continue
        where = (getattr(info, "relative_path", None), getattr(info, "offset", None))
        blob = blobs.get(where)
        if blob is None:
            continue
        chunk = st.chunk_at(sdm, by_key, index.fqn, index.offset)
        if chunk is None:
            raise CorruptCheckpointError(
                f"{blob.path}: key {index.fqn!r}: the metadata has no tensor chunk at "
                f"{tuple(index.offset)} for this safetensors entry")
        storage[index] = st.resolve_entry(blob, index, info, sdm[index.fqn].properties.dtype,
                                          tuple(chunk.sizes), sharding[where])
    out = copy.copy(metadata)
    out.storage_data = storage
    return out
