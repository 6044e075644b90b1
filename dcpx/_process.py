"""AsyncCheckpointerType.PROCESS: uploads written by a checkpoint process.

One long-lived worker process (started with ``spawn`` on first use) writes
and commits checkpoints, so that not even the Python parts of an upload
(planning, pickling the metadata) compete with training for the GIL.

The staged bytes are not copied again: a ``DefaultStager`` with
``use_shared_memory`` stages into a memfd; its descriptor is passed to the
worker once per buffer (SCM_RIGHTS over the pipe) and the worker maps the
same pages and hands views of them to the C writer.  The layout (key,
offset, dtype, shape per tensor) and its mappings cross the pipe once per
layout; the worker keeps its views and their upload plan per buffer
(``_StagedViews``).  What crosses per save is the non-tensor values and the
writer's settings, and back the committed metadata as its .metadata bytes.
State dicts staged any other way are sent over the pipe by value.

Any other StorageWriter or a custom planner goes to the checkpoint process
pickled, as torch sends them (``run_torch``; with a process group only the
writer's ``write_data`` runs there, ``run_torch_dist``).
"""
from __future__ import annotations

import atexit
import errno
import mmap
import multiprocessing as mp
import os
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.storage import StorageWriter

from . import _guard


_lock = threading.Lock()
_worker: Optional["_Worker"] = None


def _writer_config(writer) -> dict:
    return dict(path=str(writer.path), single_file_per_rank=writer.single_file_per_rank,
                sync_files=writer.sync_files, thread_count=writer.thread_count,
                overwrite=writer.overwrite)


