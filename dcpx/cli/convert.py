"""``dcpx convert SRC DST``: between a DCP checkpoint, a single
``torch.save`` file and safetensors (one file, or shards with the Hugging
Face ``model.safetensors.index.json``), in every direction.

Streaming, with bounded memory: a checkpoint larger than RAM converts.  The
output's layout (keys, dtypes, shapes, offsets) is known from the input's
metadata before any tensor is read; then tensors are read one at a time
(for a DCP input: each key's chunks, DTensor / FSDP shards included, read
into one consolidated tensor) and written out before the next is read.

* safetensors output: the header, then each tensor's bytes, written here
  (the ``safetensors`` library's writers take the whole state dict at once);
  inputs are read with ``safetensors.safe_open``.  Outputs load with
  ``safetensors.torch.load_file``.
* ``torch.save`` output: a zip archive written record by record with the
  writer ``torch.save`` itself uses (``torch._C.PyTorchFileWriter``: 64-byte
  aligned records, CRC-32s); the ``data.pkl`` record is the pickle
  ``torch.save`` writes for the same flat dict (tensors as
  ``_rebuild_tensor_v2/v3`` of a persistent storage key), built before the
  data.  Loads with ``torch.load(weights_only=True)``.
* DCP output: dcpx's C writer, one data file per 64 MiB of tensors (or per
  tensor when larger), then the ``.metadata`` commit.

Keys are flattened FQNs (``a.b.c``), as DCP stores them.  Non-tensor
values: safetensors cannot hold them; string values go into the header's
``__metadata__`` under their key, every other one is skipped with a warning
naming it.  ``__metadata__`` always has ``"format": "pt"`` (what
``transformers`` checks).
"""
from __future__ import annotations

import collections
import ctypes
import functools
import io
import json
import os
import pickle
import re
import struct
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from ._common import (
    SAFETENSORS_INDEX,
    CliError,
    Entry,
    Source,
    dtype_name,
    human,
    need_safetensors,
    open_source,
    progress,
    warn,
)

HELP = "convert between DCP, torch.save and safetensors (single or sharded), streaming"

#: bytes of tensors gathered into one DCP data file (one tensor when larger)
DCP_FILE_BYTES = 64 << 20

_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000000' -> bytes (decimal units as Hugging
    Face's ``max_shard_size``, binary ones with 'i')."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise CliError(f"cannot read the size {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    n, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary else 1000
    return int(n * base ** " KMGT".index(unit or " "))


def output_format(dst: str, to: Optional[str], sharded: bool) -> str:
    if to:
        return to
    if dst.endswith(".safetensors"):
        return "safetensors"
    if dst.endswith(_TORCH_SUFFIXES):
        return "torch"
    return "safetensors" if sharded else "dcp"


# -- bytes of a tensor, without a copy ------------------------------------

