"""Multi-process save and load: dcpx's own rank coordination over a
``torch.distributed`` process group.

torch's DCP coordinates a save with SavePlan / WriteItem dataclasses: every
rank pickles one WriteItem per tensor, the coordinator unpickles all of them
and runs the planner's dedup and metadata passes over those objects, scatters
whole plans back, then all-reduces WriteResult objects and sends the whole
Metadata object to every rank.  dcpx moves the same information as plain
tuples, in four collectives per save:

1. gather     each rank's items (key, chunk offsets and sizes, dtype, bytes)
              to the coordinator.  Byte-identical plans (replicated state, as
              in DDP) are decoded once.
2. scatter    to each rank: which of its items it writes (an item held by
              several ranks is written once, by the least-loaded holder) and
              its file prefix.
3. gather     each rank's file layout (file, offset, length of every item;
              fixed before the bytes are written) and its write status.
4. broadcast  the commit outcome, with the encoded metadata, which the other
              ranks decode only if the returned Metadata is looked at.

Only the coordinator commits, and only after every rank reported its files
written and fsynced.  A failure on any rank (planning or writing) reaches
every rank as an exception at step 2 or 4, and no ``.metadata`` is written.

A load needs no plan exchange: every rank reads the metadata, works out which
saved chunks overlap its own tensors (resharding; a sorted index per key, so
the work is not quadratic in local x saved chunks) and reads them.  One
all_gather of the ranks' status at the end makes a failure on one rank an
error on all.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import itertools
import operator
import os
import pickle
import re
import threading
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from .. import _C
from ..formats import chunks as _chunks, loadindex as _loadindex, metadata as _metadata
from ..storage import commit as _commit_files
from . import plan as _plan, readplan as _readplan
from ..formats.files import DCP_VERSION, _TAGGED_DATA_FILE, disagreeing_paths
from .flatten import flatten_state_dict
from .gcpause import paused_gc
from ..formats.legacy import legacy_layout
from ..storage.pending import _Entry, tensor_payload
from .plan import (  # noqa: F401 (the planner's names, as before)
    GlobalPlan,
    LocalItem,
    global_plan,
    is_dtensor,
    local_chunk,
    local_items,
    local_plan,
    plannable,
    scan,
)
from ..storage.reader import FileSystemReader, _TensorRead
from .._torchcompat import new_metadata
from .unasked import warn_unloaded
from ..storage.writer import FileSystemWriter, _path_key
from ..errors import CheckpointError, CorruptCheckpointError, checkpoint_errors


def fast_value(obj: Any) -> bool:
    """A value dcpx's own multi-process planning handles
    (dcpx.coordination.plan.plannable: the one rule of both paths)."""
    return plannable(obj, True)


# ------------------------------------------------------------ collectives

class _Group:
    """The process group, this rank's place in it, and object collectives
    addressed by group rank."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.coordinator = 0 if group is None else dist.get_global_rank(group, 0)
        self.is_coordinator = self.rank == 0

    def gather(self, obj: Any) -> Optional[list]:
        out = [None] * self.size if self.is_coordinator else None
        dist.gather_object(obj, out, dst=self.coordinator, group=self.group)
        return out

    def scatter(self, objs: Optional[list]) -> Any:
        out = [None]
        dist.scatter_object_list(out, objs, src=self.coordinator, group=self.group)
        return out[0]

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.coordinator, group=self.group)
        return box[0]

    def all_gather(self, obj: Any) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def path_key(path: Any) -> str:
    """What ranks compare to agree on a checkpoint directory: the path as
    given, lexically normalised (``a//b/./c/`` is ``a/b/c``).  Neither the
    working directory nor symlinks are resolved: ranks on different hosts
    may mount one file system at different places, and the same string on
    every rank is what torch's and dcpx's users pass (docs/design.md)."""
    return _path_key(path)


def _failure(rank: int, e: BaseException) -> tuple:
    return ("err", f"rank {rank}: {type(e).__name__}: {e}")


def _raise_remote(what: str, errors: list, own: Optional[BaseException], where) -> None:
    """Raise this rank's own exception, or one naming the checkpoint and the
    failed ranks (each of ``errors`` starts with "rank N:")."""
    if own is not None:
        raise own
    raise CheckpointError(f"dcpx: {what} of the checkpoint at {where} failed: "
                          + "; ".join(errors))


_async_groups: dict = {}
_async_groups_lock = threading.Lock()


def _group_timeout(pg) -> Optional[Any]:
    """The timeout the user gave ``pg`` (init_process_group / new_group),
    so that async_save's own group gives up on a stuck peer as soon as the
    user's would; None (gloo's default) if it cannot be found."""
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:
            continue
    return None


def abort_save(group, error: BaseException) -> None:
    """This rank cannot take part in a save (its staging failed): tell the
    others through the save's first two collectives, so that they raise at
    once instead of waiting for it; then raise ``error``."""
    g = _Group(group)
    _agree(g, 0)  # the save's first collective: not a steady-state save
    gathered = g.gather(_failure(g.rank, error))
    replies = None
    if g.is_coordinator:
        replies = [("err", [m[1] for m in gathered if m[0] != "ok"])] * g.size
    g.scatter(replies)
    raise error


def abort_torch_save(group, error: BaseException, writer, use_collectives: bool = True) -> None:
    """As ``abort_save``, for a save that torch's planner drives (a storage
    writer or planner of the user's): this rank enters torch's save with a
    planner that fails at once, so that torch's first collective tells the
    other ranks (a CheckpointException naming this rank's error) instead of
    leaving them to wait for it until the group's timeout; then raises
    ``error``.  Nothing is written: torch plans before it writes."""
    if use_collectives:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.state_dict_saver import save as torch_save

        class _Failed(DefaultSavePlanner):
            # torch's signature: with *args torch warns that this planner
            # lacks storage_meta ("update your implementation") to a user
            # who wrote no planner.
            def set_up_planner(self, state_dict: Any = None, storage_meta: Any = None,
                               is_coordinator: bool = False) -> None:
                raise error

        from torch.distributed.checkpoint.api import CheckpointException
        try:
            torch_save({}, storage_writer=writer, planner=_Failed(), process_group=group)
        except (Exception, CheckpointException):  # (a BaseException): this rank's own error
            pass
    raise error


