"""The node-local tier of dcpx.CheckpointManager: every save to node-local
storage first, a copy of each rank's piece on partner ranks of other
nodes, and the persistent checkpoint under the manager's ``root`` written
from the local tier every ``persist_interval_steps`` (docs/tiers.md).

Threads.  ``save()`` (the training thread) waits for the previous step's
local save (as the plain manager waits for its previous save), starts this
one -- ``dcpx.async_save`` of the rank's own state dict, ``no_dist``: no
collective -- and queues the step for two background threads: replication
(pieces swapped with the partners) and, every ``persist_interval_steps``,
persistence (the persistent step assembled from the pieces).  The training
thread never waits for either: when a thread falls behind, it takes the
newest step all ranks have queued and skips the older ones (each skip is
reported in ``tier_timings``).  The threads are daemons; an exit hook
finishes their work when the interpreter exits normally (the last
persisting save lands, as the plain manager's does) and abandons it after
an unhandled exception (a process never waits at exit for a partner).

Messages.  Each thread talks on a gloo group of the tier's own, so the
training collectives never wait for it, in rounds that rank 0 coordinates:
every rank proposes its newest queued step, rank 0 answers with the step
of the round (the oldest of the proposals), partners swap pieces
point-to-point, and rank 0 gathers what happened and answers with the
verdict (a step is "replicated" only when every rank's piece is stored on
its partners).  Every message is at most ``_FRAME`` bytes and every
receive is posted at ``_FRAME`` bytes, behind a header checked before
anything is allocated: a peer that sends more or other than it announced
costs a CheckpointError naming it, never a receive that gloo aborts the
process on.  A peer that does not answer within ``tier_timeout_s`` is
named in the CheckpointError, with the step; the tier then stops.

Who deletes.  Each node's lowest rank (its leader) deletes that node's
step folders of this job: after each replication round (every rank has
finished it), every step older than the newest ``keep_local_k`` saved,
except the newest replicated step and steps queued for persistence; and,
before a run's first save or at its resume, the steps newer than the one it
builds on.
"""
from __future__ import annotations

import atexit
import bisect
import collections
import json
import os
import socket
import struct
import sys
import threading
import time
import uuid
import warnings
import weakref
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..api.save_load import load as _load, save as _save
from ..api.async_save import async_save as _async_save
from ..errors import CheckpointError, CorruptCheckpointError
from ..filesystem import crc32, local_path, pieces

__all__ = ["LocalTier", "LocalTierFullError", "Topology"]

#: most bytes of one message on the tier's groups; every receive is posted
#: at this size (a larger message would make gloo abort the receiver)
_FRAME = 8 << 20
#: a message's header: magic, protocol version, kind, sender, step's save
#: number, payload length, payload CRC-32 (padded to _HEAD bytes)
_HDR = struct.Struct("<8sHHiqqI")
_HEAD = 64
_MAGIC = b"dcpxtier"
_VERSION = 1
#: message kinds
(_PROPOSE, _DECIDE, _PIECE, _NOPIECE, _OUTCOME, _VERDICT, _META, _FAIL, _PLAN,
 _WROTE, _OFFER) = range(1, 12)
_KIND_NAMES = {_PROPOSE: "proposal", _DECIDE: "decision", _PIECE: "piece", _NOPIECE: "no piece",
               _OUTCOME: "outcome", _VERDICT: "verdict", _META: "metadata", _FAIL: "failure",
               _PLAN: "plan", _WROTE: "records written", _OFFER: "offer"}
#: most bytes of a piece's index, of a small control message, of a piece's metadata
_MAX_INDEX = 1 << 20
_MAX_SMALL = 1 << 20
_MAX_META = 256 << 20


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


# ------------------------------------------------------------- messages

class _PeerError(Exception):
    """A message to or from ``rank`` failed: gloo timed out or lost the
    connection, or the peer broke the protocol (``protocol``)."""

    def __init__(self, rank: int, what: str, protocol: bool = False) -> None:
        super().__init__(what)
        self.rank, self.what, self.protocol = rank, what, protocol


class _Wire:
    """Messages between the ranks of one of the tier's gloo groups, used by
    one thread at a time.  Every message is at most ``_FRAME`` bytes and
    every receive is posted at ``_FRAME`` bytes, so nothing a peer sends can
    overrun a receive; a header (magic, version, kind, sender, save number,
    length, CRC-32) is checked before a payload is used or allocated."""

    def __init__(self, group: Any, me: int, timeout_s: float) -> None:
        self.group, self.me, self.timeout_s = group, me, timeout_s
        self._scratch: Optional[torch.Tensor] = None

    def scratch(self) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(_FRAME, dtype=torch.uint8)
        return self._scratch

    def _gloo(self, rank: int, what: str, e: BaseException) -> _PeerError:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "imed out" in text or "timeout" in text.lower():
            why = f"rank {rank} did not answer within {self.timeout_s:g} s ({what})"
        else:
            why = f"the connection to rank {rank} failed ({what}: {text[:300]})"
        return _PeerError(rank, why)

    def _isend(self, t: torch.Tensor, dst: int, what: str) -> Any:
        try:  # the group's own methods: it need not be in torch's registry
            return self.group.send([t], dst, 0)
        except RuntimeError as e:
            raise self._gloo(dst, what, e) from e

    def _recv(self, t: torch.Tensor, src: int, what: str) -> None:
        try:
            self.group.recv([t], src, 0).wait()
        except RuntimeError as e:
            raise self._gloo(src, what, e) from e

    def wait(self, posted: list) -> None:
        """Wait for the sends ``send``/``send_views`` posted."""
        for item in posted:
            if isinstance(item, tuple):
                work, dst, what = item
                try:
                    work.wait()
                except RuntimeError as e:
                    raise self._gloo(dst, what, e) from e

    def send(self, dst: int, kind: int, seq: int, payload: Any = b"") -> list:
        """Post one message (several frames when the payload is larger than
        a frame); returns what :meth:`wait` takes (keep it until then)."""
        n = len(payload)
        what = f"sending a {_KIND_NAMES[kind]}"
        head = _HDR.pack(_MAGIC, _VERSION, kind, self.me, int(seq), n,
                         crc32(payload) if n else 0).ljust(_HEAD, b"\0")
        if n <= _FRAME - _HEAD:
            msg = torch.frombuffer(bytearray(head + bytes(payload)), dtype=torch.uint8)
            return [(self._isend(msg, dst, what), dst, what), msg]
        first = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        out: list = [(self._isend(first, dst, what), dst, what), first]
        return out + self.send_views(dst, [payload], what)

    def send_views(self, dst: int, views: list, what: str = "sending a piece's bytes") -> list:
        """Post the bytes of ``views`` (buffers; None: nothing) in frames."""
        out: list = []
        for view in views:
            if view is None or len(view) == 0:
                continue
            t = _tensor_of(view)
            out.append(t)
            for i in range(0, t.numel(), _FRAME):
                out.append((self._isend(t[i:i + _FRAME], dst, what), dst, what))
        return out

    def recv_views(self, src: int, views: list, what: str = "receiving a piece's bytes") -> None:
        """Receive the bytes of ``views`` (writable buffers) as
        :meth:`send_views` sent them: whole frames straight into the buffer,
        the last part of each through the scratch frame."""
        scratch = self.scratch()
        for view in views:
            if view is None or len(view) == 0:
                continue
            t = torch.frombuffer(view, dtype=torch.uint8)
            n = t.numel()
            for i in range(0, n, _FRAME):
                if n - i >= _FRAME:
                    self._recv(t[i:i + _FRAME], src, what)
                else:
                    self._recv(scratch, src, what)
                    t[i:].copy_(scratch[:n - i])
            del t

    def pump(self, sends: list, recvs: list, what: str) -> None:
        """Move byte streams both ways at once: ``sends`` ``[(dst,
        [buffers])]``, ``recvs`` ``[(src, [writable buffers, or ints: bytes
        to drop])]``.  A stream is its buffers end to end, cut in frames of
        ``_FRAME`` bytes (the last one shorter), ``_WINDOW`` frames of each
        stream in flight (round trips overlap; memory stays bounded).  A
        frame that lies inside one buffer goes from or to it directly (a
        whole frame only, on the receiving side); one that spans buffers
        passes through a scratch frame.  Every receive is posted at
        ``_FRAME`` bytes.  Frame i of every stream is posted before the
        waits for frame i - _WINDOW + 1: a rank waits only for frames its
        peers posted earlier, so no cycle of ranks waits for itself."""
        outs = [_Stream(dst, views, False) for dst, views in sends]
        ins = [_Stream(src, views, True) for src, views in recvs]
        inflight: collections.deque = collections.deque()
        n = max([s.frames for s in outs + ins] + [0])
        for i in range(n):
            posted = []
            for st in outs:
                if i < st.frames:
                    t = st.frame_out(i)
                    posted.append((st, i, self._isend(t, st.rank, what), t))
            for st in ins:
                if i < st.frames:
                    t = st.frame_in(i)
                    try:
                        work = self.group.recv([t], st.rank, 0)
                    except RuntimeError as e:
                        raise self._gloo(st.rank, what, e) from e
                    posted.append((st, i, work, t))
            inflight.append(posted)
            if len(inflight) >= _WINDOW:
                self._settle(inflight.popleft(), what)
        while inflight:
            self._settle(inflight.popleft(), what)

    def _settle(self, posted: list, what: str) -> None:
        """Wait for one frame of each stream: the receives first (their
        bytes scattered where they go), then the sends."""
        for st, i, work, t in sorted(posted, key=lambda p: not p[0].incoming):
            try:
                work.wait()
            except RuntimeError as e:
                raise self._gloo(st.rank, what, e) from e
            if st.incoming:
                st.landed(i, t)
            else:
                st.sent(i)

    def recv(self, src: int, kinds: tuple, seq: Optional[int], limit: int) -> tuple:
        """The next message from ``src``: ``(kind, payload bytes)``.  A
        header that is not one, a kind or save number other than expected, a
        length beyond ``limit`` or a payload that fails its CRC-32 is the
        peer's protocol error."""
        scratch = self.scratch()
        scratch[:_HEAD].zero_()
        what = f"waiting for its {' or '.join(_KIND_NAMES[k] for k in kinds)}"
        self._recv(scratch, src, what)
        head = bytes(scratch[:_HDR.size].numpy())
        magic, version, kind, sender, got_seq, n, crc = _HDR.unpack(head)

        def bad(why: str) -> _PeerError:
            return _PeerError(src, f"rank {src} broke the tier's protocol ({what}): {why}",
                              protocol=True)
        if magic != _MAGIC or version != _VERSION:
            raise bad("not a message header (a message it sent more of than it announced, or "
                      "another dcpx version)")
        if kind not in kinds or sender != src or (seq is not None and got_seq != seq):
            raise bad(f"got a {_KIND_NAMES.get(kind, kind)} of rank {sender} for save "
                      f"{got_seq}, expected save {seq}")
        if not 0 <= n <= limit:
            raise bad(f"a {_KIND_NAMES[kind]} of {n} bytes (at most {limit} are taken)")
        if n <= _FRAME - _HEAD:
            payload = bytes(scratch[_HEAD:_HEAD + n].numpy())
        else:
            buf = bytearray(n)
            self.recv_views(src, [buf], what)
            payload = bytes(buf)
        if n and crc32(payload) != crc:
            raise bad(f"its {_KIND_NAMES[kind]} fails its CRC-32 (it sent fewer bytes than it "
                      f"announced, or others)")
        return kind, payload


