"""What every command shares: one way to open a checkpoint in any format the
CLI knows (a DCP directory, a ``torch.save`` file, a safetensors file or a
sharded safetensors directory) and read it one key at a time, progress
bars, sizes for people.

Reading is streaming by construction: ``entries()`` comes from metadata
alone (the DCP ``.metadata``, the safetensors header, a ``torch.save``
archive opened with ``mmap=True``), and ``read(key)`` materialises one value:
for DCP, one tensor assembled from its saved chunks (DTensor / FSDP shards of
one key consolidated into one tensor), read by dcpx's C reader with every
CRC checked.
"""
from __future__ import annotations

import ctypes
import io
import json
import mmap
import os
import pickle
import stat
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Optional

if TYPE_CHECKING:
    import torch

# torch and dcpx's reader are imported where they are used, so that ``dcpx
# --help`` (which imports every command's parser) does not import torch.

METADATA_FN = ".metadata"    # dcpx.filesystem.METADATA_FN (which imports torch)
SAFETENSORS_INDEX = "model.safetensors.index.json"


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def need_safetensors():
    """The ``safetensors`` package, or a clear error (dcpx itself does not
    depend on it; only the CLI's safetensors conversions do)."""
    try:
        import safetensors  # noqa: F401
        import safetensors.torch
    except ImportError:
        raise CliError("this needs the 'safetensors' package, which is not installed "
                       "(pip install safetensors)") from None
    return safetensors


class CliError(Exception):
    """An error the CLI reports as one line (exit status 1)."""


class NoCheckpoint(CliError):
    """Nothing to work on at the path given (exit status 2)."""


class _NoBar:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def progress(total: Optional[float], desc: str, *, unit: str = "B", enabled: bool = True):
    """A tqdm bar on stderr, or an object that does nothing: when disabled,
    when stderr is not a terminal (scripts, CI, logs), or when tqdm is not
    installed (a progress bar is never a reason to fail)."""
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    scale = unit == "B"
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=scale,
                unit_divisor=1024 if scale else 1000, file=sys.stderr,
                dynamic_ncols=True, leave=False)


class Entry(NamedTuple):
    key: str                          # flattened FQN
    dtype: Optional[torch.dtype]      # None: a non-tensor value
    shape: Optional[tuple]
    nbytes: int                       # tensor bytes; for a value, its stored size if known
    chunks: int = 1                   # saved pieces (DCP chunks) of this key

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


def flatten(obj: Any) -> Iterator[tuple[tuple, Any]]:
    """(path, leaf) of a loaded state dict, flattened exactly as DCP
    flattens it on save (dcpx's ``flatten_state_dict``, torch's rules:
    nested mappings, and lists that hold tensors or mappings, become keys
    ``a.b.0.c``; tuples, empty containers and other lists stay values), so
    a ``torch.save`` file and a DCP checkpoint of one state dict have the
    same keys.  Anything but a mapping at the top is the one value at the
    path ()."""
    if not isinstance(obj, Mapping):
        yield (), obj
        return
    from ..filesystem import flatten_state_dict
    flat, paths = flatten_state_dict(obj)
    for key, leaf in flat.items():
        yield tuple(paths.get(key, (key,))), leaf


