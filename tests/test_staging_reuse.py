"""Staging reuse: a stager that stages a state dict of the layout it staged
last time reuses what it built (the buffer, the staged tensors, the copy
plan) and only reads the data pointers anew (dcpx/staging.py,
``DefaultStager._reuse``; ``dcpx._C.stage_plain``, csrc/stage.c).

What these tests pin:

* The reuse path is taken for the same layout, with new tensor objects at
  the same keys (their bytes are copied, never the old ones').
* Every change that the plan depends on is noticed and staged the general
  way, bit-exact: a key added, removed, renamed or moved; another shape,
  dtype, requires_grad, type (Parameter / Tensor), device, contiguity, a
  conj or neg bit, another nesting with the same keys, a tensor replaced by
  a plain value and back; tensors torch cannot hand out as plain memory
  (sparse, nested, mkldnn, meta, a freed storage) give the error the first
  stage gives.
* Every stage returns new containers (as torch's stager does): a caller
  changing the staged dict it got does not change the next one or the
  checkpoint.
* Checkpoints saved through the reuse path load bit-exact.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch

import dcpx
from dcpx import _C


def _stager(**kw) -> dcpx.DefaultStager:
    return dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=False,
                                                  use_shared_memory=False, **kw))


def _state(step: float, n: int = 6) -> dict:
    g = torch.Generator().manual_seed(int(step * 1000) + n)
    sd = {f"t{i}": torch.randn(3 + i, 5, generator=g) for i in range(n)}
    sd["i64"] = torch.randint(-9, 9, (7,), dtype=torch.int64, generator=g)
    sd["step"] = int(step)
    return sd


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    size = t.element_size()
    t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
    return t.contiguous().reshape(-1).view(torch.uint8).clone()


def _assert_staged(staged, sd, path="") -> None:
    """staged mirrors sd: same keys and container types, tensors of the same
    dtype, shape, requires_grad and bytes (never sd's memory), equal values."""
    if isinstance(sd, dict):
        assert type(staged) is type(sd), path
        assert list(staged) == list(sd), path
        for k in sd:
            _assert_staged(staged[k], sd[k], f"{path}.{k}")
    elif isinstance(sd, torch.Tensor):
        assert isinstance(staged, torch.Tensor), path
        assert (staged.dtype, staged.shape, staged.requires_grad) == \
            (sd.dtype, sd.shape, sd.requires_grad), path
        assert torch.equal(_bits(staged), _bits(sd)), f"{path}: bytes differ"
        if sd.numel():
            assert staged.data_ptr() != sd.data_ptr(), path
    else:
        assert staged == sd, path


def _stage_both(stager, before, after):
    """Stage before (twice: the second reuses), then after; returns
    (staged after, whether after reused the plan)."""
    stager.stage(before)
    stager.stage(before)
    reused = getattr(stager, "reuse_count", 0)
    staged = stager.stage(after)
    _assert_staged(staged, after)
    return staged, getattr(stager, "reuse_count", 0) > reused


# --------------------------------------------------------------------------
# the reuse path


def test_same_layout_reuses_the_plan_and_copies_the_new_tensors():
    with _stager() as stager:
        for step in range(5):
            sd = _state(float(step))  # new tensor objects every time
            staged = stager.stage(sd)
            _assert_staged(staged, sd)
        assert (stager.stage_count, stager.alloc_count, stager.reuse_count) == (5, 1, 4)


def test_in_place_changes_between_stages_are_copied():
    sd = _state(1.0)
    with _stager() as stager:
        for step in range(4):
            for v in sd.values():
                if isinstance(v, torch.Tensor):
                    v.add_(step)
            sd["step"] = step
            _assert_staged(stager.stage(sd), sd)
        assert stager.reuse_count == 3


def test_views_of_one_storage_adjacent_in_the_buffer():
    """Views of one flat buffer (a flat parameter): 64-byte multiples, so
    they are adjacent in the staging buffer too and copied as one run."""
    flat = torch.randn(16 * 10 + 16 * 7 + 16 * 3 + 5)
    sd = {"a": flat[:160].view(10, 16), "b": flat[160:272], "c": flat[272:320].view(3, 16),
          "tail": flat[320:], "other": torch.randn(4)}
    with _stager() as stager:
        for step in range(3):
            flat.add_(1)
            _assert_staged(stager.stage(sd), sd)
        a, b = stager.stage(sd)["a"], stager.stage(sd)["b"]
        assert b.data_ptr() == a.data_ptr() + a.nbytes  # one run in the buffer
        assert stager.reuse_count == 4


def test_many_small_tensors_and_threads():
    g = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 3000, (3000,), generator=g).tolist()
    sd = {f"p{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    sd["big"] = torch.randn(5 << 20, generator=g)  # cut into tasks of 8 MiB
    with _stager() as stager:
        stager.stage(sd)
        for v in sd.values():
            v.mul_(-1)
        _assert_staged(stager.stage(sd), sd)
        assert stager.reuse_count == 1


# --------------------------------------------------------------------------
# invalidation: each change is noticed and staged correctly


def _changes():
    def grad(sd):
        sd["t1"] = torch.nn.Parameter(sd["t1"].clone())
    def param_to_tensor(sd):
        sd["t2"] = sd["t2"].clone()
    def shape(sd):
        sd["t0"] = torch.randn(4, 3)  # same numel, other shape
    def dtype(sd):
        sd["t0"] = sd["t0"].double()
    def dtype_same_size(sd):
        sd["i64"] = sd["i64"].double()
    def key_added(sd):
        sd["new"] = torch.ones(2)
    def key_removed(sd):
        del sd["t3"]
    def key_renamed(sd):
        sd["t3x"] = sd.pop("t3")
    def order(sd):
        sd["t0"] = sd.pop("t0")
    def strided(sd):
        sd["t4"] = torch.randn(sd["t4"].shape[1], sd["t4"].shape[0]).t()
    def offset_view(sd):
        sd["t4"] = torch.randn(100)[3:3 + sd["t4"].numel()].view(sd["t4"].shape)
    def neg(sd):
        c = torch.randn(sd["t5"].shape, dtype=torch.complex64)
        sd["t5"] = c.conj().imag  # a float tensor with the neg bit
        assert sd["t5"].is_neg()
    def to_value(sd):
        sd["t1"] = 3.5
    def from_value(sd):
        sd["step"] = torch.tensor(7)
    def nesting(sd):
        sd["t0"] = {"x": sd.pop("t0")}  # key t0 -> t0.x, one level down
    def ordered(sd):
        return OrderedDict(sd)
    return {f.__name__: f for f in (grad, param_to_tensor, shape, dtype, dtype_same_size,
                                    key_added, key_removed, key_renamed, order, strided,
                                    offset_view, neg, to_value, from_value, nesting,
                                    ordered)}


@pytest.mark.parametrize("change", list(_changes()))
def test_a_change_is_staged_correctly(change):
    before = _state(1.0)
    before["t2"] = torch.nn.Parameter(before["t2"])
    after = _state(2.0)
    after["t2"] = torch.nn.Parameter(after["t2"])
    out = _changes()[change](after)
    after = out if out is not None else after
    with _stager() as stager:
        _stage_both(stager, before, after)
        # and back: staging the first layout again is exact too
        _assert_staged(stager.stage(before), before)
        _assert_staged(stager.stage(after), after)


def test_same_keys_other_nesting_follows_the_new_nesting():
    """{"a.b": t} and {"a": {"b": t}} flatten to the same key: the mappings
    (saved in the checkpoint's metadata) and the staged nesting differ."""
    t = torch.randn(3)
    with _stager() as stager:
        staged, reused = _stage_both(stager, {"a.b": t}, {"a": {"b": t}})
        assert not reused and staged["a"]["b"].shape == (3,)
        staged, reused = _stage_both(stager, {"a": {"b": t}}, {"a.b": t})
        assert not reused and "a.b" in staged


def test_conj_complex_is_resolved():
    z = torch.randn(5, dtype=torch.complex64)
    with _stager() as stager:
        _, reused = _stage_both(stager, {"z": z}, {"z": z.conj()})
        assert not reused
        _stage_both(stager, {"z": z.conj()}, {"z": z})  # the general copy either way


def _unplain():
    def sparse():
        return torch.randn(3, 5).to_sparse()
    def sparse_csr():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.randn(3, 5).to_sparse_csr()
    def nested():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.nested.nested_tensor([torch.randn(5), torch.randn(10)])
    def meta():
        return torch.empty(3, 5, device="meta")
    def mkldnn():
        return torch.randn(3, 5).to_mkldnn()
    return {f.__name__: f for f in (sparse, sparse_csr, nested, meta, mkldnn)}


@pytest.mark.parametrize("kind", list(_unplain()))
def test_tensors_without_plain_memory_give_the_first_stage_error(kind):
    """At a key that held a plain tensor, a tensor the C check cannot read
    is refused with the error the general path gives, naming the key."""
    try:
        bad = _unplain()[kind]()
    except (RuntimeError, AttributeError) as e:  # not built into this torch
        pytest.skip(f"{kind}: {e}")
    before = {"t0": torch.randn(3, 5), "other": torch.ones(2)}
    with _stager() as fresh, pytest.raises(Exception) as first:
        fresh.stage({"t0": bad, "other": torch.ones(2)})
    with _stager() as stager:
        stager.stage(before)
        stager.stage(before)
        with pytest.raises(type(first.value)) as again:
            stager.stage({"t0": bad, "other": torch.ones(2)})
        assert str(again.value) == str(first.value)
        assert "t0" in str(again.value)
        _assert_staged(stager.stage(before), before)  # still usable


def test_a_freed_storage_is_refused_not_read():
    t = torch.randn(1000)
    before = {"t": torch.randn(1000)}
    with _stager() as stager:
        stager.stage(before)
        stager.stage(before)
        t.untyped_storage().resize_(0)  # FSDP frees unsharded storage so
        with pytest.raises(Exception):
            stager.stage({"t": t})


# --------------------------------------------------------------------------
# the returned state dict


def test_every_stage_returns_new_containers():
    sd = {"m": {"w": torch.randn(4), "b": torch.randn(2)}, "o": [torch.ones(3), 5], "n": 1}
    with _stager() as stager:
        one = stager.stage(sd)
        two = stager.stage(sd)
        assert one is not two and one["m"] is not two["m"] and one["o"] is not two["o"]
        assert one["m"]["w"] is two["m"]["w"]  # the same staged tensors
        assert stager.reuse_count == 1


def test_changing_the_returned_dict_does_not_change_the_next_stage():
    sd = {"m": {"w": torch.randn(4), "b": torch.randn(2)}, "x": torch.randn(3), "n": 1}
    with _stager() as stager:
        got = stager.stage(sd)
        got["m"].pop("w")
        got["x"] = "replaced"
        got["extra"] = torch.zeros(1)
        got["m"]["b"].fill_(0)  # the staged bytes: overwritten by the next stage
        again = stager.stage(sd)
        _assert_staged(again, sd)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_checkpoints_through_the_reuse_path_load_bit_exact(tmp_path, kind):
    kind = dcpx.AsyncCheckpointerType.PROCESS if kind == "process" else \
        dcpx.AsyncCheckpointerType.THREAD
    stager = dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True))
    sd = _state(1.0, n=40)
    try:
        for step in range(4):
            for i in range(40):
                sd[f"t{i}"] = sd[f"t{i}"] + step if step % 2 else sd[f"t{i}"].mul_(2)
            sd["step"] = step
            resp = dcpx.async_save(sd, checkpoint_id=tmp_path / f"c{step}",
                                   async_stager=stager, async_checkpointer_type=kind)
            resp.staging_completion.result()
            if step == 2:  # changed after staging: not in the checkpoint
                expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in sd.items()}
                sd["t0"].fill_(-1)
            resp.upload_completion.result()
            if step == 2:
                out = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v)
                       for k, v in expected.items()}
                dcpx.load(out, checkpoint_id=tmp_path / "c2")
                _assert_staged(out, expected)
        assert stager.reuse_count == 3
    finally:
        stager.close()


