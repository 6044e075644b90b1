"""The C decoder of .metadata files (csrc/mdindex.c, dcpx.formats.metadata.index)
and the load path built on it (dcpx.coordination.readplan: _indexed, _indexed_plan).

The decoder may leave any file to the general path (torch's Unpickler under
the allow-list, _metadata._validate, FileSystemReader._validate_storage),
but what it accepts it must read exactly as that path does: every test here
compares the two on the same bytes.  A wrong table would load a tensor from
the wrong extent, or skip a check the general path makes."""
from __future__ import annotations

import io
import os
import pickle
import random
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import dcpx
from dcpx import _C
from dcpx.coordination import readplan as _readplan
from dcpx.formats import metadata as _metadata
from dcpx.errors import CorruptCheckpointError, UnsafeCheckpointError

from conftest import assert_bit_equal

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "fuzz", "corpus")


@pytest.fixture(autouse=True)
def _fresh_cache():
    _readplan.clear()
    yield
    _readplan.clear()


def _python_view(md: Metadata) -> tuple:
    """What md_index_entries reports, computed from the Metadata objects as
    _readplan.Checkpoint.whole_chunks does."""
    storage = list(md.storage_data.items())
    whole = {}
    for pos, (k, _) in enumerate(storage):
        m = md.state_dict_metadata.get(k.fqn)
        if type(m) is TensorStorageMetadata and len(m.chunks) == 1:
            ch = m.chunks[0]
            if (ch.sizes == m.size and not any(ch.offsets) and k.offset is not None
                    and tuple(k.offset) == tuple(ch.offsets) and m.size.numel() > 0):
                whole[k.fqn] = pos
    ents = {}
    for fqn, m in md.state_dict_metadata.items():
        if type(m) is BytesStorageMetadata:
            ents[fqn] = ("bytes",)
        else:
            ents[fqn] = ("tensor", m.properties.dtype, tuple(m.size), whole.get(fqn, -1))
    stor = [(k.fqn, None if k.offset is None else tuple(k.offset), v.relative_path,
             v.offset, v.length) for k, v in storage]
    return ents, stor


def _index_of(raw: bytes):
    """_C.md_index on a .metadata file's bytes (no trailer check), or None."""
    if _metadata._INDEX_TABLES is None:
        _metadata._INDEX_TABLES = _metadata._index_tables()
    n = len(raw)
    if raw[-_metadata._TRAILER.size:-_metadata._TRAILER.size + 8] == _metadata._TRAILER_MAGIC:
        n -= _metadata._TRAILER.size
    return _C.md_index(raw, n, *_metadata._INDEX_TABLES)


def _python_accepts(raw: bytes, sizes: dict) -> Metadata:
    """The general path on the same bytes: loads (unpickle + _validate) and
    _validate_storage's tests against data files of the given sizes."""
    md = _metadata.loads(raw, "x")
    for info in md.storage_data.values():
        rel = info.relative_path
        if (not rel or "/" in rel or "\\" in rel or rel in (".", "..") or "\0" in rel
                or info.offset < 0 or info.length < 0
                or getattr(info, "transform_descriptors", None)):
            raise CorruptCheckpointError("storage entry refused")
        if info.offset + info.length > sizes.get(rel, -1):
            raise CorruptCheckpointError("extent outside the file")
    return md


def _check_same(raw: bytes, sizes: dict) -> bool:
    """If the C decoder accepts raw (and its extents fit `sizes`), the
    general path accepts it too and reads the same tables.  Whether C
    accepted."""
    found = _index_of(raw)
    if found is None:
        return False
    index, files = found
    if not _C.md_index_check(index, [sizes.get(f, -1) for f in files]):
        return False
    md = _python_accepts(raw, sizes)  # raises if C accepted what Python refuses
    assert _C.md_index_entries(index) == _python_view(md)
    py_bytes = {k.fqn: v for k, v in md.storage_data.items() if k.offset is None}
    assert _C.md_index_bytes(index, _StorageInfo) == py_bytes
    names = []
    for _, v in md.storage_data.items():
        if v.relative_path not in names:
            names.append(v.relative_path)
    assert files == names
    return True


