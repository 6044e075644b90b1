"""Adversarial tests of the save-side fast paths that skip work when
"nothing changed" since the previous save: the plan cache (dcpx/coordination/plan.py,
``_C.scan_plain``), the reused metadata encoding (``_metadata.Splice``, the
split form of ``.metadata``), the stager's reuse of its layout
(``DefaultStager._reuse``, ``_flat_as_is``), the upload's kept payloads
(``staging.UploadScan``, base items of the C writer) and the checkpoint
process's kept views (``_process._StagedViews``).

Every test saves a sequence of state dicts that differ in one thing at a
time (values, dtype, shape, requires_grad, storage, contiguity, a tensor
becoming a non-tensor and back, non-tensor contents, key order, keys added
or removed, nesting, checkpoint path, Stateful objects, failed saves) with
the same writer / stager / directory or with new ones, and after every save
loads the checkpoint into a fresh state dict with ``dcpx.load`` (read-plan
cache cleared and not) and with ``torch.distributed.checkpoint.load``,
comparing bit-exact, non-tensor values by type and value, and the metadata
(dtype, size, requires_grad of every tensor, non-tensors as bytes, the
planner data) with what was saved."""
from __future__ import annotations

import copy
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

import dcpx
import dcpx.storage.commit
from conftest import SAVEABLE_DTYPES, make_tensor, raw_bytes
from dcpx.coordination import plan as _plan, readplan as _readplan
from dcpx.coordination.flatten import flatten_state_dict


THREAD = dcpx.AsyncCheckpointerType.THREAD
PROCESS = dcpx.AsyncCheckpointerType.PROCESS


# ---------------------------------------------------------------- checking

