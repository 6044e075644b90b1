"""dcpx's one save planner (dcpx/coordination/plan.py): the one rule for which values
dcpx plans itself, and the reuse of a single-process save's plan by the
next save of the same layout.

Reuse must never write what a fresh plan would not: every save below is
loaded back bit for bit with dcpx and with torch's own reader, after the
layout changed in each way that changes the plan (a key added, removed or
renamed, a shape, dtype or requires_grad changed), and in the ways that
must not reuse stale data (a tensor replaced at the same key, a non-tensor
value changed, non-contiguous strides, another directory)."""
from __future__ import annotations

import warnings

import pytest
import os

import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from conftest import assert_state_bit_equal, empty_like_state, fast_writer, resolved
from dcpx import _api
from dcpx.coordination import dist as _dist


class Plain(torch.Tensor):
    """A tensor subclass with its own storage and no __tensor_flatten__."""


class Wrapper(torch.Tensor):
    """A subclass that says it wraps other tensors (as Float8 / NF4 do)."""

    def __tensor_flatten__(self):
        return [], None


def _values():
    base = torch.arange(6.0)
    return {
        "tensor": base,
        "param": torch.nn.Parameter(base.clone()),
        "subclass": base.clone().as_subclass(Plain),
        "wrapper": base.clone().as_subclass(Wrapper),
        "int": 3,
        "str": "x",
        "list": [1, 2],
    }


@pytest.mark.parametrize("name", list(_values()))
def test_one_rule_for_one_process_and_for_several_ranks(name):
    # Before: _api._is_plain_tensor took unknown subclasses, _dist.fast_value
    # refused them, so one value was planned by dcpx alone and by torch with ranks.
    v = _values()[name]
    assert _api._is_plain_or_value(v) == _dist.fast_value(v)
    assert _dist.fast_value(v) == (name != "wrapper")


def _load_both(path, want):
    """Load ``path`` with dcpx and with torch's reader; both bit-exact."""
    got = empty_like_state(want)
    dcpx.load(got, checkpoint_id=path)
    assert_state_bit_equal(got, resolved(want))
    got = empty_like_state(want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(got, storage_reader=tdcp.FileSystemReader(path))  # no_dist inferred
    assert_state_bit_equal(got, resolved(want))


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"w{i}": torch.randn(3 + i, 4, generator=g) for i in range(6)},
        "opt": {"step": 7, "lr": [0.1, 0.2], "m": torch.randn(5, generator=g)},
        "i8": torch.randint(-100, 100, (9,), dtype=torch.int8, generator=g),
    }


def _shared(m1, m2, key):
    return m1.state_dict_metadata[key] is m2.state_dict_metadata[key]


def _change(name, sd):
    """Change ``sd`` in place in one way; whether the plan may be reused."""
    if name == "same":
        sd["model"]["w0"].add_(1)               # new values, same layout
        return True
    if name == "replaced":
        sd["model"]["w1"] = torch.randn(4, 4)   # another tensor, same shape
        return True
    if name == "value":
        sd["opt"]["step"] = 10 ** 30            # a longer pickle: offsets move
        sd["opt"]["lr"] = [0.3] * 50
        return True
    if name == "strides":
        sd["model"]["w2"] = torch.randn(4, 5).t()   # same shape (5, 4), transposed
        return True
    if name == "added":
        sd["model"]["w9"] = torch.randn(2)
        return False
    if name == "removed":
        del sd["model"]["w3"]
        return False
    if name == "renamed":
        sd["model"]["w3x"] = sd["model"].pop("w3")
        return False
    if name == "reordered":
        sd["model"] = dict(reversed(sd["model"].items()))
        return False
    if name == "shape":
        sd["model"]["w4"] = torch.randn(8, 4)
        return False
    if name == "dtype":
        sd["model"]["w5"] = sd["model"]["w5"].double()
        return False
    if name == "requires_grad":
        sd["opt"]["m"] = torch.nn.Parameter(sd["opt"]["m"])
        return False
    if name == "tensor_to_value":
        sd["i8"] = 5
        return False
    raise AssertionError(name)


