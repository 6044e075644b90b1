"""How dcpx's C core takes tensors in: the DLPack protocol.

``dcpx._C.probe_tensor(t)`` reports what the C code sees of a tensor
(pointer, shape, itemsize, byte count, contiguity, device, read-only flag,
versioned or legacy capsule), and ``dcpx._C.gather_bytes(t)`` returns the
bytes the writer would put in a checkpoint (row-major order).  The writer
(``WriteJob``) and the reader (``read_items``) take tensors the same way.

Ownership contract checked here: every DLPack capsule dcpx consumes has its
deleter called exactly once, on success and on every error path.  For a torch
tensor the capsule holds a C++ reference (``Tensor._use_count()``), not a
Python one, so both counts are watched; for numpy arrays the capsule holds a
Python reference, so ``sys.getrefcount`` alone shows a leak or a double
release.
"""
import errno
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_tensor, raw_bytes
from dcpx import _C

CPU = 1  # DLPack kDLCPU


def refs(t: torch.Tensor) -> tuple:
    """(Python refcount, C++ TensorImpl use count) of a tensor."""
    return sys.getrefcount(t), t._use_count()


# --------------------------------------------------------------------------
# probe_tensor: what the C code sees

def test_contiguous_tensor():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    info = _C.probe_tensor(t)
    assert info["ptr"] == t.data_ptr()
    assert info["shape"] == (3, 4)
    assert info["itemsize"] == 4
    assert info["nbytes"] == 48
    assert info["contiguous"] == 1
    assert info["device_type"] == CPU
    assert info["read_only"] == 0
    assert info["versioned"] == 1  # torch speaks DLPack 1.x (max_version)


def test_transposed_tensor_is_strided():
    base = torch.randn(3, 5)
    t = base.T
    info = _C.probe_tensor(t)
    assert info["ptr"] == t.data_ptr() == base.data_ptr()
    assert info["shape"] == (5, 3)
    assert info["nbytes"] == 60
    assert info["contiguous"] == 0


def test_slice_with_step_and_storage_offset():
    base = torch.randn(50, dtype=torch.float64)
    t = base[7:40:3]
    info = _C.probe_tensor(t)
    assert t.storage_offset() == 7
    assert info["ptr"] == t.data_ptr() == base.data_ptr() + 7 * 8
    assert info["shape"] == (11,)
    assert info["nbytes"] == 11 * 8
    assert info["contiguous"] == 0


def test_contiguous_view_with_storage_offset():
    base = torch.randn(10, 4)
    t = base[3:6]
    info = _C.probe_tensor(t)
    assert info["ptr"] == t.data_ptr() == base.data_ptr() + 3 * 4 * 4
    assert info["contiguous"] == 1
    assert info["nbytes"] == 3 * 4 * 4


def test_expanded_stride_zero():
    t = torch.randn(1, 3).expand(4, 3)
    assert t.stride() == (0, 1)
    info = _C.probe_tensor(t)
    assert info["ptr"] == t.data_ptr()
    assert info["shape"] == (4, 3)
    assert info["nbytes"] == 48  # the logical size, not the storage's 12
    assert info["contiguous"] == 0


def test_size_one_dims_may_have_any_stride():
    t = torch.randn(4, 1).T  # shape (1, 4), strides (1, 1)
    assert t.is_contiguous()
    assert _C.probe_tensor(t)["contiguous"] == 1


def test_zero_dim_tensor():
    t = torch.tensor(2.5, dtype=torch.float16)
    info = _C.probe_tensor(t)
    assert info["shape"] == ()
    assert info["nbytes"] == 2
    assert info["ptr"] == t.data_ptr()
    assert info["contiguous"] == 1


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2), (2, 0, 0)])
def test_empty_tensor(shape):
    t = torch.empty(shape, dtype=torch.int32)
    info = _C.probe_tensor(t)
    assert info["shape"] == shape
    assert info["nbytes"] == 0
    assert info["contiguous"] == 1
    assert _C.gather_bytes(t) == b""


