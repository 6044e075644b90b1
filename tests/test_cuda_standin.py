"""dcpx's C CUDA path (csrc/cuda.c, csrc/cuda_stage.c, csrc/cuda_load.c) against a stand-in
driver (tests/fake_cuda/fake_libcuda.c, built once per session by tests/conftest.py's fixtures):
no GPU is needed, and none has run these paths; see docs/design.md, "CUDA
path".

What is checked: the copies are bit exact, across dtypes, devices and
coalesced runs; a copy never runs while a producer kernel writing its
source is pending (the stand-in counts violations; a broken producer shows
the count works) and the call never returns before the last copy has run;
one page-locked buffer serves every save; each injected driver failure
raises CudaError naming the call, code and tensor, and leaves no copy in
flight; DLPack deleters run exactly once; a forked child makes no driver
call; closing releases what was pinned and retained; a missing, too old
or device-less driver is reported clearly.  Loads: host-to-device copies
are bit exact, run after the consumer stream's pending kernels (writing or
reading the destination) and before its later ones, each injected failure
is named with the call and key, and FileSystemReader reads CUDA
destinations through one page-locked buffer reused by every load.  The cases that need a fresh
process (how the driver is first loaded) run in a subprocess.
"""
from __future__ import annotations

import ctypes
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch

from dcpx import _C

from cuda_standin import (ILLEGAL_ADDRESS, INVALID_CONTEXT, INVALID_VALUE, OUT_OF_MEMORY,
                          FakeCudaTensor)

REPO = Path(__file__).resolve().parents[1]