CHANGES = ["same", "replaced", "value", "strides", "added", "removed", "renamed",
           "reordered", "shape", "dtype", "requires_grad", "tensor_to_value"]


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("threads", [1, 3])
def test_plan_reused_only_when_the_layout_is_the_same(tmp_path, change, threads):
    sd = _state()
    p1, p2 = str(tmp_path / "a"), str(tmp_path / "b")
    m1 = dcpx.save(sd, storage_writer=fast_writer(p1, thread_count=threads))
    _load_both(p1, sd)
    reusable = _change(change, sd)
    m2 = dcpx.save(sd, storage_writer=fast_writer(p2, thread_count=threads))
    _load_both(p2, sd)
    # The metadata of an unchanged tensor is the previous save's own object
    # exactly when the plan was reused.
    assert _shared(m1, m2, "model.w0") == reusable
    # and the same directory again, after the change
    m3 = dcpx.save(sd, storage_writer=fast_writer(p1, thread_count=threads))
    assert _shared(m2, m3, "model.w0")
    _load_both(p1, sd)


def test_plan_not_reused_across_writer_configurations(tmp_path):
    sd = _state()
    m1 = dcpx.save(sd, storage_writer=fast_writer(str(tmp_path / "a"), thread_count=1))
    m2 = dcpx.save(sd, storage_writer=fast_writer(str(tmp_path / "b"), thread_count=2))
    m3 = dcpx.save(sd, storage_writer=fast_writer(str(tmp_path / "c"), thread_count=2,
                                                  single_file_per_rank=False))
    assert not _shared(m1, m2, "model.w0") and not _shared(m2, m3, "model.w0")
    assert len({si.relative_path for si in m3.storage_data.values()}) == 10
    assert len({si.relative_path for si in m2.storage_data.values()}) == 2
    for p in "abc":
        _load_both(str(tmp_path / p), sd)


def test_returned_metadata_does_not_change_the_next_save(tmp_path):
    sd = _state()
    m1 = dcpx.save(sd, storage_writer=fast_writer(str(tmp_path / "a")))
    m1.state_dict_metadata.clear()
    m1.storage_data.clear()
    m2 = dcpx.save(sd, storage_writer=fast_writer(str(tmp_path / "b")))
    assert len(m2.state_dict_metadata) == 10 and len(m2.storage_data) == 10
    _load_both(str(tmp_path / "b"), sd)


def test_many_saves_alternating_layouts_load_exactly(tmp_path):
    # More layouts than the cache keeps: plans are evicted and rebuilt.
    layouts = [_state(seed) for seed in range(3)]
    for s, sd in enumerate(layouts):
        for k in range(s):
            sd["model"][f"extra{k}"] = torch.full((k + 1,), float(k))
    layouts += [{"only": torch.ones(3)}, {"x": 1}, {}]
    for rnd in range(3):
        for i, sd in enumerate(layouts):
            for t in sd.get("model", {}).values():
                t.add_(1)
            path = str(tmp_path / f"r{rnd}l{i}")
            dcpx.save(sd, storage_writer=fast_writer(path, thread_count=1 + i % 2))
            _load_both(path, sd)


def test_async_save_reuses_and_writes_each_saves_values(tmp_path):
    sd = _state()
    for i in range(3):
        sd["model"]["w0"].fill_(float(i))
        path = str(tmp_path / f"s{i}")
        dcpx.async_save(sd, checkpoint_id=path).result()
        _load_both(path, sd)


# ------------------------------------------------------------ payloads

def test_direct_payload_keeps_every_refusal_after_its_dtype_was_seen(tmp_path):
    # The unchecked path (_pending._direct_payload) takes float32 once a
    # float32 tensor was checked; what is not a plain dense CPU tensor must
    # still be refused, naming the key.
    dcpx.save({"ok": torch.ones(2)}, storage_writer=fast_writer(str(tmp_path / "a")))
    bad = {
        "meta": (torch.empty(3, device="meta"), ValueError),
        "sparse": (torch.ones(3).to_sparse(), TypeError),
        "nested": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), TypeError),
    }
    for name, (t, exc) in bad.items():
        with pytest.raises(Exception, match=name) as info:
            dcpx.save({name: t}, storage_writer=fast_writer(str(tmp_path / name)))
        assert isinstance(info.value, exc) or exc.__name__ in str(info.value)


