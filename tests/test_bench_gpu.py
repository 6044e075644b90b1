"""benchmarks/bench_gpu.py without a GPU: it exits cleanly with status 2 and
says why, and its pure-Python parts (arguments, result formatting) work.
Its measuring parts need CUDA (run on a GPU by scripts/gpu_check.sh)."""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_gpu.py")


def _module():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run")
def test_without_cuda_it_exits_2_with_a_clear_message(tmp_path):
    out = tmp_path / "res"
    r = subprocess.run([sys.executable, SCRIPT, "--out", str(out)], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 2, r.stderr
    assert "needs a CUDA device" in r.stderr and "nothing measured" in r.stderr
    assert not list(tmp_path.iterdir())  # no results written


def test_arguments():
    bench = _module()
    a = bench.parse_args([])
    assert a.sizes == [1.0] and a.small_count == 20000 and a.repeat == 3 and a.device == 0
    assert bench.parse_args(["--big"]).sizes == [1.0, 8.0]
    assert bench.parse_args(["--gib", "2", "--gib", "0.5", "--big"]).sizes == [2.0, 0.5, 8.0]
    assert bench.parse_args(["--small-count", "0"]).small_count == 0
    for bad in (["--gib", "0"], ["--repeat", "0"], ["--small-count", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_the_report_names_the_device_and_judges_the_goals():
    bench = _module()
    assert bench.slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert bench.slug("???") == "gpu"
    meta = {"date": "2026-11-24T09:00:00+00:00", "device": "NVIDIA H100 80GB HBM3",
            "driver": "12.8", "torch": "2.13.0", "dcpx_rev": "abc1234",
            "command": "PYTHONPATH=$PWD python benchmarks/bench_gpu.py --big"}
    results = {
        "staging": [{"case": "1 GiB", "bytes": 2**30, "ref_gbps": 20.0, "dcpx_gbps": 19.0},
                    {"case": "20000 small", "bytes": 10**8, "ref_gbps": 10.0, "dcpx_gbps": 8.0}],
        "async_save": [{"case": "1 GiB", "lib": "torch", "call_s": 0.5, "staged_s": 0.6,
                        "upload_s": 2.0},
                       {"case": "1 GiB", "lib": "dcpx", "call_s": 0.001, "staged_s": 0.06,
                        "upload_s": 1.5}],
        "step": [{"case": "1 GiB", "alone_s": 0.100, "during_s": 0.101},
                 {"case": "8 GiB", "alone_s": 0.100, "during_s": 0.103}],
        "load": [{"case": "1 GiB", "torch_s": 1.0, "dcpx_s": 0.5, "exact": True},
                 {"case": "8 GiB", "torch_s": 8.0, "dcpx_s": 0.0, "exact": False}],
    }
    md = bench.render(results, meta)
    assert md.startswith("# bench_gpu: NVIDIA H100 80GB HBM3")
    assert "driver 12.8" in md and "abc1234" in md and "--big" in md
    lines = md.splitlines()
    assert "| 1 GiB | 1.07 | 20.00 | 19.00 | 0.95 | MET |" in lines
    assert "| 20000 small | 0.10 | 10.00 | 8.00 | 0.80 | NOT MET |" in lines
    assert "| 1 GiB | dcpx | 0.0010 | 0.0600 | 1.500 |" in lines
    assert "| 1 GiB | 0.10000 | 0.10100 | 1.00 % | MET |" in lines
    assert "| 8 GiB | 0.10000 | 0.10300 | 3.00 % | NOT MET |" in lines
    assert "| 1 GiB | 1.000 | 0.500 | 2.00 | yes |" in lines
    assert "| 8 GiB | 8.000 | 0.000 | n/a | NO |" in lines
    assert bench.fmt(math.nan) == "n/a" and bench.verdict(math.nan, 0.9) == "n/a"
    empty = bench.render({}, meta).splitlines()  # the four tables, with no rows
    assert sum(line.startswith("|---") for line in empty) == 4


def test_a_spent_torch_stager_is_recognised():
    """torch 2.10-2.12 clear their DefaultStager's copy table after each
    stage; the benchmark replaces such a stager before the next save."""
    import types
    bench = _module()
    spent = types.SimpleNamespace(_state_dict_stager=types.SimpleNamespace(_deepcopy_dispatch={}))
    live = types.SimpleNamespace(_state_dict_stager=types.SimpleNamespace(
        _deepcopy_dispatch={dict: None}))
    assert bench.stager_spent(spent) and not bench.stager_spent(live)
    assert not bench.stager_spent(object())  # dcpx's stager has no such table


def test_a_failed_torch_save_is_reported_not_fatal():
    """torch 2.11's shared-memory stager fails on 20,000 tensors on the GPU
    machine ("Too many open files"): the report says so in its row."""
    bench = _module()
    meta = {"date": "d", "device": "GPU", "driver": "13.0", "torch": "2.11.0",
            "dcpx_rev": "r", "command": "c"}
    nan = float("nan")
    results = {"async_save": [
        {"case": "20000 small", "lib": "torch", "call_s": nan, "staged_s": nan,
         "upload_s": nan, "error": "RuntimeError: Too many open files"},
        {"case": "20000 small", "lib": "dcpx", "call_s": 0.001, "staged_s": 0.05,
         "upload_s": 0.4, "error": None}]}
    md = bench.render(results, meta)
    assert "| 20000 small | torch | failed: RuntimeError: Too many open files | | |" in md
    assert "| 20000 small | dcpx | 0.0010 | 0.0500 | 0.400 |" in md
