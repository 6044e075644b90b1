"""Loading into meta tensors with a process group (gloo, 2 ranks).

torch's DefaultLoadPlanner replaces every meta tensor of the state dict, in
place at every level, by an empty one on the group's device before it plans
the load (``planner_helpers._init_state_dict``), so a model built on the meta
device loads with ``torch.distributed.checkpoint.load``.  dcpx refused it
(``ValueError``: the tensor holds no data) where torch accepts it; now it does
as torch does.  Without a process group both refuse
(tests/test_load_fast_adversarial.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp

import dcpx
from conftest import assert_bit_equal
from dist_helpers import CheckSession

pytestmark = pytest.mark.dist


def _saved() -> dict:
    return {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(3.0) + 0.5},
            "x": torch.arange(5, dtype=torch.int64), "step": 3}


def _meta() -> dict:
    return {"model": {"w": torch.empty(3, 4, device="meta"), "b": torch.zeros(3)},
            "x": torch.empty(5, dtype=torch.int64, device="meta"), "step": 0}


def _check(out: dict, what: str) -> None:
    want = _saved()
    for k, got in (("w", out["model"]["w"]), ("b", out["model"]["b"]), ("x", out["x"])):
        assert not got.is_meta, f"{what}: {k} is still on the meta device"
        ref = want["model"][k] if k in ("w", "b") else want["x"]
        assert_bit_equal(got, ref, f"{what}: {k}")
    assert out["step"] == 3, f"{what}: step {out['step']}"


def check_meta_destinations_load_as_torch(ctx):
    """Nested and top-level meta tensors, a checkpoint saved by dcpx: torch
    and dcpx both replace them and load the saved values."""
    path = ctx.path("meta")
    dcpx.save(_saved(), checkpoint_id=path)
    dist.barrier()
    ref = _meta()
    tdcp.load(ref, checkpoint_id=path)
    _check(ref, "torch")
    mine = _meta()
    dcpx.load(mine, checkpoint_id=path)
    _check(mine, "dcpx")
    again = _meta()   # a second load of the same layout (the read-plan cache)
    dcpx.load(again, checkpoint_id=path)
    _check(again, "dcpx, again")


def check_meta_destinations_of_a_torch_checkpoint(ctx):
    path = ctx.path("meta-torch")
    tdcp.save(_saved(), checkpoint_id=path)
    dist.barrier()
    mine = _meta()
    dcpx.load(mine, checkpoint_id=path)
    _check(mine, "dcpx")


CHECKS = [check_meta_destinations_load_as_torch, check_meta_destinations_of_a_torch_checkpoint]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return CheckSession(2, CHECKS, tmp_path_factory.mktemp("meta")).run()


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_meta_load_2_ranks(session, check):
    session.assert_ok(check)
