"""Checkpoints in the layout torch 2.0-2.3 wrote: a container holding no
tensor (an optimizer's ``param_groups``, a scheduler's state) saved as one
bytes item under its path, where torch >= 2.4 flattens it to its leaves.
torch >= 2.4 loads them through its ``2_3`` fallback
(``DefaultLoadPlanner.create_local_plan``); dcpx must load them the same
way: plain load, partial load, CheckpointManager resume.

The checkpoints are written by torch's own DCP save with its 2.3
flattening switched on (``_version._derived_version = "2_3"``, the switch
its 2_3 load fallback itself uses), which is what torch 2.3's
``flatten_state_dict`` did.  On main, ``dcpx.load`` raised "Missing key
... param_groups.0.lr", and with ``allow_partial_load=True`` left lr and
weight_decay unrestored.

Also ``dcpx convert train.pt DIR``, which on main wrote ``param_groups`` as
one value (the 2.3 layout), so that dcpx could not load its own
conversion.
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

import dcpx
from dcpx.coordination.readplan import clear
from dcpx.cli import main as cli_main


@contextlib.contextmanager
def torch_2_3_flattening():
    _version._derived_version = "2_3"
    try:
        yield
    finally:
        _version._derived_version = None


def train_state(lr: float, wd: float, steps: int, seed: int) -> tuple:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def as_state(model, opt, sched) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(),
            "sched": sched.state_dict(), "step": 5}


def fresh() -> dict:
    """A restarted job's state: other hyper-parameters, its own first step
    taken (so the optimizer holds state tensors to load into)."""
    return as_state(*train_state(lr=1.0, wd=0.0, steps=1, seed=1))


def save_2_3(path, sd: dict) -> None:
    with torch_2_3_flattening(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(sd, checkpoint_id=str(path), no_dist=True)


def torch_load(path, sd: dict, **kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(sd, checkpoint_id=str(path), no_dist=True, **kw)


def assert_same(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


def as_torch_2_3_metadata(path) -> None:
    """Rewrite .metadata as torch 2.3 pickled it: a Metadata with neither
    ``storage_meta`` nor ``version`` (fields torch 2.4 added)."""
    import pickle
    md_file = path / ".metadata"
    md = pickle.loads(md_file.read_bytes())
    del md.__dict__["storage_meta"], md.__dict__["version"]
    md_file.write_bytes(pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))


@pytest.fixture(params=["2.13 metadata", "2.3 metadata"])
def legacy(tmp_path, request):
    saved = as_state(*train_state(lr=0.01, wd=0.1, steps=3, seed=0))
    save_2_3(tmp_path / "ck", saved)
    if request.param == "2.3 metadata":
        as_torch_2_3_metadata(tmp_path / "ck")
    clear()
    return tmp_path / "ck", saved


def test_the_checkpoint_has_the_2_3_layout(legacy):
    path, _ = legacy
    sdm = dcpx.FileSystemReader(path).read_metadata().state_dict_metadata
    assert isinstance(sdm["optim.param_groups"], BytesStorageMetadata)
    assert isinstance(sdm["sched"], BytesStorageMetadata)
    assert "optim.param_groups.0.lr" not in sdm and "sched.last_epoch" not in sdm
    assert "optim.state.0.exp_avg" in sdm


def test_load_as_torch_loads(legacy):
    path, saved = legacy
    ref = fresh()
    torch_load(path, ref)
    assert_same(ref, saved)  # torch restores everything...
    for _ in range(2):  # ...and so does dcpx: fresh, then with the read plan cached
        got = fresh()
        dcpx.load(got, checkpoint_id=path)
        assert_same(got, saved)
        assert got["optim"]["param_groups"][0]["lr"] == saved["optim"]["param_groups"][0]["lr"]
        assert got["optim"]["param_groups"][0]["weight_decay"] == 0.1
        assert got["sched"]["last_epoch"] == 3


def test_partial_load_restores_the_groups(legacy):
    """On main this raised nothing and left lr / weight_decay as they were."""
    path, saved = legacy
    got = fresh()
    got["not_in_checkpoint"] = torch.zeros(2)
    ref = fresh()
    ref["not_in_checkpoint"] = torch.zeros(2)
    torch_load(path, ref, planner=DefaultLoadPlanner(allow_partial_load=True))
    dcpx.load(got, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    assert_same(got, ref)
    assert got["optim"]["param_groups"][0]["weight_decay"] == 0.1
    assert got["sched"]["_last_lr"] == saved["sched"]["_last_lr"]


def test_stateful_objects_load_the_2_3_layout(legacy):
    """Stateful values (torch's get_state_dict style): the 2.3 flattening
    runs over their state_dict(), as torch's planner does."""
    path, saved = legacy
    model, opt, sched = train_state(lr=1.0, wd=0.0, steps=1, seed=1)

    class Optim:
        def state_dict(self):
            return opt.state_dict()

        def load_state_dict(self, sd):
            opt.load_state_dict(sd)

    sd = {"model": model.state_dict(), "optim": Optim(), "sched": sched.state_dict(), "step": 0}
    dcpx.load(sd, checkpoint_id=path)
    assert opt.param_groups[0]["lr"] == saved["optim"]["param_groups"][0]["lr"]
    assert opt.param_groups[0]["weight_decay"] == 0.1
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"],
                       saved["optim"]["state"][0]["exp_avg"])
    assert sd["step"] == 5