# ------------------------------------------------ checkpoints as written

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
           torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
           torch.float8_e4m3fn, torch.uint16]


def _tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64) * 50
    if dtype.is_complex:
        return t.to(dtype)
    if dtype is torch.bool:
        return t > 0
    return t.to(dtype)


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
entries = st.lists(
    st.tuples(st.sampled_from(["tensor", "tensor", "tensor", "int", "str", "list"]), shapes,
              st.sampled_from(_DTYPES)),
    min_size=1, max_size=12)


def _state_dict(spec, seed=0) -> dict:
    sd = {}
    for i, (kind, shape, dtype) in enumerate(spec):
        key = f"m{i % 3}.layer{i}.w"
        if kind == "tensor":
            sd[key] = _tensor(shape, dtype, seed + i)
        elif kind == "int":
            sd[key] = i * 7 - 3
        elif kind == "str":
            sd[key] = f"value {i}"
        else:
            sd[key] = [i, "x", 2.5]
    return sd


def _sizes(path) -> dict:
    return {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)}


def _empty_like(sd: dict) -> dict:
    return {k: torch.full_like(v, 3) if isinstance(v, torch.Tensor) else None
            for k, v in sd.items()}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=entries, writer=st.sampled_from(["dcpx", "torch"]))
def test_decoder_reads_what_pickle_reads_and_loads_match(tmp_path_factory, spec, writer):
    """Any layout, written by dcpx or torch: the C decoder takes it, its
    tables equal the Metadata objects', and dcpx.load through them gives
    what torch's own load gives, bit for bit."""
    path = str(tmp_path_factory.mktemp("c"))
    sd = _state_dict(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if writer == "dcpx":
            dcpx.save(sd, checkpoint_id=path)
        else:
            tdcp.save(sd, checkpoint_id=path, no_dist=True)
    raw = open(os.path.join(path, ".metadata"), "rb").read()
    assert _check_same(raw, _sizes(path))
    mine, theirs = _empty_like(sd), _empty_like(sd)
    dcpx.load(mine, checkpoint_id=path)
    ck = _readplan._cache[os.path.join(path, ".metadata")]
    assert ck.index is not None
    if all(v.numel() for v in sd.values() if isinstance(v, torch.Tensor)):
        assert ck._md is None  # read through a plan: no Metadata object was made
    # (an empty tensor is not read whole: that load is planned from the Metadata)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(theirs, checkpoint_id=path, no_dist=True)
    for k in sd:
        if isinstance(sd[k], torch.Tensor):
            assert_bit_equal(mine[k], theirs[k], k)
            assert_bit_equal(mine[k], sd[k], k)
        else:
            assert mine[k] == theirs[k] == sd[k], k


def test_sharded_and_partial_entries(tmp_path):
    """Metadata with several chunks per tensor (a resharded save), an
    offset-less entry for a 0-d tensor (not its chunk's: torch looks a chunk
    up by MetadataIndex(fqn, torch.Size([]))), and a key with no storage entry:
    tables as Python's; loads plan those keys through the general path."""
    sdm, storage = {}, {}
    props = TensorProperties(dtype=torch.float32)
    sdm["a"] = TensorStorageMetadata(props, torch.Size([4, 2]), [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
        ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 2]))])
    storage[MetadataIndex("a", [0, 0])] = _StorageInfo("f0", 0, 10)
    storage[MetadataIndex("a", [2, 0])] = _StorageInfo("f1", 10, 10)
    sdm["s"] = TensorStorageMetadata(props, torch.Size([]), [
        ChunkStorageMetadata(torch.Size([]), torch.Size([]))])
    storage[MetadataIndex("s")] = _StorageInfo("f0", 20, 5)
    sdm["e"] = TensorStorageMetadata(props, torch.Size([0, 3]), [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([0, 3]))])
    storage[MetadataIndex("e", [0, 0])] = _StorageInfo("f0", 25, 5)
    sdm["nochunk"] = TensorStorageMetadata(props, torch.Size([3]), [])
    sdm["b"] = BytesStorageMetadata()
    storage[MetadataIndex("b")] = _StorageInfo("f1", 0, 3)
    for protocol in (4, 5):
        raw = pickle.dumps(Metadata(sdm, storage_data=storage), protocol=protocol)
        assert _check_same(raw, {"f0": 100, "f1": 100})
        ents, _ = _C.md_index_entries(_index_of(raw)[0])
        # "s" (0-d) has only an offset-less entry, which torch's reader
        # does not look its chunk up by: not read whole
        assert ents["a"][3] == -1 and ents["s"][3] == -1 and ents["e"][3] == -1
        # an extent past the end of its file: not accepted
        assert not _check_same(raw, {"f0": 29, "f1": 100})
    raw = _metadata.dumps(Metadata(sdm, storage_data=storage))
    assert _check_same(raw, {"f0": 100, "f1": 100})