def fqn(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def release_pages(t: torch.Tensor, path: Path) -> bool:
    """Unmap from this process the resident pages of ``t`` when ``t`` is a
    view of a memory mapping of the file ``path`` (``torch.load(mmap=True)``
    and ``safetensors.safe_open`` return such views): madvise(MADV_DONTNEED)
    on the whole pages inside the tensor.  Those pages are never written, so
    a later access reads them from the file again (tied weights stay
    right); without this, every page read stays in the process (in its
    RSS) until the file is closed.  Checked against /proc/self/maps: memory
    that is not a mapping of ``path`` is never touched.  Linux only."""
    n = t.numel() * t.element_size()
    if not sys.platform.startswith("linux") or n < mmap.PAGESIZE:
        return False
    page = mmap.PAGESIZE
    start = t.data_ptr()
    a, b = -(-start // page) * page, (start + n) // page * page
    if b <= a:
        return False
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except OSError:
        return False
    for line in maps:
        parts = line.split(None, 5)
        if len(parts) < 6 or parts[5] != real:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= a and b <= hi:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            return libc.madvise(a, b - a, 4) == 0      # MADV_DONTNEED
    return False


class Source:
    """A checkpoint opened for reading, key by key."""
    kind = "?"
    path: Path

    def entries(self) -> dict[str, Entry]:
        raise NotImplementedError

    def read(self, key: str) -> Any:
        raise NotImplementedError

    def paths(self) -> dict[str, tuple]:
        """key -> the nested path it came from (for DCP's planner_data)."""
        return {k: (k,) for k in self.entries()}

    def release(self, key: str, value: Any) -> None:
        """Done with ``value`` (read by ``read(key)``): give back its memory."""


class DcpSource(Source):
    kind = "dcp"

    def __init__(self, path: Path):
        from ..filesystem import FileSystemReader
        self.path = Path(path)
        self.reader = FileSystemReader(self.path)
        self.md = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.md, True)
        self._entries: Optional[dict[str, Entry]] = None

    def entries(self) -> dict[str, Entry]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
        if self._entries is None:
            out = {}
            for key, v in self.md.state_dict_metadata.items():
                if isinstance(v, TensorStorageMetadata):
                    dtype = v.properties.dtype
                    out[key] = Entry(key, dtype, tuple(v.size),
                                     v.size.numel() * dtype.itemsize, len(v.chunks))
                else:
                    info = self.md.storage_data.get(MetadataIndex(key))
                    out[key] = Entry(key, None, None, info.length if info else 0)
            self._entries = out
        return self._entries

    def paths(self) -> dict[str, tuple]:
        pd = self.md.planner_data if isinstance(self.md.planner_data, dict) else {}
        return {k: tuple(pd[k]) if isinstance(pd.get(k), (tuple, list)) else (k,)
                for k in self.entries()}

    def read(self, key: str) -> Any:
        return self.reader.read_key(key)


class TorchSource(Source):
    """A ``torch.save`` file, loaded with ``weights_only=True`` and
    ``mmap=True``: tensors stay in the file's pages (clean, evictable page
    cache) until read; nested dicts are flattened to FQNs."""
    kind = "torch"

    def __init__(self, path: Path):
        import torch

        from ..filesystem import archive_byteorder, swap_untyped, tensors_within
        self.path = Path(path)
        self.mapped = True
        if zipfile.is_zipfile(self.path):
            check_torch_records(self.path)
        try:
            obj = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e) and "zip" not in str(e):
                raise CliError(f"{self.path}: cannot load: {e}") from e
            # a legacy (pre-zip) file cannot be mapped: load it whole
            obj = torch.load(self.path, map_location="cpu", weights_only=True)
            self.mapped = False
        except Exception as e:
            raise CliError(f"{self.path}: cannot load with weights_only=True: {e}") from e
        # A file written on a big-endian host: torch.load swapped its typed
        # storages in place in the mapping's private (copy-on-write) pages,
        # which release_pages would discard (a tied tensor read later would
        # see the file's unswapped bytes again); and it left the untyped
        # ones (uint16, float8...) unswapped (dcpx/formats/byteorder.py).
        order = archive_byteorder(self.path) if zipfile.is_zipfile(self.path) else sys.byteorder
        self.swapped = order != sys.byteorder
        swap_untyped(tensors_within(obj), order)
        self._values: dict[str, Any] = {}
        self._paths: dict[str, tuple] = {}
        # A state dict is flattened as DCP (torch >= 2.4) flattens it, so
        # that a DCP output loads with dcpx.load / torch's load into the
        # same nested state dict (lists of dicts, e.g. an optimizer's
        # param_groups, down to their leaves; not as one value, which only
        # torch's 2.3 fallback would find).
        check_walk(obj, self.path)
        try:
            flat = list(flatten(obj))
        except ValueError as e:      # torch's "duplicated flatten key a.b"
            raise CliError(f"{self.path}: two entries flatten to the same key ({e})") from e
        for p, leaf in flat:
            key = fqn(p)
            if key in self._values:
                raise CliError(f"{self.path}: two entries flatten to the key {key!r}")
            self._values[key] = leaf
            self._paths[key] = p

    def entries(self) -> dict[str, Entry]:
        import torch
        out = {}
        for k, v in self._values.items():
            if isinstance(v, torch.Tensor):
                out[k] = Entry(k, v.dtype, tuple(v.shape), v.numel() * v.element_size())
            else:
                out[k] = Entry(k, None, None, 0)
        return out

    def paths(self) -> dict[str, tuple]:
        return dict(self._paths)

    def read(self, key: str) -> Any:
        return self._values[key]

    def release(self, key: str, value: Any) -> None:
        import torch
        if self.mapped and not self.swapped and isinstance(value, torch.Tensor):
            release_pages(value, self.path)