@pytest.mark.parametrize("dtype,itemsize", [(torch.uint8, 1), (torch.bfloat16, 2),
                                            (torch.int32, 4), (torch.complex64, 8),
                                            (torch.complex128, 16)])
def test_itemsize(dtype, itemsize):
    assert _C.probe_tensor(torch.zeros(3, dtype=dtype))["itemsize"] == itemsize


def test_torch_tensors_are_not_read_only():
    for t in (torch.randn(3), torch.randn(3, 4).T, torch.randn(1).expand(5)):
        assert _C.probe_tensor(t)["read_only"] == 0


def test_read_only_numpy_array_is_flagged_and_refused_as_destination(tmp_path):
    np = pytest.importorskip("numpy")
    a = np.arange(4.0)
    a.flags.writeable = False
    assert _C.probe_tensor(a)["read_only"] == 1
    with pytest.raises(ValueError, match="read-only"):
        _C.read_items([str(tmp_path / "x")], [(0, 0, 64, a, "DoubleStorage")])


# --------------------------------------------------------------------------
# refusals

def test_tensor_requiring_grad_is_refused_by_dlpack():
    """torch will not export a tensor that requires grad; dcpx passes torch's
    message through (dcpx.save detaches first, see test_roundtrip)."""
    t = torch.randn(3, requires_grad=True)
    before = refs(t)
    with pytest.raises(BufferError, match="gradient.*detach"):
        _C.probe_tensor(t)
    assert refs(t) == before
    _C.probe_tensor(t.detach())  # fine once detached


@pytest.mark.parametrize("obj", [object(), [1.0, 2.0], "tensor", 3.5, None],
                         ids=["object", "list", "str", "float", "None"])
def test_objects_without_dlpack_raise_type_error_naming_the_type(obj):
    with pytest.raises(TypeError, match=rf"type {type(obj).__name__}\b.*__dlpack__"):
        _C.probe_tensor(obj)
    with pytest.raises(TypeError, match=type(obj).__name__):
        _C.gather_bytes(obj)


def test_dlpack_returning_a_non_capsule_is_refused():
    class NotACapsule:
        def __dlpack__(self, **kw):
            return 42

    with pytest.raises(TypeError, match="capsule"):
        _C.probe_tensor(NotACapsule())


def test_producer_errors_propagate():
    class Failing:
        def __dlpack__(self, **kw):
            raise ValueError("producer says no")

    with pytest.raises(ValueError, match="producer says no"):
        _C.probe_tensor(Failing())


@pytest.mark.parametrize("make", [lambda: torch.randn(3, 3).to_sparse(),
                                  lambda: torch.empty(3, device="meta"),
                                  lambda: torch.randn(2, dtype=torch.complex64).conj()],
                         ids=["sparse", "meta", "conj"])
def test_tensors_torch_cannot_export_are_refused(make):
    with pytest.raises(BufferError):
        _C.probe_tensor(make())


# --------------------------------------------------------------------------
# the legacy protocol: __dlpack__() without max_version

class LegacyProducer:
    """A pre-DLPack-1.0 producer: ``__dlpack__`` takes no ``max_version``
    (raises TypeError if given one) and returns an unversioned capsule."""

    def __init__(self, wrapped):
        self.wrapped = wrapped
        self.calls = []

    def __dlpack__(self, *args, **kwargs):
        self.calls.append(kwargs)
        if "max_version" in kwargs:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        return self.wrapped.__dlpack__(*args, **kwargs)


def test_legacy_producer_is_accepted_and_its_deleter_runs_once():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    producer = LegacyProducer(t)
    before = refs(t)
    info = _C.probe_tensor(producer)
    assert producer.calls == [{"max_version": (1, 0)}, {}]  # asked new first, then legacy
    assert info["versioned"] == 0
    assert info["ptr"] == t.data_ptr()
    assert info["shape"] == (2, 3)
    assert _C.gather_bytes(producer) == raw_bytes(t)
    assert refs(t) == before  # the capsule's reference was dropped, once


