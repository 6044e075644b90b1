"""Save planning: one planner for one process and for several ranks.

Which values dcpx plans itself, and by which rule (``plannable``); one pass
over a flat state dict that turns each value into its payload for the C
writer and records what the plan depends on (``scan``); the items a rank
can write (``local_items``); the global plan that dedups and balances the
ranks' items and builds the tensor metadata (``global_plan``).  A save in
one process is the one-rank case of the same planner (``plan_local_save``),
and its plan is reused by the next save of the same layout (see "Plan
reuse" in docs/design.md).

The plan of a save depends only on:

* the writer's file configuration (``single_file_per_rank``, ``thread_count``);
* the keys, in order;
* per tensor: dtype, shape, ``requires_grad``, whether it is pinned (only
  looked at when CUDA is available), and for a DTensor its chunk's offsets
  and sizes.

Not on the data, the data pointers, strides or devices of the tensors, nor
on non-tensor values: payloads (DLPack exports, ``torch.save`` bytes) are
made afresh by every save, and the offsets of every entry in its data file
come from the C writer's layout of that save.
"""
from __future__ import annotations

import heapq
import math
import threading
from collections import OrderedDict
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .. import _C
from ..formats import metadata as _metadata
from ..formats.files import DCP_VERSION
from ..storage.pending import (
    _DIRECT,
    _TO_DLPACK,
    PendingWrite,
    dl_dtypes,
    staged_payload,
    tensor_payload,
    value_payload,
)
from .._torchcompat import DTensor, dtensor_chunk, is_checkpointable_tensor, new_metadata
from ..errors import CheckpointError


_BYTES_MD = BytesStorageMetadata()
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


# ------------------------------------------------------------ what is planned

def is_dtensor(obj: Any) -> bool:
    return DTensor is not None and isinstance(obj, DTensor)


def in_mesh(flat: dict) -> dict:
    """``flat`` without the DTensors whose mesh does not include this rank
    (a sub-mesh): this rank holds nothing of them, and, as torch's default
    planners do (``create_default_local_save_plan`` / ``_load_plan``), it
    neither writes nor reads them.  ``flat`` itself when there are none."""
    if DTensor is None or not any(issubclass(t, DTensor) for t in set(map(type, flat.values()))):
        return flat
    outside = {k for k, v in flat.items()
               if isinstance(v, DTensor) and v.device_mesh.get_coordinate() is None}
    if not outside:
        return flat
    return {k: v for k, v in flat.items() if k not in outside}


def plain_tensor(obj: Any) -> bool:
    """A tensor dcpx saves as its own memory: torch.Tensor, Parameter, or a
    subclass that is not a wrapper carrying its own layout (DTensor,
    ShardedTensor, anything with ``__tensor_flatten__``), nor a
    CheckpointableTensor (torch >= 2.14: a shard of a larger tensor,
    dcpx._torchcompat).  A subclass without storage is refused by
    ``check_saveable``, naming its key."""
    tp = type(obj)
    if tp is _Tensor or tp is _Parameter:
        return not is_checkpointable_tensor(obj)
    if not isinstance(obj, _Tensor):
        return False
    return (tp.__name__ not in ("DTensor", "ShardedTensor") and not hasattr(obj, "__tensor_flatten__")
            and not is_checkpointable_tensor(obj))


def plannable(obj: Any, distributed: bool) -> bool:
    """The one rule for which values dcpx plans itself (any other value
    sends the whole state dict to torch's planner): a non-tensor, a plain
    tensor (``plain_tensor``), and, with a process group in use, a DTensor
    whose local part is a plain tensor and has no Partial placement."""
    if not isinstance(obj, _Tensor):
        return True
    if plain_tensor(obj):
        return True
    if distributed and is_dtensor(obj):
        return (type(obj._local_tensor) in _PLAIN
                and not any(p.is_partial() for p in obj.placements))
    return False


_SHARDS: dict = {}