#: entries a state dict may hold per byte of its pickle (plus WALK_MIN),
#: counting each visit of a container reached several times
WALK_PER_BYTE = 16
WALK_MIN = 1_000_000


def check_walk(obj: Any, path: Path) -> None:
    """Refuse a loaded ``torch.save`` state dict whose walk (what
    flattening it visits: mappings and lists, every visit of a shared one
    counted) exceeds ``WALK_PER_BYTE`` entries per byte of its pickle
    (``WALK_MIN`` at least).  A pickle builds each object once, so a
    state dict without shared containers has fewer entries than its pickle
    has bytes; one that nests shared containers (a dict of two references
    to a dict of two references ..., 40 levels in 2 KB) would flatten into
    2**40 keys (flattening hung)."""
    budget = WALK_MIN + WALK_PER_BYTE * _pickle_bytes(path)
    stack, n = [obj], 0
    while stack:
        o = stack.pop()
        n += 1
        if n > budget:
            raise CliError(f"{path}: its state dict reaches more than {budget} entries (its "
                           f"pickle is {_pickle_bytes(path)} bytes): containers shared many "
                           f"times over, which no DCP key list can be made of (a crafted "
                           f"file): refused")
        if isinstance(o, Mapping):
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


def _pickle_bytes(path: Path) -> int:
    """The size of a ``torch.save`` file's ``data.pkl`` (the file's for a
    legacy, non-zip one)."""
    try:
        with zipfile.ZipFile(path) as z:
            return max((i.file_size for i in z.infolist() if i.filename.endswith("data.pkl")),
                       default=0)
    except (zipfile.BadZipFile, OSError, ValueError):
        return os.path.getsize(path)


class _Stand:
    """What a GLOBAL of ``data.pkl`` stands for in ``_storage_claims``: a
    type (so that NEWOBJ's ``cls.__new__(cls, ...)`` works too), one
    subclass per global named (``module`` / ``name`` say which).  Its
    instances take whatever a pickle does to the objects it builds (any
    arguments, ``__setstate__``, ``__setitem__``, ``append``, ``extend``,
    ``add``, a call), so that the walk always reaches every storage the
    pickle names (an ``OrderedDict``, as ``state_dict()`` returns, is built
    with ``__setitem__`` and ``__setstate__``).  Nothing is imported or
    called."""
    module = ""
    name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Stand":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Stand":
        return _Stand()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def add(self, value: Any) -> None:
        pass


class _ClaimsUnpickler(pickle.Unpickler):
    def __init__(self, f: Any) -> None:
        super().__init__(f)
        self.claims: dict[str, tuple[str, int]] = {}   # key -> (storage type, numel)
        self._types: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        t = self._types.get((module, name))
        if t is None:
            t = type("_Stand", (_Stand,), {"module": module, "name": name, "__slots__": ()})
            self._types[(module, name)] = t
        return t

    def persistent_load(self, pid: Any) -> Any:
        if (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] in ("storage", b"storage")
                and isinstance(pid[1], type) and issubclass(pid[1], _Stand)):
            key = pid[2].decode() if isinstance(pid[2], bytes) else str(pid[2])
            numel = pid[4] if isinstance(pid[4], int) else -1
            prev = self.claims.get(key)
            if prev is None or prev[1] < numel:
                self.claims[key] = (pid[1].name, numel)
        return _Stand()


