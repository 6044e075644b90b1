"""The state dict walk: ``dcpx.coordination.flatten.flatten_state_dict`` (the C walk in
csrc/flatten.c, torch's function where it cannot be sure) returns exactly
what torch's ``flatten_state_dict`` returns.

Exactly means: the same keys byte for byte, in the same order; the same
mappings (OBJ_PATH tuples whose parts have the same types: str for mapping
keys, int for list indices); the very same value objects; and where torch
raises, the same exception type and message.  Most cases also check that
the C walk itself answered (``_C.flatten_state_dict`` did not return None),
so the equivalence is the C walk's, not the fallback's.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from collections import OrderedDict
from collections.abc import Mapping

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
try:
    from torch.distributed.checkpoint import _version
except ImportError:  # torch 2.4 has no _version (nor the 2.3 fallback walk)
    _version = None
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as torch_flatten

from dcpx import _C
from dcpx.coordination.flatten import flatten_state_dict


def _outcome(fn, sd):
    try:
        return "ok", fn(sd)
    except Exception as e:  # compared below: type and message
        return "raised", e


def assert_same(sd, *, c_walk: bool = True):
    """dcpx's result is torch's: keys (bytes, order, type), mappings (values
    and part types), value identity, or the same exception.  With c_walk,
    the C walk itself must have answered."""
    tk, theirs = _outcome(torch_flatten, sd)
    ok, ours = _outcome(flatten_state_dict, sd)
    if c_walk:
        ck, raw = _outcome(_C.flatten_state_dict, sd)
        assert not (ck == "ok" and raw is None), "the C walk fell back to torch's"
    assert ok == tk, (ours, theirs)
    if tk == "raised":
        assert type(ours) is type(theirs) and str(ours) == str(theirs)
        return
    flat, mappings = ours
    tflat, tmappings = theirs
    assert type(flat) is dict and type(mappings) is dict
    assert [type(k) for k in flat] == [str] * len(flat)
    assert [k.encode("utf-8", "surrogatepass") for k in flat] == \
        [k.encode("utf-8", "surrogatepass") for k in tflat]
    assert list(mappings) == list(tflat) == list(tmappings)
    assert list(mappings.values()) == list(tmappings.values())
    assert [tuple(map(type, p)) for p in mappings.values()] == \
        [tuple(map(type, p)) for p in tmappings.values()]
    assert all(type(p) is tuple for p in mappings.values())
    assert all(a is b for a, b in zip(flat.values(), tflat.values()))
    return flat, mappings


# --------------------------------------------------------------------------
# The shapes a state dict can take

class PairMapping(Mapping):
    """A Mapping that is not a dict: walked through its own items()."""

    def __init__(self, pairs):
        self._d = dict(pairs)

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


class Key:
    """A key that is neither str nor int: torch takes str(k)."""

    def __init__(self, s):
        self.s = s

    def __str__(self):
        return self.s

    def __repr__(self):
        return f"Key({self.s!r})"


class Stateful:
    """What dcpx.save turns into its state_dict() before the walk; inside a
    container, torch treats it as any other leaf."""

    def state_dict(self):
        return {"x": 1}

    def load_state_dict(self, sd):
        pass


class ListSub(list):
    pass


class TensorSub(torch.Tensor):
    pass


TENSORS = [torch.zeros(2), torch.ones(1, dtype=torch.int64), torch.nn.Parameter(torch.zeros(3)),
           torch.zeros(2).as_subclass(TensorSub), torch.empty(0)]
STATEFUL = Stateful()

keys = st.one_of(
    st.text(alphabet=st.sampled_from("ab.0_é\U0001f600"), max_size=4),
    st.text(max_size=3),
    st.integers(-3, 3), st.booleans(), st.none(), st.floats(allow_nan=False, width=16),
    st.tuples(st.integers(0, 2)),
    st.text(alphabet="ab.1", max_size=3).map(Key),
)
leaves = st.one_of(
    st.sampled_from(TENSORS), st.integers(), st.text(max_size=3), st.none(), st.booleans(),
    st.floats(allow_nan=False), st.binary(max_size=2), st.just(STATEFUL),
    st.just(()), st.just([]), st.just({}), st.builds(OrderedDict),
    st.tuples(st.sampled_from(TENSORS), st.integers()),
)


def containers(children):
    items = st.lists(st.tuples(keys, children), max_size=4)
    return st.one_of(
        st.dictionaries(keys, children, max_size=4),
        items.map(OrderedDict),
        items.map(PairMapping),
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.lists(children, max_size=3).map(ListSub),
    )


values = st.recursive(leaves, containers, max_leaves=25)
state_dicts = st.one_of(
    st.dictionaries(keys, values, max_size=5),
    st.lists(st.tuples(keys, values), max_size=5).map(OrderedDict),
    st.lists(st.tuples(keys, values), max_size=5).map(PairMapping),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state_dicts)
def test_any_nesting_matches_torch(sd):
    assert_same(sd)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "a.b", "b", "0", "a.0", "a.b.0"]),
                          st.recursive(st.sampled_from(TENSORS), containers, max_leaves=6)),
                max_size=6))
def test_colliding_keys_match_torch(pairs):
    """Keys with dots, and keys equal to list indices: duplicate FQNs."""
    assert_same(dict(pairs))


# --------------------------------------------------------------------------
# Hand-written: the state dicts dcpx sees, and torch's corner rules

def test_model_and_adam_state_dict():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    osd = opt.state_dict()
    assert set(osd["state"]) == {0, 1, 2, 3}  # int param ids
    flat, mappings = assert_same({"model": model.state_dict(), "optim": osd, "step": 7,
                                  "extra": STATEFUL})
    assert "optim.state.0.exp_avg" in flat
    assert mappings["optim.state.0.exp_avg"] == ("optim", "state", "0", "exp_avg")
    # params lists of ints and betas tuples are leaves
    assert flat["optim.param_groups.0.params"] == [0, 1, 2, 3]
    assert mappings["optim.param_groups.0.betas"] == ("optim", "param_groups", 0, "betas")
    assert flat["extra"] is STATEFUL
    assert_same(model.state_dict())  # an OrderedDict at the top


@pytest.mark.parametrize("sd", [
    {},
    {"a": {}},                                    # empty Mapping: no entry
    {"a": []}, {"a": ()}, {"a": [[]]},             # empty list / tuple: leaves
    {"a": [1, "x", None, (TENSORS[0],)]},          # terminal list: one leaf
    {"a": [1, TENSORS[0]]},                        # a tensor: walked
    {"a": [1, [2, [TENSORS[0]]]]},                 # list of lists
    {"a": [[1], [2]]},                             # terminal inner lists
    {"a": [1, {}]},                                # an (empty) Mapping: walked
    {"a": [TENSORS[2]]}, {"a": [TENSORS[3]]},      # Parameter, tensor subclass
    {"a": ListSub([1, TENSORS[0]])},
    {"a": (TENSORS[0], {"b": 1})},                 # tuples are leaves
    {1: TENSORS[0], 2.5: 1, None: 2, (1, 2): 3, True: 4, Key("k.x"): 5},
    {"a": {1: {2: TENSORS[0]}}},
    {"é": {"\U0001f600": {"\x00": 1}}},
    {"\ud800": {"a\udfff.": [TENSORS[0]]}},          # lone surrogates
    {"a": TENSORS[0], "b": TENSORS[0]},            # one tensor at two keys
    OrderedDict(b=1, a=2),
    PairMapping([("z", {"y": [TENSORS[0]]})]),
])
def test_shapes(sd):
    assert_same(sd)


def test_ordered_dict_order_is_its_own():
    """OrderedDict.move_to_end changes the order items() gives, not the
    underlying dict's: torch follows items()."""
    d = OrderedDict(a=1, b=2, c=3)
    d.move_to_end("a")
    flat, _ = assert_same({"x": d})
    assert list(flat) == ["x.b", "x.c", "x.a"]
    top = OrderedDict(a=1, b=2)
    top.move_to_end("a")
    assert list(assert_same(top)[0]) == ["b", "a"]