class AsyncGroup:
    """async_save's own gloo group for one user group, with the same ranks,
    so that the upload's collectives never interleave with the training's.

    It is made (and remade) on the upload thread, under a name of dcpx's own
    (``dcpx_async/<user group>/<instance>/pg<seq>``), never from the number
    of groups this process happens to have.  After a failed save a gloo
    group may be unusable (a collective that timed out leaves its pairs
    broken, and every later collective on it fails at once), so the ranks
    rebuild it, and they must all do so at the same save: the decision is
    made from what every rank reports to the default store after each save
    (docs/design.md, "async_save's group after a failure")::

        save k ends (ok or not)   add <k>/failed (if it failed), add <k>/arrived;
                                  the last to arrive sets <k>/done
        save k+1 starts           wait for <k>/done; rebuild iff <k>/failed > 0

    Every rank reads the same counters after every rank has reported, so
    they all rebuild at the same save, whichever of them saw the failure.
    Saves take numbers in ``async_save`` call order (``ticket``) and run in
    that order (``turn``), THREAD and PROCESS uploads alike."""

    _instances: dict = {}

    def __init__(self, parent, ranks: list, timeout) -> None:
        from torch.distributed import distributed_c10d as c10d
        self.parent = parent
        self.ranks = ranks
        self.rank = ranks.index(dist.get_rank())
        self.timeout = timeout if timeout is not None else c10d.default_pg_timeout
        # Same on every rank of the group, distinct for groups that share
        # the store: the group's name and ranks, and how many times this
        # process made one for them (a world destroyed and made again).
        import hashlib
        name = (getattr(parent, "group_name", None) or "default") + ":" + hashlib.sha1(
            ",".join(map(str, ranks)).encode()).hexdigest()[:12]
        n = AsyncGroup._instances[name] = AsyncGroup._instances.get(name, -1) + 1
        self.prefix = f"dcpx_async/{name}/{n}"
        self.store = c10d._get_default_store()
        self.pg = None
        self.cond = threading.Condition()
        self.next_seq = 0          # the calling thread's next ticket
        self.finished = 0          # saves below this number have finished here
        self.ended: set = set()    # finished saves at or above it

    def ticket(self) -> "AsyncTicket":
        with self.cond:
            seq, self.next_seq = self.next_seq, self.next_seq + 1
        return AsyncTicket(self, seq)

    def _ready(self, seq: int):
        """The group save ``seq`` runs on: built for the first save, rebuilt
        on every rank when the previous save failed on any."""
        rebuild = self.pg is None
        if seq > 0:
            key = f"{self.prefix}/{seq - 1}"
            self.store.wait([f"{key}/done"], self.timeout)
            rebuild = rebuild or int(self.store.add(f"{key}/failed", 0)) > 0
            if seq >= 2 and self.rank == 0:
                # Every rank has read save seq-2's counters (it started save
                # seq-1, which has ended everywhere): drop them.
                old_key = f"{self.prefix}/{seq - 2}"
                for name in ("failed", "arrived", "done"):
                    try:
                        self.store.delete_key(f"{old_key}/{name}")
                    except Exception:  # a store without delete_key: a few bytes
                        break
        if rebuild:
            old, self.pg = self.pg, None
            if old is not None:
                try:
                    dist.destroy_process_group(old)
                except Exception:  # already broken: nothing to release cleanly
                    pass
            self.pg = self._build(seq)
        return self.pg

    def _build(self, seq: int):
        from torch.distributed import distributed_c10d as c10d
        name = f"{self.prefix}/pg{seq}"
        try:
            pg, _ = c10d._new_process_group_helper(
                len(self.ranks), self.rank, self.ranks, "gloo", self.store, name,
                timeout=self.timeout)
        except TypeError:  # another torch's private signature: torch's naming
            return dist.new_group(self.ranks, backend="gloo", timeout=self.timeout,
                                  use_local_synchronization=True)
        c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(self.ranks)}
        return pg

    def _end(self, seq: int, failed: bool) -> None:
        key = f"{self.prefix}/{seq}"
        try:
            if failed:
                self.store.add(f"{key}/failed", 1)
            if int(self.store.add(f"{key}/arrived", 1)) == len(self.ranks):
                self.store.set(f"{key}/done", "1")
        except Exception:
            # The store is gone (the job is ending: rank 0, its host, may
            # exit as soon as its own last save returned).  The save's own
            # outcome stands; a next save would fail at its wait (above)
            # and be counted as failed, so the ranks still agree.
            pass
        finally:
            with self.cond:
                self.ended.add(seq)
                while self.finished in self.ended:
                    self.ended.discard(self.finished)
                    self.finished += 1
                self.cond.notify_all()


class AsyncTicket:
    """One async_save's place in its AsyncGroup's sequence of saves."""

    def __init__(self, group: AsyncGroup, seq: int) -> None:
        self.group = group
        self.seq = seq
        self._used = False

    @contextlib.contextmanager
    def turn(self):
        """On the upload thread: wait for this rank's earlier saves on the
        group, then yield the process group to save on; the save's outcome
        (an exception out of the block is a failure) goes to the store."""
        g = self.group
        self._used = True
        with g.cond:
            g.cond.wait_for(lambda: g.finished >= self.seq)
        failed = True
        try:
            yield g._ready(self.seq)
            failed = False
        finally:
            g._end(self.seq, failed)

    def abandon(self) -> None:
        """async_save failed before its upload was submitted: the save
        counts as failed on this rank (the others rebuild with it)."""
        if not self._used:
            self._used = True
            self.group._end(self.seq, True)


def async_group(process_group) -> AsyncTicket:
    """A ticket for one async_save on ``process_group`` (None: the default
    group): its turn yields async_save's own group, see AsyncGroup.  Takes
    no collective: nothing here can fail for another rank's sake."""
    from torch.distributed import distributed_c10d as c10d
    key = process_group if process_group is not None else c10d._get_default_group()
    with _async_groups_lock:
        group = _async_groups.get(key)
        if group is None:
            # Forget groups of destroyed worlds.
            for k in [k for k in _async_groups if k not in c10d._world.pg_map]:
                del _async_groups[k]
            ranks = (list(range(dist.get_world_size())) if process_group is None
                     else dist.get_process_group_ranks(process_group))
            group = _async_groups[key] = AsyncGroup(key, ranks, _group_timeout(key))
    return group.ticket()


# ------------------------------------------------------------ save

class _LazyMetadata(Metadata):
    """The Metadata a non-coordinator rank returns: decoded from the
    coordinator's bytes on first use (most callers never look)."""

    def __init__(self, data: bytes, where: str, files: Optional[tuple] = None,
                 retag: Optional[tuple] = None) -> None:  # noqa: D107
        self.__dict__["_dcpx_encoded"] = (data, where)
        # The data files it names (for the commit's cleanup, undecoded).
        self.__dict__["_dcpx_files"] = files
        # (old tag, new tag, storage_meta): ``data`` is the last full save's
        # metadata, of which this steady-state save's differs only there.
        self.__dict__["_dcpx_retag"] = retag

    def _decode(self) -> None:
        enc = self.__dict__.pop("_dcpx_encoded", None)
        if enc is not None:
            data, where = enc
            md = _metadata.loads(bytes(data), where)  # bytes, or a Spliced
            retag = self.__dict__.pop("_dcpx_retag", None)
            if retag is not None:
                _retag(md, *retag)
            for f in dataclasses.fields(Metadata):
                self.__dict__[f.name] = getattr(md, f.name)

    def __reduce__(self):
        return (Metadata, tuple(getattr(self, f.name) for f in dataclasses.fields(Metadata)))


def _retag(md: Metadata, old: str, new: str, storage_meta: Any) -> None:
    """``md`` with its data file names of save tag ``old`` renamed to tag
    ``new`` (``__{rank}_{tag}_{i}.distcp``) and ``storage_meta`` set."""
    pat = re.compile(r"(__\d+_)" + re.escape(old) + r"(_\d+\.distcp)\Z")
    renamed: dict = {}
    for k, si in md.storage_data.items():
        name = renamed.get(si.relative_path)
        if name is None:
            name = renamed[si.relative_path] = pat.sub(lambda m: m.group(1) + new + m.group(2),
                                                       si.relative_path)
        md.storage_data[k] = _StorageInfo(name, si.offset, si.length)
    md.storage_meta = storage_meta


def _lazy_field(name: str) -> property:
    # Metadata's fields with defaults are class attributes, which would
    # answer before any __getattr__: each field is a property instead.
    def get(self):
        self._decode()
        return self.__dict__[name]

    def set(self, value):
        self._decode()
        self.__dict__[name] = value
    return property(get, set)


for _f in dataclasses.fields(Metadata):
    setattr(_LazyMetadata, _f.name, _lazy_field(_f.name))


def write_files(writer: FileSystemWriter, prefix: str, entries: list) -> tuple[list, list]:
    """Write entries (``_Entry(item index, payload, nbytes)``) with the C
    writer; (file names, [(item index, file number, offset, length)])."""
    pending = writer.write_entries(prefix, entries).start()
    pending.wait(results=False)
    return ([name for name, _ in pending.files],
            [(e.index, f, off, length)
             for f, ((_, ents), lay) in enumerate(zip(pending.files, pending.layout))
             for e, (off, length) in zip(ents, lay)])


def _discard(writer: FileSystemWriter, names: list) -> None:
    for name in names:
        try:
            os.unlink(writer.path / name)
        except OSError:
            pass


@checkpoint_errors()  # every rank's failure is a torch CheckpointException
def save(writer: FileSystemWriter, flat: dict, mappings: dict, group,
         use_collectives: bool = True, prepare: Callable = tensor_payload,
         write: Callable = write_files) -> Metadata:
    """Save this rank's part of a flat state dict and commit once for all.
    ``prepare(tensor, key)`` makes an item's payload, ``write(writer,
    prefix, entries)`` writes this rank's entries (the checkpoint process
    passes its own)."""
    try:
        with paused_gc():  # ~10 objects per tensor: see dcpx/coordination/gcpause.py
            return _save(writer, flat, mappings, group, use_collectives, prepare, write)
    finally:
        writer._release_tag()  # the coordinator's, if the save failed before its commit


