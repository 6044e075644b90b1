"""The .metadata pickle written in C (csrc/mdpickle.c, ``_C.dump_metadata``).

For every metadata object graph the save paths build (and many they do not),
the C stream must load to the very objects Python's pickler writes: same
types, same values, same sharing, not a byte larger; and it must pass dcpx's
own safe reader and torch's plain ``pickle.load``.  Whatever lies outside
the encoder's closed set of types goes to Python's pickler, whose output
``_metadata.dumps`` then writes unchanged.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import gc
import pathlib
import pickle
import struct
import sys
from collections import OrderedDict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import dcpx
from dcpx import _C
from dcpx.coordination import dist as _dist
from dcpx.formats import metadata as _metadata

# Metadata.version: torch >= 2.9; StorageMeta.modules: torch >= 2.8.
HAS_VERSION = "version" in {f.name for f in dataclasses.fields(Metadata)}
VERSION = {"version": "1.0.0"} if HAS_VERSION else {}
MODULES = ({"modules": ["m1", "m2"]}
           if "modules" in {f.name for f in dataclasses.fields(StorageMeta)} else {})

from conftest import (
    SAVEABLE_DTYPES,
    assert_state_bit_equal,
    empty_like_state,
    make_tensor,
    resolved,
    torch_copies,
)

_ATOMS = (type(None), bool, int, float)


def c_body(md):
    return _metadata._c_body(md)


def py_body(md):
    return _metadata._python_body(md)


def trailer(body: bytes) -> bytes:
    return body + _metadata._TRAILER.pack(_metadata._TRAILER_MAGIC, _C.crc32(body), len(body))


def same_graph(a, b, pairs=None, path="md"):
    """a and b are equal object graphs: the same types at every node, equal
    atoms (floats by their bits), dataclass instances attribute by attribute,
    and the same sharing (an object met twice in a is met twice in b)."""
    if pairs is None:
        pairs = ({}, {})
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} vs {b!r}"
        return
    if isinstance(a, _ATOMS) or isinstance(a, (torch.dtype, torch.layout, enum.Enum)):
        assert a == b, f"{path}: {a!r} vs {b!r}"
        return
    ab, ba = pairs
    if id(a) in ab or id(b) in ba:
        assert ab.get(id(a)) == id(b) and ba.get(id(b)) == id(a), f"{path}: sharing differs"
        return
    ab[id(a)], ba[id(b)] = id(b), id(a)
    if isinstance(a, (str, pathlib.PurePath, torch.memory_format)):
        assert a == b, f"{path}: {a!r} vs {b!r}"
    elif isinstance(a, dict):
        assert list(map(type, a)) == list(map(type, b)) and list(a) == list(b), f"{path}: keys"
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            same_graph(ka, kb, pairs, f"{path} key {ka!r}")
            same_graph(va, vb, pairs, f"{path}[{ka!r}]")
    elif isinstance(a, (list, tuple)):  # torch.Size too
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same_graph(x, y, pairs, f"{path}[{i}]")
    else:
        assert dataclasses.is_dataclass(a) or isinstance(a, _StorageInfo), f"{path}: {type(a)}"
        same_graph(vars(a), vars(b), pairs, f"{path}.__dict__")


def check_encodes(md, *, is_metadata=True, cyclic=False):
    """The C stream of md is accepted and loads as Python's pickle does."""
    c, py = c_body(md), py_body(md)
    assert c is not None, "the C encoder refused a graph of DCP metadata types"
    assert len(c) <= len(py)
    _C.check_pickle(c)
    from_c, from_py = pickle.loads(c), pickle.loads(py)
    same_graph(from_c, from_py)
    if not cyclic:  # dataclass eq (NaN != NaN; == recurses forever on cycles)
        assert from_c == from_py or "nan" in repr(from_py)
    data = _metadata.dumps(md)
    assert data[:len(c)] == c and len(data) == len(c) + _metadata._TRAILER.size
    if is_metadata:
        same_graph(_metadata.loads(data, "x/.metadata"), pickle.loads(py))
    return c


