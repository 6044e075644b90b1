"""dcpx.save then dcpx.load gives back exactly what was saved.

Covers every dtype torch.save can store, odd shapes and layouts (0-d, empty,
strided, views of a larger storage, aliases), nested containers of tensors
and plain values, Stateful objects, torch's model/optimizer state-dict
helpers, the in-place semantics of load, the errors torch raises for a
mismatched destination, and every FileSystemWriter option that changes the
file layout.
"""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import dcpx
from conftest import (
    KNOWN_BROKEN,
    SAVEABLE_DTYPES,
    UNSAVEABLE_DTYPES,
    assert_bit_equal,
    assert_state_bit_equal,
    data_files,
    dtype_id,
    dtype_params,
    empty_like_state,
    fast_writer,
    make_tensor,
    resolved,
    torch_save_supports,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*ComplexHalf support is experimental:UserWarning"),
]


def roundtrip(state, path, **writer_kw):
    """Save ``state``, load it into a zeroed copy of its structure, return
    the loaded copy."""
    dcpx.save(state, storage_writer=fast_writer(path, **writer_kw))
    dest = empty_like_state(state)
    dcpx.load(dest, checkpoint_id=path)
    return dest


# --------------------------------------------------------------------------
# dtypes

def test_dtype_lists_cover_the_interesting_dtypes():
    """The enumeration is programmatic; make sure it did find the dtypes this
    file is meant to cover."""
    names = {dtype_id(d) for d in SAVEABLE_DTYPES}
    unsaveable = {dtype_id(d) for d in UNSAVEABLE_DTYPES}
    for must in ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn",
                 "float8_e5m2", "complex32", "complex64", "complex128", "bool", "int8",
                 "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "bits8", "bits16"]:
        if must in ("uint16", "uint32", "uint64") and not torch_save_supports(getattr(torch, must)):
            # torch 2.4's torch.save refuses them ("dtype torch.uint16 is not
            # recognized"; torch 2.5 stores them): dcpx must refuse them too
            assert must in unsaveable
            continue
        assert must in names
    # (torch 2.4 has no int1..int7 dtypes)
    assert {n for n in ("int1", "int4", "uint1", "uint7") if hasattr(torch, n)} <= unsaveable


@pytest.mark.parametrize("dtype", dtype_params(SAVEABLE_DTYPES))
def test_every_saveable_dtype_round_trips_bit_exactly(dtype, ckpt, gen):
    state = {
        "matrix": make_tensor((5, 7), dtype, gen),
        "scalar": make_tensor((), dtype, gen),
        "empty": make_tensor((0, 3), dtype, gen),
        "strided": make_tensor((6, 8), dtype, gen)[::2, 1::3].T,
        "big": make_tensor((300_000,), dtype, gen),  # > 1 MiB for most: streamed
    }
    loaded = roundtrip(state, ckpt)
    assert_state_bit_equal(loaded, resolved(state))


@pytest.mark.parametrize("dtype", [pytest.param(d, id=dtype_id(d)) for d in UNSAVEABLE_DTYPES])
def test_dtypes_torch_save_rejects_are_refused_naming_the_key(dtype, ckpt):
    state = {"fine": torch.ones(3), "sub.byte": torch.zeros(4, dtype=dtype)}
    with pytest.raises(TypeError, match=rf"'sub\.byte'.*{dtype_id(dtype)}"):
        dcpx.save(state, checkpoint_id=ckpt)
    assert not os.path.exists(os.path.join(ckpt, ".metadata"))
    assert not os.path.isdir(ckpt) or data_files(ckpt) == []


