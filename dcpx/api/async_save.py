"""dcpx.async_save: torch's asynchronous checkpoint API over dcpx's stager
and C writer.

Timeline of one call (docs/design.md has the picture)::

    caller thread     stage() ──► returns Future / AsyncSaveResponse
    dcpx-stage        (use_async_staging) C copy into the stager's buffer ──► staging_completion
    dcpx-upload       plan + metadata ── C writer threads (no GIL) ── commit ──► upload_completion

* Uploads run one at a time, in call order, on one ``dcpx-upload`` thread
  (THREAD) or in one long-lived checkpoint process (PROCESS).  Saves into
  one directory (sync or async, any kind) run in call order: an upload gets
  its state dict only after earlier saves into its directory finished
  (dcpx/storage/locks.py).
* In-flight policy: a stager's buffer belongs to the upload of what was
  staged into it.  A second ``async_save`` with the same stager first waits
  (inside ``stage()``) for that upload, then reuses the buffer.  Saves with
  different stagers queue their uploads.  Calls without a stager use stagers
  that dcpx keeps across calls (``staging._StagerPool``): a second buffer
  while the previous upload still runs, at most two per kind.
* At interpreter exit the upload thread finishes the queued saves (it is a
  non-daemon executor thread).  A process killed before a save's commit
  leaves no ``.metadata`` for it (or the previous one, untouched): never a
  half-written checkpoint that loads.
"""
from __future__ import annotations

import copy
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from ..coordination import dist as _dist
from . import guard as _guard
from ..storage import locks as _locks
from .save_load import (
    _dist_in_use,
    _stateful_to_state_dict,
    _writer_for,
    as_state_dict,
    dist_path_eligible,
    dist_path_state,
    fast_path_eligible,
    fast_path_state,
    save,
    save_local,
)
from ..coordination.flatten import flatten_state_dict
from ..coordination.gcpause import paused_gc
from ..storage.pending import staged_payload
from .._torchcompat import HAS_CHECKPOINTABLE_TENSOR, is_checkpointable_tensor
from ..storage.writer import FileSystemWriter
from ..errors import CheckpointError, checkpoint_future, staging_error
from ..staging import DefaultStager
from ..staging import _pool as _staging_pool


# the classes users may isinstance-check against: torch's where it has them
from .._torchcompat import AsyncCheckpointerType, AsyncSaveResponse

__all__ = ["async_save", "AsyncCheckpointerType", "AsyncSaveResponse"]

_upload_lock = threading.Lock()
_upload_executor: Optional[ThreadPoolExecutor] = None


def _uploader() -> ThreadPoolExecutor:
    global _upload_executor
    with _upload_lock:
        if _upload_executor is None:
            _upload_executor = ThreadPoolExecutor(1, thread_name_prefix="dcpx-upload")
        return _upload_executor


def _after_fork_in_child() -> None:
    """A forked child has no dcpx-upload thread (the parent's saves stay the
    parent's): its first async_save starts its own (docs/design.md, Fork)."""
    global _upload_lock, _upload_executor
    _upload_lock = threading.Lock()
    _upload_executor = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _lower_priority() -> None:
    """DCPX_WRITER_NICE=N (1..19): this thread (the upload thread) at nice
    N if it runs at less, as the C writer threads put themselves
    (csrc/writer.c): a training loop's threads then win the cores the upload
    competes for.  Linux keeps a nice value per thread; raising it needs no
    privilege, lowering it again does (so it stays: later uploads run at
    the highest value asked).  Never raises."""
    try:
        n = min(int(os.environ.get("DCPX_WRITER_NICE", "0")), 19)
    except ValueError:
        return
    if n > 0 and sys.platform.startswith("linux"):
        try:
            tid = threading.get_native_id()
            if n > os.getpriority(os.PRIO_PROCESS, tid):
                os.setpriority(os.PRIO_PROCESS, tid, n)
        except OSError:
            pass