def local_chunk(obj: torch.Tensor) -> tuple[torch.Tensor, torch.Size, torch.Size]:
    """(local data, global offsets, sizes) of a tensor on this rank.

    A DTensor's shard depends only on its global shape, placements, mesh and
    this rank's coordinate in the mesh, and torch computes it in ~80 us;
    models have few distinct (shape, placements, mesh, coordinate), so it is
    cached under all four.  The coordinate is part of the key: meshes compare
    equal by their ranks and layout, not by which of those ranks this process
    is, so a process that joins a new group as another rank (an in-process
    restart, a simulation of many ranks) would otherwise get the offsets of
    the rank it was before."""
    if is_dtensor(obj):
        mesh = obj.device_mesh
        coord = mesh.get_coordinate()
        key = (obj.shape, tuple(obj.placements), mesh,
               None if coord is None else tuple(coord))
        shard = _SHARDS.get(key)
        if shard is None:
            chunk = dtensor_chunk(obj)
            if len(_SHARDS) > 65536:
                _SHARDS.clear()
            shard = _SHARDS[key] = (chunk.offsets, chunk.sizes)
        return obj._local_tensor.detach(), shard[0], shard[1]
    return obj.detach(), _metadata.zero_offsets(obj.dim()), obj.size()


# ------------------------------------------------------------ local plan

class LocalItem(NamedTuple):
    """One chunk (or bytes value) this rank can write: the unit of a plan."""
    fqn: str
    offsets: Optional[tuple]     # None for a bytes value
    sizes: Optional[tuple]
    size: Optional[tuple]        # the whole tensor's size
    dtype: Optional[torch.dtype]
    requires_grad: bool
    pinned: bool
    nbytes: int


def scan(flat: dict, prepare: Callable,
         expect: Optional[list] = None) -> tuple[Optional[list], list]:
    """One pass over a flat state dict: (signature, payloads).

    ``payloads[i]`` is the C writer's payload of the i-th value
    (``prepare(tensor, key)`` for a tensor, the ``torch.save`` bytes of any
    other value); ``signature[i]`` is what the plan depends on: None for a
    non-tensor, ``(dtype, shape, requires_grad, pinned)`` for a tensor saved
    whole, plus ``(offsets, sizes)`` for a DTensor's local chunk.  The
    caller has checked ``plannable`` for every value.

    ``expect``: a plan's signature; if the state dict has it, the signature
    returned is None (not built).  Plain CPU tensors of the payload functions
    of dcpx/storage/pending.py are looked at in one C pass (csrc/payloads.c,
    ``_C.scan_plain``), the rest here."""
    values = list(flat.values())
    # Pinned memory exists only once torch has initialised CUDA in this
    # process; asking is_pinned() before that would initialise it, and in
    # a child forked after CUDA use fails (CUDA 'initialization error').
    cuda = torch.cuda.is_initialized()
    if (prepare is tensor_payload or prepare is staged_payload) and _TO_DLPACK is not None:
        payloads, todo, same = _C.scan_plain(values, expect, _DIRECT, dl_dtypes(), _TO_DLPACK,
                                             cuda)
    else:
        payloads, todo, same = [None] * len(values), range(len(values)), expect is not None
    if todo:
        keys = list(flat)
        for i in todo:
            p, s = _scan_one(values[i], keys[i], prepare, cuda)
            payloads[i] = p
            if same and s != expect[i]:
                same = False
    if same:
        return None, payloads
    return [_signature(v, cuda) for v in values], payloads


def _scan_one(obj: Any, fqn: str, prepare: Callable, cuda: bool) -> tuple:
    """(payload, signature entry) of one value (see ``scan``)."""
    tp = type(obj)
    if tp is _Tensor or tp is _Parameter or (isinstance(obj, _Tensor) and not is_dtensor(obj)):
        p = prepare(obj, fqn)  # first: it refuses what has no metadata
        return p, (obj.dtype, obj.shape, obj.requires_grad, cuda and obj.is_pinned())
    if isinstance(obj, _Tensor):
        data, offsets, sizes = local_chunk(obj)
        p = prepare(data, fqn)
        return p, (obj.dtype, obj.shape, obj.requires_grad, cuda and data.is_pinned(),
                   tuple(offsets), tuple(sizes))
    return value_payload(obj, fqn), None


def _signature(obj: Any, cuda: bool) -> Optional[tuple]:
    """``scan``'s signature entry of a value whose payload is made."""
    if not isinstance(obj, _Tensor):
        return None
    if is_dtensor(obj):
        data, offsets, sizes = local_chunk(obj)
        return (obj.dtype, obj.shape, obj.requires_grad, cuda and data.is_pinned(),
                tuple(offsets), tuple(sizes))
    return (obj.dtype, obj.shape, obj.requires_grad, cuda and obj.is_pinned())


