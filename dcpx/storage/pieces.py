"""Pieces: one rank's part of a step in the node-local tier, and the
persistent checkpoint assembled from them (docs/tiers.md).

A piece is an ordinary single-process dcpx checkpoint of one rank's state
dict (``.metadata`` with dcpx's trailer, data files whose records carry
their CRC-32s), in a folder whose path names everything a resume must
match::

    local_root/step-{N}/{save key}/rank-{R}-of-{W}/.metadata, __0_*.distcp

The save key ``j{job}-g{segment}-b{base}-s{seq}`` is the same on every rank
for one save and new for every save, so pieces of two saves of one step
never mix.  ``job`` names the persistent root (two jobs that share a
``local_root`` never read each other's pieces); a *segment* is a run of
saves since a manager started or resumed, numbered above every segment its
node saw, and ``base`` names the segment and step it resumed from (``x``:
none).  A resume follows these links back from the newest segment it
finds (:func:`lineage`), so a step of a run this one did not build on --
an earlier run's folder brought back by a node, a step abandoned by a
rollback -- is never loaded.  A piece is committed when its ``.metadata``
is there: a rank's own piece by dcpx's commit, a replica received from a
partner by renaming its complete (and checked) folder into place.

The persistent step is written from the pieces, not from training memory:
each data record is copied as it is (its zip archive is position
independent and holds its own CRC-32s; ``copy_file_range`` or ``sendfile``
where the kernel can, so the bytes do not pass through this process) into
one file per rank, and the merged ``.metadata`` -- the chunks of every
rank, a chunk that several ranks hold (a replicated tensor) written once --
commits it, as torch's planner deduplicates a save.  This module touches
files only; the messages that move pieces and metadata between ranks are
dcpx.manager.tiers'.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any, NamedTuple, Optional

from .. import _C
from . import locks as _locks
from ..formats import metadata as _metadata
from ..formats.files import _fsync_dir, check_zip_crcs, open_regular, read_regular
from .steps import DELETING_PREFIX, STEP_RE, remove_renamed as _remove
from ..errors import CorruptCheckpointError

# \Z, not $: "$" also matches before a trailing newline ("rank-0-of-2\n")
KEY_RE = re.compile(r"^j([0-9a-f]{8})-g([0-9a-f]{1,32})-b(x|([0-9a-f]{1,32})\.(0|[1-9][0-9]{0,18}))"
                    r"-s([1-9][0-9]{0,18})\Z")
PIECE_RE = re.compile(r"^rank-(0|[1-9][0-9]*)-of-([1-9][0-9]*)\Z")
_FILE_RE = re.compile(r"^(\.metadata|__\d+_[0-9a-f_]+\.distcp|__\d+_\d+\.distcp)\Z")
_INCOMING = ".incoming-"
#: in a replica: where its holes' bytes are (records of the receiver's own piece)
HOLES = ".holes"
_DELETING = DELETING_PREFIX
#: records start at this alignment in a data file (docs/format.md)
_ALIGN = 64


class Key(NamedTuple):
    """A save key, parsed: the job, the segment, the segment and step it
    built on (None: none), and the save's number in its segment."""
    job: str
    seg: int
    base: Optional[tuple]
    seq: int


#: the job's id, kept in the persistent root (made by the first manager with a local_root)
JOB_FILE = ".dcpx-tier-job"
_JOB_RE = re.compile(r"^[0-9a-f]{8}$")


def job_id(root: Any) -> str:
    """The job part of a save key: 8 hex digits kept in the persistent root
    (``root/.dcpx-tier-job``), made at random the first time.  A restart
    with the same root -- moved or copied with its files -- is the same job;
    another root is another job, whose pieces in a shared ``local_root`` are
    never read.  ``root``: the manager's root (a local folder or a URL's
    file system)."""
    if hasattr(root, "path"):
        path = Path(root.path) / JOB_FILE
        try:
            text = read_regular(path).decode("ascii", "replace").strip()
        except FileNotFoundError:
            text = ""
        if _JOB_RE.match(text):
            return text
        os.makedirs(root.path, exist_ok=True)
        new = uuid.uuid4().hex[:8]
        tmp = path.with_name(f"{JOB_FILE}.tmp.{uuid.uuid4().hex}")
        with open(tmp, "x") as f:
            f.write(new + "\n")
        try:
            os.link(tmp, path)  # never replaces an id another manager made meanwhile
        except FileExistsError:
            current = read_regular(path).decode("ascii", "replace").strip()
            if not _JOB_RE.match(current):  # not an id (damaged): ours replaces it
                os.replace(tmp, path)
        finally:
            if tmp.exists():
                os.unlink(tmp)
        return job_id(root)
    path = f"{root.root}/{JOB_FILE}"
    try:
        text = root.fs.cat_file(path).decode("ascii", "replace").strip()
    except FileNotFoundError:
        text = ""
    if _JOB_RE.match(text):
        return text
    new = uuid.uuid4().hex[:8]
    root.fs.pipe_file(path, (new + "\n").encode())
    return new


