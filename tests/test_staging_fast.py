"""The per-tensor shortcuts of staging and of the staged upload.

* A flat state dict of the layout staged last is staged without being
  flattened again (``staging._flat_as_is``); anything that would flatten
  differently (a value turned into a container, a key of a str subclass,
  another order) is flattened and staged the general way, bit-exact.
* The upload of a staged layout takes its signature and per-tensor
  payload parts from the layout (``_Layout.upload_scan``) instead of a
  Python scan per tensor; checkpoints stay bit-exact for every dtype, with
  non-tensor values between the tensors, and are unaffected by changes to
  the sources after staging or to the staged tensors the caller was given.
* ``_C.stage_plain`` calls torch's getters through their descriptors: it
  still notices every change of a plain tensor (tests/test_staging_reuse.py
  has the full list) and reads Parameters and Tensors alike.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from dcpx.coordination import plan as _plan
from dcpx import staging


def _stager(**kw) -> dcpx.DefaultStager:
    return dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=False,
                                                  use_shared_memory=False, **kw))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t.contiguous().reshape(-1).view(torch.uint8).clone()


def _same(a, b, path="") -> None:
    if isinstance(b, dict):
        assert isinstance(a, dict) and list(a) == list(b), path
        for k in b:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(b, list):
        assert isinstance(a, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}.{i}")
    elif isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), path
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), path
        assert torch.equal(_bits(a), _bits(b)), f"{path}: bytes differ"
    else:
        assert a == b, path


def _flat(step: int, n: int = 8) -> dict:
    g = torch.Generator().manual_seed(step)
    sd = {f"t{i}": torch.randn(2 + i, 3, generator=g) for i in range(n)}
    sd["step"] = step
    sd["lr"] = [0.1, 0.2]  # a list without tensors: a leaf
    return sd


class _CountFlatten:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = staging.flatten_state_dict

        def counted(sd):
            self.calls += 1
            return real(sd)
        monkeypatch.setattr(staging, "flatten_state_dict", counted)


# --------------------------------------------------------------------------
# staging a flat state dict without flattening it


def test_flat_state_dict_of_the_same_layout_is_not_flattened_again(monkeypatch):
    count = _CountFlatten(monkeypatch)
    with _stager() as stager:
        for step in range(4):
            sd = _flat(step)
            _same(stager.stage(sd), sd)
        assert stager.reuse_count == 3
        assert count.calls == 1  # only the first stage


def _flat_changes():
    """Changes that keep the keys and their order but flatten otherwise, or
    change what a slot holds."""
    def tensor_to_dict(sd):
        sd["t1"] = {"x": sd["t1"]}          # t1 -> t1.x
    def tensor_to_tensor_list(sd):
        sd["t2"] = [sd["t2"], torch.ones(2)]  # t2 -> t2.0, t2.1
    def value_to_dict(sd):
        sd["step"] = {"a": 1}                # step -> step.a
    def value_to_tensor_list(sd):
        sd["lr"] = [torch.ones(3)]           # lr -> lr.0
    def value_to_tensor(sd):
        sd["step"] = torch.tensor(5)
    def tensor_to_value(sd):
        sd["t3"] = 2.5
    def nested_empty_dict(sd):
        sd["t4"] = {}                        # flattens to nothing
    def str_subclass_keys(sd):
        class Key(str):
            def __str__(self):
                return "renamed_" + str.__str__(self)
        return {Key(k) if k == "t0" else k: v for k, v in sd.items()}
    def other_order(sd):
        return dict(reversed(list(sd.items())))
    def ordered_dict(sd):
        from collections import OrderedDict
        return OrderedDict(sd)
    def tensor_list_leaf(sd):
        sd["lr"] = [0.3, 0.4, 0.5]           # still a leaf: reused
    return {f.__name__: f for f in (tensor_to_dict, tensor_to_tensor_list, value_to_dict,
                                    value_to_tensor_list, value_to_tensor, tensor_to_value,
                                    nested_empty_dict, str_subclass_keys, other_order,
                                    ordered_dict, tensor_list_leaf)}


@pytest.mark.parametrize("change", list(_flat_changes()))
def test_a_flat_state_dict_that_flattens_otherwise_is_staged_as_torch_flattens_it(change):
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    before = _flat(1)
    after = _flat(2)
    out = _flat_changes()[change](after)
    after = out if out is not None else after
    with _stager() as stager:
        stager.stage(before)
        stager.stage(before)
        staged = stager.stage(after)
        _same(staged, after)
        # what the upload writes: torch's flat keys and mappings of `after`
        flat, mappings = stager.flat_of(staged)
        want_flat, want_mappings = flatten_state_dict(after)
        assert sorted(flat) == sorted(want_flat)
        assert dict(mappings) == dict(want_mappings)
        for k, v in want_flat.items():
            _same(flat[k], v, k)
        _same(stager.stage(before), before)  # and back


def test_flat_fast_path_checkpoint_loads_with_torch(tmp_path):
    with _stager() as stager:
        for step in range(3):
            sd = _flat(step)
            dcpx.async_save(sd, checkpoint_id=tmp_path / f"c{step}", async_stager=stager).result()
            out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
                   for k, v in sd.items()}
            tdcp.load(out, checkpoint_id=tmp_path / f"c{step}")
            _same(out, sd)


# --------------------------------------------------------------------------
# the staged upload's payloads from the layout


def _every_dtype(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    sd: dict = {"first_value": f"step {step}"}
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
               torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
               torch.complex64, torch.complex128):
        x = torch.randn(3, 5, generator=g) * 50
        if dt.is_complex:
            t = torch.complex(x, x.flip(0)).to(dt)
        elif dt == torch.bool:
            t = x > 0
        else:
            t = x.to(dt)
        sd[f"{dt}".removeprefix("torch.")] = t
        sd[f"{dt}_value"] = step  # a non-tensor between every two tensors
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32"):
        dt = getattr(torch, name, None)
        if dt is not None:
            sd[name] = (torch.randn(4, 2, generator=g) * 4).to(dt)
    sd["grad"] = torch.nn.Parameter(torch.randn(6, generator=g))
    sd["scalar"] = torch.tensor(float(step))
    sd["empty"] = torch.empty(0, 4)
    sd["last_value"] = [1, 2]
    return sd


def _load_like(sd: dict, path) -> dict:
    out = {k: (torch.zeros_like(v.detach()) if isinstance(v, torch.Tensor) else None)
           for k, v in sd.items()}
    tdcp.load(out, checkpoint_id=path)
    return out


@pytest.mark.parametrize("async_staging", [False, True])
def test_staged_upload_of_every_dtype_with_values_between_is_bit_exact(tmp_path, monkeypatch,
                                                                        async_staging):
    scans = []
    real = _plan.scan
    monkeypatch.setattr(_plan, "scan", lambda *a, **k: scans.append(1) or real(*a, **k))
    stager = dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=async_staging,
                                                    use_shared_memory=False))
    try:
        for step in range(4):
            sd = _every_dtype(step)
            resp = dcpx.async_save(sd, checkpoint_id=tmp_path / f"c{step}",
                                   async_stager=stager)
            upload = resp.upload_completion if async_staging else resp
            upload.result()
            out = _load_like(sd, tmp_path / f"c{step}")
            for k, v in sd.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(_bits(out[k]), _bits(v)), k
                    assert out[k].dtype == v.dtype, k
                else:
                    assert out[k] == v, k
            md = dcpx.FileSystemReader(tmp_path / f"c{step}").read_metadata()
            assert md.state_dict_metadata["grad"].properties.requires_grad
            assert set(md.state_dict_metadata) == set(sd)
        assert stager.reuse_count == 3
        assert len(scans) == 1  # the first upload of the layout only
    finally:
        stager.close()


def test_staged_upload_ignores_changes_after_staging(tmp_path):
    """The sources change after staging, and so do the staged tensors the
    caller was handed (their requires_grad, their bytes are the buffer's):
    the checkpoint holds the staged bytes and the layout's metadata."""
    stager = _stager()
    try:
        sd = _flat(1)
        sd["t0"] = torch.nn.Parameter(sd["t0"])
        dcpx.async_save(sd, checkpoint_id=tmp_path / "warm", async_stager=stager).result()
        sd = _flat(2)
        sd["t0"] = torch.nn.Parameter(sd["t0"])
        expected = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in sd.items()}
        up = dcpx.async_save(sd, checkpoint_id=tmp_path / "c", async_stager=stager)
        with torch.no_grad():
            for v in sd.values():
                if isinstance(v, torch.Tensor):
                    v.fill_(-1)
        up.result()
        out = _load_like(expected, tmp_path / "c")
        _same({k: v for k, v in out.items() if isinstance(v, torch.Tensor)},
              {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)})
        md = dcpx.FileSystemReader(tmp_path / "c").read_metadata()
        assert md.state_dict_metadata["t0"].properties.requires_grad
        # a staged tensor's requires_grad flipped by the caller: the next
        # upload of the layout still describes the staged bytes as staged
        staged = stager.stage(sd)
        staged["t0"].requires_grad_(False)
        sd2 = _flat(3)
        sd2["t0"] = torch.nn.Parameter(sd2["t0"])
        dcpx.async_save(sd2, checkpoint_id=tmp_path / "d", async_stager=stager).result()
        out = _load_like(sd2, tmp_path / "d")
        assert torch.equal(out["t0"], sd2["t0"].detach())
    finally:
        stager.close()