def _buffer(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def _rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _layout(sizes, align=64):
    offs, total = [], 0
    for s in sizes:
        total = -(-total // align) * align
        offs.append(total)
        total += s
    return offs, total


# --------------------------------------------------------------------------
# copies

@pytest.mark.parametrize("bits", [8, 16, 32, 64])
def test_copies_are_bit_exact_across_devices_and_dtypes(lib, bits):
    sizes = [0, 1, 7, 64, 4096, 100_003]
    tensors, want = [], []
    for i, n in enumerate(sizes):
        t = FakeCudaTensor(lib.devices[i % 2], shape=(n,), bits=bits)
        data = _rand(t.nbytes, i + bits)
        t.write(data)
        tensors.append(t)
        want.append(data)
    offs, total = _layout([t.nbytes for t in tensors])
    buf = _buffer(total + 128)
    pairs = [(t, o, f"t{i}") for i, (t, o) in enumerate(zip(tensors, offs))]
    _C.cuda_copy_into(pairs, buf)
    raw = buf.numpy().tobytes()
    for t, o, w in zip(tensors, offs, want):
        assert raw[o:o + t.nbytes] == w
    assert lib.fake_copies_run() == lib.fake_copies_queued() == len(sizes) - 1  # not the empty one
    for t in tensors:
        assert t.dlpack_streams and all(s not in (None, -1) for s in t.dlpack_streams)
        t.free()


def test_adjacent_tensors_are_copied_in_one_call(lib):
    """Tensors of one allocation (the same alloc_key) adjacent on the
    device and in the buffer (the layout the stager's 64-byte alignment
    gives 64-byte multiples) make one copy; without a key, or with two
    keys, they are not merged across."""
    whole = FakeCudaTensor(lib.devices[0], 64 * 10)
    whole.write(_rand(640, 1))
    parts = [FakeCudaTensor(lib.devices[0], 64, base=whole, offset=64 * i) for i in range(10)]
    buf = _buffer(640)
    _C.cuda_copy_into([(p, 64 * i, f"p{i}", whole.alloc) for i, p in enumerate(parts)], buf)
    assert buf.numpy().tobytes() == whole.read()
    assert lib.fake_calls(b"cuMemcpyDtoHAsync_v2") == 1
    # No key (absent, None or 0): nothing known about the allocations, one
    # copy each.
    for pairs in ([(p, 64 * i) for i, p in enumerate(parts)],
                  [(p, 64 * i, None, None) for i, p in enumerate(parts)],
                  [(p, 64 * i, f"p{i}", 0) for i, p in enumerate(parts)]):
        lib.fake_reset()
        buf = _buffer(640)
        _C.cuda_copy_into(pairs, buf)
        assert buf.numpy().tobytes() == whole.read()
        assert lib.fake_calls(b"cuMemcpyDtoHAsync_v2") == 10
    # Two keys: one copy per key's run.
    lib.fake_reset()
    buf = _buffer(640)
    _C.cuda_copy_into([(p, 64 * i, f"p{i}", 1 + i // 5) for i, p in enumerate(parts)], buf)
    assert buf.numpy().tobytes() == whole.read()
    assert lib.fake_calls(b"cuMemcpyDtoHAsync_v2") == 2
    # Not adjacent in the buffer: one copy each.
    lib.fake_reset()
    buf = _buffer(1280)
    _C.cuda_copy_into([(p, 128 * i, f"p{i}", whole.alloc) for i, p in enumerate(parts)], buf)
    raw = buf.numpy().tobytes()
    assert all(raw[128 * i:128 * i + 64] == p.read() for i, p in enumerate(parts))
    assert lib.fake_calls(b"cuMemcpyDtoHAsync_v2") == 10
    whole.free()


@pytest.mark.parametrize("wait", [True, False])
def test_adjacent_allocations_are_never_copied_as_one(lib, wait):
    """Two allocations back to back in the device's address space (two
    cudaMalloc segments of torch's caching allocator placed next to each
    other), their tensors back to back in the buffer: a copy spanning both
    is not one the driver guarantees (the stand-in refuses it), so tensors
    of different allocations are copied one by one, bit exact; also in
    segments (wait=False)."""
    ts = FakeCudaTensor.adjacent(lib.devices[0], [4096, 4096, 64])
    assert ts[1].ptr == ts[0].ptr + 4096 and ts[2].ptr == ts[1].ptr + 4096
    data = [_rand(t.nbytes, 700 + i) for i, t in enumerate(ts)]
    for t, d in zip(ts, data):
        t.write(d)
    spanning = FakeCudaTensor(lib.devices[0], 8192, base=ts[0])
    with pytest.raises(_C.CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        _C.cuda_copy_into([(spanning, 0)], _buffer(8192))
    lib.fake_reset()
    buf = _buffer(8256)
    pairs = [(t, 4096 * i, f"w{i}", t.alloc) for i, t in enumerate(ts)]
    if wait:
        _C.cuda_copy_into(pairs, buf)
    else:
        gate, pending = _C.cuda_copy_into(pairs, buf, wait=False, segment_bytes=1 << 20)
        _C.cuda_stage_wait(pending)
        assert _C.gate_stats(gate)[:2] == (8256, 0)
    assert buf.numpy().tobytes() == b"".join(data)
    assert lib.fake_calls(b"cuMemcpyDtoHAsync_v2") == 3
    for t in ts:
        t.free()


@pytest.mark.parametrize("handshake", ["dlpack_stream", "wait_streams"])
def test_a_copy_never_runs_before_the_producers_pending_kernel(lib, handshake):
    """The producer's stream has a slow kernel writing the source; dcpx's
    copy must run after it (both forms of the handshake), and the host
    thread is not blocked by the producer."""
    lib.fake_set_delay(b"fill", 20_000)
    dev = lib.devices[0]
    t = FakeCudaTensor(dev, 1 << 16)
    buf = _buffer(1 << 16)
    for rnd in range(15):
        byte = 0x10 + rnd
        t.launch_fill(byte)
        if handshake == "dlpack_stream":
            _C.cuda_copy_into([(t, 0)], buf)
        else:
            _C.cuda_copy_into([(t.capsule(), 0)], buf, wait_streams=[(0, dev.stream)])
        assert bytes(set(buf.numpy().tobytes())) == bytes([byte]), rnd
    assert lib.fake_violations() == 0
    t.free()


@pytest.mark.skipif(os.environ.get("DCPX_SANITIZE") == "thread",
                    reason="a deliberate race (kernel and copy on one buffer), which TSan reports")
def test_the_ordering_check_catches_a_producer_that_ignores_the_stream(lib):
    """Control for the test above: a producer that ignores the consumer's
    stream (and no wait_streams) lets the copy run during the kernel, and
    the stand-in notices (and so does TSan, hence the skip there)."""
    lib.fake_set_delay(b"fill", 300_000)
    dev = lib.devices[0]
    t = FakeCudaTensor(dev, 4096, honour_stream=False)
    t.launch_fill(0x5A)
    _C.cuda_copy_into([(t, 0)], _buffer(4096))
    dev.synchronize()
    assert lib.fake_violations() >= 1
    t.free()


def test_the_call_returns_only_after_the_last_copy(lib):
    lib.fake_set_delay(b"copy", 5_000)
    ts = [FakeCudaTensor(lib.devices[i % 2], 1000 + i) for i in range(8)]
    for i, t in enumerate(ts):
        t.write(_rand(t.nbytes, i))
    offs, total = _layout([t.nbytes for t in ts])
    buf = _buffer(total)
    for _ in range(3):
        before = lib.fake_copies_queued()
        _C.cuda_copy_into([(t, o) for t, o in zip(ts, offs)], buf)
        assert lib.fake_copies_run() == lib.fake_copies_queued() == before + len(ts)
        raw = buf.numpy().tobytes()
        assert all(raw[o:o + t.nbytes] == t.read() for t, o in zip(ts, offs))
    for t in ts:
        t.free()


def test_one_pinned_buffer_serves_every_save(lib):
    t = FakeCudaTensor(lib.devices[1], 10_000)
    buf = _buffer(16384)
    registered = lib.fake_registered()
    assert _C.cuda_host_register(buf) is True
    assert lib.fake_registered() == registered + 1
    for rnd in range(5):
        data = _rand(10_000, rnd)
        t.write(data)
        _C.cuda_copy_into([(t, 4096)], buf)
        assert buf.numpy().tobytes()[4096:14096] == data
    assert lib.fake_calls(b"cuMemHostRegister_v2") == 1
    assert _C.cuda_host_unregister(buf) is True
    assert _C.cuda_host_unregister(buf) is False  # not registered any more
    assert lib.fake_registered() == registered
    t.free()


def test_pinning_failure_falls_back_to_pageable_with_a_warning(lib):
    lib.fake_fail(b"cuMemHostRegister_v2", 1, OUT_OF_MEMORY)
    buf = _buffer(8192)
    with pytest.warns(RuntimeWarning, match="cannot page-lock.*CUDA_ERROR_OUT_OF_MEMORY"):
        assert _C.cuda_host_register(buf) is False
    t = FakeCudaTensor(lib.devices[0], 8192)
    t.write(_rand(8192, 3))
    _C.cuda_copy_into([(t, 0)], buf)  # pageable: the copy still works
    assert buf.numpy().tobytes() == t.read()
    assert _C.cuda_host_unregister(buf) is False
    t.free()


def test_copies_from_several_python_threads_at_once(lib):
    errors = []

    def work(k):
        try:
            ts = [FakeCudaTensor(lib.devices[(k + i) % 2], 3000 + 17 * i) for i in range(4)]
            offs, total = _layout([t.nbytes for t in ts])
            buf = _buffer(total)
            for rnd in range(10):
                for i, t in enumerate(ts):
                    t.write(_rand(t.nbytes, 1000 * k + 10 * rnd + i))
                _C.cuda_copy_into([(t, o) for t, o in zip(ts, offs)], buf)
                raw = buf.numpy().tobytes()
                assert all(raw[o:o + t.nbytes] == t.read() for t, o in zip(ts, offs))
            for t in ts:
                t.free()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors


# --------------------------------------------------------------------------
# errors

FAILURES = [
    # (entry point, nth call, code, what the message names)
    ("cuMemcpyDtoHAsync_v2", 2, INVALID_VALUE, "cuMemcpyDtoHAsync for tensor 'b' on device 0"),
    ("cuMemcpyDtoHAsync_v2", 1, OUT_OF_MEMORY, "cuMemcpyDtoHAsync for tensor 'a' on device 0"),
    ("cuEventRecord", 1, INVALID_VALUE, "cuEventRecord for tensor"),
    ("cuEventSynchronize", 1, ILLEGAL_ADDRESS, "cuEventSynchronize"),
    ("cuEventCreate", 1, OUT_OF_MEMORY, "cuEventCreate"),
    ("cuCtxSetCurrent", 3, INVALID_CONTEXT, "cuCtxSetCurrent failed"),  # setting up events
    ("cuCtxSetCurrent", 5, INVALID_CONTEXT, "cuCtxSetCurrent for tensor 'a' on device 0"),
]


@pytest.mark.parametrize("call,nth,code,names", FAILURES, ids=[f"{f[0]}-{f[1]}" for f in FAILURES])
def test_every_injected_failure_raises_clearly_and_leaves_nothing_in_flight(lib, call, nth, code,
                                                                           names):
    ts = [FakeCudaTensor(lib.devices[0], 5000 + i) for i in range(3)]
    ts.append(FakeCudaTensor(lib.devices[1], 777))
    for i, t in enumerate(ts):
        t.write(_rand(t.nbytes, i))
    offs, total = _layout([t.nbytes for t in ts], align=8192)  # never coalesced
    buf = _buffer(total)
    # Capsules (the producer's own driver calls would meet the injection
    # too), ordered by wait_streams after the calls below.
    pairs = [(t.capsule(), o, k) for t, o, k in zip(ts, offs, "abcd")]
    lib.fake_set_delay(b"copy", 2_000)
    lib.fake_fail(call.encode(), nth, code)
    with pytest.raises(_C.CudaError) as ei:
        _C.cuda_copy_into(pairs, buf)
    assert ei.value.code == code
    msg = str(ei.value)
    assert names in msg and call.removesuffix("_v2") in msg, msg
    # Nothing still writes into the buffer once the call has failed.
    assert lib.fake_copies_run() == lib.fake_copies_queued()
    # The next save works.
    lib.fake_reset()
    _C.cuda_copy_into([(t, o, k) for t, o, k in zip(ts, offs, "abcd")], buf)
    raw = buf.numpy().tobytes()
    assert all(raw[o:o + t.nbytes] == t.read() for t, o in zip(ts, offs))
    for t in ts:
        t.free()


def test_an_asynchronous_copy_failure_is_reported_by_the_wait(lib):
    ts = [FakeCudaTensor(lib.devices[0], 4096) for _ in range(3)]
    offs, total = _layout([4096] * 3, align=8192)
    lib.fake_fail_async(2, ILLEGAL_ADDRESS)
    with pytest.raises(_C.CudaError, match="cuEventSynchronize .*CUDA_ERROR_ILLEGAL_ADDRESS") as ei:
        _C.cuda_copy_into([(t, o) for t, o in zip(ts, offs)], _buffer(total))
    assert ei.value.code == ILLEGAL_ADDRESS
    assert lib.fake_copies_run() == lib.fake_copies_queued()
    for t in ts:
        t.free()


def test_a_producer_stream_failure_is_raised(lib):
    t = FakeCudaTensor(lib.devices[0], 64)
    lib.fake_fail(b"cuStreamWaitEvent", 1, INVALID_VALUE)
    with pytest.raises(_C.CudaError, match="cuStreamWaitEvent"):
        _C.cuda_copy_into([(t, 0)], _buffer(64), wait_streams=[(0, lib.devices[0].stream)])
    assert lib.fake_copies_queued() == 0
    t.free()


def test_a_device_the_process_cannot_see_is_named(lib):
    t = FakeCudaTensor(lib.devices[0], 64)
    bad = FakeCudaTensor.__new__(FakeCudaTensor)
    bad.__dict__.update(t.__dict__, owner=False, dlpack_streams=[])
    bad.__dlpack_device__ = lambda: (2, 5)
    with pytest.raises(_C.CudaError, match=r"CUDA device 5, but this process sees 2 CUDA device"):
        _C.cuda_copy_into([(bad, 0)], _buffer(64))
    with pytest.raises(_C.CudaError, match=r"CUDA device 3, but this process sees 2"):
        _C.cuda_copy_into([], _buffer(64), wait_streams=[(3, 0)])
    t.free()


@pytest.mark.parametrize("case", ["strided", "cpu", "too_big", "no_dlpack", "bad_pair",
                                  "negative_key", "str_key"])
def test_bad_pairs_are_refused_before_any_copy(lib, case):
    t = FakeCudaTensor(lib.devices[0], 256)
    buf = _buffer(256)
    if case == "strided":
        src = FakeCudaTensor(lib.devices[0], shape=(8, 8), bits=8, strides=(16, 1), base=t)
        pair, exc, match = (src, 0, "w"), ValueError, "tensor 'w' is not contiguous"
    elif case == "cpu":
        pair, exc, match = (torch.zeros(4), 0), TypeError, "expected a CUDA tensor"
    elif case == "too_big":
        pair, exc, match = (t, 1, "x"), ValueError, "tensor 'x' does not fit"
    elif case == "no_dlpack":
        pair, exc, match = (object(), 0), TypeError, "no __dlpack_device__"
    elif case == "negative_key":
        pair, exc, match = (t, 0, "k", -1), ValueError, "tensor 'k': alloc_key must be"
    elif case == "str_key":
        pair, exc, match = (t, 0, None, "a"), ValueError, "tensor #0: alloc_key must be"
    else:
        pair, exc, match = (t,), TypeError, "pairs hold"
    with pytest.raises(exc, match=match):
        _C.cuda_copy_into([pair], buf)
    assert lib.fake_copies_queued() == 0
    t.free()


# --------------------------------------------------------------------------
# lifetime: close, fork, loading

def test_release_all_unpins_and_releases_and_the_path_comes_back(lib):
    t = FakeCudaTensor(lib.devices[1], 4096)
    t.write(_rand(4096, 9))
    bufs = [_buffer(4096) for _ in range(2)]
    before = _C.cuda_registered()
    for b in bufs:
        assert _C.cuda_host_register(b)
    # cuda_registered() counts what dcpx pinned, as the driver does.
    assert _C.cuda_registered() == (before[0] + 2, before[1] + 2 * 4096)
    assert lib.fake_registered() == before[0] + 2
    assert _C.cuda_host_unregister(bufs[1]) is True
    assert _C.cuda_registered() == (before[0] + 1, before[1] + 4096)
    assert _C.cuda_host_register(bufs[1])
    _C.cuda_copy_into([(t, 0)], bufs[0])
    retained = [lib.fake_retained(d) for d in range(2)]
    assert _C.cuda_release_all() == 2
    assert lib.fake_registered() == 0 and _C.cuda_registered() == (0, 0)
    assert [lib.fake_retained(d) for d in range(2)] == [r - 1 for r in retained]
    assert _C.cuda_host_unregister(bufs[0]) is False
    _C.cuda_copy_into([(t, 0)], bufs[1])  # streams and contexts set up again
    assert bufs[1].numpy().tobytes() == t.read()
    t.free()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_touches_the_parents_cuda_state(lib):
    t = FakeCudaTensor(lib.devices[0], 4096)
    t.write(_rand(4096, 5))
    buf = _buffer(4096)
    assert _C.cuda_host_register(buf)
    _C.cuda_copy_into([(t.capsule(), 0)], buf)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never raise, never hang
        code = 1
        try:
            signal.alarm(60)
            os.close(r)
            calls = lib.fake_total_calls()
            unreg = _C.cuda_host_unregister(buf)
            try:
                _C.cuda_copy_into([(t.capsule(), 0)], buf)
                msg = "no error"
            except _C.CudaError as e:
                msg = str(e)
            released = _C.cuda_release_all()
            out = f"{unreg}|{released}|{lib.fake_total_calls() - calls}|{msg}"
            os.write(w, out.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    unreg, released, calls, msg = out.split("|", 3)
    assert (unreg, released, calls) == ("False", "0", "0"), out
    assert "forked child cannot use it" in msg
    # The parent's state is intact.
    _C.cuda_copy_into([(t, 0)], buf)
    assert buf.numpy().tobytes() == t.read()
    assert _C.cuda_host_unregister(buf) is True
    t.free()


# A fresh process that loads the extension alone (no torch: seconds saved
# per case), as `_C`.
_LOAD_C = f"""
import importlib.util
_spec = importlib.util.spec_from_file_location("dcpx._C", {_C.__file__!r})
_C = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_C)
"""


def _fresh(code: str, env: dict, c_only: bool = True) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), **env)
    code = (_LOAD_C if c_only else "") + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", code], env=full,
                          capture_output=True, text=True, timeout=120)


def test_a_missing_driver_is_reported_and_dcpx_still_imports(tmp_path):
    r = _fresh("""
        import dcpx, torch
        from dcpx import _C
        try:
            _C.cuda_copy_into([], torch.zeros(1, dtype=torch.uint8))
        except _C.CudaError as e:
            print("ERR", e)
    """, {"DCPX_LIBCUDA": str(tmp_path / "libcuda.so.1")}, c_only=False)
    assert r.returncode == 0, r.stderr
    assert "ERR dcpx: cannot load the CUDA driver" in r.stdout and "libcuda.so.1" in r.stdout


def test_a_too_old_driver_is_refused(standin_path):
    r = _fresh("""
        try:
            _C.cuda_driver_version()
        except _C.CudaError as e:
            print("ERR", e)
    """, {"DCPX_LIBCUDA": str(standin_path), "FAKE_CUDA_DRIVER_VERSION": "10020"})
    assert r.returncode == 0, r.stderr
    assert "the CUDA driver is version 10.2 (10020); dcpx needs 11.0 or newer" in r.stdout


def test_no_device_and_first_use_failures_are_reported_and_retried(standin_path):
    r = _fresh(f"""
        import numpy
        from cuda_standin import load, Device, FakeCudaTensor
        lib = load({str(standin_path)!r})
        buf = numpy.zeros(64, dtype=numpy.uint8)
        for call, code in [("cuDevicePrimaryCtxRetain", 2), ("cuStreamCreate", 2)]:
            lib.fake_fail(call.encode(), 1, code)
            try:
                _C.cuda_copy_into([], buf, wait_streams=[(0, 0)])
            except _C.CudaError as e:
                print("ERR", e.code, e)
        lib.cuInit(0)
        t = FakeCudaTensor(Device(lib, 0), 64)
        t.write(bytes(range(64)))
        _C.cuda_copy_into([(t, 0)], buf)
        print("OK", buf.tobytes() == bytes(range(64)))
    """, {"DCPX_LIBCUDA": str(standin_path)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("ERR 2 dcpx: cuDevicePrimaryCtxRetain failed: CUDA_ERROR_OUT_OF_MEMORY")
    assert lines[1].startswith("ERR 2 dcpx: cuStreamCreate failed: CUDA_ERROR_OUT_OF_MEMORY")
    assert lines[2] == "OK True"
    r = _fresh("""
        try:
            _C.cuda_driver_version()
        except _C.CudaError as e:
            print("ERR", e.code, e)
    """, {"DCPX_LIBCUDA": str(standin_path), "FAKE_CUDA_DEVICES": "0"})
    assert "ERR 100 dcpx: cuInit failed: CUDA_ERROR_NO_DEVICE" in r.stdout, r.stdout + r.stderr


# --------------------------------------------------------------------------
# the build

def _toolkit_include():
    import glob
    for root in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda",
                 *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]:
        if root and os.path.isfile(os.path.join(root, "include", "cuda.h")):
            return os.path.join(root, "include")
    return None


@pytest.mark.skipif(_toolkit_include() is None, reason="no CUDA Toolkit cuda.h on this machine")
def test_cuda_min_h_matches_the_toolkit(tmp_path):
    """csrc/cuda_min.h (the build's fallback without a Toolkit) declares
    exactly what cuda.h declares: C11 accepts a repeated identical typedef
    and a compatible prototype, and rejects anything else."""
    check = tmp_path / "check.c"
    check.write_text(textwrap.dedent("""
        #include <cuda.h>
        #define DCPX_CUDA_MIN_CHECK
        #include "cuda_min.h"
        _Static_assert(CUDA_ERROR_INVALID_VALUE == 1, "");
        _Static_assert(CUDA_ERROR_OUT_OF_MEMORY == 2, "");
        _Static_assert(CUDA_ERROR_NOT_INITIALIZED == 3, "");
        _Static_assert(CUDA_ERROR_NO_DEVICE == 100, "");
        _Static_assert(CUDA_ERROR_INVALID_DEVICE == 101, "");
        _Static_assert(CUDA_ERROR_NOT_READY == 600, "");
        _Static_assert(CUDA_ERROR_NOT_SUPPORTED == 801, "");
        _Static_assert(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED == 712, "");
        _Static_assert(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED == 713, "");
        _Static_assert(CU_STREAM_NON_BLOCKING == 0x1, "");
        _Static_assert(CU_EVENT_DISABLE_TIMING == 0x2, "");
        _Static_assert(CU_MEMHOSTREGISTER_PORTABLE == 0x01, "");
    """))
    min_src = (REPO / "csrc" / "cuda_min.h").read_text()
    # The same enum values, as cuda_min.h spells them for a build without cuda.h.
    for name, value in [("CUDA_SUCCESS", 0), ("CUDA_ERROR_INVALID_VALUE", 1),
                        ("CUDA_ERROR_NOT_READY", 600)]:
        assert f"{name} = {value}," in min_src
    r = subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", "-fsyntax-only",
                        "-I", _toolkit_include(), "-I", str(REPO / "csrc"), str(check)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------
# dcpx.staging's CUDA path over the C one.  torch here has no CUDA, so the
# sources are the stand-in's tensors behind the few torch.Tensor methods the
# stager calls, and torch.cuda.current_stream is the producer's stream.

class _TorchLike:
    dtype = torch.uint8

    def __init__(self, t: FakeCudaTensor) -> None:
        self.t = t
        self.device = torch.device("cuda", t.device.dev)

    def detach(self):
        return self

    def is_conj(self):
        return False

    def is_neg(self):
        return False

    def is_contiguous(self):
        return True

    def untyped_storage(self):
        from types import SimpleNamespace
        return SimpleNamespace(data_ptr=lambda: self.t.alloc)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, **kw):
        return self.t.__dlpack__(**kw)


@pytest.fixture
def stager_cuda(lib, monkeypatch):
    from types import SimpleNamespace

    from dcpx import staging
    monkeypatch.setattr(staging, "_TO_DLPACK", None)  # torch's exporter needs real tensors
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda dev: SimpleNamespace(cuda_stream=lib.devices[dev.index].stream))
    return staging


def test_the_stagers_buffer_is_pinned_by_the_c_path_and_unpinned_on_release(stager_cuda, lib):
    registered = lib.fake_registered()
    b = stager_cuda._Buffer(100_000, shared=True, pin=True)
    assert b.pinned is True and lib.fake_registered() == registered + 1
    b.release()
    assert lib.fake_registered() == registered
    lib.fake_fail(b"cuMemHostRegister_v2", 1, OUT_OF_MEMORY)
    with pytest.warns(RuntimeWarning, match="staging into pageable memory"):
        b = stager_cuda._Buffer(4096, shared=False, pin=True)
    assert b.pinned is False
    b.release()


def test_the_stager_copies_after_the_current_streams_and_names_a_failing_key(stager_cuda, lib):
    lib.fake_set_delay(b"fill", 20_000)
    # Producers that ignore __dlpack__'s stream: only the event the stager
    # records on each device's current stream orders the copies.
    ts = [FakeCudaTensor(lib.devices[i % 2], 3000 + i, honour_stream=False) for i in range(4)]
    offs, total = _layout([t.nbytes for t in ts])
    b = stager_cuda._Buffer(total, shared=True, pin=True)
    pairs = [(_TorchLike(t), o, f"model.w{i}") for i, (t, o) in enumerate(zip(ts, offs))]
    for rnd in range(5):
        for i, t in enumerate(ts):
            t.launch_fill(rnd * 8 + i)
        stager_cuda.DefaultStager._copy_from_devices(pairs, b.base)
        raw = b.base.numpy().tobytes()
        for i, (t, o) in enumerate(zip(ts, offs)):
            assert raw[o:o + t.nbytes] == bytes([rnd * 8 + i]) * t.nbytes
    assert lib.fake_violations() == 0
    lib.fake_fail(b"cuMemcpyDtoHAsync_v2", 3, INVALID_VALUE)
    with pytest.raises(_C.CudaError, match="cuMemcpyDtoHAsync for tensor 'model.w1' on device 1"):
        stager_cuda.DefaultStager._copy_from_devices(pairs, b.base)
    assert lib.fake_copies_run() == lib.fake_copies_queued()
    b.release()
    for t in ts:
        t.free()


def test_the_stager_merges_copies_within_one_storage_only(stager_cuda, lib):
    """The stager keys each copy by its tensor's storage: views of one
    storage (a flat parameter's views) adjacent in the buffer are one copy;
    tensors of two allocations adjacent on the device and in the buffer
    are one copy each (one spanning both is refused), waiting or in
    segments."""
    whole = FakeCudaTensor(lib.devices[0], 640)
    whole.write(_rand(640, 11))
    views = [FakeCudaTensor(lib.devices[0], 64, base=whole, offset=64 * i) for i in range(10)]
    b = stager_cuda._Buffer(640, shared=False, pin=True)
    stager_cuda.DefaultStager._copy_from_devices(
        [(_TorchLike(v), 64 * i, f"p{i}") for i, v in enumerate(views)], b.base)
    assert b.base.numpy().tobytes()[:640] == whole.read()
    assert lib.fake_calls(b"cuMemcpyDtoHAsync_v2") == 1
    b.release()
    whole.free()
    ts = FakeCudaTensor.adjacent(lib.devices[1], [4096, 4096, 4096])
    assert ts[1].ptr == ts[0].ptr + 4096 and ts[2].ptr == ts[1].ptr + 4096
    b = stager_cuda._Buffer(3 * 4096, shared=False, pin=True)
    pairs = [(_TorchLike(t), 4096 * i, f"w{i}") for i, t in enumerate(ts)]
    for rnd, on_queued in enumerate([None, lambda gate: None]):
        lib.fake_reset()
        data = [_rand(4096, 20 + 3 * rnd + i) for i in range(3)]
        for t, d in zip(ts, data):
            t.write(d)
        stager_cuda.DefaultStager._copy_from_devices(pairs, b.base, None, on_queued)
        assert b.base.numpy().tobytes()[:3 * 4096] == b"".join(data), rnd
        assert lib.fake_calls(b"cuMemcpyDtoHAsync_v2") == 3
    b.release()
    for t in ts:
        t.free()


def test_cpu_staging_and_saving_make_no_driver_call(lib, tmp_path):
    """The CPU path is untouched: with the driver loaded, staging and
    saving host tensors call nothing in it."""
    import dcpx
    sd = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 3)}
    calls = lib.fake_total_calls()
    with dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=False)) as stager:
        staged = stager.stage(sd)
        dcpx.save(staged, checkpoint_id=str(tmp_path / "ckpt"))
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    dcpx.load(out, checkpoint_id=str(tmp_path / "ckpt"))
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    assert lib.fake_total_calls() == calls


