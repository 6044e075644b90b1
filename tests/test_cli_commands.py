"""The ``dcpx`` command line (dcpx/cli/, docs/cli.md): ``ls``, ``inspect
--json``, ``diff``, ``convert`` in every direction between DCP, torch.save
and safetensors (single file and sharded with the Hugging Face index), a
torch-written and a 2-rank DTensor checkpoint as inputs, every dtype
safetensors has, bounded memory while converting, progress bars only on a
terminal.  ``verify``'s exit statuses and reports: tests/test_cli.py.

Outputs are checked with the other side's own loader: safetensors'
``load_file`` / ``safe_open``, ``torch.load(weights_only=True)``,
``torch.distributed.checkpoint.load``; bit for bit (conftest.assert_bit_equal).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from dcpx.cli import main
from dcpx.formats.metadata import METADATA_FN

from conftest import assert_bit_equal, make_tensor, safe_loader_takes_numpy, torch_save_supports

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import _TYPES as ST_TYPES  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _nested() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {
            "layer": {"w": make_tensor((16, 8), torch.float32, g),
                      "b": make_tensor((8,), torch.bfloat16, g)},
            "emb": make_tensor((10, 4), torch.float16, g),
            "idx": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "mask": make_tensor((5,), torch.bool, g),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
        },
        "step": 12,
        "run_name": "exp-7",
    }


def _flat(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _flat(v).items()})
        else:
            out[k] = v
    return out


def _cli(*argv) -> int:
    return main([str(a) for a in argv])


def _load_dcp(path: Path, like: dict) -> dict:
    """Load a DCP checkpoint with torch's own DCP (no process group) into
    fresh tensors shaped like ``like`` (a flat dict)."""
    sd = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in like.items()}
    tdcp.load(sd, checkpoint_id=str(path))
    return sd


def _assert_same(got: dict, want: dict, tensors_only: bool = False) -> None:
    want = {k: v for k, v in want.items() if isinstance(v, torch.Tensor) or not tensors_only}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert_bit_equal(got[k], v, k)
        else:
            assert got[k] == v, k


@pytest.fixture
def ckpt(tmp_path) -> tuple:
    sd = _nested()
    dcpx.save(sd, checkpoint_id=tmp_path / "ckpt")
    return tmp_path / "ckpt", _flat(sd)


# -- ls -----------------------------------------------------------------------

def test_ls_lists_steps_in_order_committed_or_not(tmp_path, capsys):
    root = tmp_path / "run"
    for n in (10, 2, 1):
        dcpx.save({"w": torch.zeros(1000 * n)}, checkpoint_id=root / f"step-{n}")
    dcpx.save({"w": torch.zeros(3)}, checkpoint_id=root / "best")
    dcpx.save({"w": torch.zeros(3)}, checkpoint_id=root / "step-3")
    os.unlink(root / "step-3" / METADATA_FN)           # a save that never committed
    (root / "logs").mkdir()                            # not a checkpoint
    (root / "logs" / "x.txt").write_text("x")
    old = time.time() - 7200
    os.utime(root / "step-1" / METADATA_FN, (old, old))
    assert _cli("ls", root, "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["step-1", "step-2", "step-3", "step-10", "best"]
    assert [r["step"] for r in rows] == [1, 2, 3, 10, None]
    assert [r["committed"] for r in rows] == [True, True, False, True, True]
    assert rows[3]["bytes"] > rows[1]["bytes"] > 4000 * 2   # sizes follow the data
    assert rows[0]["age_s"] >= 7200 - 60 and rows[1]["age_s"] < 3600
    assert _cli("ls", root) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "STEP", "SIZE", "COMMITTED", "AGE"]
    assert lines[3].split()[0] == "step-3" and lines[3].split()[-2] == "no", lines
    assert lines[1].split()[-1] == "2h", lines


def test_ls_step_numbers_are_the_managers(tmp_path, capsys):
    """``dcpx ls`` calls STEP what CheckpointManager resumes from: a folder
    ``step-007`` is not step 7 to the manager (which names steps
    ``step-7``), so ls lists it as a checkpoint without a step."""
    root = tmp_path / "run"
    for name in ("step-7", "step-007"):
        dcpx.save({"w": torch.zeros(3)}, checkpoint_id=root / name)
    assert dcpx.CheckpointManager(root).all_steps() == [7]
    assert _cli("ls", root, "--json") == 0
    rows = {r["name"]: r["step"] for r in json.loads(capsys.readouterr().out)}
    assert rows == {"step-7": 7, "step-007": None}


def test_ls_of_nothing_exits_2(tmp_path, capsys):
    assert _cli("ls", tmp_path / "missing") == 2
    assert "missing" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert _cli("ls", tmp_path / "f") == 2


def test_ls_url_root_memory(capsys):
    """``ls`` of a URL root goes through fsspec, as checkpoint_id URLs do;
    memory:// lives in this process, so the CLI runs in-process."""
    fsspec = pytest.importorskip("fsspec")
    import uuid
    root = f"memory://dcpx-ls-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        for n in (10, 2):
            dcpx.save({"w": torch.zeros(1000 * n)}, checkpoint_id=f"{root}/step-{n}")
        dcpx.save({"w": torch.zeros(3)}, checkpoint_id=f"{root}/best")
        dcpx.save({"w": torch.zeros(3)}, checkpoint_id=f"{root}/step-3")
        base = root.split("://", 1)[1]
        fs.rm(f"{base}/step-3/{METADATA_FN}")            # a save that never committed
        fs.pipe(f"{base}/logs/x.txt", b"x")              # not a checkpoint
        assert _cli("ls", root, "--json") == 0
        rows = json.loads(capsys.readouterr().out)
        assert [r["name"] for r in rows] == ["step-2", "step-3", "step-10", "best"]
        assert [r["step"] for r in rows] == [2, 3, 10, None]
        assert [r["committed"] for r in rows] == [True, False, True, True]
        for r in rows:                                   # size = the files' sizes, as listed
            files = fs.ls(f"{base}/{r['name']}", detail=True)
            assert r["bytes"] == sum(i["size"] for i in files) > 0
        assert rows[2]["bytes"] > rows[0]["bytes"] > 4000 * 2
        assert all(0 <= r["age_s"] < 3600 for r in rows)  # memory:// gives creation times
        assert _cli("ls", root) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split() == ["NAME", "STEP", "SIZE", "COMMITTED", "AGE"]
        assert lines[2].split()[0] == "step-3" and lines[2].split()[-2] == "no", lines
        assert _cli("ls", f"{root}/step-10", "--json") == 0   # ROOT is itself a checkpoint
        rows = json.loads(capsys.readouterr().out)
        assert [(r["name"], r["step"], r["committed"]) for r in rows] == [
            (f"{root}/step-10", None, True)]
        assert _cli("ls", f"{root}/missing") == 2
        assert "missing: no such directory" in capsys.readouterr().err
        assert _cli("ls", f"{root}/logs/x.txt") == 2
        assert "not a directory" in capsys.readouterr().err
    finally:
        if fs.exists(root.split("://", 1)[1]):
            fs.rm(root.split("://", 1)[1], recursive=True)


