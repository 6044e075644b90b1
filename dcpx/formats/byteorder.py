"""Byte order of torch.save archives written on a big-endian host.

Every archive has a ``byteorder`` record (``sys.byteorder`` of the host
that wrote it; none means little, as torch assumes).  ``torch.load``
byte-swaps each storage whose order differs from the host's
(``torch/serialization.py``, ``storage.byteswap(dtype)``), but only by
the storage's own dtype: a legacy typed storage (``FloatStorage``...) is
swapped per element, while an ``UntypedStorage`` (every dtype saved with
``_rebuild_tensor_v3``: uint16/32/64, float8, complex32, bits16...) is
swapped as uint8, that is not at all, and loads as byte-reversed values.

dcpx's C reader swaps every record by its tensor's element size (complex
per component) after checking its CRC (csrc/reader.c, ``archive_swaps``).
Where torch.load reads a record for dcpx (records the C reader leaves to
it, ``dcpx convert`` of a ``torch.save`` file, the tensors inside a
non-tensor value: ``swap_value``), ``swap_untyped`` finishes
what torch.load left undone, so that every path gives the values that were
saved (docs/format.md, "Byte order").
"""
from __future__ import annotations

import collections
import io
import os
import struct
import sys
import zipfile
from collections.abc import Mapping
from typing import Any, Iterable, Union

import torch


def archive_byteorder(source: Union[bytes, str, os.PathLike]) -> str:
    """'little' or 'big': what the archive's ``byteorder`` record says
    ('little' when it has none, as torch assumes); raises ValueError for
    any other content, as torch.load does.  The record is the one in the
    archive's folder, which torch's reader takes from the name of the
    first record (``archive/data.pkl`` -> ``archive/``): a ``byteorder``
    in another folder does not exist for torch.load."""
    f = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    with zipfile.ZipFile(f) as z:
        infos = z.infolist()
        if not infos:
            return "little"
        first = infos[0].filename
        if "/" not in first:
            raise ValueError(f"the archive's first record {first!r} is not in a folder "
                             f"(torch.load refuses it)")
        name = first[:first.index("/") + 1] + "byteorder"
        infos = [i for i in infos if i.filename == name]
        if not infos:
            return "little"
        data = _stored_bytes(z, infos[0])
    if data not in (b"little", b"big"):
        raise ValueError(f"Unknown endianness type: {data!r}")
    return data.decode()


def _stored_bytes(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """A small record's bytes, without the CRC check ``ZipFile.read`` makes:
    a record torch wrote with its CRC option off has CRC 0 (not checked
    here; what dcpx checks, it checks elsewhere)."""
    if info.compress_type != zipfile.ZIP_STORED or info.file_size > 64:
        return z.read(info)
    z.fp.seek(info.header_offset)
    head = z.fp.read(30)
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        raise ValueError(f"bad zip local header for {info.filename}")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    z.fp.seek(info.header_offset + 30 + name_len + extra_len)
    return z.fp.read(info.file_size)


def _untyped(dtype: torch.dtype) -> bool:
    """torch.save stores this dtype in an UntypedStorage (_rebuild_tensor_v3)."""
    return (dtype in torch.storage._new_dtypes()
            or dtype not in torch.storage._dtype_to_storage_type_map())


def tensors_within(obj: Any) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj``, an unpickled non-tensor value:
    through mappings (keys too), lists, tuples, sets, deques and the
    attributes of objects (an ``argparse.Namespace``); each object once."""
    out: list[torch.Tensor] = []
    seen: set = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (str, bytes, bytearray, int, float, complex, type(None))):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, Mapping):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(o)
        elif not isinstance(o, type):
            d = getattr(o, "__dict__", None)
            if isinstance(d, dict):
                stack.extend(d.values())
    return out


def swap_value(value: Any, data: bytes) -> Any:
    """``value``, unpickled by torch.load from the ``torch.save`` archive
    ``data`` (a checkpoint's non-tensor value), with the untyped storages
    of the tensors it holds swapped as a tensor item's are (torch.load
    swapped the typed ones)."""
    if sys.byteorder == "little" and b"big" not in data:
        return value   # no byteorder record says "big": nothing to swap
    order = archive_byteorder(data)
    if order != sys.byteorder:
        swap_untyped(tensors_within(value), order)
    return value


def swap_untyped(tensors: Iterable[torch.Tensor], byteorder: str) -> int:
    """Byte-swap, in place and once per storage (tied tensors share one),
    the storages of ``tensors`` that torch.load left in the writer's order:
    the multi-byte dtypes it stores untyped, when ``byteorder`` is not the
    host's.  Returns how many storages were swapped."""
    if byteorder == sys.byteorder:
        return 0
    done: set = set()
    for t in tensors:
        if t.element_size() <= 1 or not _untyped(t.dtype) or t.device.type != "cpu":
            continue
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in done or st.nbytes() == 0:
            continue
        done.add(key)
        st.byteswap(t.dtype)
    return len(done)