# ------------------------------------------------ what it must leave to Python

class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _metadata_with(**changes) -> Metadata:
    props = TensorProperties(dtype=torch.float32)
    sdm = {"a": TensorStorageMetadata(props, torch.Size([2]), [
        ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))])}
    storage = {MetadataIndex("a", [0]): _StorageInfo("f0", 0, 8)}
    md = Metadata(sdm, storage_data=storage)
    for k, v in changes.items():
        setattr(md, k, v)
    return md


def _raw(md) -> bytes:
    return pickle.dumps(md, protocol=4)


@pytest.mark.parametrize("case", [
    "evil_global", "evil_planner_data", "chunk_outside", "negative_size", "bad_path",
    "dotdot", "negative_offset", "tuple_size", "str_offset", "bool_length", "dup_key",
    "transform", "wrong_storage_type", "not_metadata", "non_ascii_key", "set_in_planner",
    "protocol2", "data_after_stop", "no_stop",
])
def test_malformed_metadata_is_left_to_the_general_path(tmp_path, case):
    """The C decoder answers None for anything outside its closed grammar
    or anything the general path refuses, so that the error a load raises
    is the general path's own (and no code ever runs)."""
    md = _metadata_with()
    raw = None
    if case == "evil_global":
        md.storage_meta = _Evil()
    elif case == "evil_planner_data":
        md.planner_data = {"x": _Evil()}
    elif case == "chunk_outside":
        md.state_dict_metadata["a"].chunks[0].offsets = torch.Size([1])
    elif case == "negative_size":
        md.state_dict_metadata["a"].size = torch.Size([-2])
        md.state_dict_metadata["a"].chunks[0].sizes = torch.Size([-2])
    elif case == "bad_path":
        md.storage_data[MetadataIndex("a", [0])].relative_path = "../f0"
    elif case == "dotdot":
        md.storage_data[MetadataIndex("a", [0])].relative_path = ".."
    elif case == "negative_offset":
        md.storage_data[MetadataIndex("a", [0])].offset = -1
    elif case == "tuple_size":
        md.state_dict_metadata["a"].size = (2,)
    elif case == "str_offset":
        md.storage_data[MetadataIndex("a", [0])].offset = "0"
    elif case == "bool_length":
        md.storage_data[MetadataIndex("a", [0])].length = True
    elif case == "dup_key":
        raw = _raw(md).replace(b"planner_data", b"storage_data")
    elif case == "transform":
        md.storage_data[MetadataIndex("a", [0])].transform_descriptors = ["zstd"]
    elif case == "wrong_storage_type":
        md.state_dict_metadata["a"] = "tensor"
    elif case == "not_metadata":
        raw = pickle.dumps({"state_dict_metadata": {}}, protocol=4)
    elif case == "non_ascii_key":
        md.state_dict_metadata["é"] = md.state_dict_metadata.pop("a")
    elif case == "set_in_planner":
        md.planner_data = {"a": {1, 2}}
    elif case == "protocol2":
        raw = pickle.dumps(md, protocol=2)
    elif case == "data_after_stop":
        raw = _raw(md) + b"N"
    elif case == "no_stop":
        raw = _raw(md)[:-1]
    if raw is None:
        raw = _raw(md)
    assert _index_of(raw) is None
    if case in ("non_ascii_key", "set_in_planner", "protocol2", "dup_key"):
        _python_accepts(raw, {"f0": 64})  # fine for Python; only C leaves it
        return
    # the general path refuses it, and so does a load, with that error
    if case == "transform":  # _validate_storage's own error: an unknown transform
        expected_load = pytest.raises(Exception, match="stream transform.*'zstd'.*cannot be undone")
    else:
        with pytest.raises((CorruptCheckpointError, UnsafeCheckpointError)) as expected:
            _python_accepts(raw, {"f0": 64})
        expected_load = pytest.raises(type(expected.value))
    path = tmp_path / "c"
    path.mkdir()
    # f0 holds a valid archive of "a", so that only the metadata can fail
    src = tmp_path / "src"
    dcpx.save({"a": torch.ones(2)}, checkpoint_id=src)
    (name,) = [f for f in os.listdir(src) if f.endswith(".distcp")]
    (path / "f0").write_bytes((src / name).read_bytes())
    (path / ".metadata").write_bytes(raw)
    with expected_load:
        dcpx.load({"a": torch.zeros(2)}, checkpoint_id=path)