@pytest.mark.parametrize("with_toolkit", [False, True], ids=["cuda_min.h", "cuda.h"])
def test_the_cuda_sources_compile_with_and_without_the_toolkit(with_toolkit):
    """setup.py uses cuda.h wherever a Toolkit is installed (CI), so the
    cuda_min.h build would otherwise never be compiled there."""
    import sysconfig
    if with_toolkit and _toolkit_include() is None:
        pytest.skip("no CUDA Toolkit cuda.h on this machine")
    flags = ["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
             "-I", sysconfig.get_paths()["include"]]
    if with_toolkit:
        flags += ["-DDCPX_HAVE_CUDA_H", "-I", _toolkit_include()]
    for src in ("cuda.c", "cuda_copy.c", "cuda_stage.c", "cuda_load.c", "cuda_pipeline.c",
                "gate.c", "module.c"):
        r = subprocess.run(["cc", *flags, str(REPO / "csrc" / src)], capture_output=True, text=True)
        assert r.returncode == 0, (src, r.stderr)


# --------------------------------------------------------------------------
# loads: host-to-device copies (csrc/cuda_load.c) and FileSystemReader's
# reads into CUDA tensors over them

def _host(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8) if len(data) < 64 else \
        torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _consumers(lib):
    return [(d.dev, d.stream) for d in lib.devices]


