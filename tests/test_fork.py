"""os.fork() after dcpx was used: the child can save and load, and exits;
the parent's save in flight at the fork completes.

Each scenario runs in its own process (``tests/fork_child.py``, whose
docstring has the details), which uses dcpx, forks at a chosen moment, and
checks both sides bit for bit:

* the child (which first sets ``torch.set_num_threads(1)``, as torch's
  DataLoader workers do: torch's OpenMP pool is not fork-safe) loads the
  parent's checkpoint, saves, ``async_save``s (THREAD) with the stager it
  inherited and with a per-call one, loads each back, and leaves through
  the normal interpreter exit within a bounded time;
* the parent's save that was in flight at the fork (held at a gate inside
  its background staging, its upload's planning, or its metadata encoding
  while the C writer threads write) completes and loads bit for bit, and
  the parent's stager serves its next save.

Regressions, each found by one of these scenarios (docs/design.md, Fork):
the child's ``async_save`` hung (the dcpx-upload and dcpx-stage executor
threads, and a stager lock held by one of them, are not in the child); the
child's collector stayed off for good when the parent's upload or staging
thread had paused it; a child staging into the stager it inherited wrote
the very shared-memory pages the parent's upload was about to write
(``plan``: the parent's checkpoint silently held the child's values); the
child's exit stopped the parent's checkpoint process (dcpx's ``exit``
message and multiprocessing's terminate of daemonic children), and its
own PROCESS save raised ``AssertionError``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "fork_child.py"
TIMEOUT = 240  # s: the scenario bounds its own waits; this only backs them up

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONWARNINGS"] = "ignore"  # Python >= 3.12 warns about fork with threads
    return env


@pytest.mark.parametrize("scenario", ["idle", "staging", "plan", "write", "process"])
def test_child_works_and_the_parents_save_completes(tmp_path, scenario):
    proc = subprocess.run([sys.executable, str(CHILD), scenario, str(tmp_path)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert proc.returncode == 0 and "fork: ok" in proc.stdout, \
        f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