class _Worker:
    """Parent side: one process, one request at a time, in call order."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # This process's pid goes as an argument: the worker cannot take it
        # from os.getppid() once started, as this process may have died by
        # then (spawning imports torch: seconds), and the worker would then
        # take its new parent (init, a subreaper) for the one that handed it
        # its saves (_orphan_check).
        self.proc = ctx.Process(target=_worker_main, args=(child, os.getpid()), daemon=True,
                                name="dcpx-checkpoint-process")
        self.proc.start()
        child.close()
        # Buffers whose memfd the worker has: serial -> weakref to the buffer.
        self.sent_buffers: dict[int, weakref.ref] = {}
        # Per buffer serial, the layout the worker knows for it (at most
        # one: a buffer holds one layout) and the mappings it was sent:
        # serial -> (layout serial, mappings).  The description of a layout
        # crosses the pipe once, not with every save (_staged_message).
        self.sent_layouts: dict[int, tuple] = {}
        # The working directory the worker resolves relative paths against
        # (this process's, as last sent: _sync_cwd).
        self.sent_cwd: Optional[str] = None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="dcpx-process-upload")

    def _raise_if_unguarded(self, e: BaseException) -> bool:
        """Whether ``e`` says the pipe to the process broke (an EOFError,
        BrokenPipeError or ConnectionError, or any error once the process is
        gone); if so, the process is given 5 s to end and, if it stopped
        because the main script ran again in it (dcpx/_guard.py), that is
        raised.  Any other OSError (ENOSPC, a path the save cannot make:
        the process still alive) returns False at once, for the caller to
        raise as it is."""
        if not isinstance(e, (EOFError, BrokenPipeError, ConnectionError)) \
                and self.proc.is_alive():
            return False
        self.proc.join(5)
        err = _guard.guard_error(self.proc.exitcode)
        if err is not None:
            raise err from e
        return True

    def run(self, staged, stager, writer) -> Any:
        try:
            return self._run(staged, stager, writer)
        except (EOFError, OSError) as e:  # the pipe broke: the process died
            self._raise_if_unguarded(e)
            if not self.proc.is_alive() or isinstance(e, (EOFError, BrokenPipeError)):
                raise RuntimeError(
                    f"dcpx: the checkpoint process died while saving {writer.path} "
                    f"(exit code {self.proc.exitcode}); that checkpoint was not "
                    f"committed") from e
            raise

    def _run(self, staged, stager, writer) -> Any:
        from .errors import staging_error
        from .staging import DefaultStager
        if isinstance(staged, Future):
            try:
                staged = staged.result()
            except Exception as e:
                raise staging_error(e, writer)
        layout = stager.shared_layout_of(staged) if isinstance(stager, DefaultStager) else None
        config = _writer_config(writer)
        # What the directory holds now: should this process die, the
        # checkpoint process commits only over this (_orphan_check).
        config["committed"] = writer._committed_id()
        self._sync_cwd()
        if layout is None:
            self.conn.send(("values", config, staged))
        else:
            # Buffers are identified by a serial number, never by id(): a new
            # buffer may reuse a freed one's address.
            msg = self._staged_message(config, layout)
            try:
                self.conn.send(msg)
            except BaseException:
                # Not sent (a non-tensor value that does not pickle): the
                # worker did not get the layout this message described.
                self.sent_layouts.pop(layout.buffer.serial, None)
                raise
        status, result = self.conn.recv()
        if status == "err":
            if layout is not None:  # the worker may not have kept the layout: resend it
                self.sent_layouts.pop(layout.buffer.serial, None)
            raise result
        if status == "ok-encoded":  # .metadata bytes: dcpx's decoder, not pickle's
            from .coordination.gcpause import paused_gc
            from .formats.metadata import loads
            with paused_gc():  # ~5 objects per tensor, none in a cycle
                return loads(result, str(writer.path))
        return result

    def _staged_message(self, config: dict, layout) -> tuple:
        """The request for a save staged into a shared buffer: the buffer's
        serial, the layout's serial, the non-tensor values, and only when
        the worker does not have them yet, the layout's description and its
        mappings (the worker keeps the views of the buffer and their upload
        plan per layout: _StagedViews)."""
        # Buffers are identified by a serial number, never by id(): a new
        # buffer may reuse a freed one's address.
        serial = self._send_buffer(layout.buffer)
        known = self.sent_layouts.get(serial)
        tensors = mappings = None
        if known is None or known[0] != layout.serial:
            tensors = layout.description()
        if tensors is not None or known[1] is not layout.mappings:
            mappings = layout.mappings
        self.sent_layouts[serial] = (layout.serial, layout.mappings)
        return ("staged", config, serial, layout.serial, tensors, layout.other_values(),
                mappings, sorted(self.sent_buffers))


    def run_dist(self, staged, stager, writer, group, use_collectives) -> Any:
        """A multi-process save: this process coordinates with the other
        ranks (on the upload thread, over async_save's own group) and the
        checkpoint process writes this rank's data files."""
        from .coordination import dist as _dist
        from ._api import dist_path_state
        from .errors import staging_error
        from .staging import DefaultStager
        if isinstance(group, _dist.AsyncTicket):
            with group.turn() as pg:
                return self.run_dist(staged, stager, writer, pg, use_collectives)
        if isinstance(staged, Future):
            try:
                staged = staged.result()
            except Exception as e:
                # the other ranks raise too
                _dist.abort_save(group, staging_error(e, writer))
        layout = stager.shared_layout_of(staged) if isinstance(stager, DefaultStager) else None
        if layout is not None:
            flat, mappings = layout.flat, layout.mappings
        else:
            flat, mappings = dist_path_state(staged, writer, None, False)

        def prepare(t: torch.Tensor, key: str) -> Any:
            # What the checkpoint process needs to find the bytes: the key
            # (in the shared buffer), or the tensor itself (sent by value).
            return ("key", key) if layout is not None else ("tensor", t.contiguous())

        def write(writer, prefix: str, entries: list) -> tuple:
            tensors, others = [], []
            for e in entries:
                if isinstance(e.payload, tuple) and e.payload[0] == "key":
                    dst = layout.dst[e.payload[1]]
                    tensors.append((e.index, layout.offsets[e.payload[1]],
                                    str(dst.dtype).removeprefix("torch."), tuple(dst.shape)))
                elif isinstance(e.payload, tuple):
                    others.append((e.index, e.payload[1]))
                else:
                    others.append((e.index, e.payload))
            try:
                serial = self._send_buffer(layout.buffer) if layout is not None else None
                self._sync_cwd()
                self.conn.send(("write", _writer_config(writer), serial, prefix, tensors,
                                others, sorted(self.sent_buffers)))
                status, result = self.conn.recv()
            except (EOFError, OSError) as e:
                if not self._raise_if_unguarded(e):
                    raise
                raise RuntimeError(
                    f"dcpx: the checkpoint process died while writing {writer.path} "
                    f"(exit code {self.proc.exitcode}); that checkpoint was not "
                    f"committed") from e
            if status == "err":
                raise result
            return result

        return _dist.save(writer, flat, mappings, group, use_collectives,
                          prepare=prepare, write=write)

    # -- any StorageWriter, any planner (torch's save drives them) ----------

    def _call(self, msg: tuple, what: str, parts: dict) -> Any:
        """Send one request and wait for its answer.  ``parts`` names the
        objects the request pickles, for the error when one does not."""
        try:
            self._sync_cwd()
            self.conn.send(msg)  # pickled whole before anything is written
        except (EOFError, BrokenPipeError, ConnectionError) as e:
            self._raise_if_unguarded(e)
            raise RuntimeError(f"dcpx: the checkpoint process died before {what} "
                               f"(exit code {self.proc.exitcode})") from e
        except Exception as e:
            raise _unpicklable(parts, e) from e
        try:
            status, result = self.conn.recv()
        except (EOFError, OSError) as e:
            if not self._raise_if_unguarded(e):
                raise
            raise RuntimeError(
                f"dcpx: the checkpoint process died during {what} (exit code "
                f"{self.proc.exitcode}); that checkpoint was not committed") from e
        if status == "err":
            raise result
        return result

    def run_torch(self, staged, stager, writer, planner, use_collectives) -> Any:
        """One process, a foreign StorageWriter or a custom planner: as
        torch's checkpoint process does, the writer and the planner are sent
        to the checkpoint process (pickled), which runs the whole save.  A
        state dict staged into dcpx's shared memory is sent as its layout
        (the worker maps the same pages); any other one by value."""
        from .errors import staging_error
        from .staging import DefaultStager
        if isinstance(staged, Future):
            try:
                staged = staged.result()
            except Exception as e:
                raise staging_error(e, writer)
        layout = stager.shared_layout_of(staged) if isinstance(stager, DefaultStager) else None
        if layout is not None and all(type(t) in (torch.Tensor, torch.nn.Parameter)
                                      for t in layout.flat.values()
                                      if isinstance(t, torch.Tensor)):
            serial = self._send_buffer(layout.buffer)
            tensors = layout.description()
            values = layout.other_values()
            payload: Any = ("shared", serial, tensors, values, layout.mappings,
                            sorted(self.sent_buffers))
        else:
            payload = staged
        from .storage.writer import FileSystemWriter
        # dcpx's writer commits in the checkpoint process: the same orphan
        # check as the fast path's (_orphan_check).
        committed = writer._committed_id() if isinstance(writer, FileSystemWriter) else False
        return self._call(("torch", writer, planner, use_collectives, payload, committed),
                          f"saving to {_where(writer)}",
                          {"storage writer": writer, "planner": planner, "state dict": staged})

    def run_torch_dist(self, staged, writer, planner, group, use_collectives) -> Any:
        """With a process group, a foreign StorageWriter or a custom planner:
        torch's save runs here, on the upload thread, over async_save's own
        group (planning, collectives, the commit in ``finish``); only the
        writer's ``write_data`` runs in the checkpoint process, which gets
        the writer, this rank's plan and the planner (holding the staged
        state dict) pickled, as torch's checkpoint process gets them."""
        from .coordination import dist as _dist
        from ._api import save
        from .errors import staging_error
        if isinstance(group, _dist.AsyncTicket):
            with group.turn() as pg:
                return self.run_torch_dist(staged, writer, planner, pg, use_collectives)
        if isinstance(staged, Future):
            try:
                staged = staged.result()
            except Exception as e:  # the other ranks, in torch's save, raise too
                _dist.abort_torch_save(group, staging_error(e, writer), writer, use_collectives)
        return save(staged, storage_writer=_RemoteWriter(writer, self), planner=planner,
                    process_group=group, use_collectives=use_collectives)

    def _sync_cwd(self) -> None:
        """Tell the worker this process's working directory when it changed
        since the last request: a relative checkpoint path names a
        directory under the caller's working directory at the call, not
        under the one the worker was started in."""
        try:
            cwd: Optional[str] = os.getcwd()
        except OSError:  # removed: relative paths cannot be found here either
            cwd = None
        if cwd != self.sent_cwd:
            self.conn.send(("cwd", cwd))
            self.sent_cwd = cwd

    def _send_buffer(self, buf) -> int:
        """Pass the buffer's memfd to the worker once; its serial."""
        self.sent_buffers = {n: r for n, r in self.sent_buffers.items()
                             if r() is not None and r().fd >= 0}
        self.sent_layouts = {n: v for n, v in self.sent_layouts.items()
                             if n in self.sent_buffers}
        if buf.serial not in self.sent_buffers:
            self.conn.send(("buffer", buf.serial, buf.size))
            send_handle(self.conn, buf.fd, self.proc.pid)
            self.sent_buffers[buf.serial] = weakref.ref(buf)
        return buf.serial


def submit_process_upload(staged, stager, writer, planner, process_group, no_dist,
                          use_collectives) -> Future:
    from ._api import _dist_in_use, dist_path_eligible, fast_path_eligible
    from .storage.writer import FileSystemWriter
    distributed = _dist_in_use(no_dist)
    eligible = (dist_path_eligible(writer, planner, no_dist) if distributed
                else fast_path_eligible(writer, planner, no_dist))
    global _worker
    with _lock:
        if _worker is None or not _worker.proc.is_alive():
            _guard.check_main_guarded()  # spawn would run an unguarded script again
            _worker = _Worker()
        w = _worker
    if not (isinstance(writer, FileSystemWriter) and eligible):
        if distributed:
            return w.executor.submit(w.run_torch_dist, staged, writer, planner,
                                     process_group, use_collectives)
        return w.executor.submit(w.run_torch, staged, stager, writer, planner,
                                 use_collectives)
    if distributed:
        return w.executor.submit(w.run_dist, staged, stager, writer, process_group,
                                 use_collectives)
    return w.executor.submit(w.run, staged, stager, writer)


def _where(writer) -> str:
    return str(getattr(writer, "checkpoint_id", None) or getattr(writer, "path", None)
               or type(writer).__name__)


def _unpicklable(parts: dict, error: BaseException) -> Exception:
    """The error for a request that does not pickle, naming the object."""
    import pickle
    from multiprocessing.reduction import ForkingPickler
    for what, obj in parts.items():
        try:
            ForkingPickler.dumps(obj)
        except Exception as e:
            return TypeError(
                f"dcpx: async_save(async_checkpointer_type=PROCESS) sends the {what} to the "
                f"checkpoint process, and {type(obj).__module__}.{type(obj).__qualname__} "
                f"does not pickle: {type(e).__name__}: {e}; make it picklable or use "
                f"AsyncCheckpointerType.THREAD")
    if isinstance(error, pickle.PicklingError):
        return TypeError(f"dcpx: async_save(PROCESS): the request to the checkpoint process "
                         f"does not pickle: {error}")
    return error if isinstance(error, Exception) else RuntimeError(str(error))


class _RemoteWriter(StorageWriter):
    """The user's StorageWriter as torch's save sees it on the upload
    thread: every call goes to it here, except ``write_data``, which the
    checkpoint process runs on a copy of it (sent with the plan and the
    planner)."""

    def __init__(self, inner, worker: "_Worker") -> None:
        super().__init__()
        self.inner = inner
        self.worker = worker

    def reset(self, checkpoint_id=None) -> None:
        self.inner.reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        import inspect
        if "kwargs" in inspect.signature(self.inner.set_up_storage_writer).parameters:
            self.inner.set_up_storage_writer(is_coordinator, *args, **kwargs)
        else:
            self.inner.set_up_storage_writer(is_coordinator)

    def prepare_local_plan(self, plan):
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans):
        return self.inner.prepare_global_plan(plans)

    def write_data(self, plan, planner):
        results = self.worker._call(("write_data", self.inner, plan, planner),
                                    f"writing to {_where(self.inner)}",
                                    {"storage writer": self.inner, "planner": planner})
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results) -> None:
        self.inner.finish(metadata, results)

    def storage_meta(self):
        return self.inner.storage_meta()

    @property
    def checkpoint_id(self):
        return getattr(self.inner, "checkpoint_id", None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def _after_fork_in_child() -> None:
    """A process forked from one that has a checkpoint process: that process,
    its pipe and its upload thread are the parent's.  Forget them (the child
    starts its own on first use), so that neither a PROCESS save in the child
    nor the child's exit (dcpx's ``exit`` message, multiprocessing's
    terminate-and-join of daemonic children) reaches the parent's."""
    global _lock, _worker
    _lock = threading.Lock()  # may have been held by a thread that is gone
    w, _worker = _worker, None
    if w is not None:
        # multiprocessing's registry of children (private; stable since 3.4).
        getattr(mp.process, "_children", set()).discard(w.proc)
        w.conn.close()  # the child's copy: the worker still sees EOF when the parent dies


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _shutdown() -> None:
    w = _worker
    if w is not None:
        w.executor.shutdown(wait=True)  # finish queued saves
        try:
            w.conn.send(("exit",))
        except OSError:
            pass
        w.proc.join(timeout=10)


# ------------------------------------------------------------------ worker

def _orphan_check(parent: int, committed: Optional[tuple], writer) -> Optional[str]:
    """Why a save must not be committed: the process that handed it over
    has died and the directory was saved into since (by the restarted job,
    say), so committing would replace a newer checkpoint with an older one."""
    if os.getppid() == parent or writer._committed_id() == committed:
        return None
    return (f"dcpx: {writer.path}: not committed: the process that started this save "
            f"(pid {parent}) has exited and a newer checkpoint was committed there since; "
            f"it is kept")


def _abandon_if_orphaned(writer, parent: int) -> None:
    """A foreign StorageWriter takes no commit lock, so whether a newer
    checkpoint was committed since cannot be checked atomically: once the
    process that handed the save over has died, its ``finish`` (the
    commit) is not called at all."""
    finish = writer.finish

    def checked_finish(*args: Any, **kwargs: Any) -> Any:
        if os.getppid() != parent:
            raise RuntimeError(
                f"dcpx: {_where(writer)}: not committed: the process that started this save "
                f"(pid {parent}) has exited, and {type(writer).__name__} takes no commit lock "
                f"to tell whether a newer checkpoint was committed there since")
        return finish(*args, **kwargs)

    try:
        writer.finish = checked_finish
    except (AttributeError, TypeError):  # __slots__: committed unchecked, as before
        pass


def _writer_from(config: dict, parent: int):
    """The FileSystemWriter a request describes."""
    from .storage.writer import FileSystemWriter
    config = dict(config)
    committed = config.pop("committed", False)
    writer = FileSystemWriter(**config)
    if committed is not False:
        writer._commit_check = lambda w: _orphan_check(parent, committed, w)
    return writer


def _worker_main(conn, parent: int) -> None:
    from ._api import save
    _guard.worker_running = True  # dcpx calls from here on are the worker's own
    buffers: dict[int, torch.Tensor] = {}
    layouts: dict[int, _StagedViews] = {}  # per buffer serial: its staged layout
    cwd: Optional[str] = None  # the parent's working directory (_Worker._sync_cwd)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent died (an orphan with nothing to do)
            return
        kind = msg[0]
        if kind == "exit":
            return
        if kind == "buffer":
            _, number, size = msg
            fd = recv_handle(conn)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            os.close(fd)
            buffers[number] = torch.frombuffer(mm, dtype=torch.uint8)
            continue
        if kind == "cwd":
            cwd = msg[1]
            continue
        try:
            if cwd is not None:
                os.chdir(cwd)  # relative paths are the parent's
            if kind == "values":
                _, config, staged = msg
                result = save(staged, storage_writer=_writer_from(config, parent))
            elif kind in ("torch", "write_data"):  # any writer / planner
                result = _torch_request(msg, buffers, parent)
            elif kind == "write":  # one rank's entries of a multi-process save
                _, config, number, prefix, tensors, others, live = msg
                for gone in set(buffers) - set(live):
                    del buffers[gone]
                result = _write_entries(_writer_from(config, parent),
                                        buffers.get(number), prefix, tensors, others)
            else:
                _, config, number, layout, tensors, values, mappings, live = msg
                for gone in set(buffers) - set(live):  # freed by the parent
                    del buffers[gone]
                    layouts.pop(gone, None)
                views = layouts.get(number)
                if tensors is not None:
                    views = layouts[number] = _StagedViews(layout, buffers[number], tensors)
                elif views is None or views.serial != layout:
                    raise RuntimeError(f"dcpx checkpoint process: layout {layout} of "
                                       f"buffer {number} was never sent")
                if mappings is not None:
                    views.mappings = mappings
                result = views.save(_writer_from(config, parent), values)
                encoded = _encoded(result)
                if encoded is not None:
                    conn.send(("ok-encoded", encoded))
                    continue
            conn.send(("ok", result))
        except BaseException as e:  # reported on the upload future
            try:
                conn.send(("err", e))
            except OSError:  # the parent is gone (an orphan): say it on stderr
                if not isinstance(e, OSError) or e.errno != errno.EPIPE:
                    print(f"dcpx checkpoint process: {e}", file=sys.stderr, flush=True)
                return
            except Exception:  # an exception that does not pickle
                conn.send(("err", RuntimeError(f"dcpx checkpoint process: {e!r}")))


def _view_of(base: torch.Tensor, offset: int, dtype: str, shape: tuple) -> torch.Tensor:
    """The staged tensor at ``offset`` of a shared buffer the parent sent."""
    dt = getattr(torch, dtype)
    n = torch.Size(shape).numel() * dt.itemsize
    return base[offset:offset + n].view(dt).view(shape)


class _StagedViews:
    """The checkpoint process's side of one staged layout: views of the
    shared buffer at the offsets the parent described, made once, and the
    upload plan of their payloads (staging.UploadScan), kept across the
    saves of that layout."""

    def __init__(self, serial: int, base: torch.Tensor, tensors: list) -> None:
        from .staging import UploadScan
        self.serial = serial
        self.base = base
        self.views: dict = {}
        self.offsets: dict = {}
        for key, offset, dtype, shape, requires_grad in tensors:
            self.offsets[key] = offset
            t = _view_of(base, offset, dtype, shape)
            if requires_grad:
                t.requires_grad_(True)
            self.views[key] = t
        self.mappings: dict = {}
        self.scan = UploadScan()

    def save(self, writer, values: dict):
        from ._api import save_local
        from .coordination.gcpause import paused_gc
        from .storage.pending import staged_payload
        flat = dict(values)  # the values first, then the tensors, as before
        flat.update(self.views)
        with paused_gc():
            scanned = self.scan(flat, self.views, self.offsets, self.base)
        return save_local(writer, flat, self.mappings, prepare=staged_payload,
                          scanned=scanned)


def _encoded(metadata) -> Optional[bytes]:
    """The committed metadata as its .metadata bytes, for the reply to the
    parent (dcpx's C encoder here and its decoder there take a fifth and a
    third of pickle's time for 20,000 tensors), when what the decoder allows
    is all it holds: DCP metadata types, and planner data paths of str and
    int keys.  None: the reply pickles the Metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    from .formats.metadata import dumps
    if type(metadata) is not Metadata or not all(
            type(p) in (str, int) for path in (metadata.planner_data or {}).values()
            for p in path):
        return None
    return dumps(metadata)


def _write_entries(writer, base: Optional[torch.Tensor], prefix: str, tensors, others):
    """Write a rank's entries: tensors as views of the shared buffer, the
    rest (bytes, tensors sent by value) as they came."""
    from .coordination.dist import write_files
    from .storage.pending import _Entry, staged_payload
    entries = []
    for index, offset, dtype, shape in tensors:
        t = _view_of(base, offset, dtype, shape)
        entries.append(_Entry(index, staged_payload(t, ""), t.numel() * t.element_size()))
    for index, payload in others:
        if isinstance(payload, torch.Tensor):
            entries.append(_Entry(index, staged_payload(payload, ""),
                                  payload.numel() * payload.element_size()))
        else:
            entries.append(_Entry(index, payload, len(payload)))
    return write_files(writer, prefix, entries)


def _torch_request(msg: tuple, buffers: dict, parent: int) -> Any:
    """A save with a foreign StorageWriter or a custom planner, driven by
    torch's save (``torch``), or one rank's ``write_data`` (``write_data``)."""
    if msg[0] == "write_data":
        _, writer, plan, planner = msg
        return writer.write_data(plan, planner).wait()
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    from ._api import save
    _, writer, planner, use_collectives, staged, committed = msg
    from .storage.writer import FileSystemWriter
    if isinstance(writer, FileSystemWriter) and committed is not False:
        writer._commit_check = lambda w: _orphan_check(parent, committed, w)
    elif not isinstance(writer, FileSystemWriter):
        _abandon_if_orphaned(writer, parent)
    if isinstance(staged, tuple) and staged and staged[0] == "shared":
        _, number, tensors, values, mappings, live = staged
        for gone in set(buffers) - set(live):  # freed by the parent
            del buffers[gone]
        flat = dict(values)
        for key, offset, dtype, shape, requires_grad in tensors:
            t = _view_of(buffers[number], offset, dtype, shape)
            if requires_grad:
                t.requires_grad_(True)
            flat[key] = t
        staged = unflatten_state_dict(flat, mappings)
    return save(staged, storage_writer=writer, planner=planner, no_dist=True,
                use_collectives=use_collectives)