@pytest.mark.parametrize("bits", [8, 16, 32, 64])
def test_host_to_device_copies_are_bit_exact_across_devices_and_dtypes(lib, bits):
    sizes = [0, 1, 7, 64, 4096, 100_003]
    ts, want = [], []
    for i, n in enumerate(sizes):
        t = FakeCudaTensor(lib.devices[i % 2], shape=(n,), bits=bits)
        t.write(b"\xee" * t.nbytes)
        ts.append(t)
        want.append(_rand(t.nbytes, 50 + i + bits))
    pairs = [(t, _host(w), f"t{i}") for i, (t, w) in enumerate(zip(ts, want))]
    _C.cuda_copy_from_host(pairs, consumer_streams=_consumers(lib))
    assert [t.read() for t in ts] == want
    assert lib.fake_calls(b"cuMemcpyHtoDAsync_v2") == len(sizes) - 1  # not the empty one
    assert lib.fake_copies_run() == lib.fake_copies_queued() == len(sizes) - 1
    assert lib.fake_violations() == 0
    # A capsule as the destination (the loader hands torch's own exports).
    _C.cuda_copy_from_host([(ts[3].capsule(), _host(want[3][::-1]), "c")])
    assert ts[3].read() == want[3][::-1]
    for t in ts:
        t.free()


