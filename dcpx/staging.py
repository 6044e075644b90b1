"""Staging: copying a state dict into host memory that the checkpoint upload
can read while training goes on mutating the originals.

``DefaultStager`` mirrors ``torch.distributed.checkpoint.staging.DefaultStager``
and its ``StagingOptions``.  What is dcpx's own:

* **Reused buffers.**  The first ``stage()`` of a state dict allocates one
  page-aligned, pre-faulted host buffer for all its tensors (``mmap``; shared
  memory when ``use_shared_memory``, so a checkpoint *process* can write it
  without another copy; page-locked with ``cuMemHostRegister`` when CUDA is
  present and ``use_pinned_memory``).  Later stages of a state dict with the same
  structure (keys, dtypes, shapes) copy into the same buffer: no allocation,
  no page faults, flat memory over any number of saves.
* **The copy runs in C** (``dcpx._C.copy_into``) on several threads with the
  GIL released.  CUDA tensors are copied device-to-host by the C CUDA path
  (``dcpx._C.cuda_copy_into``, csrc/cuda_stage.c: the driver API on dcpx's
  own stream per device, ordered after the producer's current stream,
  completion waited for on events without the GIL; docs/design.md, "CUDA
  path").  With asynchronous staging the copies complete segment by
  segment, and the upload's writer threads start on each segment as soon
  as it is on the host (``early_for``; "Copy/write overlap in
  async_save").
* **One upload per buffer.**  A stager's buffer is leased to the upload of
  the checkpoint staged into it; the next ``stage()`` first waits for that
  upload to finish (docs/design.md, "In-flight policy").

Options that need CUDA (pinned memory, non-blocking copies) are accepted
and ignored on a machine without it.
"""
from __future__ import annotations

import atexit
import copy
import itertools
import mmap
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import _C
from .formats.dtypes import _TO_DLPACK, dlpack_export, dlpack_view
from .coordination.flatten import flatten_state_dict
from .coordination.gcpause import paused_gc
from .storage.pending import check_saveable, staged_payload, value_payload
from ._torchcompat import (
    any_checkpointable_tensor,
    copy_checkpointable_attrs,
    is_checkpointable_tensor,
)


from ._torchcompat import DTensor

__all__ = ["StagingOptions", "DefaultStager", "release_staging_buffers"]

_PAGE = mmap.PAGESIZE
_ALIGN = 64
#: asynchronous staging of CUDA tensors: the staging buffer's copies are
#: waited for in segments of at least this many bytes, and the upload's
#: writer threads start on each segment as it completes
_SEGMENT = 64 << 20


@dataclass
class StagingOptions:
    """Same fields and defaults as torch's ``StagingOptions``."""

    use_pinned_memory: bool = True
    use_shared_memory: bool = True
    use_async_staging: bool = True
    use_non_blocking_copy: bool = True


_THREADS = max(1, min(8, os.cpu_count() or 1))


def _copy_threads() -> int:
    return _THREADS  # os.cpu_count() costs milliseconds on a loaded machine


