"""How each torch dtype is named inside a torch.save archive, and how it
enters the C core.

torch.save pickles the classic dtypes as a legacy typed storage
(``torch.FloatStorage``, numel in elements, ``_rebuild_tensor_v2``) and every
newer dtype as an ``UntypedStorage`` (numel in bytes) plus the dtype itself
(``_rebuild_tensor_v3``).  The C core writes and parses both; it is told
which by the name returned here: a ``...Storage`` class name, or the dtype's
own name.

DLPack cannot export every dtype (the ``bits*`` types; float8 on older
torch).  Such tensors enter through a same-itemsize integer view: the bytes,
the shape and the strides are identical, only the DLPack dtype code differs,
and the archive still records the real dtype.
"""
from __future__ import annotations

import functools
import io
import warnings

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@functools.lru_cache(maxsize=None)
def storage_type_name(dtype: torch.dtype) -> str:
    """The name dcpx's C core uses for ``dtype`` in an archive; raises
    TypeError for dtypes torch.save itself cannot store."""
    legacy = torch.storage._dtype_to_storage_type_map()
    if dtype in legacy:
        return legacy[dtype]
    try:  # torch.save refuses some dtypes (sub-byte ints): so do we
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "ComplexHalf is experimental"
            torch.save(torch.empty(0, dtype=dtype), io.BytesIO())
    except Exception as e:
        raise TypeError(
            f"dtype {dtype} cannot be stored in a DCP checkpoint "
            f"(torch.save does not support it either)"
        ) from e
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=None)
def _needs_int_view(dtype: torch.dtype) -> bool:
    """Whether the C core would refuse this dtype's DLPack export: no
    export at all (bits*), or one it cannot take bytewise (float4_e2m1fn_x2
    comes as 4 bits x 2 lanes)."""
    from .. import _C
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _C.probe_tensor(torch.empty(1, dtype=dtype))
        return False
    except Exception:
        return True


def dlpack_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a same-layout integer view DLPack can export."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if _needs_int_view(t.dtype):
        return t.view(_INT_VIEW[t.element_size()])
    return t


_TO_DLPACK = getattr(torch._C, "_to_dlpack_versioned", None)


def dlpack_export(t: torch.Tensor):
    """What the C core ingests for ``t``: for a plain CPU tensor a DLPack
    capsule made by torch's C exporter directly (about 4x cheaper than
    ``Tensor.__dlpack__``'s Python checks, benchmarks/bench_micro.py, which dcpx has made already:
    detached, no conj/neg bit, strided); otherwise ``t`` itself, and the C
    core calls ``__dlpack__``.  A capsule is consumed by one C call."""
    if (_TO_DLPACK is not None and type(t) is torch.Tensor and t.is_cpu
            and not t.requires_grad and not t.is_conj() and not t.is_neg()):
        return _TO_DLPACK(t)
    return t
