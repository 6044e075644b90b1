"""torch DCP's stream transforms (``_extensions``, ZStandard), both ways
with torch, bit-exactly; dcpx's CRC of each compressed record as it is on
disk; and what a transform dcpx cannot undo says (docs/format.md, "Stream
transforms")."""
import struct
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint._extension import ExtensionRegistry, ZStandard

import dcpx
from conftest import SAVEABLE_DTYPES, make_tensor, assert_state_bit_equal, empty_like_state
from dcpx.errors import CheckpointError, CorruptCheckpointError

pytest.importorskip("zstandard")

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*ComplexHalf support is experimental:UserWarning"),
]


def _dtypes():
    """The dtypes torch's own DCP save writes (its planner refuses the bits*
    types torch.save stores: see tests/test_interop.py)."""
    from test_interop import TORCH_DCP_DTYPES
    return TORCH_DCP_DTYPES


def _state():
    g = torch.Generator().manual_seed(3)
    sd = {}
    for d in _dtypes():
        name = str(d).removeprefix("torch.")
        sd[f"t.{name}"] = make_tensor((4, 3), d, g)
        sd[f"s.{name}"] = make_tensor((), d, g)
        sd[f"e.{name}"] = make_tensor((0, 2), d, g)
    base = make_tensor((6, 5), torch.float32, g)
    sd["view"] = base.t()[1:4]       # non-contiguous
    sd["slice"] = base[2:4]          # a view of a larger storage
    sd["big"] = torch.arange(200_000, dtype=torch.float64)  # compresses well
    sd["extra"] = {"step": 11, "name": "x"}
    return sd


def _torch_save(sd, path, **kw):
    tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(str(path), _extensions=[ZStandard()],
                                                       **kw), no_dist=True)