def _save(writer: FileSystemWriter, flat: dict, mappings: dict, group,
          use_collectives: bool, prepare: Callable, write: Callable) -> Metadata:
    g = _Group(group)
    flat = _plan.in_mesh(flat)  # a DTensor on a sub-mesh: not this rank's to write
    writer.set_up_storage_writer(g.is_coordinator, rank=g.rank, use_collectives=use_collectives)
    if not use_collectives:
        return _save_alone(writer, flat, mappings, g, prepare, write)
    # 1. local plan (or its digest, when unchanged) -> coordinator
    own: Optional[BaseException] = None
    items = payloads = sent = None
    prepared = True
    gkey = _group_key(g)
    try:
        writer._prepare_dir(create=False)  # nothing on disk before the paths agree
        items, payloads, sent, msg, prepared = _local_message(flat, mappings, prepare, gkey,
                                                              path_key(writer.path))
    except Exception as e:
        own, msg = e, _failure(g.rank, e)
    # 0. steady state: every rank's plan, path and writer are those of the
    # last save it committed with the others (one fixed-size all-reduce)
    steady = None if own is not None or prepared else _steady_for(sent, writer, msg[2], g)
    if _agree(g, 0 if steady is None else steady.key):
        return _save_steady(writer, g, gkey, items, payloads, sent, steady, prepare, write)
    if sent is not None and sent.steady is not None:
        sent = sent._replace(steady=None)
    gathered = g.gather(msg)
    # 2. coordinator: global plan -> each rank
    plan = None
    replies = None
    if g.is_coordinator:
        try:
            refusal = disagreeing_paths([m[2] if m[0] == "ok" else None for m in gathered])
            if refusal is not None:
                replies = [("refuse", refusal)] * g.size
            else:
                plan, replies = _coordinate(writer, gathered)
        except Exception as e:
            own = own or e
            replies = [("err", [_failure(0, e)[1]])] * g.size
    reply = g.scatter(replies)
    if reply[0] == "resend":
        # The coordinator does not hold a plan this rank or another sent as
        # a digest: the ranks that did send it whole, in one more round.
        again = None
        if msg[0] == "ok" and msg[1] is None:
            blob = _blob(sent.items, sent.mappings)
            sent = sent._replace(digest=_digest(blob))  # what the coordinator will hold
            again = ("ok", blob, msg[2], sent.digest, msg[4])
        regathered = g.gather(again)
        replies = None
        if g.is_coordinator:
            try:
                full = [m if m is not None else gathered[r] for r, m in enumerate(regathered)]
                plan, replies = _coordinate(writer, full)
            except Exception as e:
                own = own or e
                replies = [("err", [_failure(0, e)[1]])] * g.size
        reply = g.scatter(replies)
    if reply[0] == "refuse":
        raise CheckpointError(reply[1])
    if reply[0] != "ok":
        _raise_remote("save planning", reply[1], own, writer.path)
    _, prefix, mine, token = reply
    if mine is None:  # the assignment this rank holds (it sent its token)
        mine = sent.assign
    sent = sent._replace(token=token, assign=mine)
    _remember_sent(gkey, sent)
    # 3. write; file layout + status -> coordinator
    names: list = []
    layout: list = []
    try:
        writer._prepare_dir()
        names, layout = write(writer, prefix,
                              _prepared_entries(items, payloads, prepared, sent, mine, prepare))
        msg = ("ok", names, layout)
    except Exception as e:
        own, msg = e, _failure(g.rank, e)
    return _gather_and_commit(writer, g, gkey, sent, plan, msg, names, layout, own,
                              _tag_of(prefix, g.rank))


def _gather_and_commit(writer: FileSystemWriter, g: _Group, gkey: tuple, sent: _Sent,
                       plan: Optional[GlobalPlan], msg: tuple, names: list, layout: list,
                       own: Optional[BaseException], tag: Optional[str]) -> Metadata:
    """Steps 3 and 4 of a full exchange: every rank's files and layout ->
    coordinator, which commits; outcome -> every rank, which then holds what
    the next save needs to take the steady-state path."""
    gathered = g.gather(msg)
    outcome = None
    metadata = None
    # the encoded middle, the file that holds it, the load index written
    cell: list = [None, None, None]
    if g.is_coordinator:
        outcome, metadata = _commit(writer, plan, gathered, own, cell=cell)
        if outcome[0] == "ok":
            sid = 0
            if cell[0] is not None and _steady_writer(writer):
                # in [2**61, 2**62): a pickle of fixed size
                sid = _SID_BASE + int.from_bytes(os.urandom(8), "little") % _SID_BASE
            outcome = outcome + (sid,)
    outcome = g.broadcast(outcome)
    if outcome[0] != "ok":
        if outcome[0] == "err":
            _discard(writer, names)  # nothing will ever reference these files
        if sent is not None:
            _remember_sent(gkey, sent._replace(steady=None))
        _raise_remote("save", outcome[1], own, writer.path)
    sid = outcome[2] if len(outcome) > 2 else 0
    steady = None
    if sid and sent is not None and _steady_writer(writer):
        path = path_key(writer.path)
        config = _writer_config(writer)
        if tag is not None:
            files = middle = base = crc = None
            known = None
            if g.is_coordinator:
                known = plan
                files = tuple(len(m[1]) for m in gathered)
                middle = cell[0]
                crc = None if middle is None else _C.crc32(middle)
            else:
                base = outcome[1]
            steady = _Steady(sid, _steady_key(sid, path, config), path, config, len(names),
                             layout, tag, base, known, files, middle, crc, cell[1],
                             cell[2] if g.is_coordinator else None)
    if sent is not None:
        _remember_sent(gkey, sent._replace(steady=steady))
    if metadata is None:
        metadata = _LazyMetadata(outcome[1], str(writer.path / _metadata.METADATA_FN))
    return metadata


# ------------------------------------------------------------ steady state
#
# A save whose every rank's plan (keys, signatures, sizes of the non-tensor
# values, mappings: _local_message's comparison), path and writer
# configuration are those of the last save it committed with the others
# exchanges no plan, assignment or layout: one all-reduce of a 16-byte
# tensor finds that every rank holds the same save id (rank 0 draws one at
# random for each committed save of a full exchange, and every rank keeps
# it with its own files and layout of that save), rank 0 broadcasts the new
# save's tag, each rank writes the items it wrote last time, and a second
# all-reduce finds that every rank's files and layout are those of that
# save (the C writer lays out the same items of the same sizes the same
# way; compared, not assumed).  Rank 0 then writes the .metadata from the
# last save's encoded middle (dcpx.formats.metadata.split_dumps) with the
# new file names and storage_meta, and broadcasts only the outcome and
# storage_meta; the other ranks' Metadata is the last full save's, renamed,
# decoded on first use.  A rank whose plan or path changed (or that failed
# before the check) sends 0, and the save takes the full exchange; a layout
# that differs after the write takes the full gather of layouts and rank
# 0's full commit, in the same save.  docs/design.md, "Steady-state saves".

_SID_SPAN = (1 << 62) - 1
_SID_BASE = 1 << 61

#: False: every save takes the full exchange (its plan by digest when
#: unchanged); tests of that exchange set it, on every rank alike.
steady_state_enabled = True

#: steady-state saves committed by this process (tests look at it)
STEADY_SAVES = [0]


