"""Bad input and bad checkpoints get clear errors.

Every error names what is wrong and where: the state-dict key, the data
file, the checkpoint path.  Bad input to ``save`` is refused before anything
is written.  A damaged checkpoint raises ``dcpx.CorruptCheckpointError``
instead of loading wrong values, and a crafted one raises
``dcpx.UnsafeCheckpointError`` instead of running code.
"""
import dataclasses
import os
import pickle
import shutil

import pytest
import torch

import dcpx
from conftest import (
    assert_state_bit_equal,
    data_files,
    empty_like_state,
    flip_byte,
    locate,
    make_tensor,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*quantize.*deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
]


def nothing_written(path) -> bool:
    return not os.path.isdir(path) or (data_files(path) == []
                                      and not os.path.exists(os.path.join(path, ".metadata")))


# --------------------------------------------------------------------------
# bad input to save / load

@pytest.mark.parametrize("bad", [[torch.ones(1)], (torch.ones(1),), torch.ones(1), None, "sd"],
                         ids=["list", "tuple", "tensor", "None", "str"])
@pytest.mark.parametrize("op", ["save", "load"])
def test_state_dict_must_be_a_dict(op, bad, ckpt):
    with pytest.raises(TypeError, match="must be a dict"):
        getattr(dcpx, op)(bad, checkpoint_id=ckpt)
    assert nothing_written(ckpt)


def test_checkpoint_id_or_storage_is_required():
    with pytest.raises(RuntimeError, match="checkpoint_id"):
        dcpx.save({"a": torch.ones(1)})
    with pytest.raises(RuntimeError, match="checkpoint_id"):
        dcpx.load({"a": torch.ones(1)})


def _quantized():
    return torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)


@pytest.mark.parametrize("make,exc,words", [
    (lambda: torch.randn(4, 4).to_sparse(), TypeError, "sparse_coo"),
    (lambda: torch.randn(4, 4).to_sparse_csr(), TypeError, "sparse_csr"),
    (lambda: torch.empty(3, 3, device="meta"), ValueError, "meta"),
    (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
     TypeError, "nested"),
    (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)],
                                        layout=torch.jagged),
     TypeError, "nested"),
    (_quantized, TypeError, "quantized"),
    (lambda: torch.zeros(4, dtype=torch.uint3), TypeError, "uint3"),
], ids=["sparse-coo", "sparse-csr", "meta", "nested", "nested-jagged", "quantized",
        "sub-byte-dtype"])
def test_unsupported_tensors_are_refused_naming_the_key(make, exc, words, ckpt):
    state = {"ok": torch.ones(100), "model": {"odd": make()}, "after": torch.ones(3)}
    with pytest.raises(exc, match=rf"'model\.odd'.*{words}"):
        dcpx.save(state, checkpoint_id=ckpt)
    assert nothing_written(ckpt)


# --------------------------------------------------------------------------
# damaged checkpoints

@pytest.fixture
def saved(tmp_path, gen):
    """A checkpoint with a small tensor (read whole), a large one (read in
    chunks) and a non-tensor value; returns (path, state, metadata)."""
    path = str(tmp_path / "ckpt")
    state = {"small": make_tensor((100,), torch.float32, gen),
             "large": make_tensor((600_000,), torch.float32, gen),  # 2.4 MB
             "cfg": {"name": "hello world", "ids": [1, 2, 3]}}
    md = dcpx.save(state, checkpoint_id=path)
    return path, state, md