def local_items(keys, sig: list, payloads: list) -> list[LocalItem]:
    """The items of a scanned state dict (``scan``), for the global plan."""
    items = []
    for fqn, s, p in zip(keys, sig, payloads):
        if s is None:
            items.append(LocalItem(fqn, None, None, None, None, False, False, len(p)))
            continue
        size = tuple(s[1])
        if len(s) == 4:
            offsets, sizes = (0,) * len(size), size
        else:
            offsets, sizes = s[4], s[5]
        items.append(LocalItem(fqn, offsets, sizes, size, s[0], s[2], s[3],
                               math.prod(sizes) * s[0].itemsize))
    return items


def local_plan(flat: dict, prepare: Callable) -> tuple[list[LocalItem], list]:
    """This rank's items and their payloads for the C writer."""
    sig, payloads = scan(flat, prepare)
    return local_items(flat.keys(), sig, payloads), payloads


# ------------------------------------------------------------ global plan

class GlobalPlan(NamedTuple):
    assign: list[list[int]]           # per rank: indices of its items it writes
    state_dict_metadata: dict
    index: dict                       # (rank, item idx) -> MetadataIndex
    planner_data: dict


def global_plan(plans: list[list[LocalItem]], mappings: list[dict]) -> GlobalPlan:
    """Dedup and balance the ranks' items and build the tensor metadata.
    Raises CheckpointError when ranks disagree about a key."""
    n = len(plans)
    assign: list[list[int]] = [[] for _ in range(n)]
    sdm: dict = {}
    index: dict = {}
    if n == 1:
        assign[0] = list(range(len(plans[0])))
        for i, it in enumerate(plans[0]):
            index[(0, i)] = _describe(sdm, it)
    elif all(p is plans[0] for p in plans):
        # Every rank holds every item (replicated state): balance by bytes.
        heap = [(0, r) for r in range(n)]
        for i, it in enumerate(plans[0]):
            load, r = heapq.heappop(heap)
            assign[r].append(i)
            heapq.heappush(heap, (load + it.nbytes, r))
            index[(r, i)] = _describe(sdm, it)
    else:
        holders: dict = {}
        for r, items in enumerate(plans):
            for i, it in enumerate(items):
                h = holders.get((it.fqn, it.offsets))
                if h is None:
                    holders[(it.fqn, it.offsets)] = [(r, i)]
                else:
                    other = plans[h[0][0]][h[0][1]]
                    if (other.sizes, other.size, other.dtype) != (it.sizes, it.size, it.dtype):
                        raise CheckpointError(
                            f"dcpx: ranks {h[0][0]} and {r} disagree about {it.fqn!r} at "
                            f"offset {it.offsets}: chunk {other.dtype}{list(other.sizes or ())} "
                            f"of {list(other.size or ())} vs {it.dtype}{list(it.sizes or ())} "
                            f"of {list(it.size or ())}")
                    h.append((r, i))
        load = [0] * n
        for h in holders.values():
            r, i = min(h, key=lambda ri: load[ri[0]]) if len(h) > 1 else h[0]
            it = plans[r][i]
            load[r] += it.nbytes
            assign[r].append(i)
            index[(r, i)] = _describe(sdm, it)
        for a in assign:
            a.sort()
    planner_data: dict = {}
    for m in reversed(mappings):  # the lowest rank wins, as in torch's ChainMap
        planner_data.update(m)
    return GlobalPlan(assign, sdm, index, planner_data)


