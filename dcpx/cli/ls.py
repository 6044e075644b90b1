"""``dcpx ls ROOT``: the checkpoints under a run's root directory.

Step folders are ``step-{N}`` (torchtitan's naming, which
``dcpx.CheckpointManager`` uses too); any other directory holding a DCP
checkpoint, committed or not, is listed after them.  A checkpoint is
committed when its ``.metadata`` exists: dcpx and torch write it last, by
an atomic rename, so a directory with data files and no ``.metadata`` is a
save that is still running or was interrupted."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

from ..filesystem import LOCAL_PROTOCOLS, METADATA_FN, local_path, url_protocol
from ..filesystem import DELETING_PREFIX, STEP_RE, local_step
from ._common import CliError, NoCheckpoint, human

HELP = ("list the checkpoints under a directory or URL (s3://, memory://...): step, size, "
        "committed or not, age")

# what CheckpointManager calls step N (its folders are step-N, no leading zeros)
_STEP = STEP_RE


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f}{unit}"
    return f"{seconds:.0f}s"


def _looks_like_checkpoint(d: Path) -> bool:
    try:
        return any(n == METADATA_FN or n.endswith(".distcp") or n.startswith(METADATA_FN)
                   for n in os.listdir(d))
    except OSError:
        return False


def describe(d: Path, now: float) -> Optional[dict]:
    """The row of the folder ``d``; None if it is gone (a retention pass
    renamed it away after the listing)."""
    try:
        return _describe(d, now)
    except FileNotFoundError:
        return None


def _describe(d: Path, now: float) -> dict:
    size = 0
    newest = 0.0
    try:
        names = os.listdir(d)
    except OSError:
        names = []
    for n in names:
        try:
            st = os.stat(d / n, follow_symlinks=False)
        except OSError:
            continue
        size += st.st_size
        newest = max(newest, st.st_mtime)
    meta = d / METADATA_FN
    committed = meta.is_file()
    when = meta.stat().st_mtime if committed else (newest or d.stat().st_mtime)
    m = _STEP.match(d.name)
    return {"name": d.name, "step": int(m.group(1)) if m else None, "bytes": size,
            "committed": committed, "mtime": when, "age_s": round(now - when, 3)}


def _url_row(fs, path: str, name: str, now: float) -> Optional[dict]:
    """A row for the folder ``path`` of an fsspec store, or None if it holds
    no checkpoint file.  Sizes and times are what the store's listing says
    (the time blank where the store gives none)."""
    try:
        infos = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return None
    files = {i["name"].rstrip("/").rsplit("/", 1)[-1]: i for i in infos if i.get("type") == "file"}
    if not (_STEP.match(name) or any(n == METADATA_FN or n.endswith(".distcp") for n in files)):
        return None
    from ..filesystem import info_mtime
    committed = METADATA_FN in files
    if committed:
        when = info_mtime(files[METADATA_FN])
    else:
        times = [t for t in map(info_mtime, files.values()) if t is not None]
        when = max(times) if times else None
    m = _STEP.match(name)
    return {"name": name, "step": int(m.group(1)) if m else None,
            "bytes": sum(int(i.get("size") or 0) for i in files.values()),
            "committed": committed, "mtime": when,
            "age_s": None if when is None else round(now - when, 3)}


def list_url(root: str) -> list[dict]:
    """``list_root`` for a URL root (``s3://``, ``memory://``...), through
    the fsspec storage ``checkpoint_id`` URLs use (dcpx/fsspec.py)."""
    from ..fsspec import url_to_fs
    try:
        fs, path = url_to_fs(root, {})
    except ImportError as e:
        raise CliError(str(e)) from e
    path = path.rstrip("/") or path
    if fs.isfile(path):
        raise NoCheckpoint(f"{root}: not a directory")
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        entries = None
    if entries is None or (not entries and not fs.isdir(path)):
        raise NoCheckpoint(f"{root}: no such directory")
    now = time.time()
    row = _url_row(fs, path, root, now)
    if row is not None:                    # ROOT is itself a checkpoint
        return [row]
    rows = []
    for info in entries:
        if info.get("type") != "directory":
            continue
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        row = _url_row(fs, f"{path}/{name}", name, now)
        if row is not None:
            rows.append(row)
    rows.sort(key=lambda x: (x["step"] is None, x["step"] if x["step"] is not None else 0,
                             x["name"]))
    return rows


def list_root(root: str) -> list[dict]:
    proto = url_protocol(root)
    if proto is not None and proto not in LOCAL_PROTOCOLS:
        return list_url(root)
    r = local_path(root) if proto is not None else Path(root)
    if not r.exists():
        raise NoCheckpoint(f"{r}: no such directory")
    if not r.is_dir():
        raise NoCheckpoint(f"{r}: not a directory")
    now = time.time()
    if _looks_like_checkpoint(r):          # ROOT is itself a checkpoint
        row = _describe(r, now)
        row["name"] = str(r)
        return [row]
    rows = []
    for name in os.listdir(r):
        if name.startswith(DELETING_PREFIX):
            continue  # CheckpointManager's deletion in progress: never a checkpoint
        d = r / name
        # steps by the manager's rule (links to folders included), other
        # folders holding a checkpoint (not through a link)
        if (local_step(r, name) is not None
                or (d.is_dir() and not d.is_symlink() and _looks_like_checkpoint(d))):
            row = describe(d, now)
            if row is not None:
                rows.append(row)
    rows.sort(key=lambda x: (x["step"] is None, x["step"] if x["step"] is not None else 0,
                             x["name"]))
    return rows


def add_parser(sub, **common) -> None:
    p = sub.add_parser("ls", help=HELP, description=HELP + ".", **common)
    p.add_argument("root")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(run=run)


def run(args, out=None) -> int:
    out = out or sys.stdout
    rows = list_root(args.root)
    if args.json:
        json.dump(rows, out, indent=1)
        print(file=out)
        return 0
    if not rows:
        print(f"{args.root}: no checkpoints", file=out)
        return 0
    w = max(len(r["name"]) for r in rows)
    print(f"{'NAME':<{w}}  {'STEP':>8}  {'SIZE':>10}  {'COMMITTED':<9}  AGE", file=out)
    for r in rows:
        step: Optional[int] = r["step"]
        print(f"{r['name']:<{w}}  {'-' if step is None else step:>8}  {human(r['bytes']):>10}  "
              f"{'yes' if r['committed'] else 'no':<9}  "
              f"{'' if r['age_s'] is None else _age(r['age_s'])}".rstrip(), file=out)
    return 0