def test_state_dict_changed_after_build_is_left_to_python():
    """pickle copies a dict state into the object at BUILD: a later SETITEM
    on the same (memoized) dict must not change what the decoder sees."""
    # A dict used as BUILD state, then mutated through its memo slot.
    evil = (b"\x80\x04"
            b"\x8c\x25torch.distributed.checkpoint.metadata\x94"
            b"\x8c\x08Metadata\x94\x93\x94)\x81\x94"
            b"}\x94(\x8c\x13state_dict_metadata}\x8c\x0cstorage_data}u"
            b"b"                    # BUILD Metadata with the dict at memo 4
            b"h\x04\x8c\x0cplanner_dataKds"  # then mutate that dict
            b"0"                    # POP it (not in the closed grammar either)
            b".")
    assert _metadata.loads(evil, "x").planner_data is None  # pickle's meaning
    assert _index_of(evil) is None


def _mutations(raw: bytes, rng: random.Random, count: int):
    for _ in range(count):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            kind = rng.random()
            i = rng.randrange(len(b))
            if kind < 0.6:
                b[i] = rng.randrange(256)
            elif kind < 0.8:
                del b[i:i + rng.randint(1, 8)]
            else:
                b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
            if not b:
                b = bytearray(b".")
        yield bytes(b)


def test_mutated_metadata_never_accepted_with_another_meaning(tmp_path):
    """Random byte flips, cuts and insertions in real metadata pickles
    (dcpx's and torch's, no trailer): whatever the C decoder accepts, the
    general path accepts too, with the same tables."""
    sd = _state_dict([("tensor", (3, 2), torch.float32), ("int", (), torch.float32),
                      ("tensor", (), torch.int64), ("tensor", (0,), torch.float16),
                      ("tensor", (5,), torch.bfloat16)])
    raws = []
    for writer in ("dcpx", "torch"):
        p = tmp_path / writer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (dcpx.save if writer == "dcpx" else tdcp.save)(sd, checkpoint_id=p, no_dist=True)
        raw = (p / ".metadata").read_bytes()
        if writer == "dcpx":  # without its trailer, which would catch every change
            raw = raw[:-_metadata._TRAILER.size]
        raws.append((raw, _sizes(p)))
    rng = random.Random(12)
    accepted = 0
    for raw, sizes in raws:
        sizes = {k: 10**6 for k in sizes}
        for m in _mutations(raw, rng, 1500):
            try:
                accepted += _check_same(m, sizes)
            except (CorruptCheckpointError, UnsafeCheckpointError) as e:
                raise AssertionError(f"C accepted what Python refuses: {e}\n{m!r}") from None
    assert accepted > 0  # some mutations (in values) stay valid