def _snapshot(obj):
    """What a save of ``obj`` must give back: tensors cloned (same dtype,
    shape, requires_grad), Stateful objects as their state_dict(), the rest
    deep-copied."""
    if isinstance(obj, torch.Tensor):
        c = obj.detach().clone()
        return c.requires_grad_(obj.requires_grad) if c.is_floating_point() or c.is_complex() \
            else c
    if isinstance(obj, dict):
        return type(obj)((k, _snapshot(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    if isinstance(obj, dcpx.Stateful):
        raise AssertionError("snapshot the state dict after its Stateful values are resolved")
    return copy.deepcopy(obj)


def _empty_like(obj):
    """A destination of the same structure: zeroed tensors of the same
    dtype and shape, non-tensor leaves None."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros(obj.numel() * obj.element_size(),
                           dtype=torch.uint8).view(obj.dtype).reshape(obj.shape)
    if isinstance(obj, dict):
        return type(obj)((k, _empty_like(v)) for k, v in obj.items())
    if isinstance(obj, list):
        from dcpx.staging import _is_terminal
        if _is_terminal(obj):
            return None
        return [_empty_like(v) for v in obj]
    return None


def _same(got, want, path="") -> None:
    """Bit-exact tensors (dtype, shape, bytes); other values by type and ==."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__} is not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{path}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
        assert raw_bytes(got) == raw_bytes(want), f"{path}: tensor bytes differ"
        return
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        # torch's load puts the non-tensor values under an int key at the
        # key's str (set_element with the flattened path); dcpx does as torch.
        moved = {str(k) for k in want if type(k) is int and str(k) not in want}
        assert set(want) <= set(got) and set(got) - set(want) <= moved, \
            f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            g = got[k]
            if str(k) in moved and str(k) in got:
                g = {**g, **got[str(k)]}
            _same(g, want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length differs"
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _check_metadata(path, want) -> None:
    """The committed .metadata (read as torch reads it) describes ``want``."""
    with open(Path(path) / ".metadata", "rb") as f:
        md = pickle.load(f)
    flat, mappings = flatten_state_dict(want)
    sdm = md.state_dict_metadata
    assert set(sdm) == set(flat), f"keys {sorted(sdm)} != {sorted(flat)}"
    assert dict(md.planner_data) == dict(mappings)
    for k, v in flat.items():
        m = sdm[k]
        if isinstance(v, torch.Tensor):
            assert type(m) is TensorStorageMetadata, f"{k}: {type(m).__name__}"
            assert m.properties.dtype == v.dtype, f"{k}: {m.properties.dtype} != {v.dtype}"
            assert tuple(m.size) == tuple(v.shape), f"{k}: {list(m.size)} != {list(v.shape)}"
            assert m.properties.requires_grad == v.requires_grad, f"{k}: requires_grad"
            assert [tuple(c.sizes) for c in m.chunks] == [tuple(v.shape)]
        else:
            assert type(m) is BytesStorageMetadata, f"{k}: {type(m).__name__}"
    files = {info.relative_path for info in md.storage_data.values()}
    for name in files:
        assert (Path(path) / name).is_file(), f"{name} is referenced but missing"


def verify(path, want) -> None:
    """``path`` holds exactly ``want``: loaded fresh by dcpx (cache cleared,
    then cached) and by torch DCP, and described by its metadata."""
    _check_metadata(path, want)
    for clear in (True, False):
        if clear:
            _readplan.clear()
        got = _empty_like(want)
        dcpx.load(got, checkpoint_id=str(path))
        _same(got, want, f"dcpx.load(clear={clear})")
    by_torch = _empty_like(want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(by_torch, storage_reader=tdcp.FileSystemReader(str(path)), no_dist=True)
    _same(by_torch, want, "torch load")
    _same(got, by_torch, "dcpx.load vs torch load")


# ---------------------------------------------------------------- savers

class Saver:
    """Saves with one configuration, keeping its writer and stager (if any)
    across saves, as a training loop does."""

    def __init__(self, mode: str):
        self.mode = mode
        self.writer = None
        self.stager = None
        if "stager" in mode:
            self.stager = dcpx.DefaultStager(dcpx.StagingOptions(
                use_pinned_memory=False,
                use_shared_memory="process" in mode and "noshm" not in mode,
                use_async_staging="async" in mode, use_non_blocking_copy=False))

    def close(self):
        if self.stager is not None:
            self.stager.close()

    def save(self, sd, path, mutate_after=None):
        """Save ``sd`` into ``path``; ``mutate_after()`` runs as soon as the
        call has staged (async) or returned (sync): the checkpoint must not
        see it."""
        path = str(path)
        mode = self.mode
        if mode == "sync-new-writer":
            dcpx.save(sd, checkpoint_id=path)
        elif mode.startswith("sync-"):
            if self.writer is None:
                kw = {"sync-writer-3threads": dict(thread_count=3),
                      "sync-writer-file-per-item": dict(single_file_per_rank=False)}
                self.writer = dcpx.FileSystemWriter(path, sync_files=False,
                                                    **kw.get(mode, {}))
            dcpx.save(sd, storage_writer=self.writer, checkpoint_id=path)
        else:
            kind = PROCESS if mode.startswith("process") else THREAD
            out = dcpx.async_save(sd, checkpoint_id=path, async_checkpointer_type=kind,
                                  async_stager=self.stager)
            if isinstance(out, dcpx.AsyncSaveResponse):
                out.staging_completion.result()
                out = out.upload_completion
            if mutate_after is not None:
                mutate_after()
            out.result()
            return
        if mutate_after is not None:
            mutate_after()


MODES = ["sync-new-writer", "sync-same-writer", "sync-writer-3threads",
         "sync-writer-file-per-item", "thread-nostager", "thread-stager-sync",
         "thread-stager-async", "process-nostager", "process-stager-sync",
         "process-stager-async", "process-stager-noshm-sync"]
FAST_MODES = ["sync-new-writer", "sync-same-writer", "sync-writer-3threads",
              "sync-writer-file-per-item", "thread-nostager", "thread-stager-sync",
              "thread-stager-async"]


@pytest.fixture(autouse=True)
def _fresh_caches():
    _plan.clear_plan_cache()
    _readplan.clear()
    yield
    _plan.clear_plan_cache()
    _readplan.clear()


# ---------------------------------------------------------------- state dicts

def base_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(4, 6, generator=g),
            "b": torch.randn(6, generator=g),
            "emb": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "i8": torch.randint(-100, 100, (7,), dtype=torch.int8, generator=g),
            "mask": torch.rand(9, generator=g) > 0.5,
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0, 3),
        },
        "opt": {
            "state": {0: {"step": 3, "exp_avg": torch.randn(4, 6, generator=g)},
                      1: {"step": 3, "exp_avg": torch.randn(6, generator=g)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}],
            "counts": {"a": 1, "b": 2},
        },
        "step": 7,
        "name": "run-a",
        "blob": b"xyz",
        "ratio": 0.5,
        "tags": ["x", "y"],
        # a leaf (torch.save'd as bytes) holding a tensor: the checkpoint
        # holds its values at the call, too
        "pair": (torch.arange(3.0), "s"),
    }


def _tensors(sd):
    """Every tensor in sd, in containers and in tuple / list values."""
    out = []
    for v in (sd.values() if isinstance(sd, dict) else sd):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (dict, list, tuple)):
            out.extend(_tensors(v))
    return out


def _bump(t: torch.Tensor) -> None:
    with torch.no_grad():
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.is_floating_point() or t.is_complex():
            t.mul_(1.5).add_(0.25)
        else:
            t.add_(3)


class _Model:
    """The "model" entries of a state dict, nested (``sd["model"][k]``) or
    flat (``sd["model." + k]``, after ``m_nest_flip``)."""

    def __init__(self, sd):
        self.sd = sd
        self.nested = "model" in sd

    def __getitem__(self, k):
        return self.sd["model"][k] if self.nested else self.sd[f"model.{k}"]

    def __setitem__(self, k, v):
        if self.nested:
            self.sd["model"][k] = v
        else:
            self.sd[f"model.{k}"] = v

    def get(self, k, default=None):
        try:
            return self[k]
        except KeyError:
            return default

    def keys(self):
        if self.nested:
            return list(self.sd["model"])
        return [k[len("model."):] for k in self.sd if isinstance(k, str) and k.startswith("model.")]

    def pop(self, k, default=None):
        return (self.sd["model"] if self.nested else self.sd).pop(
            k if self.nested else f"model.{k}", default)


def m_values(sd):  # the values only, in place
    for t in _tensors(sd):
        _bump(t)
    return sd


def m_dtype(sd):
    w = _Model(sd)["w"]
    _Model(sd)["w"] = w.to(torch.float64 if w.dtype != torch.float64 else torch.float32)
    return sd


def m_dtype_same_size(sd):  # float32 <-> int32: same bytes, same shape
    b = _Model(sd)["b"]
    if isinstance(b, torch.Tensor) and b.dtype in (torch.float32, torch.int32):
        _Model(sd)["b"] = b.detach().view(torch.int32 if b.dtype == torch.float32
                                          else torch.float32)
    return sd


def m_shape(sd):  # same numel
    w = _Model(sd)["w"]
    _Model(sd)["w"] = w.reshape(w.shape[::-1]).clone()
    return sd


def m_requires_grad(sd):
    b = _Model(sd)["b"]
    if isinstance(b, torch.Tensor) and b.is_floating_point():
        _Model(sd)["b"] = b.detach().clone().requires_grad_(not b.requires_grad)
    return sd


def _opt_state(sd, i):
    """The optimizer state of parameter i (keyed by int or, after
    m_int_key_as_str, by str)."""
    states = sd["opt"]["state"]
    return states[i] if i in states else states[str(i)]


def m_parameter(sd):
    s0 = _opt_state(sd, 0)
    w = s0["exp_avg"]
    if isinstance(w, torch.nn.Parameter):
        s0["exp_avg"] = w.detach().clone()
    elif isinstance(w, torch.Tensor) and w.is_floating_point():
        s0["exp_avg"] = torch.nn.Parameter(w.detach().clone(), requires_grad=False)
    return sd


def m_other_storage(sd):  # same shape and dtype, a view into another storage
    b = _Model(sd)["b"]
    if isinstance(b, torch.Tensor):
        big = torch.randn(40).to(b.dtype)
        v = big[13:13 + b.numel()].view(b.shape)
        _Model(sd)["b"] = v.requires_grad_(b.requires_grad) if b.requires_grad else v
    return sd


def m_non_contiguous(sd):  # same shape and dtype, strided
    w = _Model(sd)["w"]
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        r, c = w.shape
        _Model(sd)["w"] = torch.randn(c, r).to(w.dtype).t()
    return sd


def m_strided_slice(sd):
    s1 = _opt_state(sd, 1)
    e = s1["exp_avg"]
    if isinstance(e, torch.Tensor):
        s1["exp_avg"] = torch.randn(e.numel() * 2).to(e.dtype)[::2]
    return sd


def m_neg_conj(sd):  # a complex conj view and a neg-bit view
    c = torch.randn(5, dtype=torch.complex64)
    _Model(sd)["cplx"] = c.conj()
    _Model(sd)["negv"] = torch.randn(3, dtype=torch.complex64).conj().imag
    return sd


def m_plain_again(sd):  # back to fresh, contiguous, plain copies
    def walk(d):
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                d[k] = v.detach().resolve_conj().resolve_neg().contiguous().clone() \
                    .requires_grad_(v.requires_grad)
            elif isinstance(v, dict):
                walk(v)
    walk(sd)
    return sd


_NON_TENSORS = [5, "a string", b"\x00bytes\xff", bytearray(b"ba"), [1, 2, 3], (4, "t"), None,
                3.25, {"k": 1}]


def m_to_non_tensor(sd):
    v = _Model(sd)["b"]
    i = 0 if isinstance(v, torch.Tensor) else (_NON_TENSORS.index(v) + 1
                                                if v in _NON_TENSORS else 0)
    _Model(sd)["b"] = _NON_TENSORS[i % len(_NON_TENSORS)]
    return sd


def m_to_tensor(sd):
    if not isinstance(_Model(sd).get("b"), torch.Tensor):
        _Model(sd)["b"] = torch.randn(6)
    return sd


def m_non_tensor_content(sd):
    sd["step"] += 1
    # pickles of other lengths (bounded): later offsets move
    sd["name"] = sd["name"] + "x" if len(sd["name"]) < 12 else "run-a"
    _opt_state(sd, 0)["step"] += 1
    sd["opt"]["param_groups"][0]["lr"] *= 0.5
    sd["opt"]["counts"]["a"] = sd["opt"]["counts"]["a"] * 1000 + 1
    sd["tags"] = sd["tags"] + ["z"] if len(sd["tags"]) < 5 else sd["tags"][:2]
    sd["blob"] = sd["blob"] * 2 if len(sd["blob"]) < 100 else b"xyz"
    return sd


def m_non_tensor_same_length(sd):  # same pickle length, other content
    sd["name"] = sd["name"][:-1] + chr(ord(sd["name"][-1]) ^ 1)
    sd["opt"]["counts"]["b"] ^= 1
    return sd


def m_key_order(sd):
    if "model" in sd:
        sd["model"] = dict(reversed(list(sd["model"].items())))
    else:
        sd = dict(reversed(list(sd.items())))
    return sd


def m_top_order(sd):
    return dict(reversed(list(sd.items())))


def m_add_key(sd):
    m = _Model(sd)
    m[f"extra{len(m.keys())}"] = torch.randn(2, 2)
    return sd


def m_remove_key(sd):
    m = _Model(sd)
    keys = [k for k in m.keys() if k.startswith("extra")] or ["emb"]
    m.pop(keys[-1], None)
    return sd


def m_nest_flip(sd):  # {"model": {"w": t}} <-> {"model.w": t}: same flat keys
    if "model" in sd:
        inner = sd.pop("model")
        sd.update({f"model.{k}": v for k, v in inner.items()})
    else:
        keys = [k for k in sd if isinstance(k, str) and k.startswith("model.")]
        sd["model"] = {k[len("model."):]: sd.pop(k) for k in keys}
    return sd


def m_int_key_as_str(sd):  # opt.state keyed by 0 <-> "0": same flat keys
    st_ = sd["opt"]["state"]
    sd["opt"]["state"] = {(str(k) if isinstance(k, int) else int(k)): v for k, v in st_.items()}
    return sd


def m_dict_leaf_list(sd):  # a terminal list <-> a list holding a tensor
    if isinstance(sd["tags"], list) and any(isinstance(x, torch.Tensor) for x in sd["tags"]):
        sd["tags"] = ["x", "y"]
    else:
        sd["tags"] = [torch.arange(3), "y"]
    return sd


MUTATIONS = {f.__name__[2:]: f for f in (
    m_values, m_dtype, m_dtype_same_size, m_shape, m_requires_grad, m_parameter,
    m_other_storage, m_non_contiguous, m_strided_slice, m_neg_conj, m_plain_again,
    m_to_non_tensor, m_to_tensor, m_non_tensor_content, m_non_tensor_same_length,
    m_key_order, m_top_order, m_add_key, m_remove_key, m_nest_flip, m_int_key_as_str,
    m_dict_leaf_list)}


def _run_sequence(saver: Saver, names, dirs, sd=None) -> None:
    """Save ``sd`` (base_state()) once, then once after each mutation,
    verifying every checkpoint; in-place changes right after each call must
    not reach its checkpoint."""
    sd = base_state() if sd is None else sd
    for step, name in enumerate(["start", *names]):
        if name != "start":
            sd = MUTATIONS[name](sd)
        path = dirs[step % len(dirs)]
        want = _snapshot(sd)
        saver.save(sd, path, mutate_after=lambda: m_values(sd))
        try:
            verify(path, want)
        except AssertionError as e:
            raise AssertionError(f"{saver.mode}: after {['start', *names][:step + 1]} "
                                 f"into {Path(path).name}: {e}") from e


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("mode", MODES)
def test_each_change_then_back_loads_exactly(tmp_path, mode):
    """Every mutation in turn, each followed by a save into the same
    directory and by saves that change only values (the reused plan and
    layout) and only non-tensor values (the reused plan, another layout),
    then a second pass of the mutations (the caches now hold the first
    pass's layouts)."""
    saver = Saver(mode)
    try:
        names = [n for m in MUTATIONS for n in (m, "values", "non_tensor_content", "values")]
        names += list(MUTATIONS)
        _run_sequence(saver, names, [tmp_path / "ck"])
    finally:
        saver.close()


@pytest.mark.parametrize("mode", MODES)
def test_alternating_directories_load_exactly(tmp_path, mode):
    """The same state dict saved into two directories in turn, changing
    between saves."""
    saver = Saver(mode)
    try:
        names = ["values", "non_tensor_content", "values", "to_non_tensor", "to_tensor",
                 "values", "shape", "shape", "values", "non_tensor_same_length"]
        _run_sequence(saver, names, [tmp_path / "a", tmp_path / "b", tmp_path / "a"])
    finally:
        saver.close()


@pytest.mark.parametrize("mode", FAST_MODES)
def test_two_savers_alternating(tmp_path, mode):
    """Two stagers / writers of one kind, used in turn on two state dicts of
    the same keys but different contents."""
    s1, s2 = Saver(mode), Saver(mode)
    try:
        a, b = base_state(1), base_state(2)
        b["model"]["w"] = b["model"]["w"].to(torch.float64)
        b["name"] = "another, longer name"
        for i in range(4):
            for saver, sd, d in ((s1, a, "a"), (s2, b, "b"), (s2, a, "c"), (s1, b, "d")):
                want = _snapshot(sd)
                saver.save(sd, tmp_path / d)
                verify(tmp_path / d, want)
            m_values(a)
            m_non_tensor_content(b)
    finally:
        s1.close()
        s2.close()


class _Changing:
    """A Stateful whose state_dict() differs call to call: values, keys,
    types and nesting."""

    def __init__(self):
        self.calls = 0

    def state_dict(self):
        self.calls += 1
        n = self.calls
        kinds = [
            {"t": torch.full((3,), float(n)), "n": n},
            {"t": torch.full((3,), float(n), dtype=torch.float64), "n": n},
            {"t": n, "n": torch.full((2,), float(n))},
            {"t": torch.full((3,), float(n)), "n": n, "extra": {"x": torch.ones(1) * n}},
            {"n": n, "t": torch.full((3,), float(n))},
        ]
        return kinds[n % len(kinds)]

    def load_state_dict(self, sd):
        self.loaded = sd


@pytest.mark.parametrize("mode", MODES)
def test_stateful_returning_something_else_each_call(tmp_path, mode):
    saver = Saver(mode)
    try:
        obj = _Changing()
        for _ in range(7):
            sd = {"obj": obj, "w": torch.randn(3)}
            before = obj.calls
            saver.save(sd, tmp_path / "ck")
            assert obj.calls == before + 1
            n = obj.calls
            probe = _Changing()
            probe.calls = n - 1
            want = {"obj": _snapshot(probe.state_dict()), "w": sd["w"].clone()}
            verify(tmp_path / "ck", want)
    finally:
        saver.close()


class _Raising:
    def __init__(self):
        self.fail = True

    def state_dict(self):
        if self.fail:
            raise RuntimeError("boom from state_dict")
        return {"ok": torch.ones(2)}

    def load_state_dict(self, sd):
        pass


def _failing_saves():
    """(name, make the save fail, undo): each a different point of failure."""
    def unpicklable(sd):
        sd["bad"] = lambda: 0  # torch.save of the value raises

    def undo_unpicklable(sd):
        sd.pop("bad", None)

    def meta_tensor(sd):
        sd["model"]["w"] = torch.empty(sd["model"]["w"].shape, device="meta")

    def undo_meta(sd):
        sd["model"]["w"] = torch.randn(4, 6)

    def stateful(sd):
        sd["st"] = _Raising()

    def undo_stateful(sd):
        sd.pop("st", None)

    return [("unpicklable", unpicklable, undo_unpicklable),
            ("meta", meta_tensor, undo_meta),
            ("stateful", stateful, undo_stateful)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("failure", [f[0] for f in _failing_saves()])
def test_a_failed_save_keeps_the_last_checkpoint_and_the_next_save_is_right(
        tmp_path, mode, failure):
    _, fail, undo = next(f for f in _failing_saves() if f[0] == failure)
    saver = Saver(mode)
    try:
        path = tmp_path / "ck"
        sd = base_state()
        for round_ in range(3):
            want = _snapshot(sd)
            saver.save(sd, path)
            verify(path, want)
            m_values(sd)
            m_non_tensor_content(sd)
            fail(sd)
            with pytest.raises(Exception):
                saver.save(sd, path)
            verify(path, want)  # the failed save committed nothing
            undo(sd)
            if round_ == 1:
                m_shape(sd)
    finally:
        saver.close()


@pytest.mark.parametrize("mode", ["sync-new-writer", "sync-same-writer", "thread-nostager",
                                  "thread-stager-sync", "thread-stager-async"])
def test_a_save_failing_at_commit_then_good_saves(tmp_path, mode, monkeypatch):
    """The commit raises (a full disk, say) after the plan, the encoding
    and the data files were made: nothing cached from that save may make a
    later checkpoint wrong."""
    real = dcpx.storage.commit.commit
    failing = [False]

    def commit(*args, **kw):
        if failing[0]:
            raise OSError(28, "No space left on device (test)")
        return real(*args, **kw)

    monkeypatch.setattr(dcpx.storage.commit, "commit", commit)
    saver = Saver(mode)
    try:
        path = tmp_path / "ck"
        sd = base_state()
        for round_ in range(4):
            want = _snapshot(sd)
            saver.save(sd, path)
            verify(path, want)
            m_values(sd)
            if round_ % 2:
                m_non_tensor_content(sd)
            failing[0] = True
            with pytest.raises(Exception):
                saver.save(sd, path)
            failing[0] = False
            verify(path, want)
            m_values(sd)
    finally:
        saver.close()


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mode=st.sampled_from(FAST_MODES),
       names=st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=8),
       ndirs=st.integers(1, 2))