def _storage_itemsize(name: str) -> Optional[int]:
    import torch
    if name == "UntypedStorage":
        return 1
    for dtype, sname in torch.storage._dtype_to_storage_type_map().items():
        if sname == name:
            return dtype.itemsize
    return None


def check_torch_records(path: Path) -> None:
    """Every storage the ``data.pkl`` of the ``torch.save`` archive ``path``
    names fits in its ``data/<key>`` record.  ``torch.load(mmap=True)``
    takes each storage's bytes from the mapped file at its record's offset
    without checking its size: a record shorter than its pickle claims
    would hand out the next record's bytes (or the zip directory).  The
    pickle is read with every global replaced by an inert stand-in (nothing
    imported or run)."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if len(pkl) != 1:
                return  # not torch's layout: torch.load says what is wrong
            prefix = pkl[0].filename[:-len("data.pkl")]
            sizes = {i.filename[len(prefix):]: i.file_size for i in infos
                     if i.filename.startswith(prefix)}
            u = _ClaimsUnpickler(io.BytesIO(z.read(pkl[0])))
            try:
                u.load()
            except Exception:
                return  # torch.load reports a pickle it cannot read
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return
    for key, (stype, numel) in u.claims.items():
        itemsize = _storage_itemsize(stype)
        if itemsize is None or numel < 0:
            continue
        need = numel * itemsize
        have = sizes.get(f"data/{key}")
        if have is None:
            raise CliError(f"{path}: its pickle names the storage data/{key}, which the "
                           f"archive does not hold (damaged or crafted file)")
        if need > have:
            raise CliError(f"{path}: storage data/{key} is {have} bytes, its pickle says "
                           f"{need} ({numel} x {stype}): refused (a truncated or crafted "
                           f"record; torch.load(mmap=True) would read past it)")


class SafetensorsSource(Source):
    """One safetensors file, or the shards named by a Hugging Face
    ``model.safetensors.index.json``; read with ``safetensors.safe_open``
    one tensor at a time."""
    kind = "safetensors"

    def __init__(self, path: Path):
        need_safetensors()
        from safetensors import safe_open
        self.path = Path(path)
        index: Optional[Path] = None
        if self.path.is_dir():
            index = self.path / SAFETENSORS_INDEX
            if index.exists():
                files = self._shards(index)
            else:
                files = sorted(self.path.glob("*.safetensors"))
                if not files:
                    raise NoCheckpoint(f"{self.path}: no {SAFETENSORS_INDEX} and no "
                                       f"*.safetensors file in it")
                index = None
        elif self.path.name.endswith(".index.json"):
            index = self.path
            files = self._shards(index)
        else:
            files = [self.path]
        self._handles = {}
        self._where: dict[str, Any] = {}
        self._file: dict[str, Path] = {}
        self.metadata: dict[str, str] = {}
        for f in files:
            regular_file(f, "safetensors shard ")
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:
                raise CliError(f"{f}: not a readable safetensors file: {e}") from e
            self._handles[f] = h
            self.metadata.update(h.metadata() or {})
            for k in h.keys():
                if k in self._where:
                    raise CliError(f"{f}: key {k!r} is also in another shard")
                self._where[k] = h
                self._file[k] = f
        if index is not None:
            # every key the index names is in a shard: a shard that lacks
            # one would make an output without it
            for key, name in self._weight_map.items():
                if key not in self._where:
                    raise CliError(f"{index}: names the key {key!r} in the shard {name}, "
                                   f"which does not hold it (nor does any other shard the "
                                   f"index names): damaged or mismatched folder")

    def _shards(self, index: Path) -> list[Path]:
        regular_file(index, "safetensors index ")
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except Exception as e:
            raise CliError(f"{index}: not a safetensors index (no weight_map): {e}") from e
        if not isinstance(weight_map, dict):
            raise CliError(f"{index}: its weight_map is a {type(weight_map).__name__}, not "
                           f"an object of tensor name -> shard file")
        for key, name in weight_map.items():
            if not isinstance(name, str):
                raise CliError(f"{index}: weight_map[{key!r}] is a {type(name).__name__} "
                               f"({str(name)[:80]}), not the name of a shard file")
        self._weight_map = weight_map
        files = []
        for name in dict.fromkeys(weight_map.values()):
            files.append(shard_path(index, name))
        return files

    def entries(self) -> dict[str, Entry]:
        out = {}
        for k, h in self._where.items():
            sl = h.get_slice(k)
            dtype = _safetensors_dtype(sl.get_dtype(), k)
            shape = tuple(sl.get_shape())
            n = 1
            for s in shape:
                n *= s
            out[k] = Entry(k, dtype, shape, n * dtype.itemsize)
        return dict(sorted(out.items()))

    def read(self, key: str) -> Any:
        return self._where[key].get_tensor(key)

    def release(self, key: str, value: Any) -> None:
        release_pages(value, self._file[key])


def shard_path(index: Path, name: str) -> Path:
    """The shard ``name`` that the index file ``index`` names: a path
    relative to the index's folder and inside it (no absolute path, no
    '..'), naming an existing file.  Links are followed, as Hugging Face's
    cache folders are links into its blob store."""
    p = Path(name)
    if (not name or "\0" in name or p.is_absolute() or ".." in p.parts
            or p.drive or "\\" in name):
        raise CliError(f"{index}: names the shard {name!r}, outside its folder (refused)")
    f = index.parent / p
    if not f.exists():
        raise CliError(f"{index}: names the shard {name}, which does not exist")
    return f


def regular_file(path: Path, what: str = "") -> None:
    """Refuse ``path`` (links followed) unless it is a regular file: a FIFO
    would block the read for ever, a device would read without end."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise CliError(f"{path}: cannot read {what.strip() or 'it'}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise CliError(f"{path}: {what}is {_KIND.get(stat.S_IFMT(mode), 'not a regular file')}, "
                       f"not a regular file (refused)")