def test_the_load_runs_after_the_consumers_pending_kernels_and_before_its_later_ones(lib):
    """The caller's stream has a slow kernel writing the destination and
    one reading it, queued before the load: the copy must wait for both
    (the reader sees the old bytes, the loaded bytes are not overwritten);
    a reader queued after the call sees the new bytes.  Without the
    consumer streams, the stand-in shows the copy racing the kernels."""
    lib.fake_set_delay(b"fill", 20_000)
    dev = lib.devices[0]
    t = FakeCudaTensor(dev, 1 << 16)
    for rnd in range(4):
        new = _rand(t.nbytes, rnd)
        seen_before = ctypes.create_string_buffer(t.nbytes)
        seen_after = ctypes.create_string_buffer(t.nbytes)
        t.launch_fill(rnd + 1)              # e.g. the optimizer's last step
        t.launch_read(seen_before)          # e.g. a forward pass still running
        _C.cuda_copy_from_host([(t, _host(new), "w")], consumer_streams=[(0, dev.stream)])
        t.launch_read(seen_after)
        dev.synchronize()
        assert t.read() == new
        assert seen_before.raw == bytes([rnd + 1]) * t.nbytes
        assert seen_after.raw == new
    assert lib.fake_violations() == 0
    t.free()


_TSAN_SKIP = pytest.mark.skipif(os.environ.get("DCPX_SANITIZE") == "thread",
                                reason="a deliberate race (kernel and copy on one buffer), "
                                       "which TSan reports")


@_TSAN_SKIP
def test_the_load_ordering_check_catches_a_load_without_the_consumer_stream(lib):
    """Control for the test above: without the consumer stream the copy
    overtakes the pending kernel (a violation), and the slow kernel then
    overwrites the load."""
    lib.fake_set_delay(b"fill", 300_000)
    dev = lib.devices[0]
    t = FakeCudaTensor(dev, 4096)
    t.launch_fill(0x77)
    _C.cuda_copy_from_host([(t, _host(_rand(t.nbytes, 9)), "w")])
    dev.synchronize()
    assert lib.fake_violations() >= 1
    assert t.read() == b"\x77" * t.nbytes
    t.free()


@_TSAN_SKIP
def test_a_consumer_kernel_reading_before_a_copy_finished_is_counted(lib):
    """The stand-in's new check itself: a reading kernel on another stream
    while a host-to-device copy into its memory is still queued."""
    lib.fake_set_delay(b"copy", 300_000)
    dev = lib.devices[0]
    t = FakeCudaTensor(dev, 4096)
    src = ctypes.create_string_buffer(b"\x05" * 4096, 4096)
    out = ctypes.create_string_buffer(4096)
    other = ctypes.c_void_p()
    dev.enter()
    assert lib.cuStreamCreate(ctypes.byref(other), 1) == 0
    assert lib.cuMemcpyHtoDAsync_v2(t.ptr, src, 4096, other.value) == 0
    t.launch_read(out)  # on the device's stream, not ordered after the copy
    dev.synchronize()
    lib.cuStreamSynchronize(other.value)
    assert lib.fake_violations() == 1
    lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
    assert lib.cuStreamDestroy_v2(other.value) == 0
    t.free()


LOAD_FAILURES = [
    # (entry point, nth call, code, what the message names)
    ("cuMemcpyHtoDAsync_v2", 2, INVALID_VALUE, "cuMemcpyHtoDAsync for tensor 'b' on device 0"),
    ("cuMemcpyHtoDAsync_v2", 4, OUT_OF_MEMORY, "cuMemcpyHtoDAsync for tensor 'd' on device 1"),
    ("cuEventRecord", 1, INVALID_VALUE, "cuEventRecord on the consumer's stream on device 0"),
    ("cuEventRecord", 3, INVALID_VALUE, "cuEventRecord for tensor 'c' on device 0"),
    ("cuStreamWaitEvent", 1, INVALID_VALUE, "cuStreamWaitEvent on device 0"),
    ("cuStreamWaitEvent", 3, INVALID_VALUE,
     "cuStreamWaitEvent on the consumer's stream for tensor 'c' on device 0"),
    ("cuEventSynchronize", 1, ILLEGAL_ADDRESS, "cuEventSynchronize (host-to-device copies) on "
                                               "device 0"),
    ("cuEventCreate", 2, OUT_OF_MEMORY, "cuEventCreate on device 0"),
    ("cuCtxSetCurrent", 1, INVALID_CONTEXT, "cuCtxSetCurrent on device 0"),
    ("cuCtxSetCurrent", 9, INVALID_CONTEXT, "cuCtxSetCurrent for tensor 'a' on device 0"),
    ("cuCtxSetCurrent", 10, INVALID_CONTEXT, "cuCtxSetCurrent for tensor 'd' on device 1"),
]


@pytest.mark.parametrize("call,nth,code,names", LOAD_FAILURES,
                         ids=[f"{f[0]}-{f[1]}" for f in LOAD_FAILURES])
def test_every_injected_load_failure_raises_clearly_and_leaves_nothing_in_flight(
        lib, call, nth, code, names):
    ts = [FakeCudaTensor(lib.devices[0], 5000 + i) for i in range(3)]
    ts.append(FakeCudaTensor(lib.devices[1], 777))
    data = [_rand(t.nbytes, 70 + i) for i, t in enumerate(ts)]
    pairs = [(t.capsule(), _host(d), k) for t, d, k in zip(ts, data, "abcd")]
    lib.fake_set_delay(b"copy", 2_000)
    lib.fake_fail(call.encode(), nth, code)
    with pytest.raises(_C.CudaError) as ei:
        _C.cuda_copy_from_host(pairs, consumer_streams=_consumers(lib))
    assert ei.value.code == code
    msg = str(ei.value)
    assert names in msg and call.removesuffix("_v2") in msg, msg
    # Nothing still reads the host buffers once the call has failed.
    assert lib.fake_copies_run() == lib.fake_copies_queued()
    # The next load works.
    lib.fake_reset()
    _C.cuda_copy_from_host([(t, _host(d), k) for t, d, k in zip(ts, data, "abcd")],
                           consumer_streams=_consumers(lib))
    assert [t.read() for t in ts] == data
    for t in ts:
        t.free()


def test_an_asynchronous_load_failure_is_reported_by_the_wait(lib):
    ts = [FakeCudaTensor(lib.devices[0], 4096) for _ in range(3)]
    lib.fake_fail_async(2, ILLEGAL_ADDRESS)
    with pytest.raises(_C.CudaError, match="cuEventSynchronize .*CUDA_ERROR_ILLEGAL_ADDRESS") as ei:
        _C.cuda_copy_from_host([(t, _host(bytes(4096)), f"k{i}") for i, t in enumerate(ts)])
    assert ei.value.code == ILLEGAL_ADDRESS
    assert lib.fake_copies_run() == lib.fake_copies_queued()
    for t in ts:
        t.free()