def test_random_sequences_of_changes(tmp_path_factory, mode, names, ndirs):
    base = tmp_path_factory.mktemp("seq")
    _plan.clear_plan_cache()
    saver = Saver(mode)
    try:
        _run_sequence(saver, names, [base / f"d{i}" for i in range(ndirs)])
    finally:
        saver.close()


@pytest.mark.parametrize("stager", ["own", "pooled"])
def test_process_save_after_one_whose_value_did_not_pickle(tmp_path, stager):
    """PROCESS: a save whose request to the checkpoint process does not
    pickle (a non-tensor value that is a lambda) fails; the next save of
    the same layout, with a picklable value in that slot, must succeed and
    load.  The parent used to remember the layout as sent although the
    request never left it, and the next save failed with "layout ... was
    never sent"."""
    own = (dcpx.DefaultStager(dcpx.StagingOptions(False, True, False, False))
           if stager == "own" else None)
    path = tmp_path / "ck"
    try:
        for i in range(2):
            sd = {"w": torch.randn(5), "v": (lambda: 0), "n": i}
            if stager == "pooled":
                sd[f"k{i}"] = torch.ones(i + 1)  # a layout the pool has not sent
            with pytest.raises(Exception, match="pickle"):
                dcpx.async_save(sd, checkpoint_id=str(path), async_checkpointer_type=PROCESS,
                                async_stager=own).result()
            sd["v"] = 5
            want = _snapshot(sd)
            dcpx.async_save(sd, checkpoint_id=str(path), async_checkpointer_type=PROCESS,
                            async_stager=own).result()
            verify(path, want)
    finally:
        if own is not None:
            own.close()