class _Buffer:
    """One host allocation: page-aligned, pre-faulted, optionally shared
    and pinned."""

    _serials = itertools.count(1)

    def __init__(self, nbytes: int, shared: bool, pin: bool) -> None:
        self.nbytes = nbytes
        self.serial = next(self._serials)  # identity for the checkpoint process
        self.size = size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        self.fd = -1
        if shared and hasattr(os, "memfd_create"):
            # A memfd, so that a checkpoint process can map the same pages
            # (its fd travels over the worker's pipe).
            self.fd = os.memfd_create("dcpx-staging", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        else:
            flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
            self.mm = mmap.mmap(-1, size, flags=flags)
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)
        # Pre-fault (no page faults while staging) in C without the GIL:
        # MAP_POPULATE would do it inside mmap() with the GIL held.
        _C.prefault(self.base, threads=_copy_threads())
        self.pinned = False
        if pin:
            # Page-locked once by the C CUDA path; a refusal (out of
            # memory, RLIMIT_MEMLOCK) warns and leaves the buffer pageable.
            try:
                self.pinned = _C.cuda_host_register(self.base)
            except _C.CudaError as e:
                warnings.warn(f"{e}; staging into pageable memory", RuntimeWarning,
                              stacklevel=2)

    def view(self, offset: int, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        v = self.base[offset:offset + nbytes].view(t.dtype).view(t.shape)
        if t.requires_grad:  # so the metadata records it as torch does
            v.requires_grad_(True)
        return v

    def release(self) -> None:
        if self.pinned:
            _C.cuda_host_unregister(self.base)
            self.pinned = False
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        # Never mm.close(): staged tensors the caller still holds point into
        # the mapping (torch.frombuffer keeps the mmap object alive, but an
        # explicit close would unmap it under them).  Dropping our references
        # unmaps it once the last staged tensor is gone.
        self.base = None
        self.mm = None


_layout_serials = itertools.count(1)


class UploadScan:
    """``_plan.scan(flat, staged_payload)`` for the uploads of one staged
    layout, without a Python step per staged tensor.  ``views`` (key ->
    staged tensor) are the same tensors every call (the layout's views of
    its buffer); the signature and, per staged tensor, its payload are kept
    from the first call.  With ``offsets`` (key -> byte offset of its view
    in ``base``, the staging buffer) a kept payload is a C-writer base item
    ``(offset, nbytes, storage_type, shape)`` and the result carries
    ``base`` as a third element: later calls make no object per staged
    tensor at all, and the writer takes the buffer once (csrc/writer.c).
    Without them, a kept payload is a detached alias of the view and its
    storage type, and later calls make one DLPack export each (in one
    ``map``).  Either way what is kept is this object's own, so what a
    caller does to the staged tensors it was handed (requires_grad_, say)
    does not change what the kept signature describes.  Non-tensor values
    are encoded every call.  Recomputed when ``flat``'s keys change."""

    def __init__(self) -> None:
        self._cache: Optional[tuple] = None

    def __call__(self, flat: dict, views: dict, offsets: Optional[dict] = None,
                 base: Optional[torch.Tensor] = None) -> tuple:
        keys = list(flat)
        cache = self._cache
        if cache is None or cache[0] != keys or cache[5] is not base:
            from .coordination import plan as _plan
            sig, payloads = _plan.scan(flat, staged_payload)
            stypes = [p[1] for k, p in zip(keys, payloads) if k in views]
            staged = [k for k in keys if k in views]
            if offsets is not None and base is not None:
                kept = [(offsets[k], views[k].numel() * views[k].element_size(), st,
                         tuple(views[k].shape)) for k, st in zip(staged, stypes)]
            else:
                kept = [dlpack_view(views[k].detach()) for k in staged]
            values = [(i, k) for i, k in enumerate(keys) if k not in views]
            self._cache = (keys, sig, kept, stypes, values, base)
            return sig, payloads
        _, sig, kept, stypes, values, base = cache
        if base is not None:
            tensors = kept
        else:
            caps = map(_TO_DLPACK, kept) if _TO_DLPACK is not None else kept
            tensors = list(zip(caps, stypes))
        if values:
            payloads: list = []
            taken = 0  # tensors placed so far
            for i, k in values:  # the tensors before position i, then the value
                before = i - len(payloads)
                payloads += tensors[taken:taken + before]
                taken += before
                payloads.append(value_payload(flat[k], k))
            payloads += tensors[taken:]
        else:
            payloads = tensors
        return (sig, payloads) if base is None else (sig, payloads, base)


class _Layout:
    """The staged image of one state-dict structure: the buffer, the staged
    tensors in flat order, and the staged (nested) state dict."""

    def __init__(self, state_dict: dict, flat: dict, mappings: dict, shared: bool,
                 pin: bool) -> None:
        self.signature = _signature(flat)
        self.offsets = offsets = {}
        total = 0
        for k, v in flat.items():
            if isinstance(v, torch.Tensor):
                local = _local(v)
                total = -(-total // _ALIGN) * _ALIGN
                offsets[k] = total
                total += local.numel() * local.element_size()
        self.buffer = _Buffer(total, shared, pin)
        # dst: where each tensor's (local) bytes are copied; staged: what the
        # staged state dict holds (a DTensor over its staged local shard).
        self.dst = {k: self.buffer.view(o, _local(flat[k])) for k, o in offsets.items()}
        self.staged = {k: _wrap_like(flat[k], d) for k, d in self.dst.items()}
        # torch >= 2.14: shards of larger tensors take torch's planner (flat_of)
        self.shards = any_checkpointable_tensor(self.staged.values())
        self.flat = dict(self.staged)  # + each stage's copies of non-tensor values
        self.mappings = mappings
        self.keys = list(flat)
        self.root_type = type(state_dict)
        self.flat_root = _is_flat(state_dict, mappings)
        # The staged state dict mirrors the caller's containers (keys keep
        # their types: optimizer states are keyed by int).  `tree` is its
        # template: every stage returns a fresh copy of its containers
        # (_fresh), with that stage's non-tensor values in their slots.
        self.tree = _mirror(state_dict, (), self)
        self.plan(flat)
        self._description: Optional[list] = None
        self._upload: Optional[UploadScan] = None
        self.serial = next(_layout_serials)  # identity for the checkpoint process
        self.same_as: "weakref.WeakSet[_Layout]" = weakref.WeakSet()

    def plan(self, flat: dict) -> None:
        """How the next stages of this layout copy (``DefaultStager._reuse``):
        ``plain``, the entries ``_C.stage_plain`` checks and copies (plain
        contiguous CPU tensors, as they are now); ``others``, the other
        tensors (DTensors, strided views, device tensors) with their part of
        the signature; ``values``, the positions of non-tensor values."""
        plain, others, values = [], [], []
        offsets = self.offsets
        for i, (k, v) in enumerate(flat.items()):
            if k not in offsets:
                values.append((i, k))
            elif (type(v) in _PLAIN and v.is_cpu and v.is_contiguous()
                  and not v.is_neg() and not v.is_conj() and not is_checkpointable_tensor(v)):
                plain.append((i, type(v), v.dtype, v.shape, v.requires_grad, offsets[k],
                              v.numel() * v.element_size(), v.is_complex()))
            else:
                others.append((i, k, _entry_signature(k, v)))
        self.plain, self.others, self.values = tuple(plain), others, values

    def description(self) -> list:
        """``[(key, offset, dtype name, shape, requires_grad)]`` of the staged
        tensors, what the checkpoint process needs to find them in the shared
        buffer (dcpx/_process.py); built once per layout."""
        if self._description is None:
            self._description = [(k, self.offsets[k], str(v.dtype).removeprefix("torch."),
                                  tuple(v.shape), v.requires_grad) for k, v in self.dst.items()]
        return self._description

    def upload_scan(self) -> Optional[tuple]:
        """``(signature, payloads[, buffer])`` of ``self.flat`` for the
        upload (``UploadScan``: base items in this layout's buffer); None (the caller scans) when a staged value is
        not a plain tensor (a DTensor's stand-in)."""
        if self._upload is None:
            if any(self.staged[k] is not d for k, d in self.dst.items()):
                return None
            self._upload = UploadScan()
        return self._upload(self.flat, self.dst, self.offsets, self.buffer.base)

    def other_values(self) -> dict:
        """This stage's non-tensor values, by key."""
        return {k: self.flat[k] for _, k in self.values}

    def same_layout(self, other: "_Layout") -> bool:
        """Same signature (remembered: the pool compares on every call)."""
        if other is self or other in self.same_as:
            return True
        if self.signature != other.signature:
            return False
        self.same_as.add(other)
        return True


def _is_terminal(value: Any) -> bool:
    """torch's rule (distributed/checkpoint/_traverse.py): a Mapping is never
    a leaf; a list is one unless it holds a tensor or a non-leaf container;
    anything else (tuples included) is a leaf."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _is_terminal(entry):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True


def _mirror(value: Any, path: tuple, layout: "_Layout") -> tuple:
    """The template of a Mapping or non-leaf list: ``(container, nested,
    slots)``, the container holding the staged tensors at its tensor leaves,
    ``nested`` the ``(key, template)`` of its inner containers and ``slots``
    the ``(key, fqn)`` of its other leaves."""
    nested: list = []
    slots: list = []
    if isinstance(value, Mapping):
        out: Any = OrderedDict() if isinstance(value, OrderedDict) else {}
        items = [(k, v, path + (str(k),)) for k, v in value.items()]
    else:
        out = [None] * len(value)
        items = [(i, v, path + (i,)) for i, v in enumerate(value)]
    for key, v, p in items:
        if not _is_terminal(v):
            out[key] = None  # keeps the key's place; filled by _fresh
            nested.append((key, _mirror(v, p, layout)))
            continue
        fqn = ".".join(map(str, p))
        dst = layout.staged.get(fqn)
        if dst is None:
            slots.append((key, fqn))  # filled by every stage()
        out[key] = dst
    return out, nested, slots


def _fresh(tree: tuple, flat: dict) -> Any:
    """A new staged state dict from a layout's template: new containers (a
    caller may change the one it got; the next stage is not affected), the
    same staged tensors, this stage's non-tensor values from ``flat``."""
    container, nested, slots = tree
    out = container.copy()
    for key, sub in nested:
        out[key] = _fresh(sub, flat)
    for key, fqn in slots:
        out[key] = flat[fqn]
    return out


def _is_dtensor(v: Any) -> bool:
    return type(v) is not torch.Tensor and DTensor is not None and isinstance(v, DTensor)


def _local(v: torch.Tensor) -> torch.Tensor:
    """The bytes a tensor stages: a DTensor's local shard, or itself."""
    return v if type(v) is torch.Tensor or not _is_dtensor(v) else v._local_tensor


def _wrap_like(v: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The staged stand-in for v: dst itself, or for a DTensor a DTensor
    with v's mesh and placements over the staged local shard."""
    if not _is_dtensor(v):
        if is_checkpointable_tensor(v):  # torch >= 2.14: a shard of a larger tensor
            copy_checkpointable_attrs(v, dst)
        return dst
    dst.requires_grad_(False)
    out = DTensor.from_local(dst, v.device_mesh, v.placements, run_check=False,
                             shape=v.shape, stride=v.stride())
    return out.requires_grad_(v.requires_grad)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _entry_signature(k: str, v: Any) -> Any:
    """What the staging layout depends on for one entry: where and how
    many bytes, and what the staged stand-in is (dtype, shape,
    requires_grad; a DTensor's shard and placements)."""
    if is_checkpointable_tensor(v):  # torch >= 2.14: its shard attributes too
        return (k, v.dtype, v.shape, v.requires_grad,
                ("shard", tuple(v.global_shape), tuple(map(tuple, v.global_offsets)),
                 tuple(map(tuple, v.local_offsets)), tuple(map(tuple, v.local_sizes))))
    if type(v) is torch.Tensor:
        return (k, v.dtype, v.shape, v.requires_grad, None)
    if not isinstance(v, torch.Tensor):
        return k
    return (k, v.dtype, v.shape, v.requires_grad,
            (tuple(v._local_tensor.shape), tuple(v.placements), v.device_mesh)
            if _is_dtensor(v) else None)


def _signature(flat: dict) -> tuple:
    """The layout's identity: a state dict of another signature gets a new
    buffer.  Computed when the fast check of ``DefaultStager._reuse`` fails."""
    return tuple(_entry_signature(k, v) for k, v in flat.items())


def _is_flat(state_dict: dict, mappings: dict) -> bool:
    """Whether flattening ``state_dict`` changed nothing: every key an
    exact str and every value a leaf at the top level (each mapping is
    ``(key,)``).  Then a later state dict with the same keys, whose values
    are still leaves, is its own flat form (``_flat_as_is``)."""
    if len(mappings) != len(state_dict) or set(map(type, state_dict)) != _STR_ONLY:
        return False
    return all(len(m) == 1 for m in mappings.values())


_STR_ONLY = frozenset({str})


def _flat_as_is(layout: "_Layout", state_dict: dict) -> bool:
    """``state_dict`` flattens to itself with ``layout``'s keys and
    mappings (torch's rules), so the stage need not flatten it: its root
    is of the layout's type, its keys are the layout's (exact strs, in
    order), and every value in a slot the layout stages as a non-tensor
    is a leaf.  (The tensor slots are checked by ``_reuse``: a plain slot
    by exact type, the others as tensors; a tensor is a leaf.)"""
    if (not layout.flat_root or type(state_dict) is not layout.root_type
            or len(state_dict) != len(layout.keys)):
        return False
    keys = list(state_dict)
    if keys != layout.keys or set(map(type, keys)) != _STR_ONLY:
        return False
    if layout.values:
        values = list(state_dict.values())
        return all(_is_terminal(values[i]) for i, _ in layout.values)
    return True


class DefaultStager:
    """Drop-in for torch's ``DefaultStager``; see the module docstring.

    ``stage(state_dict)`` returns the staged state dict, or a Future of it
    when ``use_async_staging``.  Use as a context manager, or call
    ``close()``, to free the buffers.
    """

    should_synchronize_after_execute = False

    def __init__(self, config: StagingOptions = StagingOptions()) -> None:
        self._config = config
        self._cuda = torch.cuda.is_available()
        self._executor = (ThreadPoolExecutor(1, thread_name_prefix="dcpx-stage")
                          if config.use_async_staging else None)
        self._layout: Optional[_Layout] = None
        self._returned: Optional[dict] = None  # what the last stage() returned
        self._staging_future: Optional[Future] = None
        self._lease: Optional[Future] = None  # the upload reading our buffer
        # (staging future, Future of (staged, gate, gated keys) or None): set
        # once asynchronous staging has queued its CUDA copies, so that the
        # upload can start writing while they run (early_for)
        self._early: Optional[tuple] = None
        self._lock = threading.Lock()
        self._closed = False
        _stagers.add(self)
        self.stage_count = 0
        self.alloc_count = 0
        self.reuse_count = 0  # stages that reused the last one's plan (_reuse)

    # -- torch's AsyncStager protocol ---------------------------------------
    def stage(self, state_dict: dict, **kwargs: Any):
        if self._closed:
            raise RuntimeError("dcpx: DefaultStager is closed")
        self.wait_for_lease()
        if self._executor is not None:
            # The dcpx-stage thread's current stream is not the caller's:
            # the copies are ordered after the caller's, taken here.
            streams = self._caller_streams() if self._cuda else None
            early: Optional[Future] = Future() if self._cuda else None
            self._staging_future = self._executor.submit(self._stage, state_dict, streams,
                                                         early)
            self._early = (self._staging_future, early) if early is not None else None
            return self._staging_future
        return self._stage(state_dict)

    def synchronize_staging(self) -> None:
        if self._staging_future is not None:
            self._staging_future.result()

    def close(self) -> None:
        """Wait for staging and for the upload reading our buffer, then free
        the buffer.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._staging_future = None  # it holds the staged state dict
        self.wait_for_lease(raise_errors=False)
        with self._lock:
            if self._layout is not None:
                self._layout.buffer.release()
                self._layout = None
            self._returned = None

    def _after_fork_in_child(self) -> None:
        """In a forked child the dcpx-stage thread, the upload our buffer is
        leased to and any thread that held our lock are the parent's.  The
        buffer is left to the parent too: a shared-memory one is the very
        same pages, which the parent may be staging into or uploading from,
        so the child's next stage() allocates its own.  Nothing is unmapped:
        staged state dicts the child holds stay readable."""
        self._lock = threading.Lock()
        if self._executor is not None and not self._closed:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="dcpx-stage")
        self._staging_future = None
        self._lease = None
        self._returned = None
        self._early = None
        layout, self._layout = self._layout, None
        if layout is not None:
            layout.buffer.pinned = False  # a registration of the parent's CUDA context
            if layout.buffer.fd >= 0:
                os.close(layout.buffer.fd)  # the child's copy of the memfd
                layout.buffer.fd = -1

    def __enter__(self) -> "DefaultStager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- dcpx's own -----------------------------------------------------------
    @property
    def staged_bytes(self) -> int:
        """Bytes of staging memory this stager holds now."""
        layout = self._layout
        return layout.buffer.nbytes if layout is not None else 0

    def lease_to(self, upload: Future) -> None:
        """The upload of what was just staged reads our buffer until done."""
        self._lease = upload

    def wait_for_lease(self, raise_errors: bool = False) -> None:
        lease = self._lease
        if lease is not None:
            try:
                lease.result()
            except BaseException:
                if raise_errors:
                    raise
            self._lease = None

    def shared_layout_of(self, staged: dict) -> Optional["_Layout"]:
        """The layout behind a staged state dict if its buffer is a memfd
        another process can map."""
        layout = self._layout
        if layout is not None and self._returned is staged and layout.buffer.fd >= 0:
            return layout
        return None

    def early_for(self, staging: Future) -> Optional[Future]:
        """For the staging future this stager's last ``stage()`` returned: a
        Future set as soon as its CUDA copies are queued, to ``(staged,
        gate, keys)`` (the staged state dict, the C staging gate the copies
        publish, the keys staged from CUDA), or to None when the upload must
        wait for the whole staging (no CUDA copies, another accelerator's,
        or a failure before the copies).  None for any other future."""
        early = self._early
        return early[1] if early is not None and early[0] is staging else None

    def flat_of(self, staged: dict) -> Optional[tuple]:
        """(flat, mappings) of a state dict this stager returned, so the
        upload need not flatten it again; None also when it holds a
        CheckpointableTensor (torch >= 2.14), which dcpx does not plan."""
        layout = self._layout
        if layout is not None and self._returned is staged and not layout.shards:
            return layout.flat, layout.mappings
        return None

    def upload_scan_of(self, staged: dict) -> Optional[tuple]:
        """``_Layout.upload_scan`` of the layout behind a state dict this
        stager returned (its last), else None."""
        layout = self._layout
        if layout is not None and self._returned is staged:
            return layout.upload_scan()
        return None

    @staticmethod
    def _caller_streams() -> Optional[dict]:
        """{device index: stream handle} of the calling thread's current
        stream on its current device, for asynchronous staging, or None
        when CUDA is not initialised (then no tensor is on a GPU, and
        nothing here initialises it).  Other devices' tensors are ordered
        after the dcpx-stage thread's current stream on them."""
        if not torch.cuda.is_initialized():
            return None
        dev = torch.cuda.current_device()
        return {dev: torch.cuda.current_stream(torch.device("cuda", dev)).cuda_stream}

    def _stage(self, state_dict: dict, streams: Optional[dict] = None,
               early: Optional[Future] = None) -> dict:
        try:
            with paused_gc():
                layout = self._layout
                if layout is not None and _flat_as_is(layout, state_dict):
                    # A flat state dict of the last layout: it is its own
                    # flat form, its mappings the layout's (the same
                    # object: _reuse does not compare them).  Anything else
                    # is flattened after all.
                    with self._lock:
                        if self._layout is layout and self._reuse(
                                layout, state_dict, state_dict, layout.mappings, streams,
                                early):
                            self.reuse_count += 1
                            self.stage_count += 1
                            return self._returned
                return self._stage_flat(state_dict, *flatten_state_dict(state_dict),
                                        streams=streams, early=early)
        finally:
            if early is not None and not early.done():
                early.set_result(None)  # the upload waits for the whole staging

    def _stage_flat(self, state_dict: dict, flat: dict, mappings: dict,
                    streams: Optional[dict] = None, early: Optional[Future] = None) -> dict:
        with self._lock:
            layout = self._layout
            if layout is not None and self._reuse(layout, state_dict, flat, mappings, streams,
                                                  early):
                self.reuse_count += 1
            else:
                self._stage_new(state_dict, flat, mappings, streams, early)
            self.stage_count += 1
            return self._returned

    def _reuse(self, layout: _Layout, state_dict: dict, flat: dict, mappings: dict,
               streams: Optional[dict], early: Optional[Future] = None) -> bool:
        """Stage into ``layout`` as planned when ``flat`` has its layout:
        the same keys in the same order, the same mappings, and at every key
        a value of the same kind (checked per tensor in C for the plain
        ones: type, dtype, shape, requires_grad, contiguous on the CPU).
        Only the data pointers are read anew.  False, nothing copied, when
        anything differs: ``_stage_new`` then stages the general way."""
        if (type(state_dict) is not layout.root_type or len(flat) != len(layout.keys)
                or list(flat) != layout.keys
                or (mappings is not layout.mappings and mappings != layout.mappings)):
            return False
        values = list(flat.values())
        for i, k, sig in layout.others:
            v = values[i]
            if not isinstance(v, torch.Tensor) or _entry_signature(k, v) != sig:
                return False
        for i, _ in layout.values:
            if isinstance(values[i], torch.Tensor):
                return False
        if any_checkpointable_tensor(values[p[0]] for p in layout.plain):
            return False  # torch >= 2.14: a plain entry became a shard (_torchcompat)
        for i, k, _ in layout.others:  # the errors dcpx.save gives, naming the key
            check_saveable(_local(values[i]), k)
        for i, k in layout.values:  # (redone by _stage_new if the check below fails)
            layout.flat[k] = copy.deepcopy(values[i])
        if not _C.stage_plain(values, layout.plain, layout.buffer.base,
                              threads=_copy_threads()):
            return False
        # This stage's dict, before the CUDA copies (the upload may start on it).
        self._returned = _fresh(layout.tree, layout.flat)
        self._copy_entries(layout, [(k, values[i]) for i, k, _ in layout.others], streams,
                           early)
        return True

    def _stage_new(self, state_dict: dict, flat: dict, mappings: dict,
                   streams: Optional[dict], early: Optional[Future] = None) -> _Layout:
        """Stage a state dict of a new layout (or one whose tensors changed
        kind): check every tensor, reuse the buffer if the signature is the
        same, copy every entry, and plan the next stages."""
        for k, v in flat.items():
            if isinstance(v, torch.Tensor):
                check_saveable(_local(v), k)  # the errors dcpx.save gives, naming the key
        layout = self._layout
        if layout is None or layout.signature != _signature(flat):
            if layout is not None:
                layout.buffer.release()
                self._layout = None
            pin = self._cuda and self._config.use_pinned_memory
            layout = self._layout = _Layout(state_dict, flat, mappings,
                                            self._config.use_shared_memory, pin)
            self.alloc_count += 1
        else:
            # Same signature, another kind of tensor somewhere (a strided
            # view, another type, device or mappings): the buffer and the
            # staged tensors stay, the plan and the template follow flat.
            layout.mappings = mappings
            layout.keys = list(flat)
            layout.root_type = type(state_dict)
            layout.flat_root = _is_flat(state_dict, mappings)
            layout.tree = _mirror(state_dict, (), layout)
            layout.plan(flat)
        tensors = []
        for k, v in flat.items():
            if k in layout.offsets:
                tensors.append((k, v))
            else:
                layout.flat[k] = copy.deepcopy(v)
        self._returned = _fresh(layout.tree, layout.flat)
        self._copy_entries(layout, tensors, streams, early)
        return layout

    def _copy_entries(self, layout: _Layout, items: list, streams: Optional[dict],
                      early: Optional[Future] = None) -> None:
        """Copy tensors [(key, tensor)] into their places in the buffer:
        host memory by the C copy, CUDA by the C CUDA path, other devices by
        torch."""
        host_pairs, cuda_pairs, other_pairs = [], [], []
        for k, v in items:
            v = _local(v)
            if v.device.type == "cpu":
                host_pairs.append((dlpack_export(dlpack_view(v.detach())), layout.offsets[k]))
            elif v.device.type == "cuda":
                cuda_pairs.append((v, layout.offsets[k], k))
            else:  # other accelerators: torch's own copy
                other_pairs.append((v.detach(), layout.dst[k]))
        if host_pairs:
            _C.copy_into(host_pairs, threads=_copy_threads(), base=layout.buffer.base)
        if cuda_pairs:
            # The upload may start once the copies are queued (no other
            # accelerator's copy_ follows them): it gets this stage's dict.
            on_queued = (_set_queued(early, self._returned, cuda_pairs)
                         if early is not None and not other_pairs else None)
            self._copy_from_devices(cuda_pairs, layout.buffer.base, streams, on_queued)
        for src, dst in other_pairs:
            dst.detach().copy_(src)

    @staticmethod
    def _copy_from_devices(pairs: list, base: torch.Tensor,
                           streams: Optional[dict] = None, on_queued=None) -> None:
        """Device-to-host copies by the C CUDA path (csrc/cuda_stage.c):
        on dcpx's own stream per device, ordered after the work queued so
        far on each device's current stream, or the stream ``streams``
        gives for it (the caller's, when staging runs on the dcpx-stage
        thread) (an event recorded there),
        returning once every byte is in ``base``.  pairs: [(tensor,
        byte_offset, key)].  A non-contiguous tensor is made contiguous on
        its device first (on the current stream, so the event covers it).
        Each pair carries its storage's address as the allocation key: the
        C path merges copies of adjacent tensors only within one storage
        (one block of torch's caching allocator, so one device
        allocation), never across two allocations that merely touch.

        With ``on_queued``, the copies are waited for segment by segment
        (``_SEGMENT`` bytes): ``on_queued(gate)`` is called once they are
        all queued, with the C staging gate on which each segment is
        published as it completes (writer items gated on it wait for their
        bytes); this still returns only after the last copy."""
        items = []
        for v, off, key in pairs:
            v = dlpack_view(v.detach())
            if not v.is_contiguous():
                v = v.contiguous()
            alloc = v.untyped_storage().data_ptr()
            items.append((_TO_DLPACK(v) if _TO_DLPACK is not None else v, off, key, alloc))
        waits = [(dev.index, streams[dev.index] if streams and dev.index in streams
                  else torch.cuda.current_stream(dev).cuda_stream)
                 for dev in {v.device for v, _, _ in pairs}]
        if on_queued is None:
            _C.cuda_copy_into(items, base, wait_streams=waits)
            return
        gate, pending = _C.cuda_copy_into(items, base, wait_streams=waits, wait=False,
                                          segment_bytes=_SEGMENT)
        try:
            on_queued(gate)
        finally:
            _C.cuda_stage_wait(pending)  # publishes the segments; raises a copy's error


def _set_queued(early: Future, staged: dict, cuda_pairs: list):
    """The callback that tells the upload (``DefaultStager.early_for``) the
    CUDA copies of ``staged`` are queued, with their gate."""
    keys = frozenset(k for _, _, k in cuda_pairs)
    return lambda gate: early.set_result((staged, gate, keys))


# Every live stager, for the fork handler: a forked child resets them.
_stagers: "weakref.WeakSet[DefaultStager]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for stager in list(_stagers):
        stager._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

# At interpreter exit: unregister what is still page-locked, destroy dcpx's
# streams, release the primary contexts (a no-op where CUDA was never used).
atexit.register(_C.cuda_release_all)

# ------------------------------------------------------------------ no stager given
class _PooledStager(DefaultStager):
    """A stager kept by ``_StagerPool`` for async_save calls without one."""

    def __init__(self, pool: "_StagerPool", shared: bool) -> None:
        super().__init__(StagingOptions(False, shared, False, False))
        self._pool = pool
        self._pool_reserved: Optional[int] = None  # thread id between acquire and lease
        self._pool_tick = 0  # when last acquired

    def stage(self, state_dict: dict, **kwargs: Any):
        try:
            return super().stage(state_dict, **kwargs)
        except BaseException:
            self._pool.unreserve(self)
            raise

    def lease_to(self, upload: Future) -> None:
        super().lease_to(upload)
        self._pool.leased(self, upload)


class _StagerPool:
    """The stagers of ``async_save`` calls that pass no stager (torchtitan's
    ``dcp.async_save(sd, checkpoint_id=...)`` every N steps), kept across
    calls so their buffers are reused instead of allocated and pre-faulted
    on every call (docs/design.md, "Staging without a stager").

    Per kind (THREAD: private memory; PROCESS: a memfd the checkpoint process
    maps, known to it by serial) at most ``MAX`` stagers, each with at most
    one buffer of the state dict's size:

    * a call takes a stager whose upload is done (the most recently used
      first), so nothing waits and nothing is allocated when the previous
      save has finished;
    * while the previous upload still reads its buffer, a second stager (a
      second buffer) is used, so the call does not wait for that upload;
    * with ``MAX`` uploads in flight, the call waits, inside ``stage()``, for
      the oldest one, as a stager passed in would.

    After each staging, pooled stagers holding another layout (keys, dtypes,
    shapes) are released (at once, or when their upload finishes).
    ``release_staging_buffers()`` and interpreter exit free them all.
    """

    MAX = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stagers: dict = {False: [], True: []}  # use_shared_memory -> [stager]
        self._ticks = itertools.count()

    def acquire(self, shared: bool) -> _PooledStager:
        me = threading.get_ident()
        with self._lock:
            pool = self._stagers[shared]
            # Reserved: between acquire() and lease_to(), so that two threads
            # calling async_save at once never stage into one buffer.  A
            # reservation by this very thread is stale (its call failed
            # before the lease, and a thread makes one call at a time).
            mine = [s for s in pool if s._pool_reserved in (None, me)]
            free = [s for s in mine if s._lease is None or s._lease.done()]
            if free:
                stager = max(free, key=lambda s: s._pool_tick)
            elif len(pool) < self.MAX or not mine:
                stager = _PooledStager(self, shared)
                if len(pool) < self.MAX:
                    pool.append(stager)
                # else: MAX concurrent calls reserve every pooled stager;
                # this one is closed after its upload, as torch's per-call one
            else:  # stage() waits for the oldest upload
                stager = min(mine, key=lambda s: s._pool_tick)
            stager._pool_reserved = me
            stager._pool_tick = next(self._ticks)
            return stager

    def leased(self, stager: _PooledStager, upload: Future) -> None:
        """Called by ``lease_to``: the stager is the upload's until it is
        done.  Retires the pooled stagers of another layout."""
        with self._lock:
            stager._pool_reserved = None
            pool = self._stagers[stager._config.use_shared_memory]
            if stager not in pool:  # an extra one (all pooled ones reserved)
                upload.add_done_callback(lambda _: stager.close())
                return
            layout = stager._layout
            stale = [s for s in pool if s is not stager and s._pool_reserved is None
                     and s._layout is not None
                     and (layout is None or not layout.same_layout(s._layout))]
            for s in stale:
                pool.remove(s)
        for s in stale:
            _close_when_done(s)

    def unreserve(self, stager: _PooledStager) -> None:
        """stage() failed: the stager is free again."""
        with self._lock:
            if stager._pool_reserved == threading.get_ident():
                stager._pool_reserved = None

    def release(self, wait: bool = True) -> None:
        """Free every pooled buffer; with ``wait``, after the uploads that
        read them, else those still in use are freed when theirs finish."""
        with self._lock:
            stagers = self._stagers[False] + self._stagers[True]
            self._stagers = {False: [], True: []}
        for s in stagers:
            if wait:
                s.close()
            else:
                _close_when_done(s)

    def stats(self) -> dict:
        """For tests and benchmarks: stagers, buffers and bytes held,
        allocations made, per kind."""
        with self._lock:
            return {("process" if shared else "thread"): {
                "stagers": len(pool),
                "buffers": sum(s._layout is not None for s in pool),
                "bytes": sum(s.staged_bytes for s in pool),
                "alloc_count": sum(s.alloc_count for s in pool)}
                for shared, pool in self._stagers.items()}

    def _after_fork_in_child(self) -> None:
        """The stagers reset themselves (their buffers stay the parent's);
        reservations were made by threads the child does not have."""
        self._lock = threading.Lock()
        for pool in self._stagers.values():
            for s in pool:
                s._pool_reserved = None


def _close_when_done(stager: DefaultStager) -> None:
    lease = stager._lease
    if lease is None or lease.done():
        stager.close()
    else:
        lease.add_done_callback(lambda _: stager.close())


_pool = _StagerPool()


def release_staging_buffers() -> None:
    """Free the staging buffers that ``async_save`` keeps between calls made
    without a stager (``async_stager=None``), after the uploads still reading
    them.  The next such call allocates again.  Called at interpreter exit
    too (without waiting for uploads still running)."""
    _pool.release(wait=True)


def _release_at_exit() -> None:
    _pool.release(wait=False)


atexit.register(_release_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pool._after_fork_in_child)
