"""DCP's SAFETENSORS serialization format (torch's
``FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)``),
both ways with torch, bit-exactly, and what dcpx checks in it
(docs/format.md, "SAFETENSORS data files").

torch 2.13's own FileSystemReader cannot load these checkpoints (it
``torch.load``s each tensor's extent); what torch reads of them is the
``.metadata`` pickle and the safetensors blob (``safetensors.torch`` and
``_hf_utils._get_safetensors_file_metadata``, its HF reader's path).  So
"dcpx writes, torch loads" is checked there, and the data file is compared
with the one torch writes for the same state dict."""
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.filesystem import SerializationFormat

import dcpx
from conftest import make_tensor, assert_state_bit_equal, empty_like_state
from dcpx.formats.safetensors import DTYPES
from dcpx.errors import CorruptCheckpointError

st = pytest.importorskip("safetensors.torch")

pytestmark = [pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")]

SF = SerializationFormat.SAFETENSORS
#: the dtypes torch's safetensors path saves and loads back
ST_DTYPES = [d for d in DTYPES.values() if d in getattr(st, "_TYPES", {}).values()]


def _state(dtypes=ST_DTYPES, contiguous=True):
    g = torch.Generator().manual_seed(1)
    sd = {}
    for i, d in enumerate(dtypes):
        name = str(d).removeprefix("torch.")
        sd[f"t.{name}"] = make_tensor((3, 5), d, g)
        sd[f"s.{name}"] = make_tensor((), d, g)
        sd[f"e.{name}"] = make_tensor((0, 4), d, g)
        if not contiguous:
            sd[f"v.{name}"] = make_tensor((6, 4), d, g).t()[1:3]
    sd["big"] = make_tensor((300_000,), torch.float32, g)
    sd["step"] = 7
    sd["opt"] = {"lr": 0.5, "name": "adam"}
    return sd


def _torch_save(sd, path, **kw):
    tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(str(path), serialization_format=SF,
                                                       **kw), no_dist=True)


def _blob(path: Path, info):
    """The safetensors blob a tensor entry points at (to the end of the file)."""
    return (path / info.relative_path).read_bytes()[info.offset:]


def _header(blob: bytes) -> dict:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n])


@pytest.mark.parametrize("kw", [{}, {"thread_count": 3}, {"single_file_per_rank": False}],
                         ids=["one-file", "three-files", "file-per-item"])
def test_torch_writes_dcpx_loads_bit_exact(tmp_path, kw):
    sd = _state()
    _torch_save(sd, tmp_path, **kw)
    out = empty_like_state(sd)
    dcpx.load(out, checkpoint_id=tmp_path)
    assert_state_bit_equal(sd, out)
    # and again (dcpx's read-plan cache must not keep a stale resolution),
    # and through torch's load machinery with dcpx's reader
    out = empty_like_state(sd)
    dcpx.load(out, checkpoint_id=tmp_path)
    assert_state_bit_equal(sd, out)
    out = empty_like_state(sd)
    tdcp.load(out, storage_reader=dcpx.FileSystemReader(tmp_path), no_dist=True)
    assert_state_bit_equal(sd, out)


def test_torch_written_loads_with_casts_and_partially(tmp_path):
    sd = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
          "b": torch.arange(5, dtype=torch.int16)}
    _torch_save(sd, tmp_path)
    out = {"a": torch.zeros(3, 4, dtype=torch.float64)}
    dcpx.load(out, checkpoint_id=tmp_path,
              planner=tdcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(out["a"], sd["a"].double())


@pytest.mark.parametrize("kw", [{}, {"thread_count": 2}, {"single_file_per_rank": False}],
                         ids=["one-file", "two-files", "file-per-item"])
def test_dcpx_writes_torch_reads_bit_exact(tmp_path, kw):
    sd = _state(contiguous=False)
    dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(tmp_path, serialization_format=SF, **kw))
    # torch's own metadata reader, and torch's reading of each blob
    md = tdcp.FileSystemReader(str(tmp_path)).read_metadata()
    from torch.distributed.checkpoint._hf_utils import _get_safetensors_file_metadata
    for index, info in md.storage_data.items():
        value = sd[index.fqn] if index.fqn in sd else None
        if index.offset is None:
            continue
        assert info.transform_descriptors is None
        assert info.length == value.numel() * value.element_size()  # as torch records it
        blob = _blob(tmp_path, info)
        header, header_len = _get_safetensors_file_metadata(io.BytesIO(blob))
        sharding = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        assert sharding[index.fqn]["saved_offsets"] == list(index.offset)
        loaded = st.load(blob[:header_len + max(e["data_offsets"][1] for k, e in header.items()
                                                 if k != "__metadata__")])
        assert_state_bit_equal(value.contiguous(), loaded[index.fqn])
    # dcpx reads its own, values included
    out = empty_like_state(sd)
    dcpx.load(out, checkpoint_id=tmp_path)
    assert_state_bit_equal(sd, out)