@pytest.mark.parametrize("mode", MODES)
def test_one_key_through_every_dtype(tmp_path, mode):
    """One key's tensor takes every dtype torch.save stores, in turn and
    back (same shape; the plan's and the stager's dtype checks compare
    dtype objects, the C scan maps DLPack dtypes to torch dtypes)."""
    saver = Saver(mode)
    try:
        dtypes = list(SAVEABLE_DTYPES) + list(reversed(SAVEABLE_DTYPES))
        sd = {"x": torch.randn(2, 3), "n": 1, "y": torch.ones(4)}
        for i, dt in enumerate(dtypes):
            sd["x"] = make_tensor((2, 3), dt, torch.Generator().manual_seed(i))
            sd["n"] = i
            want = _snapshot(sd)
            saver.save(sd, tmp_path / "ck")
            try:
                verify(tmp_path / "ck", want)
            except AssertionError as e:
                raise AssertionError(f"{mode}: {dtypes[max(0, i - 1)]} -> {dt}: {e}") from e
    finally:
        saver.close()


@pytest.mark.parametrize("mode", ["sync-new-writer", "thread-stager-sync", "process-stager-sync"])
def test_relative_paths_equal_to_keys(tmp_path, monkeypatch, mode):
    """Relative checkpoint paths whose text equals keys of the state dict
    (storage_meta, written after the reused part of .metadata, holds the
    path; short strings are shared objects in Python)."""
    monkeypatch.chdir(tmp_path)
    saver = Saver(mode)
    try:
        sd = {"a": torch.randn(3), "b": {"a": torch.randn(2), "c": "a"}, "ck": "b"}
        for i, path in enumerate(["a", "b", "a", "ck", "a", "b"]):
            sd["a"].add_(1)
            want = _snapshot(sd)
            saver.save(sd, path)
            verify(tmp_path / path, want)
            with open(tmp_path / path / ".metadata", "rb") as f:
                recorded = str(pickle.load(f).storage_meta.checkpoint_id)
            assert recorded in (path, str(tmp_path / path))
    finally:
        saver.close()