#: frames of one stream in flight at once (Wire.pump)
_WINDOW = 4


class _Stream:
    """One byte stream of _Wire.pump: its buffers end to end, in frames."""

    def __init__(self, rank: int, views: list, incoming: bool) -> None:
        self.rank, self.incoming = rank, incoming
        self.views = [v for v in views if (v if isinstance(v, int) else len(v))]
        self.starts, total = [], 0
        for v in self.views:
            self.starts.append(total)
            total += v if isinstance(v, int) else len(v)
        self.total = total
        self.frames = -(-total // _FRAME)
        self.scratch: list = []   # frames that span buffers pass through these

    def parts(self, i: int) -> list:
        """(buffer, start, end, offset in the frame) of frame ``i``."""
        lo, hi = i * _FRAME, min((i + 1) * _FRAME, self.total)
        k = max(0, bisect.bisect_right(self.starts, lo) - 1)
        out = []
        while k < len(self.views) and self.starts[k] < hi:
            v = self.views[k]
            size = v if isinstance(v, int) else len(v)
            a, b = max(lo, self.starts[k]) - self.starts[k], min(hi, self.starts[k] + size) - self.starts[k]
            if b > a:
                out.append((v, a, b, self.starts[k] + a - lo))
            k += 1
        return out

    def _slot(self, i: int) -> torch.Tensor:
        while len(self.scratch) <= i % _WINDOW:
            self.scratch.append(torch.empty(_FRAME, dtype=torch.uint8))
        return self.scratch[i % _WINDOW]

    def frame_out(self, i: int) -> torch.Tensor:
        parts = self.parts(i)
        if len(parts) == 1:  # straight from the buffer (the page cache)
            v, a, b, _ = parts[0]
            return _tensor_of(v[a:b])
        t = self._slot(i)
        flat = memoryview(t.numpy()).cast("B")
        for v, a, b, at in parts:
            flat[at:at + b - a] = v[a:b]
        return t[:min(_FRAME, self.total - i * _FRAME)]

    def frame_in(self, i: int) -> torch.Tensor:
        parts = self.parts(i)
        if len(parts) == 1 and not isinstance(parts[0][0], int) and parts[0][2] - parts[0][1] == _FRAME:
            v, a, b, _ = parts[0]
            return torch.frombuffer(v[a:b], dtype=torch.uint8)
        return self._slot(i)

    def landed(self, i: int, t: torch.Tensor) -> None:
        parts = self.parts(i)
        if len(parts) == 1 and not isinstance(parts[0][0], int) and parts[0][2] - parts[0][1] == _FRAME:
            return
        flat = memoryview(t.numpy()).cast("B")
        for v, a, b, at in parts:
            if not isinstance(v, int):
                v[a:b] = flat[at:at + b - a]

    def sent(self, i: int) -> None:
        pass


def _aborted(answer: Any) -> Any:
    """``answer`` from rank 0, or the _PeerError it reports instead."""
    if isinstance(answer, dict) and "abort" in answer:
        rank = answer.get("rank")
        raise _PeerError(rank if type(rank) is int else 0, str(answer["abort"])[:1000])
    return answer


def _offer_of(data: bytes, src: int) -> list:
    """A partner's offer (pieces.offer), checked: ``[fqn, offsets, length,
    digest]`` entries."""
    got = _jload(data, src)
    ok = isinstance(got, list) and all(
        isinstance(e, list) and len(e) == 4 and isinstance(e[0], str)
        and (e[1] is None or (isinstance(e[1], list) and all(type(x) is int for x in e[1])))
        and type(e[2]) is int and type(e[3]) is int for e in got)
    if not ok:
        raise _PeerError(src, f"rank {src} broke the tier's protocol: its offer is not one",
                         protocol=True)
    return got


_group_counts: dict = {}


def _tier_group(parent: Any, ranks: list, rank: int, timeout: timedelta, what: str) -> Any:
    """A gloo group of ``ranks`` for the tier alone, built on the default
    store under a name of dcpx's own and kept out of torch's registry:
    ``dist.destroy_process_group()`` at the end of a script does not take
    it away from the exit hook that finishes the last save.  Every rank of
    ``parent`` makes its tiers' groups in the same order, so the names
    agree.  (Where torch's private pieces differ: ``new_group``.)"""
    import hashlib
    from torch.distributed import distributed_c10d as c10d
    name = (getattr(parent, "group_name", None) or "default") + ":" + hashlib.sha1(
        ",".join(map(str, ranks)).encode()).hexdigest()[:12]
    n = _group_counts[(name, what)] = _group_counts.get((name, what), -1) + 1
    try:
        store = dist.PrefixStore(f"dcpx_tier/{name}/{what}/{n}", c10d._get_default_store())
        return dist.ProcessGroupGloo(store, rank, len(ranks), timeout)
    except (AttributeError, TypeError):  # pragma: no cover - another torch's internals
        return dist.new_group(ranks, backend="gloo", timeout=timeout)


def _jdump(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _jload(data: bytes, src: int) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise _PeerError(src, f"rank {src} broke the tier's protocol: its message is not "
                              f"JSON ({type(e).__name__})", protocol=True) from None


# ------------------------------------------------------- background work

class _Job:
    """One save, as the background threads see it."""

    def __init__(self, step: int, key: str, seq: int, upload: Future, t0: float,
                 persist: bool, user_metadata: Optional[bytes], reported: bool) -> None:
        self.step, self.key, self.seq, self.upload, self.t0 = step, key, seq, upload, t0
        self.persist, self.user_metadata = persist, user_metadata
        #: save() raised the local save's failure already
        self.reported = reported


class _Pipeline:
    """A daemon thread that works through queued jobs (``work(pipeline)``
    takes them, several at a time when it is behind).  Daemon: the process
    never waits for it at exit; the tier's exit hook drains it when the
    interpreter exits normally."""

    def __init__(self, name: str, work: Callable) -> None:
        self.name, self.work = name, work
        self.cv = threading.Condition()
        self.jobs: collections.deque = collections.deque()
        self.busy = False
        self.stopped = False
        self.thread: Optional[threading.Thread] = None

    def put(self, job: _Job) -> None:
        with self.cv:
            self.jobs.append(job)
            self.cv.notify_all()
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self.thread.start()

    def newest(self) -> int:
        with self.cv:
            return self.jobs[-1].seq

    def take(self, seq: int) -> list:
        """The queued jobs up to save number ``seq``, oldest first."""
        out = []
        with self.cv:
            while self.jobs and self.jobs[0].seq <= seq:
                out.append(self.jobs.popleft())
        return out

    def drop(self) -> list:
        with self.cv:
            out = list(self.jobs)
            self.jobs.clear()
            return out

    def pending(self) -> bool:
        with self.cv:
            return bool(self.jobs) or self.busy

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.jobs and not self.stopped:
                    self.cv.wait()
                if self.stopped:
                    return
                self.busy = True
            try:
                self.work(self)
            except BaseException as e:  # noqa: BLE001 - a bug: never a silent dead thread
                sys.stderr.write(f"dcpx.CheckpointManager: the {self.name} thread failed: "
                                 f"{type(e).__name__}: {e}\n")
                self.drop()
            finally:
                with self.cv:
                    self.busy = False
                    self.cv.notify_all()

    def drain(self) -> None:
        """Wait until every queued job is done."""
        with self.cv:
            while self.jobs or self.busy:
                if self.thread is None or not self.thread.is_alive():
                    return
                self.cv.wait(0.5)

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()


#: live tiers, for the exit hook
_TIERS: "weakref.WeakSet" = weakref.WeakSet()
_hooked = False


def _exit_hook() -> None:
    """At interpreter exit, before the thread pools shut down: finish each
    live tier's queued work, or abandon it after an unhandled exception.

    Abandoning: a tier thread may be inside a gloo receive from a partner
    that never answers, and gloo offers no way to cancel one (aborting the
    group does not wake it), while the interpreter's teardown with a thread
    inside gloo aborts the process ("terminate called without an active
    exception").  So a crashed process whose tier is mid-round runs the
    atexit handlers, flushes its output and ends with status 1 at once, the
    status an unhandled exception gives."""
    crashed = (getattr(sys, "last_exc", None) is not None
               or getattr(sys, "last_value", None) is not None)
    stuck = False
    for tier in list(_TIERS):
        try:
            stuck = tier.at_exit(crashed) or stuck
        except BaseException as e:  # noqa: BLE001 - reported; exit goes on
            sys.stderr.write(f"dcpx.CheckpointManager: at exit: {type(e).__name__}: {e}\n")
    if stuck:
        try:
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed stream
                    pass
            os._exit(1)


def _register(tier: "LocalTier") -> None:
    global _hooked
    _TIERS.add(tier)
    if not _hooked:
        # threading's exit hooks run before the interpreter joins threads and
        # before concurrent.futures refuses new work (its hook was registered
        # before ours, and they run last-registered first): the local saves'
        # upload thread still runs while the tier's work is finished.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_exit_hook)
        else:  # pragma: no cover - every supported Python has it
            atexit.register(_exit_hook)
        _hooked = True


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
        if not float(timeout_s) > 0:
            raise ValueError(f"dcpx.CheckpointManager: tier_timeout_s must be > 0, got "
                             f"{timeout_s!r}")
        self.manager = manager
        self.local = local_path(local_root)
        os.makedirs(self.local, exist_ok=True)
        self.replicas = int(replicas)
        self.persist_interval = None if persist_interval_steps is None else int(persist_interval_steps)
        self.keep_local_k = int(keep_local_k)
        self.timeout_s = float(timeout_s)
        self.sync_files = True
        name = node if node is not None else f"{socket.gethostname()}:{os.path.realpath(self.local)}"
        self.dist = dist.is_available() and dist.is_initialized()
        pg = manager.process_group
        if self.dist:
            self.world = dist.get_world_size(pg)
            self.rank = dist.get_rank(pg)
            ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(self.world))
            self.global_rank = list(ranks)
            t = timedelta(seconds=self.timeout_s)
            # Groups of the tier's own: the replication and persistence
            # threads' messages never meet the training thread's.
            self.g_repl = _tier_group(pg, ranks, self.rank, t, "replicate")
            self.g_persist = _tier_group(pg, ranks, self.rank, t, "persist")
            self.w_repl = _Wire(self.g_repl, self.rank, self.timeout_s)
            self.w_persist = _Wire(self.g_persist, self.rank, self.timeout_s)
            self.w_main = _Wire(self.g_repl, self.rank, self.timeout_s)
            self.g_self = None
            if not _torch_has_no_dist():
                # torch < 2.7 has no no_dist=: a rank's own piece is saved and
                # loaded with a group of this rank alone instead (only this
                # rank creates it).
                self.g_self = dist.new_group([self.global_rank[self.rank]], backend="gloo",
                                             timeout=t, use_local_synchronization=True)
            first = None
            if self.rank == 0:
                try:
                    first = [time.time_ns(), pieces.job_id(manager._root), None]
                except Exception as e:  # noqa: BLE001 - raised on every rank below
                    first = [0, "", f"{type(e).__name__}: {e}"]
            clock, self.job, why = self._gather(first)[0]
            if why is not None:
                raise CheckpointError(f"dcpx.CheckpointManager: rank 0 could not read or make "
                                      f"the job's id in {manager._root}: {why}")
            seen = self._newest_segment_here()
            names, seen = self._meet(str(name), seen, clock)
        else:
            self.world, self.rank, self.global_rank = 1, 0, [0]
            self.g_repl = self.g_persist = self.g_self = None
            clock, self.job = time.time_ns(), pieces.job_id(manager._root)
            names, seen = [str(name)], self._newest_segment_here()
        self.topology = Topology(names)
        self.topology.check_replicas(self.replicas)
        self.leader = self.topology.leader(self.rank)
        # A segment: the saves since this start (or a resume); numbered above
        # every segment any node holds, so the newest one found is this run's.
        self.seg = max(clock, seen + 1)
        self.base: Optional[tuple] = None     # (segment, step) this segment builds on
        self.seq = 0
        self.settled = False         # stale steps removed (at the resume, or the first save)
        self._lock = threading.Lock()
        self._last: Optional[_Job] = None      # the newest save
        self._saved: list = []                 # (step, key) saved intact, oldest first
        self._replicated: Optional[tuple] = None  # the newest (step, key) replicated
        self._persisting: set = set()          # steps queued for persistence
        self._errors: list = []                # failures to raise at the next call
        self._broken: Optional[CheckpointError] = None  # the tier's groups failed
        self._broken_told = False
        self._deleting: list = []               # threads removing old steps
        self.closed = False
        self._repl = _Pipeline("dcpx-replicate", self._replication_round)
        self._persist = _Pipeline("dcpx-persist", self._persistence_round)
        self.last_piece_bytes: Optional[int] = None
        #: per step: seconds from the save() call to each stage, and what
        #: happened to it; what benchmarks/bench_tiers.py reports
        self.timings: dict = {}
        #: how the last load resumed: {"step", "tier": "local" | "replica" | "persistent"}
        self.last_resume: Optional[dict] = None
        _register(self)

    def _newest_segment_here(self) -> int:
        """The newest segment of this job among this node's save keys."""
        segs = [k.seg for k in (pieces.parse_key(key) for _, key, _, _ in pieces.scan(self.local))
                if k is not None and k.job == self.job]
        return max(segs, default=0)

    def _meet(self, name: str, seen: int, clock: int) -> tuple:
        """Every rank's node name and the newest segment any node holds;
        refuses two node names whose ranks share one folder (a replica
        would land on the node it protects).  Collective."""
        probe = self.local / f".dcpx-probe-{clock:x}-{self.rank}"
        open(probe, "wb").close()
        try:
            self._gather(None)  # every rank's probe is there
            here = sorted(int(n.rsplit("-", 1)[1]) for n in os.listdir(self.local)
                          if n.startswith(f".dcpx-probe-{clock:x}-"))
            everyone = self._gather([name, seen, here])
            self._gather(None)  # every rank has listed the probes
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass
        names = [e[0] for e in everyone]
        for r, (_, _, shared) in enumerate(everyone):
            for q in shared:
                if q < self.world and names[q] != names[r]:
                    raise ValueError(
                        f"dcpx.CheckpointManager: rank {r} (node {names[r]!r}) and rank {q} "
                        f"(node {names[q]!r}) share one local folder ({self.local} on rank "
                        f"{self.rank}): a replica would land on the node it protects. Give "
                        f"the ranks that share a folder one node= name, or each node its own "
                        f"local_root")
        return names, max(e[1] for e in everyone)

    # ----------------------------------------------------------- helpers
    def _solo(self, save: bool = False) -> dict:
        """The keywords that make dcpx.save / load touch this rank alone:
        nothing without a process group, else ``no_dist=True``, or, where
        torch lacks it, a group of this rank alone (with ``no_dist=True``
        for a save: dcpx's single-process path then makes no
        torch.distributed call, so an asynchronous save goes on after the
        user destroyed the process group; a state dict that path does not
        take, DTensors, goes on the group)."""
        if not self.dist:
            return {}
        if self.g_self is not None:
            return {"no_dist": True, "process_group": self.g_self} if save else \
                {"process_group": self.g_self}
        return {"no_dist": True}

    def scan(self) -> list:
        """The committed pieces of this job on this node: (step, key, rank, world)."""
        return [p for p in pieces.scan(self.local)
                if (pieces.parse_key(p[1]) or pieces.Key("", 0, None, 0)).job == self.job]

    def _g(self, rank: int) -> int:
        return self.global_rank[rank]

    def _piece(self, step: int, key: str, rank: Optional[int] = None) -> Path:
        return pieces.piece_dir(self.local, step, key, self.rank if rank is None else rank,
                                self.world)

    def _node_name(self, rank: int) -> str:
        return self.topology.names[rank]

    def _times(self, step: int) -> dict:
        return self.timings.setdefault(step, {})

    # ------------------------------------------------- errors and waiting
    def _push_error(self, e: BaseException) -> None:
        with self._lock:
            self._errors.append(e)

    def _raise_pending(self) -> None:
        """Raise what the background threads found for this rank (the first,
        with the others named), and a failure of the tier's groups once."""
        with self._lock:
            errors, self._errors = self._errors, []
        if self._broken is not None and not self._broken_told:
            self._broken_told = True
            errors = [self._broken] + [e for e in errors if e is not self._broken]
        if not errors:
            return
        first = errors[0]
        if len(errors) > 1:
            more = "; ".join(str(e) for e in errors[1:])
            first.args = (f"{first} (and: {more})",) + tuple(first.args[1:])
        raise first

    def _local_error(self, job: _Job) -> Optional[BaseException]:
        """Wait for ``job``'s local save; its failure (as a
        LocalTierFullError for a full disk) if it failed, else None."""
        try:
            job.upload.result()
        except BaseException as e:  # noqa: BLE001 - a torch CheckpointException too
            what = f"the local save of step {job.step}"
            err = self._wrap_full(e, what)
            if err is e and not (isinstance(e, CheckpointError) and f"step {job.step}" in str(e)):
                err = CheckpointError(f"dcpx.CheckpointManager: {what} failed: "
                                      f"{type(e).__name__}: {e}")
                err.__cause__ = e
            return err
        return None

    def _report_local(self, job: Optional[_Job]) -> None:
        """Raise ``job``'s local save failure unless raised already."""
        if job is None or job.reported:
            return
        err = self._local_error(job)
        if err is not None:
            job.reported = True
            raise err

    def wait_replicated(self, keep: int = 0) -> None:
        """Wait until every queued step's replication round is done; raise
        what it found for this rank.  (``keep``: kept for callers of the
        earlier API; the replication thread never leaves steps behind.)"""
        self._repl.drain()
        self._raise_pending()

    def wait_persisted(self) -> None:
        """Wait for the last local save, every queued replication and
        persistence and the deletions of old steps; raise what they found
        for this rank.  A failed local save is raised once the rounds are
        done: this rank still takes its turns in them (at exit, a thread
        left inside gloo would abort the process and cut the partners off)."""
        try:
            self._report_local(self._last)
        finally:
            self._repl.drain()
            self._persist.drain()
            for t in list(self._deleting):
                t.join()
        self._raise_pending()

    def close(self) -> None:
        try:
            self.wait_persisted()
        finally:
            self.closed = True
            self._repl.stop()
            self._persist.stop()
            _TIERS.discard(self)

    def at_exit(self, crashed: bool) -> bool:
        """The interpreter exits and close() was not called: finish the
        queued work (each message bounded by tier_timeout_s), or, after an
        unhandled exception, leave it (a crashed rank must not wait for its
        partners; its local pieces stay for a resume).  Returns whether a
        thread of this tier is mid-round (see _exit_hook)."""
        if self.closed or not (self._repl.pending() or self._persist.pending()):
            return False
        with self._repl.cv, self._persist.cv:
            steps = sorted({j.step for j in list(self._repl.jobs) + list(self._persist.jobs)})
            busy = self._repl.busy or self._persist.busy
        if crashed:
            self._repl.stop()
            self._persist.stop()
            sys.stderr.write(f"dcpx.CheckpointManager: exiting after an error: the replication "
                             f"and persistence of step(s) {steps or 'in progress'} are abandoned "
                             f"(the local pieces stay for a resume)\n")
            return busy
        try:
            self.wait_persisted()
        except BaseException as e:  # noqa: BLE001 - reported; the exit goes on
            sys.stderr.write(f"dcpx.CheckpointManager: at exit, finishing step(s) {steps}: "
                             f"{type(e).__name__}: {e}\n")
        return False

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

    def _peer_failed(self, e: _PeerError, step: int, what: str) -> CheckpointError:
        """The tier's groups failed (a peer timed out, went away or broke the
        protocol): the error every later call raises; the background work
        stops."""
        node = self._node_name(e.rank) if 0 <= e.rank < self.world else "?"
        err = CheckpointError(f"dcpx.CheckpointManager: the {what} of step {step} failed: "
                              f"{e.what} (rank {e.rank}, node {node!r}); the tier stops "
                              f"replicating and persisting (the local pieces stay)")
        with self._lock:
            if self._broken is None:
                self._broken = err
        for pipe in (self._repl, self._persist):
            for job in pipe.drop():
                key = "replication" if pipe is self._repl else "persistence"
                self._times(job.step)[key] = f"failed: {self._broken}"
                if pipe is self._persist:
                    self._done_persisting(job.step)
        return err

    # -------------------------------------------------------------- save
    def settle(self, newest_kept: Optional[int]) -> None:
        """Remove this job's steps on the node newer than ``newest_kept``
        (None: all of them), and transfers or deletions a kill interrupted:
        a run never resumes onto a step of a run it did not build on.
        Collective."""
        if self.leader:
            pieces.remove_debris(self.local)
            for step, paths in pieces.key_dirs(self.local, self.job).items():
                if newest_kept is None or step > newest_kept:
                    for path in paths:
                        pieces.remove_key(path)
        self._gather(None)  # no rank writes before its leader is done
        self.settled = True

    def save(self, step: int, state_dict: dict, mode: Any, stager: Any, persist: bool,
             user_metadata: Optional[bytes]) -> Any:
        """Start the local save of ``step`` and queue it for replication
        (and persistence); the training thread waits only for the previous
        step's local save.  Returns what dcpx.async_save returns (for a sync
        manager, dcpx.save's Metadata).  An earlier step's failure (its
        local save, or what the background threads found for this rank) is
        raised here first, and this step is then not saved."""
        t0 = time.monotonic()
        if self._broken is not None:
            self._broken_told = True
            raise CheckpointError(str(self._broken))
        error: Optional[BaseException] = None
        prev = self._last
        if prev is not None and not prev.reported:
            error = self._local_error(prev)  # as the plain manager waits for its last save
            if error is not None:
                prev.reported = True
        if error is None:
            try:
                self._raise_pending()
            except BaseException as e:  # noqa: BLE001 - raised below, in step with the others
                error = e
        if not self.settled:
            self.settle(step - 1)
        waited = time.monotonic() - t0
        self.seq += 1
        key = pieces.save_key(self.job, self.seg, self.base, self.seq)
        result: Any = None
        upload: Future = Future()
        if error is None:
            piece = self._piece(step, key)
            try:
                self._check_space()
                os.makedirs(piece, exist_ok=True)
                if mode is None:
                    result = _save(state_dict, checkpoint_id=piece, **self._solo(save=True))
                    upload.set_result(result)
                else:
                    result = _async_save(state_dict, checkpoint_id=piece, **self._solo(save=True),
                                         async_checkpointer_type=mode, async_stager=stager)
                    upload = getattr(result, "upload_completion", result)
            except BaseException as e:  # noqa: BLE001 - raised below
                error = self._wrap_full(e, f"the local save of step {step}")
        times = self._times(step)
        times.update(blocked_s=time.monotonic() - t0, waited_s=waited)
        if error is not None:
            upload = Future()
            upload.set_exception(error)
            times["local"] = f"not saved: {error}"
        else:  # when the piece committed, not when a thread looked
            upload.add_done_callback(
                lambda f, times=times: times.__setitem__("local_s", time.monotonic() - t0))
        job = _Job(step, key, self.seq, upload, t0, persist, user_metadata, error is not None)
        self._last = job
        # Queued even when nothing was saved: the other ranks' rounds take
        # this rank's turn ("no piece").
        self._repl.put(job)
        if persist:
            with self._lock:
                self._persisting.add(step)
            self._persist.put(job)
        if error is not None:
            raise error
        return result

    def _local_done(self, job: _Job) -> bool:
        """Wait for ``job``'s local save (on a background thread); note its
        time and size.  Whether it committed."""
        err = self._local_error(job)
        times = self._times(job.step)
        if err is not None:
            times.setdefault("local", f"failed: {err}")
            return False
        times["local"] = "done"
        with self._lock:
            if (job.step, job.key) not in self._saved:
                self._saved.append((job.step, job.key))
        self.last_piece_bytes = pieces.piece_bytes(self._piece(job.step, job.key))
        return True

    # ------------------------------------------------------ replication
    def _agree(self, wire: _Wire, newest: int) -> int:
        """The save number of this round: rank 0 takes every rank's newest
        queued one and answers with the oldest of them (a save every rank
        has queued).  Raises _PeerError naming a rank that did not answer."""
        if self.rank != 0:
            posted = wire.send(0, _PROPOSE, newest, _jdump({"seq": newest}))
            _, payload = wire.recv(0, (_DECIDE,), None, _MAX_SMALL)
            wire.wait(posted)
            answer = _aborted(_jload(payload, 0))
            if not (isinstance(answer, dict) and type(answer.get("seq")) is int):
                raise _PeerError(0, "rank 0 broke the tier's protocol: it sent no decision",
                                 protocol=True)
            return answer["seq"]
        seqs = [newest]
        for r in range(1, self.world):
            try:
                _, payload = wire.recv(r, (_PROPOSE,), None, _MAX_SMALL)
                got = _jload(payload, r)
                if not (isinstance(got, dict) and type(got.get("seq")) is int):
                    raise _PeerError(r, f"rank {r} broke the tier's protocol: its proposal is "
                                        f"{str(got)[:100]}", protocol=True)
            except _PeerError as e:
                self._abort(wire, _DECIDE, -1, e)
                raise
            seqs.append(got["seq"])
        agreed = min(seqs)
        posted: list = []
        for r in range(1, self.world):
            posted += wire.send(r, _DECIDE, agreed, _jdump({"seq": agreed}))
        wire.wait(posted)
        return agreed

    def _abort(self, wire: _Wire, kind: int, seq: int, e: _PeerError) -> None:
        """Rank 0 tells every other rank (but the failed one) why the answer
        they wait for (a message of ``kind``) does not come: each raises the
        same error, naming the rank.  A rank that has not sent its own
        message yet takes the answer after it."""
        msg = _jdump({"abort": e.what, "rank": e.rank})
        for r in range(1, self.world):
            if r != e.rank:
                try:
                    wire.wait(wire.send(r, kind, seq, msg))
                except _PeerError:
                    pass

    def _star(self, wire: _Wire, seq: int, mine: Any, verdict: Callable,
              limit: int = _MAX_SMALL) -> Any:
        """Every rank's ``mine`` (JSON) to rank 0, which answers every rank
        with ``verdict(all of them)`` (JSON); ``limit``: the most bytes of
        each."""
        if self.rank != 0:
            posted = wire.send(0, _OUTCOME, seq, _jdump(mine))
            _, payload = wire.recv(0, (_VERDICT,), seq, limit)
            wire.wait(posted)
            return _aborted(_jload(payload, 0))
        got = [mine]
        for r in range(1, self.world):
            try:
                _, payload = wire.recv(r, (_OUTCOME,), seq, limit)
                got.append(_jload(payload, r))
            except _PeerError as e:
                self._abort(wire, _VERDICT, seq, e)
                raise
        answer = verdict(got)
        data = _jdump(answer)
        posted = []
        for r in range(1, self.world):
            posted += wire.send(r, _VERDICT, seq, data)
        wire.wait(posted)
        return answer

    def _replication_round(self, pipe: _Pipeline) -> None:
        """One round: agree on the step, skip older queued ones, swap pieces
        with the partners, learn whether every piece is stored, delete old
        steps (the leader)."""
        job = None
        with pipe.cv:
            step = pipe.jobs[-1].step  # (the round's step, for a failure before it is agreed)
        try:
            if self.dist:
                seq = self._agree(self.w_repl, pipe.newest())
            else:
                seq = pipe.newest()
            jobs = pipe.take(seq)
            if not jobs or jobs[-1].seq != seq:
                raise _PeerError(0, f"the ranks disagree on their saves (save {seq} is not "
                                    f"queued here): every rank must save the same steps",
                                 protocol=True)
            job = jobs[-1]
            for older in jobs[:-1]:
                self._local_done(older)
                self._times(older.step)["replication"] = (
                    f"skipped: replication was behind; step {job.step} was replicated instead")
            ok = self._local_done(job)
            got = self._exchange(job, ok) if self.dist and self.replicas else {}
            mine = {"ok": ok, "got": got}
            answer = (self._star(self.w_repl, job.seq, mine, self._replication_verdict)
                      if self.dist else self._replication_verdict([mine]))
            if not isinstance(answer, dict):
                raise _PeerError(0, "rank 0 broke the tier's protocol: its verdict is not one",
                                 protocol=True)
        except _PeerError as e:
            self._push_error(self._peer_failed(e, job.step if job else step, "replication"))
            if job is not None:
                self._times(job.step)["replication"] = f"failed: {self._broken}"
            return
        times = self._times(job.step)
        if answer.get("ok"):
            times["replicated_s"] = time.monotonic() - job.t0
            times["replication"] = "done"
            self._replicated = (job.step, job.key)
        else:
            times["replication"] = f"failed: {answer.get('why')}"
        if self.leader:
            self._retain()

    def _replication_verdict(self, got: list) -> dict:
        """Rank 0: whether every rank's piece is stored locally and on each
        of its partners, and if not, why (from every rank's outcome)."""
        local = [isinstance(g, dict) and g.get("ok") is True for g in got]
        why = [f"rank {r}'s local save failed" for r, ok in enumerate(local) if not ok]
        for r, g in enumerate(got):
            received = g.get("got") if isinstance(g, dict) else None
            for k in range(1, self.replicas + 1):
                src = self.topology.source(r, k)
                status = received.get(str(src)) if isinstance(received, dict) else None
                if status == "ok" or (status == "none" and not local[src]):
                    continue
                why.append(f"rank {src}'s replica on rank {r}: {str(status)[:300]}")
        return {"ok": not why, "why": "; ".join(why)}

    def _exchange(self, job: _Job, ok: bool) -> dict:
        """Send this rank's piece to its partners and keep theirs (replica
        ``k`` from the rank ``k`` nodes back); "no piece" when this rank has
        none of the step.  First each receiver offers the tensor records of
        its own piece (pieces.offer): a record it holds already (a
        data-parallel replica) is not sent but copied on its node.  Returns
        ``{source rank: "ok" | "none" | why}``; this rank's own failures (a
        full disk, a damaged arrival) are queued to be raised at its next
        call."""
        got: dict = {}
        w = self.w_repl
        own = self._piece(job.step, job.key)
        md = None
        if ok:
            try:
                md = pieces.read_metadata(own)
            except Exception as e:  # noqa: BLE001 - the piece does not read: sent as none
                self._push_error(CheckpointError(
                    f"dcpx.CheckpointManager: this rank's piece of step {job.step} does not "
                    f"read, so it was not replicated: {e}"))
        mine = pieces.offer(own, md) if md is not None else []
        sent = reused = 0
        for k in range(1, self.replicas + 1):
            dst = self.topology.partner(self.rank, k)
            src = self.topology.source(self.rank, k)
            posted = w.send(src, _OFFER, job.seq, _jdump(mine))
            theirs = _offer_of(w.recv(dst, (_OFFER,), job.seq, _MAX_META)[1], dst)
            out = None
            if md is not None:
                try:
                    out = pieces.Outgoing(own)
                    reused += out.skip_held(theirs, md)
                    sent += sum(b - a for e in out.index for a, b in pieces.segments(e))
                except Exception as e:  # noqa: BLE001 - the piece does not read: sent as none
                    if out is not None:
                        out.close()
                        out = None
                    self._push_error(CheckpointError(
                        f"dcpx.CheckpointManager: this rank's piece of step {job.step} does not "
                        f"read, so it was not replicated: {e}"))
            what = f"the replica of rank {src}'s piece of step {job.step}"
            try:
                status = self._transfer(w, job.seq, [(dst, out)],
                                        (src, self._piece(job.step, job.key, src), what,
                                         own if md is not None else None, mine))
                w.wait(posted)
            finally:
                if out is not None:
                    out.close()
            if status not in ("ok", "none"):  # this node's: reported, in step
                self._push_error(status)
                status = f"{type(status).__name__}: {status}"[:500]
            got[str(src)] = status
        times = self._times(job.step)
        times["sent_bytes"], times["reused_bytes"] = sent, reused
        return got

    def _retain(self) -> None:
        """The leader's deletion of this job's old local steps: all but the
        newest ``keep_local_k`` saved and the newest replicated step, never
        one queued for persistence, never a step newer than those kept (a
        rank of the node may be writing it)."""
        with self._lock:
            saved = list(self._saved[-self.keep_local_k:])
            busy = set(self._persisting)
        kept = {s for s, _ in saved}
        if self._replicated is not None:
            kept.add(self._replicated[0])
        if not kept:
            return
        newest = max(kept)
        for step, paths in pieces.key_dirs(self.local, self.job).items():
            if step < newest and step not in kept and step not in busy:
                for path in paths:
                    t = pieces.remove_key(path, later=True)
                    if t is not None:
                        self._deleting.append(t)
        self._deleting = [t for t in self._deleting if t.is_alive()]
        with self._lock:
            self._saved = [(s, k) for s, k in self._saved if s in kept or s >= newest]

    # ------------------------------------------------- pieces on the wire
    def _transfer(self, wire: _Wire, seq: int, sends: list, recv: Optional[tuple]) -> Any:
        """Move pieces: to each ``(dst, pieces.Outgoing or None)`` of
        ``sends`` its index (or "no piece") and bytes, and from ``recv`` --
        ``(src, dest, what, own piece or None, own offer)`` -- one piece into
        ``dest``, its holes filled from this rank's own piece, checked and
        committed there.  The bytes of both ways move at once (_Wire.pump).
        Returns, for ``recv``, "ok", "none" (``src`` has none) or this
        rank's own failure (no room, a piece that fails its checks: an
        OSError or CheckpointError, with every byte ``src`` sent taken);
        raises _PeerError when ``src`` breaks the protocol or a peer does
        not answer."""
        posted: list = []
        for dst, out in sends:
            posted += (wire.send(dst, _NOPIECE, seq) if out is None
                       else wire.send(dst, _PIECE, seq, pieces.encode_index(out.index)))
        outgoing = [(dst, [v for views in out.views() for v in views])
                    for dst, out in sends if out is not None]
        incoming: list = []
        inc, status = None, "none"
        if recv is not None:
            src, dest, what, own, offered = recv
            kind, payload = wire.recv(src, (_PIECE, _NOPIECE), seq, _MAX_INDEX)
            if kind == _PIECE:
                try:
                    index = pieces.decode_index(payload, what, len(offered or []) if own else 0)
                except CorruptCheckpointError as e:
                    raise _PeerError(src, f"rank {src} broke the tier's protocol: {e}",
                                     protocol=True) from None
                try:
                    inc = pieces.Incoming(dest, index, what, self.sync_files)
                    incoming = [(src, [v for views in inc.views() for v in views])]
                except (OSError, CheckpointError) as e:  # every byte is still taken
                    status = self._wrap_full(e, f"receiving {what}")
                    incoming = [(src, [b - a for e in index for a, b in pieces.segments(e)])]
        try:
            wire.pump(outgoing, incoming, "sending or receiving a piece's bytes")
            del outgoing, incoming
            if inc is not None:
                try:
                    if own is not None:
                        inc.keep_holes(own, offered)
                    inc.commit()
                    status = "ok"
                except (OSError, CheckpointError) as e:
                    status = self._wrap_full(e, f"receiving {what}")
        finally:
            if inc is not None:
                inc.close()
        wire.wait(posted)
        if isinstance(status, OSError) and not isinstance(status, CheckpointError):
            status = CheckpointError(f"dcpx.CheckpointManager: receiving {what} failed: {status}")
        return status

    # ------------------------------------------------------------ persist
    def _done_persisting(self, step: int) -> None:
        with self._lock:
            self._persisting.discard(step)
        with self.manager._lock:
            self.manager._writing.discard(step)

    def _persistence_round(self, pipe: _Pipeline) -> None:
        """Agree on the step (the newest queued for persistence on every
        rank; older ones are skipped) and write it under root."""
        job = None
        jobs: list = []
        with pipe.cv:
            step = pipe.jobs[-1].step  # (the round's step, for a failure before it is agreed)
        try:
            seq = self._agree(self.w_persist, pipe.newest()) if self.dist else pipe.newest()
            jobs = pipe.take(seq)
            if not jobs or jobs[-1].seq != seq:
                raise _PeerError(0, f"the ranks disagree on the steps to persist (save {seq} is "
                                    f"not queued here)", protocol=True)
            job = jobs[-1]
            for older in jobs[:-1]:
                self._times(older.step)["persistence"] = (
                    f"skipped: persistence was behind; step {job.step} was persisted instead")
                self._done_persisting(older.step)
            ok = self._local_error(job) is None
            try:
                self._persist_collective(job, ok)
                times = self._times(job.step)
                times["persisted_s"] = time.monotonic() - job.t0
                times["persistence"] = "done"
            except CheckpointError as e:
                self._times(job.step)["persistence"] = f"failed: {e}"
                if not (job.reported and not ok):  # this rank's save() raised why already
                    self._push_error(e)
        except _PeerError as e:
            self._push_error(self._peer_failed(e, job.step if job else step, "persistence"))
            if job is not None:
                self._times(job.step)["persistence"] = f"failed: {self._broken}"
        finally:
            if job is not None:
                self._done_persisting(job.step)

    def _persist_collective(self, job: _Job, ok: bool) -> None:
        """Assemble ``root/step-{step}`` from every rank's piece: rank 0 is
        sent every piece's ``.metadata`` (parsed with dcpx's safe
        unpickler), decides who writes which record and sends each rank its
        list; each rank copies its records into one data file and says
        which; rank 0 commits the merged metadata and sends the verdict.  A
        rank that fails still takes every turn."""
        step, key = job.step, job.key
        m = self.manager
        root = m._root
        name = f"step-{step}"
        piece = self._piece(step, key)
        w = self.w_persist if self.dist else None
        md_bytes, err = None, None
        if ok:
            try:
                md_bytes = pieces.metadata_bytes(piece)
            except Exception as e:  # noqa: BLE001 - reported through rank 0
                err = f"rank {self.rank}: its piece {piece} does not read: {e}"
        else:
            err = f"rank {self.rank}: its local save of step {step} failed"
        # 1. every piece's metadata to rank 0, which plans
        if self.rank != 0:
            posted = (w.send(0, _FAIL, job.seq, err.encode()) if err is not None
                      else w.send(0, _META, job.seq, md_bytes))
            _, payload = w.recv(0, (_PLAN,), job.seq, _MAX_META)
            w.wait(posted)
            plan = _aborted(_jload(payload, 0))
            metas = owned = None
        else:
            metas, errors = [None] * self.world, []
            for r in range(self.world):
                if r == 0:
                    kind, data = (_FAIL, err.encode()) if err is not None else (_META, md_bytes)
                else:
                    try:
                        kind, data = w.recv(r, (_META, _FAIL), job.seq, _MAX_META)
                    except _PeerError as e:
                        self._abort(w, _PLAN, job.seq, e)
                        raise
                if kind == _FAIL:
                    errors.append(data.decode("utf-8", "replace")[:1000])
                    continue
                try:
                    metas[r] = pieces.metadata_of(data, f"rank {r}'s piece of step {step}")
                except Exception as e:  # noqa: BLE001 - a piece that does not parse
                    errors.append(f"rank {r}: {e}")
            plans, owned = self._plan(root, name, metas, errors)
            if self.dist:
                posted = []
                for r in range(1, self.world):
                    posted += w.send(r, _PLAN, job.seq, _jdump(plans[r]))
                w.wait(posted)
            plan = plans[0]
        # 2. each rank writes its records
        entries_file, werr, lock = None, None, None
        if isinstance(plan, dict) and isinstance(plan.get("keys"), list):
            try:
                mine = pieces.read_metadata(piece)
                keys = list(mine.storage_data)
                chosen = [keys[i] for i in plan["keys"]]
                entries_file, lock = self._write_records(root, name, piece, mine, chosen)
            except Exception as e:  # noqa: BLE001 - reported through rank 0
                werr = f"rank {self.rank}: {type(e).__name__}: {e}"
        else:
            werr = str(plan.get("error") if isinstance(plan, dict) else plan)[:2000]
        try:
            result = self._commit_step(w, job, root, name, key, metas, owned, entries_file,
                                       werr)
        finally:
            if lock is not None:
                lock.release()
        if result is not None:
            raise CheckpointError(f"dcpx.CheckpointManager: {result}")
        m._after_save(step, None)  # the persistent tier's retention (rank 0)

    def _plan(self, root: Any, name: str, metas: list, errors: list) -> tuple:
        """Rank 0: per rank, ``{"keys": [positions in its storage_data]}``
        (the records it writes), or ``{"error": why}`` for every rank; and
        the keys themselves (None after an error)."""
        if not errors:
            try:
                owned = pieces.assign(metas)
                if name in root.names():  # a step saved again: the old one goes first
                    hidden = root.hide(name)
                    if hidden is not None:
                        root.remove(hidden)
                plans = []
                for md, keys in zip(metas, owned):
                    where = {k: i for i, k in enumerate(md.storage_data)}
                    plans.append({"keys": [where[k] for k in keys]})
                return plans, owned
            except Exception as e:  # noqa: BLE001 - reported to every rank
                errors = [f"rank 0: {type(e).__name__}: {e}"]
        return [{"error": "; ".join(errors)}] * self.world, None

    def _commit_step(self, w: Optional[_Wire], job: _Job, root: Any, name: str, key: str,
                     metas: Optional[list], owned: Optional[list], mine: Optional[str],
                     err: Optional[str]) -> Optional[str]:
        """Every rank's data file (or failure) to rank 0, which writes the
        merged ``.metadata`` (the step commits) and answers with the
        verdict: None, or why the step was not persisted."""
        step = job.step
        report = {"file": mine, "error": err}
        if self.rank != 0:
            posted = w.send(0, _WROTE, job.seq, _jdump(report))
            _, payload = w.recv(0, (_VERDICT,), job.seq, _MAX_SMALL)
            w.wait(posted)
            verdict = _aborted(_jload(payload, 0))
            return verdict.get("error") if isinstance(verdict, dict) else "rank 0 sent no verdict"
        reports = [report]
        for r in range(1, self.world):
            try:
                reports.append(_jload(w.recv(r, (_WROTE,), job.seq, _MAX_SMALL)[1], r))
            except _PeerError as e:
                self._abort(w, _VERDICT, job.seq, e)
                raise
        errors = sorted({str(r.get("error"))[:2000] for r in reports
                         if not isinstance(r, dict) or r.get("error")})
        result = None
        if errors:
            result = f"persisting step {step} to {root} failed: " + "; ".join(errors)
        else:
            try:
                entries = []
                for md, keys, r in zip(metas, owned, reports):
                    entries.append({} if not keys else
                                   pieces.layout(md, keys, str(r.get("file")))[0])
                merged = pieces.merge(metas, entries, root.checkpoint_id(name), key)
                if job.user_metadata is not None:  # before the commit, as save() writes it
                    root.write_file(name, "user_metadata.json", job.user_metadata)
                if hasattr(root, "path"):
                    os.makedirs(root.path / name, exist_ok=True)
                    pieces.commit_metadata(root.path / name, merged, self.sync_files)
                else:
                    root.write_file(name, ".metadata", pieces.encode_metadata(merged))
            except Exception as e:  # noqa: BLE001 - reported to every rank
                result = f"persisting step {step} to {root} failed: rank 0: {type(e).__name__}: {e}"
        if self.dist:
            posted = []
            for r in range(1, self.world):
                posted += w.send(r, _VERDICT, job.seq, _jdump({"error": result}))
            w.wait(posted)
        return result

    def _write_records(self, root: Any, name: str, piece: Path, md: Any, keys: list) -> tuple:
        """Copy this rank's records into one new data file of the step:
        ``(its name, the save lock held meanwhile)``; (None, None) when
        another rank writes every item this rank holds."""
        lock = None
        if not keys:
            return None, None
        if hasattr(root, "path"):
            d = root.path / name
            os.makedirs(d, exist_ok=True)
            lock = pieces.claim(d)
            fname = pieces.data_file_name(self.rank, lock.tag)
            try:
                fd = os.open(d / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                try:
                    pieces.write_records(piece, md, keys, fd, fname)
                    if self.sync_files:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            except BaseException:
                lock.release()
                raise
            return fname, lock
        fname = pieces.data_file_name(self.rank, uuid.uuid4().hex[:16])
        with root.fs.open(f"{root.root}/{name}/{fname}", "wb") as f:
            pieces.write_records(piece, md, keys, f, fname)
        return fname, None

    # ------------------------------------------------------------- resume
    def _inventory(self) -> tuple:
        """What every rank's node holds of this job, the newest persistent
        step, the newest segment anywhere and rank 0's clock."""
        mine = self.scan()
        newest = self.manager.latest_step() if self.rank == 0 else None
        seen = max([k.seg for k in (pieces.parse_key(p[1]) for p in mine) if k] + [self.seg])
        everyone = self._gather([[list(p) for p in mine], newest, seen, time.time_ns()])
        held = [[tuple(p) for p in e[0]] for e in everyone]
        return held, everyone[0][1], max(e[2] for e in everyone), everyone[0][3]

    def candidates(self, held: list) -> list:
        """(step, key, {rank: [holders]}) of the saves whose pieces, one per
        rank of this world size, exist somewhere and that lie on this job's
        line (:func:`pieces.lineage`), newest first; and the complete saves
        off that line newer than the newest candidate (never loaded)."""
        holders: dict = {}
        for holder, listed in enumerate(held):
            for step, key, rank, world in listed:
                if world == self.world:
                    holders.setdefault((step, key), {}).setdefault(rank, []).append(holder)
        line = pieces.lineage({key for listed in held for _, key, _, _ in listed})
        full = [(sk, h) for sk, h in holders.items() if len(h) == self.world]
        full.sort(key=lambda x: (x[0][0], pieces.key_order(x[0][1])), reverse=True)
        out, seen, off = [], set(), []
        for (step, key), h in full:
            seg = pieces.parse_key(key).seg
            if seg not in line or (line[seg] is not None and step > line[seg]):
                off.append((step, key))
                continue
            if step not in seen:  # of one step, the newest save's pieces
                seen.add(step)
                out.append((step, key, h))
        newest = out[0][0] if out else -1
        self.off_line = [(s, k) for s, k in off if s > newest]
        return out

    def _options(self, rank: int, holders: dict, tried: dict) -> list:
        """The holders of ``rank``'s piece on other nodes not tried yet."""
        node = self.topology.node_of[rank]
        return [h for h in holders[rank]
                if self.topology.node_of[h] != node and h not in tried.get(rank, ())]

    def _moves(self, holders: dict, need: list, tried: dict) -> list:
        """(rank, holder) for each rank of ``need``: a holder on another node
        not tried before, the one at the rank's own place first and the
        sends spread over the holders (they run in parallel)."""
        load: dict = {}
        moves = []
        for rank in need:
            place = self.topology.place_of[rank]
            best = min(self._options(rank, holders, tried),
                       key=lambda h: (load.get(h, 0), self.topology.place_of[h] != place, h))
            load[best] = load.get(best, 0) + 1
            tried.setdefault(rank, set()).add(best)
            moves.append((rank, best))
        return moves

    def _fetch(self, step: int, key: str, moves: list) -> Optional[str]:
        """Bring pieces to the ranks that need them, all moves at once (each
        holder sends what it holds, each rank receives at most one piece):
        None when this rank received none or its piece arrived intact, else
        why not (a damaged replica: the caller tries another holder)."""
        w = self.w_main
        outs: list = []
        try:
            for dst, src in moves:
                if self.rank == src:
                    try:
                        outs.append((dst, pieces.Outgoing(self._piece(step, key, dst))))
                    except (OSError, CheckpointError):  # it does not read here: "none"
                        outs.append((dst, None))
            recv = None
            for dst, src in moves:
                if self.rank == dst:
                    what = f"rank {src}'s replica of rank {dst}'s piece of step {step}"
                    recv = (src, self._piece(step, key), what, None, None)
            status = self._transfer(w, 0, outs, recv)
        finally:
            for _, out in outs:
                if out is not None:
                    out.close()
        if recv is None or status == "ok":
            return None
        return f"{what}: rank {src} sent none" if status == "none" else \
            f"{type(status).__name__}: {status}"

    def _outcomes(self, value: tuple) -> list:
        return [tuple(v) for v in self._gather(list(value))]

    def _gather(self, mine: Any) -> list:
        """Every rank's ``mine`` (JSON), on every rank: the training
        thread's collectives on the tier's group (the background threads
        are idle meanwhile), through rank 0 as the rounds are."""
        if not self.dist:
            return [mine]
        try:
            return self._star(self.w_main, -2, mine, lambda got: got, _MAX_META)
        except _PeerError as e:
            raise CheckpointError(f"dcpx.CheckpointManager: the local tier's ranks could not "
                                  f"meet: {e.what} (rank {e.rank})") from None

    def _load_piece(self, state_dict: dict, s: int, key: str, reader_options: dict,
                    classify: Callable) -> tuple:
        """Load this rank's piece: ("ok", None, None) or (kind, why, the
        exception).  Where torch's load serves (a DTensor in the state
        dict), its CheckpointException (a BaseException) carries dcpx's
        error: that one is classified."""
        try:
            if reader_options:
                from ..filesystem import FileSystemReader
                reader = FileSystemReader(self._piece(s, key), **reader_options)
                _load(state_dict, storage_reader=reader, **self._solo())
            else:
                _load(state_dict, checkpoint_id=self._piece(s, key), **self._solo())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - classified
            inner = e
            failures = getattr(e, "failures", None)
            if not isinstance(e, CheckpointError) and isinstance(failures, dict) and failures:
                first = next(iter(failures.values()))
                inner = first[0] if isinstance(first, tuple) else first
                inner = inner if isinstance(inner, BaseException) else e
            return classify(inner), f"{type(inner).__name__}: {inner}", e
        return "ok", None, None

    def resume(self, state_dict: dict, step: Optional[int], reader_options: dict,
               classify: Callable, warn: Callable) -> Optional[int]:
        """Load the newest step of this job's line that the local tier can
        assemble completely (and that is not older than the newest
        persistent step) into ``state_dict``; return it, or None when the
        persistent tier must serve.  A rank whose node lost its piece, or
        whose piece fails its checks, takes a partner's replica.
        Collective on the tier's group."""
        self.wait_persisted()
        held, newest_persistent, seen, clock = self._inventory()
        found = self.candidates(held)
        for s, key in self.off_line:
            warn(f"local step-{s} (save {key}): complete, but of a run this one does not "
                 f"build on (another job's, or one abandoned by a resume); not loaded")
        result = None
        for s, key, holders in found:
            if step is not None and s != step:
                continue
            if step is None and newest_persistent is not None and newest_persistent > s:
                break
            loaded = self._try_step(state_dict, s, key, holders, reader_options, classify, warn)
            if loaded is not None:
                result = (s, key, loaded)
                break
        # A new segment: numbered above every segment seen, built on the step loaded.
        self.seg = max(clock, seen + 1, self.seg + 1)
        self.seq = 0
        if result is None:
            self.base = None
            return None
        s, key, tier = result
        self.base = (pieces.parse_key(key).seg, s)
        self.last_resume = {"step": s, "tier": tier, "key": key}
        self.settle(s)
        with self._lock:
            self._saved = [(s, key)]
        return s

    def _try_step(self, state_dict: dict, s: int, key: str, holders: dict,
                  reader_options: dict, classify: Callable, warn: Callable) -> Optional[str]:
        """Load step ``s`` on every rank: first the pieces a node lacks are
        fetched from a partner; a rank whose piece (or fetched replica) then
        fails its checks takes another node's replica, each holder once.
        Returns the tier it came from ("local" or "replica"), or None (the
        step is skipped with a warning).  Every decision is made from what
        every rank gathered, so all ranks take the same turns."""
        tried: dict = {}
        need = [r for r in range(self.world)
                if not any(self.topology.node_of[h] == self.topology.node_of[r]
                           for h in holders[r])]
        status: tuple = ("ok", None, None)
        fetched, first = False, True
        while True:
            moves = self._moves(holders, need, tried)
            fetched = fetched or bool(moves)
            mine = any(d == self.rank for d, _ in moves)
            try:
                why = self._fetch(s, key, moves) if moves else None
            except _PeerError as e:
                raise CheckpointError(f"dcpx.CheckpointManager.load: fetching the pieces of "
                                      f"local step {s} failed: {e.what}") from None
            if mine and why is not None:
                status = ("step", why, None)
            elif first or mine:
                status = self._load_piece(state_dict, s, key, reader_options, classify)
            first = False
            outcomes = self._outcomes(status[:2])
            if all(k == "ok" for k, _ in outcomes):
                return "replica" if fetched else "local"
            if status[0] == "user":
                raise status[2]
            if any(k == "user" for k, _ in outcomes):
                raise CheckpointError(
                    "dcpx.CheckpointManager: loading the local step %d failed on another rank: %s"
                    % (s, "; ".join(m for k, m in outcomes if m)))
            need = [r for r, (k, _) in enumerate(outcomes) if k != "ok"]
            if any(not self._options(r, holders, tried) for r in need):
                why = "; ".join(f"rank {r}: {m}" for r, (k, m) in enumerate(outcomes) if m)
                warn(f"local step-{s} (save {key}): {why}; trying an older step")
                return None

    def resumed_from_persistent(self, step: Optional[int]) -> None:
        if step is not None:
            self.last_resume = {"step": step, "tier": "persistent", "key": None}
        self.settle(step)
