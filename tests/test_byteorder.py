"""Checkpoints written on a big-endian host: every record's ``byteorder``
says "big" and its storages hold big-endian bytes.  torch.load byte-swaps
them on a little-endian host; dcpx must too, on every path (fresh load,
read-plan-cached load, cast load, verify, convert; tied storages).

The files are written by torch itself, as a big-endian host writes them:
torch.save records ``sys.byteorder`` (patched to "big" here, as torch's own
test_serialization does) and the raw bytes of each storage, which are
given big-endian contents first (``UntypedStorage.byteswap``, per element,
per component for complex).  On main, dcpx loaded the byte-swapped values.
"""
from __future__ import annotations

import contextlib
import io
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from dcpx.coordination.readplan import clear
from dcpx.cli import main as cli_main
from dcpx.cli.verify import verify_checkpoint
from dcpx.errors import CorruptCheckpointError
from conftest import torch_save_supports

pytestmark = pytest.mark.skipif(sys.byteorder != "little", reason="little-endian host only")

# torch.save writes these with _rebuild_tensor_v2 (typed storages: torch.load swaps them)
TYPED = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int16,
         torch.int32, torch.int64, torch.complex64, torch.complex128, torch.bool,
         torch.int8, torch.uint8]
# ... and these with _rebuild_tensor_v3 (UntypedStorage: torch.load does not swap them)
# torch 2.4's torch.save has no uint16/32/64 storages
UNTYPED = [d for d in (torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn)
           if torch_save_supports(d)]
needs_uint = pytest.mark.skipif(not torch_save_supports(torch.uint16),
                                reason=f"torch {torch.__version__}'s torch.save has no uint16")


def _values(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, str(dtype))))  # stable across runs
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    hi = 200 if dtype in (torch.uint8, torch.int8) else 60000
    t = torch.randint(0, hi, shape, generator=g)
    if dtype == torch.int8:
        t = t - 100
    return t.to(dtype)


def state() -> dict:
    return {f"t_{str(d)[6:]}": _values(d) for d in TYPED + UNTYPED}


def big_endian(t: torch.Tensor) -> torch.Tensor:
    """t's values in a big-endian host's memory layout."""
    c = t.detach().clone().contiguous()
    c.untyped_storage().byteswap(c.dtype)
    return c


@contextlib.contextmanager
def big_endian_host(monkeypatch):
    """torch.save writes ``sys.byteorder`` into each archive's byteorder record."""
    with monkeypatch.context() as m:
        m.setattr(sys, "byteorder", "big")
        yield


