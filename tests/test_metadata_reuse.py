"""Reuse of the encoded metadata body (dcpx/formats/metadata.py, "Reuse of the
encoded body"; csrc/mdpickle.c's split form).

A save whose plan is reused writes the last save's encoding of the metadata
with only the data file names and storage_meta written afresh.  Every
.metadata below is read back with pickle.load (as torch's FileSystemReader
reads it) and with dcpx's reader, and must equal the Metadata the save
returned; the checkpoints load bit-exact with dcpx and with torch."""
from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

import dcpx
from conftest import assert_state_bit_equal, empty_like_state, fast_writer, kernel_copies
from dcpx import _C
from dcpx.coordination import plan as _plan
from dcpx.formats import metadata as _metadata


def _state(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{i}.w": torch.randn(3, i % 5 + 1, generator=g) for i in range(n)},
            "opt": {"step": 3, "lr": [0.1, 0.2], "m": torch.randn(4, generator=g)},
            "i8": torch.randint(-9, 9, (7,), dtype=torch.int8, generator=g)}


def _read_back(path, returned):
    """The .metadata at path, read by pickle (torch's way) and by dcpx,
    equals the returned Metadata; the checkpoint loads in both."""
    raw = (Path(path) / ".metadata").read_bytes()
    with open(Path(path) / ".metadata", "rb") as f:
        by_pickle = pickle.load(f)
    by_dcpx = _metadata.loads(raw, str(path))
    assert by_pickle == returned
    assert by_dcpx == returned
    assert by_pickle.storage_meta.checkpoint_id == Path(path)


def _load_both(path, want):
    got = empty_like_state(want)
    dcpx.load(got, checkpoint_id=path)
    assert_state_bit_equal(got, want)
    got = empty_like_state(want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(got, storage_reader=tdcp.FileSystemReader(path), no_dist=True)
    assert_state_bit_equal(got, want)


@pytest.fixture
def spliced(monkeypatch):
    """Counts the encodings that reused a cached middle."""
    real = _C.dump_metadata
    used = []

    def counting(*args, **kw):
        if kw.get("middle") is not None:
            used.append(len(kw["middle"]))
        return real(*args, **kw)
    monkeypatch.setattr(_C, "dump_metadata", counting)
    return used


@pytest.mark.parametrize("threads", [1, 3])
def test_saves_of_one_layout_reuse_the_encoding_for_any_path(tmp_path, spliced, threads):
    _plan.clear_plan_cache()
    sd = _state()
    # paths of different lengths and characters: storage_meta differs in size
    paths = [tmp_path / "a", tmp_path / ("long" * 30), tmp_path / "ü ñ" / "x", tmp_path / "a"]
    for i, path in enumerate(paths):
        sd["model"]["layer0.w"].fill_(float(i))
        md = dcpx.save(sd, storage_writer=fast_writer(path, thread_count=threads))
        assert len(spliced) == i  # the first save encodes, every later one reuses
        _read_back(path, md)
        _load_both(str(path), sd)
        names = {si.relative_path for si in md.storage_data.values()}
        assert len(names) == threads


def test_a_changed_layout_or_planner_data_is_encoded_afresh(tmp_path, spliced):
    _plan.clear_plan_cache()
    t = torch.arange(6.0)
    # same flat keys and tensors, other nesting: the plan is reused, its
    # planner_data (the mappings) is not
    a = {"a": {"b": t}, "s": "x"}
    b = {"a.b": t, "s": "x"}
    md = dcpx.save(a, checkpoint_id=tmp_path / "1")
    _read_back(tmp_path / "1", md)
    md = dcpx.save(b, checkpoint_id=tmp_path / "2")
    assert md.planner_data == {"a.b": ("a.b",), "s": ("s",)}
    _read_back(tmp_path / "2", md)
    _load_both(str(tmp_path / "2"), b)
    # a longer non-tensor value: same plan, other offsets and lengths
    b["s"] = "x" * 1000
    md = dcpx.save(b, checkpoint_id=tmp_path / "3")
    _read_back(tmp_path / "3", md)
    _load_both(str(tmp_path / "3"), b)
    assert spliced == []
    md = dcpx.save(b, checkpoint_id=tmp_path / "4")
    assert len(spliced) == 1
    _read_back(tmp_path / "4", md)
    _load_both(str(tmp_path / "4"), b)


def _metadata_with(md, names, checkpoint_id):
    """md with its data files renamed (the very str objects of ``names``)."""
    rename = {}
    storage = {}
    for ix, si in md.storage_data.items():
        if si.relative_path not in rename:
            rename[si.relative_path] = names[len(rename)]
        storage[ix] = _StorageInfo(rename[si.relative_path], si.offset, si.length)
    return Metadata(state_dict_metadata=md.state_dict_metadata, planner_data=md.planner_data,
                    storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id="s" * 36),
                    **({"version": md.version} if hasattr(md, "version") else {}))  # torch >= 2.9


