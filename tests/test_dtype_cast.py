"""Loading into a tensor of another dtype, as torch DCP does.

torch's ``FileSystemReader.read_data`` loads each saved chunk in its saved
dtype, narrows it, and ``target.copy_(chunk)``: a fp32 checkpoint loads into
a bf16 model, torchtitan's bf16 ``export_dtype`` checkpoint into a fp32 one.
torch 2.13 has no load-planner option about casting.  dcpx does the same
``copy_`` (so the result is torch's, bit for bit) and refuses, naming the key,
exactly the pairs ``copy_`` refuses (the ``bits*`` and ``float4_e2m1fn_x2``
dtypes, to or from anything else).  Every case is compared with torch's own
load of the same checkpoint.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import dcpx
import dcpx.filesystem
from conftest import SAVEABLE_DTYPES, assert_bit_equal, dtype_id, make_tensor

#: the dtypes of real models and optimizer states, for the layout cases
COMMON = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
          torch.uint8, torch.bool, torch.complex64]
PAIRS = [pytest.param(s, d, id=f"{dtype_id(s)}-to-{dtype_id(d)}")
         for s in COMMON for d in COMMON if s != d]


def torch_load(dest: dict, path, planner=None) -> BaseException | None:
    """torch's load into ``dest``; the exception it raised, if any (its
    CheckpointException is a BaseException)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.load(dest, storage_reader=tdcp.FileSystemReader(path), planner=planner,
                      no_dist=True)
    except Exception as e:  # noqa: BLE001 - recorded, compared below
        return e
    except BaseException as e:  # CheckpointException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return e
    return None


def dcpx_load(dest: dict, path, planner=None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Casting complex values to real ..."
        dcpx.load(dest, checkpoint_id=path, planner=planner)


@pytest.mark.parametrize("saved", [pytest.param(d, id=dtype_id(d)) for d in SAVEABLE_DTYPES])
def test_every_dtype_pair_casts_as_torch_or_is_refused_as_torch(tmp_path, saved):
    """For each saved dtype, a load into every other dtype: dcpx gives torch's
    result bit for bit, or refuses (naming the key) where torch refuses."""
    src = make_tensor((5, 7), saved, torch.Generator().manual_seed(5))
    dcpx.save({"model.w": src}, checkpoint_id=tmp_path)
    refused = []
    for dest_dtype in SAVEABLE_DTYPES:
        if dest_dtype == saved:
            continue
        expected = {"model.w": torch.zeros(5, 7, dtype=dest_dtype)}
        err = torch_load(expected, tmp_path)
        got = {"model.w": torch.zeros(5, 7, dtype=dest_dtype)}
        if err is not None:
            refused.append(dest_dtype)
            with pytest.raises(TypeError, match=r"'model\.w'") as ei:
                dcpx_load(got, tmp_path)
            assert str(saved) in str(ei.value) and str(dest_dtype) in str(ei.value)
            assert got["model.w"].view(torch.uint8).eq(0).all(), "refused, yet written"
            continue
        dcpx_load(got, tmp_path)
        assert_bit_equal(got["model.w"], expected["model.w"], f"{saved} -> {dest_dtype}")
    # The refusals are copy_'s: the bit types and float4 convert to nothing.
    odd = {d for d in SAVEABLE_DTYPES if "bits" in str(d) or "float4" in str(d)}
    assert set(refused) == (set(SAVEABLE_DTYPES) - {saved} if saved in odd else odd)


def test_fp32_checkpoint_into_bf16_model_and_back(tmp_path):
    """The two cases of the issue: an fp32 checkpoint resumed by a bf16 model,
    and torchtitan's bf16 export resumed by an fp32 model."""
    g = torch.Generator().manual_seed(0)
    model = {"tok.weight": torch.randn(64, 32, generator=g),
             "layers.0.w": torch.randn(32, 32, generator=g), "step": 7}
    dcpx.save(model, checkpoint_id=tmp_path / "fp32")
    bf16 = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) else None
            for k, v in model.items()}
    bf16 = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in bf16.items()}
    dcpx.load(bf16, checkpoint_id=tmp_path / "fp32")
    for k in ("tok.weight", "layers.0.w"):
        assert_bit_equal(bf16[k], model[k].to(torch.bfloat16), k)
    assert bf16["step"] == 7

    tdcp.save({k: v for k, v in bf16.items()}, checkpoint_id=tmp_path / "export", no_dist=True)
    fp32 = {"tok.weight": torch.zeros(64, 32), "layers.0.w": torch.zeros(32, 32), "step": 0}
    dcpx.load(fp32, checkpoint_id=tmp_path / "export")
    for k in ("tok.weight", "layers.0.w"):
        assert_bit_equal(fp32[k], bf16[k].float(), k)


