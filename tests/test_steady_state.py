"""Issue 28 items 2 and 5: a save whose plan is unchanged on every rank
takes the steady-state path (fixed-size collectives, the layouts and the
encoded metadata of the last save reused), any change takes the full
exchange in the same save, and both write what torch loads bit-exact; a
DTensor's cached chunk is keyed by this rank's coordinate in its mesh."""
from __future__ import annotations

import os
import pickle
import re
import tempfile

import pytest
import torch

from dist_helpers import spawn

pytestmark = pytest.mark.dist


# ------------------------------------------------------------ item 5

def _rank_swap(rank: int, world: int, store_dir: str) -> list:
    """Join a 2-rank world as ``rank``, then a new one as the other rank:
    the DTensor chunk of the same (shape, mesh, placements) must move."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcpx.coordination.plan import local_chunk
    out = []
    for run, r in enumerate((rank, 1 - rank)):
        store = dist.FileStore(os.path.join(store_dir, f"store{run}"), world)
        dist.init_process_group("gloo", store=store, rank=r, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        local, offsets, sizes = local_chunk(dt)
        out.append((r, tuple(offsets), tuple(sizes), local.tolist()))
        dist.destroy_process_group()
    return out


def test_shard_cache_follows_the_rank():
    with tempfile.TemporaryDirectory() as d:
        results = spawn(_rank_swap, 2, d, init_pg=False)
    for per_rank in results:
        for r, offsets, sizes, local in per_rank:
            assert offsets == (4 * r,), (r, offsets)
            assert sizes == (4,)
            assert local == [float(4 * r + i) for i in range(4)]
