"""Drop-in test (issue #4, part 4): PyTorch's asynchronous checkpointing
recipe (``distributed_async_checkpoint_recipe``: FSDP, ``AppState(Stateful)``
over ``get_state_dict`` / ``set_state_dict``, ``dcp.async_save`` every few
steps, waiting for the previous save before the next) on CPU with gloo and
FSDP2 (``fully_shard``), with ``import dcpx as dcp``, then a restart at
another world size that loads the latest checkpoint and goes on training.

Phases (one spawn each):

1. 2 ranks train 10 steps, checkpointing after steps 1, 3 and 5 (the
   "latest" is step 5); they go on to step 9 without saving, which makes the
   uninterrupted reference.  At each save, rank 0 records the full model and
   optimizer state (``full_tensor()`` of every DTensor).
2. 4 ranks: (a) restart from phase 1's latest checkpoint: the model and
   optimizer state after ``dcp.load`` must equal the recorded one bit for
   bit, and the losses of steps 6..9 must match phase 1's (with the recipe's
   periodic async saves going on); (b) the same 10-step run as phase 1 at 4
   ranks, the reference for:
3. 2 ranks restart from phase 2b's latest checkpoint: the same checks.

Plus: the 10 losses of phases 1 and 2b agree, which is what makes the
cross-world-size comparison meaningful.

Every rank takes its slice of one fixed global batch per step, so the
training does not depend on the world size except for the order of the
floating-point reductions.  Tolerance: the losses are float32 values of
order 0.1-1; the forward pass is row-wise (identical per sample at any world
size), and the gradients are summed over 2 or 4 ranks in a different order,
an error of a few ulps (~1e-7 relative) per step, which Adam carries into the
weights at about the same relative size.  rtol=1e-5 / atol=1e-6 leaves two
orders of magnitude of margin over that (measured: at most 7e-8 relative
between the 2- and 4-rank runs), while a restart that lost optimizer state
changes the next losses by far more (measured: 17% for a cleared Adam state,
10% for a reset step count); smaller corruptions, which the losses could
miss, are caught by the bit-exact state comparison.

The same flow runs with the synchronous ``dcp.save``, so a failure of
``async_save`` alone is told apart from one of the load / resharding path.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

from conftest import assert_bit_equal
from dist_helpers import CheckSession

pytestmark = pytest.mark.dist

STEPS = 10
SAVE_STEPS = (1, 3, 5)   # the run "crashes" after step 5's checkpoint
RESTART_SAVE_EVERY = 2   # the restarted run checkpoints too, as the recipe does
GLOBAL_BATCH = 8
RTOL, ATOL = 1e-5, 1e-6  # see the module docstring


class ToyModel(nn.Module):
    """The recipe's model."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(16, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def _app_state_cls():
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    class AppState(Stateful):
        """The recipe's AppState."""

        def __init__(self, model, optimizer=None):
            self.model = model
            self.optimizer = optimizer

        def state_dict(self):
            model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
            return {"model": model_state_dict, "optim": optimizer_state_dict}

        def load_state_dict(self, state_dict):
            set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict["optim"])

    return AppState


def _save_mode() -> str:
    return os.environ["DCPX_FSDP_SAVE_MODE"]