def test_fuzz_corpus_never_accepted_with_another_meaning():
    """Every input of the metadata fuzzing corpus (fuzz/corpus): the C
    decoder accepts only what the general path accepts, with its meaning."""
    names = []
    for sub in ("fuzz_metadata", "fuzz_picklescan", "crashes"):
        d = os.path.join(CORPUS, sub)
        if os.path.isdir(d):
            names += [os.path.join(d, f) for f in sorted(os.listdir(d))]
    assert names
    for name in names:
        raw = open(name, "rb").read()
        try:
            _check_same(raw, {})
        except (CorruptCheckpointError, UnsafeCheckpointError) as e:
            raise AssertionError(f"{name}: C accepted what Python refuses: {e}") from None


def test_loaded_checkpoint_errors_name_key_and_file(tmp_path):
    """A CRC error found by the run made with the plan (_indexed_plan) is
    raised by the general path, naming the file and the key."""
    from conftest import flip_byte, locate
    sd = {f"k{i}": torch.arange(100, dtype=torch.float32) + i for i in range(5)}
    path = tmp_path / "c"
    dcpx.save(sd, checkpoint_id=path)
    file, off, _ = locate(path, dcpx.FileSystemReader(path).read_metadata(), "k3")
    flip_byte(file, off + 10)
    dst = {k: torch.zeros(100) for k in sd}
    with pytest.raises(CorruptCheckpointError, match=r"k3.*CRC|CRC.*k3"):
        dcpx.load(dst, checkpoint_id=path)
    with pytest.raises(CorruptCheckpointError, match=r"k3"):
        dcpx.load(dst, checkpoint_id=path)


def test_load_into_other_layouts_after_an_indexed_load(tmp_path):
    """After a load through the tables (no Metadata made), loads that need
    the Metadata (a cast, a missing key with allow_partial_load, a
    non-contiguous destination) decode it and read the right values."""
    sd = {f"k{i}": torch.randn(4, 3) for i in range(6)}
    sd["step"] = 5
    path = tmp_path / "c"
    dcpx.save(sd, checkpoint_id=path)
    dst = {k: torch.zeros(4, 3) for k in sd if k != "step"}
    dst["step"] = 0
    dcpx.load(dst, checkpoint_id=path)
    assert dst["step"] == 5
    for k in dst:
        if k != "step":
            assert_bit_equal(dst[k], sd[k], k)
    cast = {k: torch.zeros(4, 3, dtype=torch.float64) for k in dst if k != "step"}
    dcpx.load(cast, checkpoint_id=path)
    for k in cast:
        assert torch.equal(cast[k], sd[k].double())
    strided = {k: torch.zeros(3, 4).t() for k in cast}
    dcpx.load(strided, checkpoint_id=path)
    for k in strided:
        assert torch.equal(strided[k], sd[k])
    with pytest.raises(RuntimeError, match="Missing key"):
        dcpx.load({"nope": torch.zeros(1)}, checkpoint_id=path)
    reader = dcpx.FileSystemReader(path)
    dcpx.load({"k0": torch.zeros(4, 3)}, storage_reader=reader)
    assert set(k.fqn for k in reader.storage_data) == set(sd)


