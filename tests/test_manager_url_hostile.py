"""CheckpointManager and dcpx.load on a URL root that is damaged or
misused (issue 31, items 9 and 10): a damaged newest step on ``memory://``
is passed over as on a local root, a damaged URL checkpoint raises
CorruptCheckpointError (not torch's bare CheckpointException, a
BaseException that ``except Exception`` misses), best-K ranks any JSON
number, user metadata is refused at save when it could not be read back,
and ``load(root=...)`` of a root that is not there says so."""
from __future__ import annotations

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
