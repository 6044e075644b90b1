"""How the saved chunks of one tensor fill it.

A DCP ``.metadata`` lists each tensor's chunks (offsets, sizes) and nothing
checks that they tile the tensor: torch's load copies every saved chunk that
overlaps a destination, in its planner's order (the last copy wins where
chunks overlap), and leaves what no chunk covers as it was.

* ``tiling_problem`` is the check for where a whole tensor is assembled from
  its chunks into fresh memory (``FileSystemReader.read_key``: ``dcpx
  convert``, ``dcpx diff``): each element exactly once, or a message that
  says where not.  Near-linear in the number of chunks for the layouts
  saves make (row or column shards, grids); never more than one byte per
  element of the tensor for any layout.
* ``torch_order`` is the order in which torch's load applies the saved
  chunks of one key to one destination region
  (``planner_helpers.create_read_items_for_chunk_list``): by the end of each
  chunk along the "sweep" dimension, then by its place in the metadata.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple, Optional, Sequence

import torch


def _box(ch) -> tuple[tuple, tuple]:
    return tuple(map(int, ch.offsets)), tuple(map(int, ch.sizes))


class Box(NamedTuple):
    offsets: tuple
    sizes: tuple


class Tiling(NamedTuple):
    outside: Optional[str]   # a chunk outside the tensor (nothing else checked)
    overlap: Optional[str]   # two chunks that overlap (the first pair found)
    gap: Optional[str]       # elements no chunk holds (the first found)


def tiling_problem(size: Sequence[int], chunks: Sequence) -> Optional[str]:
    """None when ``chunks`` (objects with ``offsets`` and ``sizes``) cover a
    tensor of ``size`` with every element in exactly one chunk; else what is
    wrong (a chunk outside the tensor, two chunks that overlap, or elements
    no chunk holds), naming the chunks' offsets."""
    t = tiling(size, chunks)
    return t.outside or t.overlap or t.gap


def tiling(size: Sequence[int], chunks: Sequence) -> Tiling:
    """How ``chunks`` fill a tensor of ``size`` (see ``Tiling``)."""
    size = tuple(int(s) for s in size)
    nd = len(size)
    all_boxes = [_box(ch) for ch in chunks]
    for off, sz in all_boxes:
        if len(off) != nd or len(sz) != nd or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(off, sz, size)):
            return Tiling(f"the chunk at {off} of size {sz} lies outside the tensor's "
                          f"size {size}", None, None)
    numel = 1
    for s in size:
        numel *= s
    # Chunks holding no element neither overlap nor cover anything.
    boxes = [(i, off, sz) for i, (off, sz) in enumerate(all_boxes) if all(sz)]
    if numel == 0:
        return Tiling(None, None, None)
    if not boxes:
        return Tiling(None, None, f"no chunk holds any of its {numel} elements")
    if nd == 1:  # intervals: sorted, each must start where the last ended
        spans1 = sorted((off[0], off[0] + sz[0], i) for i, off, sz in boxes)
        overlap = gap = None
        end, last = 0, -1
        for lo, hi, i in spans1:
            if lo < end and overlap is None:
                overlap = _overlap(all_boxes, last, i)
            elif lo > end and gap is None:
                gap = _gap_at([[end]], (0,))
            if hi > end:
                end, last = hi, i
        if end < size[0] and gap is None:
            gap = _gap_at([[end]], (0,))
        return Tiling(None, overlap, gap)
    # The grid of the chunks' boundaries along every dimension: each chunk
    # is a block of its cells, and each cell holds at least one element.
    cuts = []
    for d in range(nd):
        c = {0, size[d]}
        for _, off, sz in boxes:
            c.add(off[d])
            c.add(off[d] + sz[d])
        cuts.append(sorted(c))
    cells = 1
    for c in cuts:
        cells *= len(c) - 1
    spans = []
    for i, off, sz in boxes:
        spans.append((i, tuple((bisect.bisect_left(cuts[d], off[d]),
                                bisect.bisect_left(cuts[d], off[d] + sz[d])) for d in range(nd))))
    overlap = None
    if all(hi - lo == 1 for _, sp in spans for lo, hi in sp):
        # The common case (row / column shards, grids): one cell per chunk.
        seen: dict = {}
        for i, sp in spans:
            cell = tuple(lo for lo, _ in sp)
            if cell in seen:
                overlap = overlap or _overlap(all_boxes, seen[cell], i)
            else:
                seen[cell] = i
        gap = None if len(seen) == cells else _gap(cuts, seen)
        return Tiling(None, overlap, gap)
    grid = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.bool)
    for i, sp in spans:
        block = grid[tuple(slice(lo, hi) for lo, hi in sp)]
        if overlap is None and bool(block.any()):
            j = next(j for j, _ in spans if j != i and _meet(all_boxes, i, j))
            overlap = _overlap(all_boxes, j, i)
        block.fill_(True)
    gap = None
    if not bool(grid.all()):
        gap = _gap_at(cuts, tuple(int(x) for x in (~grid).nonzero()[0]))
    return Tiling(None, overlap, gap)


def _meet(boxes: list, i: int, j: int) -> bool:
    (a, n), (b, m) = boxes[i], boxes[j]
    return all(x < y + q and y < x + p for x, p, y, q in zip(a, n, b, m))


def _overlap(boxes: list, i: int, j: int) -> str:
    (a, n), (b, m) = boxes[i], boxes[j]
    return f"its chunks at {a} (size {n}) and at {b} (size {m}) overlap"


def _gap(cuts: list, seen: dict) -> str:
    import itertools
    for cell in itertools.product(*(range(len(c) - 1) for c in cuts)):
        if cell not in seen:
            return _gap_at(cuts, cell)
    return "its chunks do not cover it"  # not reached

def _gap_at(cuts: list, cell: tuple) -> str:
    at = tuple(cuts[d][k] for d, k in enumerate(cell))
    return f"no chunk holds its elements at {at} (the chunks do not cover it)"


def torch_order(fqn: str, md, local: tuple, picked: Sequence[int]) -> list[int]:
    """``picked`` (positions in ``md.chunks``, the key's saved chunks that
    meet the region ``local`` = (offsets, sizes)) in the order the installed
    torch's load copies them into that region: asked of torch's own planner
    helper, whose order changed in torch 2.11 (a sweep along one dimension;
    before, the metadata's order)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
    region = ChunkStorageMetadata(offsets=torch.Size(local[0]), sizes=torch.Size(local[1]))
    slots: dict = {}
    for i in sorted(picked):
        slots.setdefault(tuple(md.chunks[i].offsets), []).append(i)
    out = []
    for item in create_read_items_for_chunk_list(fqn, md, [region]):
        q = slots.get(tuple(item.storage_index.offset))
        if q:
            out.append(q.pop(0))
    return out + sorted(i for q in slots.values() for i in q)  # none left, as torch reads all