def _describe(sdm: dict, it: LocalItem) -> MetadataIndex:
    """Add one item to the state-dict metadata; its storage index."""
    md = sdm.get(it.fqn)
    if it.offsets is None:
        if md is not None and not isinstance(md, BytesStorageMetadata):
            raise CheckpointError(f"dcpx: {it.fqn!r} is a tensor on one rank and a "
                                  f"non-tensor value on another")
        sdm[it.fqn] = _BYTES_MD
        return MetadataIndex(it.fqn)
    if md is None:
        md = sdm[it.fqn] = TensorStorageMetadata(
            properties=_metadata.properties(it.dtype, it.requires_grad, it.pinned),
            size=_metadata.interned_size(it.size), chunks=[])
    elif not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"dcpx: {it.fqn!r} is a tensor on one rank and a "
                              f"non-tensor value on another")
    elif md.properties.dtype != it.dtype or tuple(md.size) != it.size:
        raise CheckpointError(
            f"dcpx: ranks disagree about {it.fqn!r}: {md.properties.dtype}"
            f"{list(md.size)} vs {it.dtype}{list(it.size)}")
    offsets = _metadata.interned_size(it.offsets)
    md.chunks.append(ChunkStorageMetadata(offsets=offsets,
                                          sizes=_metadata.interned_size(it.sizes)))
    return MetadataIndex(it.fqn, offsets, len(md.chunks) - 1)


def file_groups(items: list[LocalItem], n: int, single_file_per_rank: bool) -> list[list[int]]:
    """Which items go into which data file (indices into ``items``), as
    torch's _split_by_size_and_type does: with one file per rank, bytes
    round-robin over ``n`` files and tensors largest first onto the
    least-loaded; else one file per item."""
    if not single_file_per_rank:
        return [[i] for i in range(len(items))]
    if n <= 1:
        return [list(range(len(items)))]
    out: list[list[int]] = [[] for _ in range(n)]
    tensors = []
    nb = 0
    for i, it in enumerate(items):
        if it.offsets is None:
            out[nb % n].append(i)
            nb += 1
        else:
            tensors.append(i)
    tensors.sort(key=lambda i: items[i].nbytes, reverse=True)
    heap = [(0, f) for f in range(n)]
    for i in tensors:
        load, f = heapq.heappop(heap)
        out[f].append(i)
        heapq.heappush(heap, (load + items[i].nbytes, f))
    return [g for g in out if g] or [[]]


# ------------------------------------------------------------ one process

class SavePlan(NamedTuple):
    """A single-process save's plan: reused by later saves of the same
    layout.  Shared between saves (and threads) once built: never mutated,
    but for ``encoded``, a cache of what its saves' metadata encodes to."""
    sig: list                   # scan()'s signature it was made for
    sdm: dict                   # fqn -> Tensor/BytesStorageMetadata
    index: list                 # per item: its MetadataIndex
    nbytes: list                # per item: bytes of a tensor (-1: a bytes value)
    groups: list                # per data file: item indices
    mappings: dict              # the planner_data it was made with
    in_order: bool              # one data file with every item in order
    encoded: list               # [None] or [(layout, middle)]: dcpx.formats.metadata.Splice


# (writer's file configuration, keys) -> SavePlan; the most recent first out
# when full.  Holds no tensor: keys, dtypes, sizes and metadata only.
_PLANS: "OrderedDict[tuple, SavePlan]" = OrderedDict()
_PLANS_MAX = 4                  # plans kept (e.g. model and optimizer saved apart)
_PLANS_MAX_ITEMS = 1_000_000    # and at most this many items over all of them
_plans_lock = threading.Lock()


def clear_plan_cache() -> None:
    with _plans_lock:
        _PLANS.clear()


def _cached_plan(config: tuple, keys: tuple) -> Optional[SavePlan]:
    """The plan kept for these keys and file configuration, if any (its
    signature is still to be compared)."""
    key = (config, keys)
    with _plans_lock:
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
    return plan


def _plan_for(config: tuple, keys: tuple, sig: list, payloads: list,
              mappings: dict, known: Optional[SavePlan] = None) -> SavePlan:
    """The plan for a scanned state dict: ``known`` (or the cached one) if
    it was made for the same signature and mappings, else a new one,
    cached."""
    plan = known if known is not None else _cached_plan(config, keys)
    if plan is not None and plan.sig == sig and (
            mappings is plan.mappings or mappings == plan.mappings):
        return plan
    items = local_items(keys, sig, payloads)
    gp = global_plan([items], [{}])
    groups = file_groups(items, config[1], config[0])
    plan = SavePlan(sig, gp.state_dict_metadata, [gp.index[(0, i)] for i in range(len(items))],
                    [-1 if it.offsets is None else it.nbytes for it in items],
                    groups, dict(mappings), groups == [list(range(len(items)))], [None])
    key = (config, keys)
    with _plans_lock:
        _PLANS[key] = plan
        _PLANS.move_to_end(key)
        total = sum(len(p.index) for p in _PLANS.values())
        while len(_PLANS) > 1 and (len(_PLANS) > _PLANS_MAX or total > _PLANS_MAX_ITEMS):
            _, gone = _PLANS.popitem(last=False)
            total -= len(gone.index)
    return plan