def test_dcpx_data_file_matches_torchs(tmp_path):
    """Same state dict (tensors only, so the blob starts the file): the
    same data file as torch's, byte for byte, but for the order of the
    __metadata__ map (safetensors writes it from a hash map)."""
    sd = {k: v for k, v in _state().items() if isinstance(v, torch.Tensor)}
    _torch_save(sd, tmp_path / "torch")
    dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(tmp_path / "dcpx", serialization_format=SF))
    (t_file,) = (tmp_path / "torch").glob("*.distcp")
    (d_file,) = (tmp_path / "dcpx").glob("*.distcp")
    t, d = t_file.read_bytes(), d_file.read_bytes()
    assert len(t) == len(d)
    ht, hd = _header(t), _header(d)
    assert ht.pop("__metadata__") == hd.pop("__metadata__")
    assert list(ht.items()) == list(hd.items())
    n = struct.unpack("<Q", t[:8])[0]
    assert t[:8] == d[:8] and t[8 + n:] == d[8 + n:]
    tm = tdcp.FileSystemReader(str(tmp_path / "torch")).read_metadata()
    dm = tdcp.FileSystemReader(str(tmp_path / "dcpx")).read_metadata()
    assert tm.state_dict_metadata == dm.state_dict_metadata
    assert ({k: (v.offset, v.length) for k, v in tm.storage_data.items()}
            == {k: (v.offset, v.length) for k, v in dm.storage_data.items()})


def test_dcpx_refuses_a_dtype_safetensors_lacks(tmp_path):
    with pytest.raises(BaseException) as ei:  # torch's CheckpointException
        dcpx.save({"c": torch.zeros(2, dtype=torch.complex128)},
                  storage_writer=dcpx.FileSystemWriter(tmp_path, serialization_format=SF))
    text = "".join(traceback.format_exception(ei.value)) + repr(ei.value)
    assert "'c'" in text and "safetensors has no dtype" in text
    assert not (tmp_path / ".metadata").exists()


# ------------------------------------------------------------- corruption

def _one_file(tmp_path):
    sd = {"a": torch.arange(8, dtype=torch.float32), "b": torch.arange(4, dtype=torch.int64)}
    _torch_save(sd, tmp_path)
    (f,) = tmp_path.glob("*.distcp")
    return sd, f


def _rewrite_header(f: Path, edit, at: int = 0):
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[at:at + 8])
    h = json.loads(raw[at + 8:at + 8 + n])
    edit(h)
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    body = raw[at + 8 + n:]
    f.write_bytes(raw[:at] + struct.pack("<Q", len(text)) + text + body)
    # torch's metadata records the blob's offset (0) and lengths: unchanged


def _load_err(tmp_path, sd):
    with pytest.raises(CorruptCheckpointError) as ei:
        dcpx.load({k: torch.empty_like(v) for k, v in sd.items()}, checkpoint_id=tmp_path)
    return str(ei.value)


def test_truncated_header(tmp_path):
    sd, f = _one_file(tmp_path)
    raw = f.read_bytes()
    # keep the metadata's extents inside the file: cut inside the header,
    # then pad so that the file keeps its size
    (n,) = struct.unpack("<Q", raw[:8])
    f.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    msg = _load_err(tmp_path, sd)
    assert f.name in msg and "header" in msg and "truncated" in msg


def test_data_offsets_out_of_range(tmp_path):
    sd, f = _one_file(tmp_path)
    _rewrite_header(f, lambda h: h["a"].update(data_offsets=[h["a"]["data_offsets"][0],
                                                             10_000]))
    msg = _load_err(tmp_path, sd)
    assert f.name in msg and "'a'" in msg and "data_offsets" in msg


def test_overlapping_tensors(tmp_path):
    sd, f = _one_file(tmp_path)
    _rewrite_header(f, lambda h: h["a"].update(data_offsets=[0, 32]) or h["b"].update(
        data_offsets=[0, 32]))
    msg = _load_err(tmp_path, sd)
    assert f.name in msg and "overlap" in msg and ("'a'" in msg or "'b'" in msg)