class _ChunkingSavePlanner(DefaultSavePlanner):
    """Saves each tensor as ``n`` chunks along ``dim`` (what several ranks'
    shards look like), in one process."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.n, self.dim = n, dim

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, t in self.state_dict.items():
            step = -(-t.shape[self.dim] // self.n)
            for start in range(0, t.shape[self.dim], step):
                offsets = [0] * t.dim()
                offsets[self.dim] = start
                sizes = list(t.shape)
                sizes[self.dim] = min(step, t.shape[self.dim] - start)
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                        properties=TensorProperties.create_from_tensor(t), size=t.size())))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        t = self.state_dict[write_item.index.fqn]
        for dim, (o, n) in enumerate(zip(write_item.index.offset,
                                         write_item.tensor_data.chunk.sizes)):
            t = t.narrow(dim, o, n)
        return t.contiguous()


class _BoxLoadPlanner(DefaultLoadPlanner):
    """Loads only the box (offsets, sizes) of tensor ``w`` into a tensor of
    the box's shape: reads narrowed from the saved chunks (a resharding
    read), through torch's planning with the storage reader under test."""

    def __init__(self, offsets, sizes) -> None:
        super().__init__()
        self.box = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata["w"]
        return LoadPlan(create_read_items_for_chunk_list("w", md, [self.box]))

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


