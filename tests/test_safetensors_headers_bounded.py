"""SAFETENSORS headers cost what the checkpoint's metadata allows them, not
what their length field says (issue 31, item 8): headers padded to 99 MB
loaded (a URL load used 566 MiB of TMPDIR and 189 MiB more memory, past
the documented 512 MiB and 64 MiB) and a 99 MB header of tiny entries cost
1.8 GiB to parse before it was refused.  A header longer than
``dcpx.formats.safetensors.header_budget`` (per tensor chunk of the metadata 256
bytes + 16 per byte of its key + 64 per dimension, 64 KiB per header) is
refused before it is fetched or read; headers that writers make load."""
from __future__ import annotations

import json
import struct
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from dcpx.formats import metadata as _metadata, safetensors as _fmt_safetensors

fsspec = pytest.importorskip("fsspec")
pytest.importorskip("safetensors")
try:
    from torch.distributed.checkpoint.filesystem import SerializationFormat
except ImportError:  # torch < 2.8
    pytest.skip("this torch has no SAFETENSORS serialization format", allow_module_level=True)

pytestmark = [pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")]
SF = SerializationFormat.SAFETENSORS


@pytest.fixture
def mem():
    fs = fsspec.filesystem("memory")
    root = f"/dcpx-st-headers-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _state() -> dict:
    return {f"t{i}": torch.full((16, 4), float(i)) for i in range(6)}


def _blobs(ck: Path) -> list:
    """(data file, blob offset) of every SAFETENSORS blob of ``ck``."""
    md = _metadata.loads((ck / ".metadata").read_bytes(), str(ck))
    return sorted(_fmt_safetensors.candidates(md))


def _rewrite_header(ck: Path, edit) -> None:
    """Each blob's header replaced by ``edit(header dict)`` (JSON text,
    the data after it unchanged: data_offsets are relative to it)."""
    for rel, off in _blobs(ck):
        raw = (ck / rel).read_bytes()
        (n,) = struct.unpack("<Q", raw[off:off + 8])
        text = edit(json.loads(raw[off + 8:off + 8 + n]))
        (ck / rel).write_bytes(raw[:off] + struct.pack("<Q", len(text)) + text
                               + raw[off + 8 + n:])


def _torch_save(ck: Path, sd: dict) -> None:
    tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(str(ck), serialization_format=SF,
                                                       single_file_per_rank=False))


def _padded(hdr: dict) -> bytes:
    text = json.dumps(hdr).encode()
    return text + b" " * (4_000_000 - len(text))          # valid JSON, valid safetensors


def _tiny_entries(hdr: dict) -> bytes:
    for i in range(40_000):                                # about 2.4 MB of entries
        hdr[f"x{i}"] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    text = json.dumps(hdr).encode()
    return text + b" " * (-len(text) % 8)


def _to_url(ck: Path, url: str) -> None:
    fsspec.filesystem("memory").put(str(ck), url.removeprefix("memory://"), recursive=True)


@pytest.mark.parametrize("edit", [_padded, _tiny_entries], ids=["padded", "tiny_entries"])
def test_oversized_header_is_refused_unread(tmp_path, mem, monkeypatch, edit):
    ck = tmp_path / "ck"
    _torch_save(ck, _state())
    assert len(_blobs(ck)) == 6                            # one data file a tensor
    _rewrite_header(ck, edit)
    parsed = []
    real = json.loads

    def watched(text, *a, **kw):
        parsed.append(len(text))
        return real(text, *a, **kw)

    monkeypatch.setattr(_fmt_safetensors.json, "loads", watched)
    out = {k: torch.zeros_like(v) for k, v in _state().items()}
    with pytest.raises(dcpx.CorruptCheckpointError, match="refused before reading it") as e:
        dcpx.load(out, checkpoint_id=ck)
    assert str(ck) in str(e.value) and "safetensors header at offset" in str(e.value)
    assert max(parsed, default=0) < 1 << 20, parsed         # no header parsed
    # through a URL: not fetched either
    _to_url(ck, mem)
    fs = fsspec.filesystem("memory")
    fetched = []
    real_cat = type(fs).cat_ranges

    def counted(self, paths, starts, ends, *a, **kw):
        fetched.extend(b - a_ for a_, b in zip(starts, ends))
        return real_cat(self, paths, starts, ends, *a, **kw)

    monkeypatch.setattr(type(fs), "cat_ranges", counted)
    with pytest.raises(dcpx.CorruptCheckpointError, match="refused before reading it") as e:
        dcpx.load(out, checkpoint_id=mem)
    assert f"{mem}/" in str(e.value) and "dcpx-fsspec-" not in str(e.value), str(e.value)
    assert sum(fetched) < 1 << 20, sum(fetched)