def test_upload_scan_matches_the_general_scan():
    """Signature and payload kinds equal to _plan.scan's, entry by entry."""
    from dcpx.storage.pending import staged_payload
    with _stager() as stager:
        for step in range(3):  # the first builds the cache, the others use it
            staged = stager.stage(_every_dtype(step))
            layout = stager._layout
            got = stager.upload_scan_of(staged)
            want_sig, want = _plan.scan(layout.flat, staged_payload)
            assert got[0] == want_sig
            assert len(got[1]) == len(want)
            # from the second call on: base items in the layout's buffer
            assert (len(got) == 3 and got[2] is layout.buffer.base) == (step > 0)
            for (k, v), p, w in zip(layout.flat.items(), got[1], want):
                if isinstance(w, bytes):
                    assert p == w, k
                elif step == 0:
                    assert type(p[0]) is type(w[0]) and p[1] == w[1], k
                else:
                    view = layout.dst[k]
                    assert p == (layout.offsets[k], view.numel() * view.element_size(),
                                 w[1], tuple(view.shape)), k
                    assert view.numel() == 0 or (
                        view.data_ptr() == layout.buffer.base.data_ptr() + p[0]), k
        assert stager.upload_scan_of({}) is None


def test_upload_scan_declines_for_a_state_dict_it_did_not_return():
    with _stager() as stager:
        stager.stage(_flat(1))
        assert stager.upload_scan_of(_flat(1)) is None