def test_dict_subclass_items_is_used():
    class Reversed(dict):
        def items(self):
            return list(reversed(list(super().items())))

    flat, _ = assert_same({"m": Reversed(a=1, b=2)})
    assert list(flat) == ["m.b", "m.a"]


def test_list_subclass_iteration_is_used():
    class Twice(list):
        def __iter__(self):
            for x in super().__iter__():
                yield x
                yield x

    assert list(assert_same({"l": Twice([TENSORS[0]])})[0]) == ["l.0", "l.1"]


@pytest.mark.parametrize("sd", [
    {"a.b": 1, "a": {"b": 2}},
    {"a": {"b": 2}, "a.b": 1},
    {1: TENSORS[0], "1": TENSORS[0]},
    {"a": [TENSORS[0]], "a.0": 1},
    {Key("x"): 1, "x": 2},
    {"a": {"b": 1}, "a.b.c": {}},                  # no collision: empty dict
])
def test_duplicate_fqns(sd):
    assert_same(sd)


def test_duplicate_message():
    with pytest.raises(ValueError, match=r"^duplicated flatten key a\.b$"):
        flatten_state_dict({"a.b": 1, "a": {"b": 2}})


# --------------------------------------------------------------------------
# What the state dict's own code does: raises, mutates, misbehaves