def _dense(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous host memory holding its own values (a copy only when
    it is not already: strided, or a lazily conjugated / negated view)."""
    t = t.detach().cpu()
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg().contiguous()
    return t


def _write_tensor(f, t: torch.Tensor) -> None:
    t = _dense(t)
    n = t.numel() * t.element_size()
    if n:
        f.write((ctypes.c_char * n).from_address(t.data_ptr()))


def _check(key: str, t: Any, e: Entry) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != e.dtype or tuple(t.shape) != e.shape:
        raise CliError(f"key {key!r}: read {getattr(t, 'dtype', type(t).__name__)}"
                       f"{list(getattr(t, 'shape', ()))}, its metadata says "
                       f"{dtype_name(e.dtype)}{list(e.shape)}")
    return t


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp.{os.getpid()}")


# -- safetensors ----------------------------------------------------------

def _st_names() -> dict:
    need_safetensors()
    from safetensors.torch import _TYPES
    return {dtype: name for name, dtype in _TYPES.items()}


def _split_values(src: Source, entries: dict) -> tuple[list, dict]:
    """(tensor entries, string metadata) for a safetensors output; warns
    about every value it skips."""
    tensors = [e for e in entries.values() if e.is_tensor]
    if any(e.key == "__metadata__" for e in tensors):
        raise CliError("a tensor named '__metadata__' cannot be saved in safetensors (the "
                       "header's own metadata has that name): rename it, or leave it out "
                       "with --only")
    meta: dict[str, str] = {"format": "pt"}
    skipped = []
    for e in entries.values():
        if e.is_tensor:
            continue
        v = src.read(e.key)
        if isinstance(v, str) and e.key not in meta:
            meta[e.key] = v
        else:
            skipped.append(f"{e.key} ({type(v).__name__})")
    if skipped:
        warn(f"safetensors holds only tensors (and string metadata): skipped "
             f"{len(skipped)} value(s): {', '.join(skipped)}")
    names = _st_names()
    bad = [f"{e.key} ({dtype_name(e.dtype)})" for e in tensors if e.dtype not in names]
    if bad:
        raise CliError(f"safetensors has no dtype for: {', '.join(bad)} (it supports "
                       f"{', '.join(sorted(dtype_name(d) for d in names))})")
    return tensors, meta


def _write_safetensors_file(src: Source, path: Path, tensors: list, meta: dict, bar) -> int:
    names = _st_names()
    header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    off = 0
    for e in tensors:
        header[e.key] = {"dtype": names[e.dtype], "shape": list(e.shape),
                         "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)   # the data starts 8-byte aligned, as the library writes it
    tmp = _tmp(path)
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for e in tensors:
                t = _check(e.key, src.read(e.key), e)
                _write_tensor(f, t)
                src.release(e.key, t)
                del t
                bar.update(e.nbytes)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    return off


def _unlink(p: Path) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def to_safetensors(src: Source, dst: Path, max_shard: Optional[int], bar_on: bool) -> str:
    entries = src.entries()
    tensors, meta = _split_values(src, entries)
    total = sum(e.nbytes for e in tensors)
    with progress(total, "convert", enabled=bar_on) as bar:
        if max_shard is None:
            _write_safetensors_file(src, dst, tensors, meta, bar)
            return f"{len(tensors)} tensors ({human(total)}) -> {dst}"
        shards: list[list[Entry]] = [[]]
        size = 0
        for e in tensors:
            if shards[-1] and size + e.nbytes > max_shard:
                shards.append([])
                size = 0
            shards[-1].append(e)
            size += e.nbytes
        dst.mkdir(parents=True, exist_ok=True)
        n = len(shards)
        weight_map = {}
        for i, group in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            _write_safetensors_file(src, dst / name, group, meta, bar)
            weight_map.update({e.key: name for e in group})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        tmp = _tmp(dst / SAFETENSORS_INDEX)
        tmp.write_text(json.dumps(index, indent=2) + "\n")
        os.replace(tmp, dst / SAFETENSORS_INDEX)
        for old in dst.glob("model-*-of-*.safetensors"):   # shards of an overwritten export
            if old.name not in set(weight_map.values()):
                _unlink(old)
        return f"{len(tensors)} tensors ({human(total)}) in {n} shard(s) -> {dst}"


# -- torch.save -----------------------------------------------------------

class _TensorRef:
    """Stands for a tensor in data.pkl; pickles as torch.save pickles it.
    ``mem``: what is in memory, for a tensor held inside a non-tensor value
    (a tuple holding a tensor): the tensor itself (contiguous), or the
    storage torch's own reduce of a tensor subclass named; None for the
    source's tensors, read when their record is written."""
    __slots__ = ("key", "dtype", "shape", "mem", "requires_grad")

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple,
                 mem: Any = None, requires_grad: bool = False):
        self.key, self.dtype, self.shape, self.mem = key, dtype, shape, mem
        self.requires_grad = requires_grad

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class _StorageRef:
    __slots__ = ("key", "stype", "numel")

    def __init__(self, key: str, stype: Any, numel: int):
        self.key, self.stype, self.numel = key, stype, numel


def _strides(shape: tuple) -> tuple:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