def test_pooled_stagers_reuse_too(tmp_path):
    """async_save without a stager (the pool): the same plan every call."""
    from dcpx import staging
    sd = _state(1.0, n=30)
    dcpx.release_staging_buffers()
    for step in range(4):
        sd["t0"].add_(1)
        dcpx.async_save(sd, checkpoint_id=tmp_path / f"c{step}").result()
    stats = staging._pool.stats()["thread"]
    assert stats["alloc_count"] == 1
    out = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    dcpx.load(out, checkpoint_id=tmp_path / "c3")
    _assert_staged(out, sd)
    dcpx.release_staging_buffers()


# --------------------------------------------------------------------------
# dcpx._C.stage_plain itself


def test_stage_plain_rejects_entries_outside_the_values_or_buffer():
    t = torch.randn(8)
    base = torch.empty(64, dtype=torch.uint8)
    good = (0, torch.Tensor, t.dtype, t.shape, False, 0, 32, False)
    assert _C.stage_plain([t], (good,), base) is True
    assert torch.equal(base[:32].view(torch.float32), t)
    for bad in ((1,) + good[1:], good[:5] + (40, 32, False), good[:6] + (65, False)):
        with pytest.raises(ValueError, match="outside"):
            _C.stage_plain([t], (bad,), base)
    with pytest.raises(TypeError, match="entries"):
        _C.stage_plain([t], (good[:7],), base)
    with pytest.raises(ValueError, match="threads"):
        _C.stage_plain([t], (good,), base, threads=0)


