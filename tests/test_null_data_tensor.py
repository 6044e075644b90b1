"""A tensor without storage must be refused, not crash the process.

A wrapper tensor subclass (``torch.Tensor._make_wrapper_subclass``: what
DTensor, FakeTensor and other subclasses are built on) has no storage: its
DLPack export carries a NULL data pointer with a non-zero size.  dcpx's C
core used to accept such a view (``dcpx._C.probe_tensor`` reported ``ptr``
0), and the writer / the staging copy then read from address 0: SIGSEGV.
Now the C core refuses a NULL data pointer with a non-zero size, and
``check_saveable`` refuses a storage-less subclass naming its key.  That is
how the async_save of a DTensor state dict crashed before the stager learnt
to stage DTensors' local shards; any other storage-less subclass still gets
there.  torch's ``dcp.save`` raises an exception for the same value.

Each case runs in a child interpreter, so that a crash fails the test
instead of killing pytest.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import sys, torch, dcpx

    class NoStorage(torch.Tensor):
        @staticmethod
        def __new__(cls, shape):
            return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
                return NoStorage(args[0].shape)
            raise NotImplementedError(str(func))

    t = NoStorage((4096,))
    what, path = sys.argv[1], sys.argv[2]
    try:
        if what == "save":
            dcpx.save({"w": t}, checkpoint_id=path)
        else:
            dcpx.async_save({"w": t}, checkpoint_id=path).result()
    except SystemExit:
        raise
    except BaseException as e:
        print("raised", type(e).__name__, str(e)[:300])
        sys.exit(0)
    print("accepted")
""")


def run_child(what: str, path: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "")
                                                       .split(os.pathsep) if p])
    return subprocess.run([sys.executable, "-c", CHILD, what, path], capture_output=True,
                          text=True, timeout=120, env=env, cwd=str(REPO))


@pytest.mark.parametrize("what", ["save", "async_save"])
def test_storageless_tensor_is_refused_not_a_crash(tmp_path, what):
    r = run_child(what, str(tmp_path / "ckpt"))
    assert r.returncode == 0, (
        f"dcpx.{what} of a tensor without storage killed the process (exit code "
        f"{r.returncode}); stderr tail:\n{r.stderr[-2000:]}")
    assert r.stdout.startswith("raised"), f"dcpx.{what} accepted it: {r.stdout}"
    assert "'w'" in r.stdout and "without storage" in r.stdout, r.stdout


def test_c_core_refuses_null_data_pointer():
    """The C check on its own (the Python check runs first in save)."""
    import torch
    from dcpx import _C
    ns = {}
    exec(CHILD.split("t = NoStorage")[0].replace("import sys, torch, dcpx", "import torch"), ns)
    with pytest.raises(ValueError, match="no data"):
        _C.probe_tensor(ns["NoStorage"]((4096,)))
    assert _C.probe_tensor(ns["NoStorage"]((0,)))["nbytes"] == 0   # empty: nothing to read
