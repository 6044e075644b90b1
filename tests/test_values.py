"""Non-tensor values in training state load safely without allow_pickle
(issue 10, item 9).

* numpy arrays, scalars, dtypes and RNG states, ``random.getstate()``,
  ``argparse.Namespace``, torch RNG states and Python containers of these
  round-trip (saved by dcpx or by torch DCP; loaded by dcpx's fast path, its
  generic path with a planner subclass, and torch's ``load`` with dcpx's
  reader), equal to the original in type and bits;
* each value is unpickled once;
* what could run code is still refused (``os.system``, ``eval``, a
  TorchScript archive), with an error that names the exact global and both
  remedies (``allow_pickle=True``, ``torch.serialization.add_safe_globals``);
* a user class is refused, then loads after ``add_safe_globals`` or inside
  ``safe_globals``; the ``.metadata`` allow-list is not loosened.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import io
import os
import random
import re
import zipfile

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from conftest import assert_bit_equal

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# --------------------------------------------------------------------------
# values and a strict comparison

def _values() -> dict:
    rng = np.random.default_rng(1234)
    np.random.seed(7)
    np.random.rand(3)  # a state part-way through the stream
    random.seed(11)
    gen = torch.Generator().manual_seed(5)
    torch.rand(3, generator=gen)
    return {
        "np_random_state": np.random.get_state(),
        "np_random_state_dict": np.random.get_state(legacy=False),
        "np_bit_generator_state": rng.bit_generator.state,
        "py_random_state": random.getstate(),
        "torch_rng_state": torch.get_rng_state(),
        "torch_generator_state": gen.get_state(),
        "arr_f32": rng.standard_normal((3, 4)).astype(np.float32),
        "arr_f64_nan": np.array([np.nan, -0.0, np.inf, 1e-310]),
        "arr_i64_0d": np.array(-(2 ** 62), dtype=np.int64),
        "arr_u8_fortran": np.asfortranarray(np.arange(12, dtype=np.uint8).reshape(3, 4)),
        "arr_strided": np.arange(20, dtype=np.int16)[::3],
        "arr_bool": np.array([True, False, True]),
        "arr_c64": np.array([1 + 2j, -3.5j], dtype=np.complex64),
        "arr_f16": np.array([0.5, -2.0], dtype=np.float16),
        "arr_datetime": np.array(["2024-01-01T12:00", "1970-01-01"], dtype="datetime64[m]"),
        "arr_str": np.array(["a", "héllo"]),
        "arr_bytes": np.array([b"x", b"yz"]),
        "arr_structured": np.array([(1, 2.5, b"ab")], dtype=[("i", "<i4"), ("f", "<f8"),
                                                              ("s", "S2")]),
        "arr_object": np.array([1, "two", None, (3, 4.0)], dtype=object),
        "arr_empty": np.zeros((0, 3), dtype=np.float32),
        "np_float32": np.float32(1.5),
        "np_float64": np.float64(-0.0),
        "np_int64": np.int64(-7),
        "np_uint16": np.uint16(65535),
        "np_bool": np.bool_(True),
        "np_complex128": np.complex128(1 - 1j),
        "np_datetime64": np.datetime64("2024-05-06T07:08:09"),
        "np_timedelta64": np.timedelta64(90, "s"),
        "np_str": np.str_("text"),
        "dtype_f32": np.dtype(np.float32),
        "dtype_big_endian": np.dtype(">i8"),
        "dtype_structured": np.dtype([("x", np.int8), ("y", (np.float32, (2,)))]),
        "dtype_class": type(np.dtype(np.float32)),
        "namespace": argparse.Namespace(lr=3e-4, layers=[1, 2], name="run", seed=np.int64(3),
                                        rng=np.random.get_state(), sub=argparse.Namespace(a=1)),
        "namespace_with_tensor": argparse.Namespace(w=torch.arange(4.0), dt=torch.bfloat16),
        "containers": {"list": [np.float32(1), np.arange(3)], "tuple": (np.int8(1), "x"),
                       "set": {1, 2}, "frozenset": frozenset({"a", 3}),
                       "deque": collections.deque([np.float64(2.0), 1], maxlen=5),
                       "ordered": collections.OrderedDict(b=np.uint8(2), a=np.dtype("f2"))},
        "tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    }


def assert_same(actual, expected, path: str = "value") -> None:
    """Equal in type, dtype, shape and bits (NaN payloads and -0.0 too)."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert_bit_equal(actual, expected, path)
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        if expected.dtype.hasobject:
            for i, (a, e) in enumerate(zip(actual.ravel(), expected.ravel())):
                assert_same(a, e, f"{path}[{i}]")
        else:
            assert np.ascontiguousarray(actual).tobytes() == \
                np.ascontiguousarray(expected).tobytes(), path
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype and actual.tobytes() == expected.tobytes(), path
    elif isinstance(expected, argparse.Namespace):
        assert_same(vars(actual), vars(expected), path)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), path
        for k in expected:
            assert_same(actual[k], expected[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple, collections.deque)):
        assert len(actual) == len(expected), path
        if isinstance(expected, collections.deque):
            assert actual.maxlen == expected.maxlen, path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _dest(state):
    """The destination: the same dicts and lists (DCP flattens them), zeroed
    tensors, None for every other value."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return type(state)((k, _dest(v)) for k, v in state.items())
    if isinstance(state, list):
        return [_dest(v) for v in state]
    return None


class SubclassPlanner(tdcp.DefaultLoadPlanner):
    """A planner subclass (load goes through torch's planning and dcpx's
    reader)."""


def _load_dcpx(state, path):
    dcpx.load(state, checkpoint_id=path)


def _load_dcpx_generic(state, path):
    dcpx.load(state, checkpoint_id=path, planner=SubclassPlanner())


def _load_torch_with_dcpx_reader(state, path):
    tdcp.load(state, storage_reader=dcpx.FileSystemReader(path))


LOADERS = {"dcpx": _load_dcpx, "dcpx-planner-subclass": _load_dcpx_generic,
           "torch-load-dcpx-reader": _load_torch_with_dcpx_reader}
SAVERS = {"dcpx": dcpx.save, "torch": tdcp.save}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The values, saved once by each library."""
    state = _values()
    out = {}
    for name, save in SAVERS.items():
        path = str(tmp_path_factory.mktemp(f"values-{name}"))
        save(state, checkpoint_id=path)
        out[name] = path
    return state, out


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("saver", list(SAVERS))
def test_training_state_values_round_trip_without_allow_pickle(saved, saver, loader):
    state, paths = saved
    dest = _dest(state)
    LOADERS[loader](dest, paths[saver])
    assert_same(dest, state)