@pytest.mark.parametrize("case", ["host_dst", "size", "cuda_src", "noncontig", "bad_device"])
def test_bad_load_pairs_are_refused_before_any_copy(lib, case):
    t = FakeCudaTensor(lib.devices[0], 64)
    src = _host(bytes(64))
    if case == "host_dst":
        pairs, match = [(t, src, "w"), (torch.zeros(64, dtype=torch.uint8), src, "h")], \
            "tensor 'h' is not on a CUDA device"
    elif case == "size":
        pairs, match = [(t, _host(bytes(65)), "w")], "'w' has a source of a different byte size"
    elif case == "cuda_src":
        pairs, match = [(t, FakeCudaTensor(lib.devices[0], 64), "w")], "not contiguous host"
    elif case == "noncontig":
        nc = FakeCudaTensor(lib.devices[0], shape=(4, 4), bits=32, strides=(1, 4))
        pairs, match = [(nc, src, "w")], "'w' is not contiguous"
    else:  # a consumer stream on a device the process cannot see
        with pytest.raises(_C.CudaError, match="CUDA device 5, but this process sees 2"):
            _C.cuda_copy_from_host([(t, src, "w")], consumer_streams=[(5, 0)])
        assert lib.fake_copies_queued() == 0
        t.free()
        return
    with pytest.raises(ValueError, match=match):
        _C.cuda_copy_from_host(pairs)
    assert lib.fake_copies_queued() == 0
    t.free()


class _CudaTarget(_TorchLike):
    """A stand-in tensor as FileSystemReader sees a CUDA destination."""

    def __init__(self, t: FakeCudaTensor, dtype: torch.dtype, shape) -> None:
        super().__init__(t)
        self.dtype, self.shape = dtype, torch.Size(shape)


@pytest.fixture
def reader_cuda(lib, monkeypatch):
    """dcpx.storage.reader with a small page-locked load ring (4 slots of 16 KiB,
    so that loads take several slots and one chunk is read in pieces) and
    the stand-in's device streams as torch's current streams."""
    from types import SimpleNamespace

    from dcpx.storage import reader as filesystem
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda dev: SimpleNamespace(cuda_stream=lib.devices[dev.index].stream))
    monkeypatch.setattr(filesystem, "_PINNED_LOAD", 65536)
    monkeypatch.setattr(filesystem, "_SLOT", 16384)
    monkeypatch.setattr(filesystem, "_pinned_buffer", None)
    yield filesystem
    if filesystem._pinned_buffer is not None:
        _C.cuda_host_unregister(filesystem._pinned_buffer)


def _saved(tmp_path):
    import dcpx
    g = torch.Generator().manual_seed(3)
    sd = {"emb": torch.randn(40, 30, generator=g),                   # 4800 B
          "w": torch.randn(1000, generator=g, dtype=torch.float64),  # 8000 B
          "big": torch.randint(0, 255, (20000,), dtype=torch.uint8, generator=g),  # > a slot
          "h": torch.randn(7, 3, generator=g).to(torch.bfloat16),
          "empty": torch.empty(0, 5),
          "b": torch.tensor([True, False, True])}
    dcpx.save(sd, checkpoint_id=str(tmp_path / "ckpt"))
    return sd, tmp_path / "ckpt"


def _reads(filesystem, path, lib, sd, devs=(0, 1)):
    import dcpx
    reader = dcpx.FileSystemReader(str(path))
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    infos = {k.fqn: v for k, v in md.storage_data.items()}
    reads, targets = [], {}
    for i, (key, v) in enumerate(sd.items()):
        ft = FakeCudaTensor(lib.devices[devs[i % len(devs)]], v.numel() * v.element_size())
        ft.write(b"\xab" * ft.nbytes)
        targets[key] = ft
        reads.append(filesystem._TensorRead(key, infos[key], v.shape, v.dtype,
                                            _CudaTarget(ft, v.dtype, v.shape), None))
    return reader, reads, targets


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_loads_into_cuda_tensors_go_through_one_reused_pinned_buffer(reader_cuda, lib, tmp_path):
    """FileSystemReader.read_tensors: CUDA destinations of the saved dtype
    and shape are read into the page-locked load ring and copied to the
    device by the C pipeline, bit exact, ordered after the current streams'
    pending kernels; the ring is pinned once and reused by every load, and
    a chunk larger than a slot is read and copied in pieces."""
    sd, path = _saved(tmp_path)
    lib.fake_set_delay(b"fill", 10_000)
    registered = lib.fake_registered()
    for rnd in range(3):
        reader, reads, targets = _reads(reader_cuda, path, lib, sd)
        for ft in targets.values():
            if ft.nbytes:
                ft.launch_fill(0x10 + rnd)  # pending work on the caller's stream
        reader.read_tensors(reads)
        for key, v in sd.items():
            assert targets[key].read() == _raw(v), key
            targets[key].free()
    assert lib.fake_violations() == 0
    assert lib.fake_calls(b"cuMemHostRegister_v2") == 1
    assert lib.fake_registered() == registered + 1
    assert reader_cuda._pinned_buffer.numel() == 65536
    # 5 non-empty tensors a round: each copied once from its slot, "big"
    # (20,000 bytes) in two pieces of a 16 KiB slot.
    assert lib.fake_calls(b"cuMemcpyHtoDAsync_v2") == 3 * 6
    assert reader.cuda_load_stats["pipeline"] == 6
    assert reader.cuda_load_stats["pipeline_stats"]["pieces"] == 2
    assert lib.fake_reuse_violations() == 0


def test_a_load_failure_names_the_key_and_the_next_load_works(reader_cuda, lib, tmp_path):
    sd, path = _saved(tmp_path)
    reader, reads, targets = _reads(reader_cuda, path, lib, sd, devs=(0,))
    reader._pipeline_threads = 1  # copies in file order: "emb", "w", "big" ...
    lib.fake_fail(b"cuMemcpyHtoDAsync_v2", 2, OUT_OF_MEMORY)
    with pytest.raises(_C.CudaError, match="cuMemcpyHtoDAsync for tensor 'w' on device 0"):
        reader.read_tensors(reads)
    assert lib.fake_copies_run() == lib.fake_copies_queued()
    lib.fake_reset()
    reader.read_tensors(reads)
    for key, v in sd.items():
        assert targets[key].read() == _raw(v), key
        targets[key].free()


def test_a_corrupt_record_loading_into_cuda_is_named_and_nothing_copied(reader_cuda, lib,
                                                                         tmp_path):
    from dcpx.errors import CorruptCheckpointError
    sd, path = _saved(tmp_path)
    reader, reads, targets = _reads(reader_cuda, path, lib, sd)
    r = next(r for r in reads if r.key == "w")
    f = path / r.info.relative_path
    raw = bytearray(f.read_bytes())
    at = raw.find(_raw(sd["w"]), r.info.offset)
    assert r.info.offset < at < r.info.offset + r.info.length
    raw[at + 100] ^= 0xFF  # inside w's tensor bytes
    f.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        reader.read_tensors([r])
    assert lib.fake_copies_queued() == 0
    assert targets["w"].read() == b"\xab" * targets["w"].nbytes
    for ft in targets.values():
        ft.free()


def test_asynchronous_staging_orders_after_the_callers_stream_not_the_stage_threads(
        stager_cuda, lib, monkeypatch):
    """With use_async_staging the copies run on the dcpx-stage thread,
    whose current stream is not the caller's: stage() takes the caller's
    current stream and the copies wait for it."""
    import dcpx
    main = threading.get_ident()
    dev = lib.devices[0]
    idle = ctypes.c_void_p()  # the stage thread's "current stream": nothing queued
    dev.enter()
    assert lib.cuStreamCreate(ctypes.byref(idle), 1) == 0
    from types import SimpleNamespace
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: SimpleNamespace(
        cuda_stream=lib.devices[0].stream if threading.get_ident() == main else idle.value))
    lib.fake_set_delay(b"fill", 20_000)
    ts = [FakeCudaTensor(dev, 3000 + i, honour_stream=False) for i in range(3)]
    offs, total = _layout([t.nbytes for t in ts])
    b = stager_cuda._Buffer(total, shared=False, pin=True)
    pairs = [(_TorchLike(t), o, f"w{i}") for i, (t, o) in enumerate(zip(ts, offs))]
    seen = []

    def stage_flat(state_dict, flat, mappings, streams=None, early=None):
        seen.append(streams)
        stager_cuda.DefaultStager._copy_from_devices(pairs, b.base, streams)
        return state_dict

    with dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True)) as stager:
        stager._cuda = True
        monkeypatch.setattr(stager, "_stage_flat", stage_flat)
        for rnd in range(3):
            for i, t in enumerate(ts):
                t.launch_fill(0x20 + rnd * 4 + i)
            stager.stage({"x": 1}).result()
            raw = b.base.numpy().tobytes()
            for i, (t, o) in enumerate(zip(ts, offs)):
                assert raw[o:o + t.nbytes] == bytes([0x20 + rnd * 4 + i]) * t.nbytes
    assert seen == [{0: dev.stream}] * 3
    assert lib.fake_violations() == 0
    b.release()
    lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
    assert lib.cuStreamDestroy_v2(idle.value) == 0
    for t in ts:
        t.free()


