"""dcpx and torch.distributed.checkpoint read each other's checkpoints.

The on-disk format is torch's: a pickled ``Metadata`` in ``.metadata`` and
``__{rank}_{i}.distcp`` data files that are concatenations of torch.save
zip archives.  Checked here in both directions, bit-exactly, plus the
format details dcpx promises on top: every archive is a valid zip whose CRCs
check out, and every tensor's bytes start 64-byte aligned in the file.
"""
import io
import tempfile
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.api import CheckpointException

import dcpx
from conftest import (
    KNOWN_BROKEN,
    SAVEABLE_DTYPES,
    assert_state_bit_equal,
    dtype_id,
    dtype_params,
    empty_like_state,
    item_slices,
    make_tensor,
    member_data_offset,
    resolved,
    torch_copies,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*ComplexHalf support is experimental:UserWarning"),
]


def torch_dcp_saves(dtype) -> bool:
    """torch DCP itself cannot save some dtypes torch.save stores (its
    planner calls torch.iinfo on the bits* types)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tempfile.TemporaryDirectory() as d:
                tdcp.save({"x": torch.zeros(2 * dtype.itemsize, dtype=torch.uint8).view(dtype)},
                          checkpoint_id=d)
        return True
    except (Exception, CheckpointException):  # a BaseException, not an Exception
        return False


TORCH_DCP_DTYPES = [d for d in SAVEABLE_DTYPES if torch_dcp_saves(d)]


def torch_dcp_loads(dtype) -> bool:
    """torch DCP's load copies each tensor into place with ``copy_``, which
    some torch versions lack for some dtypes (torch 2.8: float4_e2m1fn_x2,
    "copy_kernel not implemented"): such a checkpoint torch cannot load."""
    try:
        src = torch.zeros(2 * dtype.itemsize, dtype=torch.uint8).view(dtype)
        torch.empty_like(src).copy_(src)
        return True
    except Exception:
        return False


def needs_torch_load(dtype):
    if not torch_dcp_loads(dtype):
        pytest.skip(f"torch {torch.__version__}'s DCP load cannot copy {dtype} (no copy_ kernel)")


def mixed_state(gen, dtypes):
    """Many dtypes, nesting, plain values, 0-d, empty and strided tensors."""
    state = {"by_dtype": {dtype_id(d): make_tensor((3, 5), d, gen) for d in dtypes}}
    state.update({
        "scalar": make_tensor((), torch.float64, gen),
        "empty": make_tensor((4, 0, 2), torch.int32, gen),
        "transposed": make_tensor((7, 3), torch.float32, gen).T,
        "stepped": make_tensor((50,), torch.int16, gen)[5::4],
        "large": make_tensor((400_000,), torch.float32, gen),
        "model": {"w": make_tensor((16, 8), torch.bfloat16, gen),
                  "layers": [make_tensor((2,), torch.float16, gen), {"b": torch.arange(4)}]},
        "step": 1234,
        "name": "interop",
        "ids": [3, 1, 4, 1, 5],
        "nothing": None,
        "cfg": {"lr": 3e-4, "betas": 0.9},
    })
    return state


def common_dtypes():
    """dtypes torch DCP both saves and loads on the installed torch."""
    return [d for d in TORCH_DCP_DTYPES if d not in KNOWN_BROKEN and torch_dcp_loads(d)]


# --------------------------------------------------------------------------
# both directions, bit-exact

def torch_loads(dtype) -> bool:
    """torch DCP's load copies each tensor into its destination: on torch
    2.9 float4_e2m1fn_x2 has no copy kernel, and torch cannot load it from
    any checkpoint, its own included (conftest.torch_copies)."""
    return torch_copies(dtype)


def test_dcpx_save_torch_load(tmp_path, gen):
    state = mixed_state(gen, [d for d in common_dtypes() if torch_loads(d)])
    dcpx.save(state, checkpoint_id=tmp_path)
    dest = empty_like_state(state)
    tdcp.load(dest, checkpoint_id=tmp_path)
    assert_state_bit_equal(dest, resolved(state))


def test_torch_save_dcpx_load(tmp_path, gen):
    state = mixed_state(gen, common_dtypes())
    tdcp.save(state, checkpoint_id=tmp_path)
    dest = empty_like_state(state)
    dcpx.load(dest, checkpoint_id=tmp_path)
    assert_state_bit_equal(dest, resolved(state))


def test_torch_save_with_thread_count_and_file_per_item_dcpx_load(tmp_path, gen):
    state = mixed_state(gen, [torch.float32, torch.int64, torch.bool])
    for i, kw in enumerate([{"thread_count": 3}, {"single_file_per_rank": False}]):
        path = tmp_path / str(i)
        tdcp.save(state, storage_writer=tdcp.FileSystemWriter(path, **kw))
        dest = empty_like_state(state)
        dcpx.load(dest, checkpoint_id=path)
        assert_state_bit_equal(dest, resolved(state))


@pytest.mark.parametrize("dtype", dtype_params(SAVEABLE_DTYPES))
def test_each_dtype_dcpx_to_torch(dtype, tmp_path, gen):
    """Every dtype, alone, so a failure names it.  torch DCP loads the bits*
    dtypes although it cannot save them."""
    needs_torch_load(dtype)
    state = {"x": make_tensor((4, 6), dtype, gen), "s": make_tensor((), dtype, gen)}
    dcpx.save(state, checkpoint_id=tmp_path)
    dest = empty_like_state(state)
    tdcp.load(dest, checkpoint_id=tmp_path)
    assert_state_bit_equal(dest, state)


@pytest.mark.parametrize("dtype", dtype_params(TORCH_DCP_DTYPES))
def test_each_dtype_torch_to_dcpx(dtype, tmp_path, gen):
    state = {"x": make_tensor((4, 6), dtype, gen), "t": make_tensor((6, 4), dtype, gen).T}
    tdcp.save(state, checkpoint_id=tmp_path)
    dest = empty_like_state(state)
    dcpx.load(dest, checkpoint_id=tmp_path)
    assert_state_bit_equal(dest, resolved(state))


# --------------------------------------------------------------------------
# the metadata

def test_torch_reads_dcpx_metadata_equal_to_its_own(tmp_path, gen):
    state = mixed_state(gen, common_dtypes())
    state["grad"] = torch.randn(3, requires_grad=True)
    dcpx.save(state, checkpoint_id=tmp_path / "dcpx")
    tdcp.save(state, checkpoint_id=tmp_path / "torch")
    ours = tdcp.FileSystemReader(tmp_path / "dcpx").read_metadata()
    theirs = tdcp.FileSystemReader(tmp_path / "torch").read_metadata()

    assert ours.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    for key, want in theirs.state_dict_metadata.items():
        got = ours.state_dict_metadata[key]
        assert type(got) is type(want), key
        if isinstance(want, dcpx.TensorStorageMetadata):
            assert got.size == want.size, key
            assert got.properties.dtype == want.properties.dtype, key
            assert got.properties.requires_grad == want.properties.requires_grad, key
            assert got.chunks == want.chunks, key
    assert ours.state_dict_metadata == theirs.state_dict_metadata  # all fields
    assert ours.planner_data == theirs.planner_data
    assert set(ours.storage_data) == set(theirs.storage_data)
    # the same fields as this torch writes (no version before torch 2.9)
    assert set(vars(ours)) == set(vars(theirs))
    assert getattr(ours, "version", None) == getattr(theirs, "version", None)


def test_dcpx_reads_torch_metadata(tmp_path, gen):
    state = {"a": make_tensor((2, 3), torch.float32, gen), "n": 5}
    written = tdcp.save(state, checkpoint_id=tmp_path)
    read = dcpx.FileSystemReader(tmp_path).read_metadata()
    assert read.state_dict_metadata == written.state_dict_metadata
    # torch 2.9-2.11: FileSystemWriter.finish() stores a copy of the metadata
    # (dataclasses.replace), so the Metadata its save() returns has no
    # storage_data; what torch's reader reads from the same files has it.
    theirs = tdcp.FileSystemReader(tmp_path).read_metadata()
    assert theirs.storage_data
    assert read.storage_data == theirs.storage_data
    if written.storage_data is not None:
        assert read.storage_data == written.storage_data


# --------------------------------------------------------------------------
# the data files: zip archives, CRCs, alignment

@pytest.mark.parametrize("writer_kw", [{}, {"thread_count": 3}, {"single_file_per_rank": False}],
                         ids=["default", "3-threads", "file-per-item"])
def test_every_item_is_a_valid_zip_with_aligned_tensor_data(tmp_path, gen, writer_kw):
    state = mixed_state(gen, common_dtypes())
    md = dcpx.save(state, storage_writer=dcpx.FileSystemWriter(tmp_path, **writer_kw))
    tensor_keys = {k for k, v in md.state_dict_metadata.items()
                   if isinstance(v, dcpx.TensorStorageMetadata)}
    seen = set()
    for key, raw, file_offset in item_slices(tmp_path, md):
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            assert z.testzip() is None, f"{key}: bad CRC in {z.testzip()}"
            members = z.infolist()
            assert all(m.compress_type == zipfile.ZIP_STORED for m in members)
            data = [m for m in members if m.filename.endswith("/data/0")]
            if key in tensor_keys:
                assert len(data) == 1
                start = file_offset + member_data_offset(raw, "/data/0")[0]
                assert start % 64 == 0, f"{key}: tensor data at file offset {start}"
            # and torch itself can load every record on its own
            value = torch.load(io.BytesIO(raw), weights_only=True)
            if key in tensor_keys:
                assert isinstance(value, torch.Tensor)
        seen.add(key)
    assert seen == set(md.state_dict_metadata)


def test_zip_crc_matches_the_tensor_bytes(tmp_path, gen):
    import zlib
    t = make_tensor((3000,), torch.float64, gen)
    md = dcpx.save({"t": t}, checkpoint_id=tmp_path)
    [(_, raw, _)] = list(item_slices(tmp_path, md))
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        [member] = [m for m in z.infolist() if m.filename.endswith("/data/0")]
        payload = z.read(member)
    assert payload == t.numpy().tobytes()
    assert member.CRC == zlib.crc32(payload)