def test_stage_plain_says_false_on_a_mismatch_and_keeps_refcounts():
    import sys
    t = torch.randn(8)
    base = torch.empty(64, dtype=torch.uint8)
    entry = (0, torch.Tensor, t.dtype, torch.Size([8]), False, 0, 32, False)
    before = sys.getrefcount(t), sys.getrefcount(base)
    for other in (t.double(), t.view(2, 4), torch.nn.Parameter(t), t[::2], "x", None):
        assert _C.stage_plain([other], (entry,), base) is False
    assert _C.stage_plain([t], (entry,), base) is True
    assert (sys.getrefcount(t), sys.getrefcount(base)) == before


def test_a_change_after_copying_began_is_staged_correctly():
    """The copy starts while later tensors are still being checked: a
    change found after 8 MiB were handed to the copy threads stops them
    and the general path stages everything again, exactly."""
    big = {f"big{i}": torch.randn(1 << 20) for i in range(3)}  # 4 MiB each
    before = {**big, "last": torch.randn(10)}
    with _stager() as stager:
        stager.stage(before)
        stager.stage(before)
        after = {k: v + 1 for k, v in big.items()}
        after["last"] = torch.randn(10).double()
        _assert_staged(stager.stage(after), after)
        assert stager.reuse_count == 1
        after["last"] = after["last"].float()  # the first layout again
        _assert_staged(stager.stage(after), after)


def test_stage_plain_error_after_copying_began_joins_the_threads():
    ts = [torch.randn(1 << 20) for _ in range(3)]
    base = torch.empty(3 * (4 << 20), dtype=torch.uint8)
    entries = [(i, torch.Tensor, t.dtype, t.shape, False, i * (4 << 20), 4 << 20, False)
               for i, t in enumerate(ts)]
    assert _C.stage_plain(ts, tuple(entries), base, threads=3) is True
    for i, t in enumerate(ts):
        assert torch.equal(base[i * (4 << 20):(i + 1) * (4 << 20)].view(torch.float32), t)
    bad = entries[:2] + [entries[2][:5] + (3 * (4 << 20), 4 << 20, False)]
    for _ in range(20):  # the threads are joined each time: no leak, no hang
        with pytest.raises(ValueError, match="outside"):
            _C.stage_plain(ts, tuple(bad), base, threads=3)
