"""What changes with the installed torch version (dcpx/_torchcompat.py).

* torch 2.14's CheckpointableTensor: a plain tensor carrying
  ``global_shape`` / ``global_offsets`` / ``local_offsets`` /
  ``local_sizes`` is saved as shards of the global tensor and loaded into
  its shard; dcpx (save, load, async_save with its stager) writes the same
  metadata and bytes as torch and loads what torch wrote.  Skipped on torch
  without the protocol (2.13 and older), where such attributes mean nothing.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from dcpx import _torchcompat

from conftest import assert_bit_equal

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

needs_protocol = pytest.mark.skipif(
    not _torchcompat.HAS_CHECKPOINTABLE_TENSOR,
    reason=f"torch {torch.__version__} has no CheckpointableTensor (torch >= 2.14)")


def shard(data: torch.Tensor, global_shape, global_offsets, local_offsets, local_sizes):
    data.global_shape = tuple(global_shape)
    data.global_offsets = tuple(map(tuple, global_offsets))
    data.local_offsets = tuple(map(tuple, local_offsets))
    data.local_sizes = tuple(map(tuple, local_sizes))
    return data


def result(saved):
    """Wait for an async_save (a Future, or an AsyncSaveResponse)."""
    return getattr(saved, "upload_completion", saved).result()


def two_shards():
    """A (2, 3) local buffer holding rows 1 and 4 of a (6, 3) tensor."""
    return shard(torch.arange(6, dtype=torch.float32).reshape(2, 3) + 0.5, (6, 3),
                 [(1, 0), (4, 0)], [(0, 0), (1, 0)], [(1, 3), (1, 3)])


def test_no_protocol_means_no_checkpointable_tensors():
    t = torch.zeros(2)
    t.global_offsets = ((0,),)
    if _torchcompat.HAS_CHECKPOINTABLE_TENSOR:
        assert not _torchcompat.is_checkpointable_tensor(torch.zeros(2))
    else:  # torch <= 2.13: attributes alone make nothing a shard
        assert not _torchcompat.is_checkpointable_tensor(t)
        assert not _torchcompat.any_checkpointable_tensor([t])


@needs_protocol
@pytest.mark.parametrize("save", ["sync", "async"])
def test_checkpointable_tensor_saves_as_torch_does(tmp_path, save):
    sd = {"w": two_shards(), "n": 3}
    tdcp.save({"w": two_shards(), "n": 3}, checkpoint_id=tmp_path / "t")
    if save == "sync":
        dcpx.save(sd, checkpoint_id=tmp_path / "d")
    else:
        result(dcpx.async_save(sd, checkpoint_id=tmp_path / "d"))
    ours = tdcp.FileSystemReader(tmp_path / "d").read_metadata().state_dict_metadata
    theirs = tdcp.FileSystemReader(tmp_path / "t").read_metadata().state_dict_metadata
    assert ours == theirs
    assert ours["w"].size == torch.Size([6, 3])
    assert sorted(c.offsets for c in ours["w"].chunks) == [torch.Size([1, 0]), torch.Size([4, 0])]
    # what torch loads back from dcpx's checkpoint, shard by shard
    for path in ("d", "t"):
        got = {"w": shard(torch.zeros(2, 3), (6, 3), [(1, 0), (4, 0)], [(0, 0), (1, 0)],
                          [(1, 3), (1, 3)]), "n": 0}
        tdcp.load(got, checkpoint_id=tmp_path / path)
        assert_bit_equal(got["w"], two_shards())
        assert got["n"] == 3


@needs_protocol
def test_checkpointable_tensor_loads_as_torch_does(tmp_path):
    tdcp.save({"w": two_shards()}, checkpoint_id=tmp_path)
    # one shard of the two, into a one-row buffer
    got = {"w": shard(torch.zeros(1, 3), (6, 3), [(4, 0)], [(0, 0)], [(1, 3)])}
    dcpx.load(got, checkpoint_id=tmp_path)
    assert_bit_equal(got["w"], two_shards()[1:2])


@needs_protocol
def test_stager_reuse_sees_a_plain_tensor_become_a_shard(tmp_path):
    """The stager's reuse of a layout must not stage a tensor that gained
    shard attributes as the plain tensor it was."""
    stager = dcpx.DefaultStager()
    try:
        data = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 0.5
        result(dcpx.async_save({"w": data.clone()}, checkpoint_id=tmp_path / "a",
                               async_stager=stager))
        sd = {"w": two_shards()}
        result(dcpx.async_save(sd, checkpoint_id=tmp_path / "b", async_stager=stager))
    finally:
        stager.close()
    md = tdcp.FileSystemReader(tmp_path / "b").read_metadata().state_dict_metadata
    assert md["w"].size == torch.Size([6, 3])


@needs_protocol
def test_process_async_save_refuses_checkpointable_tensor(tmp_path):
    """The checkpoint process receives tensors as shared memory, without
    their shard attributes: refused, naming the key, never saved whole."""
    with pytest.raises(TypeError, match=r"'layer\.w'.*CheckpointableTensor.*THREAD"):
        dcpx.async_save({"layer": {"w": two_shards()}}, checkpoint_id=tmp_path,
                        async_checkpointer_type=dcpx.AsyncCheckpointerType.PROCESS)
    assert not (tmp_path / ".metadata").exists()


def test_the_cli_reads_this_torchs_checkpoints(tmp_path, capsys):
    """dcpx inspect / verify on a checkpoint saved with this torch, and on
    one whose Metadata records no version (torch <= 2.8 has no such field;
    inspect read ``md.version`` and failed there with AttributeError, and on
    newer torch called such a .metadata unreadable)."""
    import pickle

    from dcpx.cli import main
    sd = {"w": torch.arange(6.0), "step": 3}
    dcpx.save(sd, checkpoint_id=tmp_path / "a")
    assert main(["inspect", str(tmp_path / "a")]) == 0
    assert main(["verify", str(tmp_path / "a")]) == 0
    md = dcpx.FileSystemReader(tmp_path / "a").read_metadata()
    if hasattr(md, "version"):
        md.version = None  # as torch <= 2.8 wrote it
        (tmp_path / "a" / ".metadata").write_bytes(pickle.dumps(md))
        capsys.readouterr()
        assert main(["inspect", str(tmp_path / "a")]) == 0
        out = capsys.readouterr().out
        assert "unreadable" not in out and "version none recorded" in out and "w" in out



# -------------------------------------------- no_dist on torch 2.4-2.6
_ALONE_CHILD = r"""
import sys, torch, torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner
import dcpx
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
alone = dist.new_group([0])

class Save(DefaultSavePlanner):  # not dcpx's single-process path: torch's save takes it
    pass

sd = {"a": torch.arange(4.0)}
dcpx.save(sd, checkpoint_id=sys.argv[1], planner=Save(), no_dist=True, process_group=alone)
out = {"a": torch.zeros(4)}
dcpx.load(out, checkpoint_id=sys.argv[1])
assert out["a"].equal(sd["a"]), out
dist.destroy_process_group()
print("alone: ok")
"""


def test_no_dist_with_a_group_of_this_rank_alone_saves_on_any_torch(tmp_path):
    """save(no_dist=True) with a process group of this rank alone (what the
    local tier passes on torch 2.4-2.6, whose save lacks no_dist), of a
    state dict dcpx's single-process path does not take: the save goes on
    that group (before: TypeError there, "torch has no no_dist=True").  In
    a child process: torch 2.4 cannot start a second process group in one
    process."""
    import os
    import subprocess
    import sys
    from dist_helpers import REPO
    r = subprocess.run([sys.executable, "-c", _ALONE_CHILD, str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0 and "alone: ok" in r.stdout, r.stdout + r.stderr