def save_key(job: str, seg: int, base: Optional[tuple], seq: int) -> str:
    b = "x" if base is None else f"{int(base[0]):x}.{int(base[1])}"
    return f"j{job}-g{int(seg):x}-b{b}-s{int(seq)}"


def parse_key(key: str) -> Optional[Key]:
    m = KEY_RE.match(key)
    if m is None:
        return None
    base = None if m.group(3) == "x" else (int(m.group(4), 16), int(m.group(5)))
    return Key(m.group(1), int(m.group(2), 16), base, int(m.group(6)))


def key_order(key: str) -> tuple:
    """Keys sort by segment, then by save: a later segment's save is newer."""
    k = parse_key(key)
    return (-1, -1) if k is None else (k.seg, k.seq)


def lineage(keys: Any) -> dict:
    """``{segment: newest step it may serve}`` for the segments a resume may
    load from, given the save keys found (of one job): the newest segment
    (any step), the segment it built on up to the step it resumed from, and
    so on back while the keys found say where each segment came from.  A
    segment off that line (a run this one did not build on) is absent."""
    parsed = [k for k in (parse_key(x) for x in keys) if k is not None]
    if not parsed:
        return {}
    bases = {k.seg: k.base for k in parsed}
    seg = max(bases)
    limit: Optional[int] = None
    out: dict = {}
    while True:
        out[seg] = limit
        base = bases.get(seg)
        if base is None or base[0] >= seg:  # a fresh start (or a key that points forward)
            return out
        limit = base[1] if limit is None else min(limit, base[1])
        seg = base[0]
        if seg not in bases:  # where it came from left no key here: the line ends
            out[seg] = limit
            return out


def piece_dir(local_root: Path, step: int, key: str, rank: int, world: int) -> Path:
    return Path(local_root) / f"step-{int(step)}" / key / f"rank-{int(rank)}-of-{int(world)}"


def _subdirs(path: Path, pattern: "re.Pattern[str]") -> list:
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        m = pattern.match(name)
        if m is not None and not os.path.islink(path / name) and os.path.isdir(path / name):
            out.append((name, m))
    return out


def scan(local_root: Path) -> list:
    """Every committed piece under ``local_root``: ``(step, key, rank,
    world)`` tuples.  A folder named otherwise (a replica still arriving, a
    deletion in progress) and a piece without ``.metadata`` are not pieces."""
    root = Path(local_root)
    out = []
    for sname, sm in _subdirs(root, STEP_RE):
        for kname, _ in _subdirs(root / sname, KEY_RE):
            for pname, pm in _subdirs(root / sname / kname, PIECE_RE):
                rank, world = int(pm.group(1)), int(pm.group(2))
                if rank < world and os.path.isfile(root / sname / kname / pname / ".metadata"):
                    out.append((int(sm.group(1)), kname, rank, world))
    return sorted(out)


def key_dirs(local_root: Path, job: str) -> dict:
    """{step: [key folder, ...]} of ``job``'s save keys under ``local_root``."""
    root = Path(local_root)
    out: dict = {}
    for sname, sm in _subdirs(root, STEP_RE):
        for kname, km in _subdirs(root / sname, KEY_RE):
            if km.group(1) == job:
                out.setdefault(int(sm.group(1)), []).append(root / sname / kname)
    return out


def remove_tree(path: Path, later: bool = False) -> Any:
    """Remove a step, key or piece folder: renamed first (it stops being one
    at once; several ranks of a node may race, the rename picks one), then
    its files -- on a thread of its own with ``later`` (freeing a step's
    pages of node memory takes a while; a kill meanwhile leaves a
    ``.deleting-`` folder, debris the next run removes; the thread is
    returned, to be joined).  Gone already: nothing to do."""
    hidden = path.parent / f"{_DELETING}{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, hidden)
    except FileNotFoundError:
        return
    if later:
        import threading
        t = threading.Thread(target=_remove_hidden, args=(hidden,), daemon=True,
                             name="dcpx-delete")
        t.start()
        return t
    _remove(hidden)
    return None


def _remove_hidden(hidden: Path) -> None:
    _remove(hidden)
    if STEP_RE.match(hidden.parent.name):
        try:
            os.rmdir(hidden.parent)  # the step folder, once nothing else is in it
        except OSError:
            pass