def check_falls_back(md):
    assert c_body(md) is None
    py = py_body(md)
    assert _metadata.dumps(md)[:-_metadata._TRAILER.size] == py
    return py


# --------------------------------------------------------------------------
# metadata the save paths build

def _state_dicts():
    g = torch.Generator().manual_seed(3)
    yield "every dtype", {f"t.{d}": make_tensor((3, 2), d, g) for d in SAVEABLE_DTYPES}
    yield "0-d and empty", {"s": torch.tensor(2.5), "e": torch.empty(0, 4),
                            "e3": torch.empty(2, 0, 3, dtype=torch.int8)}
    yield "requires_grad", {"w": torch.randn(4, 4, requires_grad=True), "b": torch.zeros(4)}
    yield "nested", {"model": {"layer": [torch.ones(2), {"x": torch.arange(5)}]},
                     "opt": {"state": {0: {"step": torch.tensor(3.0), "m": torch.zeros(3)}},
                             "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
                     "epoch": 7, "name": "run", "none": None}
    yield "unicode and long keys", {"ключ.é.中": torch.ones(1), "k" * 300: torch.ones(2),
                                    "z" * 70000: torch.zeros(1), "\U0001F600": 3}
    yield "many", {f"l{i // 10}.p{i % 10}": torch.randn(2) for i in range(2500)}
    yield "shared shapes", {f"w{i}": torch.zeros(3, 5) for i in range(1001)}


@pytest.mark.parametrize("name,sd", list(_state_dicts()), ids=lambda x: x if isinstance(x, str) else "")
def test_single_process_saves_encode_like_python(tmp_path, name, sd):
    md = dcpx.save(sd, checkpoint_id=str(tmp_path / "c"))
    check_encodes(md)
    # and the graph dcpx's reader builds from the file (other sharing)
    with open(tmp_path / "c" / ".metadata", "rb") as f:
        check_encodes(_metadata.loads(f.read(), "x"))


def test_pinned_flag_and_torch_built_metadata(tmp_path):
    """torch's own planner builds a TensorProperties per tensor (unshared)."""
    sd = {"a": torch.randn(3), "b": torch.randn(2, 2, requires_grad=True),
          "c": torch.tensor(1, dtype=torch.int64), "v": {"x": 1}}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "t")))  # no_dist inferred
    with open(tmp_path / "t" / ".metadata", "rb") as f:
        md = pickle.load(f)
    check_encodes(md)
    props = _metadata.properties(torch.bfloat16, True, True)
    md.state_dict_metadata["p"] = TensorStorageMetadata(
        props, torch.Size([2]), [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))])
    for fmt in (torch.channels_last, torch.preserve_format):
        md.state_dict_metadata[f"f{fmt}"] = TensorStorageMetadata(
            TensorProperties(torch.float16, memory_format=fmt, pin_memory=True),
            torch.Size([1]), [ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))])
    check_encodes(md)


def _item(fqn, offsets, sizes, size, dtype=torch.float32):
    n = 1
    for s in sizes:
        n *= s
    return _dist.LocalItem(fqn, tuple(offsets), tuple(sizes), tuple(size), dtype, False, False,
                           n * dtype.itemsize)