class _Steady(NamedTuple):
    """The last save a rank committed with the others by a full exchange."""
    sid: int                # rank 0's id for it
    key: int                # this rank's contribution to the check
    path: str
    config: tuple           # _writer_config
    nfiles: int             # this rank's data files
    layout: list            # its (item, file, offset, length)
    tag: str                # the save's tag (in its file names)
    base: Optional[bytes]   # not rank 0: the save's encoded metadata
    plan: Optional[GlobalPlan]      # rank 0: the global plan
    files: Optional[tuple]          # rank 0: data files per rank
    middle: Optional[bytes]         # rank 0: the encoded middle
    middle_crc: Optional[int] = None        # rank 0: its CRC-32
    source: Optional[_metadata.FileRegion] = None  # rank 0: a file that holds it
    index: Optional[tuple] = None   # rank 0: the load index's (body, CRC-32, FileRegion)


def _writer_config(writer: FileSystemWriter) -> tuple:
    return (type(writer), bool(writer.single_file_per_rank), writer.thread_count,
            writer.plain_format(), bool(writer.sync_files))


def _steady_writer(writer: FileSystemWriter) -> bool:
    """A writer whose metadata the steady-state path may encode itself."""
    return (type(writer).encode_metadata is FileSystemWriter.encode_metadata
            and writer.plain_format())


def _steady_key(sid: int, path: str, config: tuple) -> int:
    h = _digest(repr((sid, path, config[1:], config[0].__qualname__)).encode())
    return 1 + int.from_bytes(h[:8], "little") % _SID_SPAN


def _tag_of(prefix: str, rank: int) -> Optional[str]:
    """The save tag in this rank's file prefix ``__{rank}_{tag}_`` (None:
    a prefix without one)."""
    m = re.match(r"__%d_(.+)_\Z" % rank, prefix)
    return None if m is None else m.group(1)


def _steady_for(sent: _Sent, writer: FileSystemWriter, path: str, g: _Group) -> Optional[_Steady]:
    """This rank's steady state, if this save can repeat its last one."""
    st = sent.steady
    if st is None or not steady_state_enabled or not _steady_writer(writer) or st.config != _writer_config(writer):
        return None
    if g.is_coordinator and (st.plan is None or st.middle is None or st.files is None
                             or len(st.files) != g.size):
        return None
    if not g.is_coordinator and st.base is None:
        return None
    if st.path != path:  # the ranks agree on the new path (it is in the key)
        st = st._replace(path=path, key=_steady_key(st.sid, path, st.config))
    return st


def _coll_device(group) -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_object_coll_device
        return torch.device(_get_object_coll_device(group))
    except Exception:  # another torch's private name: gloo's device
        return torch.device("cpu")


def _agree(g: _Group, key: int) -> bool:
    """Whether every rank passed the same nonzero ``key`` (one all-reduce of
    16 bytes; the same answer on every rank)."""
    t = torch.tensor([key, -key], dtype=torch.int64, device=_coll_device(g.group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g.group)
    hi, neg_lo = t.tolist()
    return hi == -neg_lo and hi > 0


def _save_steady(writer: FileSystemWriter, g: _Group, gkey: tuple, items: list,
                 payloads: list, sent: _Sent, st: _Steady, prepare: Callable,
                 write: Callable) -> Metadata:
    """A save every rank found to repeat the last one (see above)."""
    own: Optional[BaseException] = None
    tag_msg = None
    if g.is_coordinator:
        try:
            tag_msg = ("ok", writer._tag())
        except Exception as e:
            own, tag_msg = e, ("err", [_failure(0, e)[1]])
    tag_msg = g.broadcast(tag_msg)
    if tag_msg[0] != "ok":
        _remember_sent(gkey, sent._replace(steady=None))
        _raise_remote("save planning", tag_msg[1], own, writer.path)
    tag = tag_msg[1]
    prefix = writer._prefix(g.rank, tag)
    names: list = []
    layout: list = []
    same = False
    try:
        writer._prepare_dir()
        names, layout = write(writer, prefix, _prepared_entries(items, payloads, False, sent,
                                                                sent.assign, prepare))
        msg = ("ok", names, layout)
        same = (len(names) == st.nfiles and layout == st.layout
                and names == [f"{prefix}{i}.distcp" for i in range(st.nfiles)])
    except Exception as e:
        own, msg = e, _failure(g.rank, e)
    if not _agree(g, 1 if same else 0):
        # A rank failed or laid out its items otherwise: the full gather of
        # layouts and rank 0's full commit, with the plan of the last save.
        return _gather_and_commit(writer, g, gkey, sent, st.plan, msg, names, layout, own,
                                  tag)
    outcome = None
    metadata = None
    if g.is_coordinator:
        outcome, metadata, source, index = _commit_steady(writer, st, tag)
    outcome = g.broadcast(outcome)
    if outcome[0] != "ok":
        if outcome[0] == "err":
            _discard(writer, names)
        _remember_sent(gkey, sent._replace(steady=None))
        _raise_remote("save", outcome[1], own, writer.path)
    if g.is_coordinator:  # the next save copies the middle from this file
        _remember_sent(gkey, sent._replace(steady=st._replace(source=source, index=index)))
    STEADY_SAVES[0] += 1
    if metadata is None:
        metadata = _LazyMetadata(st.base, str(writer.path / _metadata.METADATA_FN),
                                 retag=(st.tag, tag, outcome[1]))
    return metadata


def _commit_steady(writer: FileSystemWriter, st: _Steady, tag: str) -> tuple:
    """Rank 0's commit of a steady-state save: the last full save's encoded
    middle with this save's file names and storage_meta; (outcome,
    Metadata, where the new file holds the middle).  Only the names and
    storage_meta are encoded; the middle is copied in the kernel from the
    last file that holds it (dcpx.storage.commit; from memory where the
    file system cannot or that file changed), and the trailer's CRC is
    combined from the parts' (the middle's is kept from the full save)."""
    try:
        names = tuple(f"{writer._prefix(r, tag)}{i}.distcp"
                      for r, n in enumerate(st.files) for i in range(n))
        storage_meta = writer.storage_meta()
        head = new_metadata(state_dict_metadata={}, planner_data={}, storage_data={},
                            storage_meta=storage_meta, version=DCP_VERSION)
        crc = st.middle_crc if st.middle_crc is not None else _C.crc32(st.middle)
        data = _metadata.steady_dumps(head, names, st.middle, crc, st.source)
        if data is None:
            raise CheckpointError("dcpx: the metadata encoder declined a steady-state save")
        metadata = _LazyMetadata(data, str(writer.path / _metadata.METADATA_FN),
                                 files=frozenset(names))
    except Exception as e:
        return ("err", [_failure(0, e)[1]]), None, None, None
    try:
        # a subclass's own commit gets bytes, as it always did
        own_commit = type(writer).commit is FileSystemWriter.commit
        written = writer.commit(metadata, data if own_commit else bytes(data))
    except Exception as e:
        return ("unknown", [f"rank 0: commit: {type(e).__name__}: {e}"]), None, None, None
    index = _steady_load_index(writer, st, data, tag) if own_commit else None
    return ("ok", storage_meta), metadata, _middle_source(writer, written, len(data.pre)), index


# ------------------------------------------------------------ plan exchange
#
# A rank's encoded plan (its items and flatten mappings, pickled) is named by
# its digest (BLAKE2b of the bytes).  A rank whose plan is exactly what it
# sent in its last save on the same group (same keys, signatures, value sizes
# and mappings: compared here, not hashed) sends only that digest; the
# coordinator keeps the bytes of the plans of its last global plans, so it
# still has them, and keeps each global plan under the tuple of the ranks'
# digests.  Each rank's share of a global plan is named by the digest of its
# index list (its token): a rank says which one it holds, and the coordinator
# sends the list only when it differs.  A digest the coordinator does not
# hold (it forgot it, or the rank's cache is of another group) is answered
# with "resend", and the ranks that sent digests send their plans whole in
# one more gather/scatter, in the same save.  docs/design.md, "Plan
# exchange by digest".

def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=20).digest()


def _blob(items: list, mappings: dict) -> bytes:
    return pickle.dumps((items, mappings), protocol=pickle.HIGHEST_PROTOCOL)


