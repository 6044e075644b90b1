"""scripts/setup.sh's torch decision, without installing anything.

Setup reuses a torch that the chosen Python already imports, installs only an
exact ``torch==X.Y.Z`` (or a wheel file) otherwise, and never hands pip a bare
``torch`` or a range without an explicitly chosen index (from PyPI that would
pull the newest CUDA build, several GB).  ``DCPX_SETUP_DRY_RUN=1`` prints the
decision and changes nothing; these tests run it in a copy of scripts/.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcpx

ROOT = Path(dcpx.__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.fixture
def repo(tmp_path) -> Path:
    text = (ROOT / "scripts" / "setup.sh").read_text()
    assert "DCPX_SETUP_DRY_RUN" in text, "setup.sh has no dry run to test its decisions with"
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    return tmp_path


@pytest.fixture
def python_without_torch(tmp_path) -> str:
    """This interpreter with no site-packages at all, so no torch."""
    wrapper = tmp_path / "python-without-torch"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    wrapper.chmod(0o755)
    assert subprocess.run([str(wrapper), "-c", "import torch"],
                          capture_output=True).returncode != 0
    return str(wrapper)


def _dry_run(repo: Path, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("DCPX_") and k not in ("PYTHON", "LD_PRELOAD")}
    e.update(env, DCPX_SETUP_DRY_RUN="1")
    run = subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], env=e,
                         capture_output=True, text=True, timeout=300)
    assert not (repo / ".venv").exists(), "the dry run created the venv"
    return run


def test_reuses_the_torch_the_python_has(repo):
    run = _dry_run(repo, PYTHON=sys.executable)
    assert run.returncode == 0, run.stderr
    site = os.path.dirname(os.path.dirname(torch.__file__))
    assert f"torch: reuse torch {torch.__version__} from {site}" in run.stdout, run.stdout
    assert "install" not in run.stdout


def test_installs_the_pinned_torch_only_when_there_is_none(repo, python_without_torch):
    run = _dry_run(repo, PYTHON=python_without_torch)
    assert run.returncode == 0, run.stderr
    assert "torch: install torch==2.13.0 from pip's configured index" in run.stdout, run.stdout
    # the output says what that is on PyPI, and how to get the CPU build
    assert "CUDA build" in run.stdout and f"DCPX_TORCH_INDEX_URL={CPU_INDEX}" in run.stdout


@pytest.mark.parametrize("spec", ["torch", "torch>=2.4", "torch<3", "torch==2.*",
                                  "torch==2.13.0,!=2.13.1", "numpy"])
def test_refuses_an_open_torch_requirement(repo, python_without_torch, spec):
    run = _dry_run(repo, PYTHON=python_without_torch, DCPX_TORCH_SPEC=spec)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "refusing" in run.stderr and CPU_INDEX in run.stderr, run.stderr


def test_an_explicit_index_allows_any_requirement(repo, python_without_torch):
    run = _dry_run(repo, PYTHON=python_without_torch, DCPX_TORCH_SPEC="torch",
                   DCPX_TORCH_INDEX_URL=CPU_INDEX)
    assert run.returncode == 0, run.stderr
    assert f"torch: install torch --index-url {CPU_INDEX}" in run.stdout, run.stdout


def test_an_explicit_spec_is_installed_even_over_an_existing_torch(repo):
    run = _dry_run(repo, PYTHON=sys.executable, DCPX_TORCH_SPEC="torch==2.13.0")
    assert run.returncode == 0, run.stderr
    assert "torch: install torch==2.13.0" in run.stdout, run.stdout
    run = _dry_run(repo, PYTHON=sys.executable, DCPX_TORCH_SPEC="/wheels/torch-2.13.0.whl")
    assert run.returncode == 0 and "torch: install /wheels/torch-2.13.0.whl\n" in run.stdout
