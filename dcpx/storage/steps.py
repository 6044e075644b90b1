"""A run's layout on storage: its checkpoints in ``step-{N}`` folders
(torchtitan's ``_create_checkpoint_id`` naming), and the names a step takes
while it is deleted.  One rule for what a step is, shared by
``dcpx.CheckpointManager``, its node-local tier and ``dcpx ls``."""
from __future__ import annotations

import os
import re
from typing import Optional, Union

#: a step folder: ``step-{N}``
STEP_RE = re.compile(r"^step-(0|[1-9][0-9]*)\Z")  # \Z: "$" matches before a final "\n"
#: a step being deleted (renamed first, so that it is never seen as a step)
DELETING_PREFIX = ".deleting-"


def remove_renamed(path: Union[str, os.PathLike]) -> None:
    """Remove a folder renamed away for deletion (``DELETING_PREFIX``), or
    a link: a link goes alone, never what it points to (``rmtree`` refuses
    a link and left it behind).  The manager's steps and the tier's pieces
    are deleted by it."""
    import shutil
    if os.path.islink(path) or not os.path.isdir(path):
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    shutil.rmtree(path, ignore_errors=True)


def step_dir(step: int) -> str:
    """The folder name of ``step``."""
    return f"step-{int(step)}"


def local_step(root: Union[str, os.PathLike], name: str) -> Optional[int]:
    """The step number of the entry ``name`` of the local folder ``root``,
    or None when it is not a step.  A step is a folder (or a link to one)
    named ``step-{N}``; a file, a FIFO, a link to nothing or a link loop
    with that name is not."""
    m = STEP_RE.match(name)
    if m is None or not os.path.isdir(os.path.join(root, name)):
        return None
    return int(m.group(1))


def info_mtime(info: dict) -> Optional[float]:
    """A file's modification time (seconds since the epoch) from an fsspec
    ``ls(detail=True)`` / ``info`` entry, as the store names it (local:
    ``mtime``, memory: ``created``, s3: ``LastModified``); None if the
    store gives none."""
    t = info.get("mtime") or info.get("created") or info.get("LastModified")
    if hasattr(t, "timestamp"):
        t = t.timestamp()
    return float(t) if isinstance(t, (int, float)) else None
