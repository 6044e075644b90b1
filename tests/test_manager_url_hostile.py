"""CheckpointManager and dcpx.load on a URL root that is damaged or
misused (issue 31, items 9 and 10): a damaged newest step on ``memory://``
is passed over as on a local root, a damaged URL checkpoint raises
CorruptCheckpointError (not torch's bare CheckpointException, a
BaseException that ``except Exception`` misses), best-K ranks any JSON
number, user metadata is refused at save when it could not be read back,
and ``load(root=...)`` of a root that is not there says so."""
from __future__ import annotations

import os
import uuid
import warnings

import pytest
import torch

import dcpx
from dcpx.manager import CheckpointManager, StepSkippedWarning

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def mem_root():
    fs = fsspec.filesystem("memory")
    root = f"/dcpx-mgr-url-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _damage(url: str, how: str) -> None:
    """Flip a byte inside ``w``'s tensor bytes, or remove its data file."""
    from dcpx.fsspec import FsspecReader
    fs, root = fsspec.core.url_to_fs(url)
    md = FsspecReader(url).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    path = f"{root}/{info.relative_path}"
    if how == "missing":
        fs.rm(path)
        return
    raw = bytearray(fs.cat_file(path))
    raw[info.offset + info.length - 30] ^= 0x40
    fs.pipe_file(path, bytes(raw))


@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_damaged_url_checkpoint_raises_corrupt_checkpoint_error(mem_root, how):
    url = f"{mem_root}/ck"
    dcpx.save({"w": torch.arange(64.0), "step": 3}, checkpoint_id=url)
    _damage(url, how)
    # before: torch's bare CheckpointException, which is no CorruptCheckpointError
    with pytest.raises(dcpx.CorruptCheckpointError) as e:
        dcpx.load({"w": torch.zeros(64), "step": 0}, checkpoint_id=url)
    assert url in str(e.value) and "dcpx-fsspec-" not in str(e.value), str(e.value)
    assert isinstance(e.value, Exception)          # `except Exception` catches it
    (inner, _), = e.value.failures.values()        # torch's failures kept
    assert isinstance(inner, dcpx.CorruptCheckpointError)


@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_manager_on_memory_root_falls_back_past_damaged_newest_step(mem_root, how):
    m = CheckpointManager(mem_root, async_mode="sync")
    m.save(1, {"w": torch.full((64,), 1.0)})
    m.save(2, {"w": torch.full((64,), 2.0)})
    _damage(f"{mem_root}/step-2", how)
    sd = {"w": torch.zeros(64)}
    with pytest.warns(StepSkippedWarning, match="step-2"):
        assert m.load(sd) == 1
    assert torch.equal(sd["w"], torch.full((64,), 1.0))
    m.close()


# ------------------------------------------------------------ item 10

def test_best_k_ranks_a_metric_past_float_range_and_retention_goes_on(tmp_path):
    """A metric of 10**400 (JSON holds it; float() of it overflows) made every
    retention pass fail with OverflowError from then on, keeping every step."""
    m = CheckpointManager(tmp_path, async_mode="sync", keep_latest_k=1, keep_best_k=1,
                          best_metric="loss", best_mode="min")
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # a failed retention pass warns
        m.save(1, {"w": torch.ones(2)}, metadata={"loss": 10 ** 400})
        m.save(2, {"w": torch.ones(2)}, metadata={"loss": 0.5})
        m.save(3, {"w": torch.ones(2)}, metadata={"loss": -10 ** 400})
        m.save(4, {"w": torch.ones(2)}, metadata={"loss": float("inf")})
        m.save(5, {"w": torch.ones(2)}, metadata={"loss": 0.25})
        m.wait_for_retention()
    assert m.best_steps() == [3]
    assert m.all_steps() == [3, 5]              # the best one and the newest one
    m.close()


