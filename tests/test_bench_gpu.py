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
    """Unless --cpu asks for the parts a CPU can run."""
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
    assert a.step_rounds == 8 and a.variants == ["as is", "nice 10", "no fsync"]
    assert not a.cpu and not a.no_cold and not a.no_async
    assert bench.parse_args(["--big"]).sizes == [1.0, 8.0]
    assert bench.parse_args(["--gib", "2", "--gib", "0.5", "--big"]).sizes == [2.0, 0.5, 8.0]
    assert bench.parse_args(["--small-count", "0"]).small_count == 0
    assert bench.parse_args(["--step-variants", "no fsync"]).variants == ["no fsync"]
    for bad in (["--gib", "0"], ["--repeat", "0"], ["--small-count", "-1"],
                ["--step-rounds", "-1"], ["--step-variants", "faster"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


META = {"date": "2026-11-24T09:00:00+00:00", "device": "NVIDIA H100 80GB HBM3",
        "driver": "12.8", "torch": "2.13.0", "dcpx_rev": "abc1234",
        "command": "PYTHONPATH=$PWD python benchmarks/bench_gpu.py --big"}


def test_the_report_names_the_device_and_judges_the_goals():
    bench = _module()
    assert bench.slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert bench.slug("???") == "gpu"
    nan = float("nan")
    results = {
        "staging": [{"case": "1 GiB", "bytes": 2**30, "ref_gbps": 20.0, "one_gbps": 25.0,
                     "dcpx_gbps": 19.0, "path": "batched (1 calls, 16 copies; 0 single)"},
                    {"case": "20000 small", "bytes": 10**8, "ref_gbps": 2.0, "one_gbps": 40.0,
                     "dcpx_gbps": 24.0, "small": True, "path": "batched (20 calls)"}],
        "async_save": [{"case": "1 GiB", "lib": "torch (pinned, shared memory)", "call_s": 0.5,
                        "staged_s": 0.6, "upload_s": 2.0},
                       {"case": "1 GiB", "lib": "dcpx", "call_s": 0.001, "staged_s": 0.06,
                        "upload_s": 1.5}],
        "step": [bench.slowdown_summary([[0.100] * 10] * 4, [[0.101] * 10] * 4) |
                 {"case": "1 GiB", "variant": "as is"},
                 {"case": "8 GiB", "alone_s": 0.100, "during_s": 0.103},  # an older run
                 {"case": "1 GiB", "variant": "nice 10", "error": "OSError: x", "rounds": 0,
                  "slowdown": nan, "ci": [nan, nan], "noise": nan, "noise_ci": [nan, nan],
                  "alone_s": nan, "during_s": nan}],
        "load": [{"case": "1 GiB", "cache": "warm", "bytes": 2**30, "torch_s": 1.0, "dcpx_s": 0.5,
                  "read_s": 0.4, "h2d_s": 0.05, "bound_s": 0.4, "path": "pipeline 16 tensors",
                  "exact": True},
                 {"case": "8 GiB", "cache": "cold", "bytes": 8 * 2**30, "torch_s": 8.0,
                  "dcpx_s": 0.0, "read_s": 4.0, "h2d_s": 0.2, "bound_s": 4.0, "exact": False,
                  "torch_error": None},
                 {"case": "20000 small", "cache": "warm", "bytes": 10**8, "torch_s": nan,
                  "dcpx_s": 0.1, "read_s": 0.05, "h2d_s": 0.01, "bound_s": 0.05,
                  "torch_error": "RuntimeError: boom", "exact": True}],
    }
    md = bench.render(results, META)
    assert md.startswith("# bench_gpu: NVIDIA H100 80GB HBM3")
    assert "driver 12.8" in md and "abc1234" in md and "--big" in md
    lines = md.splitlines()
    assert ("| 1 GiB | 1.07 | 20.00 | 25.00 | batched (1 calls, 16 copies; 0 single) | 19.00 | "
            "0.95 | 0.76 | MET (>= 0.9 per tensor) |") in lines
    assert ("| 20000 small | 0.10 | 2.00 | 40.00 | batched (20 calls) | 24.00 | 12.00 | 0.60 | "
            "MET (>= 0.5 one buffer) |") in lines
    assert "| 1 GiB | dcpx | 0.0010 | 0.0600 | 1.500 |" in lines
    step = next(ln for ln in lines if ln.startswith("| 1 GiB | as is |"))
    assert "| 4 | 40 / 40 | 0.10000 | 0.10100 | +1.00 % |" in step and step.endswith("| MET |")
    assert "+0.00 % (+0.00 % .. +0.00 %)" in step  # no noise in this made-up run
    assert any(ln.startswith("| 8 GiB | as is | 1 |") and "+3.00 %" in ln and "NOT MET" in ln
               for ln in lines)
    assert "| 1 GiB | nice 10 | failed: OSError: x | | | | | | | |" in lines
    assert "| 1 GiB | warm | 1.07 | 0.400 (2.68) | 0.050 (21.47) | 0.400 |" in lines
    assert ("| 1 GiB | warm | 1.000 | 0.500 | pipeline 16 tensors | 2.00 | 0.80 | yes | "
            "MET, NOT MET |") in lines
    assert "| 8 GiB | cold | 8.000 | 0.000 | n/a | n/a | n/a | NO | n/a, n/a |" in lines
    assert any(ln.startswith("| 20000 small | warm | failed: RuntimeError: boom | 0.100 |")
               for ln in lines)
    assert bench.fmt(math.nan) == "n/a" and bench.verdict(math.nan, 0.9) == "n/a"
    empty = bench.render({}, META).splitlines()  # the five tables, with no rows
    assert sum(line.startswith("|---") for line in empty) == 5
    line = bench.summary_line(results)
    assert "load 1 GiB warm x2.00 torch x0.80 bound" in line
    assert "stage 20000 small 0.60 of one buffer" in line and "step as is +1.00 %" in line


def test_the_step_slowdown_statistics_tell_a_slowdown_from_noise():
    """Interleaved rounds: a 3 % slowdown under 1 % noise has an interval
    clear of 0 and above the noise; no slowdown has one around 0."""
    import random
    bench = _module()
    rng = random.Random(3)

    def rounds(scale, n=8, k=40):
        return [[0.0128 * scale * (1 + rng.gauss(0, 0.01)) for _ in range(k)] for _ in range(n)]

    slow = bench.slowdown_summary(rounds(1.0), rounds(1.03))
    assert 0.025 < slow["slowdown"] < 0.035 and slow["ci"][0] > 0.015
    assert abs(slow["noise"]) < 0.01 and slow["noise_ci"][1] < slow["ci"][0]
    assert slow["rounds"] == 8 and slow["steps_alone"] == slow["steps_during"] == 320
    same = bench.slowdown_summary(rounds(1.0), rounds(1.0))
    assert same["ci"][0] < 0 < same["ci"][1] and abs(same["slowdown"]) < 0.01
    none = bench.slowdown_summary([], [])
    assert none["rounds"] == 0 and none["slowdown"] != none["slowdown"]  # nan
    assert bench.bootstrap_ci([1.0]) != bench.bootstrap_ci([1.0])  # (nan, nan)


def test_the_file_read_reference_reads_every_byte_and_drops_the_cache(tmp_path):
    bench = _module()
    files = []
    for i, n in enumerate([0, 1, (4 << 20) + 3, 100_000]):
        f = tmp_path / f"f{i}"
        f.write_bytes(os.urandom(n))
        files.append(str(f))
    assert bench.data_files(str(tmp_path)) == files
    for threads in (1, 3):
        assert bench.read_files(files, threads) >= 0
    assert bench.drop_cache(files) == hasattr(os, "posix_fadvise")


@pytest.mark.skipif(os.environ.get("DCPX_SANITIZE", "0") != "0", reason="a script run")
def test_the_cpu_run_measures_loads_saves_and_the_step(tmp_path):
    """--cpu: the parts a CPU can run, at a tiny size (the code paths the GPU
    run shares with it: the load rows and references, async_save's rows,
    the interleaved step rounds and their statistics, the report)."""
    out = tmp_path / "res"
    r = subprocess.run([sys.executable, SCRIPT, "--cpu", "--gib", "0.002", "--small-count", "40",
                        "--repeat", "1", "--step-rounds", "2", "--step-matmuls", "1",
                        "--step-variants", "as is,nice 10", "--dir", str(tmp_path),
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 0, r.stderr
    import json
    res = json.loads((tmp_path / "res.json").read_text())["results"]
    assert [(x["case"], x["cache"]) for x in res["load"]] == [
        ("0.002 GiB", "warm"), ("0.002 GiB", "cold"), ("40 small", "warm"), ("40 small", "cold")]
    assert all(x["exact"] and x["bound_s"] > 0 and x["torch_error"] is None for x in res["load"])
    libs = [x["lib"] for x in res["async_save"] if x["case"] == "40 small"]
    assert libs == ["torch (pinned, shared memory)", "torch (pinned, private memory)", "dcpx"]
    assert [x["variant"] for x in res["step"]] == ["as is", "nice 10"]
    assert all(x["rounds"] == 2 and x["error"] is None for x in res["step"])
    assert "bench_gpu: summary: load 0.002 GiB warm" in r.stderr
    assert (tmp_path / "res.md").read_text().startswith("# bench_gpu: CPU")


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
