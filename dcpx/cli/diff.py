"""``dcpx diff A B``: how two checkpoints differ (any formats the CLI reads:
DCP directories, ``torch.save`` files, safetensors files or sharded
directories).  Keys added and removed, dtype and shape changes; with
``--values``, tensor values (bit for bit, or within ``--rtol``/``--atol``)
and non-tensor values, read one key at a time from both sides."""
from __future__ import annotations

import sys

import torch

from ._common import dtype_name, open_source, progress
from ._show import same as same_value
from ._show import text

HELP = "compare two checkpoints: keys, dtypes, shapes, optionally values"

#: characters of each side of a differing non-tensor value shown
VALUE_TEXT_MAX = 200


def _same_values(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple:
    """(equal, detail)."""
    if rtol == 0 and atol == 0:
        ua = a.contiguous().reshape(-1).view(torch.uint8)
        ub = b.contiguous().reshape(-1).view(torch.uint8)
        if torch.equal(ua, ub):
            return True, ""
        n = int((ua != ub).reshape(-1, a.element_size()).any(dim=1).sum())
        return False, f"{n} of {a.numel()} elements differ bitwise"
    if a.dtype in (torch.int64, torch.uint64) and b.dtype == a.dtype:
        # float64 holds 53 bits: 2**53 + 1 and 2**53 would compare equal
        dist = _int64_distance(a, b)
        close = dist <= atol + rtol * b.to(torch.float64).abs()
        if bool(close.all()):
            return True, ""
        bad = ~close
        worst = float(dist[bad].max())
        return False, (f"{int(bad.sum())} of {a.numel()} elements outside rtol={rtol} "
                       f"atol={atol} (max abs difference {worst:g})")
    wide = torch.complex128 if (a.is_complex() or b.is_complex()) else torch.float64
    x, y = a.to(wide), b.to(wide)
    close = torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return True, ""
    bad = ~close
    worst = float((x - y).abs()[bad].max()) if bad.any() else 0.0
    return False, (f"{int(bad.sum())} of {a.numel()} elements outside rtol={rtol} "
                   f"atol={atol} (max abs difference {worst:g})")


def _int64_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| of two int64 (or uint64) tensors, as float64 computed from the
    exact difference (rounded once, so a difference of 1 stays 1 at any
    magnitude): the difference modulo 2**64 of the larger minus the
    smaller, read as an unsigned number."""
    x = a.contiguous().reshape(-1).view(torch.int64)
    y = b.contiguous().reshape(-1).view(torch.int64)
    if a.dtype == torch.uint64:  # unsigned order as signed: flip the top bit
        top = torch.tensor(-(1 << 63), dtype=torch.int64)
        x, y = x ^ top, y ^ top
    d = torch.where(x >= y, x - y, y - x)       # wraps: the true |a - b| mod 2**64
    lo = (d & 0xFFFFFFFF).to(torch.float64)
    hi = ((d >> 32) & 0xFFFFFFFF).to(torch.float64)
    return (hi * 4294967296.0 + lo).reshape(a.shape)


def diff(a_path: str, b_path: str, *, values: bool = False, rtol: float = 0.0,
         atol: float = 0.0, out=None, show_progress: bool = False) -> int:
    """Print the differences; return how many keys differ."""
    out = out or sys.stdout
    a, b = open_source(a_path), open_source(b_path)
    ea, eb = a.entries(), b.entries()
    n = 0
    for k in sorted(ea.keys() - eb.keys()):
        print(f"- {k}", file=out)
        n += 1
    for k in sorted(eb.keys() - ea.keys()):
        print(f"+ {k}", file=out)
        n += 1
    compare = []
    for k in sorted(ea.keys() & eb.keys()):
        x, y = ea[k], eb[k]
        if x.is_tensor != y.is_tensor:
            what = lambda e: f"tensor {dtype_name(e.dtype)}{list(e.shape)}" if e.is_tensor else "value"
            print(f"~ {k}: {what(x)} -> {what(y)}", file=out)
            n += 1
            continue
        if x.is_tensor and (x.dtype != y.dtype or x.shape != y.shape):
            print(f"~ {k}: {dtype_name(x.dtype)}{list(x.shape)} -> "
                  f"{dtype_name(y.dtype)}{list(y.shape)}", file=out)
            n += 1
            continue
        compare.append(k)
    if values:
        with progress(sum(ea[k].nbytes for k in compare), "diff", enabled=show_progress) as bar:
            for k in compare:
                va, vb = a.read(k), b.read(k)
                if isinstance(va, torch.Tensor):
                    same, detail = _same_values(va, vb, rtol, atol)
                else:
                    # bounded: shared parts compared and shown once
                    same, how = same_value(va, vb)
                    detail = f"{text(va, VALUE_TEXT_MAX)} -> {text(vb, VALUE_TEXT_MAX)}"
                    if how:
                        detail += f" (too large or deep to compare element by element: " \
                                  f"compared as {how})"
                if not same:
                    print(f"~ {k}: {detail}", file=out)
                    n += 1
                bar.update(ea[k].nbytes)
                a.release(k, va)
                b.release(k, vb)
                del va, vb
    what = "keys and values" if values else "keys, dtypes and shapes"
    print(f"{n} difference(s) ({len(ea)} keys in A, {len(eb)} in B; compared {what})", file=out)
    return n


def add_parser(sub, **common) -> None:
    p = sub.add_parser("diff", help=HELP, description=HELP + ".", **common)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--values", action="store_true",
                   help="also compare values (tensors bit for bit unless --rtol/--atol)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (implies --values)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (implies --values)")
    p.set_defaults(run=run)


def run(args) -> int:
    values = args.values or args.rtol > 0 or args.atol > 0
    return 1 if diff(args.a, args.b, values=values, rtol=args.rtol, atol=args.atol,
                     show_progress=True) else 0