def _upload(staged: Any, stager: Any, writer, planner, process_group, no_dist,
            use_collectives):
    """Write and commit one staged state dict (runs on the upload thread).
    With a process group, ``process_group`` is the save's ticket for
    async_save's own group (``_dist.async_group``)."""
    _lower_priority()
    if isinstance(process_group, _dist.AsyncTicket):
        with process_group.turn() as pg:
            return _upload(staged, stager, writer, planner, pg, no_dist, use_collectives)
    if (isinstance(staged, Future) and isinstance(stager, DefaultStager)
            and not _dist_in_use(no_dist) and fast_path_eligible(writer, planner, no_dist)):
        early = stager.early_for(staged)
        queued = early.result() if early is not None else None
        if queued is not None:
            done = _upload_during_staging(staged, queued, stager, writer)
            if done is not None:
                return done
    if isinstance(staged, Future):
        try:
            staged = staged.result()
        except Exception as e:
            err = staging_error(e, writer)
            if _dist_in_use(no_dist):
                _tell_peers(process_group, err, writer, planner, no_dist, use_collectives)
            raise err
    if _dist_in_use(no_dist):
        sharded = None
        if isinstance(stager, DefaultStager) and dist_path_eligible(writer, planner, no_dist):
            sharded = stager.flat_of(staged)
        if sharded is None or not all(_dist.fast_value(v) for v in sharded[0].values()):
            sharded = dist_path_state(staged, writer, planner, no_dist)
        if sharded is not None:
            return _dist.save(writer, *sharded, group=process_group,
                              use_collectives=use_collectives, prepare=staged_payload)
    fast = scanned = None
    if isinstance(stager, DefaultStager) and fast_path_eligible(writer, planner, no_dist):
        fast = stager.flat_of(staged)  # the stager's flat view: no re-flattening
        if fast is not None:  # and its payloads without a step per tensor
            with paused_gc():
                scanned = stager.upload_scan_of(staged)
    if fast is None:
        fast = fast_path_state(staged, writer, planner, no_dist)
    if fast is None:
        return save(staged, storage_writer=writer, planner=planner,
                    process_group=process_group, no_dist=no_dist,
                    use_collectives=use_collectives)
    return save_local(writer, *fast, prepare=staged_payload, scanned=scanned)


def _refuse_shards_across_processes(state_dict: dict) -> None:
    """torch >= 2.14: a CheckpointableTensor's shard attributes do not cross
    into the checkpoint process (dcpx sends its tensors as shared memory, not
    as Python objects), which would save each as a whole tensor: refused,
    naming the key, rather than saved wrong."""
    for key, v in flatten_state_dict(state_dict)[0].items():
        if is_checkpointable_tensor(v):
            raise TypeError(
                f"dcpx: async_save(async_checkpointer_type=PROCESS) cannot save {key!r}: it "
                f"is a CheckpointableTensor (a shard of a {tuple(v.global_shape)} tensor), "
                f"whose shard attributes the checkpoint process does not receive; use "
                f"AsyncCheckpointerType.THREAD or dcpx.save")


def _tell_peers(pg, err: BaseException, writer, planner, no_dist: bool,
                use_collectives: bool) -> None:
    """This rank cannot take part in an async save on ``pg`` (its staging
    failed): meet the other ranks' uploads of it where they wait for this
    rank, so that they do not wait until the group's timeout; raises
    ``err``.  A collective save fails on every rank at its first collective
    (dcpx's plan gather, or torch's, for a planner or writer of the user's);
    per-rank saves (use_collectives=False) only meet at their closing
    barrier, which this rank joins: the other ranks' own checkpoints stand,
    as they would had this rank saved."""
    if not use_collectives:
        try:
            dist.barrier(group=pg)
        except Exception:  # a peer is gone: this rank's own error is the one to report
            pass
        raise err
    if dist_path_eligible(writer, planner, no_dist):
        _dist.abort_save(pg, err)
    _dist.abort_torch_save(pg, err, writer, use_collectives)


def _abort_in_turn(ticket: "_dist.AsyncTicket", error: BaseException, writer, planner,
                   no_dist: bool, use_collectives: bool) -> None:
    """async_save raised on this rank before its upload was submitted (a
    Stateful's state_dict, a synchronous staging): the other ranks' uploads
    of this save are already waiting in its first collective.  This rank
    takes the save's turn on the upload thread and fails that collective as
    a failed staging does (``_upload``), so that they raise at once instead
    of waiting for it until the group's timeout (and every later async_save
    with them).  With use_collectives=False the others only meet at the
    save's closing barrier: this rank meets them there (their own
    checkpoints stand)."""
    # A new exception: the caller is raising ``error`` itself right now.
    err = CheckpointError(f"dcpx.async_save failed on this rank before its upload: "
                          f"{type(error).__name__}: {error}")

    def abort() -> None:
        with ticket.turn() as pg:
            _tell_peers(pg, err, writer, planner, no_dist, use_collectives)

    if not isinstance(error, Exception):  # KeyboardInterrupt and the like: no more work
        ticket.abandon()
        return
    try:
        _uploader().submit(abort)
    except BaseException:  # the interpreter is shutting down
        ticket.abandon()


