"""Shared helpers for the dcpx test suite.

Everything compares tensors *bit for bit*: a checkpoint must give back the
exact bytes that were saved, including NaN payloads, signalling NaNs and
negative zeros, which ``torch.equal`` would treat loosely (NaN != NaN) or
not at all (-0.0 == 0.0).
"""
from __future__ import annotations

import io
import os
import struct
import warnings
import zipfile
from typing import Any, Iterable, Optional

import pytest
import torch

import dcpx

# --------------------------------------------------------------------------
# dtypes, enumerated from torch itself so that a new torch dtype is picked up
# (and tested) without editing the suite.

ALL_DTYPES: list[torch.dtype] = sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    """qint8 & co.: tensors of these dtypes are quantized tensors, which DCP
    does not store as plain data (test_errors covers them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "quantized creation is deprecated"
        return torch.empty(1, dtype=dtype).is_quantized


def torch_save_supports(dtype: torch.dtype) -> bool:
    """Whether ``torch.save`` can store a tensor of ``dtype``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.save(torch.empty(2, dtype=dtype), io.BytesIO())
        return True
    except Exception:
        return False


def safe_loader_takes_numpy() -> bool:
    """Whether dcpx's safe unpickler takes numpy arrays (it adds them to
    torch's allow-list; not on torch 2.4, whose unpickler lacks what their
    pickles call)."""
    import tempfile

    import numpy as np

    import dcpx
    from dcpx.errors import UnsafeCheckpointError
    with tempfile.TemporaryDirectory() as d:
        dcpx.save({"a": np.arange(3)}, checkpoint_id=d)
        try:
            dcpx.load({"a": None}, checkpoint_id=d)
            return True
        except UnsafeCheckpointError:
            return False


def torch_copies(dtype: torch.dtype) -> bool:
    """Whether torch can copy a tensor of ``dtype`` (``clone``, ``copy_``).
    torch 2.9 has no copy kernel for float4_e2m1fn_x2 (2.10 and later do):
    there its own DCP load fails on such a tensor, in ``copy_``."""
    if dtype not in _COPIES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.zeros(2 * dtype.itemsize, dtype=torch.uint8).view(dtype).clone()
            _COPIES[dtype] = True
        except (NotImplementedError, RuntimeError):
            _COPIES[dtype] = False
    return _COPIES[dtype]


_COPIES: dict = {}


PLAIN_DTYPES = [d for d in ALL_DTYPES if not is_quantized_dtype(d)]
#: every dtype torch.save can store: dcpx must round-trip all of them
SAVEABLE_DTYPES = [d for d in PLAIN_DTYPES if torch_save_supports(d)]
#: dtypes torch.save refuses (sub-byte ints): dcpx must refuse them too
UNSAVEABLE_DTYPES = [d for d in PLAIN_DTYPES if not torch_save_supports(d)]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: dtypes torch.save stores but dcpx does not (yet): each is a reported bug,
#: and its tests are strict xfails (they start failing once it is fixed).
#: Empty now: float4_e2m1fn_x2 (DLPack: 4 bits x 2 lanes) goes through a
#: uint8 view since it was found here.
KNOWN_BROKEN: dict = {}


def dtype_params(dtypes):
    """pytest params for ``dtypes``, known-broken ones as strict xfails."""
    return [pytest.param(d, id=dtype_id(d), marks=pytest.mark.xfail(
                reason=KNOWN_BROKEN[d], strict=True)) if d in KNOWN_BROKEN
            else pytest.param(d, id=dtype_id(d)) for d in dtypes]


