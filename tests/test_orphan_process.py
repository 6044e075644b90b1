"""An orphaned checkpoint process never commits over a newer save (issue 23,
item 6).

The reproducer: a training process saves generation 1 into D, then
``async_save(..., async_checkpointer_type=PROCESS)`` generation 2 into D with
the checkpoint process *spawned by that call*, and is SIGKILLed a moment
after ``staging_completion``; the restarted job saves generation 3 into D at
once with ``dcpx.save``, which returns ok.  Whatever the timing, D must then
hold generation 3 once the orphan has exited.

On main before this change the orphan committed generation 2 over it in every
trial killed while the checkpoint process was still starting (3 of 3 at
0.1 s): the checkpoint process took its parent's pid from ``os.getppid()``
when it started, seconds after the call (it imports torch), when the parent
could already be dead, so it took its new parent (init, a subreaper) for the
one that handed it the save and never saw it die.  The trials here run in
parallel, each with its own delay (from killing at once to killing after the
upload committed), so the whole test takes about a minute on 2 shared cores.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import dcpx
from conftest import pid_gone

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
]

TESTS = Path(__file__).resolve().parent
DCPX_ROOT = Path(dcpx.__file__).resolve().parents[1]  # the dcpx under test
TIMEOUT = 240
NUMEL = 1 << 16

# The training process: generation 1 (sync), then generation 2 through a
# PROCESS upload whose checkpoint process this call starts; SIGKILLs itself
# ``delay`` seconds after staging completed (or, for delay "committed", after
# the upload committed).
_P1 = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch
    import dcpx, dcpx.api.process
    from dcpx.staging import DefaultStager, StagingOptions

    def gen(g, tensors):
        return {**{f"t{i}": torch.full((%(numel)d,), float(g)) for i in range(tensors)},
                "gen": g}

    if __name__ == "__main__":
        d, delay = sys.argv[1], sys.argv[2]
        dcpx.save(gen(1, 4), checkpoint_id=d)
        assert dcpx.api.process._worker is None  # the call below spawns it
        stager = DefaultStager(StagingOptions(use_async_staging=True, use_shared_memory=True))
        r = dcpx.async_save(gen(2, 24), storage_writer=dcpx.FileSystemWriter(d, sync_files=True),
                            async_checkpointer_type=dcpx.AsyncCheckpointerType.PROCESS,
                            async_stager=stager)
        r.staging_completion.result(timeout=120)
        print(json.dumps({"worker": dcpx.api.process._worker.proc.pid}), flush=True)
        if delay == "committed":
            r.upload_completion.result(timeout=120)
        else:
            time.sleep(float(delay))
        os.kill(os.getpid(), signal.SIGKILL)
""") % {"numel": NUMEL}


def _generation(d: Path) -> float:
    """The generation D holds, every tensor checked against it (a mix of two
    saves fails)."""
    sdm = dcpx.FileSystemReader(d).read_metadata().state_dict_metadata
    dest = {k: torch.zeros(NUMEL) for k in sdm if k.startswith("t")}
    dest["gen"] = -1
    dcpx.load(dest, checkpoint_id=d)
    g = dest["gen"]
    for k, t in dest.items():
        if k != "gen":
            assert torch.equal(t, torch.full((NUMEL,), float(g))), f"{d}: {k} is not gen {g}"
    return g


def _trial(d: Path, delay: str, out: dict) -> None:
    p = subprocess.Popen([sys.executable, "-c", _P1, str(d), delay],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(DCPX_ROOT)})
    worker = None
    try:
        line = p.stdout.readline()
        if not line:
            p.wait(TIMEOUT)
            out["error"] = f"the training process failed: {p.stderr.read()}"
            return
        worker = json.loads(line)["worker"]
        p.wait(TIMEOUT)
        assert p.returncode == -signal.SIGKILL, p.returncode
        # The restarted job, at once.
        dcpx.save({**{f"t{i}": torch.full((NUMEL,), 3.0) for i in range(2)}, "gen": 3},
                  checkpoint_id=d)
        deadline = time.monotonic() + TIMEOUT
        while not pid_gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pid_gone(worker):
            out["error"] = f"the orphaned checkpoint process {worker} did not exit"
            return
        out["refused"] = "not committed" in p.stderr.read()
        out["gen"] = _generation(d)
        md = dcpx.FileSystemReader(d).read_metadata()
        referenced = {info.relative_path for info in md.storage_data.values()}
        out["left"] = sorted(set(os.listdir(d)) - {".metadata"} - referenced)
    except BaseException as e:  # reported by the test
        out["error"] = repr(e)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if worker is not None and not pid_gone(worker):
            os.kill(worker, signal.SIGKILL)


def test_orphan_spawned_by_the_call_never_commits_over_the_restarted_jobs_save(tmp_path):
    rng = random.Random()
    delays = ["0", "0.1", "0.1", f"{rng.uniform(0, 0.5):.3f}", f"{rng.uniform(0.5, 2):.3f}",
              "committed"]
    print("delays", delays)
    outs = [dict() for _ in delays]
    threads = [threading.Thread(target=_trial, args=(tmp_path / f"d{i}", delay, outs[i]))
               for i, delay in enumerate(delays)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(2 * TIMEOUT)
    print("outcomes", list(zip(delays, outs)))
    for delay, out in zip(delays, outs):
        assert "error" not in out, f"delay {delay}: {out['error']}"
    bad = [(delay, out["gen"]) for delay, out in zip(delays, outs) if out["gen"] != 3]
    assert not bad, f"the restarted job's save (gen 3) was replaced: (delay, gen) {bad}"
    for delay, out in zip(delays, outs):
        assert not out["left"], f"delay {delay}: left {out['left']} besides the checkpoint"