def test_sharded_multi_chunk_metadata_as_the_dist_path_builds():
    """global_plan: chunks of one tensor on several ranks, replicas, bytes."""
    ranks = 4
    plans = []
    for r in range(ranks):
        items = [_item("w", (r * 4, 0), (4, 8), (16, 8)),
                 _item("emb", (0, r * 2), (10, 2), (10, 8), torch.bfloat16),
                 _item("bias", (0,), (8,), (8,))]
        items.append(_dist.LocalItem("step", None, None, None, None, False, False, 10))
        plans.append(items)
    mappings = [{"w": ("w",), "emb": ("emb",), "bias": ("bias",), "step": ("step",)}] * ranks
    plan = _dist.global_plan(plans, mappings)
    storage = {plan.index[(r, i)]: _StorageInfo(f"__{r}_0.distcp", 64 * i, 60 + i)
               for r in range(ranks) for i in plan.assign[r]}
    md = Metadata(plan.state_dict_metadata, planner_data=plan.planner_data,
                  storage_data=storage, storage_meta=StorageMeta("ck", "sid"), **VERSION)
    assert len(md.state_dict_metadata["w"].chunks) == ranks
    check_encodes(md)


def _handmade(**kw) -> Metadata:
    size = torch.Size([4, 2])
    props = TensorProperties(torch.float32)
    sdm = {"a": TensorStorageMetadata(props, size, [ChunkStorageMetadata(torch.Size([0, 0]), size)]),
           "v": BytesStorageMetadata()}
    storage = {MetadataIndex("a", [0, 0], 0): _StorageInfo("f.distcp", 0, 32),
               MetadataIndex("v"): _StorageInfo("f.distcp", 64, 9)}
    fields = dict(state_dict_metadata=sdm, planner_data={"a": ("a",), "v": ("v",)},
                  storage_data=storage)
    fields.update(kw)
    return Metadata(**fields)


@pytest.mark.parametrize("storage_meta", [
    None, StorageMeta(), StorageMeta(checkpoint_id="/ck", save_id="s", load_id="l", **MODULES),
    StorageMeta(checkpoint_id=pathlib.PosixPath("/tmp/x")),
    StorageMeta(checkpoint_id=pathlib.PurePosixPath("rel/y")),
    StorageMeta(checkpoint_id=pathlib.PureWindowsPath("C:/y"))], ids=str)
def test_storage_meta_with_and_without_fields(storage_meta):
    check_encodes(_handmade(storage_meta=storage_meta))


@pytest.mark.parametrize("value", [
    0, 255, 256, 65535, 65536, -1, -129, 2**31 - 1, -2**31, 2**31, -2**31 - 1, 2**32,
    2**40, -2**40, 2**63 - 1, -2**63, 2**63, -2**63 - 1, 2**64, 2**70, -2**70,
    2**2100, -2**2100 + 1, 1 << 2047, -(1 << 2047)])
def test_ints_of_every_width(value):
    """Offsets beyond 4 GiB are common; big ints through planner_data."""
    md = _handmade(storage_data={MetadataIndex("a", [0, 0], 0): _StorageInfo("f", value, abs(value))},
                   planner_data={"a": ("a", value, -value)})
    check_encodes(md)


def test_planner_data_int_parts_floats_and_batches():
    pd = {f"k{i}": ("opt", "state", i, "exp_avg") for i in range(2001)}
    pd["one"] = [1]
    pd["many"] = list(range(1000)) + [float("nan"), -0.0, 1e308, float("-inf")]
    pd["exact"] = {str(i): i for i in range(1000)}
    pd["deep"] = ((((),),),)
    pd["flags"] = [True, False, None]
    pd["dt"] = (torch.float8_e4m3fn, torch.sparse_coo, torch.strided)
    pd["sz"] = (torch.Size([]), torch.Size(range(10)))
    pd["lone surrogate \ud800"] = "\udfff"
    check_encodes(_handmade(planner_data=pd))


def test_shared_objects_stay_shared_and_cycles_through_lists_encode():
    shared = ["x"]
    pd = {"a": shared, "b": shared, "t": (shared, shared)}
    pd["self"] = pd
    looped: list = []
    looped.append(looped)
    pd["loop"] = looped
    md = _handmade(planner_data=pd)
    check_encodes(md, cyclic=True)
    back = pickle.loads(c_body(md)).planner_data
    assert back["a"] is back["b"] is back["t"][0] and back["self"] is back
    assert back["loop"][0] is back["loop"]