@pytest.mark.parametrize("which", ["conj", "neg", "both"])
def test_fresh_load_into_conj_and_neg_views(tmp_path, which):
    """Destinations with the conj or neg bit (which DLPack exports without
    saying) are never read into through the plan: a fresh load gives what
    torch's load gives."""
    g = torch.Generator().manual_seed(3)
    sd = {"a": torch.randn(4, 3, generator=g),
          "c": torch.randn(5, generator=g, dtype=torch.complex64),
          "r": torch.randn(6, generator=g)}
    path = tmp_path / "c"
    dcpx.save(sd, checkpoint_id=path)

    def dest():
        d = {"a": torch.zeros(4, 3), "c": torch.zeros(5, dtype=torch.complex64),
             "r": torch.zeros(6)}
        if which in ("conj", "both"):
            d["c"] = torch.zeros(5, dtype=torch.complex64).conj()
        if which in ("neg", "both"):
            d["r"] = torch._neg_view(torch.zeros(6))
        return d
    mine, theirs = dest(), dest()
    dcpx.load(mine, checkpoint_id=path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(theirs, checkpoint_id=path, no_dist=True)
    for k in sd:
        assert mine[k].is_conj() == theirs[k].is_conj() and mine[k].is_neg() == theirs[k].is_neg()
        assert torch.equal(mine[k].resolve_conj().resolve_neg(), sd[k]), k
        assert torch.equal(theirs[k].resolve_conj().resolve_neg(), sd[k]), k


@settings(max_examples=40, deadline=None)
@given(spec=st.lists(st.tuples(shapes, st.sampled_from(_DTYPES[:6])), min_size=1, max_size=8),
       data=st.data())
def test_fresh_loads_into_other_layouts_match_torch(spec, data):
    """Fresh checkpoints loaded into destinations that differ from what was
    saved: a subset of the keys, a key the checkpoint lacks (with and
    without allow_partial_load), another dtype (a cast), another shape (an
    error), a non-contiguous view.  dcpx raises exactly when torch raises,
    and otherwise leaves the same values."""
    import tempfile
    from torch.distributed.checkpoint import DefaultLoadPlanner
    sd = {f"p{i}.w": _tensor(shape, dtype, i) for i, (shape, dtype) in enumerate(spec)}
    sd["n"] = 3
    with tempfile.TemporaryDirectory() as path:
        dcpx.save(sd, checkpoint_id=path)
        keys = data.draw(st.lists(st.sampled_from(sorted(sd)), min_size=1, unique=True))
        changes = data.draw(st.lists(st.sampled_from(["none", "cast", "shape", "strided"]),
                                     min_size=len(keys), max_size=len(keys)))
        extra = data.draw(st.booleans())
        partial = data.draw(st.booleans())

        def dest():
            d = {}
            for k, how in zip(keys, changes):
                v = sd[k]
                if not isinstance(v, torch.Tensor):
                    d[k] = 0
                elif how == "cast" and v.dtype.is_floating_point:
                    d[k] = torch.zeros(v.shape, dtype=torch.float64)
                elif how == "shape":
                    d[k] = torch.zeros((*v.shape, 2), dtype=v.dtype)
                elif how == "strided" and v.dim() >= 1:
                    d[k] = torch.zeros((*v.shape, 2), dtype=v.dtype)[..., 0]
                else:
                    d[k] = torch.zeros(v.shape, dtype=v.dtype)
            if extra:
                d["absent.w"] = torch.zeros(2)
            return d

        outcome = []
        for lib in (dcpx, tdcp):
            _readplan.clear()
            d = dest()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    lib.load(d, checkpoint_id=path,
                             planner=DefaultLoadPlanner(allow_partial_load=partial),
                             **({"no_dist": True} if lib is tdcp else {}))
                outcome.append(d)
            except (Exception, tdcp.api.CheckpointException):  # a BaseException
                outcome.append(None)  # only whether each raises is compared
        mine, theirs = outcome
        assert (mine is None) == (theirs is None), (keys, changes, extra, partial)
        if mine is not None:
            for k in mine:
                if isinstance(mine[k], torch.Tensor):
                    assert_bit_equal(mine[k], theirs[k], k)
                else:
                    assert mine[k] == theirs[k], k


def test_refused_layouts_are_remembered_as_direct_plan_remembers_them(tmp_path):
    """As direct_plan + read_plan: a layout is remembered as one the plan
    refuses (no_direct) only when every key matches the metadata and a
    destination cannot be read into in place; a metadata mismatch anywhere
    (a cast here) makes it plan normally next time too."""
    sd = {f"k{i}": torch.randn(4, 3) for i in range(6)}
    path = tmp_path / "c"
    dcpx.save(sd, checkpoint_id=path)
    meta = os.path.join(path, ".metadata")
    for cast in (False, True):
        _readplan.clear()
        dst = {k: torch.zeros(4, 3) for k in sd}
        dst["k1"] = torch.zeros(3, 4).t()                       # refused: strided
        if cast:
            dst["k4"] = torch.zeros(4, 3, dtype=torch.float64)  # a mismatch: a cast
        dcpx.load(dst, checkpoint_id=path)
        for k in sd:
            assert torch.equal(dst[k], sd[k].to(dst[k].dtype)), k
        assert len(_readplan._cache[meta].no_direct) == (0 if cast else 1)


# ------------------------------------------------ many data files (issue 28)

def _many_files_metadata(nfiles: int, per_file: int) -> Metadata:
    """nfiles data files (one per rank, as a job of nfiles ranks writes),
    per_file whole-tensor keys in each, and a bytes key in the last."""
    props = TensorProperties(dtype=torch.float32)
    sdm, storage = {}, {}
    for f in range(nfiles):
        for j in range(per_file):
            k = f"r{f}.w{j}"
            sdm[k] = TensorStorageMetadata(props, torch.Size([4]), [
                ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))])
            storage[MetadataIndex(k, [0])] = _StorageInfo(f"__{f}_0.distcp", 64 * j, 64)
    sdm["step"] = BytesStorageMetadata()
    storage[MetadataIndex("step")] = _StorageInfo(f"__{nfiles - 1}_0.distcp", 64 * per_file, 9)
    return Metadata(sdm, storage_data=storage)


