"""What torch's own DCP tests expect of save / load (issue 23, item 5):
each case passes with dcpx as with torch (its ``test/distributed/checkpoint``
files, run with dcpx's save / load patched in: scripts/torch_dcp_tests.sh).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpx

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
]


# --------------------------------------------------------------------------
# 1. a DTensor on a sub-mesh: ranks outside its mesh hold nothing of it

def _submesh_state(rank: int, scale: float) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    full = DeviceMesh("cpu", [0, 1])
    sub = DeviceMesh("cpu", [0])  # rank 1 is outside it
    return {
        "sdt": distribute_tensor(torch.arange(4.0) * scale, full, [Shard(0)]),
        "submesh_sdt": distribute_tensor(torch.arange(8.0, 14.0) * scale, sub, [Shard(0)]),
        "submesh_rdt": distribute_tensor(torch.arange(20.0, 24.0) * scale, sub, [Replicate()]),
        "x": torch.full((3,), 7.0 * scale),
    }


def _submesh_job(rank: int, world: int, d: str, saver: str, loader: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import dcpx
    save = dcpx.save if saver == "dcpx" else dcp.save
    load = dcpx.load if loader == "dcpx" else dcp.load
    save(_submesh_state(rank, 1.0), checkpoint_id=d)
    dest = _submesh_state(rank, 10.0)
    load(dest, checkpoint_id=d)
    return {k: v.to_local().clone() if hasattr(v, "to_local") else v.clone()
            for k, v in dest.items()}


@pytest.mark.dist
@pytest.mark.parametrize("saver,loader", [("dcpx", "dcpx"), ("dcpx", "torch"),
                                          ("torch", "dcpx")])
def test_dtensor_on_a_submesh_saves_and_loads(tmp_path, saver, loader):
    """torch_dcp: test_dtensor_checkpoint.  On main dcpx's save reported
    success and wrote a chunk with empty offsets for rank 1 (outside the
    sub-mesh): dcpx's load said CorruptCheckpointError, torch's IndexError."""
    from dist_helpers import spawn
    d = str(tmp_path / "ckpt")
    out = spawn(_submesh_job, 2, d, saver, loader)
    assert torch.equal(out[0]["submesh_sdt"], torch.arange(8.0, 14.0))
    assert torch.equal(out[0]["submesh_rdt"], torch.arange(20.0, 24.0))
    assert out[1]["submesh_sdt"].numel() == 0 and out[1]["submesh_rdt"].numel() == 0
    for r in (0, 1):
        assert torch.equal(out[r]["sdt"], torch.arange(2.0) + 2 * r)
        assert torch.equal(out[r]["x"], torch.full((3,), 7.0))
    md = dcp.FileSystemReader(d).read_metadata()
    for key in ("submesh_sdt", "submesh_rdt"):
        chunks = md.state_dict_metadata[key].chunks
        assert all(len(c.offsets) == 1 for c in chunks), chunks


# --------------------------------------------------------------------------
# 2. io.BytesIO values (torch's own tests store raw bytes so)

@pytest.mark.parametrize("saver,loader", [("dcpx", "dcpx"), ("torch", "dcpx"),
                                          ("dcpx", "torch")])
def test_bytesio_values_round_trip(tmp_path, saver, loader):
    """torch_dcp: test_e2e_save_and_load (DDP).  torch writes an io.BytesIO
    value as a torch.save of it and unpickles it on load; on main dcpx
    refused every such value (UnsafeCheckpointError ... _io.BytesIO)."""
    import io
    save = dcpx.save if saver == "dcpx" else dcp.save
    load = dcpx.load if loader == "dcpx" else dcp.load
    buf = io.BytesIO(b"\x00raw bytes\xff" * 100)
    buf.seek(5)
    save({"buf": buf, "empty": io.BytesIO(), "nested": {"b": io.BytesIO(b"xy")},
          "t": torch.arange(3)}, checkpoint_id=tmp_path)
    dest = {"buf": None, "empty": None, "nested": {"b": None}, "t": torch.zeros(3, dtype=torch.int64)}
    load(dest, checkpoint_id=tmp_path)
    for v in (dest["buf"], dest["empty"], dest["nested"]["b"]):
        assert type(v) is io.BytesIO
    assert dest["buf"].getvalue() == b"\x00raw bytes\xff" * 100 and dest["buf"].tell() == 5
    assert dest["empty"].getvalue() == b""
    assert dest["nested"]["b"].getvalue() == b"xy"
    assert torch.equal(dest["t"], torch.arange(3))


def test_bytesio_with_attributes_is_refused(tmp_path):
    """A BytesIO's pickled state may carry a __dict__, which would shadow
    its methods (getvalue) with what the checkpoint holds: refused."""
    import io
    buf = io.BytesIO(b"abc")
    buf.getvalue = 5  # shadows the method
    dcp.save({"buf": buf}, checkpoint_id=tmp_path)
    with pytest.raises(dcpx.CorruptCheckpointError, match="io.BytesIO"):
        dcpx.load({"buf": None}, checkpoint_id=tmp_path)


def test_bytesio_inside_a_list_stays_a_bytesio_and_saves_again(tmp_path):
    import io
    dcp.save({"l": [io.BytesIO(b"q"), 1]}, checkpoint_id=tmp_path / "a")
    dest = {"l": None}
    dcpx.load(dest, checkpoint_id=tmp_path / "a")
    assert isinstance(dest["l"][0], io.BytesIO) and dest["l"][0].getvalue() == b"q"
    dcpx.save(dest, checkpoint_id=tmp_path / "b")  # pickles as a plain io.BytesIO
    again = {"l": None}
    dcp.load(again, checkpoint_id=tmp_path / "b")
    assert type(again["l"][0]) is io.BytesIO and again["l"][0].getvalue() == b"q"


# --------------------------------------------------------------------------
# 3. load sets values through the state dict's own __setitem__

class _RecordingDict(dict):
    def __init__(self) -> None:
        super().__init__()
        self.set_called = False

    def __setitem__(self, key, value) -> None:
        self.set_called = True
        super().__setitem__(key, value)


class _Foo:
    def __init__(self) -> None:
        self.loaded = False

    def state_dict(self):
        return {}

    def load_state_dict(self, sd) -> None:
        self.loaded = True


@pytest.mark.parametrize("which", ["dcpx", "torch"])
def test_load_sets_values_through_the_state_dicts_setitem(tmp_path, which):
    """torch_dcp: test_stateful_and_non_stateful_loads.  On main dcpx's load
    updated a dict subclass with dict.update, around its __setitem__."""
    save, load = (dcpx.save, dcpx.load) if which == "dcpx" else (dcp.save, dcp.load)
    foo = _Foo()
    sd = _RecordingDict()
    sd["foo"] = foo
    sd.set_called = False
    save(sd, checkpoint_id=tmp_path / "a")
    load(sd, checkpoint_id=tmp_path / "a")
    assert foo.loaded and sd["foo"] is foo  # a Stateful is loaded in place
    assert not sd.set_called

    sd = _RecordingDict()
    sd["foo"] = {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]}
    sd.set_called = False
    save(sd, checkpoint_id=tmp_path / "b")
    load(sd, checkpoint_id=tmp_path / "b")
    assert sd.set_called


@pytest.mark.parametrize("saver,loader", [("dcpx", "dcpx"), ("torch", "dcpx"),
                                          ("dcpx", "torch")])
def test_userdict_state_dict(tmp_path, saver, loader):
    """torch's save and load take a collections.UserDict; on main dcpx's
    raised TypeError."""
    import collections
    save = dcpx.save if saver == "dcpx" else dcp.save
    load = dcpx.load if loader == "dcpx" else dcp.load
    save(collections.UserDict({"a": torch.arange(4.0), "n": 3, "d": {"x": torch.ones(2)}}),
         checkpoint_id=tmp_path)
    dest = collections.UserDict({"a": torch.zeros(4), "n": 0, "d": {"x": torch.zeros(2)}})
    load(dest, checkpoint_id=tmp_path)
    assert torch.equal(dest["a"], torch.arange(4.0)) and dest["n"] == 3
    assert torch.equal(dest["d"]["x"], torch.ones(2))


def test_userdict_async_save(tmp_path):
    import collections
    dcpx.async_save(collections.UserDict({"a": torch.arange(4.0)}),
                    checkpoint_id=tmp_path).result(timeout=120)
    dest = {"a": torch.zeros(4)}
    dcpx.load(dest, checkpoint_id=tmp_path)
    assert torch.equal(dest["a"], torch.arange(4.0))


def test_save_and_load_still_refuse_what_is_no_mapping(tmp_path):
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        dcpx.save([torch.ones(1)], checkpoint_id=tmp_path)
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        dcpx.load([torch.ones(1)], checkpoint_id=tmp_path)


# --------------------------------------------------------------------------
# 4. a DefaultLoadPlanner / DefaultSavePlanner passed in is set up as torch does

@pytest.mark.parametrize("which", ["dcpx", "torch"])
def test_default_planners_passed_in_are_set_up(tmp_path, which):
    """torch_dcp: test_version_key_in_planner_data (planner.metadata after a
    load); on main dcpx's fast paths left the planners untouched."""
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        DefaultSavePlanner,
    )
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan
    save, load = (dcpx.save, dcpx.load) if which == "dcpx" else (dcp.save, dcp.load)
    module = torch.nn.Linear(2, 2)
    sp = DefaultSavePlanner()
    md = save({"module": module, "step": 3}, checkpoint_id=tmp_path, planner=sp)
    assert sp.is_coordinator is True
    assert sorted(sp.state_dict) == ["module.bias", "module.weight", "step"]
    assert sp.mappings["module.weight"] == ("module", "weight")
    assert isinstance(sp.plan, SavePlan) and isinstance(sp.global_plan, list)
    assert len(sp.global_plan) == 1 and sp.plan.items == sp.global_plan[0].items
    assert sorted(i.index.fqn for i in sp.plan.items) == ["module.bias", "module.weight", "step"]
    assert isinstance(sp.metadata, Metadata)
    assert sorted(sp.metadata.state_dict_metadata) == sorted(md.state_dict_metadata)

    lp = DefaultLoadPlanner()
    new = torch.nn.Linear(2, 2)
    dest = {"module": new, "step": 0}
    load(dest, checkpoint_id=tmp_path, planner=lp)
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    assert lp.metadata.version == CURRENT_DCP_VERSION
    assert lp.is_coordinator is True
    assert sorted(lp.state_dict) == ["module.bias", "module.weight", "step"]
    assert lp.mappings["module.bias"] == ("module", "bias")
    assert lp.original_state_dict["step"] == 3
    assert torch.equal(new.weight, module.weight) and dest["step"] == 3