def remove_key(path: Path, later: bool = False) -> Any:
    """Remove a save key's folder (see remove_tree), and its step folder
    once that is empty (another job's keys or a save arriving keep it)."""
    t = remove_tree(path, later)
    try:
        os.rmdir(path.parent)
    except OSError:
        pass
    return t


def remove_debris(local_root: Path) -> None:
    """Folders a killed transfer or deletion left (``.incoming-``,
    ``.deleting-``), at any level of ``local_root``."""
    root = Path(local_root)
    stack = [root]
    for sname, _ in _subdirs(root, STEP_RE):
        stack.append(root / sname)
        stack += [root / sname / k for k, _ in _subdirs(root / sname, KEY_RE)]
    for d in stack:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if name.startswith((_INCOMING, _DELETING)):
                _remove(d / name)


def piece_bytes(piece: Path) -> int:
    """The bytes of a piece's files."""
    total = 0
    try:
        for entry in os.scandir(piece):
            if _FILE_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    except FileNotFoundError:
        return 0
    return total


# ------------------------------------------------------------ moving pieces
#
# A piece moves between ranks as an index (JSON: each file's name and size)
# and then the files' bytes, sent straight from the sender's files (mapped,
# read-only: the page cache) and received straight into the receiver's new
# files (mapped, shared): no buffer holds a copy of the piece on either
# side, and the sender reads its bytes once, to send them.  The receiver
# checks what arrived against the piece's own checksums (the metadata's
# trailer, every record's CRC-32) before it commits the folder: a replica
# damaged at its source or on the way is refused when it arrives, not when
# a resume needs it.

#: most bytes one received file may claim (a corrupt index is refused, not allocated)
_MAX_FILE = 1 << 46
#: most files a piece's index may list
_MAX_FILES = 4096


def _close_maps(maps: list) -> None:
    """Unmap; a mapping a tensor still exports (a send in flight) is freed
    with the tensor instead."""
    for mm in maps:
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass


def archive_digest(view: Any, read: Any = None) -> Optional[int]:
    """A record's fingerprint read from its zip archive's tail alone: the
    CRC-32 of its central directory and end records (every entry's name,
    size, CRC-32 and place).  Two records of one length with one digest
    hold the same bytes wherever the CRC-32s of their entries hold (the
    receiver checks those after it copies).  None: not a zip archive.
    ``view``: the record's bytes, or its length when ``read(offset, n)``
    gives them (a file read at the record's place: only its tail is read)."""
    n = view if read is not None else len(view)
    get = read if read is not None else (lambda a, k: bytes(view[a:a + k]))
    lo = max(0, n - (1 << 16) - 22)
    tail = get(lo, n - lo)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        return None
    cd_size = int.from_bytes(tail[at + 12:at + 16], "little")
    cd_off = int.from_bytes(tail[at + 16:at + 20], "little")
    if 0xFFFFFFFF in (cd_size, cd_off):  # zip64: the zip64 end record has them
        loc = tail.rfind(b"PK\x06\x07", 0, at)
        if loc < 0:
            return None
        end64 = int.from_bytes(tail[loc + 8:loc + 16], "little")
        rec = get(end64, 56) if 0 <= end64 <= n - 56 else b""
        if rec[:4] != b"PK\x06\x06":
            return None
        cd_off = int.from_bytes(rec[48:56], "little")
    if not 0 <= cd_off <= n or n - cd_off > (64 << 20):
        return None
    return _C.crc32(tail[cd_off - lo:] if cd_off >= lo else get(cd_off, n - cd_off))


def offer(piece: Path, md: Any) -> list:
    """What a receiver tells the rank whose replica it is about to receive:
    the tensor records of its own piece of the step, ``[fqn, offsets,
    length, digest]`` -- a sender does not send the bytes of a record the
    receiver holds already (a data-parallel replica: DDP, HSDP), it says
    which of these to copy.  Reads only each record's archive tail."""
    out: list = []
    fds: dict = {}
    try:
        for index, info in md.storage_data.items():
            if type(md.state_dict_metadata.get(index.fqn)).__name__ != "TensorStorageMetadata":
                continue
            rel = info.relative_path
            if rel not in fds:
                fds[rel] = open_regular(Path(piece) / rel)
            fd, base = fds[rel], info.offset
            digest = archive_digest(info.length, lambda a, k: os.pread(fd, k, base + a))
            if digest is not None:
                out.append([index.fqn, None if index.offset is None else list(index.offset),
                            info.length, digest])
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _map(path: Path) -> Any:
    import mmap
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        return _populate(mmap.mmap(fd, size, prot=mmap.PROT_READ), 22) if size else None
    finally:
        os.close(fd)