@pytest.mark.parametrize("nfiles", [33, 40, 1000])
@pytest.mark.parametrize("writer", ["torch", "dcpx"])
def test_decoder_takes_checkpoints_of_many_data_files(nfiles, writer):
    """The C decoder used to leave every checkpoint of more than 32 data
    files (a job of more than 32 ranks) to Python.  It takes them now, and
    reads the same tables as the general path; its size check takes one
    size per file, None for a file not checked (a load checks only the
    files it reads)."""
    md = _many_files_metadata(nfiles, 3)
    raw = _raw(md) if writer == "torch" else _metadata.dumps(md)
    found = _metadata.index(raw, "x")
    assert found is not None  # the C path, not Python's
    index, files = found
    assert files == [f"__{f}_0.distcp" for f in range(nfiles)]
    sizes = {name: 64 * 3 + 9 for name in files}
    assert _check_same(raw, sizes)
    # one file too short: refused, whichever it is; unchecked: not refused
    for short in (0, nfiles // 2, nfiles - 1):
        row = [sizes[n] for n in files]
        row[short] = 64 * 3 - 1
        assert _C.md_index_check(index, row) is False
        row[short] = None
        assert _C.md_index_check(index, row) is True
    assert _C.md_index_check(index, [None] * nfiles) is True
    with pytest.raises(ValueError, match="one size per file"):
        _C.md_index_check(index, [sizes[n] for n in files][:-1])
    with pytest.raises(TypeError):
        _C.md_index_check(index, ["64"] * nfiles)


def test_decoder_many_files_hostile_names_still_refused():
    """Past 32 files the names are still checked one by one: a file name
    that leaves the directory, anywhere among 1,000, leaves the file to the
    general path (which refuses it)."""
    for bad in ("../x", "a/b", ".."):
        md = _many_files_metadata(1000, 1)
        md.storage_data[MetadataIndex("r777.w0", [0])].relative_path = bad
        assert _metadata.index(_raw(md), "x") is None


def test_the_python_decode_of_indexed_bytes_is_not_validated_twice(tmp_path, monkeypatch):
    """A load that needs the Metadata objects (DTensor destinations,
    resharding) decodes the bytes the C decoder already accepted and
    checked: the graph is not walked by _validate again (the tests above
    hold the C decoder to accept only what _validate accepts).  Bytes the
    C decoder did not take are validated as always."""
    sd = {"w": torch.arange(6.0).reshape(2, 3), "n": 3}
    dcpx.save(sd, checkpoint_id=tmp_path / "c", no_dist=True)
    raw = (tmp_path / "c" / ".metadata").read_bytes()
    calls = []
    real = _metadata._validate
    monkeypatch.setattr(_metadata, "_validate", lambda md: (calls.append(1), real(md))[1])
    found = _metadata.index(raw, "x")
    assert found is not None
    indexed = _readplan.Checkpoint(None, raw, None, {}, "x", found[0], found[1])
    plain = _readplan.Checkpoint(None, raw, None, {}, "x")
    assert indexed.metadata == plain.metadata
    assert len(calls) == 1  # the plain one only
    assert set(indexed.metadata.state_dict_metadata) == {"w", "n"}
