"""Every fenced code block of README.md and docs/*.md runs as written
(issue 22, item 7), so none can rot.

The rules (docs: README, "Documentation"):

* ```python``` blocks run as a script, in a fresh directory, after a prelude
  that fills the placeholders a snippet leaves to the reader (``state_dict``,
  ``state``, ``train_step``, ``steps``, ``every``, ``ckpt``, ...);
* ```sh``` blocks run with ``bash -e -o pipefail`` in a fresh directory
  holding the files they name (``runs/llama/step-200``, ``ckpt/step-1000``,
  ``pretrained.pt``, ``config.json``, ``tokenizer.json``, and ``examples/``
  as in the repository), with ``dcpx`` and
  ``python`` on the PATH meaning this tree's;
* ```text``` blocks are output, layouts and signatures: not commands;
* a block that is a command but must not run here (it takes tens of minutes,
  downloads GBs, needs GPUs) has ``<!-- doc-test: skip: REASON -->`` on the
  line before; there are few, and each says why.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
SKIP = re.compile(r"^<!-- doc-test: skip: (.+\S) -->$")
#: at most this many runnable blocks may be skipped
MAX_SKIPPED = 8


def _blocks() -> list[dict]:
    out = []
    for path in DOCS:
        lines = path.read_text().split("\n")
        i = 0
        while i < len(lines):
            m = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
            if m:
                j = i + 1
                while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
                    j += 1
                prev = lines[i - 1].strip() if i else ""
                skip = SKIP.match(prev)
                out.append({"file": path.relative_to(REPO).as_posix(), "line": i + 1,
                            "lang": m.group(2), "skip": skip.group(1) if skip else None,
                            "code": textwrap.dedent("\n".join(lines[i + 1:j]))})
                i = j
            i += 1
    return out


BLOCKS = _blocks()
RUN = [b for b in BLOCKS if b["lang"] in ("python", "sh") and not b["skip"]]


def test_every_block_says_what_it_is():
    untagged = [f"{b['file']}:{b['line']}" for b in BLOCKS if b["lang"] not in ("python", "sh", "text")]
    assert not untagged, f"blocks without a python / sh / text tag: {untagged}"
    skipped = [b for b in BLOCKS if b["skip"]]
    assert len(skipped) <= MAX_SKIPPED, [f"{b['file']}:{b['line']}" for b in skipped]
    assert all(b["lang"] in ("python", "sh") for b in skipped)
    assert len(RUN) >= 8


PRELUDE = '''
import os, sys
import torch
import dcpx
torch.manual_seed(0)
# placeholders a snippet leaves to the reader
model = torch.nn.Linear(4, 3)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
state_dict = {"model": model.state_dict(), "step": 0}
state = {"model": {"w": torch.randn(4, 3)}, "step": 0}
steps, every, total_steps, start = 4, 2, 4, 0
def train_step():
    with torch.no_grad():
        state["model"]["w"].add_(1.0)
ckpt = dcpx.CheckpointManager("ckpt-manager", async_mode="sync", save_interval_steps=2)
'''

SH_FIXTURE = '''
import json, torch, dcpx
g = torch.Generator().manual_seed(0)
model = {"embed.weight": torch.randn(16, 8, generator=g), "layers.0.w": torch.randn(8, 8, generator=g)}
dcpx.save({"model": model, "optim": {"state": {"0": {"exp_avg": torch.randn(8, generator=g)}}},
           "step": 200}, checkpoint_id="runs/llama/step-200")
dcpx.save({"model": model, "step": 1000}, checkpoint_id="ckpt/step-1000")
torch.save({"w": torch.randn(4, 4, generator=g)}, "pretrained.pt")
open("config.json", "w").write(json.dumps({"model_type": "llama"}))
open("tokenizer.json", "w").write("{}")
'''


def _env(tmp_path: Path) -> dict:
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    for name, cmd in (("python", ""), ("dcpx", " -m dcpx")):
        p = bin_ / name
        p.write_text(f'#!/bin/sh\nexec "{sys.executable}"{cmd} "$@"\n')
        p.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCPX_")}
    env["PATH"] = f"{bin_}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in sys.path if p])
    return env


@pytest.mark.parametrize("block", RUN, ids=[f"{b['file']}:{b['line']}" for b in RUN])
def test_block_runs_as_written(block, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    env = _env(tmp_path)
    if block["lang"] == "python":
        script = work / "block.py"
        body = PRELUDE + "\n" + block["code"] + "\n"
        # the ``if __name__ == "__main__":`` guard a training script needs
        # where a save may start a process
        script.write_text("def _main():\n" + textwrap.indent(body, "    ")
                          + "\n\nif __name__ == '__main__':\n    _main()\n")
        cmd = [sys.executable, str(script)]
    else:
        subprocess.run([sys.executable, "-c", SH_FIXTURE], cwd=work, env=env, check=True,
                       capture_output=True, timeout=300)
        (work / "examples").symlink_to(REPO / "examples")  # as run from the repository root
        script = work / "block.sh"
        script.write_text("set -eo pipefail\n" + block["code"] + "\n")
        cmd = ["bash", str(script)]
    run = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (
        f"{block['file']}:{block['line']} fails as written (rc {run.returncode}):\n"
        f"{block['code']}\n--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-3000:]}")
