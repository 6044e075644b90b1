"""CheckpointManager features its peers have (issue 22): per-step user
metadata, keep the best steps by a metric, load from another root or
without some entries, export of the model as safetensors, delete."""
from __future__ import annotations

import json

import pytest
import torch

from dcpx.errors import CheckpointError
from dcpx.manager import USER_METADATA_FN, CheckpointManager


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((3,), v), "b": torch.full((2,), -v)},
            "optim": {"m": torch.full((3,), 10 * v)}, "step": int(v)}


def test_user_metadata_saved_with_step_and_read_without_tensors(tmp_path):
    for mode in ("sync", "async"):
        root = tmp_path / mode
        with CheckpointManager(root, async_mode=mode) as ckpt:
            ckpt.save(1, _state(1), metadata={"loss": 0.5, "tokens": 1000, "tag": "warmup"})
            ckpt.save(2, _state(2))
        m = CheckpointManager(root)
        assert m.step_metadata(1) == {"loss": 0.5, "tokens": 1000, "tag": "warmup"}
        assert m.step_metadata(2) == {}
        assert json.loads((root / "step-1" / USER_METADATA_FN).read_text())["loss"] == 0.5


def test_user_metadata_must_be_json(tmp_path):
    with CheckpointManager(tmp_path, async_mode="sync") as ckpt:
        with pytest.raises(TypeError, match="metadata must be JSON-serializable"):
            ckpt.save(1, _state(1), metadata={"t": torch.ones(1)})
    assert not (tmp_path / "step-1").exists()


@pytest.mark.parametrize("mode,want", [("min", [2, 4, 6]), ("max", [3, 5, 6])])
def test_keep_best_k_by_metric(tmp_path, mode, want):
    """keep_latest_k=1 plus the 2 best by loss: the newest and the best
    two survive every retention pass."""
    losses = {1: 0.9, 2: 0.2, 3: 1.5, 4: 0.1, 5: 1.2, 6: 0.8}
    with CheckpointManager(tmp_path, async_mode="sync", keep_latest_k=1, keep_best_k=2,
                           best_metric="loss", best_mode=mode) as ckpt:
        for step, loss in losses.items():
            ckpt.save(step, _state(step), metadata={"loss": loss})
        ckpt.wait_for_retention()
        assert ckpt.all_steps() == want
        assert ckpt.best_steps() == ([4, 2] if mode == "min" else [3, 5])


def test_keep_best_k_options_checked(tmp_path):
    with pytest.raises(ValueError, match="keep_best_k and best_metric go together"):
        CheckpointManager(tmp_path, keep_best_k=2)
    with pytest.raises(ValueError, match="best_mode must be 'min' or 'max'"):
        CheckpointManager(tmp_path, keep_best_k=2, best_metric="loss", best_mode="lowest")


def test_load_from_another_root_and_excluding_entries(tmp_path):
    with CheckpointManager(tmp_path / "pretrained", async_mode="sync") as ckpt:
        ckpt.save(100, _state(7))
    mine = CheckpointManager(tmp_path / "finetune", async_mode="sync")
    state = _state(0)
    assert mine.load(state) is None  # a fresh run
    assert mine.load(state, root=tmp_path / "pretrained", exclude=("optim", "step")) == 100
    assert torch.equal(state["model"]["w"], torch.full((3,), 7.0))
    assert torch.equal(state["optim"]["m"], torch.zeros(3)) and state["step"] == 0  # left alone
    assert mine.all_steps() == []
    state = _state(0)
    assert mine.load(state, root=tmp_path / "pretrained", exclude="optim") == 100
    assert state["step"] == 7 and torch.equal(state["optim"]["m"], torch.zeros(3))
    with pytest.raises(KeyError, match=r"exclude names \['optimizer'\]"):
        mine.load(state, root=tmp_path / "pretrained", exclude=("optimizer",))
    model_only = {"model": _state(0)["model"]}  # the model alone: never asks for the rest
    assert CheckpointManager(tmp_path / "pretrained").load(model_only) == 100
    assert torch.equal(model_only["model"]["b"], torch.full((2,), -7.0))


