"""Checkpoint coordination at 64-16,384 ranks, simulated in one process: rank 0's work
per save, the bytes of every collective, the ``.metadata`` size and each rank's work at
load, for dcpx and torch DCP fed the same synthetic plans, checked against real gloo
runs at 2-16 ranks, and turned into seconds per save by a stated network model
(issue 28, item 1).

What is simulated
-----------------
A state dict of T tensors per rank shaped like a Llama-3-70B-style model (h=8192,
kv=1024, ffn=28672; nine parameters per layer), each parameter followed by its two
Adam states (bf16 parameter, fp32 states), laid out as

* ``fsdp2``: every tensor a DTensor ``Shard(0)`` over all R ranks (R chunks a tensor);
* ``hsdp``:  ``(Replicate(), Shard(0))`` on an (R/G, G) mesh: sharded over a group of G
  (``--group``, default 8), replicated across the R/G groups;
* ``ddp``:   every rank holds every tensor whole (plain tensors).

Dim 0 of every tensor is rounded up to a multiple of the shard group, so that every
rank holds an equal, non-empty chunk (FSDP2 pads unevenly otherwise).  No tensor is
allocated: only keys, shapes, dtypes and chunk boxes.

Each library's OWN coordinator code runs on the messages R ranks would send:

* dcpx: rank r's plan message is made by dcpx/coordination/dist.py's ``_changed_message`` (first
  save) from the signature ``dcpx.coordination.plan.scan`` gives a DTensor / tensor, and by the
  unchanged-plan branch of ``_local_message`` (repeated save, steady-state saves off:
  the digest and token); rank 0 runs ``disagreeing_paths`` + ``_coordinate`` on the R messages, the ranks take
  their replies as ``_save`` does, report the file layout their C writer would lay out
  (one file per rank, 64-byte aligned records of the measured record overhead), and
  rank 0 runs ``_commit`` (metadata built, encoded, written, directory cleaned) in a
  real directory that holds the R data files (sparse).  The steady-state save
  (``_dist._save_steady``) after them: ``_steady_for``'s key at rank 0 and rank k,
  the tag broadcast, their layouts checked, ``_commit_steady`` from the kept encoded
  middle, the outcome broadcast; its two 16-byte all-reduces (and the one every
  save opens with) are counted as tensor collectives.  ``DcpxProtocol`` below holds
  these steps: re-point it when the protocol changes.
* torch: rank r's ``SavePlan`` is made by torch's ``DefaultSavePlanner.set_up_planner``
  / ``create_local_plan`` (with ``enable_plan_caching=True``; its first save is the
  uncached path plus storing the caches) over stand-ins whose
  ``__create_write_items__`` returns what a DTensor's does
  (``planner_helpers._create_write_items_for_dtensor``); DDP uses real zero-stride
  tensors.  Rank 0 runs ``create_global_plan`` (dedup, metadata, validation),
  ``FileSystemWriter.prepare_global_plan`` and ``finish``; the repeated save is torch's
  plan-caching path (every rank sends ``SavePlan([], usable=False)``).

Every message crosses a model of torch's object collectives: pickled on the sender
(``_object_to_tensor``), unpickled on the receiver (``_tensor_to_object``); the bytes are
counted per collective and rank (payload, and wire: each message padded to the
largest, as ``gather_object`` / ``scatter_object_list`` send them, plus the 8-byte sizes
they exchange first).  Rank 0's CPU time per phase (``time.process_time``; dcpx's
phases run inside ``paused_gc`` as its ``save`` does, torch's with the collector on,
as torch runs) is the figure: on a shared machine it depends far less on other load
than wall time.

At load, per rank (rank 0 and rank R//2+1, each with cold caches, as a fresh process):
dcpx reads and checks ``.metadata`` (``_dist.open_checkpoint``: the C decoder, or
Python's when it declines) and finds its chunks (``_readplan.direct_plan`` then
``_dist.plan_checked``: ``plan_reads``, with the rank's chunk given for each key where a
DTensor would give it, and the data files it reads checked); torch's ``FileSystemReader.read_metadata`` + ``DefaultLoadPlanner``.  The bytes
read and the file-system calls (lstat / stat / open / pread / listdir) are counted.
No tensor data is read.

Real runs (``--real``): W gloo ranks on this machine (W in 2,4,8,16) save the same
model with tiny dims (``--real-dims tiny``) through ``dcpx.save`` / ``dcp.save``, twice
each, and load; rank 0's phases are timed by wrapping the same functions (and
torch's ``_object_to_tensor`` / ``_tensor_to_object``); the simulation of the same W, T,
shape and dims runs in a fresh process; the report gives real / simulated per phase
and the bytes of both.

Network model (``--bw-gbs``, ``--lat-us``, ``--tcp-bw-gbs``, ``--tcp-lat-us``): each
collective costs a latency per message step plus its bytes over the bandwidth into (or
out of) rank 0, either as gloo runs it (gather and scatter: rank 0 exchanges a message
with every rank; all_gather: a ring; broadcast: a binomial tree moving the whole buffer
at each of its log2 R steps) or as log-depth collectives would (log2 R latencies; a
gather or scatter still moves every byte through rank 0; a pipelined broadcast).
Defaults: 25 GB/s and 10 us (a 200 Gb/s InfiniBand / RoCE NIC per node, ~5-20 us per
small message through a software stack), and a worse case of gloo over TCP: 1.25 GB/s
(10 GbE) and 60 us.  Seconds per save = the slower rank's local plan + every collective
+ rank 0's phases + the ranks' decode of the broadcast (data writing excluded).

Usage::

    PYTHONPATH=$PWD python3 benchmarks/bench_scale.py --quick                 # ~1 min
    PYTHONPATH=$PWD python3 benchmarks/bench_scale.py --out benchmarks/results/scale/scale
    PYTHONPATH=$PWD python3 benchmarks/bench_scale.py --rows fsdp2:4096:2400 --libs dcpx \\
        --max-items 10000000 --profile               # one row, dcpx only, larger cap
    PYTHONPATH=$PWD python3 benchmarks/bench_scale.py --real --real-ranks 2,4,8,16 \\
        --out benchmarks/results/scale/real

Rows whose R x T exceeds ``--max-items`` (default 100,000 chunks, as issue 28's table: a
torch row of that size takes minutes here) are run with T scaled down to fit, and the table says so
(both libraries at the same T); ``--libs dcpx --max-items 2000000`` runs dcpx alone
further.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import io
import json
import math
import os
import platform
import pstats
import resource
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# ---------------------------------------------------------------- the model

# One transformer layer's parameters: (name, dims); dims name DIMS' entries.
LAYER = [
    ("attention.wq.weight", ("h", "h")),
    ("attention.wk.weight", ("kv", "h")),
    ("attention.wv.weight", ("kv", "h")),
    ("attention.wo.weight", ("h", "h")),
    ("feed_forward.w1.weight", ("ffn", "h")),
    ("feed_forward.w2.weight", ("h", "ffn")),
    ("feed_forward.w3.weight", ("ffn", "h")),
    ("attention_norm.weight", ("h",)),
    ("ffn_norm.weight", ("h",)),
]
DIMS = {
    "real": {"h": 8192, "kv": 1024, "ffn": 28672},   # Llama-3-70B-like
    "tiny": {"h": 8, "kv": 4, "ffn": 16},            # the real gloo runs
}
KINDS = ("fsdp2", "hsdp", "ddp")


@dataclasses.dataclass
class Model:
    """T tensors per rank of one layout over R ranks (metadata only)."""
    kind: str
    ranks: int
    tensors: int
    group: int
    dims: str
    keys: list                    # flat keys, in state-dict order
    paths: list                   # nested path of each key
    shapes: list                  # global shape of each key
    dtypes: list

    @property
    def shard(self) -> int:
        """Ranks a tensor is sharded over."""
        return {"fsdp2": self.ranks, "hsdp": self.group, "ddp": 1}[self.kind]

    def group_rank(self, r: int) -> int:
        """Rank r's place in its shard group: ranks with the same one hold the
        same chunks (HSDP's replicas, every DDP rank)."""
        return r % self.shard

    def chunk(self, i: int, r: int) -> tuple:
        """(offsets, sizes) of key i's chunk on rank r."""
        shape = self.shapes[i]
        n = shape[0] // self.shard
        g = self.group_rank(r)
        return (g * n,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:])

    def chunk_nbytes(self, i: int) -> int:
        shape = self.shapes[i]
        return math.prod(shape) // self.shard * self.dtypes[i].itemsize

    def nested(self, leaf: Callable[[int], Any]) -> dict:
        """The nested state dict with ``leaf(i)`` at key i's place."""
        sd: dict = {}
        for i, path in enumerate(self.paths):
            d = sd
            for p in path[:-1]:
                d = d.setdefault(p, {})
            d[path[-1]] = leaf(i)
        return sd

    def chunks_total(self) -> int:
        return self.ranks * self.tensors