class Boom(Exception):
    pass


class RaisingItems(Mapping):
    def __getitem__(self, k):
        raise Boom("getitem")

    def __iter__(self):
        return iter(["a"])

    def __len__(self):
        return 1


class RaisingIter(PairMapping):
    def items(self):
        raise Boom("items")


class BadKey:
    def __str__(self):
        raise Boom("str")


class StrSub(str):
    def __str__(self):
        return "other"


class SubKey:
    def __str__(self):
        return StrSub("mine")


class NotPairs(PairMapping):
    def items(self):
        return [("a", 1, 2)]


class ListPairs(PairMapping):
    def items(self):
        return [["a", 1], ["b", [TENSORS[0]]]]


@pytest.mark.parametrize("sd", [
    {"m": RaisingItems()},
    {"m": RaisingIter({"a": 1})},
    RaisingIter({"a": 1}),
    {"ok": 1, BadKey(): 2},
    {"m": {"x": [1, {BadKey(): 1}]}},
])
def test_exceptions_propagate(sd):
    assert_same(sd)
    with pytest.raises(Boom):
        _C.flatten_state_dict(sd)


@pytest.mark.parametrize("sd", [
    {SubKey(): {"a": 1}},       # str() gives a str subclass: torch str()s it again
    {"m": NotPairs({})},        # too many values to unpack
    {"m": ListPairs({})},       # pairs as lists: unpacked all the same
    [("a", 1)],                 # not a Mapping at all: no .items()
])
def test_fallback_cases_are_torchs(sd):
    assert_same(sd, c_walk=False)
    if isinstance(sd, dict):
        assert _C.flatten_state_dict(sd) is None


class Grow:
    """A key whose str() adds an entry to the dict being walked."""

    def __init__(self, d):
        self.d = d

    def __str__(self):
        self.d["new"] = 1
        return "g"


class Swap(Grow):
    """A key whose str() replaces another entry: same size, other keys."""

    def __str__(self):
        if "z" in self.d:
            del self.d["z"]
            self.d["y"] = 1
        return "s"


@pytest.mark.parametrize("key", [Grow, Swap])
@pytest.mark.parametrize("last", [False, True])
def test_dict_changed_during_walk(key, last):
    def make():
        d = {}
        if last:
            d["z"] = 2
        d[key(d)] = 1
        if not last:
            d["z"] = 2
        return d

    tk, theirs = _outcome(torch_flatten, make())
    ok, ours = _outcome(_C.flatten_state_dict, make())
    assert ok == tk
    if tk == "raised":
        assert type(ours) is RuntimeError and str(ours) == str(theirs)
    else:  # an entry replaced after the walk passed it
        assert [list(x) for x in ours] == [list(x) for x in theirs]