def test_ls_url_root_without_times_leaves_age_blank(capsys, monkeypatch):
    """A store whose listing gives no modification time: AGE is blank (and
    ``mtime``/``age_s`` null), the rest as usual."""
    fsspec = pytest.importorskip("fsspec")
    import uuid
    from fsspec.implementations.memory import MemoryFileSystem
    root = f"memory://dcpx-ls-{uuid.uuid4().hex}"
    dcpx.save({"w": torch.zeros(8)}, checkpoint_id=f"{root}/step-1")
    real_ls = MemoryFileSystem.ls

    def ls_without_times(self, path, detail=True, **kw):
        out = real_ls(self, path, detail=detail, **kw)
        return [{k: v for k, v in i.items() if k != "created"} for i in out] if detail else out

    monkeypatch.setattr(MemoryFileSystem, "ls", ls_without_times)
    try:
        assert _cli("ls", root, "--json") == 0
        rows = json.loads(capsys.readouterr().out)
        assert [(r["name"], r["committed"], r["mtime"], r["age_s"]) for r in rows] == [
            ("step-1", True, None, None)]
        assert _cli("ls", root) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[1].split() == ["step-1", "1", *lines[1].split()[2:4], "yes"], lines
    finally:
        fsspec.filesystem("memory").rm(root.split("://", 1)[1], recursive=True)


# -- inspect --json -------------------------------------------------------------

