#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of dcpx's parsers of untrusted bytes that
Python code reaches:

* ``dcpx.formats.metadata.loads(data, path)`` -> a ``Metadata``, or
  ``CorruptCheckpointError`` (``UnsafeCheckpointError`` is a subclass).
  Findings: any other exception type; a global resolved that is not the
  allow-listed object for its (module, name); a returned object graph holding
  an object of a type outside the allow-list (i.e. built by something the
  allow-list does not name); a crash, hang or memory blow-up.
* ``dcpx._C.parse_archive(data)`` -> a dict of the documented keys, or
  ``ValueError``.  Any other outcome is a finding.
* ``dcpx._C.check_pickle(data)`` (csrc/picklescan.c, the opcode scan loads
  runs first) -> None, or ``ValueError``; and when it accepts, every memo
  index and every length that ``pickletools.genops`` decodes lies within
  the data, as the scan promises.

Every input goes through all three.  Coverage feedback comes from dcpx.formats.metadata
and from an instrumented copy of the pure-Python pickle Unpickler that is
run on the same bytes with the same allow-list (its outcome is not judged:
it only guides the mutator through the pickle opcodes, which the C
unpickler that ``loads`` uses cannot report).  The C code is covered by
the libFuzzer targets (fuzz_zipread.c, fuzz_reader.c, fuzz_picklescan.c).

    PYTHONPATH=. .venv/bin/python fuzz/fuzz_metadata.py \\
        fuzz/work/py fuzz/corpus/fuzz_metadata fuzz/seeds/metadata fuzz/seeds/archive \\
        -max_total_time=180 -max_len=65536 -rss_limit_mb=4096 -timeout=20