def test_a_truly_missing_key_still_raises(legacy):
    path, _ = legacy
    got = fresh()
    got["optim"]["state"][7] = {"exp_avg": torch.zeros(2)}
    with pytest.raises(Exception, match="Missing key.*optim.state.7.exp_avg"):
        dcpx.load(got, checkpoint_id=path)


def test_current_layout_untouched(tmp_path):
    """A torch >= 2.4 checkpoint keeps the current flattening (which has
    the leaves), in both loaders."""
    saved = as_state(*train_state(lr=0.01, wd=0.1, steps=3, seed=0))
    dcpx.save(saved, checkpoint_id=tmp_path / "ck")
    sdm = dcpx.FileSystemReader(tmp_path / "ck").read_metadata().state_dict_metadata
    assert "optim.param_groups.0.lr" in sdm and "optim.param_groups" not in sdm
    got = fresh()
    dcpx.load(got, checkpoint_id=tmp_path / "ck")
    assert_same(got, saved)
    ref = fresh()
    torch_load(tmp_path / "ck", ref)
    assert_same(ref, saved)


@pytest.mark.parametrize("metadata", ["2.13", "2.3"])
def test_manager_resumes_a_2_3_step(tmp_path, metadata):
    saved = as_state(*train_state(lr=0.01, wd=0.1, steps=3, seed=0))
    save_2_3(tmp_path / "root" / "step-30", saved)
    if metadata == "2.3":
        as_torch_2_3_metadata(tmp_path / "root" / "step-30")
    for verify in ("commit", "full"):
        mgr = dcpx.CheckpointManager(tmp_path / "root", verify=verify, async_mode="sync")
        try:
            got = fresh()
            with warnings.catch_warnings():
                warnings.simplefilter("error", dcpx.manager.StepSkippedWarning)
                assert mgr.load(got) == 30
            assert_same(got, saved)
        finally:
            mgr.close()


def test_convert_of_a_training_torch_save_loads_both_ways(tmp_path, capsys):
    saved = as_state(*train_state(lr=0.01, wd=0.1, steps=3, seed=0))
    torch.save(saved, tmp_path / "train.pt")
    assert cli_main(["convert", str(tmp_path / "train.pt"), str(tmp_path / "ck")]) == 0
    sdm = dcpx.FileSystemReader(tmp_path / "ck").read_metadata().state_dict_metadata
    assert "optim.param_groups.0.lr" in sdm  # what torch >= 2.4 writes
    for loader in ("dcpx", "torch"):
        got = fresh()
        if loader == "dcpx":
            dcpx.load(got, checkpoint_id=tmp_path / "ck")
        else:
            torch_load(tmp_path / "ck", got)
        assert_same(got, saved, loader)


@pytest.mark.parametrize("case", ["dotted key", "empty container", "list of dicts"])
def test_containers_found_as_torch_finds_them(tmp_path, case):
    """The 2.3-only key is a container under a key holding a dot, an empty
    dict in the state dict being loaded (torch's fallback fills it), or a
    list of plain dicts: each loads as torch loads it."""
    w = torch.arange(6.0)
    if case == "dotted key":
        saved = {"cfg": {"a.b": {"x": 1, "y": [1, 2]}, "t": w}, "w": w}
        fresh_sd = lambda: {"cfg": {"a.b": {"x": 0, "y": [0, 0]}, "t": torch.zeros(6)},  # noqa: E731
                            "w": torch.zeros(6)}
        key = "cfg.a.b"
    elif case == "empty container":
        saved = {"sched": {"last_epoch": 3, "base_lrs": [0.1]}, "w": w}
        fresh_sd = lambda: {"sched": {}, "w": torch.zeros(6)}  # noqa: E731
        key = "sched"
    else:
        saved = {"groups": [{"lr": 0.5}, {"lr": 0.25, "ids": [1, 2]}], "w": w}
        fresh_sd = lambda: {"groups": [{"lr": 0.0}, {"lr": 0.0, "ids": [0]}],  # noqa: E731
                            "w": torch.zeros(6)}
        key = "groups"
    save_2_3(tmp_path / "ck", saved)
    sdm = dcpx.FileSystemReader(tmp_path / "ck").read_metadata().state_dict_metadata
    assert isinstance(sdm[key], BytesStorageMetadata)
    ref, got = fresh_sd(), fresh_sd()
    torch_load(tmp_path / "ck", ref)
    clear()
    dcpx.load(got, checkpoint_id=tmp_path / "ck")
    assert_same(ref, saved)
    assert_same(got, ref)


def _load_on_ranks(rank: int, world_size: int, path: str) -> list:
    """Each rank loads the 2.3-layout checkpoint through dcpx's
    multi-process path (_dist.load), plainly and with allow_partial_load."""
    import torch.distributed as dist
    assert dist.is_initialized()
    saved = as_state(*train_state(lr=0.01, wd=0.1, steps=3, seed=0))
    out = []
    for partial in (False, True):
        got = fresh()
        dcpx.load(got, checkpoint_id=path,
                  planner=DefaultLoadPlanner(allow_partial_load=partial))
        assert_same(got, saved, f"rank {rank} partial={partial}")
        out.append(got["optim"]["param_groups"][0]["weight_decay"])
    return out


def test_two_ranks_load_the_2_3_layout(tmp_path):
    from dist_helpers import spawn
    saved = as_state(*train_state(lr=0.01, wd=0.1, steps=3, seed=0))
    save_2_3(tmp_path / "ck", saved)
    assert spawn(_load_on_ranks, 2, str(tmp_path / "ck"), timeout=300) == [[0.1, 0.1]] * 2