class _MyPlanner(__import__("torch.distributed.checkpoint.default_planner",
                            fromlist=["DefaultSavePlanner"]).DefaultSavePlanner):
    """A custom planner: PROCESS saves go through torch's save in the
    checkpoint process."""


@pytest.mark.parametrize("how", ["pooled", "stager-shm", "stager-noshm", "custom-planner"])
def test_process_save_to_a_relative_path_after_chdir(tmp_path, monkeypatch, how):
    """PROCESS: a relative checkpoint path is the caller's directory at the
    call, though the checkpoint process was started in another one (it
    saved into ``first/`` before the caller changed directory).  It used
    to write into the directory it was started in and report success."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    stager = None
    if how.startswith("stager"):
        stager = dcpx.DefaultStager(dcpx.StagingOptions(False, how == "stager-shm", False,
                                                        False))
    planner = _MyPlanner() if how == "custom-planner" else None
    try:
        for i, where in enumerate(["one", "two", "one", "two"]):
            monkeypatch.chdir(tmp_path / where)
            sd = {"w": torch.full((3,), float(i)), "n": i}
            want = _snapshot(sd)
            dcpx.async_save(sd, checkpoint_id="ck", async_checkpointer_type=PROCESS,
                            async_stager=stager, planner=planner).result()
            verify(tmp_path / where / "ck", want)
    finally:
        if stager is not None:
            stager.close()


def _edge_states():
    t = torch.randn(4, 4)
    return [
        {},
        {"only": 1, "values": "here"},
        {"z": torch.empty(0), "z2": torch.empty(3, 0, dtype=torch.int64)},
        {"same": t, "again": t, "view": t[1], "tview": t.t()},
        {"a": torch.randn(3)},
        {},
        {"a": torch.randn(3), "only": 1},
        {"a": [torch.randn(2), {"b": torch.randn(1)}], "c": (torch.randn(2),)},
        {"a": torch.randn(3)},
    ]


@pytest.mark.parametrize("mode", MODES)
def test_edge_state_dicts_in_turn(tmp_path, mode):
    """Empty state dicts, only non-tensors, only empty tensors, one tensor
    under several keys and views of it, lists of tensors, in turn."""
    saver = Saver(mode)
    try:
        for rnd in range(2):
            for i, sd in enumerate(_edge_states()):
                want = _snapshot(sd)
                saver.save(sd, tmp_path / "ck")
                try:
                    verify(tmp_path / "ck", want)
                except AssertionError as e:
                    raise AssertionError(f"{mode}: state {i} of round {rnd}: {e}") from e
    finally:
        saver.close()


@pytest.mark.parametrize("klen,n", [(1, 2000), (40, 700), (200, 330), (70000, 2), (3, 1)])
def test_reused_metadata_across_frame_sizes_and_path_lengths(tmp_path, klen, n):
    """The reused part of .metadata (its own 64 KiB frames) between file
    names and storage_meta of other lengths: keys of several lengths and
    counts, so that the middle ends at various places relative to a frame,
    saved into paths of different lengths with one and three files; each
    .metadata is decoded by the C index (no fallback) and by pickle."""
    from dcpx.formats import metadata as _metadata
    sd = {("k" * klen + f"{i:05d}"): (torch.full((2,), float(i)) if i % 3 else i)
          for i in range(n)}
    for threads in (1, 3):
        writer_paths = [tmp_path / f"t{threads}" / "p", tmp_path / f"t{threads}" / ("q" * 77),
                        tmp_path / f"t{threads}" / "p"]
        for j, path in enumerate(writer_paths):
            for v in sd.values():
                if isinstance(v, torch.Tensor):
                    v.add_(1)
            want = _snapshot(sd)
            dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(path, sync_files=False,
                                                               thread_count=threads))
            verify(path, want)
            raw = (path / ".metadata").read_bytes()
            if klen < 60000:  # a key longer than a frame is left to pickle (csrc/mdindex.c)
                assert _metadata.index(raw, str(path)) is not None
            assert _metadata.loads(raw, str(path)) is not None


class _NotingWriter(dcpx.FileSystemWriter):
    """A writer whose encode_metadata changes the Metadata (a note that
    differs per save, a key of the state-dict metadata dropped) before
    dcpx's encoding."""

    count = 0

    def encode_metadata(self, metadata):
        _NotingWriter.count += 1
        metadata.planner_data["note"] = ("note", _NotingWriter.count)
        metadata.state_dict_metadata.pop("dropped", None)
        metadata.storage_data = {k: v for k, v in metadata.storage_data.items()
                                 if k.fqn != "dropped"}
        return super().encode_metadata(metadata)


