"""scripts/test.sh passes its arguments to pytest, and a rebuild swaps the
extension in atomically.

``scripts/test.sh tests/test_x.py`` runs that file only (pytest collects
``tests/`` by itself when no path is given).  The rebuild that setup.sh runs
(``pip install -e .``, i.e. setup.py's ``build_ext --inplace``) puts the new
``dcpx/_C*.so`` in place with a rename, so a process importing dcpx meanwhile
sees the old file or the new one, never a missing or half-written one.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import dcpx

ROOT = Path(dcpx.__file__).resolve().parent.parent


def _fake_repo(tmp_path: Path) -> Path:
    """scripts/test.sh with a no-op setup, the real pytest, and a tests/ of
    two files: one passing, one failing."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "test.sh", repo / "scripts")
    shutil.copy(ROOT / "scripts" / "sanitizer_env.sh", repo / "scripts")
    shutil.copy(ROOT / "pyproject.toml", repo)
    (repo / "scripts" / "setup.sh").write_text("#!/bin/sh\nexit 0\n")
    (repo / "scripts" / "setup.sh").chmod(0o755)
    (repo / ".venv" / "bin").mkdir(parents=True)
    py = repo / ".venv" / "bin" / "python"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    (repo / "tests").mkdir()
    (repo / "tests" / "test_good.py").write_text("def test_good():\n    pass\n")
    (repo / "tests" / "test_bad.py").write_text("def test_bad():\n    assert False\n")
    (repo / "elsewhere").mkdir()
    (repo / "elsewhere" / "test_other.py").write_text("def test_other():\n    pass\n")
    return repo


def _test_sh(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DCPX_", "PYTEST_")) and k != "LD_PRELOAD"}
    return subprocess.run(["bash", str(repo / "scripts" / "test.sh"), *args,
                           "-p", "no:cacheprovider"],
                          cwd=tmp_cwd(repo), env=env, capture_output=True, text=True,
                          timeout=300)


def tmp_cwd(repo: Path) -> Path:
    return repo / "elsewhere"  # test.sh must not depend on where it is run from


def test_a_path_runs_that_file_only(tmp_path):
    repo = _fake_repo(tmp_path)
    run = _test_sh(repo, "tests/test_good.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout and "failed" not in run.stdout, run.stdout


def test_a_test_id_runs_that_test_only(tmp_path):
    repo = _fake_repo(tmp_path)
    run = _test_sh(repo, "tests/test_good.py::test_good")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout, run.stdout


def test_no_path_runs_the_whole_suite_and_options_pass_through(tmp_path):
    repo = _fake_repo(tmp_path)
    run = _test_sh(repo)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed, 1 passed" in run.stdout, run.stdout
    assert "test_other" not in run.stdout  # only tests/, not the whole tree
    run = _test_sh(repo, "-k", "good")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 1 deselected" in run.stdout, run.stdout


def _so_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX")


def test_inplace_rebuild_swaps_the_extension_with_a_rename(tmp_path):
    """What ``pip install -e .`` does after compiling: copy the built
    extension into dcpx/.  The file that was there keeps its bytes (a process
    that mapped it is unaffected) and the new one appears under its name at
    once.  The compile itself is skipped here by giving build_ext an
    up-to-date build, so this takes a second."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "dcpx", repo / "dcpx",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copytree(ROOT / "csrc", repo / "csrc")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, repo)
    (built,) = glob.glob(str(ROOT / "dcpx" / "_C*.so"))
    lib = repo / "build" / "lib"
    (lib / "dcpx").mkdir(parents=True)
    new = lib / "dcpx" / ("_C" + _so_suffix())
    shutil.copy(built, new)
    os.utime(new)  # newer than every source: build_ext does not compile
    target = repo / "dcpx" / ("_C" + _so_suffix())
    target.write_bytes(b"the old build")
    old = open(target, "rb")
    try:
        run = subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace",
             "--build-lib", str(lib), "--build-temp", str(repo / "build" / "temp")],
            cwd=repo, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "gcc" not in run.stdout + run.stderr and "cc " not in run.stdout
        old.seek(0)
        assert old.read() == b"the old build", "the old extension was rewritten in place"
        assert os.fstat(old.fileno()).st_ino != os.stat(target).st_ino
        assert target.read_bytes() == new.read_bytes()
        assert sorted(p.name for p in (repo / "dcpx").iterdir()
                      if ".so" in p.name) == [target.name], "a temporary file was left"
    finally:
        old.close()


def _set_up_venv(tmp_path: Path) -> Path:
    """A copy of scripts/ beside a .venv that setup.sh takes as set up (its
    stamp present), whose python is this one (with this torch)."""
    import re
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    (repo / ".venv" / "bin").mkdir(parents=True)
    py = repo / ".venv" / "bin" / "python"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    stamp = re.search(r'stamp="\$VENV/([^"]+)"', (ROOT / "scripts" / "setup.sh").read_text())
    (repo / ".venv" / stamp.group(1)).touch()
    return repo


def _setup_dry_run(repo: Path, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("DCPX_") and k not in ("PYTHON", "LD_PRELOAD")}
    e.update(env, DCPX_SETUP_DRY_RUN="1")
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], env=e,
                          capture_output=True, text=True, timeout=300)


def test_torch_choice_for_an_existing_venv_is_not_ignored_silently(tmp_path):
    import torch
    repo = _set_up_venv(tmp_path)
    run = _setup_dry_run(repo, DCPX_TORCH_SPEC="torch==2.8.0")
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"already set up, with torch {torch.__version__}" in run.stderr
    assert "rm -rf .venv" in run.stderr and "DCPX_TORCH_SPEC=torch==2.8.0" in run.stderr
    # the torch it has: fine, with a note
    base = torch.__version__.split("+")[0]
    run = _setup_dry_run(repo, DCPX_TORCH_SPEC=f"torch=={base}")
    assert run.returncode == 0, run.stderr
    assert "apply only when it is created" in run.stderr
    # a wheel file: judged by the version in its name
    run = _setup_dry_run(repo, DCPX_TORCH_SPEC=f"/x/torch-{torch.__version__}-cp311-cp311-"
                                                "manylinux_2_28_x86_64.whl")
    assert run.returncode == 0 and "apply only when it is created" in run.stderr, run.stderr
    run = _setup_dry_run(repo, DCPX_TORCH_SPEC="/x/torch-2.8.0-cp311-cp311-linux_x86_64.whl")
    assert run.returncode == 2 and "already set up, with torch" in run.stderr, run.stderr
    run = _setup_dry_run(repo, DCPX_TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu")
    assert run.returncode == 0 and "apply only when it is created" in run.stderr, run.stderr
    run = _setup_dry_run(repo)
    assert run.returncode == 0 and run.stderr == "", run.stderr