def test_wrong_dtype(tmp_path):
    sd, f = _one_file(tmp_path)
    _rewrite_header(f, lambda h: h["a"].update(dtype="I32"))
    msg = _load_err(tmp_path, sd)
    assert f.name in msg and "'a'" in msg and "I32" in msg and "float32" in msg


def test_unknown_dtype_and_bad_shape(tmp_path):
    sd, f = _one_file(tmp_path)
    _rewrite_header(f, lambda h: h["b"].update(dtype="Q9"))
    msg = _load_err(tmp_path, sd)
    assert f.name in msg and "'b'" in msg and "unknown dtype" in msg
    sd, f = _one_file(tmp_path / "2")
    _rewrite_header(f, lambda h: h["a"].update(shape=[2, 4]))
    msg = _load_err(tmp_path / "2", sd)
    assert "'a'" in msg and "shape" in msg


def test_header_not_json(tmp_path):
    sd, f = _one_file(tmp_path)
    raw = bytearray(f.read_bytes())
    raw[9] = ord("#")
    f.write_bytes(bytes(raw))
    msg = _load_err(tmp_path, sd)
    assert f.name in msg and "JSON" in msg


# ------------------------------------------------------------- tools

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dcpx", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_cli_inspect_verify_convert(tmp_path):
    sd = _state(dtypes=[torch.float32, torch.bfloat16])
    _torch_save(sd, tmp_path / "ck")
    r = _cli("inspect", tmp_path / "ck")
    assert r.returncode == 0 and "t.bfloat16" in r.stdout
    r = _cli("verify", tmp_path / "ck")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    r = _cli("convert", tmp_path / "ck", tmp_path / "out.pt", "--to", "torch")
    assert r.returncode == 0, r.stdout + r.stderr
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_state_bit_equal(sd["big"], got["big"])
    # a corrupt header is reported, not raised
    (f,) = (tmp_path / "ck").glob("*.distcp")
    md = tdcp.FileSystemReader(str(tmp_path / "ck")).read_metadata()
    at = next(v.offset for k, v in md.storage_data.items() if k.fqn == "big")
    _rewrite_header(f, lambda h: h["big"].update(dtype="I32"), at)
    r = _cli("verify", tmp_path / "ck")
    assert r.returncode == 1 and "BAD" in r.stdout and "'big'" in r.stdout


def test_manager_loads_torch_written_safetensors_step(tmp_path):
    sd = {"w": make_tensor((4, 4), torch.float32), "step": 3}
    _torch_save(sd, tmp_path / "step-3")
    for verify in ("commit", "full"):  # "full": dcpx verify's every check
        mgr = dcpx.CheckpointManager(tmp_path, async_mode="sync", verify=verify)
        try:
            out = {"w": torch.empty(4, 4), "step": 0}
            assert mgr.load(out) == 3
            assert_state_bit_equal(sd, out)
        finally:
            mgr.close()


def test_fsspec_url_loads_safetensors(tmp_path):
    """A remote reader fetches only the extents the metadata names; a
    SAFETENSORS tensor's extent starts at its blob, so the whole blob must
    come (else its bytes would read as the sparse file's zeros)."""
    fsspec = pytest.importorskip("fsspec")
    sd = {"a": make_tensor((50_000,), torch.float32), "b": make_tensor((3, 4), torch.bfloat16),
          "c": 7}
    _torch_save(sd, tmp_path)
    fs = fsspec.filesystem("memory")
    for f in tmp_path.iterdir():
        fs.pipe(f"/st_remote/{f.name}", f.read_bytes())
    try:
        out = empty_like_state(sd)
        dcpx.load(out, checkpoint_id="memory://st_remote")
        assert_state_bit_equal(sd, out)
    finally:
        fs.rm("/st_remote", recursive=True)


def test_async_save_writes_safetensors(tmp_path):
    sd = {"a": make_tensor((1000,), torch.float32), "c": 7}
    dcpx.async_save(sd, storage_writer=dcpx.FileSystemWriter(
        tmp_path, serialization_format=SF)).result()
    md = tdcp.FileSystemReader(str(tmp_path)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "a")
    assert info.length == 4000  # torch's SAFETENSORS entry: the tensor's byte count
    out = {"a": torch.empty(1000), "c": None}
    dcpx.load(out, checkpoint_id=tmp_path)
    assert_state_bit_equal(sd, out)