def test_values_load_with_allow_pickle_too(saved):
    state, paths = saved
    dest = _dest(state)
    dcpx.load(dest, storage_reader=dcpx.FileSystemReader(paths["dcpx"], allow_pickle=True))
    assert_same(dest, state)


@pytest.mark.parametrize("loader", ["dcpx", "dcpx-planner-subclass"])
def test_each_value_is_unpickled_once(saved, loader, monkeypatch):
    """The safety check is the decode: no second torch.load per value."""
    state, paths = saved
    calls = []
    real = torch.load

    def counting(f, *args, **kwargs):
        calls.append(1)
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    dest = _dest(state)
    LOADERS[loader](dest, paths["dcpx"])
    values = sum(not isinstance(v, torch.Tensor) for v in state.values())
    # a container value is flattened into one item per leaf
    md = dcpx.FileSystemReader(paths["dcpx"]).read_metadata()
    items = sum(isinstance(m, dcpx.BytesStorageMetadata)
                for m in md.state_dict_metadata.values())
    assert items >= values
    assert len(calls) == items


# --------------------------------------------------------------------------
# refusals

class RunsShell:
    """Unpickling this runs a shell command."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class Evaluates:
    """Unpickling this evaluates an expression (a non-blocked module)."""

    def __reduce__(self):
        return (eval, ("1 + 1",))


class Point:
    """A user class: code-free, but not on any allow-list."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return type(other) is Point and (other.x, other.y) == (self.x, self.y)