def test_float_special_bit_patterns_survive(ckpt):
    bits = torch.tensor([
        0x7FF8000000000000,    # quiet NaN
        0x7FF0000000000001,    # signalling NaN
        0x7FF8DEADBEEF0001,    # NaN with a payload
        -0x0008000000000000,   # negative quiet NaN (0xFFF8...)
        0x7FF0000000000000,    # +inf
        -0x0010000000000000,   # -inf (0xFFF0...)
        -0x8000000000000000,   # -0.0
        0x0000000000000001,    # smallest denormal
    ], dtype=torch.int64)
    f64 = bits.view(torch.float64)
    f32 = torch.tensor([0x7FC00001, 0x7F800001, -0x80000000, 0x00000001],
                       dtype=torch.int32).view(torch.float32)
    f16 = torch.tensor([0x7E01, 0x7C01, -0x8000, 0x0001], dtype=torch.int16).view(torch.float16)
    bf16 = torch.tensor([0x7FC1, 0x7F81, -0x8000, 0x0001], dtype=torch.int16).view(torch.bfloat16)
    state = {"f64": f64, "f32": f32, "f16": f16, "bf16": bf16,
             "c64": torch.complex(f32, f32.flip(0))}
    loaded = roundtrip(state, ckpt)
    assert_state_bit_equal(loaded, state)
    assert (loaded["f64"].view(torch.int64) == bits).all()


# --------------------------------------------------------------------------
# shapes and layouts

@pytest.mark.parametrize("shape", [(), (0,), (0, 4), (4, 0), (2, 0, 3), (1,), (1, 1, 1)],
                         ids=str)
def test_zero_dim_and_empty_tensors(shape, ckpt, gen):
    state = {"t": make_tensor(shape, torch.float32, gen),
             "i": make_tensor(shape, torch.int64, gen)}
    loaded = roundtrip(state, ckpt)
    assert_state_bit_equal(loaded, state)


def test_empty_state_dict(ckpt):
    dcpx.save({}, checkpoint_id=ckpt)
    assert os.path.exists(os.path.join(ckpt, ".metadata"))
    dcpx.load({}, checkpoint_id=ckpt)


@pytest.mark.parametrize("make", [
    lambda g: make_tensor((6, 9), torch.float32, g).T,
    lambda g: make_tensor((40,), torch.int16, g)[3:37:4],
    lambda g: make_tensor((5, 6, 7), torch.float64, g).permute(2, 0, 1)[:, 1:, ::2],
    lambda g: make_tensor((1, 7), torch.bfloat16, g).expand(5, 7),
    lambda g: make_tensor((4, 4), torch.complex64, g).conj(),
    lambda g: make_tensor((4, 4), torch.complex64, g).conj().imag,  # a neg view
    lambda g: make_tensor((1200, 1100), torch.float32, g)[::2, ::3],  # > 1 MiB, gathered
], ids=["transposed", "sliced-step", "permuted-sliced", "expanded", "conj",
        "neg-view", "large-strided"])
def test_non_contiguous_sources(make, ckpt, gen):
    t = make(gen)
    assert not t.is_contiguous() or t.is_conj() or t.is_neg()
    loaded = roundtrip({"t": t}, ckpt)
    assert_bit_equal(loaded["t"], resolved(t))


def test_view_of_a_large_storage_stores_only_the_view(ckpt):
    base = torch.randn(1 << 20)  # 4 MiB of storage
    view = base[1000:1016]       # 64 bytes of it
    loaded = roundtrip({"v": view}, ckpt)
    assert_bit_equal(loaded["v"], view)
    total = sum(os.path.getsize(os.path.join(ckpt, f)) for f in data_files(ckpt))
    assert total < 16 * 1024, f"data files hold {total} bytes for a 64-byte view"


def test_aliased_tensors(ckpt, gen):
    """Keys that share storage are saved (and loaded) independently."""
    base = make_tensor((4, 5), torch.float32, gen)
    state = {"base": base, "same": base, "row": base[1], "col": base[:, 2],
             "flat": base.view(-1)}
    loaded = roundtrip(state, ckpt)
    assert_state_bit_equal(loaded, resolved(state))
    # and the loaded tensors are independent objects
    loaded["base"].zero_()
    assert_bit_equal(loaded["same"], base)