def test_direct_payload_resolves_views_and_grads(tmp_path):
    c = torch.randn(4, dtype=torch.complex64)
    sd = {"c": c, "conj": c.conj(), "neg": c.conj().imag, "t": torch.randn(3, 5).t(),
          "p": torch.nn.Parameter(torch.randn(4)), "g": torch.randn(3, requires_grad=True) * 2}
    for i in range(2):  # the second save: every dtype seen, plan reused
        path = str(tmp_path / f"s{i}")
        dcpx.save(sd, storage_writer=fast_writer(path))
        _load_both(path, {k: v.detach() for k, v in sd.items()})


# ------------------------------------------------------------ archives

def test_archives_of_repeated_shapes_are_whole_and_distinct(tmp_path):
    # The C writer clones the archive head and tail of a storage type and
    # shape it built before (csrc/writer.c, find_template), changing only
    # the serialization id and its CRCs: every member of every archive must
    # pass the zip CRC check, with ids that are all different, and load.
    import io
    import zipfile

    from conftest import item_slices
    shapes = [(3, 4), (5,), (), (3, 4), (0,), (2, 2, 2), (5,)] * 6
    dts = [torch.float32, torch.bfloat16, torch.int64, torch.float32]
    sd = {f"t{i}": torch.randn(s).to(dts[i % 4]) for i, s in enumerate(shapes)}
    sd["big"] = torch.randn(300_000)             # > 1 MiB: the streamed path
    sd["big2"] = torch.randn(300_000)
    path = str(tmp_path / "c")
    md = dcpx.save(sd, storage_writer=fast_writer(path))
    ids = set()
    for key, raw, _ in item_slices(path, md):
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            assert z.testzip() is None, key
            ids.add(z.read("archive/.data/serialization_id"))
            with z.open("archive/data.pkl") as f:
                assert f.read()
    assert len(ids) == len(sd)
    _load_both(path, sd)


# ------------------------------------------------------------ several ranks

def test_coordinator_reuses_the_global_plan_of_identical_rank_plans(tmp_path):
    import pickle

    def blob(items, mappings):
        return pickle.dumps((items, mappings), protocol=pickle.HIGHEST_PROTOCOL)

    def coordinate(items, mappings):
        w = dcpx.FileSystemWriter(str(tmp_path / "c"))
        try:
            plan, replies = _dist._coordinate(w, [("ok", blob(items, mappings), "c")] * 2)
        finally:
            w._release_tag()
        assert [r[0] for r in replies] == ["ok", "ok"]
        return plan

    items = [_dist.LocalItem(f"p{i}", (0,), (4,), (4,), torch.float32, False, False, 16)
             for i in range(5)]
    plan1 = coordinate(items, {"p0": ("p0",)})
    assert coordinate(items, {"p0": ("p0",)}) is plan1           # same plans: reused
    changed = items[:4] + [items[4]._replace(sizes=(8,), size=(8,), nbytes=32)]
    plan3 = coordinate(changed, {"p0": ("p0",)})
    assert plan3 is not plan1 and plan3.state_dict_metadata["p4"].size == torch.Size([8])
    plan4 = coordinate(items, {"p0": ("q", "p0")})                # mappings differ
    assert plan4 is not plan1 and plan4.planner_data == {"p0": ("q", "p0")}


def test_reused_plan_stores_each_key_once(tmp_path):
    """A later save of the same layout from a new state dict (new, equal key
    strings, as model.state_dict() makes every call) writes metadata of the
    same size as the first: the reused plan's key strings are the ones the
    pickle stores, not a second copy of each from the new state dict."""
    def state(seed):
        g = torch.Generator().manual_seed(seed)
        # keys built at run time: equal strings, distinct objects per call
        return {"".join(["layer", str(i), ".w"]): torch.randn(3, generator=g)
                for i in range(200)}
    sizes = []
    for i in range(3):
        path = tmp_path / f"c{i}"
        dcpx.save(state(i), storage_writer=dcpx.FileSystemWriter(path, sync_files=False))
        sizes.append(os.path.getsize(path / ".metadata"))
        out = {k: torch.zeros(3) for k in state(i)}
        dcpx.load(out, checkpoint_id=path)
        for k, v in state(i).items():
            assert torch.equal(out[k], v), k
    assert sizes[1] == sizes[0] and sizes[2] == sizes[0], sizes