class _Sent(NamedTuple):
    """What a rank sent in its last save on a group, and its share of the
    global plan it got back.  Never changed once made."""
    keys: tuple
    sig: list           # dcpx.coordination.plan.scan's signature
    sizes: list         # byte sizes of the non-tensor values, in order
    mappings: dict
    items: list         # local_items of the above
    digest: bytes       # of _blob(items, mappings)
    token: Optional[bytes]   # the held assignment's token
    assign: Optional[list]   # indices into items this rank wrote
    steady: Any = None       # _Steady: the last save committed by a full exchange


# (group, rank, size) -> _Sent, for the last 4 groups saved on (e.g. the
# default group and async_save's own); each holds the keys, signatures and
# items of its state dict (no tensor).
_SENT: dict = {}
_SENT_MAX = 4
_sent_lock = threading.Lock()


def _group_key(g: _Group) -> tuple:
    pg = g.group
    if pg is None:
        from torch.distributed import distributed_c10d as c10d
        pg = c10d._get_default_group()
    return (id(pg), getattr(pg, "group_name", None), g.rank, g.size)


def _remember_sent(key: tuple, sent: _Sent) -> None:
    with _sent_lock:
        _SENT.pop(key, None)
        _SENT[key] = sent
        while len(_SENT) > _SENT_MAX:
            del _SENT[next(iter(_SENT))]


def clear_exchange_cache() -> None:
    """Forget every plan sent and every global plan made (tests)."""
    with _sent_lock:
        _SENT.clear()
    with _global_plans_lock:
        _GLOBAL_PLANS.clear()


def _unprepared(t: torch.Tensor, key: str) -> torch.Tensor:
    return t


def _local_message(flat: dict, mappings: dict, prepare: Callable, gkey: tuple,
                   path: str) -> tuple:
    """(items, payloads, _Sent, message for the coordinator, prepared): the
    message carries the encoded plan, or only its digest when the plan is
    the one this rank sent last time on this group.  Then (``prepared``
    False) the tensors' payloads are not made yet: ``payloads`` holds the
    tensors ``prepare`` takes (``_prepared_entries`` makes the payloads of
    the items this rank writes, a fraction of them for replicated state);
    a changed plan gets every payload here, so that a tensor dcpx cannot
    save is refused before planning, naming its key, as before."""
    keys = tuple(flat)
    try:
        sig, payloads = scan(flat, _unprepared)
    except Exception:
        # A value whose metadata cannot be read: prepare's own error names it.
        sig, payloads = scan(flat, prepare)
        return _changed_message(keys, sig, payloads, mappings, gkey, path) + (True,)
    sizes = [len(p) for s, p in zip(sig, payloads) if s is None]
    with _sent_lock:
        last = _SENT.get(gkey)
    if (last is not None and last.keys == keys and last.sig == sig and last.sizes == sizes
            and last.mappings == mappings):
        return (last.items, payloads, last, ("ok", None, path, last.digest, last.token), False)
    payloads = [p if s is None else prepare(p, k) for k, s, p in zip(keys, sig, payloads)]
    return _changed_message(keys, sig, payloads, mappings, gkey, path) + (True,)


def _prepared_entries(items: list, payloads: list, prepared: bool, sent: _Sent, mine: list,
                      prepare: Callable) -> list:
    """The C writer's entries of the items this rank writes."""
    if prepared:
        return [_Entry(i, payloads[i], items[i].nbytes) for i in mine]
    sig, keys = sent.sig, sent.keys
    return [_Entry(i, payloads[i] if sig[i] is None else prepare(payloads[i], keys[i]),
                   items[i].nbytes) for i in mine]


def _changed_message(keys: tuple, sig: list, payloads: list, mappings: dict, gkey: tuple,
                     path: str) -> tuple:
    sizes = [len(p) for s, p in zip(sig, payloads) if s is None]
    with _sent_lock:
        last = _SENT.get(gkey)
    token = assign = None
    if last is not None:
        token, assign = last.token, last.assign
    items = local_items(keys, sig, payloads)
    blob = _blob(items, mappings)
    sent = _Sent(keys, sig, sizes, dict(mappings), items, _digest(blob), token, assign)
    return items, payloads, sent, ("ok", blob, path, sent.digest, token)


class _Known(NamedTuple):
    """A global plan the coordinator made, under the ranks' digests."""
    digests: tuple
    plan: GlobalPlan
    blobs: dict      # digest -> encoded rank plan (each distinct one once)
    tokens: list     # per rank: digest of its assignment


# The coordinator's last global plans: a save whose ranks send the digests
# of one of these reuses its global plan instead of decoding the items and
# planning again.  Never changed once made (_commit copies the dicts it
# hands out).  Bounded: 2 plans (and the encoded rank plans they were made
# from, each distinct one once).
_GLOBAL_PLANS: list = []
_global_plans_lock = threading.Lock()


def _known_plan(digests: tuple) -> Optional[_Known]:
    with _global_plans_lock:
        for known in _GLOBAL_PLANS:
            if known.digests == digests:
                return known
    return None


def _known_blob(digest: bytes) -> Optional[bytes]:
    with _global_plans_lock:
        for known in _GLOBAL_PLANS:
            blob = known.blobs.get(digest)
            if blob is not None:
                return blob
    return None


def _remember_plan(known: _Known) -> None:
    with _global_plans_lock:
        _GLOBAL_PLANS.insert(0, known)
        del _GLOBAL_PLANS[2:]


def _coordinate(writer: FileSystemWriter, gathered: list) -> tuple:
    """(global plan, reply per rank).  Messages are ``("ok", blob, path[,
    digest, held token])``, blob None when the rank sent only the digest.
    The replies are ``("ok", prefix, assignment or None, token)``, or
    ``("resend",)`` to every rank when a digest is not known here."""
    errors = [m[1] for m in gathered if m[0] != "ok"]
    if errors:
        return None, [("err", errors)] * len(gathered)
    digests = []
    fresh: dict = {}
    last_blob = last_digest = None
    for m in gathered:
        blob = m[1]
        if blob is None:
            d = m[3]
        elif last_blob is not None and (blob is last_blob or blob == last_blob):
            d = last_digest  # replicated state: every rank sends the same bytes
        else:
            # Hashed here, not taken from the message: a digest names
            # exactly these bytes.
            d = _digest(blob)
            fresh.setdefault(d, blob)
            last_blob, last_digest = blob, d
        digests.append(d)
    digests = tuple(digests)
    known = _known_plan(digests)
    if known is None:
        blobs = dict(fresh)
        for d in digests:
            if d not in blobs:
                b = _known_blob(d)
                if b is None:
                    return None, [("resend",)] * len(gathered)
                blobs[d] = b
        decoded = {d: pickle.loads(b) for d, b in blobs.items()}
        plans = [decoded[d] for d in digests]  # one object per distinct plan
        plan = global_plan([p[0] for p in plans], [p[1] for p in plans])
        tokens = [_digest(pickle.dumps(a, protocol=pickle.HIGHEST_PROTOCOL))
                  for a in plan.assign]
        known = _Known(digests, plan, blobs, tokens)
        _remember_plan(known)
    plan = known.plan
    tag = writer._tag()
    replies = []
    for r, m in enumerate(gathered):
        held = m[4] if len(m) > 4 else None
        tok = known.tokens[r]
        replies.append(("ok", writer._prefix(r, tag), None if held == tok else plan.assign[r],
                        tok))
    return plan, replies


