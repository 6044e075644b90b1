"""dcpx's C CUDA path (csrc/cuda.c, csrc/cuda_stage.c) against a stand-in
driver (tests/fake_cuda/fake_libcuda.c, built here with the C compiler):
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
or device-less driver is reported clearly.  The cases that need a fresh
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
                          Device, FakeCudaTensor, build, load)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def standin_path(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("fakecuda"))


@pytest.fixture(scope="session")
def fake(standin_path):
    """The stand-in, loaded by dcpx and by the tests (one instance)."""
    os.environ["DCPX_LIBCUDA"] = str(standin_path)
    os.environ.setdefault("FAKE_CUDA_DEVICES", "2")
    lib = load(standin_path)
    assert lib.cuInit(0) == 0
    version, ndev = _C.cuda_driver_version()
    assert (version, ndev) == (12080, 2)
    lib.devices = [Device(lib, 0), Device(lib, 1)]
    return lib


@pytest.fixture
def lib(fake):
    fake.fake_reset()
    live = fake.fake_dlpack_live()
    yield fake
    fake.fake_reset()
    for d in fake.devices:
        d.synchronize()
    assert fake.fake_dlpack_live() == live, "a DLPack deleter was not called exactly once"


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
    """Tensors adjacent on the device and in the buffer (the layout the
    stager's 64-byte alignment gives 64-byte multiples) make one copy."""
    whole = FakeCudaTensor(lib.devices[0], 64 * 10)
    whole.write(_rand(640, 1))
    parts = [FakeCudaTensor(lib.devices[0], 64, base=whole, offset=64 * i) for i in range(10)]
    buf = _buffer(640)
    _C.cuda_copy_into([(p, 64 * i) for i, p in enumerate(parts)], buf)
    assert buf.numpy().tobytes() == whole.read()
    assert lib.fake_calls(b"cuMemcpyDtoHAsync_v2") == 1
    # Not adjacent in the buffer: one copy each.
    lib.fake_reset()
    buf = _buffer(1280)
    _C.cuda_copy_into([(p, 128 * i) for i, p in enumerate(parts)], buf)
    raw = buf.numpy().tobytes()
    assert all(raw[128 * i:128 * i + 64] == p.read() for i, p in enumerate(parts))
    assert lib.fake_calls(b"cuMemcpyDtoHAsync_v2") == 10
    whole.free()


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


@pytest.mark.parametrize("case", ["strided", "cpu", "too_big", "no_dlpack", "bad_pair"])
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
    for b in bufs:
        assert _C.cuda_host_register(b)
    _C.cuda_copy_into([(t, 0)], bufs[0])
    retained = [lib.fake_retained(d) for d in range(2)]
    assert _C.cuda_release_all() == 2
    assert lib.fake_registered() == 0
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
    for src in ("cuda.c", "cuda_stage.c", "module.c"):
        r = subprocess.run(["cc", *flags, str(REPO / "csrc" / src)], capture_output=True, text=True)
        assert r.returncode == 0, (src, r.stderr)