def test_a_writer_changing_the_metadata_in_encode_metadata_gets_it_written(tmp_path):
    """The reused encoding of .metadata is the plan's, shared by every
    writer of the same keys: a subclass whose encode_metadata changes the
    Metadata used to have its first save's encoding written again (the
    file said note 1 while the save returned note 2), and a plain
    writer's later save of the same keys wrote the subclass's changes
    (a key missing from its checkpoint)."""
    sd = {"a": torch.randn(3), "dropped": torch.randn(2), "n": 1}
    for i in range(3):
        path = tmp_path / f"w{i}"
        returned = dcpx.save(sd, storage_writer=_NotingWriter(path, sync_files=False))
        with open(path / ".metadata", "rb") as f:
            on_disk = pickle.load(f)
        assert on_disk.planner_data["note"] == returned.planner_data["note"]
        assert on_disk == returned
    for i in range(2):  # then the same keys through dcpx's own writer
        sd["a"].add_(1)
        want = _snapshot(sd)
        dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(tmp_path / "plain",
                                                           sync_files=False))
        verify(tmp_path / "plain", want)


@pytest.mark.parametrize("mode", ["thread-nostager", "thread-stager-sync", "thread-stager-async",
                                  "process-nostager", "process-stager-sync",
                                  "process-stager-async"])
