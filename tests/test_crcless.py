"""Records written without zip CRCs (``torch.serialization.
set_crc32_options(False)``): torch writes 0 in every record's CRC field,
and torch.load reads them.  dcpx loads them too, ``dcpx verify`` says the
CRC is absent (not wrong), the manager resumes from them, and every CRC
that is present (torch's with the option on, dcpx's own records and its
``.metadata`` trailer) is still checked.  On main, load, verify and the
manager called such checkpoints corrupt.
"""
from __future__ import annotations

import contextlib
import io
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from dcpx.coordination.readplan import clear
from dcpx.cli.verify import verify_checkpoint
from dcpx.errors import CorruptCheckpointError


@contextlib.contextmanager
def crc_off():
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(True)


def state() -> dict:
    return {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64),
            "step": 7, "name": "run-1", "extra": (torch.arange(3), "x")}


def empty() -> dict:
    return {"w": torch.zeros(4096), "b": torch.zeros(3, dtype=torch.int64), "step": 0,
            "name": "", "extra": None}


def save_crcless(path) -> None:
    with crc_off(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(state(), checkpoint_id=str(path), no_dist=True)


def record_crcs(path) -> set:
    """The CRC fields of every zip record in the checkpoint's data files."""
    md = dcpx.FileSystemReader(path).read_metadata()
    crcs = set()
    for info in md.storage_data.values():
        raw = (path / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        crcs.update(i.CRC for i in zipfile.ZipFile(io.BytesIO(raw)).infolist() if i.file_size)
    return crcs


def check(got: dict) -> None:
    want = state()
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    assert got["step"] == 7 and got["name"] == "run-1"
    assert torch.equal(got["extra"][0], want["extra"][0]) and got["extra"][1] == "x"


def test_torch_crcless_checkpoint_loads(tmp_path):
    save_crcless(tmp_path / "ck")
    assert record_crcs(tmp_path / "ck") == {0}
    clear()
    for _ in range(2):  # fresh, then through the read-plan cache
        got = empty()
        dcpx.load(got, checkpoint_id=tmp_path / "ck")
        check(got)
    # torch reads the same
    ref = empty()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(ref, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    check(ref)


def test_verify_says_absent_not_wrong(tmp_path):
    save_crcless(tmp_path / "ck")
    out = io.StringIO()
    assert verify_checkpoint(str(tmp_path / "ck"), out) == 0, out.getvalue()
    text = out.getvalue()
    assert "NO CRC" in text and "absent, not wrong" in text
    assert "fails its CRC" not in text and "BAD" not in text
    assert text.rstrip().endswith("5 records verified, OK")


def test_present_crcs_still_checked(tmp_path):
    """torch's CRCs with the option on and dcpx's own: a flipped byte in a
    value's record fails load and verify, naming the key."""
    for writer in ("torch", "dcpx"):
        ck = tmp_path / writer
        if writer == "torch":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tdcp.save(state(), checkpoint_id=str(ck), no_dist=True)
        else:
            dcpx.save(state(), checkpoint_id=ck)
        assert 0 not in record_crcs(ck)
        md = dcpx.FileSystemReader(ck).read_metadata()
        info = next(v for k, v in md.storage_data.items() if k.fqn == "name")
        f = ck / info.relative_path
        raw = bytearray(f.read_bytes())
        seg = bytes(raw[info.offset:info.offset + info.length])
        at = info.offset + seg.index(b"run-1")
        raw[at] ^= 0x01
        f.write_bytes(bytes(raw))
        clear()
        with pytest.raises(CorruptCheckpointError, match="'name'.*CRC"):
            dcpx.load(empty(), checkpoint_id=ck)
        out = io.StringIO()
        assert verify_checkpoint(str(ck), out) == 1
        assert "BAD name" in out.getvalue() and "fails its CRC-32" in out.getvalue()


def test_crcless_tensor_bytes_are_not_checked_but_dcpx_metadata_is(tmp_path):
    """Without a CRC a flipped tensor byte cannot be seen (torch.load does
    not see it either); dcpx's own .metadata checksum still applies to a
    checkpoint dcpx wrote with torch's CRC option off."""
    with crc_off():
        dcpx.save(state(), checkpoint_id=tmp_path / "ck")
    got = empty()
    dcpx.load(got, checkpoint_id=tmp_path / "ck")
    check(got)
    meta = tmp_path / "ck" / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    meta.write_bytes(bytes(raw))
    clear()
    with pytest.raises((CorruptCheckpointError, dcpx.errors.UnsafeCheckpointError)):
        dcpx.load(empty(), checkpoint_id=tmp_path / "ck")


def test_manager_resumes_crcless_step(tmp_path):
    save_crcless(tmp_path / "root" / "step-5")
    for verify in ("commit", "full"):
        mgr = dcpx.CheckpointManager(tmp_path / "root", verify=verify, async_mode="sync")
        try:
            got = empty()
            with warnings.catch_warnings():
                warnings.simplefilter("error", dcpx.manager.StepSkippedWarning)
                assert mgr.load(got) == 5
            check(got)
        finally:
            mgr.close()


def test_convert_crcless_both_ways(tmp_path, capsys):
    """dcpx convert reads a CRC-less DCP checkpoint and a CRC-less
    torch.save file; what it writes has CRCs."""
    from dcpx.cli import main as cli_main
    save_crcless(tmp_path / "ck")
    # (--only: a value holding a tensor, 'extra', is a separate matter for
    # a torch.save output)
    assert cli_main(["convert", str(tmp_path / "ck"), str(tmp_path / "out.pt"),
                     "--only", "w", "--only", "name"]) == 0
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(got["w"], state()["w"]) and got["name"] == "run-1"
    with crc_off():
        torch.save({"w": state()["w"], "n": 3}, tmp_path / "in.pt")
    assert {i.CRC for i in zipfile.ZipFile(tmp_path / "in.pt").infolist() if i.file_size} == {0}
    assert cli_main(["convert", str(tmp_path / "in.pt"), str(tmp_path / "ck2")]) == 0
    assert 0 not in record_crcs(tmp_path / "ck2")
    back = {"w": torch.zeros(4096), "n": 0}
    dcpx.load(back, checkpoint_id=tmp_path / "ck2")
    assert torch.equal(back["w"], state()["w"]) and back["n"] == 3
