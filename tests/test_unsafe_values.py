"""Values outside the safe-load list (issue 22, item 3): a save warns, once
per key, naming the key and the remedy; CheckpointManager raises the safe
loader's refusal at once (it is not damage: older steps are not tried) and
passes load_options (allow_pickle...) to its reader."""
from __future__ import annotations

import uuid
import warnings

import pytest
import torch

import dcpx
from dcpx.errors import UnsafeCheckpointError, UnsafeValueWarning
from dcpx.manager import CheckpointManager, StepSkippedWarning


class Box:
    """A plain class: its pickle names tests' module, not on the list."""

    def __init__(self, v=0):
        self.v = v


def _key() -> str:
    return f"box_{uuid.uuid4().hex[:8]}"  # the warning is once per key and process


def test_save_warns_once_per_key_naming_key_and_remedy(tmp_path):
    key = _key()
    with pytest.warns(UnsafeValueWarning, match=rf"the value of '{key}' \(a [\w.]*Box\) pickles "
                                                r"[\w.]*Box, which dcpx's safe loader refuses"
                                                r".*add_safe_globals.*allow_pickle=True"):
        dcpx.save({"w": torch.ones(2), key: Box(1)}, checkpoint_id=tmp_path / "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dcpx.save({"w": torch.ones(2), key: Box(2)}, checkpoint_id=tmp_path / "b")
    with pytest.raises(UnsafeCheckpointError):  # what the warning announced
        dcpx.load({"w": torch.zeros(2), key: None}, checkpoint_id=tmp_path / "a")


def test_nested_and_async_saves_warn(tmp_path):
    key = _key()
    with pytest.warns(UnsafeValueWarning, match=rf"'{key}.cfg'"):
        dcpx.async_save({key: {"cfg": [1, Box()]}}, checkpoint_id=tmp_path).result()


def test_no_warning_for_values_the_loader_takes(tmp_path):
    np = pytest.importorskip("numpy")
    sd = {"i": 3, "f": 1.5, "s": "x", "none": None, "b": b"\x00", "d": {"a": [1, (2.0, "y")]},
          "t": torch.arange(3), "set": {1, 2}, "np_state": np.random.get_state(),
          "arr": np.arange(4.0), "gen": torch.Generator().get_state(), "dt": torch.float16}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dcpx.save(sd, checkpoint_id=tmp_path / "a")
        dcpx.save(sd, checkpoint_id=tmp_path / "b")  # the scan's verdict, cached
        with torch.serialization.safe_globals([Box]):  # allowed by the user: loads
            dcpx.save({_key(): Box()}, checkpoint_id=tmp_path / "c")


def test_numpy_random_state_warns(tmp_path):
    np = pytest.importorskip("numpy")
    key = _key()
    with pytest.warns(UnsafeValueWarning, match=rf"'{key}' \(a numpy.random.mtrand.RandomState\)"
                                                r".*rng.get_state\(\)"):
        dcpx.save({key: np.random.RandomState(0)}, checkpoint_id=tmp_path)


@pytest.mark.parametrize("verify", ["commit", "full"])
def test_manager_raises_refusal_at_once(tmp_path, verify):
    """Two steps hold the refused value: the load raises the refusal (with
    the manager's remedy) instead of skipping to older steps and ending in
    'no step loads'; load_options={'allow_pickle': True} loads it."""
    key = _key()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeValueWarning)
        with CheckpointManager(tmp_path, async_mode="sync") as ckpt:
            for step in (1, 2):
                ckpt.save(step, {"w": torch.full((2,), float(step)), key: Box(step)})
    state = {"w": torch.zeros(2), key: None}
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepSkippedWarning)
        with pytest.raises(UnsafeCheckpointError, match=r"step-2.*refusing to unpickle global "
                                                        r"[\w.]*Box.*load_options=\{'allow_pickle'"):
            CheckpointManager(tmp_path, verify=verify).load(state)
    mgr = CheckpointManager(tmp_path, verify=verify, load_options={"allow_pickle": True})
    assert mgr.load(state) == 2
    assert isinstance(state[key], Box) and state[key].v == 2
    assert torch.equal(state["w"], torch.full((2,), 2.0))


def test_manager_load_options_checked(tmp_path):
    with pytest.raises(ValueError, match=r"load_options takes \['allow_pickle', 'thread_count', "
                                         r"'verify'\].*\['allow_pickel'\]"):
        CheckpointManager(tmp_path, load_options={"allow_pickel": True})


def test_a_value_too_large_to_walk_is_scanned_once_per_key_and_type(tmp_path, monkeypatch):
    """A value with more items than the walk looks at has no signature; the
    scan's all-clear is kept per key and type, so saving the same state dict
    again does not scan its pickle again (it did on every save)."""
    import dcpx.formats.values as values
    scans = []
    real = values.refused_globals
    monkeypatch.setattr(values, "refused_globals", lambda data: scans.append(1) or real(data))
    key = _key()
    big = list(range(5000))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            dcpx.save({"w": torch.ones(2), key: big}, checkpoint_id=tmp_path / f"s{i}")
    assert len(scans) == 1
    # another type under the key is judged again
    dcpx.save({key: tuple(big)}, checkpoint_id=tmp_path / "d")
    assert len(scans) == 2
    # a large value the loader refuses still warns (once)
    other = _key()
    with pytest.warns(UnsafeValueWarning, match=rf"'{other}'"):
        dcpx.save({other: big + [Box()]}, checkpoint_id=tmp_path / "r0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dcpx.save({other: big + [Box()]}, checkpoint_id=tmp_path / "r1")
    assert len(scans) == 3
