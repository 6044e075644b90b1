"""The CLI tells the truth (issue 22, item 9).

* ``inspect`` shows non-tensor values, unpickled by dcpx's safe unpickler
  (never running code from the checkpoint), in the listing and in --json;
* ``inspect`` of a damaged checkpoint shows what can be read and each
  problem, exit 1;
* ``--help`` / ``--version`` answer without importing torch;
* ``convert --overwrite`` into a folder holding an earlier export in another
  layout removes that export's files (not the user's others: issue 31 item 1,
  tests/test_cli_overwrite.py);
* ``diff`` of a DCP checkpoint against the ``torch.save`` file of the same
  state finds no difference (lists flattened as DCP flattens them);
* converting to ``.pt`` prints no torch warning.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcpx
from dcpx.cli import main

from conftest import assert_bit_equal, safe_loader_takes_numpy

REPO = Path(__file__).resolve().parent.parent


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO))


def _train_state() -> dict:
    """A model, its Adam optimizer after one step (param_groups: a list of
    dicts; state: per-parameter tensors) and a few plain values."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": m.state_dict(), "optim": opt.state_dict(), "step": 7,
            "run": "exp-1", "mixed": [torch.ones(2), 3]}


# -- inspect: values ---------------------------------------------------------------

def test_inspect_shows_values_in_the_listing_and_json(tmp_path, capsys):
    sd = {"w": torch.ones(3), "step": 7, "note": "hi", "lr": 0.25, "betas": (0.9, 0.99),
          "cfg": {"layers": [1, 2]}, "nan": float("nan"), "flag": None}
    dcpx.save(sd, checkpoint_id=tmp_path / "c")
    rc, out, err = _cli(capsys, "inspect", tmp_path / "c")
    assert rc == 0, out + err
    lines = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip()
             for ln in out.splitlines()[2:]}
    assert lines["step"] == "int 7" and lines["note"] == "str 'hi'", out
    assert lines["lr"] == "float 0.25" and lines["betas"] == "tuple (0.9, 0.99)", out
    assert lines["cfg.layers"] == "list [1, 2]" and lines["nan"] == "float nan", out
    assert lines["flag"] == "NoneType None" and lines["w"] == "float32[3]", out
    assert "pickled value" not in out

    rc, out, _ = _cli(capsys, "inspect", tmp_path / "c", "--json")
    assert rc == 0
    keys = json.loads(out)["keys"]        # strict JSON: no NaN literal
    assert (keys["step"]["value_type"], keys["step"]["value"]) == ("int", 7)
    assert keys["note"]["value"] == "hi" and keys["cfg.layers"]["value"] == [1, 2]
    assert keys["flag"]["value"] is None
    # not JSON as they are: their repr
    assert keys["betas"] == dict(keys["betas"], value_type="tuple", repr="(0.9, 0.99)")
    assert "value" not in keys["betas"] and keys["nan"]["repr"] == "nan"
    assert json.loads(out)["problems"] == []


def test_inspect_shows_numpy_values(tmp_path, capsys):
    np = pytest.importorskip("numpy")
    if not safe_loader_takes_numpy():
        pytest.skip(f"torch {torch.__version__}'s allow-list (dcpx's) refuses numpy arrays")
    dcpx.save({"rng": np.random.RandomState(3).get_state(), "a": np.arange(3)},
              checkpoint_id=tmp_path / "c")
    rc, out, _ = _cli(capsys, "inspect", tmp_path / "c", "--json")
    assert rc == 0
    keys = json.loads(out)["keys"]
    assert keys["a"]["value_type"] == "numpy.ndarray" and keys["a"]["repr"] == "array([0, 1, 2])"
    assert keys["rng"]["repr"].startswith("('MT19937', array([")


