"""CheckpointManager given models, optimizers and LR schedulers directly
(``{"model": model, "optim": optim}``): a resume restores the optimizer
state (it came back empty, silently, before: a fresh optimizer's
state_dict() asks for none), and dcpx.load warns when a checkpoint holds
keys inside an entry that the state dict did not ask for (issue 22, item 1).
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

import dcpx
from dcpx.errors import UnloadedKeysWarning
from dcpx.manager import CheckpointManager

from dist_helpers import spawn


def _objects(parts: int = 1):
    """One model, or a model in two pipeline stages (parameter names kept,
    as torchtitan's pipeline split keeps them), an optimizer and an LR
    scheduler per part."""
    torch.manual_seed(0)
    if parts == 1:
        models = [torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(),
                                      torch.nn.Linear(12, 3))]
    else:
        models = [torch.nn.ModuleDict({"l0": torch.nn.Linear(6, 12)}),
                  torch.nn.ModuleDict({"l1": torch.nn.Linear(12, 3)})]
    optims = [torch.optim.AdamW(m.parameters(), lr=3e-2, weight_decay=0.1) for m in models]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in optims]
    return models, optims, scheds


def _step(models, optims, scheds, step: int) -> list:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(5, 6, generator=g)
    if len(models) == 1:
        loss = models[0](x).square().mean()
    else:
        loss = models[1]["l1"](torch.tanh(models[0]["l0"](x))).square().mean()
    loss.backward()
    for o, s in zip(optims, scheds):
        o.step()
        o.zero_grad()
        s.step()
    return loss.item()


def _state(models, optims, scheds, parts: int) -> dict:
    if parts == 1:
        return {"model": models[0], "optim": optims[0], "sched": scheds[0]}
    return {"model": models, "optim": optims, "sched": scheds}


def _run(root, total: int, stop_after=None, parts: int = 1, mode: str = "sync"):
    """Losses of steps start+1..stop; (losses, start)."""
    models, optims, scheds = _objects(parts)
    state = _state(models, optims, scheds, parts)
    losses = []
    with CheckpointManager(root, async_mode=mode) as ckpt:
        start = ckpt.load(state) or 0
        for step in range(start + 1, total + 1):
            losses.append(_step(models, optims, scheds, step))
            ckpt.save(step, state)
            if step == stop_after:
                break
    return losses, start


@pytest.mark.parametrize("parts,mode", [(1, "sync"), (1, "async"), (2, "sync")])
def test_raw_objects_resume_bit_exact(tmp_path, parts, mode):
    """Trained 3 steps, saved, resumed with fresh objects and a fresh
    manager: every later loss equals the uninterrupted run's, bit for bit
    (on main the optimizer came back empty and step 4's loss differed)."""
    straight, _ = _run(tmp_path / "a", 8, parts=parts, mode=mode)
    first, start1 = _run(tmp_path / "b", 8, stop_after=3, parts=parts, mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of any kind on this resume
        rest, start2 = _run(tmp_path / "b", 8, parts=parts, mode=mode)
    assert (start1, start2) == (0, 3)
    assert first + rest == straight


def test_list_of_unrelated_models_sharing_names_is_refused(tmp_path):
    models = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    with CheckpointManager(tmp_path, async_mode="sync") as ckpt:
        with pytest.raises(ValueError, match="the models in the list share the key 'weight'"):
            ckpt.save(1, {"model": models})


def test_resumed_objects_hold_the_saved_state(tmp_path):
    models, optims, scheds = _objects()
    for step in range(1, 4):
        _step(models, optims, scheds, step)
    with CheckpointManager(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(3, _state(models, optims, scheds, 1))
    m2, o2, s2 = _objects()
    assert len(o2[0].state) == 0
    assert CheckpointManager(tmp_path).load(_state(m2, o2, s2, 1)) == 3
    want, got = optims[0].state_dict(), o2[0].state_dict()
    assert len(got["state"]) == len(want["state"]) == 4
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    assert got["param_groups"] == want["param_groups"]
    assert s2[0].state_dict() == scheds[0].state_dict()


def test_saved_keys_are_torchtitans(tmp_path):
    """The optimizer is saved as torchtitan's OptimizersContainer saves it:
    get_optimizer_state_dict, flattened, keyed by parameter name."""
    models, optims, scheds = _objects()
    _step(models, optims, scheds, 1)
    with CheckpointManager(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(1, _state(models, optims, scheds, 1))
    keys = set(dcpx.FileSystemReader(tmp_path / "step-1").read_metadata().state_dict_metadata)
    assert {"model.0.weight", "optim.state.0.weight.exp_avg", "optim.param_groups.0.weight.lr",
            "sched.last_epoch"} <= keys


def test_optimizer_without_its_model_is_refused(tmp_path):
    models, optims, _ = _objects()
    with CheckpointManager(tmp_path, async_mode="sync") as ckpt:
        with pytest.raises(ValueError, match="'optim' is an optimizer whose parameters belong "
                                             "to no nn.Module"):
            ckpt.save(1, {"optim": optims[0]})
        with pytest.raises(ValueError, match="'optim' is an optimizer"):
            ckpt.load({"optim": optims[0], "w": torch.zeros(1)})
    assert not (tmp_path / "step-1").exists()


def test_plain_values_are_given_back(tmp_path):
    """Non-tensor values beside the wrapped objects are replaced in the
    caller's dict, as dcpx.load replaces them."""
    models, optims, scheds = _objects()
    with CheckpointManager(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(1, {"model": models[0], "optim": optims[0], "epoch": 7, "t": torch.ones(2)})
    state = {"model": models[0], "optim": optims[0], "epoch": 0, "t": torch.zeros(2)}
    CheckpointManager(tmp_path).load(state)
    assert state["epoch"] == 7 and torch.equal(state["t"], torch.ones(2))
    assert state["model"] is models[0] and state["optim"] is optims[0]


# ------------------------------------------------------------ dcpx.load


def _saved_with_optimizer_state(path):
    models, optims, scheds = _objects()
    _step(models, optims, scheds, 1)
    dcpx.save({"model": models[0], "optim": optims[0]}, checkpoint_id=path)
    return models[0]


def test_load_warns_about_optimizer_state_left_out(tmp_path):
    model = _saved_with_optimizer_state(tmp_path)
    fresh = torch.optim.AdamW(model.parameters(), lr=3e-2)
    with pytest.warns(UnloadedKeysWarning, match=r"holds 13 key\(s\) under 'optim' that the state "
                                                 r"dict did not ask for.*'optim.state.0.exp_avg'"):
        dcpx.load({"model": model, "optim": fresh}, checkpoint_id=tmp_path)
    assert len(fresh.state) == 0  # dcpx.load keeps torch's semantics: it warns, no more


def test_load_does_not_warn_when_nothing_is_left_out(tmp_path):
    model = _saved_with_optimizer_state(tmp_path)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-2)
    _step([model], [optim], [torch.optim.lr_scheduler.StepLR(optim, 2)], 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # the second load through the cached plan
            dcpx.load({"model": model, "optim": optim}, checkpoint_id=tmp_path)
        # a whole entry not asked for (the model alone): on purpose, no warning
        dcpx.load({"model": model}, checkpoint_id=tmp_path)
        # part of an entry, on purpose
        dcpx.load({"model": model, "optim": torch.optim.AdamW(model.parameters())},
                  checkpoint_id=tmp_path, planner=DefaultLoadPlanner(allow_partial_load=True))


def _fsdp2_resume(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import torch.distributed as dist

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, optim

    def run(sub, stop_after=None):
        model, optim = make()
        state = {"model": model, "optim": optim}
        losses = []
        with CheckpointManager(f"{root}/{sub}", async_mode="sync") as ckpt:
            start = ckpt.load(state) or 0
            for step in range(start + 1, 7):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
                loss = model(x).square().mean()
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss.item())
                ckpt.save(step, state)
                if step == stop_after:
                    break
        return losses

    straight = run("a")
    resumed = run("b", stop_after=3) + run("b")
    return {"same": straight == resumed, "n": len(resumed)}


@pytest.mark.dist
def test_fsdp2_raw_objects_resume_bit_exact(tmp_path):
    for r in spawn(_fsdp2_resume, 2, str(tmp_path)):
        assert r == {"same": True, "n": 6}


def test_md_index_len_counts_the_keys(tmp_path):
    """The count the unloaded-keys check compares (C decoder's tables)."""
    from dcpx import _C
    from dcpx.coordination import dist as _dist
    from dcpx.storage.reader import FileSystemReader
    sd = {"a": torch.ones(2), "b": {"c": torch.zeros(3), "d": 4}, "e": [1, torch.ones(1)]}
    dcpx.save(sd, checkpoint_id=tmp_path)
    ck = _dist.open_checkpoint(FileSystemReader(tmp_path))
    md = dcpx.FileSystemReader(tmp_path).read_metadata()
    assert ck.key_count() == len(md.state_dict_metadata) == 5
    if ck.index is not None:
        assert _C.md_index_len(ck.index) == 5


_FRESH_PROCESS = '''
import sys, torch, json
sys.path.insert(0, {tests!r})
from test_manager_state import _run
losses, start = _run(sys.argv[1], 8, stop_after=int(sys.argv[2]) or None)
print(json.dumps({{"losses": losses, "start": start}}))
'''


def test_raw_objects_resume_bit_exact_in_fresh_process(tmp_path):
    """Each run in its own process: nothing of the first survives but the
    checkpoint."""
    import json
    import os
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "run.py"
    script.write_text(_FRESH_PROCESS.format(tests=tests))

    def run(root, stop):
        r = subprocess.run([sys.executable, str(script), str(tmp_path / root), str(stop)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    straight = run("a", 0)
    first, rest = run("b", 3), run("b", 0)
    assert (first["start"], rest["start"]) == (0, 3)
    assert first["losses"] + rest["losses"] == straight["losses"]


# ------------------------------------------------ the warning's line is the caller's


def test_unloaded_keys_warning_points_at_the_callers_line(tmp_path):
    """The warning names the line that called dcpx.load (not a frame inside
    dcpx: the backward-compatible argument decorator adds one), with the
    arguments given by keyword and in torch's old positional order."""
    model = _saved_with_optimizer_state(tmp_path)
    fresh = torch.optim.AdamW(model.parameters(), lr=3e-2)
    with pytest.warns(UnloadedKeysWarning) as rec:
        dcpx.load({"model": model, "optim": fresh}, checkpoint_id=tmp_path); line = _line()  # noqa: E702
    assert [(w.filename, w.lineno) for w in rec] == [(__file__, line)]
    reader = dcpx.FileSystemReader(tmp_path)
    with pytest.warns(UserWarning) as rec:  # and torch's warning of the old argument order
        dcpx.load({"model": model, "optim": fresh}, reader); line = _line()  # noqa: E702
    assert sorted((w.category.__name__, w.filename, w.lineno) for w in rec) == [
        ("UnloadedKeysWarning", __file__, line), ("UserWarning", __file__, line)]


def _line() -> int:
    import sys
    return sys._getframe(1).f_lineno


def test_unloaded_keys_warning_through_the_manager_points_at_its_caller(tmp_path):
    with CheckpointManager(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(1, {"extra": {"a": torch.ones(2), "b": torch.ones(2)}})
    state = {"extra": {"a": torch.zeros(2)}}
    with pytest.warns(UnloadedKeysWarning, match="'extra.b'") as rec:
        CheckpointManager(tmp_path).load(state); line = _line()  # noqa: E702
    assert (rec[0].filename, rec[0].lineno) == (__file__, line)


def _warning_site_with_a_process_group(rank: int, world: int, root: str) -> tuple:
    model = _saved_with_optimizer_state(root)
    fresh = torch.optim.AdamW(model.parameters(), lr=3e-2)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        dcpx.load({"model": model, "optim": fresh}, checkpoint_id=root); line = _line()  # noqa: E702
    return [(w.filename, w.lineno) for w in rec if w.category is UnloadedKeysWarning], line


def test_unloaded_keys_warning_with_a_process_group_points_at_the_callers_line(tmp_path):
    (sites, line), = spawn(_warning_site_with_a_process_group, 1, str(tmp_path))
    assert sites == [(__file__, line)]
