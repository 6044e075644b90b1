"""The oldest Python that pyproject.toml declares can build and import dcpx.

The suite itself runs under one interpreter (the .venv's).  This test reads
``requires-python`` from pyproject.toml and, when an interpreter of that
version is on the machine (``python3.X`` on PATH or a pyenv version, or
``DCPX_OLDEST_PYTHON``), builds ``dcpx._C`` with that version's headers and
``-Werror``, imports it there, checks its CRC-32 against zlib, and compiles
every module of the package and the tests with it (syntax).  torch is not
needed for any of it, so no torch for that version has to be installed.
Skipped when no such interpreter is found.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dcpx

#: the checkout under test (the one whose dcpx is imported)
ROOT = Path(dcpx.__file__).resolve().parent.parent


def _declared_minimum() -> tuple[int, int]:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^requires-python\s*=\s*">=\s*(\d+)\.(\d+)"', text, re.M)
    assert m, "pyproject.toml declares no requires-python lower bound"
    return int(m.group(1)), int(m.group(2))


def _find_interpreter(major: int, minor: int) -> str | None:
    cands = []
    if os.environ.get("DCPX_OLDEST_PYTHON"):
        cands.append(os.environ["DCPX_OLDEST_PYTHON"])
    which = shutil.which(f"python{major}.{minor}")
    if which:
        cands.append(which)
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    cands += sorted(glob.glob(f"{root}/versions/{major}.{minor}.*/bin/python"))
    for c in cands:
        try:
            out = subprocess.run(
                [c, "-c", "import sys; print(*sys.version_info[:2])"],
                capture_output=True, text=True, timeout=60, env=_clean_env())
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.split() == [str(major), str(minor)]:
            return c
    return None


def _clean_env() -> dict[str, str]:
    # The sanitizer runs preload their runtimes (scripts/sanitizer_env.sh);
    # the other interpreter and its build are not instrumented.
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "DCPX_SANITIZE", "PYTHONPATH", "PYTHONHOME")}
    env["DCPX_WERROR"] = "1"
    return env


def test_oldest_declared_python_builds_and_imports_extension(tmp_path):
    major, minor = _declared_minimum()
    if (major, minor) == sys.version_info[:2]:
        pytest.skip("the suite already runs on the oldest declared Python")
    py = _find_interpreter(major, minor)
    if py is None:
        pytest.skip(f"no Python {major}.{minor} interpreter on this machine")
    env = _clean_env()
    if subprocess.run([py, "-c", "import setuptools"], env=env,
                      capture_output=True).returncode != 0:
        pytest.skip(f"{py} has no setuptools to build with")

    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    (tmp_path / "dcpx").mkdir()
    build = subprocess.run(
        [py, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path,
        env=env, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, (
        f"dcpx._C does not build on Python {major}.{minor}:\n"
        f"{build.stdout[-4000:]}\n{build.stderr[-4000:]}")
    (so,) = glob.glob(str(tmp_path / "dcpx" / "_C*.so"))

    sources = sorted(str(p) for p in [*ROOT.glob("dcpx/*.py"), *ROOT.glob("tests/*.py")])
    check = textwrap.dedent("""
        import importlib.util, sys, zlib
        so, sources = sys.argv[1], sys.argv[2:]
        spec = importlib.util.spec_from_file_location("dcpx._C", so)
        C = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(C)
        data = bytes(range(256)) * 4099
        assert C.crc32(data) == zlib.crc32(data), "crc32"
        a, b = data[:1000], data[1000:]
        assert C.crc32_combine(C.crc32(a), C.crc32(b), len(b)) == zlib.crc32(data)
        assert isinstance(C.WriteJob, type)
        for path in sources:
            with open(path, encoding="utf-8") as f:
                compile(f.read(), path, "exec")
        print("ok", C.crc32_impl, len(sources))
    """)
    run = subprocess.run([py, "-c", check, so, *sources], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok"), (
        f"Python {major}.{minor}: {run.stdout}\n{run.stderr}")