class _Marker:
    """Pickles as a call of os.mkdir: a value whose unpickling runs code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_inspect_never_runs_code_from_a_value(tmp_path, capsys):
    marker = tmp_path / "code-ran"
    with _no_check():
        dcpx.save({"w": torch.ones(2), "evil": _Marker(marker), "step": 3},
                  checkpoint_id=tmp_path / "c")
    for argv in (["inspect", tmp_path / "c"], ["inspect", tmp_path / "c", "--json"]):
        rc, out, err = _cli(capsys, *argv)
        assert not marker.exists(), "inspect ran code from the checkpoint"
        assert rc == 1, out + err
        assert "evil" in out and "mkdir" in out, out
    d = json.loads(out)
    assert d["keys"]["step"]["value"] == 3            # the rest is still shown
    assert [p["key"] for p in d["problems"]] == ["evil"]


class _no_check:
    """Saving a value outside the allow-list may warn (issue 22, item 3):
    not what this file tests."""

    def __enter__(self):
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


def test_inspect_does_not_read_large_values(tmp_path, capsys):
    from dcpx.cli.inspect import VALUE_READ_MAX
    dcpx.save({"big": "x" * (VALUE_READ_MAX + 1), "small": "y"}, checkpoint_id=tmp_path / "c")
    rc, out, _ = _cli(capsys, "inspect", tmp_path / "c", "--json")
    keys = json.loads(out)["keys"]
    assert rc == 0 and "not_read" in keys["big"] and "value" not in keys["big"]
    assert keys["small"]["value"] == "y"


def test_inspect_limit_reads_only_the_values_it_lists(tmp_path, capsys):
    marker = tmp_path / "code-ran"
    with _no_check():
        dcpx.save({"a": 1, "b": 2, "z_evil": _Marker(marker)}, checkpoint_id=tmp_path / "c")
    rc, out, _ = _cli(capsys, "inspect", tmp_path / "c", "--limit", "2")
    assert rc == 0, out                 # z_evil is not listed, so not read
    assert "a: int 1" in out and "b: int 2" in out and "1 more" in out


# -- inspect: damage ---------------------------------------------------------------

def _data_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.distcp"))


def test_inspect_of_truncated_checkpoint_shows_what_it_can(tmp_path, capsys):
    sd = {f"w{i}": torch.full((64,), float(i)) for i in range(4)}
    sd["step"] = 5
    dcpx.save(sd, checkpoint_id=tmp_path / "c")
    (f,) = _data_files(tmp_path / "c")
    md = dcpx.FileSystemReader(tmp_path / "c").read_metadata()
    extents = sorted((info.offset, index.fqn) for index, info in md.storage_data.items())
    cut, first_lost = extents[2][0], {fqn for _, fqn in extents[2:]}
    os.truncate(f, cut)
    rc, out, err = _cli(capsys, "inspect", tmp_path / "c")
    assert rc == 1, out + err
    assert "3 problem(s)" in err
    for key in sd:
        assert f"  {key}: " in out, out                      # every key listed
    bad = sorted(ln.split("BAD ", 1)[1].split(":", 1)[0]
                 for ln in out.splitlines() if ln.startswith("  BAD "))
    assert bad == sorted(first_lost), out
    assert all("truncated" in ln for ln in out.splitlines() if ln.startswith("  BAD "))
    rc, out, _ = _cli(capsys, "inspect", tmp_path / "c", "--json")
    d = json.loads(out)
    assert rc == 1 and sorted(p["key"] for p in d["problems"]) == sorted(first_lost)
    assert all(d["keys"][k].get("damaged") for k in first_lost)
    assert not any(d["keys"][k].get("damaged") for k in set(sd) - first_lost)


def test_inspect_of_checkpoint_missing_a_file(tmp_path, capsys):
    sd = {f"w{i}": torch.full((64,), float(i)) for i in range(4)}
    sd["step"] = 5
    dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(tmp_path / "c",
                                                        single_file_per_rank=False))
    files = _data_files(tmp_path / "c")
    assert len(files) > 1
    md = dcpx.FileSystemReader(tmp_path / "c").read_metadata()
    lost = {index.fqn for index, info in md.storage_data.items()
            if info.relative_path == files[0].name}
    files[0].unlink()
    rc, out, _ = _cli(capsys, "inspect", tmp_path / "c", "--json")
    d = json.loads(out)
    assert rc == 1 and {p["key"] for p in d["problems"]} == lost
    assert all("missing" in p["error"] for p in d["problems"])
    if "step" not in lost:
        assert d["keys"]["step"]["value"] == 5


def test_inspect_of_corrupt_metadata_lists_the_files(tmp_path, capsys):
    dcpx.save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "c")
    (tmp_path / "c" / ".metadata").write_bytes(b"garbage")
    rc, out, err = _cli(capsys, "inspect", tmp_path / "c")
    assert rc == 1
    (f,) = _data_files(tmp_path / "c")
    assert f"  {f.name}: " in out and "BAD .metadata:" in out, out
    assert str(tmp_path / "c") in err
    rc, out, _ = _cli(capsys, "inspect", tmp_path / "c", "--json")
    d = json.loads(out)
    assert rc == 1 and d["files"] == {f.name: f.stat().st_size}
    assert [p["key"] for p in d["problems"]] == [".metadata"]


# -- diff against torch.save ----------------------------------------------------------

def test_diff_dcp_against_torch_save_of_the_same_state(tmp_path, capsys):
    sd = _train_state()
    dcpx.save(sd, checkpoint_id=tmp_path / "c")
    torch.save(sd, tmp_path / "c.pt")
    for extra in ([], ["--values"]):
        rc, out, err = _cli(capsys, "diff", tmp_path / "c", tmp_path / "c.pt", *extra)
        assert rc == 0, out + err
        assert out.startswith("0 difference(s)"), out
    # and a real difference is still found
    sd["optim"]["param_groups"][0]["lr"] = 0.5
    torch.save(sd, tmp_path / "d.pt")
    rc, out, _ = _cli(capsys, "diff", tmp_path / "c", tmp_path / "d.pt", "--values")
    assert rc == 1 and "~ optim.param_groups.0.lr: 0.001 -> 0.5" in out, out


def test_convert_of_torch_save_matches_dcpx_save(tmp_path, capsys):
    """torch.save file -> DCP: the same keys as dcpx.save of that state, and
    it loads back into the nested state dict."""
    sd = _train_state()
    torch.save(sd, tmp_path / "c.pt")
    dcpx.save(sd, checkpoint_id=tmp_path / "direct")
    assert _cli(capsys, "convert", tmp_path / "c.pt", tmp_path / "c")[0] == 0
    a = dcpx.FileSystemReader(tmp_path / "c").read_metadata().state_dict_metadata
    b = dcpx.FileSystemReader(tmp_path / "direct").read_metadata().state_dict_metadata
    assert sorted(a) == sorted(b)
    fresh = _train_state()
    fresh["step"] = 0
    dcpx.load(fresh, checkpoint_id=tmp_path / "c")
    assert fresh["step"] == 7
    for k, v in sd["optim"]["state"].items():
        for kk, t in v.items():
            assert_bit_equal(fresh["optim"]["state"][k][kk], t)


def test_torch_save_keys_that_collide_are_refused(tmp_path, capsys):
    torch.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, tmp_path / "x.pt")
    torch.save({"a.b": torch.ones(1)}, tmp_path / "y.pt")
    rc, _, err = _cli(capsys, "diff", tmp_path / "x.pt", tmp_path / "y.pt")
    assert rc == 1 and "x.pt" in err and "a.b" in err, err


# -- convert --overwrite -----------------------------------------------------------------

def test_overwrite_removes_an_earlier_export_in_another_layout(tmp_path, capsys):
    """--overwrite into a folder that an earlier convert wrote in another
    layout removes that export's files (its .dcpx-convert.json names them),
    not the user's others; a model.safetensors that convert did not write
    into the folder (a single-file output is not recorded) is refused."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file
    sd = {"model": {"a": torch.arange(64.0), "b": torch.ones(64)}}
    dcpx.save(sd, checkpoint_id=tmp_path / "c")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert _cli(capsys, "convert", tmp_path / "c", out / "model.safetensors")[0] == 0
    rc, _, err = _cli(capsys, "convert", tmp_path / "c", out, "--max-shard-size", "300",
                      "--overwrite")
    assert rc == 1 and "model.safetensors (transformers loads it before the index)" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    (out / "model.safetensors").unlink()          # the user's call
    rc, _, err = _cli(capsys, "convert", tmp_path / "c", out, "--max-shard-size", "300",
                      "--overwrite")
    assert rc == 0, err
    names = sorted(p.name for p in out.iterdir())
    assert names == [".dcpx-convert.json", "config.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json"], names
    # the shards -> a DCP checkpoint in the same folder: the shards go
    rc, _, err = _cli(capsys, "convert", tmp_path / "c", out, "--to", "dcp", "--overwrite")
    assert rc == 0, err
    assert "model-00001-of-00002.safetensors" in err               # said what it removed
    names = sorted(p.name for p in out.iterdir() if not p.name.endswith(".distcp"))
    assert names == [".dcpx-convert.json", ".metadata", "config.json"], names
    # and back: the DCP files go
    rc, _, err = _cli(capsys, "convert", tmp_path / "c", out, "--max-shard-size", "1GB",
                      "--overwrite")
    assert rc == 0, err
    names = sorted(p.name for p in out.iterdir())
    assert names == [".dcpx-convert.json", "config.json", "model-00001-of-00001.safetensors",
                     "model.safetensors.index.json"], names
    got = load_file(out / "model-00001-of-00001.safetensors")
    assert_bit_equal(got["model.a"], sd["model"]["a"])