def test_a_load_buffer_that_cannot_be_pinned_warns_and_loads_through_pageable_memory(
        reader_cuda, lib, tmp_path):
    sd, path = _saved(tmp_path)
    reader, reads, targets = _reads(reader_cuda, path, lib, sd)
    registered = lib.fake_registered()
    lib.fake_fail(b"cuMemHostRegister_v2", 1, OUT_OF_MEMORY)
    with pytest.warns(RuntimeWarning, match="cannot page-lock"):
        reader.read_tensors(reads)
    assert lib.fake_registered() == registered
    for key, v in sd.items():
        assert targets[key].read() == _raw(v), key
        targets[key].free()


def test_loads_into_cuda_tensors_from_several_threads_at_once(reader_cuda, lib, tmp_path):
    """Each thread's load is bit exact; they take turns on the one buffer."""
    sd, path = _saved(tmp_path)
    errors = []

    def worker(n):
        try:
            for _ in range(3):
                reader, reads, targets = _reads(reader_cuda, path, lib, sd, devs=(n % 2,))
                reader.read_tensors(reads)
                for key, v in sd.items():
                    assert targets[key].read() == _raw(v), key
                    targets[key].free()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert lib.fake_violations() == 0
    assert lib.fake_calls(b"cuMemHostRegister_v2") == 1


# --------------------------------------------------------------------------
# loads: reading the next part while the previous part's copies run

def test_a_pending_load_is_waited_for_once_and_a_dropped_one_still_waits(lib):
    """cuda_copy_from_host(..., wait=False) returns with the copies queued;
    cuda_wait waits (a second call returns at once); a handle dropped
    without cuda_wait still waits for its copies before the sources go."""
    lib.fake_hold_copies(1)
    ts = [FakeCudaTensor(lib.devices[i % 2], 3000 + i) for i in range(3)]
    data = [_rand(t.nbytes, 200 + i) for i, t in enumerate(ts)]
    p = _C.cuda_copy_from_host([(t, _host(d), f"k{i}") for i, (t, d) in enumerate(zip(ts, data))],
                               consumer_streams=_consumers(lib), wait=False)
    assert lib.fake_copies_queued() == 3 and lib.fake_copies_run() == 0
    lib.fake_hold_copies(0)
    _C.cuda_wait(p)
    assert lib.fake_copies_run() == 3 and [t.read() for t in ts] == data
    _C.cuda_wait(p)  # idempotent
    lib.fake_set_delay(b"copy", 20_000)
    p = _C.cuda_copy_from_host([(ts[0], _host(data[1][:3000]), "x")], wait=False)
    del p
    assert lib.fake_copies_run() == lib.fake_copies_queued() == 4
    assert ts[0].read() == data[1][:3000]
    with pytest.raises(ValueError):
        _C.cuda_wait(object.__new__(object))
    for t in ts:
        t.free()


# --------------------------------------------------------------------------
# saves: writer threads start on each segment of the staging buffer as its
# device-to-host copies complete (csrc/gate.c, cuda_copy_into(wait=False))

def _wait_for(cond, what: str) -> None:
    """Block until cond() (a state the code under test must reach; the
    bound only keeps a broken build from hanging the suite)."""
    import time
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.001)


def _gated_job(tmp_path, buf, offs, sizes, gate, keys):
    from dcpx.formats.dtypes import dlpack_export, dlpack_view
    files = []
    for k, o, n in zip(keys, offs, sizes):
        item = (dlpack_export(dlpack_view(buf[o:o + n])), "ByteStorage", gate)
        files.append((str(tmp_path / f"{k}.bin"), [item]))
    return _C.WriteJob(files, sync_files=False, threads=1)


def test_writers_start_on_each_segment_as_its_copies_complete(lib, tmp_path):
    """Segments of 8 KiB (two 4 KiB tensors each); the stand-in lets only
    the first segment's copies run.  The writer writes the first segment's
    files and waits at the second while the staging is still unfinished;
    once the copies are released, everything is written bit exact."""
    # Back to back on the device and in the buffer, but pairs without an
    # allocation key: one copy each.
    ts = FakeCudaTensor.adjacent(lib.devices[0], [4096] * 6)
    data = [_rand(4096, 300 + i) for i in range(6)]
    for t, d in zip(ts, data):
        t.write(d)
    offs, keys = [4096 * i for i in range(6)], [f"k{i}" for i in range(6)]
    buf = _buffer(6 * 4096)
    lib.fake_hold_after(2)
    gate, pending = _C.cuda_copy_into([(t, o, k) for t, o, k in zip(ts, offs, keys)], buf,
                                      wait=False, segment_bytes=8192)
    waiter = threading.Thread(target=_C.cuda_stage_wait, args=(pending,))
    waiter.start()
    job = _gated_job(tmp_path, buf, offs, [4096] * 6, gate, keys)
    job.start()
    try:
        # Segment 1 published and a writer blocked on bytes past it: the
        # writer may first wait at segment 1, before it is published.
        _wait_for(lambda: _C.gate_stats(gate)[0] == 2 * 4096 and _C.gate_stats(gate)[2] == 1,
                  "the writer waiting at segment 2")
        assert _C.gate_stats(gate) == (2 * 4096, 0, 1)
        assert waiter.is_alive() and lib.fake_copies_run() == 2
        for k, d in zip(keys[:2], data[:2]):
            assert d in (tmp_path / f"{k}.bin").read_bytes(), k
        assert not (tmp_path / "k3.bin").exists()
    finally:
        lib.fake_hold_copies(0)
        waiter.join()
        job.wait()
    assert _C.gate_stats(gate) == (6 * 4096, 0, 0)
    for k, d in zip(keys, data):
        assert d in (tmp_path / f"{k}.bin").read_bytes(), k
    assert lib.fake_copies_run() == lib.fake_copies_queued() == 6
    _C.cuda_stage_wait(pending)  # idempotent
    for t in ts:
        t.free()


def test_a_failed_segment_fails_its_writers_and_names_its_keys(lib, tmp_path):
    ts = FakeCudaTensor.adjacent(lib.devices[0], [4096] * 6)  # no keys: one copy each
    offs, keys = [4096 * i for i in range(6)], [f"k{i}" for i in range(6)]
    buf = _buffer(6 * 4096)
    # Segment 2's first copy fails, once segment 1 is published (an
    # asynchronous error is sticky: a wait after it fails, whichever
    # copies it covers).
    lib.fake_hold_after(2)
    lib.fake_fail_async(3, ILLEGAL_ADDRESS)
    gate, pending = _C.cuda_copy_into([(t, o, k) for t, o, k in zip(ts, offs, keys)], buf,
                                      wait=False, segment_bytes=8192)
    errors = []

    def wait():
        try:
            _C.cuda_stage_wait(pending)
        except _C.CudaError as e:
            errors.append(e)
    waiter = threading.Thread(target=wait)
    waiter.start()
    job = _gated_job(tmp_path, buf, offs, [4096] * 6, gate, keys)
    job.start()
    _wait_for(lambda: _C.gate_stats(gate)[0] == 2 * 4096, "segment 1 published")
    lib.fake_hold_copies(0)
    waiter.join()
    assert len(errors) == 1 and errors[0].code == ILLEGAL_ADDRESS
    assert "on device 0 (tensors 'k2', 'k3') failed: CUDA_ERROR_ILLEGAL_ADDRESS" in str(errors[0])
    with pytest.raises(OSError, match="wait for the staging copies"):
        job.wait()
    assert _C.gate_stats(gate) == (2 * 4096, 1, 0)
    assert lib.fake_copies_run() == lib.fake_copies_queued()
    # A dropped pending handle still waits for its copies.
    lib.fake_reset()
    lib.fake_set_delay(b"copy", 2_000)
    gate, pending = _C.cuda_copy_into([(t, o, k) for t, o, k in zip(ts, offs, keys)], buf,
                                      wait=False, segment_bytes=8192)
    del pending
    assert lib.fake_copies_run() == lib.fake_copies_queued() == 6
    assert _C.gate_stats(gate)[:2] == (6 * 4096, 0)
    for t in ts:
        t.free()


