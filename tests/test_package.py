"""dcpx as a package people install (issue 22, item 5).

The source distribution holds everything the extension needs to build; the
wheel built from it (made manylinux by auditwheel where it is installed)
installs into a virtual environment that already has torch without
touching that torch (no index is even reachable to the install) and without
a compiler on the PATH, and works there: ``dcpx --version``, a save, a load
and ``dcpx verify`` from the installed copy, not the source tree.
``scripts/build_dist.sh`` is the command that builds them for release.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import dcpx

REPO = Path(dcpx.__file__).resolve().parent.parent


def _have(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"],
                          capture_output=True).returncode == 0


def _source_copy(tmp_path: Path) -> Path:
    """The files an sdist is built from (no .venv, no built extension)."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "dcpx", src / "dcpx",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copytree(REPO / "csrc", src / "csrc")
    shutil.copytree(REPO / "tests", src / "tests",
                    ignore=shutil.ignore_patterns("__pycache__", "fake_cuda"))
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy(REPO / name, src)
    return src


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    run = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                         timeout=kw.pop("timeout", 600), **kw)
    assert run.returncode == 0, f"{cmd}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


def _sdist(tmp_path: Path) -> Path:
    if not _have("build"):
        pytest.skip("the 'build' package is not installed (scripts/setup.sh installs it)")
    out = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", out,
          _source_copy(tmp_path)])
    (sdist,) = out.glob("dcpx-*.tar.gz")
    return sdist


def test_sdist_holds_every_source_the_extension_needs(tmp_path):
    sdist = _sdist(tmp_path)
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = {f"csrc/{p.name}" for p in (REPO / "csrc").iterdir() if p.suffix in (".c", ".h")}
    assert wanted - names == set(), f"missing from the sdist: {sorted(wanted - names)}"
    for name in ("setup.py", "pyproject.toml", "README.md", "dcpx/py.typed", "dcpx/_C.pyi",
                 "dcpx/cli/__init__.py"):
        assert name in names
    assert not any(n.startswith("tests/") for n in names), "tests/ is not part of the package"


def _venv_with_this_torch(tmp_path: Path) -> Path:
    """A fresh venv (no pip, no dcpx) that imports the torch this test runs
    with, as an installed package pip can see."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    py = venv / "bin" / "python"
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout
    torch_site = os.path.dirname(os.path.dirname(torch.__file__))
    # A plain path line: the folder joins sys.path, but its own .pth files
    # are not run, so an editable dcpx installed beside this torch (the
    # suite's .venv when it installed torch itself, as on a fresh CI
    # machine) does not come along.
    Path(site.strip(), "_test_torch.pth").write_text(torch_site + "\n")
    return venv


def _torch_in(py: Path, cwd: Path) -> str:
    return _run([py, "-c", "import torch; print(torch.__version__, torch.__file__)"],
                cwd=cwd).stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DCPX_SLOW") != "1",
                    reason="builds the extension from the sdist (minutes): set DCPX_SLOW=1")
def test_wheel_installs_beside_an_existing_torch_without_a_compiler(tmp_path):
    sdist = _sdist(tmp_path)
    wheels = tmp_path / "wheels"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DCPX_", "PYTHON"))}
    # the wheel, built from the sdist (so a file missing from it fails here)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--wheel-dir", wheels, sdist], env=env, timeout=900)
    (wheel,) = wheels.glob("dcpx-*.whl")
    if _have("auditwheel"):
        env_aw = dict(env, PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
        _run([sys.executable, "-m", "auditwheel", "repair", "--wheel-dir", wheels, wheel],
             env=env_aw)
        wheel.unlink()
        (wheel,) = wheels.glob("dcpx-*.whl")
        assert "-manylinux_" in wheel.name, wheel.name

    venv = _venv_with_this_torch(tmp_path)
    py = venv / "bin" / "python"
    work = tmp_path / "work"          # not the source tree: dcpx must come from the venv
    work.mkdir()
    before = _torch_in(py, work)
    assert subprocess.run([py, "-c", "import dcpx"], cwd=work,
                          capture_output=True).returncode != 0

    # No compiler and no index: pip may only unpack the wheel, and would fail
    # if it wanted any other torch than the one installed.
    bare = dict(env, PATH=str(venv / "bin"), CC="/bin/false", CXX="/bin/false")
    assert shutil.which("gcc", path=bare["PATH"]) is None
    assert shutil.which("cc", path=bare["PATH"]) is None
    run = _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-index",
                "--find-links", wheels, wheel], env=bare, cwd=work)
    assert "torch" not in run.stdout.split("Successfully installed")[-1], run.stdout
    assert _torch_in(py, work) == before, "installing dcpx changed torch"

    run = _run([venv / "bin" / "dcpx", "--version"], env=bare, cwd=work)
    assert run.stdout.strip() == f"dcpx {dcpx.__version__}"
    script = (
        "import dcpx, torch, os\n"
        "assert dcpx.__file__.startswith(os.environ['VENV']), dcpx.__file__\n"
        "sd = {'w': torch.arange(6.0).reshape(2, 3), 'step': 3}\n"
        "dcpx.save(sd, checkpoint_id='ck')\n"
        "got = {'w': torch.zeros(2, 3), 'step': 0}\n"
        "dcpx.load(got, checkpoint_id='ck')\n"
        "assert torch.equal(got['w'], sd['w']) and got['step'] == 3\n")
    _run([py, "-c", script], env=dict(bare, VENV=str(venv)), cwd=work)
    run = _run([venv / "bin" / "dcpx", "verify", "ck"], env=bare, cwd=work)
    assert "OK" in run.stdout


def test_build_script_is_the_documented_command():
    text = (REPO / "scripts" / "build_dist.sh").read_text()
    assert "-m build" in text and "auditwheel repair" in text
    assert "scripts/build_dist.sh" in (REPO / "README.md").read_text()