class _Pickler(pickle.Pickler):
    """torch.save's pickler, for tensors that are not in memory: the same
    reduce (torch.Tensor._reduce_ex_internal) and persistent ids
    (torch.serialization._save).  Inside a value, a plain tensor is pickled
    the same way (one dense record of its own bytes); anything else
    (a ``Parameter``, whose reduce names its ``.data``, a plain tensor;
    other subclasses) reduces as torch.save reduces it, the storages it
    names becoming records as torch.save makes them."""

    def __init__(self, f):
        super().__init__(f, protocol=2)   # torch.serialization.DEFAULT_PROTOCOL
        self.order: list[_TensorRef] = []
        self._storages: dict[int, str] = {}   # storage._cdata -> its record's key
        self._v3 = torch.storage._new_dtypes()
        self._legacy = torch.storage._dtype_to_storage_type_map()

    def reducer_override(self, obj):
        if type(obj) is torch.Tensor:
            # a tensor inside a non-tensor value: a record of its own, as
            # torch.save writes it.  Only a plain tensor: a Parameter's own
            # reduce (torch._utils._rebuild_parameter of its .data) keeps
            # it a Parameter, as torch.save does.
            if obj.layout != torch.strided or obj.is_quantized or obj.device.type != "cpu":
                return NotImplemented
            t = obj.detach().resolve_conj().resolve_neg().contiguous()
            obj = _TensorRef(None, t.dtype, tuple(t.shape), t, obj.requires_grad)
        if not isinstance(obj, _TensorRef):
            return NotImplemented
        key = str(len(self.order))
        self.order.append(obj)
        numel = 1
        for s in obj.shape:
            numel *= s
        hooks = collections.OrderedDict()
        if obj.dtype in self._v3 or obj.dtype not in self._legacy:
            st = _StorageRef(key, torch.UntypedStorage, numel * obj.dtype.itemsize)
            return (torch._utils._rebuild_tensor_v3,
                    (st, 0, tuple(obj.shape), _strides(obj.shape), obj.requires_grad, hooks,
                     obj.dtype))
        st = _StorageRef(key, getattr(torch, self._legacy[obj.dtype]), numel)
        return (torch._utils._rebuild_tensor_v2,
                (st, 0, tuple(obj.shape), _strides(obj.shape), obj.requires_grad, hooks))

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            return ("storage", obj.stype, obj.key, "cpu", obj.numel)
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            # a storage that torch's own reduce of a tensor named (a tensor
            # subclass, a tensor on another device): as torch.save's
            # persistent_id names it (pickle's default would embed its
            # bytes through torch.storage._load_from_bytes, which
            # torch.load(weights_only=True) refuses)
            if isinstance(obj, torch.storage.TypedStorage):
                st, stype, numel = (obj._untyped_storage, getattr(torch, obj._pickle_storage_type()),
                                    obj._size())
            else:
                st, stype, numel = obj, torch.UntypedStorage, obj.nbytes()
            key = self._storages.get(st._cdata)
            if key is None:
                key = self._storages[st._cdata] = str(len(self.order))
                self.order.append(_TensorRef(None, torch.uint8, (st.nbytes(),), st))
            return ("storage", stype, key, torch.serialization.location_tag(st), numel)
        return None