def test_transform_descriptors_and_extra_attributes_encode_as_python_does():
    md = _handmade()
    info = next(iter(md.storage_data.values()))
    info.transform_descriptors = ["zstd"]
    md.state_dict_metadata["a"].note = "extra attribute"
    md.extra = {"k": (1, 2)}
    check_encodes(md)


# --------------------------------------------------------------------------
# outside the closed set: Python's pickler

class _SubTSM(TensorStorageMetadata):
    pass


class _Str(str):
    pass


class _Opaque:
    def __eq__(self, other):
        return type(other) is _Opaque


def _fallbacks():
    yield "set", _handmade(planner_data={"a": {1, 2}})
    yield "OrderedDict", _handmade(planner_data=OrderedDict(a=("a",)))
    yield "bytes", _handmade(planner_data={"a": b"raw"})
    yield "unknown object", _handmade(planner_data={"a": _Opaque()})
    md = _handmade()
    md.state_dict_metadata["a"] = _SubTSM(**vars(md.state_dict_metadata["a"]))
    yield "subclass", md
    md = _handmade()
    md.state_dict_metadata["a"].extra = _Opaque()
    yield "extra attribute of unknown type", md
    t: tuple = ([],)
    t[0].append(t)
    yield "recursive tuple", _handmade(planner_data={"t": t})
    if HAS_VERSION:
        yield "str subclass", _handmade(version=_Str("1.0"))
    else:
        yield "str subclass", _handmade(planner_data={"a": (_Str("a"),)})
    yield "memory_format (no __module__)", _handmade(planner_data={"m": torch.channels_last})
    info = _StorageInfo("f", 0, 1)
    info.transform_descriptors = [_Opaque()]
    yield "transform descriptor of unknown type", _handmade(
        storage_data={MetadataIndex("a"): info})


@pytest.mark.parametrize("name,md", list(_fallbacks()), ids=lambda x: x if isinstance(x, str) else "")
def test_outside_the_closed_set_python_pickles_it(name, md):
    py = check_falls_back(md)
    if name != "recursive tuple":
        assert pickle.loads(py) == md


def test_lazy_metadata_of_the_dist_path_goes_through_its_reduce():
    md = _handmade()
    lazy = _dist._LazyMetadata(_metadata.dumps(md), "x/.metadata")
    py = check_falls_back(lazy)
    assert type(pickle.loads(py)) is Metadata and pickle.loads(py) == md


def test_errors_the_pickler_would_raise_are_raised():
    md = _handmade(planner_data={"f": lambda: 0})
    with pytest.raises((pickle.PicklingError, AttributeError)):
        _metadata.dumps(md)
    md = _handmade()
    md.state_dict_metadata["a"].properties.memory_format = "bogus"
    with pytest.raises(RuntimeError, match="memory_format"):
        _metadata.dumps(md)
    deep: list = []
    for _ in range(100000):
        deep = [deep]
    with pytest.raises(RecursionError):
        _metadata.dumps(_handmade(planner_data={"d": deep}))


def test_a_type_whose_reduction_changed_is_left_to_python(monkeypatch):
    """_c_kinds checks each type's reduction; one with its own __reduce__ is
    not handed to C."""
    monkeypatch.setattr(StorageMeta, "__reduce__", lambda self: (StorageMeta, ()), raising=False)
    kinds = _metadata._c_kinds()
    assert StorageMeta not in kinds and Metadata in kinds
    md = _handmade(storage_meta=StorageMeta("x"))
    assert _C.dump_metadata(md, kinds, 5) is None


# --------------------------------------------------------------------------
# torch reads what C wrote

