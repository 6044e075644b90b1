"""The stand-in CUDA driver (tests/fake_cuda/fake_libcuda.c) and a DLPack
producer of "CUDA" tensors over its device memory, for the tests of dcpx's
C CUDA path on machines without a GPU (tests/test_cuda_standin.py).

``build(dir)`` compiles the stand-in with the system C compiler; pointing
``DCPX_LIBCUDA`` at the result before dcpx first touches CUDA makes dcpx
load it instead of libcuda.so.1.  ``ctypes.CDLL`` of the same path gives
the tests the very same library instance (dlopen returns the loaded one),
so they can drive its streams and read its counters.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

SRC = Path(__file__).resolve().parent / "fake_cuda" / "fake_libcuda.c"

c_void_p, c_int, c_long, c_size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_size_t

# CUresult codes the stand-in returns (cuda.h's values).
INVALID_VALUE, OUT_OF_MEMORY, NOT_INITIALIZED = 1, 2, 3
INVALID_DEVICE, INVALID_CONTEXT, ILLEGAL_ADDRESS = 101, 201, 700


_built: "Path | None" = None


def build(out_dir: Path) -> Path:
    """Compile the stand-in into out_dir, once per process (dcpx loads the
    driver once: every test module must get the same library)."""
    global _built
    if _built is not None:
        return _built
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler to build the stand-in CUDA driver")
    out = out_dir / "libfakecuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-g", "-Wall", "-Wextra", "-Werror",
                    "-pthread", "-o", str(out), str(SRC)], check=True)
    _built = out
    return out


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.fake_device_alloc.restype = c_void_p
    lib.fake_device_alloc.argtypes = [c_int, c_size_t]
    lib.fake_device_alloc_adjacent.argtypes = [c_int, c_int, ctypes.POINTER(c_size_t),
                                               ctypes.POINTER(c_void_p)]
    lib.fake_device_free.argtypes = [c_void_p]
    lib.fake_launch_fill.argtypes = [c_void_p, c_void_p, c_int, c_size_t]
    lib.fake_launch_read.argtypes = [c_void_p, c_void_p, c_size_t, c_void_p]
    lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_ulonglong, c_void_p, c_size_t, c_void_p]
    lib.fake_fail.argtypes = [ctypes.c_char_p, c_long, c_int]
    lib.fake_fail_async.argtypes = [c_long, c_int]
    lib.fake_set_delay.argtypes = [ctypes.c_char_p, c_long]
    lib.fake_hold_copies.argtypes = [c_int]
    lib.fake_hold_after.argtypes = [c_long]
    lib.fake_calls.argtypes = [ctypes.c_char_p]
    for name in ("fake_calls", "fake_total_calls", "fake_violations", "fake_copies_queued",
                 "fake_copies_run", "fake_dlpack_live", "fake_reuse_violations",
                 "fake_log_len"):
        getattr(lib, name).restype = c_long
    lib.fake_log_get.argtypes = [c_long, ctypes.POINTER(LogEntry)]
    lib.fake_dlpack.restype = c_void_p
    lib.fake_dlpack.argtypes = [c_void_p, c_int, c_int, ctypes.POINTER(ctypes.c_int64),
                                ctypes.POINTER(ctypes.c_int64), c_int, c_int]
    lib.cuCtxSetCurrent.argtypes = [c_void_p]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(c_void_p)]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(c_void_p), c_int]
    lib.cuStreamCreate.argtypes = [ctypes.POINTER(c_void_p), ctypes.c_uint]
    lib.cuStreamSynchronize.argtypes = [c_void_p]
    lib.cuEventCreate.argtypes = [ctypes.POINTER(c_void_p), ctypes.c_uint]
    lib.cuEventRecord.argtypes = [c_void_p, c_void_p]
    lib.cuEventDestroy_v2.argtypes = [c_void_p]
    lib.cuStreamWaitEvent.argtypes = [c_void_p, c_void_p, ctypes.c_uint]
    lib.fake_fail.argtypes = [ctypes.c_char_p, c_long, c_int]
    return lib


class LogEntry(ctypes.Structure):
    """One entry of the stand-in's call log (fake_libcuda.c, log_entry)."""
    _fields_ = [("kind", c_long), ("stream", c_void_p), ("host", c_void_p),
                ("dptr", ctypes.c_ulonglong), ("n", c_size_t), ("event", c_void_p),
                ("batch", c_long)]


LOG_KINDS = {1: "htod", 2: "dtoh", 3: "batch", 4: "record", 5: "evsync", 6: "wait"}


def call_log(lib: ctypes.CDLL) -> list:
    """The stand-in's call log since its last fake_reset, as dicts:
    kind ('htod', 'dtoh', 'batch', 'record', 'evsync', 'wait'), stream,
    host, dptr, n, event, batch (a copy's batch number, or 0)."""
    out, e = [], LogEntry()
    for i in range(lib.fake_log_len()):
        if lib.fake_log_get(i, ctypes.byref(e)) != 0:
            break
        out.append({"kind": LOG_KINDS[e.kind], "stream": e.stream, "host": e.host,
                    "dptr": e.dptr, "n": e.n, "event": e.event, "batch": e.batch})
    return out


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"stand-in {what} returned {rc}")


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [c_void_p, ctypes.c_char_p, c_void_p]