def _overlap_stager(stager_cuda, stager, ts, gates):
    """The stager's _stage_flat for host-shaped state dicts whose bytes are
    the stand-in tensors `ts` (torch here has no CUDA): the real layout and
    the real CUDA staging path, with the gate it hands the upload kept."""
    def stage_flat(state_dict, flat, mappings, streams=None, early=None):
        with stager._lock:
            if stager._layout is None:
                stager._layout = stager_cuda._Layout(state_dict, flat, mappings, False, True)
            layout = stager._layout
            pairs = [(_TorchLike(ts[int(k[1:])]), layout.offsets[k], k) for k in flat]
            # this stage's staged dict (a new one each stage: staging._fresh)
            staged = stager._returned = stager_cuda._fresh(layout.tree, layout.flat)
            tell = stager_cuda._set_queued(early, staged, pairs)

            def on_queued(gate):
                gates.append(gate)
                tell(gate)
            stager_cuda.DefaultStager._copy_from_devices(pairs, layout.buffer.base, streams,
                                                         on_queued)
            return staged
    return stage_flat


def _use_overlap_stager(monkeypatch, stager_cuda, stager, ts, gates):
    """Every stage through _overlap_stager: also a flat state dict of the
    last layout, which the stager would otherwise stage without calling
    _stage_flat (staging._flat_as_is), as the plain CPU tensors it holds
    here (the stand-in's CUDA tensors are swapped in by _overlap_stager)."""
    monkeypatch.setattr(stager, "_stage_flat", _overlap_stager(stager_cuda, stager, ts, gates))
    monkeypatch.setattr(stager_cuda, "_flat_as_is", lambda layout, state_dict: False)


def test_async_save_writes_while_the_later_segments_still_copy(stager_cuda, lib, tmp_path,
                                                                monkeypatch):
    """async_save with asynchronous staging of CUDA tensors: the upload's
    writers start on the first segment while the second is held back, so
    neither staging_completion nor the upload is done; released, the
    checkpoint loads bit exact.  Twice, reusing the stager's buffer."""
    import dcpx
    monkeypatch.setattr(stager_cuda, "_SEGMENT", 8192)  # two tensors a segment
    # Back to back on the device and in the buffer, each its own
    # allocation (key): one copy each.
    ts = FakeCudaTensor.adjacent(lib.devices[0], [4096] * 6)
    sd = {f"w{i}": torch.zeros(4096, dtype=torch.uint8) for i in range(6)}
    gates: list = []
    with dcpx.DefaultStager(dcpx.StagingOptions(True, False, True, True)) as stager:
        stager._cuda = True
        _use_overlap_stager(monkeypatch, stager_cuda, stager, ts, gates)
        for rnd in range(2):
            data = [_rand(4096, 400 + 10 * rnd + i) for i in range(6)]
            for t, d in zip(ts, data):
                t.write(d)
            path = tmp_path / f"ckpt{rnd}"
            lib.fake_hold_after(2)
            resp = dcpx.async_save(sd, checkpoint_id=str(path), async_stager=stager)
            try:
                _wait_for(lambda: len(gates) > rnd and _C.gate_stats(gates[rnd])[0] == 2 * 4096
                          and _C.gate_stats(gates[rnd])[2] >= 1,
                          "a writer waiting at segment 2")
                assert _C.gate_stats(gates[rnd])[:2] == (2 * 4096, 0)
                assert not resp.staging_completion.done()
                assert not resp.upload_completion.done()
            finally:
                lib.fake_hold_copies(0)
            resp.upload_completion.result(timeout=60)
            assert resp.staging_completion.done()
            out = {k: torch.zeros_like(v) for k, v in sd.items()}
            dcpx.load(out, checkpoint_id=str(path))
            for i in range(6):
                assert out[f"w{i}"].numpy().tobytes() == data[i], i
    assert lib.fake_violations() == 0
    for t in ts:
        t.free()


def test_async_save_with_a_failed_copy_commits_nothing_and_names_the_key(stager_cuda, lib,
                                                                         tmp_path, monkeypatch):
    import dcpx
    monkeypatch.setattr(stager_cuda, "_SEGMENT", 8192)  # two tensors a segment
    # Back to back on the device and in the buffer, each its own
    # allocation (key): one copy each.
    ts = FakeCudaTensor.adjacent(lib.devices[0], [4096] * 6)
    data = [_rand(4096, 500 + i) for i in range(6)]
    for t, d in zip(ts, data):
        t.write(d)
    sd = {f"w{i}": torch.zeros(4096, dtype=torch.uint8) for i in range(6)}
    gates: list = []
    with dcpx.DefaultStager(dcpx.StagingOptions(True, False, True, True)) as stager:
        stager._cuda = True
        _use_overlap_stager(monkeypatch, stager_cuda, stager, ts, gates)
        lib.fake_hold_after(2)
        lib.fake_fail_async(3, ILLEGAL_ADDRESS)  # once segment 1 is published
        resp = dcpx.async_save(sd, checkpoint_id=str(tmp_path / "bad"), async_stager=stager)
        _wait_for(lambda: gates and _C.gate_stats(gates[0])[0] == 2 * 4096, "segment 1 published")
        lib.fake_hold_copies(0)
        with pytest.raises(Exception, match=r"\(tensors 'w2', 'w3'\) failed: "
                                            r"CUDA_ERROR_ILLEGAL_ADDRESS"):
            resp.upload_completion.result(timeout=60)
        assert isinstance(resp.staging_completion.exception(), _C.CudaError)
        assert not (tmp_path / "bad" / ".metadata").exists()
        assert not list((tmp_path / "bad").glob("*.distcp"))
        assert lib.fake_copies_run() == lib.fake_copies_queued()
        lib.fake_reset()
        resp = dcpx.async_save(sd, checkpoint_id=str(tmp_path / "good"), async_stager=stager)
        resp.upload_completion.result(timeout=60)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcpx.load(out, checkpoint_id=str(tmp_path / "good"))
    assert all(out[f"w{i}"].numpy().tobytes() == data[i] for i in range(6))
    for t in ts:
        t.free()


def test_async_save_of_tensors_in_adjacent_allocations_is_bit_exact(stager_cuda, lib, tmp_path,
                                                                    monkeypatch):
    """async_save of tensors in allocations placed back to back on the
    device, which the stager's layout puts back to back in its buffer:
    the save succeeds (no copy spans two allocations) and loads bit exact."""
    import dcpx
    ts = FakeCudaTensor.adjacent(lib.devices[0], [4096] * 4)
    data = [_rand(4096, 600 + i) for i in range(4)]
    for t, d in zip(ts, data):
        t.write(d)
    sd = {f"w{i}": torch.zeros(4096, dtype=torch.uint8) for i in range(4)}
    gates: list = []
    with dcpx.DefaultStager(dcpx.StagingOptions(True, False, True, True)) as stager:
        stager._cuda = True
        _use_overlap_stager(monkeypatch, stager_cuda, stager, ts, gates)
        resp = dcpx.async_save(sd, checkpoint_id=str(tmp_path / "ckpt"), async_stager=stager)
        resp.upload_completion.result(timeout=60)
        assert sorted(stager._layout.offsets.values()) == [0, 4096, 8192, 12288]
    assert lib.fake_calls(b"cuMemcpyDtoHAsync_v2") == 4
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcpx.load(out, checkpoint_id=str(tmp_path / "ckpt"))
    for i in range(4):
        assert out[f"w{i}"].numpy().tobytes() == data[i], i
    for t in ts:
        t.free()
