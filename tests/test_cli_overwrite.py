"""``dcpx convert --overwrite`` removes only what an earlier convert wrote,
and convert never writes outside its output (issue 31, items 1 and 4).

On main, ``--overwrite`` into a folder deleted every ``*.safetensors`` its
new index did not name and every ``*.distcp`` (a user's
``adapter_model.safetensors``, ``consolidated.safetensors``,
``notes.distcp``), a DCP save replaced a foreign checkpoint's files, and a
symlinked output folder was followed into its target for all of it.  A
symlink planted at convert's temporary name (``.NAME.tmp.<pid>``) made it
write through the link, outside the output folder."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from dcpx.cli import convert as convert_mod
from dcpx.cli import main

from conftest import assert_bit_equal

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")

MANIFEST = ".dcpx-convert.json"


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


@pytest.fixture
def ckpt(tmp_path) -> tuple[Path, dict]:
    sd = {"a": torch.arange(64.0), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    dcpx.save(sd, checkpoint_id=tmp_path / "c")
    return tmp_path / "c", sd


def _snapshot(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def _user_files(d: Path) -> dict:
    st = pytest.importorskip("safetensors.torch")
    d.mkdir(exist_ok=True)
    st.save_file({"lora": torch.ones(2)}, str(d / "adapter_model.safetensors"))
    st.save_file({"w": torch.zeros(2)}, str(d / "consolidated.safetensors"))
    (d / "notes.distcp").write_text("my notes")
    (d / "config.json").write_text("{}")
    users = ("adapter_model.safetensors", "consolidated.safetensors", "notes.distcp",
             "config.json")
    return {k: v for k, v in _snapshot(d).items() if k in users}


# -- item 1: what --overwrite removes -----------------------------------------------------

@pytest.mark.parametrize("to", [["--max-shard-size", "200"], ["--to", "dcp"]],
                         ids=["shards", "dcp"])
def test_overwrite_into_a_users_folder_keeps_the_users_files(tmp_path, capsys, ckpt, to):
    """On main: exit 0, and the user's adapter_model.safetensors,
    consolidated.safetensors and notes.distcp were gone."""
    src, sd = ckpt
    out = tmp_path / "hf"
    mine = _user_files(out)
    rc, err = _cli(capsys, "convert", src, out, *to, "--overwrite")
    assert rc == 0, err
    after = _snapshot(out)
    assert {k: after[k] for k in mine} == mine
    # ... and a second --overwrite (replacing convert's own files) keeps them too
    rc, err = _cli(capsys, "convert", src, out, *to, "--overwrite")
    assert rc == 0, err
    after = _snapshot(out)
    assert {k: after[k] for k in mine} == mine
    if to[0] == "--to":
        got = {"a": torch.empty(64), "b": torch.empty(3, 5, dtype=torch.bfloat16)}
        dcpx.load(got, checkpoint_id=out)
    else:
        from safetensors.torch import load_file
        got = {}
        for f in sorted(out.glob("model-*.safetensors")):
            got.update(load_file(f))
    assert_bit_equal(got["a"], sd["a"])
    assert_bit_equal(got["b"], sd["b"])


def test_overwrite_refuses_shards_it_did_not_write(tmp_path, capsys, ckpt):
    """A Hugging Face download's own shards and index, at the names the
    output would write: refused, naming them, nothing changed."""
    st = pytest.importorskip("safetensors.torch")
    src, _ = ckpt
    out = tmp_path / "hf"
    out.mkdir()
    st.save_file({"x": torch.ones(2)}, str(out / "model-00001-of-00001.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"x": "model-00001-of-00001.safetensors"}}))
    before = _snapshot(out)
    rc, err = _cli(capsys, "convert", src, out, "--max-shard-size", "1GB", "--overwrite")
    assert rc == 1
    assert "model-00001-of-00001.safetensors" in err and "model.safetensors.index.json" in err
    assert _snapshot(out) == before


def test_overwrite_refuses_a_foreign_dcp_checkpoint(tmp_path, capsys, ckpt):
    """A DCP output into a folder holding torch's own checkpoint: a DCP save
    would replace its .metadata and delete its data files; refused, naming
    them, and the checkpoint still loads."""
    src, _ = ckpt
    out = tmp_path / "theirs"
    mine = {"w": torch.arange(8.0)}
    tdcp.save(mine, checkpoint_id=str(out))
    before = _snapshot(out)
    rc, err = _cli(capsys, "convert", src, out, "--to", "dcp", "--overwrite")
    assert rc == 1 and ".metadata" in err and "__0_0.distcp" in err, err
    assert _snapshot(out) == before
    got = {"w": torch.empty(8)}
    tdcp.load(got, checkpoint_id=str(out))
    assert torch.equal(got["w"], mine["w"])


def test_overwrite_never_removes_through_a_symlinked_folder(tmp_path, capsys, ckpt):
    """OUT is a link to a folder holding an earlier convert's output and the
    user's files: --overwrite through the link is refused (on main it
    deleted in the target); into the folder itself it works.  A link to an
    empty folder is written into, as before."""
    src, _ = ckpt
    target = tmp_path / "real"
    assert _cli(capsys, "convert", src, target, "--max-shard-size", "200")[0] == 0
    mine = _user_files(target)
    before = _snapshot(target)
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    for to in (["--to", "dcp"], ["--max-shard-size", "1GB"]):
        rc, err = _cli(capsys, "convert", src, link, *to, "--overwrite")
        assert rc == 1 and "symbolic link" in err and str(target) in err, err
        assert _snapshot(target) == before
    rc, err = _cli(capsys, "convert", src, target, "--max-shard-size", "1GB", "--overwrite")
    assert rc == 0, err
    after = _snapshot(target)
    assert {k: after[k] for k in mine} == mine
    assert not (target / "model-00001-of-00002.safetensors").exists()   # convert's own: gone
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "link2").symlink_to(empty, target_is_directory=True)
    assert _cli(capsys, "convert", src, tmp_path / "link2", "--to", "dcp")[0] == 0
    assert (empty / ".metadata").is_file()


def test_a_crafted_manifest_never_deletes_other_files(tmp_path, capsys, ckpt):
    """A manifest naming config.json, a path outside, and a symlink at one of
    convert's names: none of them is removed (names outside convert's own,
    links and files changed since are never believed)."""
    src, _ = ckpt
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    outside = tmp_path / "outside.safetensors"
    outside.write_text("keep")
    (out / "model-00007-of-00009.safetensors").symlink_to(outside)
    (out / MANIFEST).write_text(json.dumps({"files": {
        "config.json": [2, 0], "../outside.safetensors": [4, 0],
        "model-00007-of-00009.safetensors": [None, None]}}))
    rc, err = _cli(capsys, "convert", src, out, "--max-shard-size", "1GB", "--overwrite")
    assert rc == 0, err
    assert (out / "config.json").read_text() == "{}"
    assert outside.read_text() == "keep"
    assert (out / "model-00007-of-00009.safetensors").is_symlink()


def test_overwrite_refuses_a_file_changed_since_convert_wrote_it(tmp_path, capsys, ckpt):
    st = pytest.importorskip("safetensors.torch")
    src, _ = ckpt
    out = tmp_path / "out"
    assert _cli(capsys, "convert", src, out, "--max-shard-size", "1GB")[0] == 0
    shard = out / "model-00001-of-00001.safetensors"
    st.save_file({"fine_tuned": torch.ones(7)}, str(shard))     # the user's own now
    before = _snapshot(out)
    rc, err = _cli(capsys, "convert", src, out, "--max-shard-size", "1GB", "--overwrite")
    assert rc == 1 and shard.name in err, err
    assert _snapshot(out) == before


def test_overwrite_after_a_convert_that_failed_midway(tmp_path, capsys, ckpt, monkeypatch):
    """A convert that stopped after its first shard: the shard it left is in
    its manifest (as being written), so the next --overwrite replaces it."""
    src, _ = ckpt
    out = tmp_path / "out"
    real = convert_mod._write_safetensors_file
    calls = []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*a, **k)
    monkeypatch.setattr(convert_mod, "_write_safetensors_file", failing)
    with pytest.raises(OSError):
        convert_mod.convert(str(src), str(out), max_shard_size="200")
    monkeypatch.setattr(convert_mod, "_write_safetensors_file", real)
    assert (out / "model-00001-of-00002.safetensors").exists()
    rc, err = _cli(capsys, "convert", src, out, "--max-shard-size", "200", "--overwrite")
    assert rc == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_directory_outputs_and_file_paths_do_not_mix(tmp_path, capsys, ckpt):
    src, _ = ckpt
    (tmp_path / "f").write_text("mine")
    rc, err = _cli(capsys, "convert", src, tmp_path / "f", "--to", "dcp", "--overwrite")
    assert rc == 1 and "is a file" in err
    assert (tmp_path / "f").read_text() == "mine"
    (tmp_path / "d.pt").mkdir()
    rc, err = _cli(capsys, "convert", src, tmp_path / "d.pt", "--overwrite")
    assert rc == 1 and "is a directory" in err


# -- item 4: temporary files -----------------------------------------------------------

def _plant(path: Path, target: Path) -> None:
    path.symlink_to(target)


@pytest.mark.parametrize("out", ["model.safetensors", "model.pt", "shards"])
def test_a_symlink_at_the_temporary_name_is_never_written_through(tmp_path, capsys, ckpt,
                                                                  monkeypatch, out):
    """Links planted at the old temporary name (.NAME.tmp.<pid>) and at the
    first random name convert picks: convert writes neither target (on
    main it wrote through the link and renamed the link into place)."""
    src, sd = ckpt
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    d = tmp_path / "o"
    d.mkdir()
    names = (["model-00001-of-00001.safetensors", "model.safetensors.index.json", MANIFEST]
             if out == "shards" else [out])
    tokens = iter(["aaaaaaaa", "bbbbbbbb"] * 10)
    monkeypatch.setattr("secrets.token_hex", lambda n: next(tokens))
    for name in names:
        _plant(d / f".{name}.tmp.{os.getpid()}", victim)
        _plant(d / f".{name}.tmp.{os.getpid()}.aaaaaaaa", victim)
    dst = d if out == "shards" else d / out
    extra = ["--max-shard-size", "1GB", "--overwrite"] if out == "shards" else []
    # --overwrite: the folder holds only the planted links (nothing convert
    # would replace)
    rc, err = _cli(capsys, "convert", src, dst, *extra)
    assert rc == 0, err
    assert victim.read_bytes() == b"precious"
    for name in names:
        assert (d / name).is_file() and not (d / name).is_symlink(), name
    if out == "model.pt":
        got = torch.load(d / out, weights_only=True)
    else:
        from safetensors.torch import load_file
        got = load_file(d / ("model.safetensors" if out != "shards"
                             else "model-00001-of-00001.safetensors"))
    assert_bit_equal(got["a"], sd["a"])