def test_legacy_numpy_producer_deleter_runs_exactly_once():
    """numpy's capsule owns a Python reference to the array: a missing
    deleter call leaves the refcount high, a second call drops it low."""
    np = pytest.importorskip("numpy")
    a = np.arange(10, dtype=np.float32)
    producer = LegacyProducer(a)
    baseline = sys.getrefcount(a)
    for _ in range(20):
        info = _C.probe_tensor(producer)
        assert info["versioned"] == 0
        assert sys.getrefcount(a) == baseline
    assert _C.gather_bytes(producer) == a.tobytes()
    assert sys.getrefcount(a) == baseline


def test_versioned_numpy_producer_deleter_runs_exactly_once():
    np = pytest.importorskip("numpy")
    a = np.arange(10, dtype=np.float64)[::2]
    baseline = sys.getrefcount(a)
    for _ in range(20):
        info = _C.probe_tensor(a)
        assert info["versioned"] == 1
        assert info["contiguous"] == 0
    assert _C.gather_bytes(a) == np.ascontiguousarray(a).tobytes()
    assert sys.getrefcount(a) == baseline


def test_legacy_producer_through_writer_and_reader(tmp_path):
    src = torch.randn(5, 7)
    dst = torch.zeros(5, 7)
    path = str(tmp_path / "f.distcp")
    s_before, d_before = refs(src), refs(dst)
    job = _C.WriteJob([(path, [(LegacyProducer(src), "FloatStorage")])], sync_files=False)
    [[(offset, length)]] = job.layout()
    job.start()
    job.wait()
    job.release()
    del job
    failures = _C.read_items([path], [(0, offset, length, LegacyProducer(dst), "FloatStorage")])
    assert failures == []
    assert raw_bytes(dst) == raw_bytes(src)
    assert refs(src) == s_before and refs(dst) == d_before


# --------------------------------------------------------------------------
# gather_bytes: the row-major image of any strided view

def test_gather_bytes_contiguous_and_transposed():
    t = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    assert _C.gather_bytes(t) == raw_bytes(t)
    assert _C.gather_bytes(t.T) == raw_bytes(t.T.contiguous())
    assert _C.gather_bytes(t.T) != _C.gather_bytes(t)  # not just the storage


_DTYPES = [torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.int64,
           torch.complex64, torch.complex128]