class Device:
    """The producer's side of one device: its primary context and its own
    ("current") stream, on which its kernels run."""

    def __init__(self, lib: ctypes.CDLL, dev: int) -> None:
        self.lib, self.dev = lib, dev
        self.ctx = c_void_p()
        check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")
        self.enter()
        s = c_void_p()
        check(lib.cuStreamCreate(ctypes.byref(s), 1), "cuStreamCreate")
        self.stream = s.value

    def enter(self) -> None:
        """Make this device's context current on the calling thread."""
        check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def synchronize(self) -> None:
        self.enter()
        check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")


class FakeCudaTensor:
    """A 1-d "CUDA" tensor of `nbytes` uint8 (or `shape` of `bits`-bit
    unsigned ints) in the stand-in's memory of `device`.  ``__dlpack__``
    follows the DLPack consumer contract: given the consumer's stream, it
    orders that stream after its device stream's pending work with an
    event (unless ``honour_stream`` is False: a broken producer)."""

    def __init__(self, device: Device, nbytes: int = 0, shape=None, bits: int = 8,
                 strides=None, base: "FakeCudaTensor | None" = None, offset: int = 0,
                 honour_stream: bool = True, ptr: int = 0) -> None:
        self.device, self.lib = device, device.lib
        self.shape = tuple(shape) if shape is not None else (nbytes // (bits // 8),)
        self.bits, self.strides = bits, strides
        self.nbytes = (bits // 8) * _prod(self.shape)
        self.honour_stream = honour_stream
        self.dlpack_streams: list = []
        if base is None:
            self.owner = True
            self.ptr = ptr or self.lib.fake_device_alloc(device.dev, max(self.nbytes, 1))
            assert self.ptr
            self.alloc = self.ptr
        else:  # a view into another tensor's allocation
            self.owner = False
            self.ptr = base.ptr + offset
            self.alloc = base.alloc  # the allocation it lies in (torch: the storage)

    @classmethod
    def adjacent(cls, device: Device, sizes) -> "list[FakeCudaTensor]":
        """uint8 tensors, each its own allocation, placed back to back in
        device memory (two cudaMalloc segments the driver happened to put
        next to each other): a copy spanning two of them fails."""
        n = len(sizes)
        ptrs = (c_void_p * n)()
        check(device.lib.fake_device_alloc_adjacent(device.dev, n, (c_size_t * n)(*sizes), ptrs),
              "fake_device_alloc_adjacent")
        return [cls(device, s, ptr=p) for s, p in zip(sizes, ptrs)]

    # -- test helpers --------------------------------------------------------
    def write(self, data: bytes) -> None:
        """Set the device bytes directly (no kernel)."""
        assert len(data) <= self.nbytes
        ctypes.memmove(self.ptr, data, len(data))

    def read(self) -> bytes:
        return ctypes.string_at(self.ptr, self.nbytes)

    def launch_fill(self, byte: int) -> None:
        """A kernel on the producer's stream writing `byte` everywhere."""
        check(self.lib.fake_launch_fill(self.device.stream, self.ptr, byte, self.nbytes),
              "fake_launch_fill")

    def launch_read(self, out) -> None:
        """A consumer kernel on the producer's stream copying the tensor's
        bytes into the host buffer `out` (a ctypes buffer) when it runs."""
        check(self.lib.fake_launch_read(self.device.stream, self.ptr, self.nbytes, out),
              "fake_launch_read")

    def capsule(self):
        """A DLPack capsule with no stream handshake (the caller's job)."""
        n = len(self.shape)
        shape = (ctypes.c_int64 * max(n, 1))(*self.shape)
        strides = (ctypes.c_int64 * n)(*self.strides) if self.strides is not None else None
        m = self.lib.fake_dlpack(self.ptr, self.device.dev, n, shape, strides, 1, self.bits)
        assert m
        return _capsule_new(m, b"dltensor_versioned", None)

    def free(self) -> None:
        if self.owner and self.ptr:
            self.lib.fake_device_free(self.ptr)
            self.ptr = 0

    # -- the DLPack protocol -------------------------------------------------
    def __dlpack_device__(self):
        return (2, self.device.dev)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.dlpack_streams.append(stream)
        if max_version is None or max_version[0] < 1:
            raise BufferError("this producer exports versioned capsules only")
        if self.honour_stream and stream not in (None, -1) and stream != self.device.stream:
            lib = self.lib
            self.device.enter()
            ev = c_void_p()
            check(lib.cuEventCreate(ctypes.byref(ev), 2), "cuEventCreate")
            check(lib.cuEventRecord(ev, self.device.stream), "cuEventRecord")
            check(lib.cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent")
            check(lib.cuEventDestroy_v2(ev), "cuEventDestroy")
        return self.capsule()


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