def test_list_shrinking_during_walk():
    """Exact lists are read by index against their current length, as
    list iteration does."""
    class Shrink:
        def __init__(self, lst):
            self.lst = lst

        @property
        def __class__(self):  # isinstance() asks this; it pops the list
            if self.lst:
                self.lst.pop()
            return Shrink

    def make():
        lst = [TENSORS[0]]
        lst[:0] = [Shrink(lst)]
        lst.append(1)
        return {"l": lst}

    theirs = torch_flatten(make())
    ours = _C.flatten_state_dict(make())
    assert list(ours[0]) == list(theirs[0])
    assert list(ours[1].values()) == list(theirs[1].values())


@pytest.mark.skipif(_version is None, reason="torch 2.4 has no _version module "
                    "(no 2.3-layout fallback walk to take)")
def test_derived_version_2_3_uses_torchs_old_walk(monkeypatch):
    sd = {"a": {"b": 1}, "c": [TENSORS[0]]}
    monkeypatch.setattr(_version, "_derived_version", "2_3")
    flat, mappings = flatten_state_dict(sd)
    assert list(flat) == ["a", "c.0"]  # 2.3: a dict of non-tensors is a leaf
    assert (flat, mappings) == torch_flatten(sd)


def test_mapping_registry_change_falls_back():
    """A builtin registered as a Mapping changes torch's answers (a tuple
    is then walked by items()): the C walk must not use its fast path."""
    code = textwrap.dedent("""
        from collections.abc import Mapping
        import torch
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict as F
        from dcpx import _C
        from dcpx.coordination.flatten import flatten_state_dict
        sd = {"a": (1, 2), "b": {"c": torch.zeros(1)}}
        assert _C.flatten_state_dict(sd) is not None
        Mapping.register(tuple)
        assert _C.flatten_state_dict(sd) is None
        for fn in (F, flatten_state_dict):
            try:
                fn(sd)
            except AttributeError as e:
                print(type(e).__name__, e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], lines


# --------------------------------------------------------------------------
# Depth: deep nesting is torch's to decide, self reference never crashes

def _nested(depth, leaf):
    d = leaf
    for i in range(depth):
        d = {f"k{i}": d}
    return d


def _nested_list(depth, leaf):
    d = leaf
    for _ in range(depth):
        d = [d]
    return {"l": d}


def test_moderate_depth_in_c():
    assert_same(_nested(90, TENSORS[0]))
    assert_same(_nested_list(45, TENSORS[0]))  # is_terminal nests below each level


def test_past_max_depth_is_torchs():
    for sd in (_nested(150, TENSORS[0]), _nested_list(150, TENSORS[0])):
        assert _C.flatten_state_dict(sd) is None
        assert_same(sd, c_walk=False)


@pytest.mark.parametrize("make", [
    lambda: _nested(20000, 1),
    lambda: _nested_list(20000, TENSORS[0]),
])
def test_very_deep_raises_recursion_error(make):
    with pytest.raises(RecursionError):
        flatten_state_dict(make())


def test_self_reference_raises_recursion_error():
    d = {"a": 1}
    d["self"] = d
    lst = [TENSORS[0]]
    lst.append(lst)
    for sd in (d, {"l": lst}, {"m": PairMapping([("me", d)])}):
        with pytest.raises(RecursionError):
            flatten_state_dict(sd)
        assert _C.flatten_state_dict(sd) is None


@pytest.mark.skipif(sys.version_info >= (3, 12),
                    reason="3.12+ counts C recursion apart from sys.getrecursionlimit")
def test_recursion_limit_reached_in_c_is_torchs():
    """Called with little recursion room left, the C walk's
    Py_EnterRecursiveCall fails; torch's walk then raises its own error."""
    sd = _nested(60, 1)
    depth = 0
    f = sys._getframe()
    while f is not None:
        depth, f = depth + 1, f.f_back
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 30)
    try:
        c = _C.flatten_state_dict(sd)
        with pytest.raises(RecursionError):
            torch_flatten(sd)
    finally:
        sys.setrecursionlimit(old)
    assert c is None
    assert_same(sd)