@st.composite
def strided_views(draw):
    """A random view: a base tensor of up to 4 dims, sliced with random
    starts and steps, permuted, and maybe with a broadcast (stride-0) dim."""
    ndim = draw(st.integers(0, 4))
    shape = draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim))
    dtype = draw(st.sampled_from(_DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    base = make_tensor(shape, dtype, torch.Generator().manual_seed(seed))
    view = base
    for dim, n in enumerate(shape):
        start = draw(st.integers(0, max(0, n - 1)))
        step = draw(st.integers(1, 3))
        view = view.narrow(dim, start, n - start) if n else view
        idx = [slice(None)] * ndim
        idx[dim] = slice(None, None, step)
        view = view[tuple(idx)]
    if ndim:
        view = view.permute(draw(st.permutations(range(ndim))))
    if draw(st.booleans()):
        view = view.unsqueeze(0).expand(draw(st.integers(0, 3)), *view.shape)
    return view


@settings(max_examples=300, deadline=None)
@given(view=strided_views())
def test_gather_bytes_matches_torch_contiguous(view):
    assert _C.gather_bytes(view) == raw_bytes(view)
    info = _C.probe_tensor(view)
    assert info["ptr"] == view.data_ptr() or view.numel() == 0
    assert info["shape"] == tuple(view.shape)
    assert info["nbytes"] == view.numel() * view.element_size()
    assert bool(info["contiguous"]) == view.is_contiguous()


def test_gather_bytes_large_strided_view():
    base = make_tensor((300, 1024), torch.float32)
    view = base[::3, 1::2].T
    assert _C.gather_bytes(view) == raw_bytes(view)


# --------------------------------------------------------------------------
# reference counting: nothing leaks, nothing is released twice

def test_probe_and_gather_do_not_leak():
    t = torch.randn(4, 5)
    v = t[:, ::2]
    before, vbefore = refs(t), refs(v)
    for _ in range(50):
        _C.probe_tensor(t)
        _C.probe_tensor(v)
        _C.gather_bytes(t)
        _C.gather_bytes(v)
    assert refs(t) == before
    assert refs(v) == vbefore


def test_write_job_holds_the_tensor_until_release(tmp_path):
    t = torch.randn(4, 5)
    before = refs(t)
    job = _C.WriteJob([(str(tmp_path / "a"), [(t, "FloatStorage"), b"raw bytes"])],
                      sync_files=False, threads=1)
    assert t._use_count() == before[1] + 1  # the live capsule keeps t's memory
    job.start()
    job.wait()
    job.release()
    assert refs(t) == before
    del job
    assert refs(t) == before


def test_write_job_never_started_releases_on_dealloc(tmp_path):
    t = torch.randn(8)
    before = refs(t)
    for _ in range(10):
        job = _C.WriteJob([(str(tmp_path / "a"), [(t, "FloatStorage")])], sync_files=False)
        del job
    assert refs(t) == before


def test_write_job_dropped_while_running_releases_on_dealloc(tmp_path):
    t = torch.randn(1 << 18)
    before = refs(t)
    job = _C.WriteJob([(str(tmp_path / "a"), [(t, "FloatStorage")])], sync_files=False)
    job.start()
    del job  # dealloc cancels and joins the threads, then releases
    assert refs(t) == before


@pytest.mark.parametrize("bad_item", [
    (torch.zeros(2),),                           # tuple of the wrong arity
    (torch.zeros(2, requires_grad=True), "FloatStorage"),  # DLPack refuses
    (torch.randn(2, 2).to_sparse(), "FloatStorage"),       # DLPack refuses
    ("not a tensor", "FloatStorage"),            # no __dlpack__
    12345,                                       # neither bytes nor a tuple
], ids=["arity", "requires_grad", "sparse", "no-dlpack", "int"])
def test_write_job_error_after_a_good_tensor_releases_it(tmp_path, bad_item):
    t = torch.randn(3)
    before = refs(t)
    for _ in range(5):
        with pytest.raises(Exception):
            _C.WriteJob([(str(tmp_path / "a"), [(t, "FloatStorage"), bad_item])],
                        sync_files=False)
    assert refs(t) == before
    assert not (tmp_path / "a").exists()  # construction never writes


def test_write_job_rejects_a_non_tuple_item_with_type_error(tmp_path):
    with pytest.raises(TypeError, match="bytes or \\(tensor, storage_type\\)"):
        _C.WriteJob([(str(tmp_path / "a"), [12345])], sync_files=False)


def test_write_job_io_error_names_the_file_and_releases(tmp_path):
    t = torch.randn(3)
    before = refs(t)
    path = str(tmp_path / "no-such-dir" / "a.distcp")
    job = _C.WriteJob([(path, [(t, "FloatStorage")])], sync_files=False)
    job.start()
    with pytest.raises(OSError) as ei:
        job.wait()
    assert ei.value.errno == errno.ENOENT
    assert ei.value.filename == path
    job.release()
    del job
    assert refs(t) == before


def _written(tmp_path, t, stype="FloatStorage"):
    path = str(tmp_path / "src.distcp")
    job = _C.WriteJob([(path, [(t, stype)])], sync_files=False)
    [[(offset, length)]] = job.layout()
    job.start()
    job.wait()
    job.release()
    return path, offset, length


def test_read_items_does_not_leak(tmp_path):
    src = torch.randn(6, 4)
    path, offset, length = _written(tmp_path, src)
    dst = torch.empty(6, 4)
    before = refs(dst)
    for _ in range(20):
        assert _C.read_items([path], [(0, offset, length, dst, "FloatStorage")]) == []
    assert raw_bytes(dst) == raw_bytes(src)
    assert refs(dst) == before


def test_read_items_missing_file_reports_and_releases(tmp_path):
    dst = torch.empty(6, 4)
    before = refs(dst)
    for _ in range(5):
        failures = _C.read_items([str(tmp_path / "missing")],
                                 [(0, 0, 1000, dst, "FloatStorage")])
        assert failures == [(0, 3, errno.ENOENT, "open failed")]
    assert refs(dst) == before


@pytest.mark.parametrize("bad", [
    (7, 0, 10, torch.empty(1), "FloatStorage"),  # file index out of range
    (0, 0, 10, "not a tensor", "FloatStorage"),  # no __dlpack__
    (0, 0, 10, torch.zeros(2, requires_grad=True), "FloatStorage"),
    (0, 0),                                     # malformed item
], ids=["file-index", "no-dlpack", "requires_grad", "malformed"])
def test_read_items_error_after_a_good_item_releases_it(tmp_path, bad):
    src = torch.randn(5)
    path, offset, length = _written(tmp_path, src)
    dst = torch.empty(5)
    before = refs(dst)
    for _ in range(5):
        with pytest.raises((TypeError, IndexError, BufferError)):
            _C.read_items([path], [(0, offset, length, dst, "FloatStorage"), bad])
    assert refs(dst) == before


# --------------------------------------------------------------------------
# Capsules made by the caller (dcpx.formats.dtypes.dlpack_export)

def test_caller_made_capsule_is_consumed_once_and_released():
    """A capsule from torch's C exporter is taken as is: renamed used_*, its
    deleter run exactly once (the tensor's C++ use count comes back), and a
    second use is refused with a TypeError instead of a double free."""
    from dcpx.formats.dtypes import dlpack_export
    t = torch.arange(12, dtype=torch.float32)
    before = refs(t)
    cap = dlpack_export(t)
    assert type(cap).__name__ == "PyCapsule" and 'dltensor_versioned' in repr(cap)
    assert t._use_count() == before[1] + 1            # the capsule holds the tensor
    info = _C.probe_tensor(cap)
    assert info["ptr"] == t.data_ptr() and info["shape"] == (12,) and info["versioned"]
    assert "used_dltensor_versioned" in repr(cap)
    assert refs(t) == before                          # deleter ran once
    with pytest.raises(TypeError, match="unused DLPack capsule"):
        _C.probe_tensor(cap)
    del cap
    assert refs(t) == before


def test_unconsumed_capsule_releases_on_its_own():
    from dcpx.formats.dtypes import dlpack_export
    t = torch.ones(5)
    before = refs(t)
    cap = dlpack_export(t)
    del cap                                           # torch's capsule destructor
    assert refs(t) == before


@pytest.mark.parametrize("make", [
    lambda: torch.ones(3, requires_grad=True),
    lambda: torch.ones(3, dtype=torch.complex64).conj(),
    lambda: torch.nn.Parameter(torch.ones(3)),
])
def test_dlpack_export_leaves_special_tensors_to_dlpack(make):
    """Only plain, detached CPU tensors get a capsule; others go through
    __dlpack__ (and its checks)."""
    from dcpx.formats.dtypes import dlpack_export
    t = make()
    assert dlpack_export(t) is t


def test_write_job_with_capsules_writes_the_same_bytes(tmp_path):
    from dcpx.formats.dtypes import dlpack_export
    a = torch.arange(1000, dtype=torch.int32)
    b = torch.randn(7, 9)
    job = _C.WriteJob([(str(tmp_path / "f"), [(dlpack_export(a), "IntStorage"),
                                               (dlpack_export(b), "FloatStorage")])],
                      sync_files=False, threads=1)
    layout = job.layout()[0]
    job.start()
    job.wait()
    job.release()
    import io
    raw = (tmp_path / "f").read_bytes()
    for (off, length), want in zip(layout, (a, b)):
        got = torch.load(io.BytesIO(raw[off:off + length]), weights_only=True)
        assert torch.equal(got, want)