def test_torch_reads_and_loads_a_checkpoint_whose_metadata_c_wrote(tmp_path, monkeypatch):
    def no_python(md):
        raise AssertionError("Python's pickler was used")
    monkeypatch.setattr(_metadata, "_python_body", no_python)
    g = torch.Generator().manual_seed(5)
    sd = {f"t{i}": make_tensor((i % 4 + 1, 3), d, g) for i, d in enumerate(SAVEABLE_DTYPES)}
    sd["nested"] = {"x": [torch.arange(7), 4.5], "s": "text"}
    path = str(tmp_path / "ck")
    dcpx.save(sd, checkpoint_id=path)
    md = dcp.FileSystemReader(path).read_metadata()
    assert set(md.state_dict_metadata) >= {f"t{i}" for i in range(len(SAVEABLE_DTYPES))}
    # torch loads every key but those of a dtype it cannot copy (torch 2.9:
    # float4_e2m1fn_x2, conftest.torch_copies); it reads all of their metadata
    loadable = {k: v for k, v in sd.items()
                if not isinstance(v, torch.Tensor) or torch_copies(v.dtype)}
    out = empty_like_state(loadable)
    out["nested"]["s"] = ""
    dcp.load(out, storage_reader=dcp.FileSystemReader(path))  # no process group: no_dist inferred
    assert_state_bit_equal(out, resolved(loadable))


# --------------------------------------------------------------------------
# properties

_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-2**80, 2**80),
    st.floats(allow_nan=True), st.text(max_size=20),
    st.sampled_from(SAVEABLE_DTYPES), st.sampled_from([torch.strided, torch.sparse_coo]),
    st.lists(st.integers(0, 2**40), max_size=5).map(torch.Size))
_values = st.recursive(
    _leaf, lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.lists(inner, max_size=5).map(tuple),
        st.dictionaries(st.text(max_size=8), inner, max_size=5)), max_leaves=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pd=st.dictionaries(st.text(max_size=30), _values, max_size=20), reuse=st.booleans())
def test_any_planner_data_of_the_closed_set_loads_as_python(pd, reuse):
    if reuse and pd:  # the same objects again under other keys
        pd.update({k + "'": v for k, v in list(pd.items())})
    check_encodes(_handmade(planner_data=pd))


_dims = st.lists(st.integers(0, 2**33), min_size=0, max_size=4)


@settings(max_examples=60, deadline=None)
@given(tensors=st.lists(st.tuples(st.text(min_size=1, max_size=12), _dims,
                                  st.sampled_from(SAVEABLE_DTYPES), st.booleans(), st.booleans(),
                                  st.integers(0, 2**45)), max_size=30))
def test_any_tensor_metadata_loads_as_python(tensors):
    sdm, storage, pd = {}, {}, {}
    for fqn, dims, dtype, grad, pinned, offset in tensors:
        size = _metadata.interned_size(tuple(dims))
        sdm[fqn] = TensorStorageMetadata(
            _metadata.properties(dtype, grad, pinned), size,
            [ChunkStorageMetadata(_metadata.zero_offsets(len(dims)), size)])
        storage[MetadataIndex(fqn, [0] * len(dims), 0)] = _StorageInfo("__0_0.distcp", offset, 1)
        pd[fqn] = tuple(fqn.split("."))
    check_encodes(Metadata(sdm, planner_data=pd, storage_data=storage,
                           storage_meta=StorageMeta(), **VERSION))


# --------------------------------------------------------------------------
# reference counts

def _refs(objs):
    gc.collect()  # tracebacks that pytest.raises kept in reference cycles
    return [sys.getrefcount(o) for o in objs]


def _bad_kinds(md, kinds):
    bad = dict(kinds)
    bad[Metadata] = "not a tuple"
    with pytest.raises(TypeError, match="kinds"):
        _C.dump_metadata(md, bad, 5)