class LocalSave(NamedTuple):
    """A single-process save whose data files are being laid out (and, once
    ``pending.start()`` is called, written): its plan, and what its
    Metadata is built from (``metadata()``, called while the data is
    written)."""
    writer: Any
    plan: SavePlan
    pending: PendingWrite
    names: tuple                # data file names, per file of plan.groups

    def metadata(self) -> Metadata:
        """The save's Metadata; leaves the writer a hint for encoding it
        (dcpx.formats.metadata.Splice): its plan's last encoding, if the layout
        is the same."""
        plan, pending, names = self.plan, self.pending, self.names
        layout = pending.layout
        cached = plan.encoded[0]
        middle = None
        if cached is not None and cached[0] == layout:
            # Equal: keep the plan's list, so this save's are freed now.
            layout = pending.layout = cached[0]
            middle = cached[1]
        index = plan.index
        storage_data = {}
        if plan.in_order:
            name = names[0]
            storage_data = {ix: _StorageInfo(name, off, length)
                            for ix, (off, length) in zip(index, layout[0])}
        else:
            for name, g, lay in zip(names, plan.groups, layout):
                for i, (off, length) in zip(g, lay):
                    storage_data[index[i]] = _StorageInfo(name, off, length)
        metadata = new_metadata(
            state_dict_metadata=dict(plan.sdm),
            # The plan's copy: its key strings are the objects the reused
            # metadata holds, so the pickle stores each key once (a new
            # state dict's equal strings would be stored again).
            planner_data=dict(plan.mappings),
            storage_data=storage_data,
            storage_meta=self.writer.storage_meta(),
            version=DCP_VERSION,
        )
        # Only for dcpx's own encode_metadata: a subclass's may change the
        # Metadata before encoding it, which the cached encoding (shared by
        # every writer of this plan) would not show.
        from ..storage.writer import FileSystemWriter
        if type(self.writer).encode_metadata is FileSystemWriter.encode_metadata:
            self.writer._splice = _metadata.Splice(metadata, names, plan.encoded, layout,
                                                   middle)
        return metadata


def plan_local_save(writer, flat: dict, mappings: dict,
                    prepare: Callable = tensor_payload,
                    scanned: Optional[tuple] = None) -> LocalSave:
    """Plan a flat, single-process state dict and lay out its data files:
    the one-rank case of the global plan, reused while the layout stays the
    same.  ``prepare(tensor, key)`` turns each tensor into a C-writer
    payload (the async path passes staged copies).  The data files are
    written once ``pending.start()`` is called; ``metadata()`` builds the
    Metadata meanwhile.  ``scanned``: ``scan(flat, prepare)``'s result
    when the caller has it (a stager's layout: staging.UploadScan), with
    the staging buffer as a third element when the payloads of the staged
    tensors are base items in it."""
    writer.set_up_storage_writer(True, rank=0)
    writer._prepare_dir()
    prefix = writer._prefix(0)
    config = (bool(writer.single_file_per_rank), max(1, writer.thread_count))
    keys = tuple(flat)
    known = _cached_plan(config, keys)
    base = None
    if scanned is not None:
        sig, payloads, *rest = scanned
        if rest:  # a stager's buffer: its tensors' payloads are base items
            base = rest[0]
    else:
        sig, payloads = scan(flat, prepare, known.sig if known is not None else None)
    plan = (known if sig is None and (mappings is known.mappings or mappings == known.mappings)
            else _plan_for(config, keys, sig if sig is not None else known.sig, payloads,
                           mappings, known))
    del sig
    names = tuple(f"{prefix}{i}.distcp" for i in range(len(plan.groups)))
    if plan.in_order:
        groups = [payloads]
    else:
        groups = [[payloads[i] for i in g] for g in plan.groups]
    del payloads
    pending = writer.write_payloads(list(names), groups, base=base)
    return LocalSave(writer, plan, pending, names)