# --------------------------------------------------------------------------
# 5. the deprecated positional forms save(sd, writer) / load(sd, reader)

@pytest.mark.parametrize("which", ["dcpx", "torch"])
def test_positional_writer_and_reader_warn_and_work(tmp_path, which):
    """torch warns that the argument order changed and goes on; on main
    dcpx raised TypeError (keyword-only arguments)."""
    mod = dcpx if which == "dcpx" else dcp
    with pytest.warns(UserWarning, match="The argument order of save has been changed"):
        mod.save({"a": torch.arange(3.0)}, mod.FileSystemWriter(tmp_path))
    dest = {"a": torch.zeros(3)}
    with pytest.warns(UserWarning, match="The argument order of load has been changed"):
        mod.load(dest, mod.FileSystemReader(tmp_path))
    assert torch.equal(dest["a"], torch.arange(3.0))
    with pytest.raises(AssertionError, match="storage_writer in kwargs"):
        with pytest.warns(UserWarning):
            mod.save({"a": torch.ones(1)}, mod.FileSystemWriter(tmp_path),
                     storage_writer=mod.FileSystemWriter(tmp_path))


def test_signatures_stay_torchs():
    import inspect

    def shape(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]
    assert shape(dcpx.save) == shape(dcp.save)
    assert shape(dcpx.load) == shape(dcp.load)