def test_dump_metadata_keeps_reference_counts_on_every_path():
    md = _handmade(storage_meta=StorageMeta(pathlib.PosixPath("/x"), "sid"))
    tsm = md.state_dict_metadata["a"]
    watched = [md, tsm, tsm.properties, tsm.size, tsm.chunks[0], md.planner_data,
               md.storage_data, md.storage_meta, md.storage_meta.checkpoint_id,
               next(iter(md.storage_data.values())), "a", torch.float32, Metadata, torch.Size]
    kinds = _metadata._c_kinds()
    watched.append(kinds)
    before = _refs(watched)
    for _ in range(3):
        assert _C.dump_metadata(md, kinds, 5) is not None
    assert _refs(watched) == before
    # fallback (None): an unknown object deep inside
    md.planner_data["z"] = ("a", [_Opaque()])
    before = _refs(watched)
    for _ in range(3):
        assert _C.dump_metadata(md, kinds, 5) is None
    assert _refs(watched) == before
    # errors: a __getstate__ that raises, a bad kinds table, a bad protocol
    del md.planner_data["z"]
    tsm.properties = TensorProperties(torch.float32)
    tsm.properties.memory_format = "bogus"
    watched[2] = tsm.properties
    before = _refs(watched)
    for _ in range(3):
        with pytest.raises(RuntimeError):
            _C.dump_metadata(md, kinds, 5)
    _bad_kinds(md, kinds)
    with pytest.raises(ValueError):
        _C.dump_metadata(md, kinds, 2)
    with pytest.raises(TypeError):
        _C.dump_metadata(md, [], 5)
    assert _refs(watched) == before


def test_a_copy_encodes_like_the_original():
    """deepcopy breaks sharing with the module's caches: memo decisions
    follow the copy's own references."""
    md = _handmade()
    md.planner_data["again"] = md.state_dict_metadata["a"].size
    check_encodes(copy.deepcopy(md))


# --------------------------------------------------------------------------
# the stream itself

def _frames(data: bytes) -> list:
    import pickletools
    return [arg for op, arg, _ in pickletools.genops(data) if op.name == "FRAME"]


@pytest.mark.parametrize("value", [list(range(200000)), {str(i): i for i in range(50000)},
                                   ["x" * 70000, 1, "y" * 100]], ids=["ints", "dict", "big str"])
def test_frames_end_near_64_kib_and_big_strings_lie_between_frames(value):
    c = c_body(value)
    assert c is not None and pickle.loads(c) == value
    frames = _frames(c)
    assert frames and max(frames) < 65536 + 64
    assert len(c) <= len(py_body(value))


class _Mutating:
    """A key whose reduction empties the dict holding it (and so drops the
    value the encoder is about to write)."""

    def __init__(self, target):
        self.target = target


def _reduce_and_clear(obj):
    obj.target.clear()
    return (pathlib.PurePosixPath, ("p",))


def test_a_reduction_that_changes_the_dict_being_written_raises():
    d: dict = {}
    d[_Mutating(d)] = ["only held by the dict"]
    d["other"] = 1
    kinds = dict(_metadata._c_kinds())
    kinds[_Mutating] = (4, _reduce_and_clear)  # KIND_REDUCE with a reducer
    with pytest.raises(RuntimeError, match="changed size"):
        _C.dump_metadata(d, kinds, 5)


def test_the_installed_torch_types_are_all_handed_to_c():
    """A torch that changes how one of its metadata types pickles shows up
    here (its metadata would silently take the slow path otherwise)."""
    kinds = {cls: kind for cls, (kind, _) in _metadata._c_kinds().items()}
    plain = {Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
             MetadataIndex, StorageMeta}
    assert {c for c, k in kinds.items() if k == _metadata._KIND_PLAIN} == plain
    assert kinds[TensorProperties] == _metadata._KIND_GETSTATE
    assert kinds[_StorageInfo] == _metadata._KIND_STORAGE
    assert kinds[torch.Size] == _metadata._KIND_SIZE
    assert kinds[torch.dtype] == kinds[torch.layout] == _metadata._KIND_REDUCE
