"""The many-chunks shape of ``.metadata`` (issue 21): a key saved as up to
``FUZZ_MAX_CHUNKS`` (default 2**17) chunks, laid out as rows, a grid, rows
in shuffled order, rows with repeats or overlaps, with a few perturbed
chunks, built from the fuzzer's bytes; and its check, with a time bound
per input.

Each input is decoded by the C index (``_metadata.index``, csrc/mdindex.c),
by the general path (``_metadata.loads``) and its chunks checked by
``_chunks.tiling`` (what convert, diff and load's planning run).  Findings:

* the whole of that takes longer than ``FUZZ_BASE_S`` (1.0) plus
  ``FUZZ_US_PER_CHUNK`` (250) microseconds per chunk: a quadratic step
  (40,000 chunks took 19 s in the C index before it was fixed, 485 us per
  chunk; the linear decode takes 10 to 80 us per chunk on a loaded 2-core
  machine);
* the C index accepts a file the general path refuses;
* any exception but ``CorruptCheckpointError`` from ``loads``.

Used by ``fuzz_metadata.py --many-chunks`` (atheris) and by
``tests/test_tools_hostile.py`` (a few seeds, without the time bound)."""
from __future__ import annotations

import os
import pickle
import random
import time

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from dcpx.formats import chunks as _chunks, metadata as _metadata
from dcpx.errors import CorruptCheckpointError

LAYOUTS = ("rows", "grid", "shuffled", "repeats", "overlaps")


class TooSlow(Exception):
    pass


def build(data: bytes, max_chunks: int = 0) -> tuple[bytes, int]:
    """(.metadata bytes, chunk count) of the many-chunks shape that ``data``
    picks."""
    max_chunks = max_chunks or int(os.environ.get("FUZZ_MAX_CHUNKS", 1 << 17))
    data = data + bytes(8 - min(len(data), 8))
    n = 1 + int.from_bytes(data[0:3], "little") % max_chunks
    ndim = 1 + data[3] % 3
    layout = LAYOUTS[data[4] % len(LAYOUTS)]
    extra = data[5] % 4
    rng = random.Random(data[6:])
    if layout == "grid" and ndim > 1:
        side = max(1, round(n ** (1 / 2)))
        shape = [side, max(1, n // side)] + [2] * (ndim - 2)
        boxes = [((r, c) + (0,) * (ndim - 2), (1, 1) + (2,) * (ndim - 2))
                 for r in range(shape[0]) for c in range(shape[1])]
    else:
        shape = [n] + [3] * (ndim - 1)
        rest = (0,) * (ndim - 1), tuple(shape[1:])
        boxes = [((i,) + rest[0], (1,) + rest[1]) for i in range(n)]
    if layout == "shuffled":
        rng.shuffle(boxes)
    elif layout == "repeats":
        boxes += [boxes[rng.randrange(len(boxes))] for _ in range(1 + n // 16)]
    elif layout == "overlaps":
        for _ in range(1 + n // 64):
            i = rng.randrange(len(boxes))
            off, sz = boxes[i]
            boxes[i] = (off, (min(sz[0] + 1, shape[0] - off[0]),) + sz[1:])
    for _ in range(rng.randrange(3)):  # a few perturbed chunks
        i = rng.randrange(len(boxes))
        off, sz = boxes[i]
        boxes[i] = ((off[0] + rng.choice((-1, 1, shape[0])),) + off[1:], sz)
    props = _metadata.properties(torch.float32, False, False)
    info = _StorageInfo("__0_0.distcp", 0, 4)
    sdm, storage = {}, {}
    chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes]
    sdm["w"] = TensorStorageMetadata(props, torch.Size(shape), chunks)
    for c in chunks:
        storage[MetadataIndex("w", c.offsets)] = info
    for k in range(extra):
        sdm[f"k{k}"] = TensorStorageMetadata(props, torch.Size([1]), [
            ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1]))])
        storage[MetadataIndex(f"k{k}", torch.Size([0]))] = info
    md = Metadata(state_dict_metadata=sdm, storage_data=storage)
    return pickle.dumps(md), len(chunks)


def check(raw: bytes, n: int, timed: bool = True) -> None:
    """Decode ``raw`` both ways and check its chunks; raise AssertionError
    (a finding) or TooSlow."""
    base = float(os.environ.get("FUZZ_BASE_S", "1.0"))
    per = float(os.environ.get("FUZZ_US_PER_CHUNK", "250")) * 1e-6
    t0 = time.perf_counter()
    found = _metadata.index(raw, "fuzz/.metadata")
    try:
        md = _metadata.loads(raw, "fuzz/.metadata")
    except CorruptCheckpointError as e:
        if found is not None:
            raise AssertionError(f"the C index accepted what loads refuses: {e}") from None
        md = None
    if md is not None:
        for v in md.state_dict_metadata.values():
            if isinstance(v, TensorStorageMetadata):
                _chunks.tiling(v.size, v.chunks)
    took = time.perf_counter() - t0
    if timed and took > base + per * n:
        raise TooSlow(f"{n} chunks took {took:.2f} s ({took / n * 1e6:.0f} us per chunk; "
                      f"bound {base} s + {per * 1e6:.0f} us per chunk)")
