"""scripts/torch_dcp_tests.sh: runs a torch DCP test file with torch's save /
load and again with dcpx's patched in (in every process), and reports both
runs' counts per file (issue 23, item 5)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "torch_dcp_tests.sh"

_FAKE = textwrap.dedent('''
    import os, subprocess, sys
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import save as imported_save

    PATCHED = os.environ.get("DCPX_PATCH_TORCH") == "1"

    def _module(f):
        return f.__module__.split(".")[0]

    def test_package_attributes():
        assert _module(dcp.save) == ("dcpx" if PATCHED else "torch")
        assert _module(dcp.load) == ("dcpx" if PATCHED else "torch")
        assert _module(dcp.async_save) == ("dcpx" if PATCHED else "torch")

    def test_names_imported_by_the_test_module():
        assert _module(imported_save) == ("dcpx" if PATCHED else "torch")

    def test_a_spawned_process_is_patched_too():
        out = subprocess.check_output([sys.executable, "-c",
            "import torch.distributed.checkpoint as d; print(d.load.__module__)"], text=True)
        assert out.split(".")[0].strip() == ("dcpx" if PATCHED else "torch")

    def test_round_trip(tmp_path):
        dcp.save({"a": torch.arange(3.0)}, checkpoint_id=tmp_path)
        sd = {"a": torch.zeros(3)}
        dcp.load(sd, checkpoint_id=tmp_path)
        assert torch.equal(sd["a"], torch.arange(3.0))

    def test_fails_only_with_dcpx():
        assert not PATCHED
''')


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_script_runs_each_file_with_torch_and_with_dcpx(tmp_path):
    d = tmp_path / "torch_tests"
    d.mkdir()
    (d / "test_fake_dcp.py").write_text(_FAKE)
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "logs"),
           "TIMEOUT": "300"}
    r = subprocess.run(["bash", str(SCRIPT), str(d)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| test_fake_dcp.py")]
    assert len(rows) == 1, r.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "5 / 0 / 0 / 0", (cells, r.stdout)   # torch: all pass
    assert cells[2] == "4 / 1 / 0 / 0", (cells, r.stdout)   # dcpx: one fails, on purpose
    assert "only with dcpx:" in cells[3] and "test_fails_only_with_dcpx" in cells[3]