def test_split_form_with_a_reused_middle_loads_to_the_new_metadata(tmp_path):
    sd = _state(n=300)
    md = dcpx.save(sd, storage_writer=fast_writer(tmp_path / "c", thread_count=2))
    first = _metadata_with(md, ("f0.distcp", "f1.distcp"), "/x")
    cell = [None]
    data = _metadata.dumps(first, _metadata.Splice(first, ("f0.distcp", "f1.distcp"),
                                                   cell, ["layout"], None))
    assert pickle.loads(data) == first == _metadata.loads(data, "x")
    assert cell[0] is not None and cell[0][0] == ["layout"]
    # other names (other lengths), another storage_meta: only those change
    names = ("__0_" + "9" * 300 + "_0.distcp", "g.distcp")
    second = _metadata_with(md, names, Path("/" + "y" * 500))
    data2 = _metadata.dumps(second, _metadata.Splice(second, names, cell, ["layout"],
                                                     cell[0][1]))
    _C.check_pickle(data2[:-_metadata._TRAILER.size])
    assert pickle.loads(data2) == second == _metadata.loads(data2, "x")
    assert second != first
    # as large as the standard form, give or take the names and the tail
    assert abs(len(data2) - len(_metadata.dumps(second))) < 1000


def test_a_splice_for_another_metadata_or_a_name_written_out_is_not_used(tmp_path):
    sd = _state(n=5)
    md = dcpx.save(sd, checkpoint_id=tmp_path / "c")
    name = next(iter(md.storage_data.values())).relative_path
    other = _metadata_with(md, ("x.distcp",), "/x")
    cell = [None]
    # the splice is for md, not other: the standard form
    data = _metadata.dumps(other, _metadata.Splice(md, (name,), cell, [], None))
    assert data == _metadata.dumps(other) and cell == [None]
    # a name given as an equal but distinct str is written out in the
    # middle: correct once, never cached
    copy = "".join(["x.", "distcp"])
    data = _metadata.dumps(other, _metadata.Splice(other, (copy,), cell, [], None))
    assert pickle.loads(data) == other and cell == [None]


# ------------------------------------------------ steady-state: the middle by parts