def test_convert_into_its_own_input_is_refused(tmp_path, capsys):
    dcpx.save({"a": torch.ones(2)}, checkpoint_id=tmp_path / "c")
    rc, _, err = _cli(capsys, "convert", tmp_path / "c", tmp_path / "c", "--to", "dcp",
                      "--overwrite")
    assert rc == 1 and "is the input" in err, err
    assert dcpx.FileSystemReader(tmp_path / "c").read_metadata() is not None


# -- convert to .pt ------------------------------------------------------------------------

def test_convert_to_torch_save_prints_no_warning(tmp_path):
    t = torch.arange(100.0).reshape(10, 10)
    torch.save({"view": t[3:5], "whole": t, "tail": t.reshape(-1)[95:]}, tmp_path / "v.pt")
    dcpx.save({"a": torch.ones(3), "step": 1}, checkpoint_id=tmp_path / "c")
    script = (
        "import sys\nfrom dcpx.cli import main\n"
        "assert main([sys.argv[1], sys.argv[2] + '/c', sys.argv[2] + '/c.pt']) == 0\n"
        "assert main([sys.argv[1], sys.argv[2] + '/v.pt', sys.argv[2] + '/w.pt']) == 0\n")
    run = subprocess.run([sys.executable, "-c", script, "convert", str(tmp_path)],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr == "", run.stderr
    got = torch.load(tmp_path / "w.pt", weights_only=True)
    want = torch.load(tmp_path / "v.pt", weights_only=True)
    for k in want:                      # views of one storage: each its own bytes
        assert_bit_equal(got[k], want[k])


# -- --help without torch ---------------------------------------------------------------------

def test_help_and_version_do_not_import_torch():
    script = (
        "import sys\nfrom dcpx.cli import main\n"
        "for argv in (['--help'], ['inspect', '--help'], ['verify', '--help'], ['--version']):\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=_env(), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"dcpx {dcpx.__version__}" in run.stdout
    for name in ("ls", "inspect", "verify", "diff", "convert"):
        assert f"    {name}" in run.stdout, run.stdout


def test_help_lines_are_the_commands_own():
    import importlib

    from dcpx import cli
    for name in cli.NAMES:
        assert cli._help_of(name) == importlib.import_module(f"dcpx.cli.{name}").HELP


def test_metadata_file_name_is_dcpx_own():
    from dcpx.cli._common import METADATA_FN
    from dcpx.filesystem import METADATA_FN as real
    assert METADATA_FN == real


def test_import_dcpx_is_lazy_and_complete():
    """Without torch imported first, ``import dcpx`` does not import it;
    the first public name does, and then everything is there."""
    script = (
        "import sys\nimport dcpx\n"
        "assert 'torch' not in sys.modules\n"
        "assert dcpx.__version__ and dcpx._C.crc32_impl\n"
        "assert 'torch' not in sys.modules\n"
        "save = dcpx.save\n"
        "import torch.distributed.checkpoint as tdcp\n"
        "from dcpx.api.compat import torch_public_names\n"
        "assert set(torch_public_names()) <= set(dcpx.__all__)\n"
        "assert all(hasattr(dcpx, n) for n in dcpx.__all__)\n"
        "assert dcpx.FileSystemWriter.__module__.startswith('dcpx')\n"
        "ns = {}\nexec('from dcpx import *', ns)\n"
        "assert 'CheckpointManager' in ns\n"
        "assert ('HuggingFaceStorageReader' in ns) == hasattr(tdcp, 'HuggingFaceStorageReader')\n"
        "assert 'CheckpointManager' in dir(dcpx)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=_env(), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_first_use_from_many_threads_at_once():
    script = (
        "import sys, threading\nimport dcpx\n"
        "assert 'torch' not in sys.modules\n"
        "start, got, errors = threading.Barrier(8), [], []\n"
        "def use(name):\n"
        "    start.wait()\n"
        "    try:\n        got.append(getattr(dcpx, name))\n"
        "    except Exception as e:\n        errors.append(repr(e))\n"
        "names = ['save', 'load', 'CheckpointManager', 'FileSystemWriter'] * 2\n"
        "ts = [threading.Thread(target=use, args=(n,)) for n in names]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "assert not errors and len(got) == 8, errors\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=_env(), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