def make_model_and_optimizer():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same initial weights at every world size
    model = ToyModel()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.net1, mesh=mesh)
    fully_shard(model.net2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer


def batch(step: int, rank: int, world: int):
    """This rank's rows of the step's fixed global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.rand(GLOBAL_BATCH, 16, generator=g)
    y = torch.rand(GLOBAL_BATCH, 8, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def train_step(model, optimizer, step: int) -> float:
    """One step; returns the global mean loss (the same number on all ranks)."""
    import torch.distributed as dist

    x, y = batch(step, dist.get_rank(), dist.get_world_size())
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)  # FSDP averages the gradients
    loss.backward()
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def full_state(model, optimizer) -> dict:
    """The full (unsharded) model and optimizer state, for bit comparison.
    Collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from dtensor_api import DTensor

    def full(v):
        if isinstance(v, DTensor):
            return v.full_tensor()
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, dict):
            return {k: full(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(full(x) for x in v)
        return v

    msd, osd = get_state_dict(model, optimizer)
    return {"model": full(msd), "optim": full(osd)}


def assert_state_equal(got, exp, path="state"):
    if isinstance(exp, torch.Tensor):
        assert_bit_equal(got, exp, path)
    elif isinstance(exp, dict):
        assert set(got) == set(exp), f"{path}: keys {sorted(map(str, got))} != {sorted(map(str, exp))}"
        for k in exp:
            assert_state_equal(got[k], exp[k], f"{path}.{k}")
    elif isinstance(exp, (list, tuple)):
        assert len(got) == len(exp), f"{path}: length {len(got)} != {len(exp)}"
        for i, (a, b) in enumerate(zip(got, exp)):
            assert_state_equal(a, b, f"{path}[{i}]")
    else:
        assert got == exp, f"{path}: {got!r} != {exp!r}"


def checkpoint(dcp, app_state, path, pending):
    """The recipe: wait for the previous checkpoint, then start the next."""
    if pending is not None:
        pending.result()
    if _save_mode() == "async_save":
        return dcp.async_save({"app": app_state}, checkpoint_id=path)
    dcp.save({"app": app_state}, checkpoint_id=path)
    return None


def latest_checkpoint(run_dir: str) -> tuple:
    steps = [int(n.split("_")[1]) for n in os.listdir(run_dir)
             if n.startswith("step_") and os.path.exists(os.path.join(run_dir, n, ".metadata"))]
    assert steps, f"no committed checkpoint in {run_dir}: {os.listdir(run_dir)}"
    return max(steps), os.path.join(run_dir, f"step_{max(steps)}")


def _train_and_checkpoint(ctx, run: str) -> None:
    """Phases 1 and 2b: train STEPS steps, checkpoint after SAVE_STEPS."""
    import dcpx as dcp

    AppState = _app_state_cls()
    model, optimizer = make_model_and_optimizer()
    run_dir = ctx.path(run)
    losses, pending = [], None
    for step in range(STEPS):
        losses.append(train_step(model, optimizer, step))
        if step in SAVE_STEPS:
            expected = full_state(model, optimizer)  # what this checkpoint must hold
            if ctx.rank == 0:
                torch.save(expected, os.path.join(ctx.path(), f"{run}_expected_{step}.pt"))
            pending = checkpoint(dcp, AppState(model, optimizer),
                                 os.path.join(run_dir, f"step_{step}"), pending)
    if pending is not None:
        pending.result()
    if ctx.rank == 0:
        with open(ctx.path(f"{run}_losses.json"), "w") as f:
            json.dump(losses, f)


def _restart(ctx, from_run: str, run: str) -> None:
    """Phases 2a and 3: load the latest checkpoint of ``from_run`` at this
    world size, check the state bit for bit, continue, compare the losses."""
    import dcpx as dcp

    AppState = _app_state_cls()
    model, optimizer = make_model_and_optimizer()
    step, path = latest_checkpoint(ctx.path(from_run))
    assert step == SAVE_STEPS[-1], f"latest checkpoint of {from_run} is step {step}"
    dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=path)
    expected = torch.load(ctx.path(f"{from_run}_expected_{step}.pt"), weights_only=True)
    assert_state_equal(full_state(model, optimizer), expected,
                       f"state after loading {from_run}/step_{step} at world size "
                       f"{ctx.world_size}")
    losses, pending = [], None
    for s in range(step + 1, STEPS):
        losses.append(train_step(model, optimizer, s))
        if (s - step) % RESTART_SAVE_EVERY == 0:
            pending = checkpoint(dcp, AppState(model, optimizer),
                                 ctx.path(run, f"step_{s}"), pending)
    if pending is not None:
        pending.result()
    with open(ctx.path(f"{from_run}_losses.json")) as f:
        reference = json.load(f)[step + 1:]
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64),
        rtol=RTOL, atol=ATOL,
        msg=lambda m: (f"losses after restarting {from_run} at world size {ctx.world_size} "
                       f"{losses} differ from the uninterrupted run's {reference}: {m}"))


def check_train_2_ranks(ctx):
    _train_and_checkpoint(ctx, "run2")


def check_restart_2_to_4_ranks(ctx):
    _restart(ctx, "run2", "restart4")


def check_train_4_ranks(ctx):
    _train_and_checkpoint(ctx, "run4")


def check_restart_4_to_2_ranks(ctx):
    _restart(ctx, "run4", "restart2")


MODES = ["async_save", "save"]


@pytest.fixture(scope="module")
def phases(request, tmp_path_factory):
    mode = request.param
    workdir = tmp_path_factory.mktemp(f"fsdp_{mode}")
    env = {"DCPX_FSDP_SAVE_MODE": mode}
    p1 = CheckSession(2, [check_train_2_ranks], workdir, "phase1", env=env).run()
    p2 = CheckSession(4, [check_restart_2_to_4_ranks, check_train_4_ranks], workdir, "phase2",
                      env=env).run()
    p3 = CheckSession(2, [check_restart_4_to_2_ranks], workdir, "phase3", env=env).run()
    return mode, workdir, {"check_train_2_ranks": p1, "check_restart_2_to_4_ranks": p2,
                           "check_train_4_ranks": p2, "check_restart_4_to_2_ranks": p3}


def _run(phases, check):
    sessions = phases[2]
    sessions[check].assert_ok(check)


@pytest.mark.parametrize("phases", MODES, indirect=True)
def test_recipe_train_and_checkpoint_2_ranks(phases):
    _run(phases, "check_train_2_ranks")


@pytest.mark.parametrize("phases", MODES, indirect=True)
def test_recipe_restart_2_to_4_ranks(phases):
    _run(phases, "check_restart_2_to_4_ranks")


@pytest.mark.parametrize("phases", MODES, indirect=True)
def test_recipe_train_and_checkpoint_4_ranks(phases):
    _run(phases, "check_train_4_ranks")


@pytest.mark.parametrize("phases", MODES, indirect=True)
def test_recipe_restart_4_to_2_ranks(phases):
    _run(phases, "check_restart_4_to_2_ranks")


@pytest.mark.parametrize("phases", MODES, indirect=True)
def test_losses_do_not_depend_on_world_size(phases):
    """Phase 1 (2 ranks) and phase 2b (4 ranks) train identically within the
    tolerance: the premise of the restart comparisons."""
    _, workdir, sessions = phases
    sessions["check_train_2_ranks"].assert_ok("check_train_2_ranks")
    sessions["check_train_4_ranks"].assert_ok("check_train_4_ranks")
    with open(workdir / "run2_losses.json") as f:
        l2 = json.load(f)
    with open(workdir / "run4_losses.json") as f:
        l4 = json.load(f)
    torch.testing.assert_close(torch.tensor(l4, dtype=torch.float64),
                               torch.tensor(l2, dtype=torch.float64), rtol=RTOL, atol=ATOL)
    assert l2[-1] < l2[0], f"the model does not train: losses {l2}"