def test_inspect_json(ckpt, capsys):
    path, flat = ckpt
    assert _cli("inspect", path, "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tensors"] == 6 and d["values"] == 2
    w = d["keys"]["model.layer.w"]
    assert (w["dtype"], w["shape"], w["nbytes"]) == ("float32", [16, 8], 512)
    (shard,) = w["shards"]
    assert shard["offsets"] == [0, 0] and shard["sizes"] == [16, 8]
    assert shard["file"] in d["files"] and shard["length"] > 512
    assert d["keys"]["step"]["type"] == "value"
    assert d["tensor_bytes"] == sum(v.numel() * v.element_size() for v in flat.values()
                                    if isinstance(v, torch.Tensor))
    for f, n in d["files"].items():   # bytes of records referenced in each file
        assert 0 < n <= os.path.getsize(path / f)


# -- diff -----------------------------------------------------------------------

def test_diff_keys_shapes_dtypes_and_values(tmp_path, capsys):
    a = {"same": torch.arange(10.0), "gone": torch.zeros(2), "reshaped": torch.zeros(2, 3),
         "recast": torch.zeros(4), "nudged": torch.ones(100), "n": 1}
    b = {"same": torch.arange(10.0), "new": torch.zeros(2), "reshaped": torch.zeros(3, 2),
         "recast": torch.zeros(4, dtype=torch.float64), "nudged": torch.ones(100) + 1e-6, "n": 1}
    dcpx.save(a, checkpoint_id=tmp_path / "a")
    dcpx.save(b, checkpoint_id=tmp_path / "b")
    assert _cli("diff", tmp_path / "a", tmp_path / "a", "--values") == 0
    capsys.readouterr()
    assert _cli("diff", tmp_path / "a", tmp_path / "b") == 1
    out = capsys.readouterr().out.splitlines()
    assert "- gone" in out and "+ new" in out
    assert "~ reshaped: float32[2, 3] -> float32[3, 2]" in out
    assert "~ recast: float32[4] -> float64[4]" in out
    assert not any("nudged" in ln for ln in out)       # keys only by default
    assert _cli("diff", tmp_path / "a", tmp_path / "b", "--values") == 1
    out = capsys.readouterr().out
    assert "~ nudged: 100 of 100 elements differ bitwise" in out, out
    assert _cli("diff", tmp_path / "a", tmp_path / "b", "--atol", "1e-5") == 1
    out = capsys.readouterr().out
    assert "nudged" not in out and "4 difference(s)" in out, out
    assert _cli("diff", tmp_path / "a", tmp_path / "b", "--atol", "1e-8") == 1
    assert "nudged: 100 of 100 elements outside" in capsys.readouterr().out
    assert _cli("diff", tmp_path / "a", tmp_path / "missing") == 2


def test_diff_across_formats(ckpt, tmp_path, capsys):
    path, flat = ckpt
    assert _cli("convert", path, tmp_path / "m.pt") == 0
    assert _cli("diff", path, tmp_path / "m.pt", "--values") == 0
    emb = flat["model.emb"]
    emb[-1, -1] = 1.0 if emb[-1, -1] != 1.0 else 2.0
    torch.save(flat, tmp_path / "changed.pt")
    assert _cli("diff", path, tmp_path / "changed.pt", "--values") == 1
    assert "~ model.emb: 1 of 40 elements differ bitwise" in capsys.readouterr().out


# -- convert ----------------------------------------------------------------------

def test_dcp_to_torch_save(ckpt, tmp_path):
    path, flat = ckpt
    out = tmp_path / "model.pt"
    assert _cli("convert", path, out) == 0
    _assert_same(torch.load(out, weights_only=True), flat)
    # data.pkl is the very pickle torch.save writes for the same flat dict
    ref = tmp_path / "ref.pt"
    torch.save(flat, ref)
    with zipfile.ZipFile(out) as a, zipfile.ZipFile(ref) as b:
        pa = [n for n in a.namelist() if n.endswith("/data.pkl")]
        pb = [n for n in b.namelist() if n.endswith("/data.pkl")]
        assert a.read(pa[0]) == b.read(pb[0])
        assert a.testzip() is None                      # every CRC right
        assert [n.split("/", 1)[1] for n in a.namelist()] == \
            [n.split("/", 1)[1] for n in b.namelist()]


def test_dcp_to_safetensors_single(ckpt, tmp_path, capsys):
    path, flat = ckpt
    out = tmp_path / "model.safetensors"
    assert _cli("convert", path, out) == 0
    err = capsys.readouterr().err
    assert "skipped 1 value(s): step (int)" in err, err
    _assert_same(load_file(out), flat, tensors_only=True)
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "run_name": "exp-7"}