def test_export_model_as_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(tmp_path / "run", async_mode="sync") as ckpt:
        ckpt.save(1, {"model": model, "optim": optim, "step": 1})
        ckpt.save(2, {"model": model, "optim": optim, "step": 2})
        out = ckpt.export(tmp_path / "hf")
    assert out == str(tmp_path / "hf" / "model.safetensors")
    got = st.load_file(out)
    want = model.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k])
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    fresh.load_state_dict(got)  # strict: the model's own keys
    shards = CheckpointManager(tmp_path / "run").export(tmp_path / "sharded", step=1,
                                                        max_shard_size="40B")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(want) and shards == str(tmp_path / "sharded")
    with pytest.raises(CheckpointError, match="step-3 under .* is not a committed step"):
        CheckpointManager(tmp_path / "run").export(tmp_path / "x.safetensors", step=3)


def test_delete(tmp_path):
    with CheckpointManager(tmp_path, async_mode="sync") as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step), metadata={"loss": step})
        assert ckpt.delete(2) is True
        assert ckpt.delete(2) is False and ckpt.delete(99) is False
        assert ckpt.all_steps() == [1, 3]
        assert not any(p.name.startswith(".deleting-") for p in tmp_path.iterdir())
        state = _state(0)
        assert ckpt.load(state) == 3


def test_user_metadata_on_a_url_root():
    pytest.importorskip("fsspec")
    import uuid
    root = f"memory://dcpx-features-{uuid.uuid4().hex[:8]}"
    with CheckpointManager(root, async_mode="sync", keep_latest_k=1, keep_best_k=1,
                           best_metric="acc", best_mode="max") as ckpt:
        ckpt.save(1, _state(1), metadata={"acc": 0.9})
        ckpt.save(2, _state(2), metadata={"acc": 0.5})
        ckpt.save(3, _state(3), metadata={"acc": 0.7})
        ckpt.wait_for_retention()
        assert ckpt.all_steps() == [1, 3]
        assert ckpt.step_metadata(1) == {"acc": 0.9}
        assert ckpt.delete(3) is True and ckpt.all_steps() == [1]


def test_user_metadata_link_refused(tmp_path):
    from dcpx.errors import CorruptCheckpointError
    with CheckpointManager(tmp_path / "r", async_mode="sync") as ckpt:
        ckpt.save(1, _state(1), metadata={"loss": 1.0})
    meta = tmp_path / "r" / "step-1" / USER_METADATA_FN
    (tmp_path / "elsewhere.json").write_text('{"loss": 0.0}')
    meta.unlink()
    meta.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(CorruptCheckpointError, match="user_metadata.json: cannot open it"):
        CheckpointManager(tmp_path / "r").step_metadata(1)


@pytest.mark.parametrize("where", ["local", "url"])
def test_resave_of_a_step_without_metadata_drops_the_old_metadata(tmp_path, where):
    """A step saved again without metadata= has none (the earlier save's
    user_metadata.json stayed, and step_metadata / keep_best_k read it)."""
    if where == "url":
        pytest.importorskip("fsspec")
        import uuid
        root = f"memory://dcpx-resave-{uuid.uuid4().hex[:8]}"
    else:
        root = tmp_path
    for mode in ("sync", "async"):
        with CheckpointManager(root, async_mode=mode) as ckpt:
            ckpt.save(5, _state(1), metadata={"loss": 0.5})
            assert ckpt.step_metadata(5) == {"loss": 0.5}
            ckpt.save(5, _state(2))
            ckpt.wait()
            assert ckpt.step_metadata(5) == {}
            ckpt.save(5, _state(3), metadata={"loss": 0.25})
            ckpt.wait()
        assert CheckpointManager(root).step_metadata(5) == {"loss": 0.25}