# --------------------------------------------------------------------------
# 6. metadata naming the sharded tensor module's TensorProperties (older torch)

def _rewrite_with_sharded_tensor_properties(path) -> None:
    """Rewrite a torch-written .metadata as older torch wrote it: each
    tensor's properties an instance of
    torch.distributed._shard.sharded_tensor.metadata.TensorProperties."""
    import pickle

    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as OldTP
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    for v in md.state_dict_metadata.values():
        if isinstance(v, TensorStorageMetadata):
            p = v.properties
            v.properties = OldTP(dtype=p.dtype, layout=p.layout, requires_grad=p.requires_grad,
                                 memory_format=p.memory_format, pin_memory=p.pin_memory)
    data = pickle.dumps(md)
    assert b"torch.distributed._shard.sharded_tensor.metadata" in data
    with open(path / ".metadata", "wb") as f:
        f.write(data)


def test_metadata_with_sharded_tensor_tensor_properties_loads(tmp_path):
    """On main dcpx refused it as unsafe (UnsafeCheckpointError); torch
    loads it."""
    sd = {"w": torch.arange(6.0).reshape(2, 3), "i": torch.arange(4, dtype=torch.int32),
          "n": 5}
    dcp.save(sd, checkpoint_id=tmp_path)
    _rewrite_with_sharded_tensor_properties(tmp_path)
    for load in (dcp.load, dcpx.load):
        dest = {"w": torch.zeros(2, 3), "i": torch.zeros(4, dtype=torch.int32), "n": 0}
        load(dest, checkpoint_id=tmp_path)
        assert torch.equal(dest["w"], sd["w"]) and torch.equal(dest["i"], sd["i"])
        assert dest["n"] == 5
    md = dcpx.FileSystemReader(tmp_path).read_metadata()
    assert md.state_dict_metadata["i"].properties.dtype == torch.int32