def test_dcp_to_safetensors_sharded(ckpt, tmp_path):
    path, flat = ckpt
    out = tmp_path / "hf"
    assert _cli("convert", path, out, "--max-shard-size", "600B") == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size()
                                                  for v in tensors.values())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                      for i in range(1, len(shards) + 1)]
    got = {}
    for s in shards:
        part = load_file(out / s)
        size = sum(v.numel() * v.element_size() for v in part.values())
        assert size <= 600 or len(part) == 1, (s, size)
        assert all(index["weight_map"][k] == s for k in part)
        got.update(part)
    _assert_same(got, flat, tensors_only=True)
    # overwritten with fewer shards: the old ones go
    assert _cli("convert", path, out, "--max-shard-size", "1MB", "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == [".dcpx-convert.json",
                                                      "model-00001-of-00001.safetensors",
                                                      "model.safetensors.index.json"]


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "sharded"])
def test_to_dcp_loads_with_torch_and_dcpx(tmp_path, fmt):
    flat = {k: v for k, v in _flat(_nested()).items() if isinstance(v, torch.Tensor)}
    if fmt == "torch":
        src = tmp_path / "in.pt"
        torch.save(_nested(), src)                    # nested: flattened to FQNs
        flat = _flat(_nested())
    elif fmt == "safetensors":
        src = tmp_path / "in.safetensors"
        save_file(flat, src)
    else:
        save_file(dict(list(flat.items())[:3]), tmp_path / "a.safetensors")
        save_file(dict(list(flat.items())[3:]), tmp_path / "b.safetensors")
        (tmp_path / "hf").mkdir()
        os.replace(tmp_path / "a.safetensors", tmp_path / "hf" / "a.safetensors")
        os.replace(tmp_path / "b.safetensors", tmp_path / "hf" / "b.safetensors")
        weight_map = {k: ("a" if i < 3 else "b") + ".safetensors" for i, k in enumerate(flat)}
        (tmp_path / "hf" / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
        src = tmp_path / "hf"
    dst = tmp_path / "dcp"
    assert _cli("convert", src, dst) == 0
    _assert_same(_load_dcp(dst, flat), flat)
    got = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
    dcpx.load(got, checkpoint_id=dst)
    _assert_same(got, flat)
    assert _cli("verify", dst) == 0
    if fmt == "torch":   # the nested layout: loads into the nested state dict too
        nested = _nested()
        target = {"model": {"layer": {"w": torch.empty(16, 8), "b": torch.empty(8, dtype=torch.bfloat16)},
                            "emb": torch.empty(10, 4, dtype=torch.float16),
                            "idx": torch.empty(2, 3, dtype=torch.int64),
                            "mask": torch.empty(5, dtype=torch.bool),
                            "scalar": torch.empty((), dtype=torch.float64)},
                  "step": 0, "run_name": ""}
        tdcp.load(target, checkpoint_id=str(dst))
        _assert_same(_flat(target), _flat(nested))


def test_export_only_the_model_without_its_prefix(ckpt, tmp_path, capsys):
    path, flat = ckpt
    out = tmp_path / "model.safetensors"
    assert _cli("convert", path, out, "--only", "model.", "--strip-prefix", "model.") == 0
    assert "skipped" not in capsys.readouterr().err      # step and run_name left out, no warning
    _assert_same(load_file(out), {k[len("model."):]: v for k, v in flat.items()
                                  if k.startswith("model.")})
    assert _cli("convert", path, tmp_path / "x.pt", "--only", "optim.") == 1
    assert "no key starts with 'optim.'" in capsys.readouterr().err
    assert _cli("convert", path, tmp_path / "y.pt", "--strip-prefix", "model.layer.") == 0
    assert sorted(torch.load(tmp_path / "y.pt", weights_only=True))[:3] == ["b", "model.emb", "model.idx"]


def test_round_trips_through_every_format(ckpt, tmp_path):
    path, flat = ckpt
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert _cli("convert", path, tmp_path / "a.pt") == 0
    assert _cli("convert", tmp_path / "a.pt", tmp_path / "b.safetensors") == 0
    assert _cli("convert", tmp_path / "b.safetensors", tmp_path / "c", "--max-shard-size", "1KB") == 0
    assert _cli("convert", tmp_path / "c", tmp_path / "d") == 0
    assert _cli("convert", tmp_path / "d", tmp_path / "e.pt") == 0
    _assert_same(torch.load(tmp_path / "e.pt", weights_only=True), tensors)


def test_legacy_torch_save_input(tmp_path):
    """A pre-zip torch.save file cannot be memory-mapped: it is loaded whole."""
    flat = {k: v for k, v in _flat(_nested()).items()}
    torch.save(flat, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert _cli("convert", tmp_path / "old.pt", tmp_path / "new.safetensors") == 0
    _assert_same(load_file(tmp_path / "new.safetensors"), flat, tensors_only=True)


def test_torch_written_dcp_input(tmp_path):
    sd = _nested()
    tdcp.save(sd, checkpoint_id=str(tmp_path / "t"))
    flat = _flat(sd)
    assert _cli("convert", tmp_path / "t", tmp_path / "t.safetensors") == 0
    _assert_same(load_file(tmp_path / "t.safetensors"), flat, tensors_only=True)
    assert _cli("convert", tmp_path / "t", tmp_path / "t.pt") == 0
    _assert_same(torch.load(tmp_path / "t.pt", weights_only=True), flat)


def test_every_safetensors_dtype(tmp_path):
    g = torch.Generator().manual_seed(3)
    sd = {f"t_{name}": make_tensor((3, 5), dtype, g) for name, dtype in ST_TYPES.items()
          if torch_save_supports(dtype)}       # torch 2.4: no uint16/32/64 storages
    dcpx.save(sd, checkpoint_id=tmp_path / "all")
    assert _cli("convert", tmp_path / "all", tmp_path / "all.safetensors") == 0
    _assert_same(load_file(tmp_path / "all.safetensors"), sd)
    assert _cli("convert", tmp_path / "all.safetensors", tmp_path / "back") == 0
    _assert_same(_load_dcp(tmp_path / "back", sd), sd)
    assert _cli("convert", tmp_path / "all", tmp_path / "all.pt") == 0
    _assert_same(torch.load(tmp_path / "all.pt", weights_only=True), sd)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.bits8])