def _weights_only_refusal(v: Any) -> Optional[str]:
    """Why ``torch.load(weights_only=True)`` would refuse the value (dcpx's
    own allow-list also admits numpy arrays, deques, Namespaces, ...), or
    None."""
    buf = io.BytesIO()
    torch.save(v, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()
        found = [ln.strip() for ln in first if "GLOBAL" in ln or "Unsupported" in ln]
        return (found[0] if found else f"{type(v).__name__}")[:200]
    return None


def _storage_bytes(t: torch.Tensor) -> Any:
    """The untyped storage holding exactly the bytes of ``t`` (contiguous):
    its own storage, or a slice of it, which shares its memory."""
    st = t.untyped_storage()
    n = t.numel() * t.element_size()
    off = t.storage_offset() * t.element_size()
    return st if off == 0 and st.nbytes() == n else st[off:off + n]


def _check_loads(tmp: Path, dst: Path) -> None:
    """The finished file loads with torch.load(weights_only=True) (mapped,
    so no tensor data is read)."""
    try:
        got = torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
        del got
    except Exception as e:
        raise CliError(f"{dst}: the written file does not load with torch.load("
                       f"weights_only=True): {e}") from e


def to_torch(src: Source, dst: Path, bar_on: bool) -> str:
    from ..filesystem import (check_saveable, torch_file_writer, torch_save_alignment,
                              torch_save_header)
    entries = src.entries()
    obj: dict[str, Any] = {}
    skipped = []
    for e in entries.values():
        if e.is_tensor:
            check_saveable(torch.empty(0, dtype=e.dtype), e.key)
            obj[e.key] = _TensorRef(e.key, e.dtype, e.shape)
        else:
            v = src.read(e.key)
            why = _weights_only_refusal(v)
            if why:
                skipped.append(f"{e.key} ({why})")
            else:
                obj[e.key] = v
    if skipped:
        warn(f"torch.load(weights_only=True) would refuse these values, so they are "
             f"skipped: {'; '.join(skipped)} (a DCP output keeps them)")
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(obj)
    order = p.order
    data = buf.getvalue()
    total = sum(r.nbytes if r.mem is not None else entries[r.key].nbytes for r in order)
    align = torch_save_alignment()
    tmp = _tmp(dst)
    try:
        with open(tmp, "wb") as f, progress(total, "convert", enabled=bar_on) as bar:
            w = torch_file_writer(f, align)
            ended = False
            try:
                w.write_record("data.pkl", data, len(data))
                for name, text in torch_save_header(align):
                    w.write_record(name, text, len(text))
                w.write_record("byteorder", sys.byteorder, len(sys.byteorder))
                for i, ref in enumerate(order):
                    if ref.mem is not None:   # a tensor (or storage) inside a value
                        st = (_storage_bytes(ref.mem) if isinstance(ref.mem, torch.Tensor)
                              else ref.mem.cpu())
                        w.write_record(f"data/{i}", st, ref.nbytes)
                        bar.update(ref.nbytes)
                        continue
                    e = entries[ref.key]
                    t = _dense(_check(e.key, src.read(e.key), e))
                    # This tensor's bytes only, from its own memory (a view
                    # of a larger storage needs no copy): a slice of its
                    # storage shares that memory.  A storage, as torch.save
                    # passes it (a data pointer is deprecated: torch warns).
                    w.write_record(f"data/{i}", _storage_bytes(t), e.nbytes)
                    src.release(e.key, t)
                    del t
                    bar.update(e.nbytes)
                ended = True
                w.write_end_of_file()
            finally:
                # A writer left unfinished writes its end in its destructor,
                # after the file is closed, and aborts the process: end it
                # here (the file is removed on an error).
                if not ended:
                    try:
                        w.write_end_of_file()
                    except Exception:
                        pass
                del w
            f.flush()
            os.fsync(f.fileno())
        _check_loads(tmp, dst)
        os.replace(tmp, dst)
    except BaseException:
        _unlink(tmp)
        raise
    n = sum(r.mem is None for r in order)
    return f"{n} tensors, {len(obj) - n} other values ({human(total)}) -> {dst}"


# -- DCP --------------------------------------------------------------------

def to_dcp(src: Source, dst: Path, bar_on: bool) -> str:
    from ..filesystem import FileSystemWriter, LazyItem
    entries = src.entries()
    total = sum(e.nbytes for e in entries.values() if e.is_tensor)

    with progress(total, "convert", enabled=bar_on) as bar:
        def read(e: Entry) -> Any:
            v = src.read(e.key)
            if not e.is_tensor:
                return v
            t = _check(e.key, v, e)
            bar.update(e.nbytes)
            return t

        def release(key: str, v: Any) -> None:  # once its file is written
            if isinstance(v, torch.Tensor):
                src.release(key, v)

        # each value is read only once the previous file is written (if it
        # would not fit): one file's tensors in memory
        items = ((e.key, LazyItem(e.nbytes, functools.partial(read, e)))
                 for e in entries.values())
        md = FileSystemWriter(dst).write_items(items, planner_data=src.paths(),
                                               file_bytes=DCP_FILE_BYTES, written=release)
    nfiles = len({info.relative_path for info in md.storage_data.values()})
    n_t = sum(1 for e in entries.values() if e.is_tensor)
    return (f"{n_t} tensors, {len(entries) - n_t} other values ({human(total)}) in "
            f"{nfiles} data file(s) -> {dst}")


def _remove_stale(dst: Path, fmt: str) -> list[str]:
    """After an ``--overwrite`` into the directory ``dst``: remove the files
    of an earlier export in another layout, which loaders would otherwise
    find beside the new output (``transformers`` takes a
    ``model.safetensors`` before an index; ``detect`` takes a ``.metadata``
    first).  A sharded safetensors output removes every ``*.safetensors``
    file its index does not name and a DCP checkpoint's ``.metadata`` and
    ``*.distcp`` files; a DCP output removes ``*.safetensors`` files and the
    index.  Other files (a model's config.json, tokenizer) stay."""
    if fmt == "safetensors":
        try:
            keep = set(json.loads((dst / SAFETENSORS_INDEX).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []
        stale = [p for p in dst.glob("*.safetensors") if p.name not in keep]
        stale += [p for p in dst.glob("*.distcp")] + [dst / ".metadata"]
    elif fmt == "dcp":
        stale = list(dst.glob("*.safetensors")) + [dst / SAFETENSORS_INDEX]
    else:
        return []
    removed = []
    for p in stale:
        if p.is_file() and not p.is_symlink():
            _unlink(p)
            removed.append(p.name)
    return sorted(removed)


class _Selected(Source):
    """The keys of ``src`` that start with one of ``only`` (all when empty),
    renamed without ``strip`` (e.g. export ``model.*`` of a training
    checkpoint as the model's own state dict)."""

    def __init__(self, src: Source, only: list, strip: Optional[str]):
        self.src, self.kind, self.path = src, src.kind, src.path
        self._map: dict[str, str] = {}
        for k in src.entries():
            if only and not any(k.startswith(p) for p in only):
                continue
            new = k[len(strip):] if strip and k.startswith(strip) else k
            if not new:
                raise CliError(f"--strip-prefix {strip!r} leaves the key {k!r} empty")
            if new in self._map:
                raise CliError(f"keys {self._map[new]!r} and {k!r} both become {new!r}")
            self._map[new] = k
        if not self._map:
            raise CliError(f"no key starts with {' or '.join(map(repr, only))}")

    def entries(self) -> dict[str, Entry]:
        e = self.src.entries()
        return {new: e[old]._replace(key=new) for new, old in self._map.items()}

    def paths(self) -> dict[str, tuple]:
        return {new: (new,) for new in self._map}

    def read(self, key: str) -> Any:
        return self.src.read(self._map[key])

    def release(self, key: str, value: Any) -> None:
        self.src.release(self._map[key], value)


def convert(src_path: str, dst_path: str, *, to: Optional[str] = None,
            src_format: Optional[str] = None, max_shard_size: Optional[str] = None,
            overwrite: bool = False, only: Optional[list] = None,
            strip_prefix: Optional[str] = None, show_progress: bool = False, out=None) -> int:
    out = out or sys.stdout
    max_shard = parse_size(max_shard_size) if max_shard_size else None
    fmt = output_format(dst_path, to, max_shard is not None)
    if max_shard is not None and fmt != "safetensors":
        raise CliError("--max-shard-size is for safetensors output")
    if max_shard is not None and max_shard <= 0:
        raise CliError("--max-shard-size must be positive")
    dst = Path(dst_path)
    if dst.exists() and not overwrite and (not dst.is_dir() or any(dst.iterdir())):
        raise CliError(f"{dst}: exists (pass --overwrite to replace it)")
    if fmt == "safetensors" and max_shard is None and dst.is_dir():
        raise CliError(f"{dst}: is a directory; a single safetensors output is a file "
                       f"(or pass --max-shard-size for shards in a directory)")
    src = open_source(src_path, src_format)
    if overwrite and dst.exists() and dst.resolve() == Path(src_path).resolve():
        raise CliError(f"{dst}: is the input; convert into another path")
    if only or strip_prefix:
        src = _Selected(src, list(only or []), strip_prefix)
    if fmt == "safetensors":
        what = to_safetensors(src, dst, max_shard, show_progress)
    elif fmt == "torch":
        what = to_torch(src, dst, show_progress)
    else:
        what = to_dcp(src, dst, show_progress)
    if overwrite and dst.is_dir():
        removed = _remove_stale(dst, fmt)
        if removed:
            warn(f"--overwrite: removed {len(removed)} file(s) of an earlier export from "
                 f"{dst}: {', '.join(removed)}")
    print(f"{src.kind} {src_path}: {what}", file=out)
    return 0


def add_parser(sub, **common) -> None:
    p = sub.add_parser("convert", help=HELP, description=HELP + ".", **common)
    p.add_argument("src", help="a DCP directory, a torch.save file, a .safetensors file, "
                               "or a directory / index.json of safetensors shards")
    p.add_argument("dst")
    p.add_argument("--to", choices=["dcp", "torch", "safetensors"],
                   help="output format (default: from DST: *.safetensors or "
                        "--max-shard-size: safetensors; *.pt, *.pth, *.bin, *.ckpt: "
                        "torch; otherwise a DCP directory)")
    p.add_argument("--from", dest="src_format", choices=["dcp", "torch", "safetensors"],
                   help="input format (default: detected)")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="safetensors shards of at most SIZE (e.g. 5GB) each in directory DST, "
                        "with model.safetensors.index.json (a tensor larger than SIZE gets "
                        "a shard of its own)")
    p.add_argument("--only", action="append", metavar="PREFIX",
                   help="convert only the keys that start with PREFIX (repeatable)")
    p.add_argument("--strip-prefix", metavar="PREFIX",
                   help="remove PREFIX from the start of the keys that have it")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.set_defaults(run=run)


def run(args) -> int:
    return convert(args.src, args.dst, to=args.to, src_format=args.src_format,
                   max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                   only=args.only, strip_prefix=args.strip_prefix, show_progress=True)