# --------------------------------------------------------------------------
# bit-exact comparison

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements in row-major order, as raw bytes.  Uses only
    torch and numpy (not dcpx): a same-size integer view of the tensor (legal
    for any strides) handed to numpy, whose tobytes() walks it in C order."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.element_size() == 16:  # complex128: two float64s per element
        t = torch.view_as_real(t)
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy().tobytes()


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same dtype, same shape and the very same bytes."""
    where = f" ({what})" if what else ""
    assert isinstance(actual, torch.Tensor), f"not a tensor{where}: {type(actual)}"
    assert actual.dtype == expected.dtype, f"dtype{where}: {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"shape{where}: {actual.shape} != {expected.shape}"
    a, e = raw_bytes(actual), raw_bytes(expected)
    if a != e:
        diff = next(i for i in range(min(len(a), len(e))) if a[i] != e[i])
        raise AssertionError(f"bytes differ{where}: first difference at byte {diff} "
                             f"of {len(e)}")


def assert_state_bit_equal(actual: Any, expected: Any, path: str = "") -> None:
    """Recursively compare nested state dicts; tensors bit-exactly, other
    values with ==."""
    if isinstance(expected, torch.Tensor):
        assert_bit_equal(actual, expected, path)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: {type(actual)} is not a dict"
        assert set(actual) == set(expected), f"{path}: keys {set(actual)} != {set(expected)}"
        for k in expected:
            assert_state_bit_equal(actual[k], expected[k], f"{path}.{k}" if path else str(k))
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_state_bit_equal(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


# --------------------------------------------------------------------------
# random tensors of any dtype

_SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1.0, -1.5, 1e-40]


def make_tensor(shape: Iterable[int], dtype: torch.dtype,
                gen: Optional[torch.Generator] = None, specials: bool = True) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` filled with random bytes
    (so floats include arbitrary NaN payloads and denormals).  Floating and
    complex dtypes also get NaN / inf / -0.0 in their first elements.

    bool is the exception: only the bytes 0 and 1 are valid bools (torch's
    own copy kernels normalise other bytes), so bools are random 0/1.
    """
    shape = tuple(shape)
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    numel = 1
    for n in shape:
        numel *= n
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), generator=gen, dtype=torch.uint8)
    t = raw.view(dtype).reshape(shape)
    if specials and numel and (dtype.is_floating_point or dtype.is_complex):
        k = min(numel, len(_SPECIALS))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                vals = torch.tensor(_SPECIALS[:k], dtype=torch.float64).to(dtype)
            t.view(-1)[:k] = vals
        except (RuntimeError, TypeError):
            pass  # dtypes torch cannot convert to (float4, ...): random bytes only
    return t


# --------------------------------------------------------------------------
# checkpoint helpers

def data_files(path: os.PathLike) -> list[str]:
    """The checkpoint's data files (``*.distcp``), sorted."""
    return sorted(n for n in os.listdir(path) if n.endswith(".distcp"))


def empty_like_state(state: Any) -> Any:
    """A destination state dict of the same structure: tensors of the same
    shape and dtype (zeroed bytes), non-tensor leaves replaced by None."""
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.numel() * state.element_size(),
                           dtype=torch.uint8).view(state.dtype).reshape(state.shape)
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(empty_like_state(v) for v in state)
    return None


def resolved(state: Any) -> Any:
    """What a load gives back for ``state``: tensors as plain contiguous
    copies (conj / neg views resolved), other values as they are."""
    if isinstance(state, torch.Tensor):
        t = state.detach().resolve_conj().resolve_neg()
        if not torch_copies(t.dtype):  # copied as same-size ints (torch 2.9: float4)
            return t.view(_SAME_SIZE_INT[t.element_size()]).contiguous().clone().view(t.dtype)
        return t.contiguous().clone()
    if isinstance(state, dict):
        return {k: resolved(v) for k, v in state.items()}
    if isinstance(state, list):
        return [resolved(v) for v in state]
    if isinstance(state, tuple):
        return tuple(resolved(v) for v in state)
    return state


def item_slices(path, metadata):
    """(key, bytes of the item's archive, its offset in its file) per item,
    found through the metadata's storage_data."""
    files: dict = {}
    for index, info in metadata.storage_data.items():
        if info.relative_path not in files:
            with open(os.path.join(path, info.relative_path), "rb") as f:
                files[info.relative_path] = f.read()
        raw = files[info.relative_path][info.offset:info.offset + info.length]
        assert len(raw) == info.length
        yield index.fqn, raw, info.offset


