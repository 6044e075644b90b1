"""Replay the fuzzing corpus (fuzz/corpus/: minimised seeds and every input a
fuzzer found a problem with) through the parsers of untrusted bytes that
Python reaches, and keep a short random-mutation search running in CI.

Contracts (see fuzz/README.md):
  dcpx._C.parse_archive(bytes)   -> dict, or ValueError
  dcpx._C.check_pickle(bytes)    -> None, or ValueError
  dcpx.formats.metadata.loads(bytes, p) -> Metadata, or CorruptCheckpointError
                                    (UnsafeCheckpointError is a subclass)

libFuzzer inputs start with a mode byte (fuzz_zipread) or a 9-byte header
(fuzz_reader), so each file is also replayed without its first 1 and 9
bytes.

Inputs of open bugs are listed in OPEN_BUGS: they run in a subprocess (one
may take the interpreter down) and are marked xfail(strict=True), so that
the test XPASSes, which fails, once the bug is fixed and the entry is to be
removed.  Findings a file replay does not show in the plain build (they need
a memoryview, a save/load, or a memory measurement) have their own tests
below (in subprocesses where a regression could crash).
"""
from __future__ import annotations

import os
import pathlib
import struct
import subprocess
import sys
import textwrap
import tracemalloc
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import Metadata

import dcpx
from dcpx import _C
from dcpx.formats import metadata as _metadata
from dcpx.errors import CorruptCheckpointError

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
FILES = sorted(p for p in CORPUS.rglob("*") if p.is_file() and p.name != "README.md")

# Open bugs: none at the moment (fuzz/README.md has the history).

#: corpus file -> reason, for inputs that break a contract in this build
#: (all fixed so far: zip64-locator-wrap-*, check-record-stride-overflow-reader,
#: metadata-*no-state*, metadata-memo-put-huge-index in 8db44ab, and
#: roundtrip-empty-stride-overflow in 553e9e6)
OPEN_BUGS: dict[str, str] = {}


# --------------------------------------------------------------------------
# the checks

def check_archive(data) -> None:
    try:
        out = _C.parse_archive(data)
    except ValueError:
        return
    assert isinstance(out, dict), out
    assert len(out["shape"]) == len(out["stride"]) <= 16, out
    assert 0 <= out["data_offset"] <= out["data_offset"] + out["data_length"] <= len(data), out


def check_metadata(data: bytes) -> None:
    try:
        md = _metadata.loads(data, "fuzz/.metadata")
    except CorruptCheckpointError:  # UnsafeCheckpointError is a subclass
        return
    assert isinstance(md, Metadata), type(md)


def variants(data: bytes):
    yield data
    if len(data) > 1:
        yield data[1:]
    if len(data) > 9:
        yield data[9:]


def check_pickle_scan(data: bytes) -> None:
    try:
        assert _C.check_pickle(data) is None
    except ValueError:
        pass


def replay(data: bytes) -> None:
    for v in variants(data):
        check_archive(v)
        check_metadata(v)
        check_pickle_scan(v)


# --------------------------------------------------------------------------
# the committed corpus

def test_corpus_is_present_and_small():
    assert len(FILES) > 20, "fuzz/corpus/ is (nearly) empty"
    total = sum(p.stat().st_size for p in FILES)
    assert total < 2 << 20, f"fuzz/corpus/ holds {total} bytes; minimise it (fuzz/run.sh merge)"
    assert set(OPEN_BUGS) <= {p.relative_to(CORPUS).as_posix() for p in FILES}


def _params():
    for p in FILES:
        rel = p.relative_to(CORPUS).as_posix()
        marks = []
        if rel in OPEN_BUGS:
            marks.append(pytest.mark.xfail(strict=True, reason=OPEN_BUGS[rel]))
        yield pytest.param(p, id=rel, marks=marks)


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    prelude = ("import sys, warnings; warnings.filterwarnings('ignore'); "
               f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *args],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("path", list(_params()))