def _two_rank_safetensors(rank, world, path):
    import torch.distributed as dist
    sd = {"w": torch.full((4,), 1.5), f"r{rank}": torch.arange(5) + rank, "step": 9}
    dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(path, serialization_format=SF))
    dist.barrier()
    out = {"w": torch.empty(4), f"r{rank}": torch.empty(5, dtype=torch.int64), "step": 0}
    dcpx.load(out, checkpoint_id=path)
    assert torch.equal(out[f"r{rank}"], torch.arange(5) + rank) and out["step"] == 9
    assert torch.equal(out["w"], torch.full((4,), 1.5))


def test_two_ranks_safetensors(tmp_path):
    from dist_helpers import spawn
    spawn(_two_rank_safetensors, 2, str(tmp_path))
    assert len(list(tmp_path.glob("__1_*.distcp"))) == 1  # each rank wrote its file
    out = {"r0": torch.empty(5, dtype=torch.int64), "r1": torch.empty(5, dtype=torch.int64)}
    dcpx.load(out, checkpoint_id=tmp_path)
    assert torch.equal(out["r1"], torch.arange(5) + 1)


def test_format_modules_import_no_rank_coordination():
    """The storage formats import downward only (issue 23, "Also"): no
    module they reach, directly or not, is rank coordination (_dist) or the
    planning and API layers above it."""
    import ast
    root = Path(dcpx.__file__).parent
    above = {"_dist", "_plan", "_api", "_async", "_process", "manager", "_writer", "_reader"}

    def imports(mod):
        tree = ast.parse((root / f"{mod}.py").read_text())
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    out.add(node.module.split(".")[0])
                else:
                    out.update(a.name for a in node.names)
        return out

    for start in ("_formats", "_fmt_safetensors", "_fmt_transforms"):
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m in seen or not (root / f"{m}.py").exists():
                continue
            seen.add(m)
            todo.extend(imports(m))
        assert not (seen & above), (start, sorted(seen & above))


def test_header_byte_flips_never_crash_or_load_wrong(tmp_path):
    """Any single flipped byte in the blob's length or header: the load
    either raises CorruptCheckpointError naming the file, or (a flip JSON
    and the checks cannot see, e.g. in padding that stays whitespace)
    loads the right bytes."""
    import random
    sd = {"a": make_tensor((8,), torch.float32), "b": make_tensor((2, 3), torch.int16),
          "c": make_tensor((), torch.bfloat16)}
    _torch_save(sd, tmp_path / "ref")
    (ref,) = (tmp_path / "ref").glob("*.distcp")
    good = ref.read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    rng = random.Random(0)
    for trial in range(60):
        at = rng.randrange(8 + n)
        bad = bytearray(good)
        bad[at] ^= 1 << rng.randrange(8)
        ref.write_bytes(bytes(bad))
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        try:
            dcpx.load(out, checkpoint_id=tmp_path / "ref")
        except CorruptCheckpointError as e:
            assert ref.name in str(e), (at, str(e))
        else:
            assert_state_bit_equal(sd, out)


# ------------------------------------------- hostile headers (issue 31, item 11)

def test_deeply_nested_header_names_the_file(tmp_path):
    """JSON nested 30,000 deep in the header (60 KB: inside the header budget
    of issue 31 item 9, so the parse, not the budget, refuses it): json raises
    RecursionError, which the reader turns into CorruptCheckpointError naming
    the file."""
    sd, f = _one_file(tmp_path)
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    deep = b"[" * 30_000 + b"]" * 30_000
    text = raw[8:8 + n].rstrip()[:-1] + b',"zz":' + deep + b"}"
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    msg = _load_err(tmp_path, sd)
    assert f.name in msg and "JSON" in msg, msg


def test_deeply_nested_sharding_info_names_the_file(tmp_path):
    sd, f = _one_file(tmp_path)
    key = "DCP_SHARDING_INFO"
    _rewrite_header(f, lambda h: h["__metadata__"].update({key: "[" * 30_000 + "]" * 30_000}))
    msg = _load_err(tmp_path, sd)
    assert f.name in msg and key in msg, msg


@pytest.mark.parametrize("saved", [5, "0", [None], {"a": 1}])
def test_saved_offsets_not_a_list_names_the_file(tmp_path, saved):
    sd, f = _one_file(tmp_path)
    key = "DCP_SHARDING_INFO"

    def edit(h):
        info = json.loads(h["__metadata__"][key])
        info["a"]["saved_offsets"] = saved
        h["__metadata__"][key] = json.dumps(info)
    _rewrite_header(f, edit)
    msg = _load_err(tmp_path, sd)
    assert f.name in msg and "'a'" in msg and "saved_offsets" in msg, msg