def _commit(writer: FileSystemWriter, plan: Optional[GlobalPlan], gathered: list,
            own: Optional[BaseException], rank: int = 0,
            cell: Optional[list] = None) -> tuple:
    """(outcome for every rank, Metadata or None).  Outcome ``("err", ...)``
    means nothing was committed; ``("unknown", ...)`` that the commit failed
    after the metadata may have become visible.  dcpx's own encoder writes
    the split form (dcpx.formats.metadata.split_dumps), and ``cell``
    ([None, None, None]) gets its reusable middle (None if there is none),
    where the committed file holds it (_middle_source), and the load index
    written beside it (_write_load_index)."""
    errors = [m[1] for m in gathered if m[0] != "ok"]
    if errors or plan is None:
        return ("err", errors or ["planning failed"]), None
    try:
        storage_data = {}
        all_names = []
        for r, (_, names, layout) in enumerate(gathered):
            all_names.extend(names)
            for i, f, off, length in layout:
                storage_data[plan.index[(r, i)]] = _StorageInfo(names[f], off, length)
        # Own dicts: the plan may be reused by the next save (_GLOBAL_PLANS).
        metadata = new_metadata(state_dict_metadata=dict(plan.state_dict_metadata),
                            planner_data=dict(plan.planner_data), storage_data=storage_data,
                            storage_meta=writer.storage_meta(), version=DCP_VERSION)
        out = None
        if (type(writer).encode_metadata is FileSystemWriter.encode_metadata
                and len(set(all_names)) == len(all_names)):
            out = _metadata.split_dumps(metadata, tuple(all_names))
        at = 0
        if out is not None:
            data, at = out[0], out[2]
            if cell is not None:
                cell[0] = out[1]
        else:
            data = writer.encode_metadata(metadata)
    except Exception as e:
        return ("err", [_failure(rank, e)[1]]), None
    try:
        written = writer.commit(metadata, data)
    except Exception as e:
        return ("unknown", [f"rank {rank}: commit: {type(e).__name__}: {e}"]), None
    if cell is not None and cell[0] is not None:
        cell[1] = _middle_source(writer, written, at)
    index = _write_load_index(writer, metadata, data)
    if cell is not None:
        cell[2] = index
    return ("ok", data), metadata


#: a full save writes a load index (docs/format.md, "The load index") when
#: its metadata has at least this many storage entries, at least
#: LOAD_INDEX_MIN_PER_KEY per key on average (a save sharded over many
#: ranks: below that, every rank decodes little, and a load of whole
#: tensors keeps the C direct plan)
LOAD_INDEX_MIN_ENTRIES = 65536
LOAD_INDEX_MIN_PER_KEY = 4


def _trailer(data: Any) -> Optional[tuple]:
    """(crc, length) of the dcpx trailer that ends an encoded .metadata."""
    tail = bytes(data.post if isinstance(data, _metadata.Spliced) else data)
    tail = tail[-_metadata._TRAILER.size:]
    if len(tail) != _metadata._TRAILER.size:
        return None
    magic, crc, n = _metadata._TRAILER.unpack(tail)
    return (crc, n) if magic == _metadata._TRAILER_MAGIC else None


def _write_load_index(writer: FileSystemWriter, metadata: Metadata, data: Any) -> Optional[tuple]:
    """Rank 0, once its .metadata is committed: the load index beside it,
    or the last one removed.  (body, its CRC-32, FileRegion of the file
    written) for the next steady-state save, or None.  The checkpoint is
    committed already: a failure here leaves no index (loads read
    .metadata), never a failed save."""
    if type(writer).commit is not FileSystemWriter.commit:
        return None  # a writer with its own commit: its files are its own
    n = len(metadata.storage_data)
    body = None
    trailer = _trailer(data)
    tag = None
    if (trailer is not None and n >= LOAD_INDEX_MIN_ENTRIES
            and n >= LOAD_INDEX_MIN_PER_KEY * max(1, len(metadata.state_dict_metadata))):
        # the save's tag in its data file names (one tag in all of them):
        # the body holds a hole there, so that a steady-state save reuses it
        tags = {m.group(1) if m else None for m in map(
            _TAGGED_DATA_FILE.match, {i.relative_path for i in metadata.storage_data.values()})}
        tag = tags.pop() if len(tags) == 1 else None
        body = _loadindex.build_body(metadata, tag)
    kept = _put_load_index(writer, body, None, trailer, tag, None)
    # a body without a tag names its own files: no steady-state save reuses it
    return kept if tag is not None else None


def _steady_load_index(writer: FileSystemWriter, st: _Steady, data: Any,
                       tag: str) -> Optional[tuple]:
    """The load index of a steady-state save: the last one's body (copied
    from its file where the file system can; its data file names hold a
    hole for the tag) under a header for this save's .metadata and tag."""
    body, crc, source = st.index if st.index is not None else (None, None, None)
    return _put_load_index(writer, body, crc, _trailer(data), tag, source)


def _put_load_index(writer: FileSystemWriter, body: Optional[bytes], crc: Optional[int],
                    trailer: Optional[tuple], tag: Optional[str],
                    source: Optional[_metadata.FileRegion]) -> Optional[tuple]:
    """Write ``body`` (copied from ``source`` where it can be) under a
    header for the .metadata of ``trailer`` and the save's ``tag``, or,
    without a body or a trailer, remove the last index.  (body, its
    CRC-32, FileRegion of the file written), or None (also when writing
    failed: loads read .metadata)."""
    try:
        if body is None or trailer is None:
            _commit_files.remove_index(writer.path)
            return None
        if crc is None:
            crc = _C.crc32(body)
        data = _metadata.Spliced(_loadindex.header(body, trailer[0], trailer[1], crc, tag), body,
                                 b"", source)
        written = _commit_files.write_index(writer.path, writer.save_id, data,
                                            bool(writer.sync_files))
    except OSError:
        return None
    return body, crc, _metadata.FileRegion(str(writer.path / _loadindex.INDEX_FN),
                                           _loadindex.HEADER_LEN, written)


def _middle_source(writer: FileSystemWriter, written: Any,
                   offset: int) -> Optional[_metadata.FileRegion]:
    """Where the .metadata just committed holds its middle (None: the
    writer's commit did not say which file it wrote)."""
    if not (isinstance(written, tuple) and len(written) == 4):
        return None
    return _metadata.FileRegion(str(writer._metadata_path()), offset, written)


def _save_alone(writer: FileSystemWriter, flat: dict, mappings: dict, g: _Group,
                prepare: Callable, write: Callable) -> Metadata:
    """use_collectives=False: every rank saves what it holds under
    ``__{rank}.metadata``, as torch does; a barrier at the end."""
    writer._prepare_dir()
    items, payloads = local_plan(flat, prepare)
    plan = global_plan([items], [mappings])
    names, layout = write(writer, writer._prefix(g.rank),
                          [_Entry(i, p, it.nbytes) for i, (it, p)
                           in enumerate(zip(items, payloads))])
    outcome, metadata = _commit(writer, plan, [("ok", names, layout)], None, g.rank)
    if outcome[0] != "ok":
        raise CheckpointError(f"dcpx: save of the checkpoint at {writer.path} failed: "
                              f"{'; '.join(outcome[1])}")
    dist.barrier(group=g.group)
    return metadata


# ------------------------------------------------------------ load

class _ChunkIndex:
    """The saved chunks of one key, sorted by their start along dim 0, with
    the running maximum of their ends: the chunks that overlap a region are
    found by bisection instead of a scan over all of them."""

    __slots__ = ("chunks", "starts", "max_end")

    def __init__(self, chunks: list) -> None:
        # (a key's chunks are R of them at R ranks: no Python step per chunk
        # that a builtin can take; the order is sorted()'s, stable)
        starts = [c.offsets[0] for c in chunks]
        if any(map(operator.gt, starts, itertools.islice(starts, 1, None))):
            order = sorted(range(len(starts)), key=starts.__getitem__)
            chunks = [chunks[i] for i in order]
            starts = [starts[i] for i in order]
        self.chunks = list(chunks)
        self.starts = starts
        self.max_end = list(itertools.accumulate(
            map(operator.add, starts, [c.sizes[0] for c in self.chunks]), max))

    def overlapping(self, lo: int, hi: int) -> list:
        j = bisect.bisect_left(self.starts, hi) - 1
        out = []
        while j >= 0 and self.max_end[j] > lo:
            out.append(self.chunks[j])
            j -= 1
        return out


class _StorageLookup:
    """``storage_data`` looked up by (fqn, offsets or None), as a dict
    keyed that way would answer, without building one over every entry
    (R x T of them at R ranks, for the few a rank reads)."""

    __slots__ = ("_data",)

    def __init__(self, storage_data: dict) -> None:
        self._data = storage_data

    def get(self, key: tuple) -> Any:
        fqn, offsets = key
        # MetadataIndex hashes and compares (fqn, offset) only; its
        # constructor makes offsets a torch.Size, equal to the tuple
        return self._data.get(MetadataIndex(fqn, offsets))


