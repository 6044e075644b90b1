"""A load touches only the data files it reads (issue 28 item 4).

Before, every rank checked every data file of the checkpoint when it opened
it (an lstat each, and an open and a read of each file's end), and the C
reader opened every file the metadata names: 2R^2 file-system calls per
load at R ranks.  Now each file is checked when a load first reads from
it (dcpx.coordination.readplan.need_files), with the same checks: regular,
no link, every extent inside the file."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import dcpx
from dcpx.coordination import readplan as _readplan
from dcpx.errors import CorruptCheckpointError

from conftest import assert_bit_equal

NFILES = 48


@pytest.fixture(autouse=True)
def _fresh_cache():
    _readplan.clear()
    yield
    _readplan.clear()


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """A torch-written checkpoint of NFILES data files, one key each (as
    NFILES ranks write one file each), and a bytes value in one more."""
    path = tmp_path_factory.mktemp("many") / "c"
    sd = {f"k{i:02d}": torch.arange(6, dtype=torch.float32) + i for i in range(NFILES)}
    sd["v"] = {"step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(
            path, thread_count=NFILES + 1, single_file_per_rank=False))  # no group: one process
    files = [f for f in os.listdir(path) if f.endswith(".distcp")]
    assert len(files) == NFILES + 1
    return path, sd


class _Touched:
    """The paths os.lstat / os.stat / os.open are called on while active."""

    def __init__(self, monkeypatch) -> None:
        self.paths: list = []
        for name in ("lstat", "stat", "open"):
            real = getattr(os, name)

            def wrap(p, *a, __real=real, **kw):
                self.paths.append(os.path.basename(os.fspath(p)))
                return __real(p, *a, **kw)
            monkeypatch.setattr(os, name, wrap)

    def data_files(self) -> set:
        return {p for p in self.paths if p.endswith(".distcp")}


def _file_of(path, key: str) -> str:
    md = dcpx.FileSystemReader(path).read_metadata()
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == key]
    return info.relative_path


def _load(path, sd: dict) -> None:
    dcpx.load(sd, storage_reader=dcpx.FileSystemReader(path),
              planner=DefaultLoadPlanner(allow_partial_load=True))


@pytest.mark.parametrize("how", ["whole", "cast", "value"])
def test_load_touches_only_the_files_it_reads(many, monkeypatch, how):
    """Loading 2 of 48 keys (in place: the C plan; into another dtype:
    plan_reads; a bytes value) stats and opens those keys' files only."""
    path, sd = many
    if how == "value":
        want = {"v": {"step": None}}
        keys = ["v.step"]
    else:
        dtype = torch.float32 if how == "whole" else torch.float64
        want = {k: torch.zeros(6, dtype=dtype) for k in ("k03", "k30")}
        keys = list(want)
    expect = {_file_of(path, k) for k in keys}
    touched = _Touched(monkeypatch)
    _load(path, want)
    assert touched.data_files() == expect, sorted(touched.data_files())
    if how == "value":
        assert want == {"v": {"step": 7}}
    else:
        for k, t in want.items():
            assert_bit_equal(t, sd[k].to(t.dtype), k)
    # a second load of the same layout (the cached plan) touches them again only
    touched.paths.clear()
    _load(path, want)
    assert touched.data_files() <= expect


def test_unread_files_are_not_checked_and_read_ones_are(many, tmp_path):
    """A file the load does not read may be anything (torch's load does not
    look at it either); one it reads gets the checks it always got, at
    open time, with their errors naming the file and the key."""
    src, sd = many
    path = tmp_path / "c"
    path.mkdir()
    for f in os.listdir(src):
        (path / f).write_bytes((src / f).read_bytes())
    link, fifo, short = _file_of(path, "k05"), _file_of(path, "k06"), _file_of(path, "k07")
    outside = tmp_path / "outside"
    outside.write_bytes((path / link).read_bytes())
    os.unlink(path / link)
    os.symlink(outside, path / link)
    os.unlink(path / fifo)
    os.mkfifo(path / fifo)
    data = (path / short).read_bytes()
    (path / short).write_bytes(data[:len(data) // 2])
    gone = _file_of(path, "k08")
    os.unlink(path / gone)
    want = {"k01": torch.zeros(6), "k40": torch.zeros(6)}
    _load(path, want)
    for k, t in want.items():
        assert_bit_equal(t, sd[k], k)
    for key, match in (("k05", "symbolic link"), ("k06", "FIFO|not a regular"),
                       ("k07", "outside the file"), ("k08", "missing")):
        for dtype in (torch.float32, torch.float64):  # the C plan, plan_reads
            _readplan.clear()
            with pytest.raises(CorruptCheckpointError, match=match) as e:
                _load(path, {key: torch.zeros(6, dtype=dtype), "k01": torch.zeros(6)})
            assert key in str(e.value)