def member_data_offset(raw: bytes, name_suffix: str) -> tuple:
    """(offset, length) of the data of the zip member whose name ends with
    ``name_suffix``, within the archive bytes ``raw`` (from its local
    header, as a zip reader finds it)."""
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        [zinfo] = [m for m in z.infolist() if m.filename.endswith(name_suffix)]
    header = raw[zinfo.header_offset:zinfo.header_offset + 30]
    assert header[:4] == b"PK\x03\x04"
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return zinfo.header_offset + 30 + name_len + extra_len, zinfo.file_size


def locate(path, metadata, key: str, member: str = "/data/0") -> tuple:
    """(data file path, file offset, length) of one zip member of ``key``'s
    record: ``/data/0`` is a tensor's bytes, ``/data.pkl`` its pickle."""
    for index, info in metadata.storage_data.items():
        if index.fqn == key:
            file = os.path.join(path, info.relative_path)
            with open(file, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            off, length = member_data_offset(raw, member)
            return file, info.offset + off, length
    raise KeyError(key)


def flip_byte(file, offset: int, mask: int = 0x10) -> None:
    """XOR one byte of a file in place."""
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def kernel_copies(directory) -> bool:
    """Whether copy_file_range works between two files of ``directory``
    (a steady-state save copies its metadata's middle with it)."""
    a, b = os.path.join(directory, "probe.a"), os.path.join(directory, "probe.b")
    with open(a, "wb") as f:
        f.write(b"x" * 4096)
    try:
        with open(a, "rb") as src, open(b, "wb") as dst:
            return os.copy_file_range(src.fileno(), dst.fileno(), 4096) == 4096
    except (AttributeError, OSError):
        return False
    finally:
        for p in (a, b):
            if os.path.exists(p):
                os.unlink(p)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def ckpt(tmp_path) -> str:
    """A path for a checkpoint directory (not yet created)."""
    return str(tmp_path / "ckpt")


def fast_writer(path, **kw) -> dcpx.FileSystemWriter:
    """A writer without fsync, for tests that save many times."""
    kw.setdefault("sync_files", False)
    return dcpx.FileSystemWriter(path, **kw)


def pid_gone(pid: int, timeout: float = 0.0) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie / dead entry)
    within ``timeout`` seconds (0: now)."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


# --------------------------------------------------------------------------
# The stand-in CUDA driver (tests/fake_cuda/fake_libcuda.c, tests/cuda_standin.py)
# for the tests of dcpx's C CUDA path without a GPU: one library per test
# session, shared by every test module (dcpx loads the driver once).

@pytest.fixture(scope="session")
def standin_path(tmp_path_factory):
    from cuda_standin import build
    return build(tmp_path_factory.mktemp("fakecuda"))


@pytest.fixture(scope="session")
def fake(standin_path):
    """The stand-in, loaded by dcpx and by the tests (one instance).
    Batched copies (the stand-in's driver version is 12.8) are switched
    off here: the tests of the one-call-per-copy path count those calls;
    the ``batched`` fixture switches them on."""
    from cuda_standin import Device, load

    from dcpx import _C
    os.environ["DCPX_LIBCUDA"] = str(standin_path)
    os.environ.setdefault("FAKE_CUDA_DEVICES", "2")
    lib = load(standin_path)
    assert lib.cuInit(0) == 0
    version, ndev = _C.cuda_driver_version()
    assert (version, ndev) == (12080, 2)
    assert _C.cuda_batch_copies(False) is None
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


@pytest.fixture
def batched(lib):
    """Batched copies on (cuMemcpyBatchAsync, the 12.8 ABI) for one test."""
    from dcpx import _C
    assert _C.cuda_batch_copies(True) == "cuMemcpyBatchAsync"
    yield lib
    _C.cuda_batch_copies(False)