def _candidates(md: TensorStorageMetadata, cache: dict, fqn: str, offsets, sizes) -> list:
    chunks = md.chunks
    if len(chunks) <= 8 or not sizes:
        return chunks
    idx = cache.get(fqn)
    if idx is None:
        idx = cache[fqn] = _ChunkIndex(chunks)
    return idx.overlapping(offsets[0], offsets[0] + sizes[0])


def plan_reads(reader: FileSystemReader, metadata: Metadata, flat: dict,
               allow_partial_load: bool, serial: Optional[list] = None) -> tuple[list, list]:
    """(tensor reads, bytes keys) that fill this rank's part of ``flat``.

    Saved chunks that overlap (torch accepts them: its load copies each in
    turn, the last copy wins) are read in torch's order: the reads of such a
    key go to ``serial`` (to be read one after the other, in that order), or
    at the end of the reads when ``serial`` is None.  Elements that no chunk
    holds are an error, naming the key."""
    sdm = metadata.state_dict_metadata
    storage = _StorageLookup(metadata.storage_data)
    reads, byte_keys, cache = [], [], {}
    overlapped: dict = {}  # fqn -> (its reads, their chunks, its region)
    for fqn, obj in flat.items():
        md = sdm.get(fqn)
        if md is None:
            if allow_partial_load:
                continue
            raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
        if isinstance(md, BytesStorageMetadata):
            byte_keys.append(fqn)
            continue
        if not isinstance(obj, torch.Tensor):
            raise TypeError(f"dcpx: key {fqn!r}: the checkpoint holds a tensor, the "
                            f"state_dict holds a {type(obj).__name__}")
        if obj.size() != md.size:
            raise ValueError(f"Size mismatch between saved {md.size} and current: "
                             f"{obj.size()} for {fqn}")
        target, offsets, sizes = local_chunk(obj)
        if target.device.type == "meta":
            # copy_ into it does nothing: the load would report success and
            # leave no data.  With a process group, load_flat replaces it
            # first, as torch does; without one torch fails too.
            raise MetaDestinationError(
                f"dcpx: cannot load {fqn!r} into a tensor on the meta device (it holds no "
                f"data): allocate it first, e.g. with Module.to_empty(device=...), or load "
                f"with a process group initialised (the tensor is then replaced by one on "
                f"the group's device, as torch.distributed.checkpoint.load does)")
        volume = 1
        for n in sizes:
            volume *= n
        if volume == 0 and len(sizes) > 0:
            continue
        covered = 0
        mine, boxes, chunks = [], [], []
        for ch in _candidates(md, cache, fqn, offsets, sizes):
            view, inner, whole, vol = target, [], [], 1
            for dim, (o, n, co, cn) in enumerate(zip(offsets, sizes, ch.offsets, ch.sizes)):
                lo, hi = max(o, co), min(o + n, co + cn)
                if hi <= lo:
                    break
                if lo != o or hi - lo != n:
                    view = view.narrow(dim, lo - o, hi - lo)
                inner.append(lo - co)
                whole.append(hi - lo)
                vol *= hi - lo
            else:
                info = storage.get((fqn, tuple(ch.offsets)))
                if info is None:
                    raise CorruptCheckpointError(
                        f"{reader.path}: metadata lists {fqn!r} but has no storage entry "
                        f"for it at offset {tuple(ch.offsets)}")
                full = tuple(whole) == tuple(ch.sizes)
                mine.append(_TensorRead(fqn, info, ch.sizes, md.properties.dtype, view,
                                        None if full else (tuple(inner), tuple(whole))))
                start = tuple(max(o, co) - o for o, co in zip(offsets, ch.offsets))
                boxes.append(_chunks.Box(start, tuple(whole)))
                chunks.append(ch)
                covered += vol
        if covered < volume:
            raise CorruptCheckpointError(
                f"{reader.path}: the saved chunks of {fqn!r} cover {covered} of the "
                f"{volume} elements this rank needs (offsets {tuple(offsets)}, "
                f"sizes {tuple(sizes)})")
        tiling = _chunks.tiling(sizes, boxes) if len(mine) > 1 else None
        if tiling is not None and tiling.gap:
            raise CorruptCheckpointError(
                f"{reader.path}: the saved chunks of {fqn!r} do not cover the region this "
                f"rank needs (offsets {tuple(offsets)}, sizes {tuple(sizes)}): {tiling.gap}")
        if tiling is not None and tiling.overlap:
            overlapped[fqn] = (mine, chunks, (tuple(offsets), tuple(sizes)))
        else:
            reads.extend(mine)
    if overlapped:
        ordered = _torch_ordered(sdm, storage, flat, overlapped)
        (reads if serial is None else serial).extend(ordered)
    return reads, byte_keys


def _torch_ordered(sdm: dict, storage: dict, flat: dict, overlapped: dict) -> list:
    """The reads of the keys whose saved chunks overlap, in the order torch's
    load applies them: its read items grouped by data file, the files in
    the order they first appear in the whole plan (the state dict's keys in
    order, each key's chunks in torch's order: ``_chunks.torch_order``), the items of one
    file in plan order (torch ``FileSystemReader.read_data``)."""
    order = {}  # per overlapped key: its chunks' positions, in torch's order
    for fqn, (_, chunks, region) in overlapped.items():
        md = sdm[fqn]
        where = {id(c): i for i, c in enumerate(md.chunks)}
        order[fqn] = _chunks.torch_order(fqn, md, region, [where[id(c)] for c in chunks])
    rank: dict = {}
    keys = list(flat)
    last = max(keys.index(k) for k in overlapped)
    for fqn in keys[:last + 1]:
        md = sdm.get(fqn)
        if md is None:
            continue
        if isinstance(md, BytesStorageMetadata):
            info = storage.get((fqn, None))
            if info is not None:
                rank.setdefault(info.relative_path, len(rank))
            continue
        if fqn in overlapped:
            ordered = order[fqn]
        else:
            if not isinstance(flat[fqn], torch.Tensor):
                continue
            _, offsets, sizes = local_chunk(flat[fqn])
            region = (tuple(offsets), tuple(sizes))
            ordered = _chunks.torch_order(
                fqn, md, region, [i for i, c in enumerate(md.chunks) if _meets(region, c)])
        for i in ordered:
            info = storage.get((fqn, tuple(md.chunks[i].offsets)))
            if info is not None:
                rank.setdefault(info.relative_path, len(rank))
    out = []
    for fqn, (mine, chunks, region) in overlapped.items():
        md = sdm[fqn]
        where = {id(c): i for i, c in enumerate(md.chunks)}
        picked = [where[id(c)] for c in chunks]
        pos = {i: p for p, i in enumerate(order[fqn])}
        out.extend(mine[k] for k in sorted(
            range(len(mine)), key=lambda k: (rank[mine[k].info.relative_path],
                                             pos[picked[k]])))
    return out


def _meets(region: tuple, ch: Any) -> bool:
    return all(o < co + cn and co < o + n
               for o, n, co, cn in zip(region[0], region[1], ch.offsets, ch.sizes))


def load_flat(flat: dict, mappings: dict, original: dict, reader: FileSystemReader,
              ck: _readplan.Checkpoint, allow_partial_load: bool = False) -> None:
    """Fill a flattened state dict, in place, from the checkpoint ``ck``
    (``open_checkpoint``): through a compiled read plan when every tensor is
    read whole and in place (cached per layout, dcpx/coordination/readplan.py), else
    planned here (resharding, casts, devices, views, and every error)."""
    try:
        planned = _load_flat(flat, mappings, original, reader, ck, allow_partial_load)
    except MetaDestinationError:
        if not _materialize_meta(original):
            raise
        flat, mappings = flatten_state_dict(original)
        planned = _load_flat(flat, mappings, original, reader, ck, allow_partial_load)
    if planned:
        # Loaded through a plan: the Metadata objects are not needed by
        # the next load of this layout (dcpx/coordination/readplan.py, Checkpoint).
        ck.release()