def make_model(kind: str, ranks: int, tensors: int, group: int = 8, dims: str = "real") -> Model:
    """``tensors`` (a multiple of 3) per rank: parameters layer by layer, each with its
    two Adam states, in the order a model's and then its optimizer's state dict list
    them (``{"model": ..., "optim": {"state": {param: {"exp_avg", "exp_avg_sq"}}}}``)."""
    if tensors % 3:
        raise ValueError("tensors per rank must be a multiple of 3 (a parameter and 2 states)")
    if kind == "hsdp" and ranks % group:
        raise ValueError(f"hsdp: {ranks} ranks are not a multiple of the group {group}")
    d = DIMS[dims]
    shard = {"fsdp2": ranks, "hsdp": min(group, ranks), "ddp": 1}[kind]
    params = []
    layer = 0
    while len(params) < tensors // 3:
        for name, dd in LAYER:
            if len(params) == tensors // 3:
                break
            shape = [d[x] for x in dd]
            shape[0] = -(-shape[0] // shard) * shard
            params.append((f"layers.{layer}.{name}", tuple(shape)))
        layer += 1
    keys, paths, shapes, dtypes = [], [], [], []
    for name, shape in params:
        keys.append(f"model.{name}")
        paths.append(("model", name))
        shapes.append(shape)
        dtypes.append(torch.bfloat16)
    for name, shape in params:
        for st in ("exp_avg", "exp_avg_sq"):
            keys.append(f"optim.state.{name}.{st}")
            paths.append(("optim", "state", name, st))
            shapes.append(shape)
            dtypes.append(torch.float32)
    return Model(kind, ranks, tensors, min(group, ranks), dims, keys, paths, shapes, dtypes)


# ---------------------------------------------------------------- measuring

_ACTIVE: list = []   # (Phases, phase name) being timed, innermost last
_GC_START = [0.0]


def _gc_watch(event: str, info: dict) -> None:
    """Cyclic-GC seconds, charged to the phase being timed (torch's save runs
    with the collector on, dcpx's with it paused)."""
    if event == "start":
        _GC_START[0] = time.perf_counter()
    elif _ACTIVE:
        ph, name = _ACTIVE[-1]
        ph.gc[name] = ph.gc.get(name, 0.0) + time.perf_counter() - _GC_START[0]


gc.callbacks.append(_gc_watch)


class Phases:
    """CPU and wall seconds per named phase, summed over calls, and the
    seconds the cyclic collector ran inside each."""

    def __init__(self) -> None:
        self.cpu: dict = {}
        self.wall: dict = {}
        self.gc: dict = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        _ACTIVE.append((self, name))
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c0
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w0
            _ACTIVE.pop()

    def as_dict(self) -> dict:
        return {"cpu": dict(self.cpu), "wall": dict(self.wall), "gc": dict(self.gc),
                "cpu_total": sum(self.cpu.values()), "wall_total": sum(self.wall.values()),
                "gc_total": sum(self.gc.values())}


_CPU = torch.device("cpu")


def _dumps(obj: Any) -> torch.Tensor:
    """A message as torch's object collectives send it: torch's own
    ``_object_to_tensor`` (pickled, then copied into a uint8 tensor); its
    ``len`` is the bytes on the wire (before padding)."""
    from torch.distributed import distributed_c10d as c10d
    return c10d._object_to_tensor(obj, _CPU, None)[0]


def _loads(data: torch.Tensor) -> Any:
    """A received message, unpickled by torch's ``_tensor_to_object``."""
    from torch.distributed import distributed_c10d as c10d
    return c10d._tensor_to_object(data, len(data), None)


class Wire:
    """Byte counts of one save's (or load's) collectives, as torch's object
    collectives move them between R ranks (rank 0 the root)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.colls: list = []

    def add(self, name: str, kind: str, sizes: list) -> None:
        """``sizes``: per rank, the pickled message it sends (gather, all_gather) or
        receives (scatter); one size for a broadcast; the tensor's bytes for an
        all_reduce (a tensor collective: nothing pickled, no sizes exchanged)."""
        self.colls.append({"name": name, "kind": kind, "sizes": list(sizes)})

    def summary(self, other: int) -> list:
        """Per collective: payload and wire bytes in/out at rank 0 and at rank
        ``other``; the wire pads every message to the largest (object collectives),
        plus an 8-byte size per rank (all_gather in gather_object, broadcast in
        scatter_object_list and broadcast_object_list)."""
        R = self.ranks
        out = []
        for c in self.colls:
            s, kind = c["sizes"], c["kind"]
            big = max(s)
            # what rank 0 pickles in it (its own message; every reply of a scatter)
            mine = sum(s) if kind == "scatter" else 0 if kind == "all_reduce" else s[0]
            row = {"name": c["name"], "kind": kind, "max_msg": big, "rank0_pickled": mine}
            if kind == "gather":
                row.update(
                    rank0_in=sum(s) - s[0], rank0_out=0, other_in=0, other_out=s[other],
                    rank0_in_wire=(R - 1) * big + 8 * (R - 1), rank0_out_wire=8 * (R - 1),
                    other_in_wire=8 * (R - 1), other_out_wire=big + 8 * (R - 1))
            elif kind == "scatter":
                row.update(
                    rank0_in=0, rank0_out=sum(s) - s[0], other_in=s[other], other_out=0,
                    rank0_in_wire=0, rank0_out_wire=(R - 1) * (big + 8),
                    other_in_wire=big + 8, other_out_wire=0)
            elif kind == "broadcast":
                row.update(
                    rank0_in=0, rank0_out=(R - 1) * s[0], other_in=s[0], other_out=0,
                    rank0_in_wire=0, rank0_out_wire=(R - 1) * (s[0] + 8),
                    other_in_wire=s[0] + 8, other_out_wire=0)
            elif kind == "all_gather":
                row.update(
                    rank0_in=sum(s) - s[0], rank0_out=s[0], other_in=sum(s) - s[other],
                    other_out=s[other],
                    rank0_in_wire=(R - 1) * (big + 8), rank0_out_wire=big + 8,
                    other_in_wire=(R - 1) * (big + 8), other_out_wire=big + 8)
            elif kind == "all_reduce":
                # gloo's ring: each rank sends and receives 2 (R-1)/R of the
                # buffer (at most twice its size)
                n = s[0]
                ring = 2 * n * (R - 1) // R
                row.update(rank0_in=n, rank0_out=n, other_in=n, other_out=n,
                           rank0_in_wire=ring, rank0_out_wire=ring,
                           other_in_wire=ring, other_out_wire=ring)
            out.append(row)
        return out


def _other_rank(R: int) -> int:
    """The non-zero rank reported beside rank 0."""
    return R // 2 + 1 if R > 2 else R - 1


_BASE: list = [torch.empty(0, dtype=torch.uint8)]


def _base(nbytes: int) -> torch.Tensor:
    """An uninitialised buffer of at least ``nbytes`` (never touched: no memory is
    committed) that the C writer's base items may point into."""
    if _BASE[0].numel() < nbytes:
        _BASE[0] = torch.empty(max(nbytes, 2 * _BASE[0].numel()), dtype=torch.uint8)
    return _BASE[0]


def dcpx_file_layout(items: list) -> list:
    """[(offset, length)] of ``items`` (``(dtype, chunk sizes, nbytes)``, in order)
    in one data file, as dcpx's C writer lays it out (``_C.WriteJob(...).layout()``
    over base items: nothing is written, no tensor memory is touched)."""
    from dcpx import _C
    from dcpx.formats.dtypes import storage_type_name
    if not items:
        return []
    base = _base(max(n for _, _, n in items))
    payloads = [(0, n, storage_type_name(dt), tuple(sz)) for dt, sz, n in items]
    job = _C.WriteJob([("/nonexistent/bench_scale.distcp", payloads)], sync_files=False,
                      threads=1, base=base)
    try:
        return job.layout()[0]
    finally:
        job.release()


_TORCH_RECORDS: dict = {}


def torch_record_length(dtype: torch.dtype, sizes: tuple) -> int:
    """Bytes of torch's FileSystemWriter record of a tensor (its ``torch.save``
    archive): measured for a tensor of this shape up to 1 MiB; above, that of the
    same dtype and rank at one element per dimension plus the bytes (within
    torch's 64-byte record alignment of the real length)."""
    key = (dtype, tuple(sizes))
    n = _TORCH_RECORDS.get(key)
    if n is None:
        nbytes = math.prod(sizes) * dtype.itemsize
        probe = tuple(sizes) if nbytes <= 1 << 20 else (1,) * len(sizes)
        buf = io.BytesIO()
        torch.save(torch.zeros(probe, dtype=dtype), buf)
        n = len(buf.getvalue()) - math.prod(probe) * dtype.itemsize + nbytes
        _TORCH_RECORDS[key] = n
    return n


_EOCD = b"PK\x05\x06" + b"\0" * 18  # a zip end-of-central-directory record, no comment


def make_data_files(directory: str, sizes: dict) -> None:
    """Sparse stand-ins of the data files (name -> bytes): the right size, ending
    in a zip end record, as dcpx's load checks them (``_formats.plain_zip_files``)."""
    for name, size in sizes.items():
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            size = max(size, len(_EOCD))
            os.ftruncate(fd, size)
            os.pwrite(fd, _EOCD, size - len(_EOCD))
        finally:
            os.close(fd)


class FsCounter:
    """Counts file-system calls made through ``os`` (and files opened with
    ``io.open``) while active, and the bytes read: ``os.pread`` / ``os.read``
    results, plus the whole size of each regular file ``io.open`` opens for
    reading (torch reads ``.metadata`` through ``pickle.load`` on such a file)."""

    NAMES = ("lstat", "stat", "open", "fstat", "pread", "read", "listdir", "scandir")

    def __init__(self) -> None:
        self.counts = {n: 0 for n in self.NAMES}
        self.counts["io.open"] = 0
        self.bytes_read = 0
        self._saved: dict = {}

    def __enter__(self):
        import builtins
        for n in self.NAMES:
            f = getattr(os, n)
            self._saved[(os, n)] = f

            def wrap(*a, __f=f, __n=n, **kw):
                self.counts[__n] += 1
                out = __f(*a, **kw)
                if __n in ("pread", "read"):
                    self.bytes_read += len(out)
                return out
            setattr(os, n, wrap)
        real_open = io.open

        def io_open(file, mode="r", *a, **kw):
            f = real_open(file, mode, *a, **kw)
            self.counts["io.open"] += 1
            if "r" in mode and not isinstance(file, int):
                self.bytes_read += self._saved[(os, "stat")](file).st_size
            return f
        for mod in (io, builtins):
            self._saved[(mod, "open")] = mod.open
            mod.open = io_open
        return self

    def __exit__(self, *exc) -> None:
        for (mod, n), f in self._saved.items():
            setattr(mod, n, f)

    def as_dict(self) -> dict:
        return {"fs_ops": sum(self.counts.values()), "by_call": dict(self.counts),
                "bytes_read": self.bytes_read}


# ---------------------------------------------------------------- dcpx's protocol
#
# The steps of one dcpx save as dcpx/coordination/dist.py's ``_save`` takes them, rank side and
# coordinator side.  When the coordinator changes (issue 28, items 2-3), update these
# methods and, if the collectives change, ``dcpx_save`` below; tests/test_bench_scale.py
# checks them against a real 2-rank gloo save.


class _SimShard(torch.Tensor):
    """A zero-memory stand-in for a DTensor at load: a tensor of the global shape
    whose type is not a plain tensor (dcpx's direct read plans decline it, as they do
    a DTensor) and that gives torch's planner its chunk (``__create_chunk_list__``)."""

    _chunk: Any = None

    def __create_chunk_list__(self):
        return [self._chunk]


def _sim_shard(shape: tuple, dtype: torch.dtype, chunk: Any) -> torch.Tensor:
    t = torch.empty((), dtype=dtype).expand(shape).as_subclass(_SimShard)
    t._chunk = chunk
    return t


class DcpxProtocol:
    """dcpx's rank-side and coordinator steps of a save, on synthetic plans."""

    def __init__(self, model: Model) -> None:
        self.model = model
        from dcpx.coordination import flatten as _flatten
        # keys and mappings from one flattening, as a save has them (the pickled
        # plan stores each key string once)
        flat, self.mappings = _flatten.flatten_state_dict(model.nested(lambda i: i))
        if list(flat.values()) != list(range(len(model.keys))):
            raise AssertionError("the model's keys are not in state-dict order")
        self.keys = tuple(flat)

    def signature(self, r: int) -> list:
        """``dcpx.coordination.plan.scan``'s signature of rank r's state dict: (dtype, shape,
        requires_grad, pinned) for a plain tensor, plus (offsets, sizes) of its chunk
        for a DTensor (CPU tensors: pinned is False)."""
        m = self.model
        sig = []
        for i, shape in enumerate(m.shapes):
            size = torch.Size(shape)
            if m.kind == "ddp":
                sig.append((m.dtypes[i], size, False, False))
            else:
                off, sz = m.chunk(i, r)
                sig.append((m.dtypes[i], size, False, False, off, sz))
        return sig

    def first_message(self, r: int, path: str) -> tuple:
        """(_Sent, message) of rank r's first save: ``_dist._changed_message``."""
        from dcpx.coordination import dist as _dist
        m = self.model
        items, _, sent, msg = _dist._changed_message(
            self.keys, self.signature(r), [None] * len(m.keys), self.mappings,
            ("bench_scale", r), path)
        return sent, msg

    @staticmethod
    def repeat_message(sent: Any, path: str) -> tuple:
        """Rank r's message when its plan is the one it sent last time
        (``_dist._local_message``'s unchanged branch)."""
        return ("ok", None, path, sent.digest, sent.token)

    @staticmethod
    def take_reply(sent: Any, reply: tuple) -> tuple:
        """(prefix, the indices it writes, updated _Sent), as ``_save`` takes a reply."""
        if reply[0] != "ok":
            raise RuntimeError(f"simulated save: reply {reply!r}")
        _, prefix, mine, token = reply
        if mine is None:
            mine = sent.assign
        return prefix, mine, sent._replace(token=token, assign=mine)

    @staticmethod
    def layout_message(sent: Any, prefix: str, mine: list) -> tuple:
        """What ``_dist.write_files`` reports for one file per rank
        (single_file_per_rank, one writer thread): (names, [(item, file, offset,
        length)]), laid out by the C writer."""
        items = sent.items
        lay = dcpx_file_layout([(items[i].dtype, items[i].sizes, items[i].nbytes)
                                for i in mine])
        return ("ok", [f"{prefix}0.distcp"],
                [(i, 0, off, length) for i, (off, length) in zip(mine, lay)])

    @staticmethod
    def coordinate(writer: Any, gathered: list) -> tuple:
        """Rank 0's planning step: (global plan, replies)."""
        from dcpx.coordination import dist as _dist
        refusal = _dist.disagreeing_paths([m[2] if m[0] == "ok" else None for m in gathered])
        if refusal is not None:
            raise RuntimeError(refusal)
        return _dist._coordinate(writer, gathered)

    @staticmethod
    def commit(writer: Any, plan: Any, gathered: list, cell: Optional[list] = None) -> tuple:
        """Rank 0's commit: (outcome broadcast to every rank, Metadata);
        ``cell[0]`` gets the encoded middle a steady-state save reuses."""
        from dcpx.coordination import dist as _dist
        outcome, metadata = _dist._commit(writer, plan, gathered, None,
                                          cell=[None, None, None] if cell is None else cell)
        if outcome[0] != "ok":
            raise RuntimeError(f"simulated commit: {outcome!r}")
        # the id of the save a steady-state save may repeat
        # (``_dist._gather_and_commit``; its pickle is of fixed size)
        return outcome + (_dist._SID_BASE,), metadata

    @staticmethod
    def remember_steady(writer: Any, sent: Any, r: int, size: int, path: str, prefix: str,
                        layout_msg: tuple, outcome: tuple, plan: Any = None,
                        files: Optional[tuple] = None, middle: Optional[bytes] = None,
                        source: Any = None, index: Any = None) -> Any:
        """Rank r's _Sent after a committed full exchange, holding its
        ``_Steady`` as ``_dist._gather_and_commit`` makes it (rank 0: the global
        plan, data files per rank and encoded middle; another rank: the
        broadcast metadata)."""
        from dcpx import _C
        from dcpx.coordination import dist as _dist
        sid = outcome[2]
        config = _dist._writer_config(writer)
        _, names, layout = layout_msg
        st = _dist._Steady(sid, _dist._steady_key(sid, path, config), path, config,
                           len(names), layout, _dist._tag_of(prefix, r),
                           None if r == 0 else outcome[1], plan if r == 0 else None,
                           files if r == 0 else None, middle if r == 0 else None,
                           _C.crc32(middle) if r == 0 and middle is not None else None,
                           source if r == 0 else None, index if r == 0 else None)
        return sent._replace(steady=st)

    @staticmethod
    def steady_key(writer: Any, sent: Any, r: int, size: int, path: str) -> int:
        """Rank r's contribution to the first all-reduce (``_dist._steady_for``;
        0: this rank cannot repeat its last save)."""
        from dcpx.coordination import dist as _dist
        g = _SimGroup(r, size)
        st = _dist._steady_for(sent, writer, path, g)
        return 0 if st is None else st.key

    @staticmethod
    def steady_layout(writer: Any, sent: Any, r: int, tag: str) -> tuple:
        """(layout message, same): what rank r's write reports in a
        steady-state save and whether it is its last save's (``_save_steady``)."""
        st = sent.steady
        prefix = writer._prefix(r, tag)
        msg = DcpxProtocol.layout_message(sent, prefix, sent.assign)
        _, names, layout = msg
        same = (len(names) == st.nfiles and layout == st.layout
                and names == [f"{prefix}{i}.distcp" for i in range(st.nfiles)])
        return msg, same

    @staticmethod
    def commit_steady(writer: Any, sent: Any, path: str, tag: str) -> tuple:
        """Rank 0's commit of a steady-state save: (outcome, Metadata)."""
        from dcpx.coordination import dist as _dist
        st = _dist._steady_for(sent, writer, path, _SimGroup(0, len(sent.steady.files)))
        outcome, metadata, _, _ = _dist._commit_steady(writer, st, tag)
        if outcome[0] != "ok":
            raise RuntimeError(f"simulated steady commit: {outcome!r}")
        return outcome, metadata

    @staticmethod
    def steady_metadata(sent: Any, directory: str, tag: str, outcome: tuple) -> Any:
        """Another rank's Metadata of a steady-state save (decoded on use)."""
        from dcpx.coordination import dist as _dist
        st = sent.steady
        return _dist._LazyMetadata(st.base, os.path.join(directory, ".metadata"),
                                   retag=(st.tag, tag, outcome[1]))


class _SimGroup:
    """What ``_dist._steady_for`` asks of a group."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.is_coordinator = rank, size, rank == 0


def dcpx_save(model: Model, directory: str, state: dict, profile: Any = None,
              repeat: bool = False, steady: bool = False) -> dict:
    """One dcpx save of ``model`` over R simulated ranks into ``directory``.
    ``state`` carries each rank's _Sent from one save to the next.  The cyclic
    collector is paused throughout, as dcpx's ``save`` pauses it on every rank.

    The first save is the full exchange with every plan sent whole;
    ``repeat``: the full exchange with each plan by digest (what an unchanged
    plan costs with steady-state saves off, or when a rank's files or layout
    differ from its last save's); ``steady``: the steady-state save
    (``_dist._save_steady``), which needs a full exchange before it."""
    from dcpx.coordination import dist as _dist, gcpause as _gc
    with _gc.paused_gc():
        if steady:
            was = _dist.steady_state_enabled
            _dist.steady_state_enabled = True  # fresh_caches turns it off
            try:
                return _dcpx_steady(model, directory, state, profile)
            finally:
                _dist.steady_state_enabled = was
        return _dcpx_save(model, directory, state, profile, repeat)


def _dcpx_save(model: Model, directory: str, state: dict, profile: Any, repeat: bool) -> dict:
    from dcpx.storage.writer import FileSystemWriter
    R = model.ranks
    other = _other_rank(R)
    proto = state.setdefault("proto", DcpxProtocol(model))
    writer = FileSystemWriter(directory, sync_files=False)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    path = os.path.normpath(directory)
    ph, rank_ph = Phases(), {0: Phases(), other: Phases()}
    wire = Wire(R)
    sents = state.setdefault("sent", {})
    # 0. the steady-state check (``_dist._agree``): one all-reduce of 16 bytes;
    # the first save, and a repeated one with steady-state saves off, give 0
    wire.add("agree", "all_reduce", [16] * R)
    # 1. every rank's plan message (rank side: timed at rank 0 and ``other``);
    # ranks that hold the same chunks send equal bytes, made once here
    wires1: list = [None] * R
    by_group: dict = {}
    for r in range(R):
        g = model.group_rank(r)
        if repeat:
            with rank_ph[r]("local") if r in rank_ph else contextlib.nullcontext():
                msg = proto.repeat_message(sents[r], path)
                data = _dumps(msg)
        elif g in by_group and r not in rank_ph:
            sents[r], data = by_group[g]
        else:
            with rank_ph[r]("local") if r in rank_ph else contextlib.nullcontext():
                sents[r], msg = proto.first_message(r, path)
                data = _dumps(msg)
            by_group.setdefault(g, (sents[r], data))
        wires1[r] = data
    by_group.clear()
    wire.add("plan", "gather", [len(w) for w in wires1])
    prof = profile if profile is not None else contextlib.nullcontext()
    with prof:
        with ph("g1_decode"):
            gathered = [_loads(w) for w in wires1]
        with ph("plan"):
            plan, replies = proto.coordinate(writer, gathered)
        with ph("s1_encode"):
            wires2 = [_dumps(x) for x in replies]
    del gathered
    wires1 = None
    wire.add("assign", "scatter", [len(w) for w in wires2])
    # 3. every rank takes its reply, writes, reports its layout
    wires3: list = [None] * R
    files: dict = {}
    sizes = state["file_sizes"] = [0] * R
    own: dict = {}
    for r in range(R):
        with rank_ph[r]("reply_decode") if r in rank_ph else contextlib.nullcontext():
            reply = _loads(wires2[r])
        with rank_ph[r]("layout") if r in rank_ph else contextlib.nullcontext():
            prefix, mine, sents[r] = proto.take_reply(sents[r], reply)
            msg = proto.layout_message(sents[r], prefix, mine)
            wires3[r] = _dumps(msg)
        if r in rank_ph:
            own[r] = (prefix, msg)
        if msg[2]:
            last = msg[2][-1]
            files[msg[1][0]] = sizes[r] = last[2] + last[3]
    wires2 = None
    wire.add("layout", "gather", [len(w) for w in wires3])
    make_data_files(directory, files)  # written before the commit, as in a real save
    with prof:
        with ph("g2_decode"):
            gathered = [_loads(w) for w in wires3]
        cell: list = [None, None, None]
        with ph("commit"):
            outcome, _ = proto.commit(writer, plan, gathered, cell)
        with ph("b_encode"):
            wire4 = _dumps(outcome)
    nfiles = tuple(len(m[1]) for m in gathered)
    del gathered
    wires3 = None
    wire.add("outcome", "broadcast", [len(wire4)])
    with rank_ph[other]("b_decode"):
        outcome_k = _loads(wire4)
    # what rank 0 and rank k keep for a steady-state save after this one
    for r, oc in ((0, outcome), (other, outcome_k)):
        sents[r] = proto.remember_steady(writer, sents[r], r, R, path, own[r][0], own[r][1],
                                         oc, plan, nfiles, cell[0], cell[1], cell[2])
    del plan
    writer._release_tag()
    return {"rank0": ph.as_dict(), "rank0_local": rank_ph[0].as_dict(),
            "other_local": rank_ph[other].as_dict(), "other": other,
            "collectives": wire.summary(other),
            "metadata_bytes": os.path.getsize(os.path.join(directory, ".metadata")),
            "data_files": len(files)}


def _dcpx_steady(model: Model, directory: str, state: dict, profile: Any) -> dict:
    """A steady-state save (``_dist._save_steady``) after a full exchange:
    an all-reduce of 16 bytes (every rank's key), rank 0's tag broadcast,
    each rank's write and check of its layout, an all-reduce that all are
    the last save's, rank 0's commit from the encoded middle, the outcome
    broadcast.  Rank 0 and rank k run their real steps; every rank's
    contribution to each all-reduce is the same (checked at 0 and k)."""
    from dcpx.storage.writer import FileSystemWriter
    R = model.ranks
    other = _other_rank(R)
    proto = state["proto"]
    sents = state["sent"]
    writer = FileSystemWriter(directory, sync_files=False)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    path = os.path.normpath(directory)
    ph, rank_ph = Phases(), {0: Phases(), other: Phases()}
    wire = Wire(R)
    keys = {}
    for r in (0, other):
        with rank_ph[r]("local"):
            keys[r] = proto.steady_key(writer, sents[r], r, R, path)
    if not keys[0] or keys[0] != keys[other]:
        raise RuntimeError(f"simulated steady save: the ranks' keys differ: {keys!r}")
    wire.add("agree", "all_reduce", [16] * R)
    prof = profile if profile is not None else contextlib.nullcontext()
    with prof:
        with ph("commit"):
            tag = writer._tag()
        with ph("b_encode"):
            wire1 = _dumps(("ok", tag))
    wire.add("tag", "broadcast", [len(wire1)])
    with rank_ph[other]("b_decode"):
        got = _loads(wire1)
    if got[1] != tag:
        raise RuntimeError("simulated steady save: tag")
    for r in (0, other):
        with rank_ph[r]("layout"):
            _, same = proto.steady_layout(writer, sents[r], r, tag)
        if not same:
            raise RuntimeError(f"simulated steady save: rank {r}'s layout differs")
    wire.add("same", "all_reduce", [16] * R)
    make_data_files(directory, {f"{writer._prefix(r, tag)}0.distcp": n
                                for r, n in enumerate(state["file_sizes"]) if n})
    # the part of the commit that moves the encoded middle's bytes into the
    # new .metadata (copy_file_range from the last file, or from memory)
    from dcpx.storage import commit as _commit_mod
    copy = {"cpu": 0.0, "wall": 0.0}
    before = dict(_commit_mod.MIDDLE_BYTES)
    real_copy = _commit_mod._copy_middle

    def timed_copy(*a, **kw):
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            return real_copy(*a, **kw)
        finally:
            copy["cpu"] += time.process_time() - c0
            copy["wall"] += time.perf_counter() - w0
    _commit_mod._copy_middle = timed_copy
    try:
        with prof:
            with ph("commit"):
                outcome, _ = proto.commit_steady(writer, sents[0], path, tag)
    finally:
        _commit_mod._copy_middle = real_copy
    copy["copied"] = _commit_mod.MIDDLE_BYTES["copied"] - before["copied"]
    copy["written"] = _commit_mod.MIDDLE_BYTES["written"] - before["written"]
    with ph("b_encode"):
        wire2 = _dumps(outcome)
    wire.add("outcome", "broadcast", [len(wire2)])
    with rank_ph[other]("b_decode"):
        oc = _loads(wire2)
        proto.steady_metadata(sents[other], directory, tag, oc)
    writer._release_tag()
    return {"rank0": ph.as_dict(), "rank0_local": rank_ph[0].as_dict(),
            "other_local": rank_ph[other].as_dict(), "other": other,
            "collectives": wire.summary(other),
            "metadata_bytes": os.path.getsize(os.path.join(directory, ".metadata")),
            "data_files": sum(1 for n in state["file_sizes"] if n), "middle_copy": copy}


# ---------------------------------------------------------------- torch's protocol

class _TorchWriteStandIn:
    """What a DTensor gives torch's save planner (``__create_write_items__``): the
    WriteItem of ``planner_helpers._create_write_items_for_dtensor``, built from the
    rank's chunk with torch's own dataclasses."""

    __slots__ = ("dtype", "size_", "offsets", "sizes")

    def __init__(self, dtype, size, offsets, sizes) -> None:
        self.dtype, self.size_, self.offsets, self.sizes = dtype, size, offsets, sizes

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        sizes, offsets = torch.Size(self.sizes), torch.Size(self.offsets)
        return [WriteItem(
            index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=TensorProperties(dtype=self.dtype, layout=torch.strided,
                                            requires_grad=False,
                                            memory_format=torch.contiguous_format,
                                            pin_memory=False),
                size=torch.Size(self.size_)))]


class TorchProtocol:
    """torch DCP's rank-side and coordinator steps of a save (torch 2.x's
    ``_save_state_dict``), on synthetic plans."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def state_dict(self, r: int) -> dict:
        m = self.model
        if m.kind == "ddp":
            return m.nested(lambda i: torch.empty((), dtype=m.dtypes[i]).expand(m.shapes[i]))
        return m.nested(lambda i: _TorchWriteStandIn(m.dtypes[i], m.shapes[i], *m.chunk(i, r)))

    @staticmethod
    def planner(caching: bool) -> Any:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        try:
            return DefaultSavePlanner(enable_plan_caching=caching)
        except TypeError:  # a torch without plan caching
            return DefaultSavePlanner()

    def local_plan(self, r: int, writer: Any, caching: bool) -> Any:
        """Rank r's SavePlan: ``local_step`` of torch's ``_save_state_dict``."""
        planner = self.planner(caching)
        planner.set_up_planner(state_dict=self.state_dict(r), storage_meta=writer.storage_meta(),
                               is_coordinator=r == 0)
        writer.set_up_storage_writer(r == 0, rank=r, use_collectives=True)
        plan = planner.create_local_plan()
        return writer.prepare_local_plan(plan), planner

    @staticmethod
    def unchanged_plan() -> Any:
        """What a rank sends under plan caching when its plan did not change."""
        from torch.distributed.checkpoint.planner import SavePlan
        return SavePlan([], usable=False)

    @staticmethod
    def coordinate(planner: Any, writer: Any, plans: list) -> tuple:
        """``global_step``: (plans to scatter, global Metadata)."""
        plans, metadata = planner.create_global_plan(plans)
        return writer.prepare_global_plan(plans), metadata

    @staticmethod
    def write_results(plan: Any) -> list:
        """What torch's FileSystemWriter.write_data returns for ``plan`` (one file,
        one thread): a WriteResult per item, records back to back."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.storage import WriteResult
        name = f"{plan.storage_data.prefix}0.distcp"
        off, out = 0, []
        for item in plan.items:
            td = item.tensor_data
            length = torch_record_length(td.properties.dtype, tuple(td.chunk.sizes))
            out.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(name, off, length)))
            off += length
        return out

    @staticmethod
    def finish(writer: Any, metadata: Any, results: list) -> Any:
        writer.finish(metadata=metadata, results=results)
        return metadata


def torch_save(model: Model, directory: str, state: dict, repeat: bool = False) -> dict:
    """One torch DCP save of ``model`` over R simulated ranks, with plan caching
    on (its first save is torch's uncached path plus storing the caches)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    R = model.ranks
    other = _other_rank(R)
    proto = state.setdefault("proto", TorchProtocol(model))
    os.makedirs(directory, exist_ok=True)  # every rank's prepare_local_plan does it
    writer = FileSystemWriter(directory, sync_files=False)
    ph, rank_ph = Phases(), {0: Phases(), other: Phases()}
    wire = Wire(R)
    wires1: list = [None] * R
    by_group: dict = {}
    planner0 = None
    for r in range(R):
        g = model.group_rank(r)
        ctx = rank_ph[r]("local") if r in rank_ph else contextlib.nullcontext()
        if repeat:
            with ctx:
                data = _dumps(proto.unchanged_plan())
        elif g in by_group and r not in rank_ph:
            data = by_group[g]
        else:
            with ctx:
                w = FileSystemWriter(directory, sync_files=False)
                plan, planner = proto.local_plan(r, w, caching=True)
                data = _dumps(plan)
            by_group.setdefault(g, data)
            if r == 0:
                planner0 = planner
        wires1[r] = data
    by_group.clear()
    if planner0 is None:
        planner0 = state["planner0"]
    state["planner0"] = planner0
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    wire.add("plan", "gather", [len(w) for w in wires1])
    with ph("g1_decode"):
        gathered = [_loads(w) for w in wires1]
    wires1 = None
    with ph("plan"):
        plans, metadata = proto.coordinate(planner0, writer, gathered)
    del gathered
    with ph("s1_encode"):
        wires2 = [_dumps(p) for p in plans]
    del plans
    wire.add("assign", "scatter", [len(w) for w in wires2])
    wires3: list = [None] * R
    finals = state.setdefault("final", {})
    for r in range(R):
        ctx = rank_ph[r]("reply_decode") if r in rank_ph else contextlib.nullcontext()
        with ctx:
            central = _loads(wires2[r])
        ctx = rank_ph[r]("layout") if r in rank_ph else contextlib.nullcontext()
        with ctx:
            # finish_plan: the cached final plan when the delta is empty
            final = central if central.usable else _loads(finals[r])
            wires3[r] = _dumps(proto.write_results(final))
        if central.usable:  # kept as its bytes (rank 0 of a real job holds one)
            finals[r] = wires2[r]
    wires2 = None
    wire.add("results", "gather", [len(w) for w in wires3])
    with ph("g2_decode"):
        results = [_loads(w) for w in wires3]
    wires3 = None
    with ph("commit"):
        metadata = proto.finish(writer, metadata, results)
    del results
    with ph("b_encode"):
        wire4 = _dumps(metadata)
    wire.add("metadata", "broadcast", [len(wire4)])
    with rank_ph[other]("b_decode"):
        _loads(wire4)
    del wire4
    return {"rank0": ph.as_dict(), "rank0_local": rank_ph[0].as_dict(),
            "other_local": rank_ph[other].as_dict(), "other": other,
            "collectives": wire.summary(other),
            "metadata_bytes": os.path.getsize(os.path.join(directory, ".metadata"))}


# ---------------------------------------------------------------- loads

def _patched_local_chunk(chunks: dict):
    """dcpx.coordination.dist.local_chunk for the stand-ins: (target, offsets, sizes) of the
    rank's chunk, the target a zero-memory view of the chunk's shape."""
    from dcpx.coordination import dist as _dist
    real = _dist.local_chunk

    def local_chunk(obj):
        c = chunks.get(id(obj))
        if c is None:
            return real(obj)
        return c
    return real, local_chunk


def dcpx_load_rank(model: Model, r: int, directory: str, keep_reads: bool = False) -> dict:
    """Rank r's work at a dcpx load before any tensor byte is read: what
    ``_dist.load`` -> ``load_flat`` -> ``_load_flat`` do (cold caches).
    ``keep_reads``: also return the reads, (key, chunk, offset, length) sorted."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from dcpx.coordination import (
        dist as _dist,
        gcpause as _gc,
        plan as _plan,
        readplan as _readplan,
    )
    from dcpx.formats.legacy import legacy_layout
    from dcpx.storage.reader import FileSystemReader
    _readplan.clear()
    chunks: dict = {}

    def leaf(i):
        off, sz = model.chunk(i, r)
        t = _sim_shard(model.shapes[i], model.dtypes[i],
                       ChunkStorageMetadata(torch.Size(off), torch.Size(sz)))
        target = torch.empty((), dtype=model.dtypes[i]).expand(sz)
        chunks[id(t)] = (target, torch.Size(off), torch.Size(sz))
        return t
    original = model.nested(leaf)
    from dcpx.coordination.flatten import flatten_state_dict
    flat, _ = flatten_state_dict(original)
    real, fake = _patched_local_chunk(chunks)
    ph = Phases()
    _dist.local_chunk = fake
    try:
        with FsCounter() as fs, _gc.paused_gc():
            reader = FileSystemReader(directory)
            with ph("open"):
                ck = _dist.open_checkpoint(reader, r, r == 0)
                ck.key_count()
            with ph("plan"):
                legacy = legacy_layout(original, flat, ck.byte_info())
                f = flat if legacy is None else legacy[0]
                f = _plan.in_mesh(f)
                key = None if ck.no_plan else (tuple(f), False)
                plan = None if key is None else _readplan.get_plan(ck, key)
                if plan is None and key is not None:
                    plan = _readplan.direct_plan(reader, ck, f, False, key)
                if plan is not None:
                    raise RuntimeError("simulated load: a direct plan for DTensor stand-ins")
                # plan_reads, and the data files of its reads checked
                # (before issue 28 item 4: every file, at open_checkpoint)
                reads, _, serial = _dist.plan_checked(reader, ck, f, False)
            decoder = ("load index" if getattr(ck, "lidx", None) is not None
                       else "C (mdindex)" if ck.index is not None else "Python")
    finally:
        _dist.local_chunk = real
    out = ph.as_dict()
    out.update(fs.as_dict())
    out.update(reads=len(reads) + len(serial), decoder=decoder)
    if keep_reads:
        out["read_list"] = sorted((x.key, tuple(x.chunk), x.info.offset, x.info.length)
                                  for x in reads + serial)
        out["infos"] = [x.info for x in reads + serial]
    return out


def torch_load_rank(model: Model, r: int, directory: str) -> tuple:
    """Rank r's work at a torch DCP load before its collectives: read and unpickle
    ``.metadata``, set up the planner, make its LoadPlan.  (result, pickled plan)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def leaf(i):
        off, sz = model.chunk(i, r)
        if model.kind == "ddp":
            return torch.empty((), dtype=model.dtypes[i]).expand(model.shapes[i])
        return _sim_shard(model.shapes[i], model.dtypes[i],
                          ChunkStorageMetadata(torch.Size(off), torch.Size(sz)))
    sd = model.nested(leaf)
    ph = Phases()
    with FsCounter() as fs:
        reader = FileSystemReader(directory)
        with ph("open"):
            md = reader.read_metadata()
        with ph("plan"):
            planner = DefaultLoadPlanner()
            planner.set_up_planner(sd, md, r == 0)
            reader.set_up_storage_reader(md, r == 0, rank=r, use_collectives=True)
            plan = reader.prepare_local_plan(planner.create_local_plan())
            data = _dumps(plan)
    out = ph.as_dict()
    out.update(fs.as_dict())
    out.update(reads=len(plan.items), decoder="Python (pickle)")
    return out, data


def torch_load_coordinator(R: int, sample: bytes) -> dict:
    """Rank 0's part of torch's load: unpickle R LoadPlans, its global step, pickle
    R plans back.  The plans of R ranks are R copies of one rank's (a non-zero
    rank's: FSDP2 / HSDP ranks' plans are alike in size and shape)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    ph = Phases()
    with ph("g1_decode"):
        plans = [_loads(sample) for _ in range(R)]
    with ph("plan"):
        plans = DefaultLoadPlanner().create_global_plan(plans)
        plans = FileSystemReader("/nonexistent").prepare_global_plan(plans)
    with ph("s1_encode"):
        for p in plans:
            _dumps(p)
    return ph.as_dict()


# ---------------------------------------------------------------- one row

def run_row(lib: str, kind: str, R: int, T: int, group: int, dims: str, workdir: str,
            profile: bool = False, load: bool = True) -> dict:
    """The saves (first, repeated; dcpx: also steady-state) and the loads of one
    library for one row, in this process (run it in a fresh one: caches, memory
    high-water mark)."""
    model = make_model(kind, R, T, group, dims)
    fresh_caches()
    base_rss = _rss_mib()
    out: dict = {"lib": lib, "kind": kind, "ranks": R, "tensors": T, "group": model.group,
                 "dims": dims, "chunks_items": R * T,
                 "chunks_distinct": T * model.shard}
    state: dict = {}
    d1, d2 = os.path.join(workdir, "save1"), os.path.join(workdir, "save2")
    d3 = os.path.join(workdir, "save3")
    prof = cProfile.Profile() if profile else None
    if lib == "dcpx":
        out["first"] = dcpx_save(model, d1, state, prof)
        prof2 = cProfile.Profile() if profile else None
        out["repeat"] = dcpx_save(model, d2, state, prof2, repeat=True)
        prof3 = cProfile.Profile() if profile else None
        out["steady"] = dcpx_save(model, d3, state, prof3, steady=True)
        shutil.rmtree(d3, ignore_errors=True)
        if profile:
            out["profile_first"] = _top(prof)
            out["profile_repeat"] = _top(prof2)
            out["profile_steady"] = _top(prof3)
    else:
        out["first"] = torch_save(model, d1, state)
        out["repeat"] = torch_save(model, d2, state, repeat=True)
    state.clear()
    if load:
        other = _other_rank(R)
        if lib == "dcpx":
            # the process's one-time setup of dcpx's metadata reader (its
            # allow-list, the C decoder's tables) is not counted against rank 0
            from dcpx.formats import metadata as _metadata
            _metadata.index(b"", "warm-up")
            prof4 = cProfile.Profile() if profile else None
            rank0 = dcpx_load_rank(model, 0, d2)
            if prof4 is not None:
                prof4.enable()
            out["load"] = {"rank0": rank0, "other": dcpx_load_rank(model, other, d2)}
            if prof4 is not None:
                prof4.disable()
                out["profile_load"] = _top(prof4)
            w = Wire(R)
            w.add("status", "all_gather", [len(_dumps(("ok",)))] * R)
            out["load"]["collectives"] = w.summary(other)
        else:
            r0, d0 = torch_load_rank(model, 0, d2)
            ro, do = torch_load_rank(model, other, d2)
            w = Wire(R)
            sizes = [len(d0)] + [len(do)] * (R - 1)
            w.add("plan", "gather", sizes)
            w.add("plan", "scatter", sizes)
            out["load"] = {"rank0": r0, "other": ro, "collectives": w.summary(other),
                           "coordinator": torch_load_coordinator(R, do)}
    out["peak_rss_mib"] = _rss_mib() - base_rss
    return out


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _top(prof: cProfile.Profile, n: int = 15) -> str:
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(n)
    text = s.getvalue()
    # keep the table, drop the header lines
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.strip().startswith("ncalls")), 0)
    return "\n".join(l for l in lines[start:] if l.strip())


def run_row_subprocess(args: dict, timeout: float, inprocess: bool = False) -> dict:
    """``run_row`` in a fresh interpreter (``inprocess``: in this one, its peak
    memory not measured); its result, or an error record."""
    workdir = tempfile.mkdtemp(prefix="dcpx-bench-scale-")
    try:
        if inprocess:
            t0 = time.perf_counter()
            res = run_row(args["lib"], args["kind"], args["ranks"], args["tensors"],
                          args["group"], args.get("dims", "real"), workdir,
                          args.get("profile", False), not args.get("no_load", False))
            res.update(series=args.get("series"), tensors_asked=args.get("tensors_asked"),
                       row_seconds=time.perf_counter() - t0, peak_rss_mib=None)
            return res
        spec = dict(args, workdir=workdir)
        cmd = [sys.executable, os.path.abspath(__file__), "--_row", json.dumps(spec)]
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", "1")
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return dict(args, error=f"did not finish in {timeout:.0f} s")
        if p.returncode != 0:
            return dict(args, error=f"exit {p.returncode}: {p.stderr[-3000:]}")
        res = json.loads(p.stdout.strip().splitlines()[-1])
        res["row_seconds"] = time.perf_counter() - t0
        return res
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------- real gloo runs

def fresh_caches() -> None:
    """Forget what earlier saves of this process left for the next: dcpx's plan
    exchange (each rank's last plan, the coordinator's global plans) and torch's
    plan caching (class-level dicts of SavePlanner)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    from dcpx.coordination import dist as _dist
    _dist.clear_exchange_cache()
    # The "repeat" save simulated here is the exchange by digest, with
    # steady-state saves off, as the real runs' "dcpx" saves take it;
    # dcpx_save(steady=True) and the real runs' "dcpx_steady" turn them on.
    _dist.steady_state_enabled = False
    for name in dir(SavePlanner):
        if name.startswith("_cached") and isinstance(getattr(SavePlanner, name), dict):
            getattr(SavePlanner, name).clear()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_state_dict(model: Model, rank: int, mesh) -> dict:
    """The model with tiny tensors: DTensors on ``mesh`` (fsdp2, hsdp) or plain."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def leaf(i):
        off, sz = model.chunk(i, rank)
        local = torch.full(sz, float(i), dtype=model.dtypes[i])
        if model.kind == "ddp":
            return local
        placements = [Shard(0)] if model.kind == "fsdp2" else [Replicate(), Shard(0)]
        shape = model.shapes[i]
        stride = tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=torch.Size(shape), stride=stride)
    return model.nested(leaf)


class _Hooks:
    """Rank 0's phases in a real save, timed by wrapping the functions the
    simulation calls: torch's object (un)pickling per collective, dcpx's
    ``_coordinate`` / ``_commit``, torch's global step and ``finish``."""

    def __init__(self, lib: str) -> None:
        self.lib = lib
        self.coll = None
        self.ph = Phases()
        self.sizes: list = []   # (collective, bytes sent by this rank / per message)
        self._undo: list = []

    def _patch(self, obj, name, wrapper) -> None:
        old = getattr(obj, name)
        self._undo.append((obj, name, old))
        setattr(obj, name, wrapper(old))

    def install(self) -> None:
        from torch.distributed import distributed_c10d as c10d
        hooks = self
        names = {"gather1": ("g1_decode", None), "scatter1": (None, "s1_encode"),
                 "gather2": ("g2_decode", None), "bcast": (None, "b_encode")}

        def to_tensor(old):
            def f(obj, *a, **kw):
                phase = names.get(hooks.coll, (None, None))[1]
                ctx = hooks.ph(phase) if phase else contextlib.nullcontext()
                with ctx:
                    out = old(obj, *a, **kw)
                hooks.sizes.append((hooks.coll, int(out[1].item())))
                return out
            return f

        def to_object(old):
            def f(*a, **kw):
                phase = names.get(hooks.coll, (None, None))[0]
                ctx = hooks.ph(phase) if phase else contextlib.nullcontext()
                with ctx:
                    return old(*a, **kw)
            return f
        self._patch(c10d, "_object_to_tensor", to_tensor)
        self._patch(c10d, "_tensor_to_object", to_object)

        def timed(phase):
            def wrap(old):
                def f(*a, **kw):
                    with hooks.ph(phase):
                        return old(*a, **kw)
                return f
            return wrap

        if self.lib == "dcpx":
            from dcpx.coordination import dist as _dist
            seq = {"gather": ["gather1", "gather2"], "scatter": ["scatter1"],
                   "broadcast": ["bcast"], "all_gather": ["status"]}
            self._named_collectives(_dist._Group, seq)
            self._patch(_dist, "_coordinate", timed("plan"))
            self._patch(_dist, "disagreeing_paths", timed("plan"))
            self._patch(_dist, "_commit", timed("commit"))
            self._patch(_dist, "_commit_steady", timed("commit"))
        else:
            from torch.distributed.checkpoint import default_planner, filesystem, utils
            seq = {"gather_object": ["gather1", "gather2"], "scatter_object": ["scatter1"],
                   "broadcast_object": ["bcast"], "all_gather_object": ["status"]}
            self._named_collectives(utils._DistWrapper, seq)
            self._patch(default_planner.DefaultSavePlanner, "create_global_plan", timed("plan"))
            self._patch(filesystem.FileSystemWriter, "prepare_global_plan", timed("plan"))
            self._patch(filesystem.FileSystemWriter, "finish", timed("commit"))

    def _named_collectives(self, cls, seq: dict) -> None:
        hooks = self
        counters = {k: 0 for k in seq}
        self._counters = counters

        def wrap(name):
            def w(old):
                def f(*a, **kw):
                    names = seq[name]
                    hooks.coll = names[min(counters[name], len(names) - 1)]
                    counters[name] += 1
                    try:
                        return old(*a, **kw)
                    finally:
                        hooks.coll = None
                return f
            return w
        for name in seq:
            self._patch(cls, name, wrap(name))

    def reset(self) -> None:
        self.ph = Phases()
        self.sizes = []
        for k in self._counters:
            self._counters[k] = 0

    def uninstall(self) -> None:
        for obj, name, old in reversed(self._undo):
            setattr(obj, name, old)
        self._undo.clear()


def _real_rank(rank: int, ws: int, port: int, spec: dict, root: str, out: str) -> None:
    """One rank of a real run: dcpx's saves and load, then torch's (plan caching on),
    rank 0's phases timed as the simulation times them."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    try:
        model = make_model(spec["kind"], ws, spec["tensors"], spec["group"], spec["dims"])
        mesh = None
        if model.kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (ws,))
        elif model.kind == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (ws // model.group, model.group))
        sd = _real_state_dict(model, rank, mesh)
        res: dict = {}
        for lib in spec["libs"]:
            hooks = _Hooks("dcpx" if lib == "dcpx_steady" else lib)
            hooks.install()
            try:
                res[lib] = _real_saves(lib, sd, hooks, root, rank, spec["saves"])
            finally:
                hooks.uninstall()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _real_saves(lib: str, sd: dict, hooks: _Hooks, root: str, rank: int, saves: int) -> dict:
    """``saves`` saves of ``sd`` by ``lib`` into ``root/save1``, ``save2``, ... (the
    simulation's directory names: messages that carry the path are of the same
    size), removed afterwards.  ``dcpx``: steady-state saves off (the repeated
    saves take the exchange by digest); ``dcpx_steady``: on, from a fresh
    exchange cache (the repeated saves take the steady-state path; each save
    records whether it did, from ``dist.STEADY_SAVES``)."""
    import torch.distributed as dist
    import warnings
    from dcpx.coordination import dist as _dist
    out: dict = {"saves": []}
    if lib == "dcpx_steady":
        _dist.clear_exchange_cache()
    _dist.steady_state_enabled = lib == "dcpx_steady"
    for it in range(saves):
        path = os.path.join(root, f"save{it + 1}")
        hooks.reset()
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        steady0 = _dist.STEADY_SAVES[0]
        if lib.startswith("dcpx"):
            import dcpx
            dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(path, sync_files=False))
        else:
            import torch.distributed.checkpoint as dcp
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=False),
                         planner=TorchProtocol.planner(True))
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        out["saves"].append({"phases": hooks.ph.as_dict(), "sizes": hooks.sizes,
                             "total": total, "cpu": cpu,
                             "steady": _dist.STEADY_SAVES[0] - steady0,
                             "metadata_bytes": os.path.getsize(os.path.join(path, ".metadata"))
                             if rank == 0 else None})
    _dist.steady_state_enabled = False
    dist.barrier()
    if rank == 0:
        for it in range(saves):
            shutil.rmtree(os.path.join(root, f"save{it + 1}"), ignore_errors=True)
    dist.barrier()
    return out


def run_real(W: int, kind: str, T: int, group: int, dims: str, libs: list, saves: int,
             timeout: float) -> dict:
    """A real run of W gloo ranks; per rank its timings (rank 0's phases)."""
    import torch.multiprocessing as mp
    root = tempfile.mkdtemp(prefix="dcpx-bench-scale-")  # as the simulation's
    out = tempfile.mkdtemp(prefix="dcpx-bench-scale-real-out-")
    spec = {"kind": kind, "tensors": T, "group": group, "dims": dims, "libs": libs,
            "saves": saves}
    try:
        ctx = mp.start_processes(_real_rank, args=(W, _free_port(), spec, root, out),
                                 nprocs=W, join=False, start_method="spawn")
        t0 = time.time()
        while not ctx.join(timeout=5):
            if time.time() - t0 > timeout:
                for p in ctx.processes:
                    p.kill()
                raise RuntimeError(f"real run W={W} {kind}: no result in {timeout:.0f} s")
        return {r: json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(W)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


# ---------------------------------------------------------------- network model

def net_seconds(colls: list, R: int, bw: float, lat: float, tree: bool) -> float:
    """Seconds the collectives of one save (``Wire.summary`` rows) take on the
    network; bw in bytes/s, lat in s a message.

    ``tree`` False: gloo's algorithms (gloo/gather.cc, scatter.cc: rank 0 posts one
    message per rank; allgather.cc: a ring, 2 (R-1) half-chunk steps;
    broadcast.cc: a binomial tree, ceil(log2 R) steps each moving the whole
    buffer).  ``tree`` True: log-depth everywhere (ceil(log2 R) latencies; a
    gather / scatter still moves every byte through rank 0; a pipelined
    broadcast, 2 x bytes / bandwidth).  Each object collective first exchanges
    8-byte sizes: an all_gather (gather_object) or a broadcast
    (scatter_object_list, broadcast_object_list).  An all_reduce (dcpx's
    16-byte steady-state checks): gloo's ring, 2 (R-1) latencies; tree: 2
    log2 R."""
    steps = max(1, math.ceil(math.log2(max(R, 2))))

    def allgather(nbytes_in: float) -> float:
        return (steps if tree else 2 * (R - 1)) * lat + nbytes_in / bw

    def bcast(nbytes: float) -> float:
        return steps * lat + 2 * nbytes / bw if tree else steps * (lat + nbytes / bw)

    t = 0.0
    for c in colls:
        kind = c["kind"]
        if kind == "gather":
            t += allgather(8 * (R - 1))
            t += (steps if tree else R - 1) * lat + c["rank0_in_wire"] / bw
        elif kind == "scatter":
            t += bcast(8)
            t += (steps if tree else R - 1) * lat + c["rank0_out_wire"] / bw
        elif kind == "broadcast":
            t += bcast(8) + bcast(c["other_in_wire"])
        elif kind == "all_gather":
            t += allgather(8 * (R - 1)) + allgather(c["rank0_in_wire"])
        elif kind == "all_reduce":
            # gloo: a ring, 2 (R-1) steps; tree: reduce then broadcast, 2 log2 R
            t += (2 * steps if tree else 2 * (R - 1)) * lat + c["rank0_in_wire"] / bw
    return t


def save_seconds(save: dict, R: int, bw: float, lat: float, tree: bool) -> float:
    """One save's coordination seconds: the slower rank's local plan, every
    collective, rank 0's phases, the ranks' decode of the broadcast."""
    local = max(save["rank0_local"]["cpu_total"] - save["rank0_local"]["cpu"].get("b_decode", 0),
                save["other_local"]["cpu_total"] - save["other_local"]["cpu"].get("b_decode", 0))
    return (local + save["rank0"]["cpu_total"] + save["other_local"]["cpu"].get("b_decode", 0)
            + net_seconds(save["collectives"], R, bw, lat, tree))


# ---------------------------------------------------------------- the run

def _rows(args) -> list:
    """(kind, R, T asked, T run) per row."""
    rows = []
    if args.rows:
        for spec in args.rows.split(","):
            kind, R, T = spec.split(":")
            rows.append((kind, int(R), int(T)))
    else:
        ranks = [int(x) for x in args.ranks.split(",")]
        if args.constant_chunks:
            for R in ranks:
                T = max(3, (args.constant_chunks // R) // 3 * 3)
                rows.append(("fsdp2", R, T, "const"))
        for kind in args.kinds.split(","):
            for T in [int(x) for x in args.tensors.split(",")]:
                for R in ranks:
                    if kind == "hsdp" and R % args.group:
                        continue
                    rows.append((kind, R, T))
    out, seen = [], {}
    for row in rows:
        kind, R, T = row[:3]
        series = row[3] if len(row) > 3 else f"T={T}"
        run_T = T
        if R * T > args.max_items:
            run_T = max(3, (args.max_items // R) // 3 * 3)
        prev = seen.get((kind, R, run_T))
        if prev is not None:  # two series scaled down to the same row: run it once
            prev["series"] += f", {series}"
            prev["tensors_asked"] = max(prev["tensors_asked"], T)
            continue
        seen[(kind, R, run_T)] = row = {"series": series, "kind": kind, "ranks": R,
                                        "tensors_asked": T, "tensors": run_T}
        out.append(row)
    return out


def _machine() -> dict:
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=REPO).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=REPO).stdout.strip()
    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "commit": git + ("-dirty" if dirty else ""), "loadavg_before": _load_avg(),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "workdir_fs": _file_system(tempfile.gettempdir())}


def _file_system(path: str) -> str:
    """The type of the file system that holds ``path`` (its mount point's
    entry in /proc/mounts): the checkpoints of the simulation go there."""
    best = ("", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2:
                    mnt = parts[1]
                    if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) \
                            and len(mnt) > len(best[0]):
                        best = (mnt, parts[2])
    except OSError:
        pass
    return f"{best[1]} at {best[0] or '?'}"


def _load_avg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def _fmt_s(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f} s"
    if x >= 1:
        return f"{x:.2f} s"
    return f"{x * 1000:.1f} ms" if x >= 0.001 else f"{x * 1e6:.0f} us"


def _fmt_b(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n:.0f} B"


def markdown(report: dict) -> str:
    L = ["# Checkpoint coordination at scale: dcpx vs torch DCP (simulated)", "",
         f"- command: `{report['command']}`"]
    if report.get("rendered"):
        L.append(f"- network model and tables redone by `{report['rendered']}`")
    L += [
         f"- started {report['started']}, commit {report['machine']['commit']}, torch "
         f"{report['machine']['torch']}, Python {report['machine']['python']}, "
         f"{report['machine']['cpus']} CPUs, {report['machine']['mem_gib']} GiB",
         f"- load average before / after: {report['machine']['loadavg_before']} / "
         f"{report['machine'].get('loadavg_after', '?')}",
         f"- checkpoints written to: {report['machine'].get('workdir_fs', 'not recorded')} "
         f"(the file system under TMPDIR)",
         f"- times are rank 0's CPU seconds (`process_time`) per phase on this machine; rows "
         f"whose R x T exceeds {report['max_items']:,} chunks run with fewer tensors per rank "
         f"(column T: asked -> run, both libraries alike)", ""]
    rows = report["rows"]
    by = {}
    for r in rows:
        by.setdefault((r.get("series"), r["kind"], r["ranks"], r.get("tensors")), {})[r["lib"]] = r
    L += ["## Rank 0's work per save", "",
          "dcpx, same plan by digest: the full exchange with each unchanged plan sent as its "
          "digest (steady-state saves off, or a rank whose files or layout differ); dcpx "
          "steady: the steady-state save of an unchanged plan (the default).", "",
          "| series | shape | ranks | T (asked -> run) | chunks | torch first | torch, plan "
          "caching | dcpx first | dcpx, same plan by digest | dcpx steady | torch / dcpx first "
          "| torch cached / dcpx digest | torch cached / dcpx steady | `.metadata` torch / dcpx "
          "| peak RSS torch / dcpx |",
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: | ---: | ---: |"]
    for (series, kind, R, T), libs in by.items():
        d, t = libs.get("dcpx"), libs.get("torch")
        asked = (d or t)["tensors_asked"]
        tcol = f"{asked}" if asked == T else f"{asked} -> {T}"
        chunks = (d or t)["chunks_items"]

        def cell(x, k):
            if x is None:
                return "-"
            if "error" in x:
                return "error"
            if k not in x:
                return "-"
            return _fmt_s(x[k]["rank0"]["cpu_total"])

        def ratio(k1, k2):
            if not d or not t or "error" in d or "error" in t or k2 not in d:
                return "-"
            return f"{t[k1]['rank0']['cpu_total'] / max(d[k2]['rank0']['cpu_total'], 1e-9):.1f}x"
        md_t = _fmt_b(t["first"]["metadata_bytes"]) if t and "error" not in t else "-"
        md_d = _fmt_b(d["first"]["metadata_bytes"]) if d and "error" not in d else "-"
        rss_t = (f"{t['peak_rss_mib']:.0f}" if t and "error" not in t
                 and t.get("peak_rss_mib") is not None else "-")
        rss_d = (f"{d['peak_rss_mib']:.0f} MiB" if d and "error" not in d
                 and d.get("peak_rss_mib") is not None else "-")
        L.append(f"| {series} | {kind} | {R:,} | {tcol} | {chunks:,} | {cell(t, 'first')} | "
                 f"{cell(t, 'repeat')} | {cell(d, 'first')} | {cell(d, 'repeat')} | "
                 f"{cell(d, 'steady')} | {ratio('first', 'first')} | {ratio('repeat', 'repeat')} "
                 f"| {ratio('repeat', 'steady')} | {md_t} / {md_d} | "
                 f"{rss_t} / {rss_d} |")
    L += ["", "Errors:" if any("error" in r for r in rows) else ""]
    for r in rows:
        if "error" in r:
            L.append(f"- {r['lib']} {r['kind']} R={r['ranks']} T={r['tensors']}: "
                     f"{r['error'][-400:]}")
    L += ["", "## Where rank 0's time goes (CPU seconds per phase: gather-1 decode, plan, "
          "scatter encode, gather-2 decode, commit, broadcast encode)", "",
          "| shape | ranks | T | lib | save | g1_decode | plan | s1_encode | g2_decode | commit "
          "| b_encode | total | of which cyclic GC (wall) |", "| --- | ---: | ---: | --- | --- "
          "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (series, kind, R, T), libs in by.items():
        for lib in ("torch", "dcpx"):
            x = libs.get(lib)
            if not x or "error" in x:
                continue
            for k in [k for k in ("first", "repeat", "steady") if k in x]:
                c = x[k]["rank0"]["cpu"]
                L.append(f"| {kind} | {R:,} | {T} | {lib} | {k} | " + " | ".join(
                    _fmt_s(c.get(p, 0.0)) for p in ("g1_decode", "plan", "s1_encode",
                                                    "g2_decode", "commit", "b_encode"))
                    + f" | {_fmt_s(x[k]['rank0']['cpu_total'])} | "
                    f"{_fmt_s(x[k]['rank0'].get('gc_total', 0.0))} |")
    copies = [(kind, R, T, x) for (series, kind, R, T), libs in by.items()
              for x in [libs.get("dcpx")] if x and "steady" in x
              and x["steady"].get("middle_copy")]
    if copies:
        L += ["", "## dcpx's steady-state commit: what moving the encoded middle costs", "",
              "Rank 0 writes the names and storage_meta, and the kernel copies the encoded "
              "middle from the last `.metadata` that holds it (`copy_file_range`: a page-cache "
              "copy on ext4, a reflink on XFS or btrfs, a server-side copy on NFS 4.2; from "
              "memory where it cannot).  The rest is what grows with ranks only: file names, "
              "the directory's cleanup.", "",
              "| shape | ranks | T | `.metadata` | commit CPU | of which the copy, CPU / wall | "
              "bytes copied by the kernel / from memory | commit CPU less the copy |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for kind, R, T, x in copies:
            st = x["steady"]
            c = st["middle_copy"]
            commit = st["rank0"]["cpu"].get("commit", 0.0)
            L.append(f"| {kind} | {R:,} | {T} | {_fmt_b(st.get('metadata_bytes'))} | "
                     f"{_fmt_s(commit)} | {_fmt_s(c['cpu'])} / {_fmt_s(c['wall'])} | "
                     f"{_fmt_b(c['copied'])} / {_fmt_b(c['written'])} | "
                     f"{_fmt_s(max(0.0, commit - c['cpu']))} |")
    if report.get("copy_probe"):
        L += ["", "## The steady-state commit at sizes too large to simulate", "",
              "`--copy-probe`: a `.metadata` of 160 kB of names (4,096 ranks' file names), a "
              "middle of the given size (random bytes, not a checkpoint) and a tail, committed "
              "once from memory and synced (as `sync_files=True` leaves the last save's file), "
              "then again as a steady-state save commits it, unsynced: the middle copied from "
              "the first file.  4,096 ranks x 2,400 tensors (9.8 million chunks) "
              "make a middle of about 1.4 GB at the ~144 bytes a chunk measured above.", "",
              "| middle | commit CPU | commit wall | bytes copied by the kernel / from memory "
              "| the copy's bytes right |", "| ---: | ---: | ---: | ---: | --- |"]
        for p in report["copy_probe"]:
            L.append(f"| {_fmt_b(p['mb'] * 1e6)} | {_fmt_s(p['cpu'])} | {_fmt_s(p['wall'])} | "
                     f"{_fmt_b(p['copied'])} / {_fmt_b(p['written'])} | "
                     f"{'yes' if p['same'] else 'NO'} |")
    L += ["", "## Each rank's own work per save (CPU: rank 0 / rank k): its plan message, "
          "taking its reply, its write report, decoding the broadcast", "",
          "| shape | ranks | T | lib | save | local plan | reply | write report | decode "
          "broadcast |", "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    for (series, kind, R, T), libs in by.items():
        for lib in ("torch", "dcpx"):
            x = libs.get(lib)
            if not x or "error" in x:
                continue
            for k in [k for k in ("first", "repeat", "steady") if k in x]:
                a, b = x[k]["rank0_local"]["cpu"], x[k]["other_local"]["cpu"]
                L.append(f"| {kind} | {R:,} | {T} | {lib} | {k} | " + " | ".join(
                    f"{_fmt_s(a.get(p, 0.0))} / {_fmt_s(b.get(p, 0.0))}"
                    for p in ("local", "reply_decode", "layout")) + f" | {_fmt_s(b.get('b_decode'))} |")
    L += ["", "## Bytes per collective (payload; rank 0 in / out, rank k in / out; the largest "
          "message; rank k is R/2+1)", "",
          "| shape | ranks | T | lib | save | collective | rank 0 in | rank 0 out | rank k in | "
          "rank k out | largest message | rank 0 in + out, wire |",
          "| --- | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (series, kind, R, T), libs in by.items():
        if series not in ("T=300", "T=2400", None) and not series.startswith("T="):
            continue
        for lib in ("torch", "dcpx"):
            x = libs.get(lib)
            if not x or "error" in x:
                continue
            for k in [k for k in ("first", "repeat", "steady") if k in x]:
                for c in x[k]["collectives"]:
                    L.append(f"| {kind} | {R:,} | {T} | {lib} | {k} | {c['kind']} {c['name']} | "
                             f"{_fmt_b(c['rank0_in'])} | {_fmt_b(c['rank0_out'])} | "
                             f"{_fmt_b(c['other_in'])} | {_fmt_b(c['other_out'])} | "
                             f"{_fmt_b(c['max_msg'])} | "
                             f"{_fmt_b(c['rank0_in_wire'] + c['rank0_out_wire'])} |")
    L += ["", "## Each rank's work at load (before reading tensor data; cold caches)", "",
          "| shape | ranks | T | chunks / rank | lib | rank | decoder | open + decode | find own "
          "chunks | total | bytes read | fs calls (lstat) | torch: rank 0's load "
          "coordination |",
          "| --- | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (series, kind, R, T), libs in by.items():
        for lib in ("torch", "dcpx"):
            x = libs.get(lib)
            if not x or "error" in x or "load" not in x:
                continue
            ld = x["load"]
            for who in ("rank0", "other"):
                y = ld[who]
                coord = (_fmt_s(ld["coordinator"]["cpu_total"])
                         if lib == "torch" and who == "rank0" else "")
                L.append(f"| {kind} | {R:,} | {T} | {T} | {lib} | "
                         f"{'0' if who == 'rank0' else 'k'} | {y['decoder']} | "
                         f"{_fmt_s(y['cpu'].get('open', 0))} | {_fmt_s(y['cpu'].get('plan', 0))} | "
                         f"{_fmt_s(y['cpu_total'])} | {_fmt_b(y['bytes_read'])} | "
                         f"{y['fs_ops']:,} ({y['by_call']['lstat']:,}) | {coord} |")
    if report.get("network"):
        L += ["", "## Seconds per save under the network model (coordination only; data "
              "writing excluded)", "", report["network"]["text"], ""]
        L += ["| shape | ranks | T | network | collectives | torch first | torch, plan caching "
              "| dcpx first | dcpx, same plan by digest | dcpx steady |",
              "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for row in report["network"]["rows"]:
            L.append(f"| {row['kind']} | {row['ranks']:,} | {row['tensors']} | {row['net']} | "
                     f"{row['topology']} | {_fmt_s(row.get('torch_first'))} | "
                     f"{_fmt_s(row.get('torch_repeat'))} | {_fmt_s(row.get('dcpx_first'))} | "
                     f"{_fmt_s(row.get('dcpx_repeat'))} | {_fmt_s(row.get('dcpx_steady'))} |")
    prof = [r for r in rows if r.get("profile_first")]
    if prof:
        L += ["", "## cProfile of dcpx's rank-0 phases (top functions by own time)", ""]
        for r in prof:
            for k in [k for k in ("first", "repeat", "steady", "load") if f"profile_{k}" in r]:
                what = "rank k's load" if k == "load" else f"{k} save"
                L += [f"### {r['kind']} R={r['ranks']:,} T={r['tensors']}: {what}", "",
                      "```", r[f"profile_{k}"], "```", ""]
    return "\n".join(L) + "\n"


def network_table(rows: list, args) -> dict:
    nets = [("IB", args.bw_gbs * 1e9, args.lat_us * 1e-6),
            ("TCP", args.tcp_bw_gbs * 1e9, args.tcp_lat_us * 1e-6)]
    by: dict = {}
    for r in rows:
        if "error" in r or r["ranks"] not in (1024, 4096, 16384):
            continue
        by.setdefault((r.get("series"), r["kind"], r["ranks"], r["tensors"]), {})[r["lib"]] = r
    out = []
    for (series, kind, R, T), libs in by.items():
        for net, bw, lat in nets:
            for tree in (False, True):
                row = {"series": series, "kind": kind, "ranks": R, "tensors": T, "net": net,
                       "topology": "tree" if tree else "gloo"}
                for lib, x in libs.items():
                    for k in ("first", "repeat", "steady"):
                        if k in x:
                            row[f"{lib}_{k}"] = save_seconds(x[k], R, bw, lat, tree)
                out.append(row)
    text = (f"IB: {args.bw_gbs} GB/s into / out of rank 0, {args.lat_us} us a message (a 200 "
            f"Gb/s NIC per node; 5-20 us a small message through a software stack); TCP (gloo "
            f"over TCP, a worse case): {args.tcp_bw_gbs} GB/s (10 GbE), {args.tcp_lat_us} us.  "
            f"gloo: the algorithms gloo runs (gather and scatter: rank 0 exchanges a message "
            f"with each rank, R-1 latencies; all_gather: a ring, 2 (R-1) latencies; broadcast: "
            f"a binomial tree, ceil(log2 R) steps that each move the whole message).  tree: "
            f"log-depth collectives (ceil(log2 R) latencies; rank 0 still moves every byte of "
            f"a gather or scatter; a pipelined broadcast, 2 x bytes / bandwidth).  Each object "
            f"collective first exchanges 8-byte sizes (an all_gather or a broadcast).  An "
            f"all_reduce (dcpx's 16-byte steady-state checks, one in every save, two in a "
            f"steady-state save): gloo's ring, 2 (R-1) latencies; tree: 2 log2 R.  Seconds = "
            f"the slower of rank 0's and rank k's local plan + rank 0's CPU phases (this "
            f"machine) + the network + rank k's decode of the broadcast (torch's ranks unpickle "
            f"the whole Metadata; dcpx's take bytes); writing data excluded.")
    return {"text": text, "rows": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="64,256,1024,4096,16384")
    ap.add_argument("--tensors", default="300,2400", help="tensors per rank (multiples of 3)")
    ap.add_argument("--kinds", default="fsdp2,hsdp,ddp")
    ap.add_argument("--group", type=int, default=8, help="HSDP's shard group")
    ap.add_argument("--constant-chunks", type=int, default=100_000,
                    help="also an FSDP2 series with about this many chunks a row (0: none)")
    ap.add_argument("--rows", default=None,
                    help="only these rows: KIND:RANKS:TENSORS[,...] (e.g. fsdp2:4096:2400)")
    ap.add_argument("--libs", default="torch,dcpx")
    ap.add_argument("--max-items", type=int, default=100_000,
                    help="R x T above this: T scaled down for the row")
    ap.add_argument("--no-load", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile dcpx's rank-0 phases (rows of 4,096 ranks and more, or --rows)")
    ap.add_argument("--row-timeout", type=float, default=1800)
    ap.add_argument("--inprocess", action="store_true",
                    help="run the rows in this process (faster start; no peak memory)")
    ap.add_argument("--bw-gbs", type=float, default=25.0)
    ap.add_argument("--lat-us", type=float, default=10.0)
    ap.add_argument("--tcp-bw-gbs", type=float, default=1.25)
    ap.add_argument("--tcp-lat-us", type=float, default=60.0)
    ap.add_argument("--real", action="store_true", help="real gloo runs vs the simulation")
    ap.add_argument("--real-ranks", default="2,4,8,16")
    ap.add_argument("--real-kinds", default="fsdp2")
    ap.add_argument("--real-tensors", type=int, default=300)
    ap.add_argument("--real-group", type=int, default=2)
    ap.add_argument("--real-saves", type=int, default=3,
                    help="saves per library in a real run (the first warms up)")
    ap.add_argument("--quick", action="store_true",
                    help="16 and 64 ranks, FSDP2 and DDP, 60 tensors, in this process "
                         "(with --real: 2 and 4 ranks, 30 tensors)")
    ap.add_argument("--copy-probe", default=None, metavar="MB[,MB]",
                    help="also time the steady-state commit's copy of an encoded middle of "
                         "these sizes on TMPDIR's file system (rows too large to simulate)")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="only redo the network model and the markdown of an earlier run's "
                         "JSON (to OUT.json, OUT.md)")
    ap.add_argument("--_row", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._row:
        spec = json.loads(args._row)
        res = run_row(spec["lib"], spec["kind"], spec["ranks"], spec["tensors"], spec["group"],
                      spec.get("dims", "real"), spec["workdir"], spec.get("profile", False),
                      not spec.get("no_load", False))
        res.update(series=spec.get("series"), tensors_asked=spec.get("tensors_asked"))
        print(json.dumps(res))
        return
    if args.quick:
        args.ranks, args.tensors, args.kinds = "16,64", "60", "fsdp2,ddp"
        args.constant_chunks, args.max_items, args.inprocess = 0, 10_000, True
        if args.real:
            args.real_ranks, args.real_tensors, args.real_saves = "2,4", 30, 2
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    machine = _machine()
    env = "".join(f"{k}={shlex.quote(os.environ[k])} " for k in ("TMPDIR", "PYTHONPATH")
                  if k in os.environ)
    report: dict = {"command": env + shlex.join(["python3", *sys.argv]), "started": started,
                    "machine": machine, "max_items": args.max_items}
    if args.render:
        with open(args.render) as f:
            report = json.load(f)
        if "rows" in report:  # the network model as this script has it, with these options
            report["network"] = network_table(report["rows"], args)
            report["rendered"] = env + shlex.join(["python3", *sys.argv])
        md = real_markdown(report) if "real" in report else markdown(report)
        print(md)
        if args.out:
            with open(args.out + ".md", "w") as f:
                f.write(md)
            with open(args.out + ".json", "w") as f:
                json.dump(report, f, indent=1)
        return
    if args.real:
        report["real"] = real_check(args)
        machine["loadavg_after"] = _load_avg()
        md = real_markdown(report)
    else:
        rows = []
        for row in _rows(args):
            for lib in args.libs.split(","):
                spec = dict(row, lib=lib, group=args.group, no_load=args.no_load,
                            profile=args.profile and lib == "dcpx"
                            and (bool(args.rows) or row["ranks"] >= 4096))
                t0 = time.perf_counter()
                res = run_row_subprocess(spec, args.row_timeout, args.inprocess)
                res.setdefault("series", row["series"])
                res.setdefault("tensors_asked", row["tensors_asked"])
                rows.append(res)
                if "error" in res:
                    print(f"{lib:5s} {row['kind']:5s} R={row['ranks']:6d} T={row['tensors']:5d}: "
                          f"ERROR {res['error'][-300:]}", file=sys.stderr, flush=True)
                else:
                    print(f"{lib:5s} {row['kind']:5s} R={row['ranks']:6d} T={row['tensors']:5d} "
                          f"first {res['first']['rank0']['cpu_total']:8.3f} s  repeat "
                          f"{res['repeat']['rank0']['cpu_total']:8.3f} s  "
                          + (f"steady {res['steady']['rank0']['cpu_total']:8.4f} s  "
                             if "steady" in res else "") + ".metadata "
                          f"{res['first']['metadata_bytes'] / 1e6:7.2f} MB  "
                          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        report["rows"] = rows
        report["network"] = network_table(rows, args)
        if args.copy_probe:
            report["copy_probe"] = copy_probe([float(x) for x in args.copy_probe.split(",")])
        machine["loadavg_after"] = _load_avg()
        md = markdown(report)
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(report, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(md)


# ---------------------------------------------------------------- the copy alone

class _ProbeWriter:
    """What dcpx.storage.commit.commit uses of a writer, for copy_probe."""

    def __init__(self, path: str, sync_files: bool = False) -> None:
        import pathlib
        self.path, self.rank, self.save_id = pathlib.Path(path), 0, "probe"
        self.sync_files, self.use_collectives = sync_files, True
        self._save_lock = self._commit_check = None
        os.makedirs(path)

    def _metadata_path(self) -> Any:
        return self.path / ".metadata"

    def _discard_own(self) -> None:
        pass

    def _remove_unreferenced(self, *args: Any) -> None:
        pass

    def _release_tag(self) -> None:
        pass


def copy_probe(sizes_mb: list, names_bytes: int = 160_000) -> list:
    """The steady-state commit of a .metadata whose encoded middle has each
    size, on TMPDIR's file system: a first commit writes the middle from
    memory (the full save), a second copies it from that file as a
    steady-state save does (names of ``names_bytes`` before it, as 4,096
    ranks' file names).  The first file is synced, as the default
    ``sync_files=True`` leaves the last save's; the second is not (its
    fsync is the disk's time, not the copy's).  The bytes are random: this times the file system's
    copy at sizes whose first save this machine cannot simulate (4,096 x
    2,400 is ~1.4 GB), not a checkpoint."""
    from dcpx.formats import metadata as _metadata
    from dcpx.storage import commit as _commit
    out = []
    for mb in sizes_mb:
        d = tempfile.mkdtemp(prefix="dcpx-bench-copy-")
        try:
            middle = os.urandom(int(mb * 1e6))
            pre, post = b"N" * names_bytes, b"T" * 300
            # synced, as a FileSystemWriter's default (sync_files=True) leaves it
            ident = _commit.commit(_ProbeWriter(os.path.join(d, "a"), sync_files=True), None,
                                   _metadata.Spliced(pre, middle, post, None))
            src = _metadata.FileRegion(os.path.join(d, "a", ".metadata"), len(pre), ident)
            before = dict(_commit.MIDDLE_BYTES)
            c0, w0 = time.process_time(), time.perf_counter()
            _commit.commit(_ProbeWriter(os.path.join(d, "b")), None,
                           _metadata.Spliced(pre, middle, post, src))
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            with open(os.path.join(d, "b", ".metadata"), "rb") as f:
                f.seek(len(pre))
                same = f.read(len(middle)) == middle
            out.append({"mb": mb, "cpu": cpu, "wall": wall, "same": same,
                        "copied": _commit.MIDDLE_BYTES["copied"] - before["copied"],
                        "written": _commit.MIDDLE_BYTES["written"] - before["written"]})
            del middle
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return out


# ---------------------------------------------------------------- real vs simulated

PHASES = ("g1_decode", "plan", "s1_encode", "g2_decode", "commit", "b_encode")


def real_check(args) -> list:
    """Per (W, shape): the real run's rank-0 phases (median over saves 2..N for
    the repeated save, the first save as is) beside the simulation's."""
    libs = args.libs.split(",")
    # dcpx twice: steady-state saves off (the repeated saves by digest), then on
    real_libs = libs + (["dcpx_steady"] if "dcpx" in libs else [])
    out = []
    for kind in args.real_kinds.split(","):
        for W in [int(x) for x in args.real_ranks.split(",")]:
            if kind == "hsdp" and W % args.real_group:
                continue
            t0 = time.perf_counter()
            real = run_real(W, kind, args.real_tensors, args.real_group, "tiny", real_libs,
                            args.real_saves, args.row_timeout)
            wall = time.perf_counter() - t0
            entry = {"kind": kind, "ranks": W, "tensors": args.real_tensors,
                     "group": args.real_group, "real_seconds": wall, "real": real[0],
                     "real_other": real[_other_rank(W)], "sim": {}}
            for lib in libs:
                entry["sim"][lib] = run_row_subprocess(
                    {"lib": lib, "kind": kind, "ranks": W, "tensors": args.real_tensors,
                     "group": args.real_group, "dims": "tiny", "no_load": True},
                    args.row_timeout)
            out.append(entry)
            print(f"real {kind} W={W}: {wall:.0f} s", file=sys.stderr, flush=True)
    return out


def _real_phase(saves: list, which: str) -> dict:
    """CPU per phase of the real run: the first save, or the median of saves 2..N."""
    import statistics
    if which == "first":
        return saves[0]["phases"]["cpu"]
    rest = saves[1:]
    return {p: statistics.median(s["phases"]["cpu"].get(p, 0.0) for s in rest) for p in PHASES}


def _real_gc(saves: list, which: str) -> Optional[float]:
    """Cyclic-GC seconds inside rank 0's phases of a real save (None: not recorded)."""
    import statistics
    vals = [s["phases"].get("gc_total") for s in (saves[:1] if which == "first" else saves[1:])]
    if any(v is None for v in vals):
        return None
    return statistics.median(vals)


def _real_bytes(saves: list, which: str) -> dict:
    """Bytes rank 0 sent per collective in a real save (pickled sizes)."""
    s = saves[0] if which == "first" else saves[-1]
    out: dict = {}
    for coll, n in s["sizes"]:
        out.setdefault(coll, []).append(n)
    return out


def _sim_bytes(colls: list) -> dict:
    """Rank 0's pickled bytes of a simulated save under the real run's names
    (gather1, scatter1, gather2, bcast: both broadcasts of a steady-state save);
    all-reduces pickle nothing."""
    out: dict = {}
    gathers = 0
    for c in colls:
        if c["kind"] == "gather":
            gathers += 1
            name = f"gather{gathers}"
        else:
            name = {"scatter": "scatter1", "broadcast": "bcast"}.get(c["kind"])
        if name:
            out[name] = out.get(name, 0) + c["rank0_pickled"]
    return out


def real_markdown(report: dict) -> str:
    L = ["# Real gloo runs vs the simulation (rank 0's CPU per phase)", "",
         f"- command: `{report['command']}`",
         f"- started {report['started']}, commit {report['machine']['commit']}, torch "
         f"{report['machine']['torch']}, {report['machine']['cpus']} CPUs",
         f"- load average before / after: {report['machine']['loadavg_before']} / "
         f"{report['machine'].get('loadavg_after', '?')}",
         "- real: W gloo processes on this machine (tiny tensors, the plan shapes of the "
         "simulation), rank 0's phases timed by wrapping the same functions the simulation "
         "calls; first = the first save of the process (dcpx: full plan exchange; torch: "
         "plan caching's first save), repeated = median of saves 2..N (dcpx: steady-state "
         "saves off, the plan by digest; dcpx_steady: steady-state saves on, the steady-state "
         "path, compared with the simulation's steady save; torch: cached plans).  sim: the "
         "same W, T, shape and dims through bench_scale's simulation in a fresh process.  "
         "ratio = real / sim.  steady: of the repeated saves, how many took the steady-state "
         "path on rank 0 / rank k (``dist.STEADY_SAVES``).", "",
         "| shape | W | T | lib | save | " + " | ".join(PHASES) + " | total | of which cyclic "
         "GC | bytes rank 0 pickled per collective (gather 1, scatter, gather 2, broadcasts), "
         "real / sim | steady |",
         "| --- | ---: | ---: | --- | --- | " + " | ".join("---:" for _ in PHASES)
         + " | ---: | ---: | --- | ---: |"]
    ratios: dict = {}
    for e in report["real"]:
        for lib in e["real"]:
            sim = e["sim"]["dcpx" if lib == "dcpx_steady" else lib]
            if "error" in sim:
                L.append(f"| {e['kind']} | {e['ranks']} | {e['tensors']} | {lib} | sim error: "
                         f"{sim['error'][-200:]} |")
                continue
            for which, key in (("first", "first"),
                               ("repeat", "steady" if lib == "dcpx_steady" else "repeat")):
                real = _real_phase(e["real"][lib]["saves"], which)
                simc = sim[key]["rank0"]["cpu"]
                cells = []
                for p in PHASES:
                    rv, sv = real.get(p, 0.0), simc.get(p, 0.0)
                    rt = rv / sv if sv > 0 else float("nan")
                    ratios.setdefault((lib, which, p), []).append(rt)
                    cells.append(f"{_fmt_s(rv)} / {_fmt_s(sv)} ({rt:.2f}x)")
                rtot, stot = sum(real.get(p, 0.0) for p in PHASES), sim[key]["rank0"]["cpu_total"]
                ratios.setdefault((lib, which, "total"), []).append(rtot / stot if stot else 0)
                rb = _real_bytes(e["real"][lib]["saves"], which)
                names = ("gather1", "scatter1", "gather2", "bcast")
                real_b = [sum(rb.get(k, [0])) for k in names]
                sb = _sim_bytes(sim[key]["collectives"])
                sim_b = [sb.get(k, 0) for k in names]
                bytes_cell = ", ".join(f"{_fmt_b(a)} / {_fmt_b(b)}" for a, b in zip(real_b, sim_b))
                steady = "-"
                if lib.startswith("dcpx") and which == "repeat":
                    steady = " / ".join(str(sum(x.get("steady", 0) for x in w[lib]["saves"][1:]))
                                        for w in (e["real"], e["real_other"]))
                rgc = _real_gc(e["real"][lib]["saves"], which)
                sgc = sim[key]["rank0"].get("gc_total", 0.0)
                L.append(f"| {e['kind']} | {e['ranks']} | {e['tensors']} | {lib} | {which} | "
                         + " | ".join(cells) + f" | {_fmt_s(rtot)} / {_fmt_s(stot)} "
                         f"({rtot / stot if stot else 0:.2f}x) | {_fmt_s(rgc)} / {_fmt_s(sgc)} | "
                         f"{bytes_cell} | {steady} |")
    L += ["", "## Ratio real / sim, over the rank counts (min - max, median)", "",
          "| lib | save | phase | min | median | max |", "| --- | --- | --- | ---: | ---: | ---: |"]
    import statistics
    for (lib, which, p), v in sorted(ratios.items()):
        v = [x for x in v if x == x]
        if v:
            L.append(f"| {lib} | {which} | {p} | {min(v):.2f} | {statistics.median(v):.2f} | "
                     f"{max(v):.2f} |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    main()
