"""The node-local tier of dcpx.CheckpointManager: every save to node-local
storage first, a copy of each rank's piece on partner ranks of other
nodes, and the persistent checkpoint under the manager's ``root`` written
from the local tier every ``persist_interval_steps`` (docs/tiers.md).

Threads and groups.  ``save()`` (the training thread) starts the local
save -- ``dcpx.async_save`` of the rank's own state dict, ``no_dist``: no
collective -- and queues the step on the replication thread, which waits
for the local commit, swaps pieces with the partners (point-to-point on a
gloo group of the tier's own) and, every ``persist_interval_steps``,
queues the step on the persistence thread, which assembles the persistent
step from the pieces (a second gloo group).  Both threads take the steps
in the order of the saves, which is the same on every rank, so their
collectives match without asking the training thread for anything; the
training collectives never wait for them.  A ``save()`` waits until at
most one earlier step is still replicating (and a persisting save for the
previous persistence), so a step's replication overlaps the next training
step.

Who deletes.  Each node's lowest rank (its leader) deletes that node's
step folders: old steps after each replication, once every rank has
passed the step (a barrier ends each replication), a step queued for
persistence only once persisted; and, before a run's first save, the
steps that run cannot build on (newer than the step it resumed from, or
than the step it starts at).
"""
from __future__ import annotations

import collections
import os
import socket
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..api.save_load import load as _load, save as _save
from ..api.async_save import async_save as _async_save
from ..errors import CheckpointError
from ..filesystem import local_path, pieces

__all__ = ["LocalTier", "LocalTierFullError", "Topology"]

#: bytes per point-to-point message (a piece goes in several)
_MSG = 256 << 20
#: steps saved locally but not yet replicated, at most (the one being saved
#: included): 2 lets a step's copy overlap the next training step.  Measured
#: on the 2-core VM, 4 ranks, 256 MiB each, a save every second
#: (benchmarks/bench_tiers.py, runs of 2026-11-27): the training thread
#: blocked 0.19-0.31 s a save with 2 against 0.23-0.71 s with 1, and a step
#: replicated 3.8-4.6 s after its save() against 1.9-2.4 s: less training
#: time lost, more steps at risk.
_IN_FLIGHT = 2


def _torch_has_no_dist() -> bool:
    import inspect
    from torch.distributed import checkpoint as dcp
    return all("no_dist" in inspect.signature(f).parameters for f in (dcp.save, dcp.load))


class LocalTierFullError(CheckpointError, OSError):
    """The node-local tier has no room for the step: the message gives the
    bytes it needs and the bytes free."""


class Topology:
    """Ranks grouped into nodes (failure domains) by a name per rank, nodes
    numbered by their lowest rank.  Replica ``k`` (1, 2, ...) of a rank's
    piece goes to the rank with the same place in node ``node + k`` (a jump
    of ``k`` nodes: another failure domain)."""

    def __init__(self, names: list) -> None:
        self.names = list(names)
        self.nodes: list = []
        where: dict = {}
        for rank, name in enumerate(self.names):
            if name not in where:
                where[name] = len(self.nodes)
                self.nodes.append([])
            self.nodes[where[name]].append(rank)
        self.node_of = [where[n] for n in self.names]
        self.place_of = [self.nodes[self.node_of[r]].index(r) for r in range(len(self.names))]

    def leader(self, rank: int) -> bool:
        return self.nodes[self.node_of[rank]][0] == rank

    def check_replicas(self, replicas: int) -> None:
        if replicas <= 0:
            return
        if len(self.nodes) < replicas + 1:
            raise ValueError(
                f"dcpx.CheckpointManager: replicas={replicas} needs at least {replicas + 1} "
                f"nodes, and the ranks are on {len(self.nodes)} (a node: the ranks that share "
                f"a host name and local_root, or the same node= name)")
        sizes = {len(n) for n in self.nodes}
        if len(sizes) != 1:
            raise ValueError(f"dcpx.CheckpointManager: replicas need the same number of ranks "
                             f"on every node, got {sorted(len(n) for n in self.nodes)}")

    def partner(self, rank: int, k: int) -> int:
        """Where replica ``k`` of ``rank``'s piece goes."""
        node = (self.node_of[rank] + k) % len(self.nodes)
        return self.nodes[node][self.place_of[rank]]

    def source(self, rank: int, k: int) -> int:
        """Whose replica ``k`` ``rank`` holds."""
        node = (self.node_of[rank] - k) % len(self.nodes)
        return self.nodes[node][self.place_of[rank]]