def test_loading_into_non_contiguous_destinations(ckpt, gen):
    src = make_tensor((6, 4), torch.float32, gen)
    dcpx.save({"t": src, "u": src[::2]}, checkpoint_id=ckpt)
    big = torch.zeros(4, 6)
    other = torch.zeros(6, 4)
    dest = {"t": big.T, "u": other[::2]}
    dcpx.load(dest, checkpoint_id=ckpt)
    assert_bit_equal(big.T, src)
    assert_bit_equal(other[::2], src[::2])
    assert (other[1::2] == 0).all()  # rows in between untouched


# --------------------------------------------------------------------------
# autograd

def test_requires_grad_tensors(ckpt):
    w = torch.randn(3, 4, requires_grad=True)
    (w * 2).sum().backward()  # has a grad; must not matter
    md = dcpx.save({"w": w, "plain": torch.ones(2)}, checkpoint_id=ckpt)
    assert md.state_dict_metadata["w"].properties.requires_grad is True
    assert md.state_dict_metadata["plain"].properties.requires_grad is False
    on_disk = dcpx.FileSystemReader(ckpt).read_metadata()
    assert on_disk.state_dict_metadata["w"].properties.requires_grad is True

    param = torch.nn.Parameter(torch.zeros(3, 4))
    dest = {"w": param, "plain": torch.zeros(2)}
    dcpx.load(dest, checkpoint_id=ckpt)
    assert dest["w"] is param and param.requires_grad
    assert_bit_equal(param.detach(), w.detach())


# --------------------------------------------------------------------------
# containers and non-tensor values

def nested_state(gen):
    return {
        "model": {"layer1": {"weight": make_tensor((3, 4), torch.float32, gen),
                             "bias": make_tensor((3,), torch.float32, gen)},
                  "layer2": {"weight": make_tensor((2, 3), torch.bfloat16, gen)}},
        "list": [make_tensor((2,), torch.int64, gen), make_tensor((3,), torch.float16, gen),
                 {"inner": make_tensor((1,), torch.float64, gen)}],
        "tuple": (make_tensor((2,), torch.float32, gen), 5, "five"),
        "mixed_list": [1, make_tensor((2,), torch.uint8, gen)],
        "step": 10,
        "name": "experiment-7",
        "ints": [1, 2, 3],
        "none": None,
        "hparams": {"lr": 0.1, "momentum": 0.9, "eps": 1e-8},
        "flag": True,
    }


def test_nested_containers_and_plain_values(ckpt, gen):
    state = nested_state(gen)
    md = dcpx.save(state, checkpoint_id=ckpt)
    # flattened exactly like torch: dicts and tensor-holding lists are walked
    assert "model.layer1.weight" in md.state_dict_metadata
    assert "list.2.inner" in md.state_dict_metadata
    assert "hparams.lr" in md.state_dict_metadata
    dest = empty_like_state(state)
    dcpx.load(dest, checkpoint_id=ckpt)
    assert_state_bit_equal(dest, state)
    assert isinstance(dest["tuple"], tuple)


# --------------------------------------------------------------------------
# Stateful objects

class Counter:
    """A minimal Stateful: load must call load_state_dict with the loaded
    values (not the placeholders it handed out)."""

    def __init__(self, count: int, weights: torch.Tensor):
        self.count = count
        self.weights = weights
        self.loaded = []

    def state_dict(self):
        return {"count": self.count, "weights": self.weights, "tag": f"c{self.count}"}

    def load_state_dict(self, sd):
        self.loaded.append(sd)
        self.count = sd["count"]
        self.weights = sd["weights"]


def test_stateful_object(ckpt, gen):
    src = Counter(41, make_tensor((3, 3), torch.float32, gen))
    assert isinstance(src, dcpx.Stateful)
    dcpx.save({"app": src, "extra": torch.ones(2)}, checkpoint_id=ckpt)

    dst = Counter(0, torch.zeros(3, 3))
    weights = dst.weights
    dcpx.load({"app": dst, "extra": torch.zeros(2)}, checkpoint_id=ckpt)
    assert len(dst.loaded) == 1
    got = dst.loaded[0]
    assert got["count"] == 41 and got["tag"] == "c41"
    assert got["weights"] is weights  # loaded in place into the tensor it gave
    assert_bit_equal(dst.weights, src.weights)