def save_big_dcp(monkeypatch, sd: dict, path) -> None:
    swapped = {k: big_endian(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    with big_endian_host(monkeypatch):
        tdcp.save(swapped, checkpoint_id=str(path))


def empty_like(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


def byteorders(path: Path) -> set:
    """The byteorder records of every archive in a DCP checkpoint's data files."""
    md = dcpx.FileSystemReader(path).read_metadata()
    out = set()
    for info in md.storage_data.values():
        raw = (path / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        z = zipfile.ZipFile(io.BytesIO(raw))
        out.update(z.read(n) for n in z.namelist() if n.endswith("/byteorder"))
    return out


def assert_equal(got: dict, want: dict, keys=None) -> None:
    for k in keys or want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


def test_dcp_written_big_endian_loads_as_saved(tmp_path, monkeypatch):
    sd = state()
    save_big_dcp(monkeypatch, sd, tmp_path / "ck")
    assert byteorders(tmp_path / "ck") == {b"big"}
    clear()
    got = empty_like(sd)
    dcpx.load(got, checkpoint_id=tmp_path / "ck")
    assert_equal(got, sd)
    # torch reads the typed ones to the same values
    ref = empty_like(sd)
    tdcp.load(ref, checkpoint_id=str(tmp_path / "ck"))
    typed = [k for k in sd if sd[k].dtype in TYPED]
    assert_equal(got, ref, typed)
    # ... and leaves the untyped multi-byte ones as stored (a torch bug that
    # dcpx does not copy: docs/migration.md)
    for k in sd:
        if sd[k].dtype in UNTYPED and sd[k].element_size() > 1:
            assert torch.equal(ref[k], big_endian(sd[k])), k


def test_cached_and_cast_loads_swap(tmp_path, monkeypatch):
    sd = state()
    save_big_dcp(monkeypatch, sd, tmp_path / "ck")
    clear()
    for _ in range(3):  # the second and third go through the read-plan cache
        got = empty_like(sd)
        dcpx.load(got, checkpoint_id=tmp_path / "ck")
        assert_equal(got, sd)
    # casting loads read into a temporary of the saved dtype, then copy_
    casts = {"t_float32": torch.float64, "t_int32": torch.int64, "t_float16": torch.float32,
             "t_complex64": torch.complex128, "t_uint16": torch.int32, "t_bfloat16": torch.float32}
    casts = {k: d for k, d in casts.items() if k in sd}
    got = {k: torch.zeros(sd[k].shape, dtype=d) for k, d in casts.items()}
    dcpx.load(got, checkpoint_id=tmp_path / "ck", planner=dcpx.DefaultLoadPlanner(
        allow_partial_load=True))
    for k, d in casts.items():
        assert torch.equal(got[k], sd[k].to(d)), k


def test_widening_load_swaps(tmp_path, monkeypatch):
    """int32 saved, int64 destination: read into a temporary, then copy_."""
    sd = {"w": torch.arange(64, dtype=torch.int32).reshape(8, 8) * 1000}
    save_big_dcp(monkeypatch, sd, tmp_path / "ck")
    got = {"w": torch.zeros(8, 8, dtype=torch.int64)}
    dcpx.load(got, checkpoint_id=tmp_path / "ck")
    assert torch.equal(got["w"], sd["w"].long())


def test_dcpx_written_loads_both_ways_unchanged(tmp_path):
    """dcpx's own records stay little-endian and load in both."""
    sd = state()
    dcpx.save(sd, checkpoint_id=tmp_path / "ck")
    assert byteorders(tmp_path / "ck") == {b"little"}
    got = empty_like(sd)
    dcpx.load(got, checkpoint_id=tmp_path / "ck")
    assert_equal(got, sd)
    ref = empty_like(sd)
    tdcp.load(ref, checkpoint_id=str(tmp_path / "ck"))
    assert_equal(ref, sd)


def test_verify_big_endian_ok_and_bad_byteorder_named(tmp_path, monkeypatch):
    sd = {"w": torch.arange(6, dtype=torch.float32)}
    save_big_dcp(monkeypatch, sd, tmp_path / "ck")
    out = io.StringIO()
    assert verify_checkpoint(str(tmp_path / "ck"), out) == 0, out.getvalue()
    # A byteorder record that says neither: torch.load raises ValueError
    # ("Unknown endianness type"); dcpx calls the record corrupt, naming the key.
    f = next((tmp_path / "ck").glob("*.distcp"))
    raw = f.read_bytes()
    i = raw.index(b"bigPK")
    f.write_bytes(raw[:i] + b"bog" + raw[i + 3:])
    clear()
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*byteorder"):
        dcpx.load({"w": torch.zeros(6)}, checkpoint_id=tmp_path / "ck")
    out = io.StringIO()
    assert verify_checkpoint(str(tmp_path / "ck"), out) >= 1
    assert "BAD w" in out.getvalue()


def test_convert_big_endian_dcp_to_torch_save(tmp_path, monkeypatch, capsys):
    sd = state()
    save_big_dcp(monkeypatch, sd, tmp_path / "ck")
    assert cli_main(["convert", str(tmp_path / "ck"), str(tmp_path / "out.pt")]) == 0
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_equal(got, sd)


@needs_uint
def test_convert_big_endian_torch_save_with_tied_weights(tmp_path, monkeypatch, capsys):
    """Two keys share one storage: torch.load swaps it once in the file
    mapping's private pages; convert must not give those pages back (they
    would be read again from the file, unswapped) before the second key."""
    n = 1 << 16  # several pages
    w = torch.arange(n, dtype=torch.float32) * 3.5
    u = torch.arange(n, dtype=torch.int32) * 7
    h = torch.arange(n).to(torch.uint16)
    sd = {"enc": {"w": w, "u": u, "h": h}, "dec": {"w": w, "u": u, "h": h}}
    be = {k: big_endian(t) for k, t in {"w": w, "u": u, "h": h}.items()}
    with big_endian_host(monkeypatch):
        torch.save({"enc": dict(be), "dec": dict(be)}, tmp_path / "tied.pt")
    with zipfile.ZipFile(tmp_path / "tied.pt") as z:
        assert z.read("tied/byteorder") == b"big"
    # torch reads the typed ones back
    ref = torch.load(tmp_path / "tied.pt", weights_only=True)
    assert torch.equal(ref["dec"]["w"], w) and torch.equal(ref["dec"]["u"], u)
    assert cli_main(["convert", str(tmp_path / "tied.pt"), str(tmp_path / "ck")]) == 0
    flat = {f"{a}.{b}": sd[a][b] for a in sd for b in sd[a]}
    got = {k: torch.zeros_like(v) for k, v in flat.items()}
    dcpx.load(got, checkpoint_id=tmp_path / "ck")
    assert_equal(got, flat)
    # and to torch.save again, through the DCP reader
    assert cli_main(["convert", str(tmp_path / "tied.pt"), str(tmp_path / "again.pt")]) == 0
    again = torch.load(tmp_path / "again.pt", weights_only=True)
    assert_equal(again, flat)


def test_torch_save_big_endian_value_item(tmp_path, monkeypatch):
    """A non-tensor value holding a tensor (a tuple is stored whole, with
    torch.save): torch.load (under dcpx's allow-list) swaps it."""
    t = torch.arange(4, dtype=torch.int64) * 99
    with big_endian_host(monkeypatch):
        tdcp.save({"blob": (big_endian(t), 3)}, checkpoint_id=str(tmp_path / "ck"))
    got = {"blob": None}
    dcpx.load(got, checkpoint_id=tmp_path / "ck")
    assert torch.equal(got["blob"][0], t) and got["blob"][1] == 3


@needs_uint
@pytest.mark.parametrize("how", ["safe", "allow_pickle", "forced_weights_only"])
def test_big_endian_value_holding_untyped_tensors(tmp_path, monkeypatch, how):
    """Tensors inside a non-tensor value are swapped as tensor items are:
    torch.load swaps the typed storages (float32: dcpx equals torch's
    load), and leaves the untyped ones byte-reversed (uint16/32/64, float8:
    on main dcpx did too; now they load as saved, as a tensor item of the
    same dtype does)."""
    import argparse
    f = _values(torch.float32, (4,))
    un = {d: _values(d, (5,)) for d in UNTYPED}
    value = (big_endian(f), {"un": [big_endian(t) for t in un.values()]},
             big_endian(un[torch.uint16]))
    if how == "safe":   # dcpx's allow-list: a Namespace's attributes are walked too
        value += (argparse.Namespace(h=big_endian(un[torch.uint32])),)
    with big_endian_host(monkeypatch):
        tdcp.save({"blob": value, "w": big_endian(un[torch.uint16])},
                  checkpoint_id=str(tmp_path / "ck"))
    if how == "forced_weights_only":
        monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    reader = dcpx.FileSystemReader(tmp_path / "ck", allow_pickle=how == "allow_pickle")
    got = {"blob": None, "w": torch.zeros(5, dtype=torch.uint16)}
    dcpx.load(got, storage_reader=reader)
    ref = {"blob": None, "w": torch.zeros(5, dtype=torch.uint16)}
    tdcp.load(ref, checkpoint_id=str(tmp_path / "ck"))
    b, r = got["blob"], ref["blob"]
    assert torch.equal(b[0], f) and torch.equal(r[0], f)          # typed: as torch
    for t, want in zip(b[1]["un"], un.values()):
        assert t.dtype == want.dtype and torch.equal(t.view(torch.uint8),
                                                     want.view(torch.uint8)), t.dtype
    assert torch.equal(b[2], un[torch.uint16]) and torch.equal(b[2], got["w"])
    assert torch.equal(r[2], big_endian(un[torch.uint16]))        # torch leaves it reversed
    if how == "safe":
        assert torch.equal(b[3].h, un[torch.uint32])


@needs_uint
def test_convert_big_endian_torch_save_untyped_in_a_list(tmp_path, monkeypatch, capsys):
    """torch.load leaves untyped storages (uint16 here) unswapped wherever
    they sit in the file's object, a list included; convert swaps them."""
    h = torch.arange(300).to(torch.uint16) * 200
    f = torch.arange(5, dtype=torch.float64) / 3
    with big_endian_host(monkeypatch):
        torch.save({"hist": [big_endian(h), big_endian(f)]}, tmp_path / "l.pt")
    assert torch.equal(torch.load(tmp_path / "l.pt", weights_only=True)["hist"][0], big_endian(h))
    assert cli_main(["convert", str(tmp_path / "l.pt"), str(tmp_path / "ck")]) == 0
    got = {"hist": [torch.zeros_like(h), torch.zeros_like(f)]}
    dcpx.load(got, checkpoint_id=tmp_path / "ck")
    assert torch.equal(got["hist"][0], h) and torch.equal(got["hist"][1], f)


@needs_uint
def test_records_left_to_torch_load_are_swapped_too(tmp_path, monkeypatch):
    """A record the C reader leaves to torch.load (FileSystemReader.
    _fallback_read: views of a larger storage, a byteorder record far from
    the start): torch.load swaps the typed storages, dcpx the untyped ones."""
    from dcpx.storage.reader import _TensorRead
    sd = {"f": _values(torch.float32), "h": _values(torch.uint16), "c": _values(torch.complex64)}
    save_big_dcp(monkeypatch, sd, tmp_path / "ck")
    reader = dcpx.FileSystemReader(tmp_path / "ck")
    md = reader.read_metadata()
    for index, info in md.storage_data.items():
        t = sd[index.fqn]
        got = reader._fallback_read(_TensorRead(index.fqn, info, t.shape, t.dtype, t, None))
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), index.fqn


@needs_uint
@pytest.mark.skipif(not hasattr(torch.serialization, "set_crc32_options"),
                    reason="torch < 2.6 always writes zip CRCs")
def test_big_endian_without_crcs(tmp_path, monkeypatch, capsys):
    """Both at once (torch.serialization.set_crc32_options(False) on a
    big-endian host): the byteorder record has no CRC either."""
    from dcpx.storage.reader import _TensorRead
    sd = {"f": _values(torch.float64), "h": _values(torch.uint32)}
    torch.serialization.set_crc32_options(False)
    try:
        save_big_dcp(monkeypatch, sd, tmp_path / "ck")
        with big_endian_host(monkeypatch):
            torch.save({k: big_endian(v) for k, v in sd.items()}, tmp_path / "be.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    got = empty_like(sd)
    dcpx.load(got, checkpoint_id=tmp_path / "ck")
    assert_equal(got, sd)
    reader = dcpx.FileSystemReader(tmp_path / "ck")
    for index, info in reader.read_metadata().storage_data.items():
        t = sd[index.fqn]
        back = reader._fallback_read(_TensorRead(index.fqn, info, t.shape, t.dtype, t, None))
        assert torch.equal(back, t), index.fqn
    assert cli_main(["convert", str(tmp_path / "be.pt"), str(tmp_path / "ck2")]) == 0
    got = empty_like(sd)
    dcpx.load(got, checkpoint_id=tmp_path / "ck2")
    assert_equal(got, sd)


# -- a byteorder record outside the archive's folder (issue 31, item 11) -------------------

def _rewrite_records(root: Path, edit) -> None:
    """Rebuild each tensor record of the DCP checkpoint ``root`` as the zip
    of ``edit(records)`` (records: [(name, bytes)] in the archive's order),
    with the metadata's offsets and lengths made to match."""
    import pickle
    md = dcpx.FileSystemReader(root).read_metadata()
    for index, info in md.storage_data.items():
        f = root / info.relative_path
        raw = f.read_bytes()[info.offset:info.offset + info.length]
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            records = [(i.filename, z.read(i)) for i in z.infolist()]
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            for name, data in edit(records):
                z.writestr(name, data)
        new = buf.getvalue()
        name = f"__0_{index.fqn}.distcp"
        (root / name).write_bytes(new)
        info.relative_path, info.offset, info.length = name, 0, len(new)
    for p in root.glob("*.distcp"):
        if p.name not in {i.relative_path for i in md.storage_data.values()}:
            p.unlink()
    (root / ".metadata").write_bytes(pickle.dumps(md))


def _sd() -> dict:
    sd = {"f": _values(torch.float32)}
    if torch_save_supports(torch.uint16):
        sd["h"] = _values(torch.uint16)
    return sd


@pytest.mark.parametrize("where", ["first", "after-data.pkl", "last"])
def test_foreign_byteorder_record_is_refused_as_torch_refuses(tmp_path, capsys, where):
    """A record 'zzz/byteorder' ("big") in a tensor's archive: torch's reader
    takes the archive's folder from the first record ('archive/', or 'zzz/'
    when the foreign record is first) and refuses an archive with a record
    in another folder; dcpx loaded it, byte-swapped when it came first."""
    sd = _sd()
    tdcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
    at = {"first": 0, "after-data.pkl": 1, "last": None}[where]
    foreign = [("zzz/byteorder", b"big")]
    _rewrite_records(tmp_path / "ck", lambda recs: recs + foreign if at is None
                     else recs[:at] + foreign + recs[at:])
    md = dcpx.FileSystemReader(tmp_path / "ck").read_metadata()
    for info in md.storage_data.values():
        raw = (tmp_path / "ck" / info.relative_path).read_bytes()
        with pytest.raises(RuntimeError, match="zzz/|hasRecord"):
            torch.load(io.BytesIO(raw), weights_only=True)
    with pytest.raises(CorruptCheckpointError, match="first record"):
        dcpx.load(empty_like(sd), checkpoint_id=tmp_path / "ck")
    assert verify_checkpoint(str(tmp_path / "ck")) == len(sd)      # problems: every record
    assert capsys.readouterr().out.count("first record") == len(sd)


def test_byteorder_is_read_from_the_archives_own_folder():
    """archive_byteorder (the torch.load fallback's swap, the CLI's
    torch.save input, values) reads '<first record's folder>/byteorder'."""
    from dcpx.formats.byteorder import archive_byteorder

    def archive(*names):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            for name, data in names:
                z.writestr(name, data)
        return buf.getvalue()

    assert archive_byteorder(archive(("a/data.pkl", b""), ("b/byteorder", b"big"),
                                     ("a/byteorder", b"little"))) == "little"
    assert archive_byteorder(archive(("a/data.pkl", b""), ("b/byteorder", b"big"))) == "little"
    assert archive_byteorder(archive(("b/byteorder", b"big"), ("a/data.pkl", b""))) == "big"
    with pytest.raises(ValueError, match="not in a folder"):
        archive_byteorder(archive(("byteorder", b"big"), ("a/data.pkl", b"")))
