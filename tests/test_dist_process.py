"""async_save(AsyncCheckpointerType.PROCESS) with a process group: each
rank coordinates on its upload thread, its checkpoint process writes its
data files (from the stager's shared memory, or tensors sent by value)."""
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.dist

WORLD = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, path: str, shared: bool) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from dtensor_api import Replicate, Shard, distribute_tensor

    import dcpx
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
        w = distribute_tensor(full.clone(), mesh, [Shard(0)])
        sd = {"w": w, "r": distribute_tensor(full.clone(), mesh, [Replicate()]),
              "plain": torch.arange(5, dtype=torch.int64), "meta": {"step": 7}}
        stager = dcpx.DefaultStager(dcpx.StagingOptions(False, shared, True, False))
        for i in range(3):
            resp = dcpx.async_save(sd, checkpoint_id=path, async_stager=stager,
                                   async_checkpointer_type=dcpx.AsyncCheckpointerType.PROCESS)
            resp.staging_completion.result()
            if i < 2:
                w._local_tensor.add_(100)        # after staging: not in save i
            dist.all_reduce(torch.ones(1))       # training collectives meanwhile
            md = resp.upload_completion.result(timeout=60)
        stager.close()
        want = full + 200
        assert md.state_dict_metadata["w"].chunks[1].offsets == torch.Size([4, 0])
        out = {"w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]),
               "r": torch.zeros(8, 6), "plain": torch.zeros(5, dtype=torch.int64),
               "meta": {"step": 0}}
        dcpx.load(out, checkpoint_id=path)
        assert torch.equal(out["w"].full_tensor(), want)
        assert torch.equal(out["r"], full) and torch.equal(out["plain"], torch.arange(5))
        assert out["meta"]["step"] == 7
        theirs = {"w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)]),
                  "r": torch.zeros(8, 6), "plain": torch.zeros(5, dtype=torch.int64)}
        tdcp.load(theirs, checkpoint_id=path)
        assert torch.equal(theirs["w"].full_tensor(), want)
        dist.barrier()
        if rank == 0:  # each replicated value written once, by one rank
            assert len(md.storage_data) == 2 + 1 + 1 + 1, md.storage_data.keys()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "by-value"])
def test_process_checkpointer_with_process_group(tmp_path, shared):
    ctx = mp.start_processes(_rank, args=(_port(), str(tmp_path / "ckpt"), shared),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("ranks did not finish within 180 s (hang)")
