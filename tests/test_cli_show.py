"""Showing a value has bounded work and output (issue 31, item 6).

A non-tensor value's pickle of a few hundred bytes can build a structure
whose tree is exponential (memo-shared nesting: a list of two references to
a list of two references ... 40 levels), and a 600 KB string referenced
many times is a repr of hundreds of MB.  On main, ``inspect``,
``inspect --json`` and ``diff --values`` walked (``repr``, ``json``,
``==``) the whole tree: they hung, or built a 900 MB repr.  Now the text
of a value is cut at a size, nesting at a depth, and a shared container is
shown once (dcpx/cli/_show.py)."""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcpx.cli import _show
from dcpx.cli.diff import VALUE_TEXT_MAX
from dcpx.cli.inspect import REPR_MAX
from dcpx.filesystem import FileSystemWriter

REPO = Path(__file__).resolve().parent.parent


def _dag(levels: int, kind: str):
    x: object = []
    for _ in range(levels):
        x = [x, x] if kind == "list" else {"a": x, "b": x}
    return x


def _save_value(path: Path, value) -> int:
    """A DCP checkpoint holding ``value`` under "v" (written without dcpx.save,
    whose flattening walks the state dict), and the bytes of its data file."""
    FileSystemWriter(path).write_items(iter([("v", value), ("t", torch.ones(2))]))
    return sum(p.stat().st_size for p in path.glob("*.distcp"))


def test_show_exponential_and_huge_values_with_bounded_output(tmp_path):
    """One subprocess runs inspect, inspect --json and diff --values over
    three hostile values (on main the first two hang for ever: the
    subprocess is given a generous limit, only so that a hang fails the test
    instead of stalling the suite)."""
    big = "y" * 600_000
    cases = {"list": _dag(40, "list"), "dict": _dag(40, "dict"), "str": [big] * 200}
    for name, v in cases.items():
        size = _save_value(tmp_path / name, v)
        assert size < 620_000 if name == "str" else size < 4096, (name, size)
        _save_value(tmp_path / f"{name}2", v)
    script = (
        "import contextlib, io, json, sys\n"
        "from dcpx.cli import main\n"
        "root, out = sys.argv[1], {}\n"
        "for name in sys.argv[2:]:\n"
        "    d = root + '/' + name\n"
        "    other = root + ('/dict' if name == 'list' else '/list')\n"
        "    cmds = {'text': ['inspect', d], 'json': ['inspect', '--json', d],\n"
        "            'same': ['diff', '--values', d, d + '2'],\n"
        "            'other': ['diff', '--values', d, other]}\n"
        "    for what, cmd in cmds.items():\n"
        "        buf = io.StringIO()\n"
        "        with contextlib.redirect_stdout(buf):\n"
        "            rc = main(cmd)\n"
        "        out[name + ' ' + what] = (rc, buf.getvalue())\n"
        "json.dump(out, open(root + '/out.json', 'w'))\n")
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path), *cases],
                       env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    for name in cases:
        rc, listing = out[f"{name} text"]
        assert rc == 0
        (line,) = [ln for ln in listing.splitlines() if ln.startswith("  v: ")]
        assert len(line) <= REPR_MAX + 20, line
        rc, js = out[f"{name} json"]
        assert rc == 0
        entry = json.loads(js)["keys"]["v"]
        assert "value" not in entry and len(entry["repr"]) <= _show.SHOW_MAX
        assert entry.get("truncated") is (True if name == "str" else None)
        if name != "str":     # all 40 levels fit: each shared part shown once
            assert entry["repr"].count("shown above>") >= 30
        rc, diff = out[f"{name} same"]          # compared pair by pair, shared parts once
        assert rc == 0 and diff.startswith("0 difference(s)"), diff[:500]
        rc, diff = out[f"{name} other"]
        assert rc == 1 and diff.startswith("~ v: ") and len(diff) < 2 * VALUE_TEXT_MAX + 200


