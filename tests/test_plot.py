"""benchmarks/plot.py runs on the committed results (so the script cannot rot as result formats change)."""

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
EXPECTED = {"io_throughput.png", "async_save.png", "dist_coordination.png", "cast_load.png"}


def _run(args):
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "plot.py")] + args,
                          capture_output=True, text=True, timeout=300)


def test_plot_committed_results(tmp_path):
    out = tmp_path / "img"
    r = _run(["--results", RESULTS, "--out", str(out)])
    assert r.returncode == 0, r.stderr
    assert set(os.listdir(out)) == EXPECTED
    for name in EXPECTED:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        assert len(data) > 10_000, name
    # the committed images are the ones this script makes from these results
    assert EXPECTED <= set(os.listdir(os.path.join(REPO, "docs", "img")))


def test_plot_missing_inputs_skip(tmp_path):
    res = tmp_path / "res"
    res.mkdir()
    shutil.copy(os.path.join(RESULTS, "cast_local.md"), res)
    r = _run(["--results", str(res), "--out", str(tmp_path / "img")])
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp_path / "img") == ["cast_load.png"]
    assert "io_local.json does not exist" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _run(["--results", str(empty), "--out", str(tmp_path / "img2")])
    assert r.returncode == 1 and "no result files" in r.stderr


def test_parse_md_tables():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import plot
    finally:
        sys.path.pop(0)
    with open(os.path.join(RESULTS, "cast_local.md")) as f:
        tables = plot.parse_md_tables(f.read())
    rows = next(t for t in tables if t and "loader" in t[0])
    assert [r["loader"] for r in rows][0] == "torch DCP"
    assert all(plot._num(r["time (s)"]) > 0 for r in rows)
    text = "| a | b |\n|---|---:|\n| x | 1.5 s |\n| y | 2 |\n\nnot a table\n"
    assert plot.parse_md_tables(text) == [[{"a": "x", "b": "1.5 s"}, {"a": "y", "b": "2"}]]
    with pytest.raises(ValueError, match="no number"):
        plot._num("n/a")


def test_ratio_labels_never_read_zero():
    """io_throughput.png labelled torch's small-tensor load '0.00x' (0.04 GB/s
    against an 18.5 GB/s read limit)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import plot
    finally:
        sys.path.pop(0)
    assert plot.ratio_label(0.04 / 18.48) == "0.0022x"
    assert plot.ratio_label(0.8) == "0.80x" and plot.ratio_label(1.0) == "1.00x"
    assert plot.ratio_label(0.02) == "0.02x"