# --------------------------------------------------------------------------
# stage_plain's getters


def test_parameters_and_tensors_at_the_same_keys_switch_correctly():
    """Both exact types go through their own cached getters; a switch
    between them is a change (staged the general way)."""
    with _stager() as stager:
        for step in range(6):
            sd = _flat(step, n=4)
            if step % 3 == 1:
                sd["t1"] = torch.nn.Parameter(sd["t1"])
            if step % 3 == 2:
                sd["t1"] = torch.nn.Parameter(sd["t1"], requires_grad=False)
            _same(stager.stage(sd), sd)


def test_in_place_metadata_changes_of_the_same_objects_are_noticed():
    """The same tensor objects, changed in place (shape, strides, storage,
    requires_grad): each stage copies what they hold now."""
    sd = {"a": torch.randn(4, 6), "b": torch.randn(10), "c": torch.randn(3)}
    with _stager() as stager:
        _same(stager.stage(sd), sd)
        _same(stager.stage(sd), sd)
        sd["a"].t_()                      # strided now
        _same(stager.stage(sd), sd)
        sd["a"].t_()
        _same(stager.stage(sd), sd)
        sd["b"].resize_(5)                # fewer bytes
        _same(stager.stage(sd), sd)
        sd["b"].set_(torch.randn(5))      # other storage, same shape
        _same(stager.stage(sd), sd)
        sd["c"].requires_grad_(True)
        _same(stager.stage(sd), sd)
        with torch.no_grad():
            sd["c"].data = torch.randn(3, dtype=torch.float64)
        _same(stager.stage(sd), sd)
        assert stager.reuse_count >= 2