def test_user_metadata_past_its_limit_is_refused_at_save(tmp_path):
    """An 80 MB metadata= was saved, then step_metadata() called it corrupt."""
    from dcpx.manager import checkpoint_manager as mgr
    m = CheckpointManager(tmp_path, async_mode="sync")
    big = {"notes": "x" * (mgr._MAX_USER_METADATA - 5)}
    with pytest.raises(ValueError, match="holds at most") as e:
        m.save(1, {"w": torch.ones(2)}, metadata=big)
    assert str(mgr._MAX_USER_METADATA) in str(e.value)
    assert m.all_steps() == [] and not (tmp_path / "step-1").exists()   # nothing written
    ok = {"notes": "x" * (mgr._MAX_USER_METADATA - 20)}                # at the limit: read back
    m.save(2, {"w": torch.ones(2)}, metadata=ok)
    assert m.step_metadata(2) == ok
    m.close()


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_load_from_a_root_that_is_not_there_raises(tmp_path, mem_root, kind):
    """load(root=<typo>) returned None like a fresh run, and training went on
    from scratch; a fresh run of the manager's own root still returns None."""
    base = str(tmp_path) if kind == "local" else mem_root
    m = CheckpointManager(f"{base}/mine", async_mode="sync")
    sd = {"w": torch.zeros(2)}
    assert m.load(sd) is None                    # own root, fresh run: None, no error
    with pytest.raises(dcpx.IncompleteCheckpointError, match="does not exist") as e:
        m.load(sd, root=f"{base}/pretrianed")
    assert isinstance(e.value, FileNotFoundError) and "pretrianed" in str(e.value)
    other = CheckpointManager(f"{base}/pretrained", async_mode="sync")
    other.save(7, {"w": torch.ones(2)})
    assert m.load(sd, root=f"{base}/pretrained") == 7 and torch.equal(sd["w"], torch.ones(2))
    other.delete(7)
    with pytest.raises(dcpx.IncompleteCheckpointError, match="holds no committed step"):
        m.load(sd, root=f"{base}/pretrained")
    other.close()
    m.close()


# ------------------------------------------------------------ item 11 (manager, tier names)

def test_names_with_a_trailing_newline_are_not_steps_pieces_or_files(tmp_path):
    """``re``'s "$" matches before a final newline: a folder "step-9\\n" was
    the manager's step 9 (whose checkpoint_id, root/step-9, is another
    folder), and a piece index could name "__0_0.distcp\\n"."""
    import shutil
    from dcpx.storage import pieces as _pieces
    m = CheckpointManager(tmp_path, async_mode="sync")
    m.save(1, {"w": torch.ones(2)})
    shutil.copytree(tmp_path / "step-1", tmp_path / "step-9\n")
    assert m.all_steps() == [1]
    assert m.load({"w": torch.zeros(2)}) == 1
    m.close()
    assert not _pieces.STEP_RE.match("step-9\n")
    assert not _pieces.KEY_RE.match("r1-s2\n") and not _pieces.PIECE_RE.match("rank-0-of-2\n")
    index = _pieces.encode_index([[".metadata", 3, 0], ["__0_0.distcp\n", 3, 0]])
    with pytest.raises(dcpx.CorruptCheckpointError, match="not \\(checkpoint file name"):
        _pieces.decode_index(index, "peer 1")


def test_removing_a_linked_piece_folder_removes_the_link_only(tmp_path):
    """A piece destination that is a link (to a folder elsewhere): removing
    it left a ".deleting-" link behind for good (rmtree refuses links, and
    the debris sweep used rmtree too); what it points to is never touched."""
    from dcpx.storage import pieces as _pieces
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    step = tmp_path / "local" / "step-3" / "j0123abcd-g1-bx-s1"
    step.mkdir(parents=True)
    (step / "rank-0-of-1").symlink_to(target, target_is_directory=True)
    _pieces.remove_tree(step / "rank-0-of-1")
    assert os.listdir(step) == []
    assert (target / "keep.txt").read_text() == "mine"
    # debris an earlier version left: swept, link only
    os.symlink(target, step / ".deleting-rank-0-of-1-0123abcd")
    _pieces.remove_debris(tmp_path / "local")
    assert os.listdir(step) == [] and (target / "keep.txt").read_text() == "mine"
