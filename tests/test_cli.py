"""``python -m dcpx verify`` / ``inspect``: one exit-status scheme, and every
problem of a damaged checkpoint reported, one line each naming key and file.

Exit status (dcpx/__main__.py, docs/api.md): 0 sound; 1 the checkpoint has
problems; 2 no checkpoint to check (usage error, no such directory, not a
directory, no .metadata).
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import dcpx
import dcpx.__main__ as cli
from dcpx.formats.metadata import METADATA_FN

from conftest import flip_byte, locate


def _state(n: int = 6) -> dict:
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(64 + i, generator=g) for i in range(n)}
    sd["step"] = 7              # a pickled (bytes) value
    return sd


def _save(path: Path, n: int = 6, single_file_per_rank: bool = True) -> dict:
    sd = _state(n)
    dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(
        path, single_file_per_rank=single_file_per_rank, sync_files=False))
    return sd


def _layout(path: Path) -> dict:
    """relative_path -> sorted [(offset, length, fqn)]"""
    md = dcpx.FileSystemReader(path).read_metadata()
    files = defaultdict(list)
    for index, info in md.storage_data.items():
        files[info.relative_path].append((info.offset, info.length, index.fqn))
    return {k: sorted(v) for k, v in files.items()}


def _verify(path, capsys) -> tuple[int, list[str], str]:
    rc = cli.main(["verify", str(path)])
    cap = capsys.readouterr()
    bad = [ln for ln in cap.out.splitlines() if ln.lstrip().startswith("BAD ")]
    return rc, bad, cap.out + cap.err


def _bad_keys(bad: list[str]) -> list[str]:
    return [ln.split("BAD ", 1)[1].split(":", 1)[0] for ln in bad]


def test_clean_checkpoint_exits_0(tmp_path, capsys):
    _save(tmp_path / "c")
    rc, bad, text = _verify(tmp_path / "c", capsys)
    assert rc == 0 and bad == [], text
    assert "7 records verified, OK" in text


def test_corrupt_metadata_exits_1_and_names_it(tmp_path, capsys):
    _save(tmp_path / "c")
    (tmp_path / "c" / METADATA_FN).write_bytes(b"\x80\x04not a pickle at all")
    rc, bad, text = _verify(tmp_path / "c", capsys)
    assert rc == 1, text
    assert len(bad) == 1 and bad[0].lstrip().startswith("BAD .metadata:"), text
    assert str(tmp_path / "c") in bad[0]


def test_truncated_file_reports_every_bad_extent(tmp_path, capsys):
    _save(tmp_path / "c")
    (rel, items), = [(k, v) for k, v in _layout(tmp_path / "c").items()]
    assert len(items) == 7
    # Cut the file inside the third record: it and every later one lie
    # (partly) past the end.
    cut = items[2][0] + items[2][1] // 2
    os.truncate(tmp_path / "c" / rel, cut)
    beyond = [fqn for off, length, fqn in items if off + length > cut]
    assert len(beyond) >= 3
    rc, bad, text = _verify(tmp_path / "c", capsys)
    assert rc == 1, text
    assert sorted(_bad_keys(bad)) == sorted(beyond), text
    for ln in bad:
        assert rel in ln, ln            # names the file
    assert "2 records verified" in text, text  # the intact ones were still read


def test_missing_file_reports_its_keys_and_checks_the_rest(tmp_path, capsys):
    _save(tmp_path / "c", single_file_per_rank=False)
    layout = _layout(tmp_path / "c")
    assert len(layout) >= 2
    gone = sorted(layout)[0]
    os.unlink(tmp_path / "c" / gone)
    rc, bad, text = _verify(tmp_path / "c", capsys)
    assert rc == 1, text
    assert sorted(_bad_keys(bad)) == sorted(fqn for _, _, fqn in layout[gone]), text
    for ln in bad:
        assert gone in ln and "missing" in ln, ln
    kept = sum(len(v) for k, v in layout.items() if k != gone)
    assert f"{kept} records verified" in text, text


def test_every_crc_mismatch_is_reported(tmp_path, capsys):
    _save(tmp_path / "c")
    md = dcpx.FileSystemReader(tmp_path / "c").read_metadata()
    hit = ["w1", "w4"]
    for key in hit:
        file, off, length = locate(tmp_path / "c", md, key)
        flip_byte(file, off + length // 2)
    rc, bad, text = _verify(tmp_path / "c", capsys)
    assert rc == 1, text
    assert sorted(_bad_keys(bad)) == hit, text
    for ln in bad:
        assert "CRC" in ln and os.path.basename(file) in ln, ln
    assert "5 records verified" in text, text


def test_missing_storage_entry_is_a_problem(tmp_path, capsys):
    import pickle
    _save(tmp_path / "c")
    md = dcpx.FileSystemReader(tmp_path / "c").read_metadata()
    victim = next(k for k in md.storage_data if k.fqn == "w3")
    del md.storage_data[victim]
    (tmp_path / "c" / METADATA_FN).write_bytes(pickle.dumps(md))
    rc, bad, text = _verify(tmp_path / "c", capsys)
    assert rc == 1 and _bad_keys(bad) == ["w3"], text
    with pytest.raises(Exception):   # load refuses it too
        dcpx.load(_state(), checkpoint_id=tmp_path / "c")


@pytest.mark.parametrize("what", ["missing", "no-metadata", "a-file"])
def test_no_checkpoint_exits_2(tmp_path, capsys, what):
    path = tmp_path / "c"
    if what == "no-metadata":
        _save(path)
        os.unlink(path / METADATA_FN)
    elif what == "a-file":
        path.write_bytes(b"x")
    for cmd in ("verify", "inspect"):
        assert cli.main([cmd, str(path)]) == 2
        err = capsys.readouterr().err
        assert str(path) in err, err


def test_inspect_of_corrupt_metadata_exits_1(tmp_path, capsys):
    _save(tmp_path / "c")
    (tmp_path / "c" / METADATA_FN).write_bytes(b"garbage")
    assert cli.main(["inspect", str(tmp_path / "c")]) == 1
    assert str(tmp_path / "c") in capsys.readouterr().err


def test_command_line_exit_status(tmp_path):
    _save(tmp_path / "c")
    (rel, items), = _layout(tmp_path / "c").items()
    os.truncate(tmp_path / "c" / rel, items[-2][0])
    env = dict(os.environ, PYTHONPATH=str(Path(dcpx.__file__).parent.parent))
    run = subprocess.run([sys.executable, "-m", "dcpx", "verify", str(tmp_path / "c")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.count("BAD ") == 2, run.stdout
    with pytest.raises(SystemExit) as ei:    # usage error
        cli.main(["verify"])
    assert ei.value.code == 2


def test_help_documents_the_exit_status(capsys):
    for argv in (["--help"], ["verify", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        out = capsys.readouterr().out
        assert "Exit status: 0" in out and "1 the checkpoint has problems" in out, out
        assert "2 no checkpoint to check" in out, out
