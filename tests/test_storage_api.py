"""The storage building blocks the CLI and the checkpoint manager use
(docs/api.md, "Storage building blocks"): FileSystemReader.read_key /
read_chunk / check_storage and FileSystemWriter.write_items."""
import io
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

import dcpx
from conftest import assert_bit_equal, assert_state_bit_equal, flip_byte, locate, make_tensor
from dcpx.cli.verify import verify_checkpoint
from dcpx.errors import CorruptCheckpointError
from dcpx.filesystem import FileSystemReader, FileSystemWriter, LazyItem


def _files(path) -> list[str]:
    return sorted(os.listdir(path))


def _sharded(path, full: torch.Tensor, dim: int) -> None:
    """A checkpoint whose key ``w`` is saved as two chunks of ``full``, split
    along ``dim`` (as two ranks of a sharded save lay it out): each half is
    saved as its own key, then the metadata names both records as the
    chunks of ``w``."""
    half = full.shape[dim] // 2
    a, b = full.narrow(dim, 0, half), full.narrow(dim, half, full.shape[dim] - half)
    md = FileSystemWriter(path, sync_files=False).write_items(
        [("a", a.contiguous()), ("b", b.contiguous()), ("step", 7)])
    zero = [0] * full.dim()
    at = list(zero)
    at[dim] = half
    chunks = [ChunkStorageMetadata(offsets=torch.Size(zero), sizes=a.shape),
              ChunkStorageMetadata(offsets=torch.Size(at), sizes=b.shape)]
    props = md.state_dict_metadata["a"].properties
    sharded = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(properties=props, size=full.shape,
                                                        chunks=chunks),
                             "step": md.state_dict_metadata["step"]},
        storage_data={MetadataIndex("w", chunks[0].offsets): md.storage_data[MetadataIndex("a", zero)],
                      MetadataIndex("w", chunks[1].offsets): md.storage_data[MetadataIndex("b", zero)],
                      MetadataIndex("step"): md.storage_data[MetadataIndex("step")]},
        planner_data={"w": ("w",), "step": ("step",)}, storage_meta=md.storage_meta,
        **({"version": md.version} if hasattr(md, "version") else {}))  # torch >= 2.9
    FileSystemWriter(path, sync_files=False).commit(sharded)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16])
def test_read_key_joins_two_chunks_bit_for_bit(tmp_path, gen, dim, dtype):
    full = make_tensor((6, 10), dtype, gen)
    _sharded(tmp_path, full, dim)
    reader = FileSystemReader(tmp_path)
    md = reader.read_metadata()
    assert len(md.state_dict_metadata["w"].chunks) == 2
    # given the metadata, or set up with it
    assert_bit_equal(reader.read_key("w", md), full, "w")
    reader.set_up_storage_reader(md, True)
    got = reader.read_key("w")
    assert_bit_equal(got, full, "w")
    assert got.is_contiguous()
    assert reader.read_key("step") == 7
    # the hand-made layout is one torch reads too: the test's ground truth
    dest = {"w": torch.zeros_like(full)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tdcp.load(dest, storage_reader=tdcp.FileSystemReader(tmp_path))
    assert_bit_equal(dest["w"], full, "torch's load")


def test_read_chunk_is_the_saved_chunk(tmp_path, gen):
    full = make_tensor((4, 6), torch.float64, gen)
    _sharded(tmp_path, full, 1)
    reader = FileSystemReader(tmp_path)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    assert_bit_equal(reader.read_chunk(MetadataIndex("w", (0, 3))), full[:, 3:].contiguous())
    with pytest.raises(CorruptCheckpointError, match=r"no chunk of 'w' at offset \(1, 0\)"):
        reader.read_chunk(MetadataIndex("w", (1, 0)))


def test_read_key_refuses_chunks_that_do_not_tile(tmp_path, gen):
    full = make_tensor((4, 4), torch.float32, gen)
    _sharded(tmp_path, full, 0)
    reader = FileSystemReader(tmp_path)
    md = reader.read_metadata()
    md.state_dict_metadata["w"].chunks.pop()  # half the tensor has no chunk
    with pytest.raises(CorruptCheckpointError, match=r"key 'w' of size \(4, 4\): no chunk holds its elements at \(2, 0\)"):
        reader.read_key("w", md)
    md = reader.read_metadata()  # whole chunks again, but no storage entries
    md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn != "w"}
    with pytest.raises(CorruptCheckpointError, match=r"no storage entry for 'w' at offset"):
        reader.read_key("w", md)