_KIND = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory"}


def _safetensors_dtype(name: str, key: str) -> torch.dtype:
    from safetensors.torch import _TYPES
    if name not in _TYPES:
        raise CliError(f"key {key!r}: safetensors dtype {name} has no torch dtype here")
    return _TYPES[name]


def detect(path: Path) -> str:
    """'dcp', 'safetensors' or 'torch' for an existing input path."""
    from ..errors import IncompleteCheckpointError
    if path.is_dir():
        if (path / METADATA_FN).exists():
            return "dcp"
        if (path / SAFETENSORS_INDEX).exists() or any(path.glob("*.safetensors")):
            return "safetensors"
        raise IncompleteCheckpointError(
            f"{path}: no {METADATA_FN} (not a committed DCP checkpoint) and no safetensors files")
    if path.name.endswith((".safetensors", ".index.json")):
        return "safetensors"
    if path.exists():
        regular_file(path)
        with open(path, "rb") as f:
            head = f.read(9)
        if len(head) >= 9 and head[8:9] == b"{":
            return "safetensors"     # 8-byte header length, then JSON
        return "torch"
    raise NoCheckpoint(f"{path}: no such file or directory")


def open_source(path: str, fmt: Optional[str] = None) -> Source:
    p = Path(path)
    if not p.exists():
        raise NoCheckpoint(f"{p}: no such file or directory")
    fmt = fmt or detect(p)
    if fmt == "dcp":
        return DcpSource(p)
    if fmt == "safetensors":
        return SafetensorsSource(p)
    return TorchSource(p)


def warn(msg: str) -> None:
    print(f"dcpx: warning: {msg}", file=sys.stderr)