def _populate(mm: Any, advice: int) -> Any:
    """Map every page of ``mm`` now, in one call (MADV_POPULATE_READ 22 /
    _WRITE 23, Linux 5.14+), instead of a fault per 4 KiB page as the
    bytes are touched: three times faster on tmpfs.  Older kernels: as is."""
    try:
        mm.madvise(advice)
    except (OSError, ValueError, AttributeError):
        pass
    return mm


class Outgoing:
    """A committed piece's files, mapped for sending; ``index`` is what the
    receiver allocates them by.  :meth:`skip_held` leaves out of what is
    sent the records the receiver holds already (its offer): those are
    ``holes`` of the index, filled by the receiver from its own piece.
    Close it (or use ``with``) after the sends."""

    def __init__(self, piece: Path) -> None:
        self.piece = Path(piece)
        self.maps: list = []
        self.index: list = []
        self.fill: dict = {}     # file -> [(offset, length, source buffer)]: a replica's holes
        self.sources: list = []  # maps of the piece a replica's holes are in
        names = sorted(n for n in os.listdir(piece) if _FILE_RE.match(n))
        if ".metadata" not in names:
            raise CorruptCheckpointError(f"{piece}: not a committed piece (no .metadata)")
        try:
            for n in names:
                mm = _map(self.piece / n)
                self.maps.append(mm)
                self.index.append([n, 0 if mm is None else len(mm)])
            if os.path.exists(self.piece / HOLES):
                self._holes(dict(zip(names, self.maps)))
        except BaseException:
            self.close()
            raise

    def _holes(self, maps: dict) -> None:
        """A replica with holes: their bytes are read from the records of the
        receiver's own piece beside it, named in its ``.holes``."""
        what = f"{self.piece}: {HOLES}"
        try:
            got = json.loads(read_regular(self.piece / HOLES))
            src = self.piece.parent / got["from"]
            holes = got["holes"]
            assert PIECE_RE.match(src.name) and isinstance(holes, list)
        except Exception as e:  # noqa: BLE001 - any damage is the same refusal
            raise CorruptCheckpointError(f"{what} does not read: {e!r}") from None
        opened: dict = {}
        for h in holes:
            ok = (isinstance(h, list) and len(h) == 5 and h[0] in maps and isinstance(h[3], str)
                  and _FILE_RE.match(h[3]) and all(type(x) is int for x in (h[1], h[2], h[4])))
            if ok and h[3] not in opened:
                opened[h[3]] = _map(src / h[3])
                self.sources.append(opened[h[3]])
            size = len(maps[h[0]] or b"") if ok else 0
            source = opened.get(h[3]) if ok else None
            if not (ok and source is not None and 0 <= h[1] and 0 < h[2] <= size - h[1]
                    and 0 <= h[4] and h[2] <= len(source) - h[4]):
                raise CorruptCheckpointError(f"{what} names {str(h)[:200]}: not a record of "
                                             f"{src.name}")
            self.fill.setdefault(h[0], []).append((h[1], h[2], memoryview(source)[h[4]:h[4] + h[2]]))
        for v in self.fill.values():
            v.sort(key=lambda x: x[0])

    def skip_held(self, held: list, md: Any = None) -> int:
        """Mark the records ``held`` (a receiver's :func:`offer`) that this
        piece holds with the same length and digest as holes; returns the
        bytes that are then not sent.  ``md``: the piece's Metadata (read
        when not given)."""
        if not held:
            return 0
        md = md if md is not None else read_metadata(self.piece)
        want = {(e[0], None if e[1] is None else tuple(e[1])): (i, e[2], e[3])
                for i, e in enumerate(held)}
        where = {name: k for k, (name, _) in enumerate(self.index)}
        holes: dict = {}
        for index, info in md.storage_data.items():
            key = (index.fqn, None if index.offset is None else tuple(index.offset))
            got = want.get(key)
            k = where.get(info.relative_path)
            if got is None or k is None or got[1] != info.length or self.maps[k] is None:
                continue
            if info.offset + info.length > len(self.maps[k]):
                continue
            view = memoryview(self.maps[k])[info.offset:info.offset + info.length]
            if archive_digest(view) == got[2]:
                holes.setdefault(k, []).append([info.offset, info.length, got[0]])
        saved = 0
        for k, hs in holes.items():
            hs.sort()
            self.index[k] = [self.index[k][0], self.index[k][1], hs]
            saved += sum(h[1] for h in hs)
        return saved

    def views(self) -> list:
        """Per file of the index, the buffers to send, read-only: the file's
        bytes outside the holes the receiver fills itself; where this piece
        is a replica with holes of its own, their bytes from the piece they
        are in."""
        out = []
        for entry, mm in zip(self.index, self.maps):
            if mm is None:
                out.append([])
                continue
            views = []
            for a, b in segments(entry):
                pos = a
                for off, length, src in self.fill.get(entry[0], ()):
                    if off + length <= pos or off >= b:
                        continue
                    if off > pos:
                        views.append(memoryview(mm)[pos:off])
                    lo, hi = max(off, pos), min(off + length, b)
                    views.append(src[lo - off:hi - off])
                    pos = hi
                if pos < b:
                    views.append(memoryview(mm)[pos:b])
            out.append(views)
        return out

    def close(self) -> None:
        self.fill = {}
        _close_maps(self.maps + self.sources)
        self.maps, self.sources = [], []

    def __enter__(self) -> "Outgoing":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def segments(entry: list) -> list:
    """The byte ranges ``[start, end)`` of a file of the index that are
    sent: all of it but its holes."""
    size, holes = entry[1], (entry[2] if len(entry) > 2 else [])
    out, pos = [], 0
    for off, length, _ in holes:
        if off > pos:
            out.append((pos, off))
        pos = off + length
    if pos < size:
        out.append((pos, size))
    return out