class AppState:
    """torch's recommended wrapper: model + optimizer behind Stateful."""

    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optimizer,
                       model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def make_trained(seed, lr):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_module_and_optimizer_via_torch_state_dict_helpers(ckpt):
    model, opt = make_trained(0, lr=1e-3)
    dcpx.save({"app": AppState(model, opt), "epoch": 3}, checkpoint_id=ckpt)

    model2, opt2 = make_trained(1, lr=5e-2)  # different weights, state and lr
    params_before = [p for p in model2.parameters()]
    dest = {"app": AppState(model2, opt2), "epoch": 0}
    dcpx.load(dest, checkpoint_id=ckpt)
    assert dest["epoch"] == 3
    for p, q, same in zip(model.parameters(), model2.parameters(), params_before):
        assert q is same
        assert_bit_equal(q.detach(), p.detach())
    assert opt2.param_groups[0]["lr"] == 1e-3
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert_bit_equal(s2[k][name], s1[k][name])


# --------------------------------------------------------------------------
# load semantics

def test_load_is_in_place(ckpt, gen):
    src = {"a": make_tensor((4, 4), torch.float32, gen),
           "nested": {"b": make_tensor((10,), torch.int32, gen)}}
    dcpx.save(src, checkpoint_id=ckpt)
    a, b = torch.zeros(4, 4), torch.zeros(10, dtype=torch.int32)
    nested = {"b": b}
    dest = {"a": a, "nested": nested}
    ptr_a, ptr_b = a.data_ptr(), b.data_ptr()
    dcpx.load(dest, checkpoint_id=ckpt)
    assert dest["a"] is a and dest["nested"] is nested and nested["b"] is b
    assert a.data_ptr() == ptr_a and b.data_ptr() == ptr_b
    assert_bit_equal(a, src["a"])
    assert_bit_equal(b, src["nested"]["b"])


def test_missing_key_raises_like_torch(ckpt):
    dcpx.save({"a": torch.ones(2)}, checkpoint_id=ckpt)
    dest = {"a": torch.zeros(2), "not_saved": torch.zeros(2)}
    with pytest.raises(RuntimeError, match="Missing key in checkpoint state_dict: not_saved"):
        dcpx.load(dest, checkpoint_id=ckpt)


def test_unexpected_keys_in_checkpoint_are_ignored(ckpt, gen):
    src = {"a": make_tensor((3,), torch.float32, gen), "b": torch.ones(5), "c": "text"}
    dcpx.save(src, checkpoint_id=ckpt)
    dest = {"a": torch.zeros(3)}
    dcpx.load(dest, checkpoint_id=ckpt)
    assert set(dest) == {"a"}
    assert_bit_equal(dest["a"], src["a"])


def test_shape_mismatch_names_the_key(ckpt):
    dcpx.save({"layer.weight": torch.ones(3, 4)}, checkpoint_id=ckpt)
    dest = {"layer": {"weight": torch.zeros(4, 3)}}
    with pytest.raises((ValueError, RuntimeError), match=r"layer\.weight"):
        dcpx.load(dest, checkpoint_id=ckpt)
    assert (dest["layer"]["weight"] == 0).all()


def test_dtype_mismatch_casts_as_torch(ckpt):
    """torch casts into the destination's dtype, and so does dcpx (every
    pair: tests/test_dtype_cast.py)."""
    dcpx.save({"w": torch.tensor([1.5, -2.25, 3.0])}, checkpoint_id=ckpt)
    dest = {"w": torch.zeros(3, dtype=torch.float64)}
    dcpx.load(dest, checkpoint_id=ckpt)
    assert dest["w"].tolist() == [1.5, -2.25, 3.0]


