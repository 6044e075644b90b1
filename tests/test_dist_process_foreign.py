"""async_save(PROCESS) with a process group and a foreign StorageWriter or a
custom planner (issue 10, item 7): torch's save coordinates the ranks on
the upload thread over async_save's own group, the checkpoint process runs
the writer's write_data.  2 ranks (gloo), a DTensor sharded over them plus
replicated plain values; loaded with torch DCP and dcpx, bit-exact."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp

import dcpx
from conftest import assert_bit_equal
from dist_helpers import dtensor_of, full_value, spawn
from test_process_foreign import MARKER, MarkingWriter, RenamingPlanner

pytestmark = pytest.mark.dist

CASES = [("marking", "renaming"), ("fsspec", None), ("dcpx", "renaming"), ("marking", None)]


def _writer(kind, path):
    if kind == "marking":
        return MarkingWriter(path)
    if kind == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        return FsspecWriter(path)
    return dcpx.FileSystemWriter(path)


def _ranks(rank, world_size, workdir, cases):
    from torch.distributed.device_mesh import init_device_mesh
    from dtensor_api import Shard

    mesh = init_device_mesh("cpu", (world_size,))
    full = full_value("pf.w", (16, 6))
    done = []
    for writer, planner in cases:
        path = os.path.join(workdir, f"{writer}-{planner}")
        sd = {"w": dtensor_of(full, mesh, [Shard(0)]), "b": full_value("pf.b", (5,)),
              "step": 3}
        for _ in range(2):
            fut = dcpx.async_save(sd, storage_writer=_writer(writer, path),
                                  planner=RenamingPlanner() if planner else None,
                                  async_checkpointer_type=dcpx.AsyncCheckpointerType.PROCESS)
            fut.result(timeout=120)
        dist.barrier()
        pre = "renamed." if planner else ""
        for load in (tdcp.load, dcpx.load):
            out = {pre + "w": dtensor_of(torch.zeros(16, 6), mesh, [Shard(0)]),
                   pre + "b": torch.zeros(5), pre + "step": 0}
            load(out, checkpoint_id=path)
            assert_bit_equal(out[pre + "w"].full_tensor(), full, f"{path}: w")
            assert_bit_equal(out[pre + "b"], full_value("pf.b", (5,)), f"{path}: b")
            assert out[pre + "step"] == 3
        if writer == "marking":
            assert os.path.exists(os.path.join(path, MARKER))
        done.append(path)
    return done


def test_process_upload_foreign_writer_and_planner_2_ranks(tmp_path):
    cases = [c for c in CASES if c[0] != "fsspec"]
    try:
        import fsspec  # noqa: F401
        cases = CASES
    except ImportError:
        pass
    spawn(_ranks, 2, str(tmp_path), cases, timeout=300)