def test_dtype_safetensors_lacks_is_refused_by_name(tmp_path, capsys, dtype):
    sd = {"ok": torch.zeros(2), "odd": make_tensor((2,), dtype)}
    dcpx.save(sd, checkpoint_id=tmp_path / "c")
    assert _cli("convert", tmp_path / "c", tmp_path / "c.safetensors") == 1
    err = capsys.readouterr().err
    assert "odd (" + str(dtype).removeprefix("torch.") + ")" in err, err
    assert not any(tmp_path.glob("*.safetensors")) and not any(tmp_path.glob(".c.safetensors*"))
    assert _cli("convert", tmp_path / "c", tmp_path / "c.pt") == 0   # torch.save has it
    _assert_same(torch.load(tmp_path / "c.pt", weights_only=True), sd)


def test_values_torch_weights_only_refuses_are_skipped_by_name(tmp_path, capsys):
    import collections

    import numpy as np
    numpy = safe_loader_takes_numpy()              # not on torch 2.4
    sd = {"w": torch.ones(3), "hist": collections.deque([1, 2]), "lr": 0.1,
          **({"arr": np.arange(3)} if numpy else {})}
    dcpx.save(sd, checkpoint_id=tmp_path / "c")     # dcpx's allow-list has deque and numpy
    assert _cli("convert", tmp_path / "c", tmp_path / "c.pt") == 0
    err = capsys.readouterr().err
    assert "hist (" in err and ("arr (" in err) == numpy and "lr" not in err, err
    got = torch.load(tmp_path / "c.pt", weights_only=True)
    assert sorted(got) == ["lr", "w"] and got["lr"] == 0.1
    assert _cli("convert", tmp_path / "c", tmp_path / "d") == 0      # DCP keeps them
    assert _cli("diff", tmp_path / "c", tmp_path / "d", "--values") == 0


def test_damaged_input_fails_naming_the_key_and_leaves_nothing(ckpt, tmp_path, capsys):
    from conftest import flip_byte, locate
    path, _ = ckpt
    md = dcpx.FileSystemReader(path).read_metadata()
    file, off, length = locate(path, md, "model.emb")
    flip_byte(file, off + length // 2)
    for out in ("m.safetensors", "m.pt", "m_dcp"):
        assert _cli("convert", path, tmp_path / out) == 1
        err = capsys.readouterr().err
        assert "model.emb" in err and "CRC" in err, err
        assert not (tmp_path / out).exists() or not any((tmp_path / out).glob(METADATA_FN))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".m")) == []