def test_steady_dumps_is_split_dumps_by_parts_with_a_combined_crc(tmp_path):
    """The steady-state save encodes only the names and storage_meta and
    combines the trailer's CRC from the parts': the bytes are split_dumps's
    with the same middle, for names and tails of other lengths."""
    md = dcpx.save(_state(n=120), storage_writer=fast_writer(tmp_path / "c"))
    names = ("__0_aa_0.distcp", "__1_aa_0.distcp")
    first = _metadata_with(md, names, "/x")
    data, middle, at = _metadata.split_dumps(first, names)
    assert middle is not None and data[at:at + len(middle)] == middle
    for names2, cid in ((names, "/x"), (("__0_" + "b" * 90 + "_0.distcp", "n"), "/" + "y" * 700)):
        second = _metadata_with(md, names2, cid)
        want = _metadata.split_dumps(second, names2, middle)[0]
        got = _metadata.steady_dumps(second, names2, middle, _C.crc32(middle))
        assert bytes(got) == want and got.size() == len(want)
        assert got.middle is middle and got.source is None
        assert pickle.loads(bytes(got)) == second == _metadata.loads(bytes(got), "x")
    # a wrong CRC for the middle is a wrong trailer: dcpx's reader refuses it
    bad = _metadata.steady_dumps(second, names2, middle, _C.crc32(middle) ^ 1)
    with pytest.raises(dcpx.CorruptCheckpointError):
        _metadata.loads(bytes(bad), "x")


class _W:
    """What dcpx.storage.commit.commit uses of a writer."""

    def __init__(self, path):
        self.path, self.rank, self.save_id = Path(path), 0, "sid"
        self.sync_files, self.use_collectives = False, True
        self._save_lock = self._commit_check = None

    def _metadata_path(self):
        return self.path / ".metadata"

    def _discard_own(self):
        pass

    def _remove_unreferenced(self, *args):
        pass

    def _release_tag(self):
        pass


@pytest.mark.parametrize("case", ["copied", "aligned", "no-source", "gone", "changed", "exdev",
                                  "short"])
def test_a_spliced_commit_copies_the_middle_only_from_the_file_it_wrote(tmp_path, case,
                                                                        monkeypatch):
    """dcpx.storage.commit writes a Spliced's middle by copy_file_range
    from its source while that file is the one it wrote, and from memory
    when there is none, it is gone or changed, or the kernel refuses or
    stops short; the file's bytes are the same every way."""
    import os

    from dcpx.storage import commit as _commit
    works = kernel_copies(tmp_path)
    pre, middle, post = b"P" * 10, bytes(range(256)) * 4000, b"T" * 7
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    # "aligned": the middle at the same offset in both files (whole blocks
    # copied, the partial blocks at its ends written)
    at = len(pre) if case == "aligned" else 3
    ident = _commit.commit(_W(tmp_path / "a"), None,
                           _metadata.Spliced(b"Q" * at, middle, b"", None))
    assert ident[2] == at + len(middle)
    src = _metadata.FileRegion(str(tmp_path / "a" / ".metadata"), at, ident)
    if case == "no-source":
        src = None
    elif case == "gone":
        os.unlink(tmp_path / "a" / ".metadata")
    elif case == "changed":
        with open(tmp_path / "a" / ".metadata", "r+b") as f:
            f.seek(100)
            f.write(b"\0")
        os.utime(tmp_path / "a" / ".metadata", ns=(0, ident[3] + 1))
    elif case == "exdev":
        def refuse(*args):
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    elif case == "short":
        real = os.copy_file_range
        calls = []

        def short(s, d, n, off=None):
            calls.append(n)
            return real(s, d, min(n, 1000), off) if len(calls) == 1 else 0
        monkeypatch.setattr(os, "copy_file_range", short)
    before = dict(_commit.MIDDLE_BYTES)
    _commit.commit(_W(tmp_path / "b"), None, _metadata.Spliced(pre, middle, post, src))
    assert (tmp_path / "b" / ".metadata").read_bytes() == pre + middle + post
    copied = _commit.MIDDLE_BYTES["copied"] - before["copied"]
    written = _commit.MIDDLE_BYTES["written"] - before["written"]
    assert copied + written == len(middle)
    bs = max(512, os.stat(tmp_path / "b" / ".metadata").st_blksize)
    whole = (len(middle) - (bs - len(pre))) // bs * bs
    want = {"copied": len(middle), "short": 1000, "aligned": whole}.get(case, 0) if works else 0
    assert copied == want, (case, copied, written)
