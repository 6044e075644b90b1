"""scripts/gpu_check.sh, the prepared GPU check (issue 20), on a machine
without a GPU: the parts that can run here run (the build, in a copy of the
repository; the import; the collection of the CUDA tests), the GPU parts are
recorded as skipped, and the files and the summary have the promised form.
So the check cannot rot between the rare sessions that have a GPU."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"
CUDA = torch.cuda.is_available()


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _copy_repo(dst: Path) -> Path:
    """The sources the check needs, without any built extension."""
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info", "build", ".venv*")
    for d in ("csrc", "dcpx", "scripts", "tests", "benchmarks"):
        shutil.copytree(REPO / d, dst / d, ignore=ignore)
    for f in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / f, dst / f)
    return dst


@pytest.mark.skipif(CUDA, reason="this machine has CUDA: the GPU parts would run")
@pytest.mark.skipif(os.environ.get("DCPX_SANITIZE", "0") != "0",
                    reason="a script and a build in a copy: the normal run covers it")
def test_the_check_runs_here_and_records_every_part(tmp_path):
    repo = _copy_repo(tmp_path / "repo")
    out = tmp_path / "out"
    parts = "env,build,import,gpu-tests,cuda-tests,bench-1gib,bench-8gib"
    r = subprocess.run(["bash", str(repo / "scripts" / "gpu_check.sh"), str(out), "--quick",
                        "--parts", parts], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(repo.glob("dcpx/_C*.so")), "the build part built no extension"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["check.log", "results.json", "summary.md"] and len(files) <= 8
    res = json.loads((out / "results.json").read_text())
    status = {row["part"]: row["status"] for row in res["parts"]}
    assert status == {"env": "pass", "build": "pass", "import": "pass",
                      "gpu-tests": "skip", "cuda-tests": "skip",
                      "bench-1gib": "skip", "bench-8gib": "skip"}
    assert all(row["result"] for row in res["parts"]), res["parts"]
    assert res["meta"]["device"] == "no CUDA" and res["meta"]["torch"] == torch.__version__
    summary = (out / "summary.md").read_text()
    assert summary in r.stdout  # printed at the end, one screen
    assert len(summary.splitlines()) < 40
    for part in parts.split(","):
        assert re.search(rf"^\| {part} \| (pass|skip) \| [0-9.]+ \| .+ \|$", summary, re.M), part
    assert summary.rstrip().endswith("no part failed")
    log = (out / "check.log").read_text()
    assert "== build:" in log and "== import:" in log and "== gpu-tests" not in log


def test_the_cuda_tests_it_runs_are_collected_and_skip_cleanly_here():
    """The check's two test parts select real tests (no collection error),
    and without CUDA every one of them skips."""
    mod = _module()
    cmds = {p[0]: p[1] for p in mod.parts("/tmp/unused", quick=True)}
    for name, minimum in (("gpu-tests", 60), ("cuda-tests", 4)):
        argv = [a for a in cmds[name] if not a.startswith("--junitxml")]
        r = subprocess.run(argv + ["--collect-only", "-q"], cwd=REPO, capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert r.returncode == 0, r.stdout + r.stderr
        # -qq prints "file: count" per file
        count = sum(int(n) for n in re.findall(r"^\S+\.py: (\d+)$", r.stdout, re.M))
        assert count >= minimum, r.stdout[-2000:]
    if not CUDA:
        r = subprocess.run(cmds["gpu-tests"][:-2] + ["tests/test_gpu.py"], cwd=REPO,
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert r.returncode == 0, r.stdout + r.stderr
        counts = mod.pytest_counts(r.stdout)
        assert "skipped" in counts and "passed" not in counts and "error" not in counts


def test_statuses():
    mod = _module()
    assert mod.status_of(None, "") == "fail"  # timed out
    assert mod.status_of(2, "") == "fail"
    assert mod.status_of(1, "") == "fail"  # a load not bit exact
    assert mod.status_of(0, "72 skipped in 1.2s") == "skip"
    assert mod.status_of(0, "70 passed, 2 skipped in 9.0s") == "pass"
    assert mod.status_of(1, "1 failed, 71 passed in 9.0s") == "fail"
    assert mod.status_of(5, "no tests ran in 0.1s") == "fail"
    assert mod.result_line("build", "fail", "x\nfoo.c:1: error: bad\nmore") == "foo.c:1: error: bad"
    assert mod.result_line("suite-subset", "pass", "...\n===== 3 passed in 1.0s =====") \
        == "3 passed in 1.0s"


def test_the_summary_names_the_failures():
    mod = _module()
    meta = {"date": "2026-11-27T12:00:00+00:00", "device": "NVIDIA H100 80GB HBM3",
            "torch": "2.11.0+cu130", "python": "3.12.3", "rev": "abc1234",
            "command": "bash scripts/gpu_check.sh out"}
    rows = [{"part": "build", "status": "pass", "seconds": 12.25, "result": "built"},
            {"part": "gpu-tests", "status": "fail", "seconds": 80.0, "result": "2 failed"},
            {"part": "bench-8gib", "status": "skip", "seconds": 0.0, "result": "budget"}]
    text = mod.summary(rows, meta)
    assert "| build | pass | 12.2 | built |" in text or "| build | pass | 12.3 | built |" in text
    assert "NVIDIA H100 80GB HBM3" in text and "torch 2.11.0+cu130" in text
    assert text.rstrip().endswith("FAILED: gpu-tests")


def test_unknown_parts_are_refused(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "o"), "--parts", "nope"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown parts" in r.stderr