def test_sharded_tensor_tensor_properties_is_no_way_around_the_allow_list(tmp_path):
    """Only that class and its enum are allowed from that module."""
    import pickle
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path)
    _rewrite_with_sharded_tensor_properties(tmp_path)
    # a pickle naming another global of that module is refused
    forged = pickle.dumps(__import__("torch.distributed._shard.sharded_tensor.metadata",
                                     fromlist=["ShardedTensorMetadata"]).ShardedTensorMetadata())
    (tmp_path / ".metadata").write_bytes(forged)
    with pytest.raises(dcpx.UnsafeCheckpointError, match="ShardedTensorMetadata"):
        dcpx.FileSystemReader(tmp_path).read_metadata()


# --------------------------------------------------------------------------
# 7. an unknown URL protocol

@pytest.mark.parametrize("op", ["save", "load", "async_save"])
def test_unknown_url_protocol_raises_runtime_error_as_torch(tmp_path, op):
    """torch raises RuntimeError ("Cannot detect which StorageReader or
    StorageWriter to use"); on main dcpx raised ValueError."""
    pytest.importorskip("fsspec")
    url = "bogusproto://bucket/ckpt"
    sd = {"a": torch.ones(1)}
    if op != "async_save":
        with pytest.raises(RuntimeError, match="Cannot detect which StorageReader"):
            getattr(dcp, op)(dict(sd), checkpoint_id=url)
    with pytest.raises(RuntimeError, match="bogusproto") as info:
        fn = getattr(dcpx, op)
        r = fn(dict(sd), checkpoint_id=url)
        r.result(timeout=60)
    assert isinstance(info.value, ValueError)  # what dcpx raised before
    assert "Cannot detect which StorageReader or StorageWriter" in str(info.value)