def encode_index(index: list) -> bytes:
    return json.dumps(index).encode()


def decode_index(data: Any, what: str, offered: int = 0) -> list:
    """The index a sender sent, checked: every name a checkpoint file name
    (nothing else is ever written), each size an integer within bounds, a
    ``.metadata``, no name twice; a file's holes (records the receiver
    copies from its own piece, of the ``offered`` ones) sorted, apart and
    inside the file.  Anything else (not JSON, nested too deep, too many
    files) is a CorruptCheckpointError naming ``what``."""
    try:
        index = json.loads(bytes(data))
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{what}: the piece's index is not JSON: "
                                     f"{type(e).__name__}: {str(e)[:200]}") from None
    ok = isinstance(index, list) and len(index) <= _MAX_FILES
    for entry in index if ok else ():
        if not (isinstance(entry, list) and len(entry) in (2, 3) and isinstance(entry[0], str)
                and _FILE_RE.match(entry[0]) and type(entry[1]) is int
                and 0 <= entry[1] <= _MAX_FILE
                and (len(entry) == 2 or _holes_ok(entry[2], entry[1], offered))):
            raise CorruptCheckpointError(f"{what}: the piece's index holds {str(entry)[:200]}, "
                                         f"not (checkpoint file name, size[, holes])")
    names = [e[0] for e in index] if ok else []
    if not ok or ".metadata" not in names or len(set(names)) != len(names):
        raise CorruptCheckpointError(f"{what}: the piece's index is not a piece's")
    return index


def _holes_ok(holes: Any, size: int, offered: int) -> bool:
    if not isinstance(holes, list) or len(holes) > offered:
        return False
    pos = 0
    for h in holes:
        if not (isinstance(h, list) and len(h) == 3 and all(type(x) is int for x in h)
                and pos <= h[0] and 0 < h[1] <= size - h[0] and 0 <= h[2] < offered):
            return False
        pos = h[0] + h[1]
    return True


def verify_piece(files: dict, what: str, skip: Any = ()) -> Any:
    """Check a piece held in ``files`` (``{name: buffer or None}``) against
    its own checksums: the ``.metadata`` trailer, and every record the
    metadata names -- inside its file, a tensor's bytes matching the CRC-32
    of its archive (the CRC pass the receiver makes anyway), any other
    value's archive every CRC-32 of it -- but those at ``skip`` ((file,
    offset): holes, the receiver's own records).  Returns the Metadata;
    raises CorruptCheckpointError naming ``what`` and the record."""
    raw = files.get(".metadata")
    md = _metadata.loads(bytes(raw) if raw is not None else b"", f"{what}: .metadata")
    for index, info in md.storage_data.items():
        if (info.relative_path, info.offset) in skip:
            continue
        rel = info.relative_path
        if not (isinstance(rel, str) and _FILE_RE.match(rel) and rel in files):
            raise CorruptCheckpointError(f"{what}: record {index.fqn!r} is in {rel!r}, which "
                                         f"the piece lacks")
        buf = files[rel] if files[rel] is not None else b""
        if not (0 <= info.offset <= len(buf) and 0 <= info.length <= len(buf) - info.offset):
            raise CorruptCheckpointError(
                f"{what}: record {index.fqn!r} lies outside {rel!r} ({info.offset}, "
                f"{info.length} bytes of {len(buf)})")
        if getattr(info, "transform_descriptors", None):
            continue  # a compressed record (never in a piece): the load checks it
        view = memoryview(buf)[info.offset:info.offset + info.length]
        where = f"{what}: record {index.fqn!r}"
        try:
            rec = _C.parse_archive(view)
        except ValueError:  # not one tensor (a value), or damaged: every CRC then
            check_zip_crcs(bytes(view), where)
            continue
        if not rec["crc_ok"]:
            raise CorruptCheckpointError(f"{where}: its bytes fail their CRC-32 (damaged at "
                                         f"the source or on the way)")
    return md