class MetaDestinationError(ValueError):
    """A load's destination is a tensor on the meta device (plan_reads)."""


def _materialize_meta(original: dict) -> bool:
    """With a process group initialised, replace the meta tensors (and
    DTensors) in ``original`` by empty ones on the group's device, in place,
    as torch's DefaultLoadPlanner does before it plans a load
    (``planner_helpers._init_state_dict``); False without a group (torch's
    load fails there too) or without that helper (torch < 2.5)."""
    try:
        from torch.distributed.checkpoint.planner_helpers import _init_state_dict
    except ImportError:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        return False
    _init_state_dict(original)
    return True


def _load_flat(flat: dict, mappings: dict, original: dict, reader: FileSystemReader,
               ck: _readplan.Checkpoint, allow_partial_load: bool) -> bool:
    """load_flat; whether it went through a plan."""
    legacy = legacy_layout(original, flat, ck.byte_info())  # a torch <= 2.3 checkpoint
    if legacy is not None:
        flat, mappings = legacy
    flat = _plan.in_mesh(flat)  # a DTensor on a sub-mesh: not this rank's to read
    key = None if ck.no_plan else (tuple(flat), allow_partial_load)
    plan = None if key is None else _readplan.get_plan(ck, key)
    if plan is None and key is not None:
        plan = _readplan.direct_plan(reader, ck, flat, allow_partial_load, key)
    if plan is not None:
        failures = _readplan.run_plan(reader, plan, flat)
        if failures is not None and not failures:
            _readplan.put_plan(ck, key, plan)
            _load_values(flat, mappings, original, reader, ck, plan.byte_keys)
            return True
        # A destination changed (None) or a read failed: plan this load
        # anew, which raises what a load without the cache raises.
        _readplan.drop_plan(ck, key, failed=failures is not None)
    reads, byte_keys, serial = plan_checked(reader, ck, flat, allow_partial_load)
    reader.read_tensors(reads)
    for r in serial:  # overlapping chunks: one at a time, in torch's order
        reader.read_tensors([r])
    _load_values(flat, mappings, original, reader, ck, byte_keys)
    return False


def region_metadata(ck: _readplan.Checkpoint, flat: dict) -> Optional[Metadata]:
    """What plan_reads needs of ``ck`` for this rank's part of ``flat``,
    from the C decoder's tables: the entries of flat's keys, each tensor's
    chunks only those that meet this rank's region, and their storage
    entries.  At R ranks an FSDP key has R chunks: a rank makes Python
    objects for the few it reads, not for every chunk of every key (issue
    28 item 4).  None when ``ck`` has no tables or its Metadata is decoded
    already: plan from ``ck.metadata``."""
    if not ck.regions:
        return None
    try:
        return _region_metadata(ck, flat)
    except _readplan.Demoted:  # the load index was damaged: from .metadata
        return region_metadata(ck, flat)


def _region_metadata(ck: _readplan.Checkpoint, flat: dict) -> Metadata:
    sdm: dict = {}
    storage: dict = {}
    for fqn, obj in flat.items():
        region = None
        if isinstance(obj, torch.Tensor):
            try:
                _, offsets, sizes = local_chunk(obj)
                region = (tuple(offsets), tuple(sizes))
            except Exception:  # noqa: BLE001 - plan_reads raises it, in its turn
                region = None
        got = ck.region(fqn, region)
        if got is None:
            continue
        if not got:
            sdm[fqn] = BytesStorageMetadata()
            continue
        dtype, size, chunks, infos = got
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), size, chunks)
        for ch, info in zip(chunks, infos):
            if info is not None:
                storage[MetadataIndex(fqn, ch.offsets)] = info
    return Metadata(state_dict_metadata=sdm, storage_data=storage)


def plan_checked(reader: FileSystemReader, ck: _readplan.Checkpoint, flat: dict,
                 allow_partial_load: bool) -> tuple[list, list, list]:
    """plan_reads from ``ck`` (from the C decoder's tables, for this rank's
    region only: region_metadata), and the data files of its reads checked
    (each rank checks only the files it reads: _readplan.need_files).
    (reads, bytes keys, serial reads)."""
    serial: list = []
    part = region_metadata(ck, flat)
    reads, byte_keys = plan_reads(reader, ck.metadata if part is None else part, flat,
                                  allow_partial_load, serial)
    if part is not None and serial:
        # saved chunks that overlap: torch's order of their reads follows
        # every chunk of the key (_torch_ordered), so plan from them all
        serial = []
        reads, byte_keys = plan_reads(reader, ck.metadata, flat, allow_partial_load, serial)
    names = {r.info.relative_path for r in reads}
    names.update(r.info.relative_path for r in serial)
    if not _readplan.need_files(reader, ck, names):
        # ck turned to the general path (SAFETENSORS data files): its
        # entries are not the ones just planned from
        serial = []
        reads, byte_keys = plan_reads(reader, ck.metadata, flat, allow_partial_load, serial)
    return reads, byte_keys, serial


def _load_values(flat: dict, mappings: dict, original: dict, reader: FileSystemReader,
                 ck: _readplan.Checkpoint, byte_keys: list) -> None:
    if not byte_keys:
        return
    index = ck.byte_info()
    names = {index[k].relative_path for k in byte_keys if k in index}
    if not _readplan.need_files(reader, ck, names):
        index = ck.byte_info()
    for fqn in byte_keys:
        info = index.get(fqn)
        if info is None:
            raise CorruptCheckpointError(
                f"{reader.path}: metadata lists {fqn!r} but has no storage entry for it")
        set_element(original, mappings[fqn], reader.load_value(fqn, info))


def open_checkpoint(reader: FileSystemReader, rank: Optional[int] = None,
                    is_coordinator: bool = True) -> _readplan.Checkpoint:
    """The checkpoint's metadata, checked, with ``reader`` set up for it:
    the global ``.metadata``, or (as torch does, when rank is given and there
    is none) this rank's own ``__{rank}.metadata`` from a
    use_collectives=False save.  A FileSystemReader whose metadata and setup
    methods are dcpx's own uses the cache of dcpx/coordination/readplan.py."""
    collective = True
    if _readplan.cacheable(reader):
        try:
            ck = _readplan.checkpoint(reader)
        except FileNotFoundError:
            if rank is None or not (reader.path / f"__{rank}{_metadata.METADATA_FN}").exists():
                raise
            ck, collective = _readplan.checkpoint(reader, rank), False
        reader._set_up_cached(ck, rank, collective)
        return ck
    metadata, collective = read_metadata(reader, rank)
    reader.set_up_storage_reader(metadata, is_coordinator, rank=rank,
                                 use_collectives=collective)
    ck = _readplan.Checkpoint(None, b"", metadata, {})
    ck.no_plan = True  # the reader may read its own way (a subclass)
    return ck


def read_metadata(reader: FileSystemReader, rank: Optional[int]) -> tuple[Metadata, bool]:
    """The global metadata, or (as torch does) this rank's own
    ``__{rank}.metadata`` from a use_collectives=False save."""
    try:
        return reader.read_metadata(), True
    except FileNotFoundError:
        if rank is None or not (reader.path / f"__{rank}{_metadata.METADATA_FN}").exists():
            raise
    return reader.read_metadata(rank=rank), False


@checkpoint_errors()
def load(reader: FileSystemReader, flat: dict, mappings: dict, original: dict, group,
         allow_partial_load: bool) -> None:
    """Each rank fills its part; an error on any rank is raised on all."""
    g = _Group(group)
    own: Optional[BaseException] = None
    try:
        with paused_gc():
            ck = open_checkpoint(reader, g.rank, g.is_coordinator)
            count = ck.key_count()
            load_flat(flat, mappings, original, reader, ck, allow_partial_load)
        if g.is_coordinator and not allow_partial_load:  # once, not once per rank
            warn_unloaded(ck, count, flat, original, reader.path)
        status = ("ok",)
    except Exception as e:
        own, status = e, _failure(g.rank, e)
    statuses = g.all_gather(status)
    errors = [s[1] for s in statuses if s[0] != "ok"]
    if errors:
        _raise_remote("load", errors, own, reader.path)