def test_read_key_checks_the_given_metadata_before_reading(tmp_path, gen):
    """Metadata not set up in the reader is checked as set-up checks it: a
    data file named outside the directory is refused, never opened."""
    FileSystemWriter(tmp_path, sync_files=False).write_items([("x", torch.ones(3))])
    reader = FileSystemReader(tmp_path)
    md = reader.read_metadata()
    [index] = md.storage_data
    md.storage_data[index] = md.storage_data[index].__class__(
        "../escape.distcp", md.storage_data[index].offset, md.storage_data[index].length)
    with pytest.raises(CorruptCheckpointError, match="outside the checkpoint directory"):
        reader.read_key("x", md)


def test_check_storage_lists_every_problem(tmp_path, gen):
    """A truncated file and a missing one, both listed (set-up stops at the
    first); a flipped byte is no storage problem, reading finds it; verify
    reports all three."""
    state = {k: make_tensor((64,), torch.float32, gen) for k in "abcd"}
    md = FileSystemWriter(tmp_path, sync_files=False).write_items(
        state.items(), file_bytes=1)  # one file per tensor
    files = {i.fqn: tmp_path / info.relative_path for i, info in md.storage_data.items()}
    assert len(set(files.values())) == 4
    with open(files["a"], "r+b") as f:
        f.truncate(os.path.getsize(files["a"]) - 10)
    os.unlink(files["b"])
    file, offset, _ = locate(tmp_path, md, "c")
    flip_byte(file, offset + 5)

    reader = FileSystemReader(tmp_path)
    md = reader.read_metadata()
    problems = reader.check_storage(md)
    assert [i.fqn for i, _ in problems] == ["a", "b"]
    assert all(isinstance(e, CorruptCheckpointError) for _, e in problems)
    assert "truncated?" in str(problems[0][1]) and "'a'" in str(problems[0][1])
    assert "is missing (needed by key 'b')" in str(problems[1][1])
    with pytest.raises(CorruptCheckpointError, match="truncated"):  # the first
        reader.set_up_storage_reader(md, True)

    good = Metadata(state_dict_metadata=md.state_dict_metadata,
                    storage_data={i: v for i, v in md.storage_data.items() if i.fqn in "cd"})
    assert reader.check_storage(good) == []
    reader.set_up_storage_reader(good, True)
    with pytest.raises(CorruptCheckpointError, match="'c'"):
        reader.read_chunk(MetadataIndex("c", (0,)))
    assert_bit_equal(reader.read_key("d"), state["d"])

    out = io.StringIO()
    assert verify_checkpoint(str(tmp_path), out=out) == 3
    bad = [line for line in out.getvalue().splitlines() if line.startswith("  BAD")]
    assert [line.split(":")[0] for line in bad] == ["  BAD a", "  BAD b", "  BAD c"]