class Incoming:
    """A piece being received into a new folder beside ``dest``: each file
    created at its size and mapped, so the bytes land in it directly;
    :meth:`commit` checks the piece (:func:`verify_piece`), syncs and renames
    the folder to ``dest`` (it appears complete or not at all); a piece
    already there (a damaged one being replaced, or the same save's received
    again) is replaced.  Without a commit, :meth:`close` removes the folder."""

    def __init__(self, dest: Path, index: list, what: str, sync: bool = True) -> None:
        import mmap
        self.dest, self.index, self.what, self.sync = Path(dest), index, what, sync
        os.makedirs(self.dest.parent, exist_ok=True)
        self.tmp: Optional[Path] = self.dest.parent / f"{_INCOMING}{self.dest.name}-{uuid.uuid4().hex[:8]}"
        os.mkdir(self.tmp)
        self.maps: list = []
        self.fds: list = []
        try:
            need = sum(e[1] for e in index)
            free = free_bytes(self.dest.parent)
            if free is not None and need > free:
                raise OSError(errno.ENOSPC, f"{what}: {need} bytes do not fit in the "
                              f"{free} free", str(self.dest.parent))
            for entry in index:
                name, size = entry[0], entry[1]
                fd = os.open(self.tmp / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             0o644)
                self.fds.append(fd)
                if not size:
                    self.maps.append(None)
                    continue
                os.ftruncate(fd, size)  # the holes stay holes: no memory, no disk
                mm = mmap.mmap(fd, size)
                self.maps.append(mm)
                for a, b in segments(entry):
                    # Reserved now: a full disk is an OSError here, never a
                    # SIGBUS when the mapping is written.
                    os.posix_fallocate(fd, a, b - a)
                    lo = a - a % mmap.PAGESIZE
                    try:
                        mm.madvise(23, lo, b - lo)  # MADV_POPULATE_WRITE (see _populate)
                    except (OSError, ValueError, AttributeError):
                        pass
        except BaseException:
            self.close()
            raise

    def views(self) -> list:
        """Per file of the index, the writable buffers its sent bytes land
        in (all of it but its holes)."""
        return [[] if mm is None else [memoryview(mm)[a:b] for a, b in segments(entry)]
                for entry, mm in zip(self.index, self.maps)]

    def keep_holes(self, own: Path, offered: list) -> int:
        """Record where the holes' bytes are: in the records of this rank's
        own piece ``own`` (a sibling folder of the same save) that it
        ``offered`` (its :func:`offer`).  They are not copied: the replica's
        files keep holes there and its ``.holes`` names the records, which
        an Outgoing of the replica sends in their place.  Returns the bytes
        left as holes."""
        holes = [(entry[0], h) for entry in self.index if len(entry) > 2 for h in entry[2]]
        if not holes:
            return 0
        assert self.tmp is not None
        if Path(own).parent != self.dest.parent:
            raise CorruptCheckpointError(f"{self.what}: its holes must point into a piece of "
                                         f"the same save")
        md = read_metadata(own)
        where = {(i.fqn, None if i.offset is None else tuple(i.offset)): info
                 for i, info in md.storage_data.items()}
        out = []
        for name, (off, length, i) in holes:
            fqn, offsets = offered[i][0], offered[i][1]
            info = where.get((fqn, None if offsets is None else tuple(offsets)))
            if info is None or info.length != length:
                raise CorruptCheckpointError(f"{self.what}: its record {fqn!r} is to be "
                                             f"read from this rank's piece, which lacks it")
            out.append([name, off, length, info.relative_path, info.offset])
        with open(self.tmp / HOLES, "x") as f:
            json.dump({"from": Path(own).name, "holes": out}, f)
        self.skip = {(h[0], h[1]) for h in out}
        return sum(h[2] for h in out)

    def commit(self) -> Any:
        """Check, sync and commit the piece; returns its Metadata."""
        assert self.tmp is not None
        md = verify_piece({e[0]: mm for e, mm in zip(self.index, self.maps)}, self.what,
                          getattr(self, "skip", ()))
        for fd in self.fds:  # (the mapped pages too: they are the file's)
            if self.sync:
                os.fsync(fd)
        self._release()
        if self.sync:
            _fsync_dir(self.tmp)
        if os.path.isdir(self.dest):
            remove_tree(self.dest)
        os.rename(self.tmp, self.dest)
        self.tmp = None
        if self.sync:
            _fsync_dir(self.dest.parent)
        return md

    def _release(self) -> None:
        _close_maps(self.maps)
        for fd in self.fds:
            os.close(fd)
        self.maps, self.fds = [], []

    def close(self) -> None:
        self._release()
        if self.tmp is not None:
            import shutil
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