def test_replay_corpus_file(path):
    rel = path.relative_to(CORPUS).as_posix()
    if rel not in OPEN_BUGS:
        replay(path.read_bytes())
        return
    r = run_child("""
        import pathlib, test_fuzz_regressions as t
        t.replay(pathlib.Path(sys.argv[1]).read_bytes())
        print("REPLAY-OK")
    """, str(path))
    assert r.returncode == 0 and "REPLAY-OK" in r.stdout, (
        f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


# --------------------------------------------------------------------------
# findings that a file replay alone does not show in the plain build

def test_zip64_locator_wrap_parse_archive_stays_in_its_buffer():
    """zip64-locator-wrap (fixed in 8db44ab): the zip64 end record used to
    be read from up to 56 bytes before the buffer; with a memoryview those
    are the caller's bytes, and a record planted there sent
    dcpx_zip_scan_cd to read at buffer + 2**40 (SIGSEGV).  In a subprocess,
    in case it comes back."""
    r = run_child("""
        import struct
        from dcpx import _C
        planted = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, 1, 1,
                              1 << 20, 1 << 40)   # entries, CD size, CD offset
        for j in range(56):  # z64 = 2**64 - 56 + j
            archive = (struct.pack("<IIQI", 0x07064B50, 0, (1 << 64) - 56 + j, 1)
                       + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, 0, 0, 0))
            buf = bytearray(planted[:56 - j] + b"x" * j + archive)
            try:
                _C.parse_archive(memoryview(buf)[56:])
            except ValueError:
                pass
        print("REPLAY-OK")
    """)
    assert r.returncode == 0 and "REPLAY-OK" in r.stdout, f"rc={r.returncode}\n{r.stderr[-3000:]}"


def _save_load_child(shape_expr: str) -> subprocess.CompletedProcess:
    return run_child(f"""
        import tempfile, torch, dcpx
        shape = {shape_expr}
        with tempfile.TemporaryDirectory() as d:
            dcpx.save({{"t": torch.empty(shape)}}, checkpoint_id=d)
            out = {{"t": torch.empty(shape)}}
            dcpx.load(out, checkpoint_id=d)
        assert out["t"].shape == shape
        print("REPLAY-OK")
    """)


def test_check_record_stride_product_overflow():
    """check-record-stride-overflow (fixed in 8db44ab): check_record's int64
    product overflowed (UB) for (2**63 - 1, 2, 0), a shape torch creates.
    Only clang's UBSan in fuzz/ saw it (the plain build wraps, and gcc -O1
    drops the dead last multiplication with its check), so this guards the
    behaviour: the tensor saves and loads.  In a subprocess, in case a
    regression crashes."""
    r = _save_load_child("(2**63 - 1, 2, 0)")
    assert r.returncode == 0 and "REPLAY-OK" in r.stdout, f"rc={r.returncode}\n{r.stderr[-3000:]}"


def test_empty_tensor_with_huge_sizes_round_trips():
    """Found by fuzz_reader's round-trip mode (corpus/crashes/
    roundtrip-empty-stride-overflow): torch creates this tensor, dcpx saves
    it, and must load it back."""
    r = _save_load_child("(2**40, 0, 2**40)")
    assert r.returncode == 0 and "REPLAY-OK" in r.stdout, f"rc={r.returncode}\n{r.stderr[-3000:]}"


def test_metadata_memo_index_does_not_allocate():
    """metadata-memo-put-huge-index (fixed in 8db44ab by the opcode scan):
    9 bytes of .metadata made the C unpickler allocate and zero 256 MiB.
    tracemalloc sees the unpickler's PyMem allocations exactly (a peak-RSS
    measurement is not reliable here)."""
    data = (CORPUS / "crashes" / "metadata-memo-put-huge-index").read_bytes()
    tracemalloc.start()
    try:
        check_metadata(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{len(data)} bytes of .metadata took {peak >> 20} MiB to parse"


# --------------------------------------------------------------------------
# a bounded random-mutation search over real bytes

@pytest.fixture(scope="module")
def real_bytes(tmp_path_factory):
    """(archives, .metadata files) of a small dcpx and a small torch
    checkpoint."""
    import torch.distributed.checkpoint as tdcp

    root = tmp_path_factory.mktemp("fuzzseed")
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
          "b": torch.arange(5, dtype=torch.int32).to(torch.uint16), "s": torch.tensor(2.5),
          "e": torch.empty(0, 2), "n": {"x": 1}}
    archives, metas = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcpx.save(sd, checkpoint_id=str(root / "d"))
        tdcp.save(sd, checkpoint_id=str(root / "t"))
    for who in ("d", "t"):
        d = root / who
        raw_md = (d / ".metadata").read_bytes()
        metas.append(raw_md)
        md = _metadata.loads(raw_md, str(d))
        for info in md.storage_data.values():
            blob = (d / info.relative_path).read_bytes()
            archives.append(blob[info.offset:info.offset + info.length])
    assert sum(isinstance(_C.parse_archive(a), dict) for a in archives[:4]) >= 3
    return archives, metas


MUTATION = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.integers(0, 1 << 20), st.integers(0, 255)),
        st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 7)),
        st.tuples(st.just("cut"), st.integers(0, 1 << 20), st.integers(1, 64)),
        st.tuples(st.just("dup"), st.integers(0, 1 << 20), st.integers(1, 64)),
        st.tuples(st.just("u64"), st.integers(0, 1 << 20),
                  st.sampled_from([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 32, (1 << 63) - 1,
                                   (1 << 64) - 1, (1 << 64) - 57, 1 << 63])),
    ),
    min_size=1, max_size=6)


def mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for op, pos, arg in ops:
        if not b:
            break
        pos %= len(b)
        if op == "set":
            b[pos] = arg
        elif op == "flip":
            b[pos] ^= 1 << arg
        elif op == "cut":
            del b[pos:pos + arg]
        elif op == "dup":
            b[pos:pos] = b[pos:pos + arg]
        else:
            b[pos:pos + 8] = struct.pack("<Q", arg)[:len(b[pos:pos + 8])]
    return bytes(b)


_BOUNDED = dict(deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@settings(max_examples=800, **_BOUNDED)
@given(data=st.data())
def test_mutated_archives(real_bytes, data):
    archives, _ = real_bytes
    m = mutate(data.draw(st.sampled_from(archives)), data.draw(MUTATION))
    check_archive(m)
    check_metadata(m)


@settings(max_examples=400, **_BOUNDED)
@given(data=st.data())
def test_mutated_metadata(real_bytes, data):
    _, metas = real_bytes
    m = mutate(data.draw(st.sampled_from(metas)), data.draw(MUTATION))
    check_metadata(m)
    check_pickle_scan(m)
    # with dcpx's trailer recomputed, so that the mutated pickle gets parsed
    if len(m) > 20 and m[-20:-12] == _metadata._TRAILER_MAGIC:
        body = m[:-20]
        check_metadata(body + _metadata._TRAILER.pack(
            _metadata._TRAILER_MAGIC, _C.crc32(body), len(body)))