def _refusal(path, key="v", reader=None):
    dest = {"w": torch.zeros(2), key: None}
    with pytest.raises(dcpx.UnsafeCheckpointError) as ei:
        dcpx.load(dest, checkpoint_id=path, storage_reader=reader)
    assert dest[key] is None
    return str(ei.value)


def test_os_system_is_refused_naming_the_global(tmp_path):
    path = str(tmp_path / "ck")
    witness = tmp_path / "pwned"
    dcpx.save({"w": torch.ones(2), "v": RunsShell(f"echo pwned > {witness}")},
              checkpoint_id=path)
    msg = _refusal(path)
    assert f"{os.system.__module__}.system" in msg  # posix.system on Linux
    assert "'v'" in msg and "allow_pickle=True" in msg
    # torch's weights_only loader blocks os/posix even when allow-listed
    with torch.serialization.safe_globals([os.system]):
        _refusal(path)
    assert not witness.exists()


def test_eval_is_refused_naming_the_global_and_both_remedies(tmp_path):
    path = str(tmp_path / "ck")
    dcpx.save({"w": torch.ones(2), "v": Evaluates()}, checkpoint_id=path)
    msg = _refusal(path)
    assert "refusing to unpickle global builtins.eval" in msg
    assert "FileSystemReader(path, allow_pickle=True)" in msg
    assert "torch.serialization.add_safe_globals([builtins.eval])" in msg


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_value_is_refused(tmp_path):
    """torch.load(weights_only=False) would hand it to torch.jit.load."""
    import dataclasses
    from dcpx.formats import metadata as _metadata
    path = tmp_path / "ck"
    dcpx.save({"w": torch.ones(2), "v": 1}, checkpoint_id=str(path))
    md = dcpx.FileSystemReader(str(path)).read_metadata()
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buf)
    (path / "__0_9.distcp").write_bytes(buf.getvalue())
    md.storage_data = {k: (dataclasses.replace(v, relative_path="__0_9.distcp", offset=0,
                                               length=len(buf.getvalue()))
                           if k.fqn == "v" else v) for k, v in md.storage_data.items()}
    (path / ".metadata").write_bytes(_metadata.dumps(md))
    with pytest.raises(dcpx.UnsafeCheckpointError, match="'v': the value is a TorchScript"):
        dcpx.load({"w": torch.zeros(2), "v": None}, checkpoint_id=str(path))


@pytest.fixture
def restore_safe_globals():
    before = torch.serialization.get_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)


def test_user_class_refused_then_allowed_by_torch_safe_globals(tmp_path, restore_safe_globals):
    path = str(tmp_path / "ck")
    value = Point(1, np.float32(2.5))
    dcpx.save({"w": torch.ones(2), "v": value}, checkpoint_id=path)
    name = f"{Point.__module__}.Point"

    msg = _refusal(path, key="v")
    assert f"refusing to unpickle global {name}" in msg
    assert "FileSystemReader(path, allow_pickle=True)" in msg
    assert f"torch.serialization.add_safe_globals([{name}])" in msg
    assert f"torch.serialization.safe_globals([{name}])" in msg

    with torch.serialization.safe_globals([Point]):
        dest = {"w": torch.zeros(2), "v": None}
        dcpx.load(dest, checkpoint_id=path)
        assert dest["v"] == value
        dest = {"w": torch.zeros(2), "v": None}
        dcpx.load(dest, checkpoint_id=path, planner=SubclassPlanner())
        assert dest["v"] == value
    _refusal(path, key="v")  # only inside the context

    torch.serialization.add_safe_globals([Point])
    dest = {"w": torch.zeros(2), "v": None}
    dcpx.load(dest, checkpoint_id=path)
    assert dest["v"] == value