# ---------------------------------------------------- the persistent step

def read_metadata(piece: Path) -> Any:
    """The piece's Metadata (dcpx's safe unpickler, trailer checked)."""
    path = Path(piece) / ".metadata"
    return _metadata.loads(read_regular(path), str(path))


def metadata_bytes(piece: Path) -> bytes:
    """The piece's ``.metadata`` file as it is (what rank 0 is sent: it
    parses it with dcpx's safe unpickler, trailer checked)."""
    return read_regular(Path(piece) / ".metadata")


def _chunk_key(index: Any) -> tuple:
    off = index.offset
    return (index.fqn, None if off is None else tuple(off))


def assign(metas: list) -> list:
    """Which rank writes which item of the persistent step: a list, per
    rank, of the keys (``MetadataIndex``) of its piece it writes.  An item
    that several ranks hold (a replicated tensor, a value every rank saved
    under one key: torch's ``dedup_save_plans`` keeps one of them too) goes
    to the rank with the fewest bytes so far; the sizes and dtypes of one
    key must agree across ranks."""
    owners: dict = {}
    order: list = []
    sizes: dict = {}
    for rank, md in enumerate(metas):
        for fqn, tmd in md.state_dict_metadata.items():
            shape = (type(tmd).__name__, tuple(getattr(tmd, "size", ()) or ()),
                     str(getattr(getattr(tmd, "properties", None), "dtype", None)))
            if sizes.setdefault(fqn, (shape, rank))[0] != shape:
                first, r0 = sizes[fqn]
                raise CorruptCheckpointError(
                    f"{fqn!r}: rank {r0} saved {first}, rank {rank} saved {shape}: the ranks' "
                    f"pieces of one step disagree")
        for index, info in md.storage_data.items():
            key = _chunk_key(index)
            if key not in owners:
                owners[key] = []
                order.append(key)
            owners[key].append((rank, index, info.length))
    load = [0] * len(metas)
    out: list = [[] for _ in metas]
    for key in order:
        rank, index, length = min(owners[key], key=lambda c: (load[c[0]], c[0]))
        load[rank] += length
        out[rank].append(index)
    return out


def layout(md: Any, keys: list, out_name: str) -> tuple:
    """Where the records ``keys`` of a piece go in one data file of the
    persistent step, each at a 64-byte aligned offset as dcpx writes them:
    ``({MetadataIndex: _StorageInfo}, [(source file, source offset, offset,
    length)], file size)``.  Rank 0 computes the same entries the writing
    rank does, from the piece's metadata alone."""
    by_file: dict = {}
    for k in keys:
        by_file.setdefault(md.storage_data[k].relative_path, []).append(k)
    entries, copies = {}, []
    pos = 0
    for rel, ks in by_file.items():
        if not isinstance(rel, str) or "/" in rel or rel.startswith(".") or not _FILE_RE.match(rel):
            raise CorruptCheckpointError(f"the piece's metadata names the data file {rel!r}")
        for k in sorted(ks, key=lambda k: md.storage_data[k].offset):
            info = md.storage_data[k]
            pos += (info.offset - pos) % _ALIGN  # keep the record's alignment
            copies.append((rel, info.offset, pos, info.length))
            entries[k] = dataclasses.replace(info, relative_path=out_name, offset=pos)
            pos += info.length
    return entries, copies, pos


#: copy_file_range / sendfile errors that mean "not between these files": fall back
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM,
                   errno.EBADF, errno.ENOTSUP)


def _kernel_copy(src_fd: int, dst_fd: int, src_off: int, dst_off: int, length: int,
                 how: list) -> None:
    """Copy ``length`` bytes between two files without passing them through
    this process where the kernel can: ``copy_file_range`` (a reflink or an
    in-kernel copy on one file system), else ``sendfile`` (across file
    systems: tmpfs to a disk), else ``pread`` / ``pwrite``.  ``how``: a
    one-element list naming the method that worked last (shared by the
    copies of one file)."""
    while length > 0:
        n = 0
        try:
            if how[0] == "copy_file_range":
                n = os.copy_file_range(src_fd, dst_fd, length, src_off, dst_off)
            elif how[0] == "sendfile":
                os.lseek(dst_fd, dst_off, os.SEEK_SET)
                n = os.sendfile(dst_fd, src_fd, src_off, length)
            else:
                data = os.pread(src_fd, min(8 << 20, length), src_off)
                n = len(data)
                view = memoryview(data)
                while view:
                    view = view[os.pwrite(dst_fd, view, dst_off + n - len(view)):]
        except OSError as e:
            if how[0] != "pread" and e.errno in _NO_KERNEL_COPY:
                how[0] = "sendfile" if how[0] == "copy_file_range" else "pread"
                continue
            raise
        if n == 0:
            raise CorruptCheckpointError(f"a data file of the piece ends {length} bytes early")
        src_off += n
        dst_off += n
        length -= n