(``pip install atheris``; it ships manylinux wheels for CPython.)
Pass ``--replay FILE...`` to run files through the checks without atheris.
Pass ``--many-chunks`` (then atheris' arguments) to fuzz the many-chunks
shape instead (fuzz/many_chunks.py: the bytes pick a layout of up to 2**17
chunks of one key; a finding when decoding and checking it takes longer
than a bound per chunk, or the C index accepts what ``loads`` refuses).

Memory: an input during which the process's peak RSS grows by more than
FUZZ_RSS_GROWTH_MB (default 512) is a finding.  As a safety net the address
space is capped (RLIMIT_AS: its size at start + FUZZ_AS_HEADROOM_MB, default
8192), so that a larger blow-up fails with MemoryError instead of taking the
machine down.  A MemoryError as such is not a finding: the C unpickler asks
for the length a BINBYTES8 / BYTEARRAY8 opcode names before reading, which
fails at once, untouched, and loads turns it into CorruptCheckpointError.
(Runs before commit 8db44ab skipped the two problems they had found, the
memo blow-up and a Metadata built without its fields; both are fixed, and
nothing is skipped now.)
"""
from __future__ import annotations

import collections
import enum
import os
import pickletools
import resource
import importlib.util
import io
import pathlib
import sys
import types
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402,F401  (imported before atheris, uninstrumented: far too big)
from torch.distributed.checkpoint import metadata as _md  # noqa: E402

from dcpx import _C  # noqa: E402
from dcpx.formats import metadata as _metadata
from dcpx.errors import CorruptCheckpointError  # noqa: E402

ALLOWED = _metadata._allowed()
ALLOWED_IDS = {id(v) for v in ALLOWED.values()}

# Types an unpickled Metadata may hold: the allow-listed classes, the types
# of the allow-listed instances (dtypes, layouts, memory formats), and what
# pickle builds from opcodes alone.
OK_TYPES = {v for v in ALLOWED.values() if isinstance(v, type)}
OK_TYPES |= {type(v) for v in ALLOWED.values() if not isinstance(v, (type, types.FunctionType))}
OK_TYPES |= {type(None), bool, int, float, complex, str, bytes, bytearray,
             tuple, list, dict, set, frozenset, slice, collections.OrderedDict,
             pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath}

ARCHIVE_KEYS = {"storage_type": str, "numel": int, "numel_in_bytes": int,
                "storage_offset": int, "shape": tuple, "stride": tuple,
                "data_offset": int, "data_length": int, "crc": int,
                "crc_ok": bool}


class Finding(BaseException):
    """Raised (uncaught) so that atheris records the input.  A BaseException,
    so that loads' ``except Exception`` does not turn one raised inside the
    unpickler (find_class) into CorruptCheckpointError."""




def cap_address_space() -> None:
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    extra = int(os.environ.get("FUZZ_AS_HEADROOM_MB", "8192")) << 20
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, resource.RLIM_INFINITY))


def check_graph(obj, depth=0, seen=None):
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 200:
        return
    seen.add(id(obj))
    if id(obj) in ALLOWED_IDS:  # an allow-listed class/function/dtype itself
        return
    t = type(obj)
    if t not in OK_TYPES and not isinstance(obj, enum.Enum):
        raise Finding(f"unpickled object of type {t!r} outside the allow-list")
    if isinstance(obj, dict):
        for k, v in obj.items():
            check_graph(k, depth + 1, seen)
            check_graph(v, depth + 1, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            check_graph(v, depth + 1, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            check_graph(v, depth + 1, seen)


_orig_find_class = _metadata.SafeUnpickler.find_class


def _checked_find_class(self, module, name):
    obj = _orig_find_class(self, module, name)  # raises Unsafe... if refused
    if (module, name) not in ALLOWED or ALLOWED[(module, name)] is not obj:
        raise Finding(f"find_class resolved {module}.{name} -> {obj!r} "
                      f"outside the allow-list")
    return obj


_metadata.SafeUnpickler.find_class = _checked_find_class


def check_metadata(data: bytes) -> None:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        md = _metadata.loads(data, "fuzz/.metadata")
    except CorruptCheckpointError:  # includes UnsafeCheckpointError
        md = None
    except Finding:
        raise
    except BaseException as e:  # noqa: BLE001  (KeyboardInterrupt aside)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise Finding(f"loads raised {type(e).__name__}: {e!r}") from e
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0  # KiB
    if grew > int(os.environ.get("FUZZ_RSS_GROWTH_MB", "512")) << 10:
        raise Finding(f"loads of {len(data)} bytes grew the peak RSS by {grew >> 10} MiB")
    if md is None:
        return
    if not isinstance(md, _md.Metadata):
        raise Finding(f"loads returned {type(md)!r}")
    check_graph(md)


def check_pickle_scan(data: bytes) -> None:
    try:
        ok = _C.check_pickle(data)
    except ValueError:
        return
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt):
            raise
        raise Finding(f"check_pickle raised {type(e).__name__}: {e!r}") from e
    if ok is not None:
        raise Finding(f"check_pickle returned {ok!r}")
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET",
                           "LONG_BINGET") and isinstance(arg, int) and arg > len(data):
                raise Finding(f"check_pickle accepted memo index {arg} > {len(data)}")
    except Finding:
        raise
    except Exception as e:  # noqa: BLE001
        if any(w in str(e) for w in ("remain", "not enough data", "no newline")):
            raise Finding(f"check_pickle accepted a truncated opcode: {e}") from e


def check_archive(data: bytes) -> None:
    try:
        out = _C.parse_archive(data)
    except ValueError:
        return
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt):
            raise
        raise Finding(f"parse_archive raised {type(e).__name__}: {e!r}") from e
    if not isinstance(out, dict) or set(out) != set(ARCHIVE_KEYS):
        raise Finding(f"parse_archive returned {out!r}")
    for k, t in ARCHIVE_KEYS.items():
        if not isinstance(out[k], t):
            raise Finding(f"parse_archive: {k} is {out[k]!r}")
    if len(out["shape"]) != len(out["stride"]) or len(out["shape"]) > 16:
        raise Finding(f"parse_archive: rank {out!r}")
    if out["data_offset"] + out["data_length"] > len(data):
        raise Finding(f"parse_archive: data outside the buffer {out!r}")


def _coverage_unpickler():
    """An instrumented private copy of the pure-Python pickle module."""
    import atheris

    origin = importlib.util.find_spec("pickle").origin
    spec = importlib.util.spec_from_file_location("_fuzz_pickle", origin)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # patch the copy's code objects in place (its dispatch table holds the
    # same function objects); the real pickle module is left alone
    for f in list(vars(mod._Unpickler).values()) + list(vars(mod).values()):
        if isinstance(f, types.FunctionType) and f.__module__ == "_fuzz_pickle":
            atheris.instrument_func(f)

    # its BYTEARRAY8 zero-fills bytearray(n) for whatever n the input names
    # (the C unpickler's allocation stays untouched): cap it, or a 9-byte
    # input costs gigabytes of RSS in this helper alone
    def small_bytearray(*args):
        if args and isinstance(args[0], int) and args[0] > 1 << 24:
            raise mod.UnpicklingError("bytearray too large for the fuzzer")
        return bytearray(*args)

    mod.bytearray = small_bytearray

    class Py(mod._Unpickler):
        def find_class(self, module, name):
            obj = ALLOWED.get((module, name))
            if obj is None:
                raise mod.UnpicklingError("refused")
            return obj

        def persistent_load(self, pid):
            raise mod.UnpicklingError("refused")
    return Py


def check_many_chunks(data: bytes) -> None:
    """The many-chunks shape (fuzz/many_chunks.py), with its time bound."""
    import many_chunks
    raw, n = many_chunks.build(data)
    try:
        many_chunks.check(raw, n)
    except (AssertionError, many_chunks.TooSlow) as e:
        raise Finding(f"many chunks ({len(raw)} bytes): {e}") from e


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if len(sys.argv) > 1 and sys.argv[1] == "--many-chunks":
        # fuzz/fuzz_metadata.py --many-chunks WORKDIR [atheris flags]:
        # the fuzzer's bytes pick the shape (many_chunks.build)
        import atheris
        del sys.argv[1]
        atheris.Setup(sys.argv, check_many_chunks)
        atheris.Fuzz()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--replay":
        for f in sys.argv[2:]:
            data = pathlib.Path(f).read_bytes()
            check_metadata(data)
            check_archive(data)
            check_pickle_scan(data)
            print("ok", f)
        return
    import atheris

    cap_address_space()
    py_unpickler = _coverage_unpickler()
    atheris.instrument_func(_metadata.loads)
    atheris.instrument_func(_orig_find_class)

    def one(data: bytes) -> None:
        check_metadata(data)
        check_archive(data)
        check_pickle_scan(data)
        try:  # coverage only
            py_unpickler(io.BytesIO(data)).load()
        except Exception:  # noqa: BLE001
            pass

    atheris.Setup(sys.argv, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