def _upload_during_staging(staging: Future, queued: tuple, stager: DefaultStager, writer):
    """The fast-path upload of a state dict whose CUDA copies are still
    running: each writer thread reads a CUDA-staged tensor only once the
    staging gate says its segment is on the host (csrc/gate.c), so writing
    overlaps the copies.  Commits only after the whole staging succeeded;
    a failed copy fails the gate, the writes and the save, with the
    staging's error.  None if the stager no longer holds that state dict."""
    staged, gate, keys = queued
    fast = stager.flat_of(staged)
    if fast is None:
        return None

    def prepare(t: torch.Tensor, key: str) -> tuple:
        payload = staged_payload(t, key)
        return (*payload, gate) if key in keys else payload

    try:
        return save_local(writer, *fast, prepare=prepare, before_commit=staging.result)
    except BaseException as e:
        err = staging.exception()  # waits: a failed gate means a failed staging
        if err is None:
            raise
        raise staging_error(err, writer) from (None if err is e else e)


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: Union[str, os.PathLike, None] = None,
    storage_writer=None,
    planner=None,
    process_group=None,
    async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
    async_stager=None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Union[Future, AsyncSaveResponse]:
    """Asynchronous save; same signature and semantics as
    ``torch.distributed.checkpoint.async_save``.

    Returns a Future of the Metadata when staging finished inside the call,
    or ``AsyncSaveResponse(staging_completion, upload_completion)`` when the
    stager stages asynchronously.  After staging completes the caller may
    change its tensors: the checkpoint holds the values of the call.
    """
    _guard.check_not_bootstrapping("async_save")  # the main script run again by spawn
    state_dict = as_state_dict(state_dict, "dcpx.async_save")
    if _dist_in_use(no_dist):
        pg = process_group or dist.distributed_c10d._get_default_group()
        if torch.device("cpu") not in pg._device_types:
            raise AssertionError(
                "A CPU backend must be enabled for async save; try initializing "
                "process group with 'cpu:gloo,cuda:nccl'")
    process = AsyncCheckpointerType(async_checkpointer_type) == AsyncCheckpointerType.PROCESS
    writer = _writer_for(storage_writer, checkpoint_id)
    if type(writer) is FileSystemWriter and writer is storage_writer:
        # The caller's writer, as it is now (path, save id): the upload runs
        # later, and the caller may reset its writer to the next
        # checkpoint_id meanwhile (a loop of async_save(sd, storage_writer=w,
        # checkpoint_id=...)), which would move this save into that path.
        writer = copy.copy(writer)
    if process and hasattr(writer, "check_crosses_processes"):
        writer.check_crosses_processes()  # memory:// lives in this process only
    if _dist_in_use(no_dist):
        # The upload's collectives run on a group of their own, made on the
        # upload thread: as in torch, a coordination failure is reported on
        # the upload future, never raised here.
        process_group = _dist.async_group(process_group)
    if async_stager is None:
        if hasattr(writer, "stage") and not isinstance(writer, FileSystemWriter):
            async_stager = writer  # torch's writers are their own stager
        else:  # kept across calls (staging._StagerPool); shared memory for PROCESS
            async_stager = _staging_pool.acquire(process)
    submitted = False
    try:
        flat_sd = _stateful_to_state_dict(state_dict)
        if process and HAS_CHECKPOINTABLE_TENSOR:
            _refuse_shards_across_processes(flat_sd)
        try:
            staged = async_stager.stage(flat_sd)
        except Exception as e:
            raise staging_error(e, writer)

        # Saves into one directory run one at a time, in call order: the upload
        # gets ``staged`` only once earlier saves into it have finished.  A
        # state dict staged in this call is handed over only once this call
        # returns (``start``): until then the upload waits without the GIL
        # instead of taking it from this thread, which would then wait for
        # it, 5 ms a switch, while the upload plans.  (A staging Future goes
        # as it is: the upload may start on it early, early_for.)
        start: Optional[Future] = None if isinstance(staged, Future) else Future()
        key = _locks.dir_key(writer)
        with _locks.submitting():
            turn = _locks.enter(key)
            try:
                args = (_locks.gate(staged if start is None else start, turn), async_stager, writer, planner, process_group,
                        no_dist, use_collectives)
                if process:
                    from .process import submit_process_upload
                    upload = submit_process_upload(*args)
                else:
                    upload = _uploader().submit(_locks.run_holding, key, _upload, *args)
                submitted = True
            except BaseException:
                _locks.finish(turn)
                raise
        try:
            upload.add_done_callback(lambda _: _locks.finish(turn))
            upload = checkpoint_future(upload)  # failures are torch CheckpointExceptions
            if isinstance(async_stager, DefaultStager):
                async_stager.lease_to(upload)
        finally:
            if start is not None:
                start.set_result(staged)  # the upload may start
    except BaseException as e:
        if isinstance(process_group, _dist.AsyncTicket):
            if submitted:
                process_group.abandon()  # (a no-op once the upload took its turn)
            else:  # no upload: the other ranks' uploads of this save must fail too
                _abort_in_turn(process_group, e, writer, planner, no_dist, use_collectives)
        raise

    if isinstance(staged, Future):
        staging_done: Future = Future()

        def _relay(f: Future) -> None:
            err = f.exception()
            if err is None:
                staging_done.set_result(None)
            else:
                staging_done.set_exception(staging_error(err, writer))

        staged.add_done_callback(_relay)
        return AsyncSaveResponse(staging_completion=staging_done, upload_completion=upload)
    if getattr(async_stager, "should_synchronize_after_execute", False):
        async_stager.synchronize_staging()
    return upload
