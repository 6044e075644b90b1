"""torch DCP's stream transforms (``FileSystemWriter(_extensions=[...])``,
``FileSystemReader(_extension_registry=...)``): a record's bytes (a
``torch.save`` archive or a bytes item) are passed through the writer's
extensions in order, and ``_StorageInfo.transform_descriptors`` names them
outermost first (``"stream.zstd/1"``).  Loading undoes them through torch's
``ExtensionRegistry`` (its ZStandard by default, and whatever the user
registered), exactly as torch's ``FileSystemReader`` does.

dcpx's own addition, invisible to torch: when the outermost transform is
ZStandard, dcpx appends a zstd *skippable frame* (magic 0x184D2A5D, 8
bytes: ``b"DCPX"`` + the CRC-32 of every byte before it in the record) to
each record it writes.  Every zstd decoder skips it (torch's reader stops
at the end of the first frame), and dcpx checks it before decompressing:
the CRC covers what is on disk.  Records without it (written by torch) are
checked by what decompression and the archive's own zip CRC-32s catch.

This module does no rank coordination (it never imports dcpx.coordination.dist)."""
from __future__ import annotations

import io
import struct
from typing import Any, Optional, Sequence

from .. import _C
from ..errors import CorruptCheckpointError, UnsupportedFormatError

#: Undoing the transforms reads this much at a time (what is held beyond
#: the record's own bytes while it inflates).
_CHUNK = 1 << 20
#: A tensor record inflates to a ``torch.save`` archive of the chunk's
#: bytes plus its zip records and pickle: at most this many bytes more (and
#: 64 per dimension: the pickled shape and strides).
ARCHIVE_SLACK = 64 << 10
#: A value's record (no size in the metadata) may inflate to at most this
#: many times its stored bytes, and to this many bytes in any case; more is
#: refused as a decompression bomb unless the reader trusts the checkpoint
#: (``allow_pickle=True``).
VALUE_RATIO = 1024
VALUE_FLOOR = 64 << 20

_SKIP_MAGIC = 0x184D2A5D
_TRAILER = struct.pack("<II", _SKIP_MAGIC, 8) + b"DCPX"
TRAILER_LEN = len(_TRAILER) + 4
_ZSTD = "stream.zstd"


def default_registry() -> Any:
    from torch.distributed.checkpoint._extension import ExtensionRegistry
    return ExtensionRegistry()


def extensions_for(descriptors: Sequence[str], registry: Any, where: str) -> list:
    """The extensions that undo ``descriptors`` (outermost first), from
    ``registry``; UnsupportedFormatError saying what to do otherwise."""
    try:
        return list(registry.from_descriptor_list(list(descriptors)))
    except Exception as e:  # torch raises ValueError for unknown / unavailable ones
        hint = ("install zstandard or pyzstd" if any(str(d).startswith(_ZSTD) for d in descriptors)
                else "register its Extension class with an ExtensionRegistry and pass it "
                     "as FileSystemReader(path, _extension_registry=registry)")
        raise UnsupportedFormatError(
            f"dcpx: {where} is stored with stream transform(s) {list(descriptors)} that "
            f"cannot be undone here ({type(e).__name__}: {e}); the checkpoint is not "
            f"damaged: {hint}") from None


class InflatesTooFar(CorruptCheckpointError):
    """A transformed record inflates past the bytes it may hold (``limit``)."""

    def __init__(self, msg: str, limit: Optional[int] = None) -> None:
        super().__init__(msg)
        self.limit = limit


def tensor_limit(nbytes: int, ndim: int) -> int:
    """The most bytes a tensor chunk's record of ``nbytes`` bytes (the
    metadata's chunk size times its dtype's) may inflate to."""
    return int(nbytes) + ARCHIVE_SLACK + 64 * int(ndim)


def value_limit(stored: int) -> int:
    """The most bytes a value's record of ``stored`` bytes may inflate to."""
    return max(VALUE_FLOOR, int(stored) * VALUE_RATIO)