def _tensor_of(data: Any) -> torch.Tensor:
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer: only sent, never written
        return torch.frombuffer(data, dtype=torch.uint8)


class LocalTier:
    """The tiers of one CheckpointManager (built by it; see the module
    docstring and docs/tiers.md)."""

    def __init__(self, manager: Any, local_root: Any, replicas: int,
                 persist_interval_steps: Optional[int], keep_local_k: int,
                 node: Optional[str], timeout_s: float) -> None:
        if int(replicas) < 0:
            raise ValueError(f"dcpx.CheckpointManager: replicas must be >= 0, got {replicas!r}")
        if int(keep_local_k) < 1:
            raise ValueError(f"dcpx.CheckpointManager: keep_local_k must be at least 1, got "
                             f"{keep_local_k!r}")
        if persist_interval_steps is not None and int(persist_interval_steps) < 1:
            raise ValueError(f"dcpx.CheckpointManager: persist_interval_steps must be None or "
                             f"at least 1, got {persist_interval_steps!r}")
        self.manager = manager
        self.local = local_path(local_root)
        os.makedirs(self.local, exist_ok=True)
        self.replicas = int(replicas)
        self.persist_interval = None if persist_interval_steps is None else int(persist_interval_steps)
        self.keep_local_k = int(keep_local_k)
        self.sync_files = True
        name = node if node is not None else f"{socket.gethostname()}:{os.path.realpath(self.local)}"
        self.dist = dist.is_available() and dist.is_initialized()
        pg = manager.process_group
        if self.dist:
            self.world = dist.get_world_size(pg)
            self.rank = dist.get_rank(pg)
            ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(self.world))
            self.global_rank = list(ranks)
            t = timedelta(seconds=float(timeout_s))
            # Groups of the tier's own: the replication and persistence
            # threads' collectives never meet the training thread's.
            self.g_repl = dist.new_group(ranks, backend="gloo", timeout=t)
            self.g_persist = dist.new_group(ranks, backend="gloo", timeout=t)
            self.g_self = None
            if not _torch_has_no_dist():
                # torch < 2.7 has no no_dist=: a rank's own piece is saved and
                # loaded with a group of this rank alone instead (only this
                # rank creates it).
                self.g_self = dist.new_group([self.global_rank[self.rank]], backend="gloo",
                                             timeout=t, use_local_synchronization=True)
            names: list = [None] * self.world
            dist.all_gather_object(names, str(name), group=self.g_repl)
            box = [time.time_ns()]
            dist.broadcast_object_list(box, src=self.global_rank[0], group=self.g_repl)
            run = int(box[0])
        else:
            self.world, self.rank, self.global_rank = 1, 0, [0]
            self.g_repl = self.g_persist = self.g_self = None
            names, run = [str(name)], time.time_ns()
        self.topology = Topology(names)
        self.topology.check_replicas(self.replicas)
        self.leader = self.topology.leader(self.rank)
        self.run = run
        self.seq = 0
        self.settled = False         # stale steps removed (at the resume, or the first save)
        self._repl = ThreadPoolExecutor(1, thread_name_prefix="dcpx-replicate")
        self._persist = ThreadPoolExecutor(1, thread_name_prefix="dcpx-persist")
        self._repl_queue: collections.deque = collections.deque()  # replications queued
        self._last_persist: Optional[Future] = None
        self._kept: list = []        # (step, key) this run saved, oldest first
        self._persisting: set = set()  # steps queued for persistence
        self._lock = threading.Lock()
        self.last_piece_bytes: Optional[int] = None
        #: per step: seconds from the save() call to each stage (blocked,
        #: local, replicated, persisted); what benchmarks/bench_tiers.py reports
        self.timings: dict = {}
        #: how the last load resumed: {"step", "tier": "local" | "replica" | "persistent"}
        self.last_resume: Optional[dict] = None

    # ----------------------------------------------------------- helpers
    def _solo(self) -> dict:
        """The keyword that makes dcpx.save / load touch this rank alone:
        nothing without a process group, else ``no_dist=True`` (or, where
        torch lacks it and dcpx falls back to torch's save or load, a group
        of this rank alone)."""
        if not self.dist:
            return {}
        if self.g_self is not None:
            return {"process_group": self.g_self}
        return {"no_dist": True}

    def scan(self) -> list:
        """The committed pieces on this node: (step, key, rank, world)."""
        return pieces.scan(self.local)

    def _g(self, rank: int) -> int:
        return self.global_rank[rank]

    def _piece(self, step: int, key: str, rank: Optional[int] = None) -> Path:
        return pieces.piece_dir(self.local, step, key, self.rank if rank is None else rank,
                                self.world)

    def wait_replicated(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` steps are queued for replication
        (0: all replicated); raises the first failure."""
        while len(self._repl_queue) > keep:
            self._repl_queue.popleft().result()

    def wait_persisted(self) -> None:
        self.wait_replicated()  # it queues the persistence
        fut, self._last_persist = self._last_persist, None
        if fut is not None:
            fut.result()

    def close(self) -> None:
        try:
            self.wait_persisted()
        finally:
            self._repl.shutdown(wait=True)
            self._persist.shutdown(wait=True)

    def space_needed(self, piece_bytes: int) -> dict:
        """Bytes each tier needs for pieces of ``piece_bytes`` (per rank):
        the local tier of one node holds, for each of ``keep_local_k``
        steps plus the one being written, its ranks' pieces and the replicas
        they keep for partners; the persistent tier, per step, every rank's
        bytes (a chunk several ranks hold, once)."""
        per_node = len(self.topology.nodes[self.topology.node_of[self.rank]])
        per_step = per_node * (1 + self.replicas) * int(piece_bytes)
        return {"local_per_node": (self.keep_local_k + 1) * per_step,
                "local_per_step_per_node": per_step,
                "persistent_per_step_at_most": self.world * int(piece_bytes)}

    def _check_space(self) -> None:
        if self.last_piece_bytes is None:
            return  # the first save: its size is not known before it is written
        need = self.space_needed(self.last_piece_bytes)["local_per_step_per_node"]
        free = pieces.free_bytes(self.local)
        if free is not None and free < need:
            raise LocalTierFullError(
                f"dcpx.CheckpointManager: the local tier {self.local} has {free} bytes free; a "
                f"step needs {need} ({len(self.topology.nodes[self.topology.node_of[self.rank]])}"
                f" rank(s) on this node x (1 + {self.replicas} replica(s)) x "
                f"{self.last_piece_bytes} bytes per piece), and keep_local_k="
                f"{self.keep_local_k} steps need {self.space_needed(self.last_piece_bytes)['local_per_node']}")

    def _wrap_full(self, e: BaseException, what: str) -> BaseException:
        """``e``, or a LocalTierFullError for a full disk."""
        if isinstance(e, LocalTierFullError) or not pieces.is_enospc(e):
            return e
        out = LocalTierFullError(f"dcpx.CheckpointManager: the local tier {self.local} is full "
                                 f"({what}): {e}")
        out.__cause__ = e
        return out

    # -------------------------------------------------------------- save
    def settle(self, newest_kept: Optional[int]) -> None:
        """Remove the node's steps newer than ``newest_kept`` (None: all of
        them), and transfers or deletions a kill interrupted: a run never
        resumes onto a step of a run it did not build on.  Collective."""
        if self.leader:
            pieces.remove_debris(self.local)
            for step, path in pieces.step_dirs(self.local).items():
                if newest_kept is None or step > newest_kept:
                    pieces.remove_tree(path)
        if self.dist:
            dist.barrier(group=self.g_repl)  # no rank writes before its leader is done
        self.settled = True

    def save(self, step: int, state_dict: dict, mode: Any, stager: Any, persist: bool,
             user_metadata: Optional[bytes]) -> Any:
        """Start the local save of ``step``; queue its replication (and
        persistence).  Returns what dcpx.async_save returns (for a sync
        manager, dcpx.save's Metadata)."""
        t0 = time.monotonic()
        # One earlier step may still be replicating while this one is saved
        # locally: its copy overlaps the training, not this save.
        self.wait_replicated(keep=_IN_FLIGHT - 1)
        if persist:
            self.wait_persisted()
        if not self.settled:
            self.settle(step - 1)
        waited = time.monotonic() - t0
        self.seq += 1
        key = pieces.save_key(self.run, self.seq)
        piece = self._piece(step, key)
        upload: Future
        result: Any = None
        error: Optional[BaseException] = None
        try:
            self._check_space()
            os.makedirs(piece, exist_ok=True)
            if mode is None:
                result = _save(state_dict, checkpoint_id=piece, **self._solo())
                upload = Future()
                upload.set_result(result)
            else:
                result = _async_save(state_dict, checkpoint_id=piece, **self._solo(),
                                     async_checkpointer_type=mode, async_stager=stager)
                upload = getattr(result, "upload_completion", result)
        except BaseException as e:
            error = self._wrap_full(e, "the local save")
            upload = Future()
            upload.set_exception(error)
        times = self.timings.setdefault(step, {})
        times["blocked_s"] = time.monotonic() - t0
        times["waited_s"] = waited  # of blocked_s: for earlier steps' replication
        if persist:
            with self._lock:
                self._persisting.add(step)
        # Queued even when the local save failed: the partners' replication
        # and the persistence collectives wait for this rank's turn.
        self._repl_queue.append(self._repl.submit(self._replicate, step, key, upload, persist,
                                                  user_metadata, t0, error is not None))
        if error is not None:
            raise error
        return result

    def _replicate(self, step: int, key: str, upload: Future, persist: bool,
                   user_metadata: Optional[bytes], t0: float, reported: bool) -> None:
        """The replication thread's part of a step.  ``reported``: save()
        raised the local save's error already (not raised again here)."""
        times = self.timings.setdefault(step, {})
        ok, error = True, None
        try:
            upload.result()
        except BaseException as e:
            ok, error = False, (None if reported else self._wrap_full(e, "the local save"))
        times["local_s"] = time.monotonic() - t0
        if ok:
            self.last_piece_bytes = pieces.piece_bytes(self._piece(step, key))
        try:
            if self.replicas and self.dist:
                err = self._exchange(step, key, ok)
                error = error or err
            if self.dist:
                dist.barrier(group=self.g_repl)
            times["replicated_s"] = time.monotonic() - t0
        finally:
            if persist:
                self._last_persist = self._persist.submit(
                    self._persist_step, step, key, ok, user_metadata, t0, reported)
        if ok:
            self._kept.append((step, key))
        if self.leader:
            self._retain()
        if error is not None:
            raise error

    # ------------------------------------------------- pieces on the wire
    def _post_piece(self, out: Optional[Any], dst: int) -> list:
        """Post the sends of a piece (``out``: a pieces.Outgoing, or None
        for "no piece") to ``dst``: its index's length (0: none), the index,
        then each file's bytes from its mapping.  Returns the works and the
        tensors they send from (keep both until the works are waited)."""
        index = b"" if out is None else pieces.encode_index(out.index)
        head = torch.tensor([len(index)], dtype=torch.int64)
        keep = [head, _tensor_of(index)]
        works = [dist.isend(head, self._g(dst), group=self.g_repl)]
        if index:
            works.append(dist.isend(keep[1], self._g(dst), group=self.g_repl))
            for view in out.views():
                if view is None:
                    continue
                t = _tensor_of(view)
                keep.append(t)
                for i in range(0, t.numel(), _MSG):
                    works.append(dist.isend(t[i:i + _MSG], self._g(dst), group=self.g_repl))
        return works + keep

    def _recv_piece(self, src: int, dest: Path, what: str) -> bool:
        """Receive a piece from ``src`` into ``dest`` (committed there);
        False when ``src`` said it has none."""
        head = torch.zeros(1, dtype=torch.int64)
        dist.recv(head, self._g(src), group=self.g_repl)
        n = int(head.item())
        if n == 0:
            return False
        raw = torch.empty(n, dtype=torch.uint8)
        dist.recv(raw, self._g(src), group=self.g_repl)
        index = pieces.decode_index(raw.numpy(), what)
        try:
            inc = pieces.Incoming(dest, index, what, self.sync_files)
        except BaseException:
            # No room (or no folder) here: the sender's file messages are
            # still taken, into a scratch buffer, so both sides stay in step.
            scratch = torch.empty(min(_MSG, max((e[1] for e in index), default=0)),
                                  dtype=torch.uint8)
            for _, size, _ in index:
                for i in range(0, size, _MSG):
                    dist.recv(scratch[:min(_MSG, size - i)], self._g(src), group=self.g_repl)
            raise
        try:
            for view in inc.views():
                if view is None:
                    continue
                t = _tensor_of(view)
                for i in range(0, t.numel(), _MSG):
                    dist.recv(t[i:i + _MSG], self._g(src), group=self.g_repl)
                del t
            inc.commit()
        finally:
            inc.close()
        return True

    @staticmethod
    def _wait_all(posted: list) -> None:
        for w in posted:
            if hasattr(w, "wait"):
                w.wait()

    def _exchange(self, step: int, key: str, ok: bool) -> Optional[BaseException]:
        """Send this rank's piece to its partners and keep theirs (replica
        ``k`` from the rank ``k`` nodes back); "no piece" is sent when this
        rank has none of the step."""
        error = None
        for k in range(1, self.replicas + 1):
            dst, src = self.topology.partner(self.rank, k), self.topology.source(self.rank, k)
            out = None
            if ok:
                try:
                    out = pieces.Outgoing(self._piece(step, key))
                except Exception as e:  # the piece does not read: sent as none
                    error = e
            try:
                posted = self._post_piece(out, dst)
                try:
                    self._recv_piece(src, self._piece(step, key, src),
                                     f"the replica of rank {src}'s piece of step {step}")
                except (OSError, CheckpointError) as e:  # this node's: reported, in step
                    error = error or self._wrap_full(e, f"a replica of rank {src}")
                self._wait_all(posted)
                del posted
            finally:
                if out is not None:
                    out.close()
        return error

    def _retain(self) -> None:
        """The leader's deletion of old local steps: all but the newest
        ``keep_local_k`` this run saved, never one queued for persistence,
        never a step newer than those kept (a rank of the node may be
        writing it)."""
        kept = {s for s, _ in self._kept[-self.keep_local_k:]}
        if not kept:
            return
        newest = max(kept)
        with self._lock:
            busy = set(self._persisting)
        for step, path in pieces.step_dirs(self.local).items():
            if step < newest and step not in kept and step not in busy:
                pieces.remove_tree(path)
        self._kept = [(s, k) for s, k in self._kept if s in kept]

    # ------------------------------------------------------------ persist
    def _persist_step(self, step: int, key: str, ok: bool, user_metadata: Optional[bytes],
                      t0: float, reported: bool) -> None:
        try:
            self._persist_collective(step, key, ok, user_metadata)
            self.timings.setdefault(step, {})["persisted_s"] = time.monotonic() - t0
        except CheckpointError:
            if not (reported and not ok):  # this rank's save() raised why already
                raise
        finally:
            with self._lock:
                self._persisting.discard(step)
            with self.manager._lock:
                self.manager._writing.discard(step)

    def _gather(self, value: Any) -> Optional[list]:
        if not self.dist:
            return [value]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(value, out, dst=self._g(0), group=self.g_persist)
        return out

    def _scatter(self, values: Optional[list]) -> Any:
        if not self.dist:
            return values[0]
        box = [None]
        dist.scatter_object_list(box, values, src=self._g(0), group=self.g_persist)
        return box[0]

    def _persist_collective(self, step: int, key: str, ok: bool,
                            user_metadata: Optional[bytes]) -> None:
        """Assemble ``root/step-{step}`` from every rank's piece: gather the
        pieces' metadata on rank 0, which decides who writes which record;
        each rank copies its records into one data file; rank 0 commits the
        merged metadata.  A rank that fails still takes every turn."""
        m = self.manager
        root = m._root
        name = f"step-{step}"
        piece = self._piece(step, key)
        md, err = None, None
        if ok:
            try:
                md = pieces.read_metadata(piece)
            except Exception as e:
                err = f"rank {self.rank}: its piece {piece} does not read: {e}"
        else:
            err = f"rank {self.rank}: its local save of step {step} failed"
        gathered = self._gather((err, md))
        plan = None
        if self.rank == 0:
            errors = [e for e, _ in gathered if e]
            plan = [("error", "; ".join(errors))] * self.world if errors else None
            if plan is None:
                try:
                    owned = pieces.assign([md for _, md in gathered])
                    if name in root.names():  # a step saved again: the old one goes first
                        hidden = root.hide(name)
                        if hidden is not None:
                            root.remove(hidden)
                    plan = [("ok", o) for o in owned]
                except Exception as e:
                    plan = [("error", f"rank 0: {e}")] * self.world
        what, mine = self._scatter(plan)
        entries, err = None, None
        lock = None
        if what == "ok":
            try:
                entries, lock = self._write_records(root, name, piece, md, mine)
            except Exception as e:
                err = f"rank {self.rank}: {type(e).__name__}: {e}"
        else:
            err = mine
        written = self._gather((err, entries))
        result: list = [None]
        try:
            if self.rank == 0:
                errors = sorted({e for e, _ in written if e})
                if errors:
                    result = [f"persisting step {step} to {root} failed: " + "; ".join(errors)]
                else:
                    try:
                        merged = pieces.merge([md for _, md in gathered],
                                              [e for _, e in written],
                                              root.checkpoint_id(name), key)
                        if user_metadata is not None:  # before the commit, as save() writes it
                            root.write_file(name, "user_metadata.json", user_metadata)
                        if hasattr(root, "path"):
                            os.makedirs(root.path / name, exist_ok=True)
                            pieces.commit_metadata(root.path / name, merged, self.sync_files)
                        else:
                            root.write_file(name, ".metadata", pieces.encode_metadata(merged))
                    except Exception as e:
                        result = [f"persisting step {step} to {root} failed: rank 0: "
                                  f"{type(e).__name__}: {e}"]
            if self.dist:
                dist.broadcast_object_list(result, src=self._g(0), group=self.g_persist)
        finally:
            if lock is not None:
                lock.release()
        if result[0] is not None:
            raise CheckpointError(f"dcpx.CheckpointManager: {result[0]}")
        m._after_save(step, None)  # the persistent tier's retention (rank 0)

    def _write_records(self, root: Any, name: str, piece: Path, md: Any, keys: list) -> tuple:
        lock = None
        if not keys:  # every item this rank holds is written by another: no file
            return {}, None
        if hasattr(root, "path"):
            d = root.path / name
            os.makedirs(d, exist_ok=True)
            lock = pieces.claim(d)
            fname = pieces.data_file_name(self.rank, lock.tag)
            try:
                fd = os.open(d / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                with os.fdopen(fd, "wb", buffering=8 << 20) as f:
                    entries = pieces.write_records(piece, md, keys, f, fname)
                    f.flush()
                    if self.sync_files:
                        os.fsync(f.fileno())
            except BaseException:
                lock.release()
                raise
            return entries, lock
        import uuid
        fname = pieces.data_file_name(self.rank, uuid.uuid4().hex[:16])
        with root.fs.open(f"{root.root}/{name}/{fname}", "wb") as f:
            entries = pieces.write_records(piece, md, keys, f, fname)
        return entries, None

    # ------------------------------------------------------------- resume
    def _inventory(self) -> tuple:
        """What every rank's node holds, and the newest persistent step."""
        mine = pieces.scan(self.local)
        newest = self.manager.latest_step() if self.rank == 0 else None
        if not self.dist:
            return [mine], newest
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, (mine, newest), group=self.g_repl)
        return [e[0] for e in everyone], everyone[0][1]

    def candidates(self, held: list) -> list:
        """(step, key) that can be assembled completely from the pieces the
        ranks hold, newest first, with {rank: [holders]} for each."""
        holders: dict = {}
        for holder, listed in enumerate(held):
            for step, key, rank, world in listed:
                if world == self.world:
                    holders.setdefault((step, key), {}).setdefault(rank, []).append(holder)
        full = [(sk, h) for sk, h in holders.items() if len(h) == self.world]
        full.sort(key=lambda x: (x[0][0], pieces.key_order(x[0][1])), reverse=True)
        out, seen = [], set()
        for (step, key), h in full:
            if step not in seen:  # of one step, the newest save's pieces
                seen.add(step)
                out.append((step, key, h))
        return out

    def _fetch(self, step: int, key: str, holders: dict) -> bool:
        """Bring every rank's piece onto its own node (from a partner where
        the node lost it).  Transfers run in one global order, each between
        two ranks, so none waits for a transfer that waits for it.  Returns
        whether this rank fetched its piece."""
        moves = []
        for rank in range(self.world):
            h = holders[rank]
            if rank not in h:
                same = [x for x in h if self.topology.node_of[x] == self.topology.node_of[rank]]
                if not same:
                    moves.append((rank, min(h)))
        fetched = False
        for dst, src in moves:
            what = f"rank {src}'s replica of rank {dst}'s piece of step {step}"
            if self.rank == src:
                with pieces.Outgoing(self._piece(step, key, dst)) as out:
                    posted = self._post_piece(out, dst)
                    self._wait_all(posted)
                    del posted
            elif self.rank == dst:
                if not self._recv_piece(src, self._piece(step, key), what):
                    raise CheckpointError(f"dcpx.CheckpointManager: {what}: rank {src} sent none")
                fetched = True
        return fetched

    def _outcomes(self, value: tuple) -> list:
        if not self.dist:
            return [value]
        out: list = [None] * self.world
        dist.all_gather_object(out, value, group=self.g_repl)
        return out

    def resume(self, state_dict: dict, step: Optional[int], reader_options: dict,
               classify: Callable, warn: Callable) -> Optional[int]:
        """Load the newest step that the local tier can assemble completely
        (and that is not older than the newest persistent step) into
        ``state_dict``; return it, or None when the persistent tier must
        serve.  Collective on the tier's group."""
        self.wait_persisted()
        held, newest_persistent = self._inventory()
        for s, key, holders in self.candidates(held):
            if step is not None and s != step:
                continue
            if step is None and newest_persistent is not None and newest_persistent > s:
                break
            kind, msg, fetched = "ok", None, False
            try:
                fetched = self._fetch(s, key, holders)
                reader = None
                if reader_options:
                    from ..filesystem import FileSystemReader
                    reader = FileSystemReader(self._piece(s, key), **reader_options)
                if reader is None:
                    _load(state_dict, checkpoint_id=self._piece(s, key), **self._solo())
                else:
                    _load(state_dict, storage_reader=reader, **self._solo())
            except Exception as e:
                kind, msg = classify(e), f"{type(e).__name__}: {e}"
                if kind == "user":
                    err = e
            outcomes = self._outcomes((kind, msg, fetched))
            if all(k == "ok" for k, _, _ in outcomes):
                tier = "replica" if any(f for _, _, f in outcomes) else "local"
                self.last_resume = {"step": s, "tier": tier, "key": key}
                self.settle(s)
                self._kept = [(s, key)]
                return s
            if kind == "user":
                raise err
            if any(k == "user" for k, _, _ in outcomes):
                raise CheckpointError(
                    "dcpx.CheckpointManager: loading the local step %d failed on another rank: %s"
                    % (s, "; ".join(m for k, m, _ in outcomes if m)))
            why = "; ".join(f"rank {r}: {m}" for r, (k, m, _) in enumerate(outcomes) if m)
            warn(f"local step-{s} (save {key}): {why}; trying an older step")
        return None

    def resumed_from_persistent(self, step: Optional[int]) -> None:
        if step is not None:
            self.last_resume = {"step": step, "tier": "persistent", "key": None}
        self.settle(step)