def test_saves_in_flight_together_each_hold_their_call(tmp_path, mode):
    """async_save calls made without waiting for the previous upload (the
    pool's second buffer, or a stager waiting for its lease), with changes
    between calls (values, a non-tensor, a dtype, a key added): each
    checkpoint holds what its call was given."""
    saver = Saver(mode)
    kind = PROCESS if mode.startswith("process") else THREAD
    try:
        sd = base_state()
        pending = []
        changes = ["values", "non_tensor_content", "values", "dtype", "values", "add_key",
                   "values", "values"]
        for i, name in enumerate(changes):
            sd = MUTATIONS[name](sd)
            want = _snapshot(sd)
            out = dcpx.async_save(sd, checkpoint_id=str(tmp_path / f"c{i}"),
                                  async_checkpointer_type=kind, async_stager=saver.stager)
            if isinstance(out, dcpx.AsyncSaveResponse):
                out.staging_completion.result()
                out = out.upload_completion
            m_values(sd)  # after the call: not in its checkpoint
            pending.append((out, tmp_path / f"c{i}", want))
        for out, path, want in pending:
            out.result()
            verify(path, want)
    finally:
        saver.close()


@pytest.mark.parametrize("mode", ["thread-nostager", "thread-stager-sync", "thread-stager-async",
                                  "process-nostager", "process-stager-sync"])