def decode(data: bytes, descriptors: Sequence[str], registry: Any, where: str,
           verify: bool = True, limit: Optional[int] = None, why: str = "") -> bytes:
    """A record's bytes as they were before the transforms.  dcpx's CRC
    trailer, when present, is checked first (``verify``).  Inflated in
    chunks of _CHUNK bytes, never more than ``limit`` bytes (None: no
    limit): a record that would inflate further raises InflatesTooFar
    (``why`` says where the limit comes from) having held at most
    ``limit`` + _CHUNK bytes of its output."""
    exts = extensions_for(descriptors, registry, where)
    if (verify and str(descriptors[0]).startswith(_ZSTD) and len(data) >= TRAILER_LEN
            and data[-TRAILER_LEN:-4] == _TRAILER):
        (want,) = struct.unpack("<I", data[-4:])
        got = _C.crc32(memoryview(data)[:-TRAILER_LEN])
        if got != want:
            raise CorruptCheckpointError(
                f"{where}: CRC-32 mismatch in the compressed record: recorded {want:08x}, "
                f"computed {got:08x}")
    stream: Any = io.BytesIO(data)
    from torch.distributed.checkpoint._extension import StreamTransformExtension
    for ex in exts:
        if isinstance(ex, StreamTransformExtension):
            stream = ex.transform_from(stream)
    # Parts joined once at the end (a growing buffer's reallocations can
    # hold two copies of it at once).
    parts: list = []
    held = 0
    try:
        while True:
            want = _CHUNK if limit is None else min(_CHUNK, limit + 1 - held)
            part = stream.read(want)
            if not part:
                break
            parts.append(part)
            held += len(part)
            if limit is not None and held > limit:
                raise InflatesTooFar(
                    f"{where}: the record ({len(data)} bytes stored) inflates past {limit} "
                    f"bytes{why}: refused (a decompression bomb, or a damaged record); "
                    f"stopped after {held} bytes", limit)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # the decompressor's own error (zstd: "corrupt frame", ...)
        raise CorruptCheckpointError(f"{where}: cannot undo stream transforms "
                                     f"{list(descriptors)}: {type(e).__name__}: {e}") from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _NoClose(io.RawIOBase):
    """torch's NoCloseWriter: a transform's close() must not close the
    buffer the record is collected in."""

    def __init__(self, raw: io.BytesIO) -> None:
        self.raw = raw

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.raw.write(b)

    def close(self) -> None:
        pass


def encode(data: Any, extensions: Sequence[Any]) -> tuple[bytes, list[str]]:
    """``data`` through ``extensions`` (the writer's, applied in order as
    torch's _StorageWriterTransforms does), plus dcpx's CRC trailer when
    the outermost is ZStandard.  Returns (record bytes, descriptors)."""
    buf = io.BytesIO()
    out: Any = _NoClose(buf)
    for ex in extensions:
        out = ex.transform_to(out)
    out.write(data)
    out.close()
    descriptors = [ex.get_descriptor() for ex in reversed(extensions)]
    raw = buf.getvalue()
    if descriptors and descriptors[0].startswith(_ZSTD):
        raw += _TRAILER + struct.pack("<I", _C.crc32(raw))
    return raw, descriptors


def check_extensions(extensions: Optional[Sequence[Any]]) -> list:
    """The writer's extensions, checked: each a StreamTransformExtension.
    torch's extension module is imported only when there are some: torch
    2.4 - 2.6 have none (torch.distributed.checkpoint._extension)."""
    exts = list(extensions or ())
    if not exts:
        return exts
    from torch.distributed.checkpoint._extension import StreamTransformExtension
    for ex in exts:
        if not isinstance(ex, StreamTransformExtension):
            raise TypeError(f"dcpx: _extensions must be StreamTransformExtension instances, "
                            f"got {type(ex).__name__}")
    return exts