def test_write_items_round_trip(tmp_path, gen):
    """Tensors of several dtypes, a lazy one, other values; files of bounded
    size; loads bit for bit with dcpx and with torch."""
    state = {"model.w": make_tensor((300, 7), torch.float32, gen),
             "h": make_tensor((1000,), torch.bfloat16, gen),
             "i": make_tensor((3, 4, 5), torch.int64, gen),
             "empty": torch.empty(0, 3),
             "meta": {"lr": 0.1, "names": ["x", "y"]},
             "step": 12}
    reads, written = [], []

    def lazy(k):
        def read():
            reads.append(k)
            return state[k]
        return LazyItem(state[k].numel() * state[k].element_size(), read)

    items = [(k, lazy(k) if k == "h" else v) for k, v in state.items()]
    md = FileSystemWriter(tmp_path, sync_files=False).write_items(
        items, file_bytes=8000, planner_data={"model.w": ("model", "w")},
        written=lambda k, v: written.append(k))
    assert reads == ["h"] and sorted(written) == sorted(state)
    assert md.planner_data["model.w"] == ("model", "w") and md.planner_data["step"] == ("step",)
    assert len({i.relative_path for i in md.storage_data.values()}) >= 2  # 8 KB files
    assert (tmp_path / ".metadata").is_file()
    assert not [n for n in _files(tmp_path) if n.endswith(".lock") or ".tmp" in n]

    flat = {k: v for k, v in state.items()}
    flat["model"] = {"w": flat.pop("model.w")}
    got = {"model": {"w": torch.zeros(300, 7)}, "h": torch.zeros(1000, dtype=torch.bfloat16),
           "i": torch.zeros(3, 4, 5, dtype=torch.int64), "empty": torch.zeros(0, 3),
           "meta": None, "step": 0}
    dcpx.load(got, checkpoint_id=tmp_path)
    assert_state_bit_equal(got, flat)
    theirs = {"model": {"w": torch.zeros(300, 7)}, "h": torch.zeros(1000, dtype=torch.bfloat16),
              "i": torch.zeros(3, 4, 5, dtype=torch.int64), "empty": torch.zeros(0, 3),
              "meta": None, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tdcp.load(theirs, storage_reader=tdcp.FileSystemReader(tmp_path))
    assert_state_bit_equal(theirs, flat)


def test_write_items_reads_a_lazy_item_after_the_full_file_is_written(tmp_path):
    """The file that a LazyItem would overflow is written (and handed to
    ``written``) before the item is read: one file's values in memory."""
    events = []

    def lazy(k, n):
        def read():
            events.append(("read", k))
            return torch.zeros(n, dtype=torch.uint8)
        return LazyItem(n, read)

    FileSystemWriter(tmp_path, sync_files=False).write_items(
        [("a", lazy("a", 600)), ("b", lazy("b", 300)), ("c", lazy("c", 600))],
        file_bytes=1000, written=lambda k, v: events.append(("written", k)))
    assert events == [("read", "a"), ("read", "b"), ("written", "a"), ("written", "b"),
                      ("read", "c"), ("written", "c")]


def test_write_items_failure_leaves_no_files_and_no_lock(tmp_path):
    def items():
        yield "a", torch.ones(1000)
        yield "b", torch.ones(1000)

        def boom():
            raise RuntimeError("source failed")
        yield "c", LazyItem(4000, boom)

    with pytest.raises(RuntimeError, match="source failed"):
        FileSystemWriter(tmp_path, sync_files=False).write_items(items(), file_bytes=4000)
    assert _files(tmp_path) == []
    with pytest.raises(ValueError, match="key 'a' is given twice"):
        FileSystemWriter(tmp_path, sync_files=False).write_items(
            [("a", torch.ones(1)), ("a", torch.ones(1))])
    assert _files(tmp_path) == []


def test_write_items_refuses_overwrite_false(tmp_path):
    FileSystemWriter(tmp_path, sync_files=False).write_items([("a", torch.ones(2))])
    with pytest.raises(RuntimeError, match="already exists"):
        FileSystemWriter(tmp_path, sync_files=False, overwrite=False).write_items(
            [("a", torch.zeros(2))])
    got = {"a": torch.zeros(2)}
    dcpx.load(got, checkpoint_id=tmp_path)
    assert torch.equal(got["a"], torch.ones(2))


def test_user_facing_layers_use_no_private_helpers_below():
    """The CLI and the checkpoint manager (and its tiers) import no private name of the
    layers below and call no private method of the storage classes
    (STYLE.md, "The package as it grows").  The layers' modules (dcpx.api,
    dcpx.storage, ...) have public names; their private ones stay theirs."""
    import ast
    import pathlib
    root = pathlib.Path(dcpx.__file__).parent
    private_methods = {n for cls in (FileSystemReader, FileSystemWriter) for n in vars(cls)
                       if n.startswith("_") and not n.startswith("__")}
    found = []
    for path in [*sorted((root / "cli").glob("*.py")), *sorted((root / "manager").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = (node.module or "").split(".")
                below = node.level == 2  # dcpx's own modules, from cli/ or manager/
                if below and parts[0].startswith("_"):
                    found.append(f"{path.name}: from {node.module}")
                found += [f"{path.name}: {a.name} from {node.module}" for a in node.names
                          if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr in private_methods:
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert found == []
