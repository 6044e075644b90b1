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