@pytest.mark.parametrize("key", ["small", "large"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_bit_in_tensor_data(saved, key, where):
    path, state, md = saved
    file, off, length = locate(path, md, key)
    flip_byte(file, off + {"first": 0, "middle": length // 2, "last": length - 1}[where])
    with pytest.raises(dcpx.CorruptCheckpointError) as ei:
        dcpx.load(empty_like_state(state), checkpoint_id=path)
    msg = str(ei.value)
    assert file in msg and f"'{key}'" in msg and "CRC" in msg
    # the check is what catches it: unverified, the flipped value loads
    dest = empty_like_state(state)
    dcpx.load(dest, storage_reader=dcpx.FileSystemReader(path, verify=False))
    assert not torch.equal(dest[key].view(torch.int32), state[key].view(torch.int32))


def test_flipped_bit_in_tensor_pickle(saved):
    path, state, md = saved
    file, off, length = locate(path, md, "small", "/data.pkl")
    flip_byte(file, off + length // 2, 0x01)
    with pytest.raises(dcpx.CorruptCheckpointError) as ei:
        dcpx.load({"small": torch.zeros(100)}, checkpoint_id=path)
    assert file in str(ei.value) and "'small'" in str(ei.value)


def test_flipped_bit_in_a_non_tensor_value(saved):
    path, state, md = saved
    file, off, length = locate(path, md, "cfg.name", "/data.pkl")
    with open(file, "rb") as f:
        f.seek(off)
        at = f.read(length).index(b"hello world")
    flip_byte(file, off + at, 0x02)  # 'hello' -> 'jello'
    with pytest.raises(dcpx.CorruptCheckpointError) as ei:
        dcpx.load({"cfg": {"name": None, "ids": None}}, checkpoint_id=path)
    assert file in str(ei.value) and "'cfg.name'" in str(ei.value)


@pytest.mark.parametrize("where", ["start", "middle", "trailer-crc"])
def test_flipped_bit_in_metadata(saved, where):
    path, state, _ = saved
    meta = os.path.join(path, ".metadata")
    size = os.path.getsize(meta)
    # the dcpx trailer is the last 20 bytes: 8 magic, 4 CRC, 8 length
    flip_byte(meta, {"start": 2, "middle": size // 2, "trailer-crc": size - 12}[where], 0x01)
    with pytest.raises(dcpx.CorruptCheckpointError) as ei:
        dcpx.load(empty_like_state(state), checkpoint_id=path)
    assert meta in str(ei.value)


@pytest.mark.parametrize("content", [b"", b"garbage", pickle.dumps({"not": "metadata"})],
                         ids=["empty", "garbage", "wrong-object"])
def test_metadata_that_is_not_metadata(saved, content):
    path, state, _ = saved
    meta = os.path.join(path, ".metadata")
    with open(meta, "wb") as f:
        f.write(content)
    with pytest.raises(dcpx.CorruptCheckpointError) as ei:
        dcpx.load(empty_like_state(state), checkpoint_id=path)
    assert meta in str(ei.value)


@pytest.mark.parametrize("cut", [1, 100, 2_000_000])
def test_truncated_data_file(saved, cut):
    path, state, _ = saved
    [name] = data_files(path)
    file = os.path.join(path, name)
    os.truncate(file, os.path.getsize(file) - cut)
    with pytest.raises(dcpx.CorruptCheckpointError) as ei:
        dcpx.load(empty_like_state(state), checkpoint_id=path)
    assert file in str(ei.value) and "truncated" in str(ei.value)


def test_deleted_data_file(saved):
    path, state, _ = saved
    [name] = data_files(path)
    os.unlink(os.path.join(path, name))
    with pytest.raises(dcpx.CorruptCheckpointError) as ei:
        dcpx.load(empty_like_state(state), checkpoint_id=path)
    assert name in str(ei.value) and "missing" in str(ei.value)


# --------------------------------------------------------------------------
# crafted checkpoints

class RunsShell:
    """Unpickling this runs a shell command."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("with_trailer", [False, True], ids=["torch-style", "valid-dcpx-trailer"])
def test_metadata_pickle_that_runs_code_is_refused(saved, with_trailer):
    path, state, _ = saved
    witness = os.path.join(path, "pwned")
    body = pickle.dumps(RunsShell(f"echo pwned > {witness}"))
    if with_trailer:  # a correct checksum does not make it trusted
        from dcpx.formats import metadata as _metadata
        body += _metadata._TRAILER.pack(_metadata._TRAILER_MAGIC, dcpx._C.crc32(body), len(body))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(body)
    with pytest.raises(dcpx.UnsafeCheckpointError, match="system"):
        dcpx.load(empty_like_state(state), checkpoint_id=path)
    with pytest.raises(dcpx.UnsafeCheckpointError):
        dcpx.FileSystemReader(path).read_metadata()
    assert not os.path.exists(witness)


@pytest.mark.parametrize("rel", ["../outside.distcp", "ABSOLUTE", "sub/dir.distcp", "..", ""])
def test_metadata_pointing_outside_the_directory_is_refused(saved, rel, tmp_path):
    path, state, md = saved
    # a perfectly valid data file outside the checkpoint: must still not be read
    outside = tmp_path / "outside.distcp"
    shutil.copy(os.path.join(path, data_files(path)[0]), outside)
    if rel == "ABSOLUTE":
        rel = str(outside)
    evil = dataclasses.replace(md, storage_data={
        k: dataclasses.replace(v, relative_path=rel) for k, v in md.storage_data.items()})
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(evil, f)
    with pytest.raises(dcpx.CorruptCheckpointError, match="outside the checkpoint directory"):
        dcpx.load(empty_like_state(state), checkpoint_id=path)


class Opaque:
    """A value only a full unpickler can rebuild (not on weights_only's
    allow-list)."""

    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.v == self.v


def test_non_tensor_value_that_runs_code_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    witness = str(tmp_path / "pwned")
    dcpx.save({"w": torch.ones(2), "hook": RunsShell(f"echo pwned > {witness}")},
              checkpoint_id=path)
    assert not os.path.exists(witness)  # saving does not run it either

    dest = {"w": torch.zeros(2), "hook": None}
    with pytest.raises(dcpx.UnsafeCheckpointError) as ei:
        dcpx.load(dest, checkpoint_id=path)
    assert "'hook'" in str(ei.value) and "allow_pickle=True" in str(ei.value)
    assert not os.path.exists(witness)
    assert dest["hook"] is None

    # The refusal is real: trusting the checkpoint runs the command.
    dcpx.load(dest, storage_reader=dcpx.FileSystemReader(path, allow_pickle=True))
    assert os.path.exists(witness)


def test_custom_objects_need_allow_pickle(tmp_path):
    path = str(tmp_path / "ckpt")
    dcpx.save({"obj": Opaque([1, 2]), "n": 3}, checkpoint_id=path)
    dest = {"obj": None, "n": 0}
    with pytest.raises(dcpx.UnsafeCheckpointError, match="'obj'"):
        dcpx.load(dest, checkpoint_id=path)
    dcpx.load(dest, storage_reader=dcpx.FileSystemReader(path, allow_pickle=True))
    assert_state_bit_equal(dest, {"obj": Opaque([1, 2]), "n": 3})


def test_plain_values_load_without_allow_pickle(tmp_path):
    """weights_only covers what state dicts normally hold."""
    path = str(tmp_path / "ckpt")
    state = {"n": 3, "f": 0.5, "s": "text", "l": [1, 2], "t": (1, "a"), "none": None,
             "d": {"lr": 0.1}, "b": True, "by": b"raw", "od": {"x": [1.5, 2.5]}}
    dcpx.save(state, checkpoint_id=path)
    dest = empty_like_state(state)
    dcpx.load(dest, checkpoint_id=path)
    assert_state_bit_equal(dest, state)


def test_unpicklable_value_names_the_key_and_writes_nothing(tmp_path):
    ck = tmp_path / "ck"
    with pytest.raises(TypeError, match="'cfg.fn'.*does not pickle"):
        dcpx.save({"w": torch.ones(2), "cfg": {"fn": lambda x: x}}, checkpoint_id=ck)
    assert not any(ck.iterdir())


def test_failure_after_the_writers_started_removes_their_files(tmp_path, monkeypatch):
    """An error while the metadata is encoded (the C threads are already
    writing) cancels them and leaves no data file behind."""
    ck = tmp_path / "ck"

    def boom(self, metadata):
        raise RuntimeError("encode failed")

    monkeypatch.setattr(dcpx.FileSystemWriter, "encode_metadata", boom)
    with pytest.raises(RuntimeError, match="encode failed"):
        dcpx.save({"w": torch.ones(1 << 22)}, checkpoint_id=ck)
    assert list(ck.iterdir()) == []


@pytest.mark.parametrize("body,words", [
    (b"\x80\x04r\xff\xff\xff\xffN.", "memo index"),     # LONG_BINPUT 2**32-1: a huge memo
    (b"\x80\x04X\xff\xff\xff\x7fab.", "past the end"),   # length beyond the data
    (b"\x80\x02\x82\x01.", "extension"),                 # EXT1: copyreg registry
    (b"\x80\x02K\x01Q.", "persistent"),                  # BINPERSID
    (b"\x80\x04N", "no STOP"),
])
def test_metadata_pickle_is_scanned_before_unpickling(tmp_path, body, words):
    """Opcode-level attacks on .metadata are refused before CPython's
    unpickler runs (found by fuzz/fuzz_metadata.py: the first one makes the
    unpickler allocate a memo table of tens of GiB)."""
    ck = tmp_path / "ck"
    dcpx.save({"w": torch.ones(2)}, checkpoint_id=ck)
    (ck / ".metadata").write_bytes(body)
    with pytest.raises(dcpx.CorruptCheckpointError, match=words):
        dcpx.load({"w": torch.zeros(2)}, checkpoint_id=ck)


def test_metadata_objects_without_their_fields_are_refused(tmp_path):
    """NEWOBJ of an allowed class with no BUILD: a Metadata with no fields."""
    import pickle
    from torch.distributed.checkpoint.metadata import Metadata
    ck = tmp_path / "ck"
    dcpx.save({"w": torch.ones(2)}, checkpoint_id=ck)
    (ck / ".metadata").write_bytes(
        b"\x80\x04\x8c%torch.distributed.checkpoint.metadata\x94\x8c\x08Metadata\x94\x93)\x81.")
    assert isinstance(pickle.loads((ck / ".metadata").read_bytes()), Metadata)
    with pytest.raises(dcpx.CorruptCheckpointError, match="malformed"):
        dcpx.load({"w": torch.zeros(2)}, checkpoint_id=ck)