# --------------------------------------------------------------------------
# References: nothing leaked, nothing released twice, on every path

def test_refcounts():
    t = torch.zeros(2)
    inner = [1, t]
    leaf_list = [1, 2]
    odict = OrderedDict(x=t)
    pm = PairMapping([("p", t)])
    key = "some.key"
    sd = {key: {"a": inner, "b": leaf_list, 3: odict, "pm": pm, "tup": (t,)}, "t": t}
    watched = [t, inner, leaf_list, odict, pm, key, sd, sd[key]]
    before = [sys.getrefcount(x) for x in watched]
    for _ in range(200):
        flat, mappings = _C.flatten_state_dict(sd)
    assert sys.getrefcount(flat) == 2 and sys.getrefcount(mappings) == 2
    # each path: the dict's reference, the loop's, getrefcount's argument
    assert {sys.getrefcount(p) for p in mappings.values()} == {3}
    del flat, mappings
    assert [sys.getrefcount(x) for x in watched] == before


@pytest.mark.parametrize("bad", [
    lambda t: {"a.b": t, "a": {"b": t}},                 # duplicate
    lambda t: {"a": [t, {"m": RaisingItems()}]},         # items() raises
    lambda t: {"a": t, "b": {BadKey(): t}},              # str(key) raises
    lambda t: {"a": t, "m": NotPairs({})},               # fallback: not pairs
    lambda t: {"a": t, SubKey(): t},                     # fallback: str subclass
    lambda t: {"a": t, "d": _nested(150, t)},            # fallback: depth
])
def test_refcounts_on_error_and_fallback_paths(bad):
    t = torch.zeros(2)
    sd = bad(t)
    watched = [t, sd] + list(sd.values())
    before = [sys.getrefcount(x) for x in watched]
    for _ in range(100):
        try:
            _C.flatten_state_dict(sd)
        except (ValueError, Boom):
            pass
    assert [sys.getrefcount(x) for x in watched] == before


# --------------------------------------------------------------------------
# dcpx's save, load and staging walk with it

def test_save_load_and_async_save_use_the_c_walk(tmp_path, monkeypatch):
    """With torch's function made to fail, dcpx still saves and loads
    nested state dicts (sync and async, staged): every flatten on those
    paths is the C walk's, and the keys are torch's (torch loads them)."""
    import torch.distributed.checkpoint as tdcp

    import dcpx
    from dcpx.coordination import flatten as _flatten

    def no(sd):
        raise AssertionError("torch's flatten_state_dict called")

    monkeypatch.setattr(_flatten, "_torch_flatten_state_dict", no)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"l": [torch.ones(2), 3]}}
    dcpx.save(sd, checkpoint_id=tmp_path / "sync")
    dcpx.async_save(sd, checkpoint_id=tmp_path / "async").result()
    for d in ("sync", "async"):
        out = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
               "extra": {"l": [torch.zeros(2), 0]}}
        dcpx.load(out, checkpoint_id=tmp_path / d)
        assert all(torch.equal(out["model"][k], v) for k, v in sd["model"].items())
        assert torch.equal(out["extra"]["l"][0], torch.ones(2))
        theirs = {"extra": {"l": [torch.zeros(2), 0]}}
        with warnings.catch_warnings():  # "torch.distributed is disabled"
            warnings.simplefilter("ignore")
            tdcp.load(theirs, checkpoint_id=tmp_path / d)  # torch's own walk
        assert torch.equal(theirs["extra"]["l"][0], torch.ones(2))