def _sharded_checkpoint(path, dtype, n=3, dim=1):
    src = make_tensor((12, 10), dtype, torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save({"w": src}, storage_writer=tdcp.FileSystemWriter(path),
                  planner=_ChunkingSavePlanner(n, dim), no_dist=True)
    md = dcpx.FileSystemReader(path).read_metadata()
    assert len(md.state_dict_metadata["w"].chunks) == n
    return src


@pytest.mark.parametrize("saved,dest_dtype", PAIRS)
def test_sharded_checkpoint_into_another_dtype(tmp_path, saved, dest_dtype):
    """Saved chunks split along dim 1 land in non-contiguous views of the
    destination; along dim 0 in contiguous ones (dcpx's own load path)."""
    for dim in (0, 1):
        path = tmp_path / f"dim{dim}"
        _sharded_checkpoint(path, saved, n=3, dim=dim)
        expected = {"w": torch.zeros(12, 10, dtype=dest_dtype)}
        assert torch_load(expected, path) is None
        got = {"w": torch.zeros(12, 10, dtype=dest_dtype)}
        dcpx_load(got, path)
        assert_bit_equal(got["w"], expected["w"], f"chunks along dim {dim}")


@pytest.mark.parametrize("saved,dest_dtype", PAIRS)
def test_narrowed_reads_into_another_dtype(tmp_path, saved, dest_dtype):
    """A box that cuts across saved chunks: each read narrows its chunk
    (torch's planning, dcpx's reader) and casts."""
    _sharded_checkpoint(tmp_path, saved, n=3, dim=0)
    offsets, sizes = (2, 3), (7, 5)   # rows 2..8 cut chunks [0,4) [4,8) [8,12)
    expected = {"w": torch.zeros(sizes, dtype=dest_dtype)}
    assert torch_load(expected, tmp_path, _BoxLoadPlanner(offsets, sizes)) is None
    got = {"w": torch.zeros(sizes, dtype=dest_dtype)}
    dcpx_load(got, tmp_path, _BoxLoadPlanner(offsets, sizes))
    assert_bit_equal(got["w"], expected["w"])


@pytest.mark.parametrize("saved,dest_dtype", PAIRS)
def test_non_contiguous_destination_of_another_dtype(tmp_path, saved, dest_dtype):
    src = make_tensor((6, 9), saved, torch.Generator().manual_seed(9))
    dcpx.save({"w": src, "v": src[:, 0].clone()}, checkpoint_id=tmp_path)

    def dest():
        return {"w": torch.zeros(9, 6, dtype=dest_dtype).t(),           # transposed
                "v": torch.zeros(6, 2, dtype=dest_dtype)[:, 1]}         # strided
    expected, got = dest(), dest()
    assert torch_load(expected, tmp_path) is None
    dcpx_load(got, tmp_path)
    for k in expected:
        assert not got[k].is_contiguous()
        assert_bit_equal(got[k], expected[k], k)


def test_temporaries_are_bounded_and_batched(tmp_path, monkeypatch):
    """With a small budget the casting reads go in several batches (each C
    read call holds at most one budget of saved-dtype temporaries, or one
    chunk if larger); the result is the same."""
    state = {f"w{i}": make_tensor((33, 17), torch.float32, torch.Generator().manual_seed(i))
             for i in range(9)}
    dcpx.save(state, checkpoint_id=tmp_path)
    batches = []
    real = dcpx.filesystem.FileSystemReader._read_batch

    def spy(self, direct, staged):
        assert all(dcpx.storage.reader._reads_in_place(r) for r in direct)
        assert not any(dcpx.storage.reader._reads_in_place(r) for r in staged)
        batches.append(([r.key for r in direct],
                        sum(r.chunk.numel() * r.dtype.itemsize for r in staged)))
        return real(self, direct, staged)
    monkeypatch.setattr(dcpx.filesystem.FileSystemReader, "_read_batch", spy)
    monkeypatch.setattr(dcpx.storage.reader, "_TEMP_BUDGET", 3 * 33 * 17 * 4)
    got = {k: torch.zeros(33, 17, dtype=torch.bfloat16) for k in state}
    got["w0"] = torch.zeros(33, 17)  # same dtype: read in place, no temporary
    dcpx.load(got, checkpoint_id=tmp_path)
    size = 33 * 17 * 4
    assert batches == [(["w0"], 3 * size), ([], 3 * size), ([], 2 * size)]
    for k, v in state.items():
        assert_bit_equal(got[k], v if k == "w0" else v.to(torch.bfloat16), k)


def test_refused_cast_writes_nothing_and_names_the_key(tmp_path):
    """A pair torch cannot convert is refused before any byte is read, so
    the other tensors of the state dict are left as they were."""
    dcpx.save({"a": torch.ones(4), "b": torch.ones(4, dtype=torch.uint8)}, checkpoint_id=tmp_path)
    dest = {"a": torch.zeros(4), "b": torch.zeros(4, dtype=torch.uint8).view(torch.bits8)}
    with pytest.raises(TypeError, match=r"'b'.*torch\.uint8.*torch\.bits8"):
        dcpx.load(dest, checkpoint_id=tmp_path)
    assert (dest["a"] == 0).all()


def test_shape_mismatch_keeps_its_error_when_the_dtype_differs_too(tmp_path):
    dcpx.save({"w": torch.ones(3, 4)}, checkpoint_id=tmp_path)
    with pytest.raises(ValueError, match=r"Size mismatch.*w"):
        dcpx.load({"w": torch.zeros(4, 3, dtype=torch.bfloat16)}, checkpoint_id=tmp_path)


def test_torch_written_non_contiguous_record_into_another_dtype(tmp_path, monkeypatch):
    """torch's writer keeps a transposed tensor's strides in its record,
    which dcpx's C reader leaves to torch.load (the fallback read).  The cast
    must copy_ from that strided tensor, as torch does: float32 NaN becomes
    bfloat16 0x7fc0 through the strided loop but 0xffff through the
    vectorised one (a contiguous copy first gave the wrong bits)."""
    src = make_tensor((8, 5), torch.float32, torch.Generator().manual_seed(11)).t()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save({"t": src}, checkpoint_id=tmp_path, no_dist=True)
    expected = {"t": torch.zeros(5, 8, dtype=torch.bfloat16)}
    assert torch_load(expected, tmp_path) is None
    got = {"t": torch.zeros(5, 8, dtype=torch.bfloat16)}
    fallback = []
    real = dcpx.filesystem.FileSystemReader._fallback_read

    def spy(self, r):
        fallback.append(r.key)
        return real(self, r)
    monkeypatch.setattr(dcpx.filesystem.FileSystemReader, "_fallback_read", spy)
    dcpx_load(got, tmp_path)
    assert fallback == ["t"], "the record was expected to take the fallback path"
    assert_bit_equal(got["t"], expected["t"])


def test_large_tensor_cast_matches_torch(tmp_path):
    """A 4.8 MB record (read in chunks by the C reader; torch's copy_ splits
    it across its threads) of random float32 bytes: NaNs with every payload,
    denormals, values out of range for the integer dtypes."""
    src = make_tensor((1_200_000,), torch.float32, torch.Generator().manual_seed(12))
    dcpx.save({"w": src, "m": src[:60_000].reshape(300, 200).clone()}, checkpoint_id=tmp_path)
    for dtype in (torch.bfloat16, torch.float16, torch.int32, torch.uint8, torch.bool,
                  torch.float8_e4m3fn):
        def dest():
            return {"w": torch.zeros(1_200_000, dtype=dtype),
                    "m": torch.zeros(200, 300, dtype=dtype).t()}
        expected, got = dest(), dest()
        assert torch_load(expected, tmp_path) is None
        dcpx_load(got, tmp_path)
        for k in expected:
            assert_bit_equal(got[k], expected[k], f"{k} into {dtype}")