def test_one_writer_object_for_async_saves_to_successive_paths(tmp_path, mode):
    """One FileSystemWriter passed to every async_save with the next
    checkpoint_id (its reset() moves it there) while earlier uploads are
    still queued: each save goes to the path of its call.  The uploads
    used the caller's writer object, so an upload that had not started
    was written to a later call's path (or failed on its lock file)."""
    saver = Saver(mode)
    kind = PROCESS if mode.startswith("process") else THREAD
    writer = dcpx.FileSystemWriter(tmp_path / "unused", sync_files=False)
    try:
        sd = {"w": torch.zeros(256, 64), "n": 0}
        pending = []
        for i in range(6):
            sd["w"].fill_(float(i))
            sd["n"] = i
            want = _snapshot(sd)
            out = dcpx.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / f"s{i}",
                                  async_checkpointer_type=kind, async_stager=saver.stager)
            if isinstance(out, dcpx.AsyncSaveResponse):
                out.staging_completion.result()  # before sd changes
                out = out.upload_completion
            pending.append((out, tmp_path / f"s{i}", want))
        for out, path, want in pending:
            out.result()
            verify(path, want)
    finally:
        saver.close()


def test_one_writer_object_reset_by_a_sync_save_while_an_upload_waits(tmp_path):
    """The upload thread busy (held here), an async_save to ``a`` with a
    writer, then dcpx.save with the same writer to ``b``: ``a`` holds the
    async save, ``b`` the sync one (the async save was written into ``b``
    over the sync save's checkpoint, and ``a`` was never made)."""
    import threading

    import dcpx._async
    writer = dcpx.FileSystemWriter(tmp_path / "unused", sync_files=False)
    held = threading.Event()
    blocker = dcpx._async._uploader().submit(held.wait)
    try:
        a = {"w": torch.ones(2)}
        b = {"w": torch.zeros(3)}
        want_a, want_b = _snapshot(a), _snapshot(b)
        fut = dcpx.async_save(a, storage_writer=writer, checkpoint_id=tmp_path / "a")
        dcpx.save(b, storage_writer=writer, checkpoint_id=tmp_path / "b")
    finally:
        held.set()
    blocker.result()
    fut.result()
    verify(tmp_path / "a", want_a)
    verify(tmp_path / "b", want_b)


class _MetaWriter(dcpx.FileSystemWriter):
    """storage_meta() of its own: None, or one that changes every save."""

    def __init__(self, *args, meta="none", **kw):
        super().__init__(*args, **kw)
        self.meta = meta
        self.saves = 0

    def storage_meta(self):
        self.saves += 1
        if self.meta == "none":
            return None
        from torch.distributed.checkpoint.metadata import StorageMeta
        return StorageMeta(checkpoint_id=f"{self.path}#{self.saves}",
                           save_id=f"save-{self.saves}" * self.saves)


@pytest.mark.parametrize("meta", ["none", "changing"])
def test_writer_with_its_own_storage_meta_reuses_the_rest(tmp_path, meta):
    """storage_meta is encoded after the reused part of .metadata: a
    writer's own (None, or longer every save) is what each file holds."""
    writer = _MetaWriter(tmp_path / "ck", sync_files=False, meta=meta)
    sd = {"a": torch.randn(3), "n": 1}
    for i in range(4):
        sd["a"].add_(1)
        want = _snapshot(sd)
        returned = dcpx.save(sd, storage_writer=writer)
        verify(tmp_path / "ck", want)
        with open(tmp_path / "ck" / ".metadata", "rb") as f:
            assert pickle.load(f) == returned