@pytest.mark.parametrize("kw", [{}, {"thread_count": 2}], ids=["one-file", "two-files"])
def test_torch_zstd_loads_in_dcpx(tmp_path, kw):
    sd = _state()
    _torch_save(sd, tmp_path, **kw)
    md = tdcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert all(v.transform_descriptors == ["stream.zstd/1"] for v in md.storage_data.values())
    out = empty_like_state(sd)
    dcpx.load(out, checkpoint_id=tmp_path)
    assert_state_bit_equal(sd, out)
    out = empty_like_state(sd)
    tdcp.load(out, storage_reader=dcpx.FileSystemReader(tmp_path), no_dist=True)
    assert_state_bit_equal(sd, out)
    # a cast and a partial load take the other read paths
    out = {"big": torch.empty(200_000, dtype=torch.float32)}
    dcpx.load(out, checkpoint_id=tmp_path,
              planner=tdcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(out["big"], sd["big"].float())


@pytest.mark.parametrize("kw", [{}, {"thread_count": 2}, {"single_file_per_rank": False}],
                         ids=["one-file", "two-files", "file-per-item"])
def test_dcpx_zstd_loads_in_torch(tmp_path, kw):
    sd = _state()
    dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(tmp_path, _extensions=[ZStandard()],
                                                       **kw))
    md = tdcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert all(v.transform_descriptors == ["stream.zstd/1"] for v in md.storage_data.values())
    out = empty_like_state(sd)
    tdcp.load(out, storage_reader=tdcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert_state_bit_equal(sd, out)
    out = empty_like_state(sd)
    dcpx.load(out, checkpoint_id=tmp_path)
    assert_state_bit_equal(sd, out)
    # compressed: the 1.6 MB of arange take far less
    big = next(v for k, v in md.storage_data.items() if k.fqn == "big")
    assert big.length < 400_000


def _entry(tmp_path, fqn):
    md = tdcp.FileSystemReader(str(tmp_path)).read_metadata()
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


def _flip(tmp_path, info, at):
    f = tmp_path / info.relative_path
    raw = bytearray(f.read_bytes())
    raw[info.offset + at] ^= 0x10
    f.write_bytes(bytes(raw))


def test_flipped_byte_in_dcpx_compressed_record_is_caught(tmp_path):
    sd = {"w": torch.arange(50_000, dtype=torch.float32), "v": make_tensor((64,), torch.int32)}
    dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(tmp_path, _extensions=[ZStandard()]))
    info = _entry(tmp_path, "w")
    for at in (info.length // 2, 5):  # in the compressed data, in the frame header
        _flip(tmp_path, info, at)
        with pytest.raises(CorruptCheckpointError, match="'w'.*CRC-32 mismatch in the compressed"):
            dcpx.load({"w": torch.empty(50_000)}, checkpoint_id=tmp_path)
        _flip(tmp_path, info, at)  # back
    out = {"w": torch.empty(50_000)}
    dcpx.load(out, checkpoint_id=tmp_path)
    assert torch.equal(out["w"], sd["w"])
    # verify reports it too
    _flip(tmp_path, info, info.length // 2)
    r = subprocess.run([sys.executable, "-m", "dcpx", "verify", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "BAD w" in r.stdout and "CRC-32" in r.stdout


def test_flipped_byte_in_torch_compressed_record_is_caught(tmp_path):
    """torch's records carry no dcpx CRC: decompression or the archive's own
    zip CRC-32s catch a flipped byte; never silent wrong data."""
    sd = {"w": make_tensor((20_000,), torch.float32)}  # random bytes: stored near verbatim
    _torch_save(sd, tmp_path)
    info = _entry(tmp_path, "w")
    for at in range(info.length // 4, info.length, info.length // 5):
        _flip(tmp_path, info, at)
        out = {"w": torch.empty(20_000)}
        try:
            dcpx.load(out, checkpoint_id=tmp_path)
        except CorruptCheckpointError as e:
            assert "'w'" in str(e)
        else:
            raise AssertionError(f"a flipped byte at {at} loaded without an error")
        _flip(tmp_path, info, at)


def test_unknown_transform_is_not_called_corrupt(tmp_path):
    sd = {"w": torch.arange(10.)}
    dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(tmp_path, _extensions=[ZStandard()]))

    class Registry(ExtensionRegistry):
        def __init__(self):
            super().__init__()
            self.extensions = {}  # knows nothing (as if zstandard were missing)

    with pytest.raises(CheckpointError) as ei:
        dcpx.load({"w": torch.empty(10)},
                  storage_reader=dcpx.FileSystemReader(tmp_path, _extension_registry=Registry()))
    from dcpx.errors import UnsupportedFormatError
    assert isinstance(ei.value, UnsupportedFormatError)
    assert not isinstance(ei.value, CorruptCheckpointError)
    msg = str(ei.value)
    assert "stream.zstd/1" in msg and "not damaged" in msg and "zstandard" in msg


def test_safetensors_and_extensions_together_are_refused(tmp_path):
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    with pytest.raises(NotImplementedError, match="choose one"):
        dcpx.FileSystemWriter(tmp_path, _extensions=[ZStandard()],
                              serialization_format=SerializationFormat.SAFETENSORS)


def test_crc_trailer_is_a_zstd_skippable_frame(tmp_path):
    import zstandard
    dcpx.save({"w": torch.arange(100.)},
              storage_writer=dcpx.FileSystemWriter(tmp_path, _extensions=[ZStandard()]))
    info = _entry(tmp_path, "w")
    rec = (tmp_path / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    magic, size = struct.unpack("<II", rec[-16:-8])
    assert magic == 0x184D2A5D and size == 8 and rec[-8:-4] == b"DCPX"
    from dcpx import _C
    assert struct.unpack("<I", rec[-4:])[0] == _C.crc32(rec[:-16])
    # zstd's own decoder reads past it: the record is a valid zstd stream
    dec = zstandard.ZstdDecompressor().decompressobj()
    assert dec.decompress(rec)[:2] == b"PK"


def _two_rank_zstd(rank, world, path):
    import torch.distributed as dist
    sd = {"w": torch.full((4,), float(rank)), f"r{rank}": torch.arange(5) + rank}
    dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(path, _extensions=[ZStandard()]))
    dist.barrier()
    out = {"w": torch.empty(4), f"r{rank}": torch.empty(5, dtype=torch.int64)}
    dcpx.load(out, checkpoint_id=path)
    assert torch.equal(out[f"r{rank}"], torch.arange(5) + rank)


def test_two_ranks_zstd(tmp_path):
    from dist_helpers import spawn
    spawn(_two_rank_zstd, 2, str(tmp_path))
    out = {"r0": torch.empty(5, dtype=torch.int64), "r1": torch.empty(5, dtype=torch.int64)}
    tdcp.load(out, storage_reader=tdcp.FileSystemReader(str(tmp_path)), no_dist=True,
              planner=tdcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(out["r1"], torch.arange(5) + 1)


def test_torch_safetensors_with_zstd_is_not_called_corrupt(tmp_path):
    """torch writes SAFETENSORS + _extensions as an empty zstd frame per
    tensor (recording the tensor's byte count) before an untransformed
    blob; torch's reader cannot load it either.  dcpx says what it is."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from dcpx.errors import UnsupportedFormatError
    tdcp.save({"a": torch.arange(10.)}, storage_writer=tdcp.FileSystemWriter(
        str(tmp_path), serialization_format=SerializationFormat.SAFETENSORS,
        _extensions=[ZStandard()]), no_dist=True)
    with pytest.raises(UnsupportedFormatError, match="'a'.*SAFETENSORS together with _extensions"):
        dcpx.load({"a": torch.empty(10)}, checkpoint_id=tmp_path)
