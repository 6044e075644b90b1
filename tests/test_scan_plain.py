"""``_C.scan_plain`` (csrc/payloads.c): the payloads of a state dict's plain
CPU tensors made in one C pass, as ``_pending._direct_payload`` makes them
one by one in Python, and the comparison with a plan's signature.

Each payload must describe the very memory ``_direct_payload``'s does
(pointer, shape, strides, dtype, storage type); every value that function
leaves to the checked path must be left to Python (a hole), so that its
refusal still names the key."""
from __future__ import annotations

import pytest
import torch

import dcpx
from conftest import SAVEABLE_DTYPES, make_tensor
from dcpx import _C
from dcpx.coordination import plan as _plan
from dcpx.storage import pending as _pending


class Sub(torch.Tensor):
    pass


def _values():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    c = torch.randn(4, dtype=torch.complex64, generator=g)
    vals = {
        "plain": base,
        "0-d": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "transposed": base.t(),
        "offset view": base[2:, 1:],
        "strided": base[::2],
        "param": torch.nn.Parameter(base.clone()),
        "grad": torch.randn(3, requires_grad=True),
        "non-leaf grad": torch.randn(3, requires_grad=True) * 2,
        "conj": c.conj(),
        "neg": c.conj().imag,
        "complex": c,
        "sparse": base.to_sparse(),
        "csr": base.to_sparse_csr(),
        "mkldnn": base.to_mkldnn(),
        "meta": torch.empty(3, device="meta"),
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "quantized": torch.quantize_per_tensor(base, 0.1, 0, torch.qint8),
        "subclass": base.clone().as_subclass(Sub),
        "int": 3,
        "str": "x",
        "none": None,
    }
    for d in SAVEABLE_DTYPES:
        vals[f"dtype {d}"] = make_tensor((3, 2), d, g)
    return vals


def _same_memory(a, b):
    """Two payloads describe the same bytes (or both are None)."""
    if a is None or b is None:
        return a is None and b is None
    ta, tb = torch.from_dlpack(a[0]), torch.from_dlpack(b[0])
    return (a[1] == b[1] and ta.dtype == tb.dtype and ta.shape == tb.shape
            and ta.stride() == tb.stride() and ta.data_ptr() == tb.data_ptr()
            and not ta.requires_grad)


def _direct_of_every_dtype(vals):
    for k, v in vals.items():  # what _pending learns from checked saves
        if isinstance(v, torch.Tensor):
            try:
                _pending.tensor_payload(v, k)
            except (TypeError, ValueError, RuntimeError):
                pass


def test_payloads_and_holes_are_direct_payloads():
    vals = _values()
    _direct_of_every_dtype(vals)
    values = list(vals.values())
    payloads, holes, same = _C.scan_plain(values, None, _pending._DIRECT,
                                          _pending.dl_dtypes(), _pending._TO_DLPACK, False)
    assert same is False
    assert len(payloads) == len(values)
    for i, (k, v) in enumerate(vals.items()):
        want = _pending._direct_payload(v) if isinstance(v, torch.Tensor) else None
        assert _same_memory(payloads[i], want), k
        assert (payloads[i] is None) == (i in holes), k
    taken = {k for i, k in enumerate(vals) if i not in holes}
    assert {"plain", "0-d", "empty", "transposed", "offset view", "param", "grad",
            "complex"} <= taken
    assert not taken & {"conj", "neg", "sparse", "csr", "mkldnn", "meta", "nested",
                        "quantized", "subclass",
                        "int", "str", "none"}


def test_a_dtype_never_checked_is_left_to_python():
    t = torch.ones(3, dtype=torch.float64)
    payloads, holes, _ = _C.scan_plain([t], None, {}, _pending.dl_dtypes(),
                                       _pending._TO_DLPACK, False)
    assert payloads == [None] and holes == [0]


@pytest.mark.parametrize("change,same", [
    ("none", True), ("shape", False), ("dtype", False), ("requires_grad", False),
    ("pinned", False), ("short", False)])
def test_signature_comparison(change, same):
    vals = [torch.ones(2, 3), torch.zeros(4), torch.ones(1, dtype=torch.int8)]
    _direct_of_every_dtype(dict(enumerate(vals)))
    expect = [(v.dtype, v.shape, v.requires_grad, False) for v in vals]
    if change == "shape":
        expect[1] = (torch.float32, torch.Size([5]), False, False)
    elif change == "dtype":
        expect[2] = (torch.uint8, torch.Size([1]), False, False)
    elif change == "requires_grad":
        expect[0] = (torch.float32, torch.Size([2, 3]), True, False)
    elif change == "pinned":
        expect[0] = (torch.float32, torch.Size([2, 3]), False, True)
    elif change == "short":
        expect[1] = (torch.float32, torch.Size([4]), False, False, (0,), (4,))
    _, holes, got = _C.scan_plain(vals, expect, _pending._DIRECT, _pending.dl_dtypes(),
                                  _pending._TO_DLPACK, False)
    assert holes == [] and got is same


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="expect"):
        _C.scan_plain([torch.ones(1)], [], {}, {}, _pending._TO_DLPACK, False)
    with pytest.raises(TypeError):
        _C.scan_plain((torch.ones(1),), None, {}, {}, _pending._TO_DLPACK, False)