def write_records(piece: Path, md: Any, keys: list, out: Any, out_name: str) -> tuple:
    """Copy the records ``keys`` of the piece into ``out`` -- a file
    descriptor (kernel copies, :func:`_kernel_copy`) or a binary file object
    written from its start -- laid out by :func:`layout`; returns
    ``(entries, method)`` (``method``: how the bytes were copied)."""
    entries, copies, size = layout(md, keys, out_name)
    fds: dict = {}
    how = ["copy_file_range" if hasattr(os, "copy_file_range") else "sendfile"]
    try:
        for rel, _, _, _ in copies:
            if rel not in fds:
                fds[rel] = open_regular(Path(piece) / rel)
        if isinstance(out, int):
            for rel, src, dst, length in copies:
                _kernel_copy(fds[rel], out, src, dst, length, how)
            os.ftruncate(out, size)  # (the alignment gaps are holes: zeros)
            return entries, how[0]
        pos = 0
        for rel, src, dst, length in copies:
            if dst > pos:
                out.write(b"\0" * (dst - pos))
            pos = dst + length
            while length > 0:
                data = os.pread(fds[rel], min(8 << 20, length), src)
                if not data:
                    raise CorruptCheckpointError(f"{piece}: {rel} ends {length} bytes early")
                out.write(data)
                src += len(data)
                length -= len(data)
        return entries, "write"
    finally:
        for fd in fds.values():
            os.close(fd)


def merge(metas: list, entries: list, checkpoint_id: str, save_id: str) -> Any:
    """The persistent step's Metadata: every rank's chunks that ``entries``
    (per rank, from :func:`write_records`) hold, in rank order."""
    from torch.distributed.checkpoint import metadata as md_mod
    sdm: dict = {}
    planner: dict = {}
    storage: dict = {}
    for md, written in zip(metas, entries):
        for k, v in (md.planner_data or {}).items():
            planner.setdefault(k, v)
        for index, info in written.items():
            storage[index] = info
            tmd = md.state_dict_metadata[index.fqn]
            if isinstance(tmd, md_mod.TensorStorageMetadata):
                if index.fqn not in sdm:
                    sdm[index.fqn] = md_mod.TensorStorageMetadata(tmd.properties, tmd.size, [])
                chunk = next(c for c in tmd.chunks if tuple(c.offsets) == tuple(index.offset))
                sdm[index.fqn].chunks.append(chunk)
            else:
                sdm.setdefault(index.fqn, tmd)
    for md in metas:  # tensors with no chunk (empty everywhere) keep their entry
        for fqn, tmd in md.state_dict_metadata.items():
            sdm.setdefault(fqn, tmd)
    kw: dict = {"state_dict_metadata": sdm, "planner_data": planner, "storage_data": storage}
    fields = {f.name for f in dataclasses.fields(md_mod.Metadata)}
    if "storage_meta" in fields and hasattr(md_mod, "StorageMeta"):
        kw["storage_meta"] = md_mod.StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id)
    if "version" in fields and getattr(metas[0], "version", None) is not None:
        kw["version"] = metas[0].version
    return md_mod.Metadata(**kw)


def data_file_name(rank: int, tag: str) -> str:
    return f"__{int(rank)}_{tag}_0.distcp"


def claim(step_dir: Path) -> Any:
    """A save lock in the persistent step's folder while this rank writes
    into it (the manager's retention sees a live save)."""
    return _locks.claim_save(Path(step_dir))


def commit_metadata(step_dir: Path, md: Any, sync: bool = True) -> None:
    """Write the merged ``.metadata`` atomically (temporary file, fsync,
    rename under the folder's commit lock): the persistent step commits."""
    step_dir = Path(step_dir)
    data = _metadata.dumps(md)
    tmp = step_dir / f".metadata.tmp.{uuid.uuid4().hex}"
    with _locks.dir_lock(step_dir):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, step_dir / ".metadata")
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if sync:
            _fsync_dir(step_dir)


def encode_metadata(md: Any) -> bytes:
    """``.metadata`` bytes with dcpx's trailer (for a URL root)."""
    return _metadata.dumps(md)


def is_enospc(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def free_bytes(path: Path) -> Optional[int]:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def metadata_of(data: bytes, what: str) -> Any:
    """A piece's Metadata from its ``.metadata`` bytes as a rank sent them
    (dcpx's safe unpickler, trailer checked)."""
    return _metadata.loads(bytes(data), what)