ODD_KEYS = ["w", "a" * 2000, 'q"uo\\te', "ctl\x01\x02\x1f", "\u00e9t\u00e9", "emoji\U0001f600" * 50,
            "model.layers.0.self_attn.q_proj.weight"]


@pytest.mark.parametrize("writer", ["torch", "dcpx"])
def test_headers_writers_make_load_locally_and_from_a_url(tmp_path, mem, writer):
    """Keys of every kind (long, quotes, control characters, non-ASCII),
    up to 8 dimensions, empty tensors: within the budget with room to spare."""
    sd = {}
    for i, k in enumerate(ODD_KEYS):
        sd[k] = torch.full((2,) * (1 + i % 8), float(i))
    sd["empty"] = torch.zeros(0, 3, 1, 5)
    sd["big8d"] = torch.arange(2 ** 8, dtype=torch.float64).reshape((2,) * 8)
    ck = tmp_path / "ck"
    if writer == "torch":
        _torch_save(ck, sd)
    else:
        dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(ck, serialization_format=SF,
                                                           single_file_per_rank=False))
    md = _metadata.loads((ck / ".metadata").read_bytes(), str(ck))
    blobs = _blobs(ck)
    used = 0
    for rel, off in blobs:
        raw = (ck / rel).read_bytes()
        used += struct.unpack("<Q", raw[off:off + 8])[0]
    budget = _fmt_safetensors.header_budget(md, len(blobs))
    slack = _fmt_safetensors.HEADER_SLACK * len(blobs)
    assert used <= (budget - slack) // 2 + 100 * len(blobs), (used, budget - slack)
    for where in (ck, mem):
        if where == mem:
            _to_url(ck, mem)
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcpx.load(out, checkpoint_id=where)
        for k, v in sd.items():
            assert torch.equal(out[k], v), k


def test_url_load_frees_the_headers_before_its_turns(tmp_path, mem, monkeypatch):
    """The headers' local space goes back once the local reader has parsed
    them: a load's TMPDIR holds them, or a turn, never both."""
    import os
    import tempfile
    from dcpx.filesystem import FileSystemReader
    sd = {f"k{i}" + "x" * 10_000: torch.full((4,), float(i)) for i in range(200)}
    ck = tmp_path / "ck"
    _torch_save(ck, sd)          # 200 headers of about 20 KiB, a tensor of 16 bytes each
    _to_url(ck, mem)
    staging = tmp_path / "tmp"
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))
    seen = []
    real = FileSystemReader.read_data

    def watched(self, plan, planner):
        seen.append(sum(os.stat(os.path.join(dp, n)).st_blocks * 512
                        for dp, _, ns in os.walk(staging) for n in ns))
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", watched)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcpx.load(out, checkpoint_id=mem)
    for k, v in sd.items():
        assert torch.equal(out[k], v), k
    # the turn's 200 x 16 bytes of tensors fetched (a block or two each);
    # the 200 headers' 4 MiB freed
    assert seen and max(seen) <= 200 * 8192, seen