def test_refusal_lists_every_global_an_object_needs(tmp_path, restore_safe_globals):
    """A RandomState object (not its state) needs numpy.random's
    constructors: the error names the first one refused and lists all of
    them in the add_safe_globals remedy, which then works."""
    path = str(tmp_path / "ck")
    rs = np.random.RandomState(3)
    rs.rand(2)
    dcpx.save({"w": torch.ones(2), "v": rs}, checkpoint_id=path)
    msg = _refusal(path)
    m = re.search(r"refusing to unpickle global (\S+):", msg)
    assert m and m.group(1).startswith("numpy.random.")
    remedy = re.search(r"torch\.serialization\.add_safe_globals\(\[([^\]]+)\]\)", msg)
    names = [n.strip() for n in remedy.group(1).split(",")]
    assert "numpy.random._pickle.__randomstate_ctor" in names and m.group(1) in names
    objs = []
    for n in names:
        mod, _, attr = n.rpartition(".")
        objs.append(getattr(importlib.import_module(mod), attr))
    torch.serialization.add_safe_globals(objs)
    dest = {"w": torch.zeros(2), "v": None}
    dcpx.load(dest, checkpoint_id=path)
    got, want = dest["v"].get_state(), rs.get_state()
    assert_same(got, want)


def test_forced_weights_only_uses_torchs_own_list(tmp_path, monkeypatch):
    """TORCH_FORCE_WEIGHTS_ONLY_LOAD=1: torch's list, nothing of dcpx's."""
    path = str(tmp_path / "ck")
    dcpx.save({"w": torch.ones(2), "n": 3, "v": np.arange(3)}, checkpoint_id=path)
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    msg = _refusal(path)
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" in msg and "numpy" in msg
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    dest = {"w": torch.zeros(2), "n": None, "v": None}
    dcpx.load(dest, checkpoint_id=path)
    assert_same(dest["v"], np.arange(3))


def test_metadata_allow_list_is_not_loosened(tmp_path):
    """Numpy is allowed in values, never in .metadata."""
    import pickle
    path = tmp_path / "ck"
    dcpx.save({"w": torch.ones(2)}, checkpoint_id=str(path))
    (path / ".metadata").write_bytes(pickle.dumps(np.arange(3), protocol=2))
    with pytest.raises(dcpx.UnsafeCheckpointError, match="numpy"):
        dcpx.load({"w": torch.zeros(2)}, checkpoint_id=str(path))


def test_non_zip_value_is_refused(tmp_path):
    """A value must be a torch.save archive: torch's legacy format (a raw
    pickle) is never handed to torch.load."""
    import pickle
    with pytest.raises(dcpx.CorruptCheckpointError, match="not a torch.save zip"):
        dcpx.formats.values.loads(pickle.dumps(3), "ck: key 'v'")
    buf = io.BytesIO()
    torch.save(3, buf)
    assert zipfile.is_zipfile(io.BytesIO(buf.getvalue()))
    assert dcpx.formats.values.loads(buf.getvalue(), "ck: key 'v'") == 3


def _renamed_numpy_module(data: bytes, old: bytes, new: bytes) -> bytes:
    """The same torch.save archive with numpy's module named as another
    numpy version names it in the pickle."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            raw = src.read(info)
            if info.filename.endswith("data.pkl"):
                assert old in raw
                raw = raw.replace(old, new)
            dst.writestr(info.filename, raw)
    return out.getvalue()


@pytest.mark.parametrize("module", [b"numpy.core.multiarray", b"numpy._core.multiarray"])
def test_numpy_1x_and_2x_module_names_both_load(module):
    """numpy 1.x pickles name numpy.core, 2.x numpy._core: both resolve to
    the installed numpy's functions."""
    value = {"a": np.arange(5, dtype=np.int32), "s": np.float32(2.5)}
    buf = io.BytesIO()
    torch.save(value, buf)
    current = (b"numpy._core.multiarray" if b"numpy._core.multiarray" in buf.getvalue()
               else b"numpy.core.multiarray")
    data = _renamed_numpy_module(buf.getvalue(), current, module)
    assert_same(dcpx.formats.values.loads(data, "ck: key 'v'"), value)