# -- _show, directly ----------------------------------------------------------------------

@pytest.mark.parametrize("v", [
    0, -3, 1.5, float("nan"), None, True, "a'b\n", b"\x00x", 2 + 3j,
    [1, [2, (3,)], {"k": {4, 5}}], (0.9, 0.95), (), [], {}, set(), frozenset(),
    frozenset({1}), collections.deque([1, 2], maxlen=4), collections.OrderedDict(a=1),
    collections.defaultdict(list, a=[1]), argparse.Namespace(lr=0.1, betas=(0.9, 0.99)),
    torch.arange(3), torch.Size([2, 3]),
])
def test_text_is_repr_for_plain_values(v):
    want = repr(v)
    if type(v) is collections.OrderedDict:       # Python 3.12 changed this repr
        want = "OrderedDict({'a': 1})"
    assert _show.text(v, 1000) == want


def test_text_numpy():
    np = pytest.importorskip("numpy")
    a = np.arange(4, dtype=np.float32)
    assert _show.text(a) == repr(a)
    inner = [1, 2]
    obj = np.empty(2, dtype=object)
    obj[0] = obj[1] = inner
    assert _show.text(obj) == "array([[1, 2], <the list shown above>], dtype=object)"


def test_text_shared_cyclic_deep_and_long():
    x = [1, 2]
    assert _show.text([x, x]) == "[[1, 2], <the list shown above>]"
    assert _show.text([[], []]) == "[[], []]"            # an empty one costs nothing to repeat
    c: list = [1]
    c.append(c)
    assert _show.text(c) == "[1, [...]]" == repr(c)
    deep: list = []
    for _ in range(1000):
        deep = [deep]
    assert _show.text(deep) == "[" * _show.DEPTH_MAX + "[...]" + "]" * _show.DEPTH_MAX
    s = _show.text(["z" * 10_000], 100)
    assert len(s) == 100 and s.endswith("...")
    assert _show.text_cut(list(range(10_000)), 50)[1] is True
    assert _show.text(10 ** 5000) == f"<int of {(10 ** 5000).bit_length()} bits>"


def test_json_value_counts_every_repeat():
    assert _show.json_value({"lr": 0.1, "names": ["a", "b"], "n": None})
    assert not _show.json_value((1, 2)) and not _show.json_value(float("nan"))
    assert not _show.json_value({1: "a"})
    assert not _show.json_value(_dag(40, "dict"))
    assert not _show.json_value(["x" * 100] * 1000, limit=10_000)
    assert _show.json_value(["x" * 100] * 10, limit=10_000)
    deep: list = []
    for _ in range(60):
        deep = [deep]
    assert not _show.json_value(deep)


def test_same_compares_shared_parts_once():
    assert _show.same(_dag(60, "list"), _dag(60, "list")) == (True, "")
    assert _show.same(_dag(60, "dict"), _dag(60, "dict")) == (True, "")
    a, b = _dag(60, "list"), _dag(60, "list")
    inner = b
    for _ in range(30):
        inner = inner[1]
    inner.append(1)                # one change, deep in the shared structure
    assert _show.same(a, b) == (False, "")
    assert _show.same(collections.OrderedDict(a=1, b=2), collections.OrderedDict(b=2, a=1)) \
        == (False, "")
    assert _show.same({"a": 1, "b": 2}, collections.OrderedDict(b=2, a=1)) == (True, "")
    assert _show.same([1], (1,)) == (False, "")
    assert _show.same(argparse.Namespace(x=[1]), argparse.Namespace(x=[1])) == (True, "")
    c: list = [1]
    c.append(c)
    d: list = [1]
    d.append(d)
    assert _show.same(c, d) == (True, "")
    big = [float(i) for i in range(100)]
    assert _show.same(big, [float(i) for i in range(100)], budget=10) == (True, "pickles")
    assert _show.same(big, [float(i) for i in range(99)] + [0.5], budget=10) == (False, "pickles")