def test_tensor_saved_value_loaded_into_a_non_tensor_names_the_key(ckpt):
    dcpx.save({"w": torch.ones(3)}, checkpoint_id=ckpt)
    with pytest.raises((TypeError, ValueError), match="'w'"):
        dcpx.load({"w": 3}, checkpoint_id=ckpt)


# --------------------------------------------------------------------------
# writer options

def many_items(gen):
    state = {f"t{i}": make_tensor((100 * (i + 1),), torch.float32, gen) for i in range(8)}
    state["step"] = 7
    state["name"] = "run"
    return state


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_thread_count_one_file_per_thread(threads, ckpt, gen):
    state = many_items(gen)
    loaded = roundtrip(state, ckpt, thread_count=threads)
    assert len(data_files(ckpt)) == threads
    assert_state_bit_equal(loaded, state)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_reader_thread_count(threads, ckpt, gen):
    state = many_items(gen)
    dcpx.save(state, storage_writer=fast_writer(ckpt, thread_count=2))
    dest = empty_like_state(state)
    dcpx.load(dest, storage_reader=dcpx.FileSystemReader(ckpt, thread_count=threads))
    assert_state_bit_equal(dest, state)


def test_one_file_per_item(ckpt, gen):
    state = many_items(gen)
    loaded = roundtrip(state, ckpt, single_file_per_rank=False)
    assert len(data_files(ckpt)) == len(state)
    assert_state_bit_equal(loaded, state)


@pytest.mark.parametrize("sync", [True, False])
def test_sync_files_option(sync, ckpt, gen):
    state = many_items(gen)
    dcpx.save(state, storage_writer=dcpx.FileSystemWriter(ckpt, sync_files=sync))
    dest = empty_like_state(state)
    dcpx.load(dest, checkpoint_id=ckpt)
    assert_state_bit_equal(dest, state)


def test_thread_count_must_be_positive(ckpt):
    with pytest.raises(ValueError, match="thread_count"):
        dcpx.FileSystemWriter(ckpt, thread_count=0)


def test_save_returns_the_metadata_it_wrote(ckpt, gen):
    state = many_items(gen)
    md = dcpx.save(state, checkpoint_id=ckpt)
    on_disk = dcpx.FileSystemReader(ckpt).read_metadata()
    assert md.state_dict_metadata == on_disk.state_dict_metadata
    assert md.storage_data == on_disk.storage_data


# --------------------------------------------------------------------------
# property: any state dict round-trips

_PROPERTY_DTYPES = [d for d in SAVEABLE_DTYPES if d not in KNOWN_BROKEN]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(_PROPERTY_DTYPES))
    ndim = draw(st.integers(0, 3))
    shape = draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim))
    t = make_tensor(shape, dtype, torch.Generator().manual_seed(draw(st.integers(0, 2**31))))
    layout = draw(st.sampled_from(["contiguous", "transposed", "stepped", "narrowed"]))
    if layout == "transposed" and ndim >= 2:
        t = t.transpose(0, ndim - 1)
    elif layout == "stepped" and ndim >= 1:
        t = t[::2]
    elif layout == "narrowed" and ndim >= 1 and shape[0] > 1:
        t = t[1:]
    return t


keys = st.text(alphabet="abcxyz_0123", min_size=1, max_size=6)
leaves = st.one_of(tensors(), st.integers(-10**6, 10**6), st.text(max_size=8), st.none(),
                   st.lists(st.integers(0, 100), max_size=4))
state_dicts = st.dictionaries(keys, st.one_of(leaves, st.dictionaries(keys, leaves, max_size=3)),
                              max_size=6)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(state=state_dicts)
def test_property_random_state_dicts_round_trip(state, tmp_path_factory):
    path = tmp_path_factory.mktemp("prop")
    dcpx.save(state, storage_writer=fast_writer(path))
    dest = empty_like_state(state)
    dcpx.load(dest, checkpoint_id=path)
    assert_state_bit_equal(dest, resolved(state))