def test_an_export_that_raises_leaves_the_value_to_python():
    def boom(t):
        raise RuntimeError("export failed")
    _direct_of_every_dtype({"x": torch.ones(2)})
    payloads, holes, same = _C.scan_plain([torch.ones(2)], None, _pending._DIRECT,
                                          _pending.dl_dtypes(), boom, False)
    assert payloads == [None] and holes == [0] and same is False


def test_plan_scan_matches_the_python_scan(tmp_path):
    """_plan.scan with and without a plan to compare against gives the
    signature and payloads the value-by-value scan gives."""
    vals = _values()
    _direct_of_every_dtype(vals)
    flat = {k: v for k, v in vals.items()
            if not isinstance(v, torch.Tensor) or k in ("plain", "0-d", "empty", "transposed",
                                                        "param", "grad", "complex", "conj",
                                                        "neg", "subclass")
            or k.startswith("dtype")}
    sig, payloads = _plan.scan(flat, _pending.tensor_payload)
    cuda = torch.cuda.is_available()
    for (k, v), s, p in zip(flat.items(), sig, payloads):
        want_p, want_s = _plan._scan_one(v, k, _pending.tensor_payload, cuda)
        assert s == want_s, k
        if isinstance(v, torch.Tensor):
            assert _same_memory(p, want_p) or k in ("conj", "neg"), k
        else:
            assert p == want_p, k
    again, _ = _plan.scan(flat, _pending.tensor_payload, sig)
    assert again is None
    sig2 = list(sig)
    sig2[-1] = None
    again, _ = _plan.scan(flat, _pending.tensor_payload, sig2)
    assert again == sig
    # and a save of it loads
    md = dcpx.save({k: v for k, v in flat.items() if k not in ("subclass",)},
                   checkpoint_id=tmp_path / "c")
    assert len(md.state_dict_metadata) == len(flat) - 1


def test_dl_dtype_table_names_each_dlpack_dtype_by_its_one_torch_dtype():
    """Every entry is the one torch dtype whose tensors export with that
    DLPack dtype; a DLPack dtype two torch dtypes share is not in it (the
    tensor's dtype getter answers then)."""
    table = _pending.dl_dtypes()
    keys = {}
    for d in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
        try:
            keys.setdefault(_C.dlpack_dtype_key(_pending._TO_DLPACK(torch.empty(1, dtype=d))),
                            set()).add(d)
        except Exception:
            pass
    assert torch.float32 in table.values()
    for k, d in table.items():
        assert keys[k] == {d}
    for k, ds in keys.items():
        assert (k in table) == (len(ds) == 1 and k >= 0)


def test_dtypes_the_table_leaves_out_are_asked_of_the_tensor():
    """int8 and uint8 share their DLPack dtype with the sub-byte dtypes on
    this torch: scan_plain asks the tensor, and the payload names it."""
    vals = [torch.ones(3, dtype=torch.int8), torch.ones(3, dtype=torch.uint8),
            torch.ones(3, dtype=torch.bool), torch.ones(3)]
    _direct_of_every_dtype(dict(enumerate(vals)))
    expect = [(v.dtype, v.shape, False, False) for v in vals]
    payloads, holes, same = _C.scan_plain(vals, expect, _pending._DIRECT, _pending.dl_dtypes(),
                                          _pending._TO_DLPACK, False)
    assert holes == [] and same is True
    for v, p in zip(vals, payloads):
        assert p[1] == _pending._direct_payload(v)[1]
        assert torch.from_dlpack(p[0]).dtype == v.dtype
    # and a table that lies about a dtype is believed: it must be exact
    wrong = {k: torch.float64 for k in _pending.dl_dtypes()}
    _, _, same = _C.scan_plain(vals[3:], expect[3:], _pending._DIRECT, wrong,
                               _pending._TO_DLPACK, False)
    assert same is False


def test_reference_counts_are_kept_on_every_path():
    """Taken, left to Python, refused by the export, conj (asked after the
    export): the values, dtypes and storage type names are held as before
    once the payloads are gone."""
    import sys
    c = torch.randn(3, dtype=torch.complex64)
    vals = [torch.ones(2), torch.nn.Parameter(torch.ones(2)), c, c.conj(),
            torch.empty(1, device="meta"), ["not a tensor"]]
    _direct_of_every_dtype(dict(enumerate(vals)))
    stype = _pending._DIRECT[torch.float32]
    expect = [(torch.float32, torch.Size([2]), False, False)] * 2 + [None] * 4

    def counts():
        return ([sys.getrefcount(v) for v in vals], sys.getrefcount(stype),
                sys.getrefcount(torch.float32))
    before = counts()
    for _ in range(50):
        out = _C.scan_plain(vals, expect, _pending._DIRECT, _pending.dl_dtypes(),
                            _pending._TO_DLPACK, False)
        assert out[1] == [3, 4, 5]
        del out
    assert counts() == before