def test_convert_errors(ckpt, tmp_path, capsys):
    path, _ = ckpt
    assert _cli("convert", tmp_path / "missing", tmp_path / "x.pt") == 2
    (tmp_path / "x.pt").write_bytes(b"keep")
    assert _cli("convert", path, tmp_path / "x.pt") == 1
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "x.pt").read_bytes() == b"keep"
    assert _cli("convert", path, tmp_path / "x.pt", "--overwrite") == 0
    assert _cli("convert", path, tmp_path / "y.pt", "--max-shard-size", "1GB") == 1
    assert _cli("convert", path, tmp_path / "z", "--max-shard-size", "lots") == 1
    with pytest.raises(SystemExit) as ei:
        _cli("convert", path)
    assert ei.value.code == 2


# -- a checkpoint saved by 2 ranks (DTensor shards) -------------------------------

def _save_sharded(rank: int, world: int, path: str, use_torch: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from dtensor_api import Replicate, Shard

    from dist_helpers import dtensor_of, full_value

    mesh = init_device_mesh("cpu", (world,))
    sd = {"rows": dtensor_of(full_value("rows", (7, 5)), mesh, [Shard(0)]),
          "cols": dtensor_of(full_value("cols", (3, 9), torch.bfloat16), mesh, [Shard(1)]),
          "rep": dtensor_of(full_value("rep", (4,)), mesh, [Replicate()]),
          "plain": full_value("plain", (6,)), "step": 5}
    (tdcp if use_torch else dcpx).save(sd, checkpoint_id=path)


@pytest.mark.dist
@pytest.mark.parametrize("writer", ["dcpx", "torch"])
def test_two_rank_dtensor_checkpoint_is_consolidated(tmp_path, writer, capsys):
    from dist_helpers import full_value, spawn
    spawn(_save_sharded, 2, str(tmp_path / "c"), writer == "torch")
    want = {"rows": full_value("rows", (7, 5)), "cols": full_value("cols", (3, 9), torch.bfloat16),
            "rep": full_value("rep", (4,)), "plain": full_value("plain", (6,))}
    assert _cli("inspect", tmp_path / "c", "--json") == 0
    keys = json.loads(capsys.readouterr().out)["keys"]
    assert len(keys["rows"]["shards"]) == 2 and len(keys["cols"]["shards"]) == 2
    assert _cli("convert", tmp_path / "c", tmp_path / "c.safetensors") == 0
    _assert_same(load_file(tmp_path / "c.safetensors"), want)
    assert _cli("convert", tmp_path / "c", tmp_path / "c.pt") == 0
    _assert_same(torch.load(tmp_path / "c.pt", weights_only=True), dict(want, step=5))


# -- bounded memory ---------------------------------------------------------------

_MEMORY_CHILD = textwrap.dedent("""
    import sys
    import torch, safetensors.torch, tqdm
    from dcpx.cli import main

    def status(field):   # kB
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":"))

    src, dst, small, warm = sys.argv[1:5]
    assert main(["convert", small, warm]) == 0    # lazy imports, allocator warm-up
    # Peak RSS of this process from here on: reset the high-water mark
    # (VmHWM) to the current RSS.  Not getrusage's ru_maxrss: Linux keeps it
    # across fork and exec, so a child of a big pytest process starts high.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    assert main(["convert", src, dst]) == 0
    print((status("VmHWM") - before) * 1024)
""")


MIB = 1 << 20
TENSOR = 64 * MIB
N_TENSORS = 6


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory):
    """6 float32 tensors of 64 MiB each (384 MiB) as a DCP checkpoint, a
    safetensors file and a torch.save file, and a tiny checkpoint for the
    warm-up conversion."""
    root = tmp_path_factory.mktemp("big")
    sd = {f"layer{i}.w": torch.full((TENSOR // 4,), float(i)) for i in range(N_TENSORS)}
    dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(root / "big", sync_files=False))
    save_file(sd, root / "big.safetensors")
    torch.save(sd, root / "big.pt")
    del sd
    dcpx.save({"w": torch.zeros(4)}, checkpoint_id=root / "small")
    yield root
    shutil.rmtree(root, ignore_errors=True)     # 1.2 GB: not left for pytest's 3 kept runs


@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="under ASan (scripts/sanitizer_env.sh) freed memory sits in the "
                           "allocator's quarantine: RSS says nothing about the converter")
@pytest.mark.parametrize("src,out", [("big", "model.safetensors"), ("big", "model.pt"),
                                     ("big.safetensors", "dcp"), ("big.pt", "dcp"),
                                     ("big.pt", "model.safetensors"), ("big", "dcp")])
def test_convert_memory_is_bounded_by_one_tensor(big_ckpt, tmp_path, src, out):
    """The converting process's peak RSS grows by a small multiple of one
    tensor (64 MiB), not by the checkpoint (384 MiB): a converter that held
    the state dict, or two tensors at once, fails this; so does one that keeps the
    pages of a memory-mapped input (torch.load(mmap=True), safe_open) it has
    read mapped in the process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    warm = "warm-" + out
    run = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(big_ckpt / src),
                          str(tmp_path / out), str(big_ckpt / "small"), str(tmp_path / warm)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    growth = int(run.stdout.strip().splitlines()[-1])
    assert growth < 1.75 * TENSOR, f"peak RSS grew by {growth / MIB:.0f} MiB"
    # and the output is right (read one tensor at a time)
    from dcpx.cli._common import open_source
    got = open_source(str(tmp_path / out))
    assert sorted(got.entries()) == [f"layer{i}.w" for i in range(N_TENSORS)]
    for i in range(N_TENSORS):
        t = got.read(f"layer{i}.w")
        assert t.shape == (TENSOR // 4,) and t.dtype == torch.float32 and bool((t == i).all())
        got.release(f"layer{i}.w", t)
        del t
    del got
    shutil.rmtree(tmp_path, ignore_errors=True)


# -- progress bars -------------------------------------------------------------------

class _Tty:
    def __init__(self):
        self.text = []

    def isatty(self):
        return True

    def write(self, s):
        self.text.append(s)

    def flush(self):
        pass


def test_progress_bar_only_on_a_terminal(ckpt, tmp_path, monkeypatch, capsys):
    path, _ = ckpt
    assert _cli("convert", path, tmp_path / "a.pt") == 0
    assert _cli("verify", path) == 0
    assert capsys.readouterr().err == ""          # stderr is not a terminal: silent
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert _cli("convert", path, tmp_path / "b.pt") == 0
    assert _cli("verify", path) == 0
    assert _cli("diff", path, tmp_path / "b.pt", "--values") == 0
    text = "".join(tty.text)
    for what in ("convert", "verify", "diff"):
        assert what + ":" in text, text


# -- the entry points ---------------------------------------------------------------

def test_module_and_console_script_entry(ckpt, tmp_path):
    path, _ = ckpt
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "dcpx", "ls", str(path.parent)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and "ckpt" in run.stdout, run.stdout + run.stderr
    import tomllib
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    mod, fn = scripts["dcpx"].split(":")
    import importlib
    assert getattr(importlib.import_module(mod), fn) is main


def test_without_safetensors_and_tqdm(ckpt, tmp_path, monkeypatch, capsys):
    """dcpx does not depend on them: without them verify and torch.save
    conversions work (no bars), a safetensors conversion says what to install."""
    path, flat = ckpt
    for mod in ("safetensors", "safetensors.torch", "tqdm"):
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.setattr(sys, "stderr", _Tty())
    assert _cli("verify", path) == 0
    assert _cli("convert", path, tmp_path / "m.pt") == 0
    assert _cli("convert", path, tmp_path / "m.safetensors") == 1
    text = "".join(sys.stderr.text)
    assert "needs the 'safetensors' package" in text and "pip install safetensors" in text, text


def test_dcp_to_torch_save_with_tensors_inside_values(tmp_path):
    """A non-tensor value holding tensors (a tuple) converts
    to a .pt file that torch.load(weights_only=True) reads, its tensors as
    records of their own (the default pickling went through
    torch.storage._load_from_bytes, which weights_only refuses: convert
    failed its own final check)."""
    gen = torch.Generator().manual_seed(8)
    inner = torch.randn(3, 4, generator=gen)
    state = {"w": torch.randn(5, generator=gen),
             "pair": (inner.t(), "x"),
             "nested": [{"m": torch.arange(6, dtype=torch.int16).view(2, 3)},
                        torch.empty(0, 2)],
             "scalar": (torch.tensor(2.5), torch.tensor([True, False]))}
    dcpx.save(state, checkpoint_id=tmp_path / "c")
    out = tmp_path / "m.pt"
    assert _cli("convert", tmp_path / "c", out) == 0
    got = torch.load(out, weights_only=True)
    assert_bit_equal(got["w"], state["w"])
    assert_bit_equal(got["pair"][0], inner.t()) and got["pair"][1] == "x"
    # the list is flattened by DCP: its tensors are tensors of the checkpoint
    assert_bit_equal(got["nested.0.m"], state["nested"][0]["m"])
    assert_bit_equal(got["nested.1"], state["nested"][1])
    assert_bit_equal(got["scalar"][0], state["scalar"][0])
    assert_bit_equal(got["scalar"][1], state["scalar"][1])
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None


def test_dcp_to_torch_save_keeps_parameters_and_warns_nothing(tmp_path):
    """Tensors inside a value are written as torch.save writes them: a
    Parameter stays a Parameter (torch's _rebuild_parameter; on main it
    became a plain tensor), a tensor keeps requires_grad, and every record
    is handed to the writer as a storage (on main a tensor inside a value
    went by data pointer, which torch warns is deprecated, on stderr, once
    per process: hence a fresh one, Python's warnings as errors)."""
    gen = torch.Generator().manual_seed(9)
    param = torch.nn.Parameter(torch.randn(4, generator=gen), requires_grad=False)
    grad = torch.randn(3, generator=gen).requires_grad_()
    state = {"w": torch.randn(5, generator=gen),
             "v": (torch.arange(6, dtype=torch.int16).view(2, 3).t(), param, grad, "x"),
             "h": {"p": [1, (torch.nn.Parameter(torch.ones(2)),)]}}
    dcpx.save(state, checkpoint_id=tmp_path / "c")
    out = tmp_path / "m.pt"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # (not plain -W error: an old torch leaves a ResourceWarning at exit)
    run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-W",
                          "error::UserWarning", "-W", "error::FutureWarning", "-m", "dcpx", "convert",
                          str(tmp_path / "c"), str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Warning" not in run.stderr and "deprecated" not in run.stderr, run.stderr
    got = torch.load(out, weights_only=True)
    ref = tmp_path / "ref.pt"
    # torch.save's own output for the flat dict (DCP keys), loaded alike
    torch.save({"w": state["w"], "v": state["v"], "h.p": state["h"]["p"]}, ref)
    want = torch.load(ref, weights_only=True)
    assert list(got) == list(want)

    def same(a, b):
        assert type(a) is type(b), (type(a), type(b))
        if isinstance(a, torch.Tensor):
            assert a.requires_grad == b.requires_grad
            assert_bit_equal(a.detach(), b.detach())
        elif isinstance(a, (tuple, list)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        else:
            assert a == b
    for k in want:
        same(got[k], want[k])
    assert type(got["v"][1]) is torch.nn.Parameter and not got["v"][1].requires_grad
    assert type(got["v"][2]) is torch.Tensor and got["v"][2].requires_grad
    # the very pickle torch.save writes for what it holds
    torch.save(got, ref)
    with zipfile.ZipFile(out) as a, zipfile.ZipFile(ref) as b:
        assert a.testzip() is None
        assert a.read(a.namelist()[0]) == b.read(b.namelist()[0])   # data.pkl
        assert [n.split("/", 1)[1] for n in a.namelist()] == \
            [n.split("/", 1)[1] for n in b.namelist()]


def test_dcp_to_torch_save_with_a_quantized_tensor_inside_a_value(tmp_path, capsys):
    """A tensor that is not a plain CPU one (quantized here) reduces as
    torch.save reduces it, its storage a record of its own (on main its
    bytes were pickled through torch.storage._load_from_bytes, which
    torch.load(weights_only=True) refuses: convert failed)."""
    qt = torch.quantize_per_tensor(torch.arange(6.0), 0.5, 2, torch.quint8)
    dcpx.save({"w": torch.zeros(3), "v": (qt, torch.ones(3)[1:])}, checkpoint_id=tmp_path / "c")
    out = tmp_path / "m.pt"
    assert _cli("convert", tmp_path / "c", out) == 0, capsys.readouterr().err
    got = torch.load(out, weights_only=True)
    assert got["v"][0].is_quantized and got["v"][0].q_scale() == 0.5
    assert_bit_equal(got["v"][0].int_repr(), qt.int_repr())
    assert_bit_equal(got["v"][1], torch.ones(2))
