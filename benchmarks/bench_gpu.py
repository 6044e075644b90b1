#!/usr/bin/env python3
"""GPU benchmark of dcpx's CUDA path against torch DCP and the machine's own limits (issues 11, 30).

Its pure-Python parts (arguments, statistics, result formatting) are tested by
tests/test_bench_gpu.py.  Without a CUDA device it prints why and exits with status 2, unless
``--cpu`` asks for the parts a CPU can run (loads against the file-read limit, async_save, the
step slowdown with a CPU step).

What one run measures, on one device (``--device``), for a state dict of 16 large fp32 tensors
per ``--gib`` size (default 1; ``--big`` adds 8) and one of ``--small-count`` small tensors
(default 20,000), every reference measured in the same run:

* **staging** (device to host): ``dcpx.DefaultStager.stage`` (synchronous, its page-locked
  buffer reused; batched copies where the driver has ``cuMemcpyBatchAsync``, and for the small
  case also one copy per tensor) against two pinned copies of the same bytes: one ``copy_`` per
  tensor into one pinned buffer, and one ``copy_`` of a single device buffer of the same size
  (what the many-tensor case is judged against).  Goals: >= 0.9x the per-tensor copy for large
  tensors, >= 0.5x the one-buffer copy at 20,000 tensors.
* **async_save**: time blocked in the call, to ``staging_completion`` and to upload done, for
  dcpx and for torch DCP with two stagers: ``DefaultStager(pinned, shared memory, async,
  non_blocking)`` and the same without shared memory (which works at 20,000 tensors, where the
  shared-memory one runs out of file descriptors).  A library that fails gets a row saying so.
* **training-step slowdown** during a dcpx upload (first case only): rounds of ``--step-rounds``
  alternate steps alone with an async_save whose upload runs while steps go on; per round the
  ratio of the median step during the upload to the median alone; reported: the median of those
  ratios, its 95 % bootstrap interval, and the same statistic of two halves of the alone steps
  (the noise: a slowdown below it cannot be told from nothing).  Variants: as is, with the
  upload's threads at nice 10 (``DCPX_WRITER_NICE``), and without fsync (page-cache writeback
  only).  Goal: < 2 %.
* **load** into preallocated CUDA tensors of a checkpoint dcpx saved: ``dcpx.load`` (the load
  pipeline: reader threads into page-locked slots, copies overlapped; batched copies for many
  small tensors, and for the small case also without them) and ``torch.distributed.checkpoint.load``,
  both checked bit exact, page cache warm (medians) and cold (once each, after
  ``posix_fadvise(DONTNEED)`` on the data files); beside them the references: reading the data
  files (4 MiB preads by as many threads as dcpx's pipeline uses) warm and cold, a pinned
  host-to-device copy of the same bytes, and the pipelined bound max(read, copy) (read and copy
  overlapped).  Every row states dcpx / torch and dcpx / bound (speed ratios; goals 1.2 and 0.9).

Results go to ``benchmarks/results/gpu_<device>.json`` and ``.md`` (``--out STEM`` for another
stem), naming the device, driver, torch and dcpx revision.  Exit status: 0, 1 if a load was not
bit exact, 2 without CUDA (and without ``--cpu``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import torch

GB = 1e9  # decimal GB/s
STAGING_GOAL, STAGING_SMALL_GOAL, STEP_GOAL = 0.9, 0.5, 0.02
LOAD_TORCH_GOAL, LOAD_BOUND_GOAL = 1.2, 0.9
perf = time.perf_counter
NO_CUDA = ("bench_gpu.py: needs a CUDA device (torch.cuda.is_available() is False); "
           "nothing measured (--cpu measures the parts a CPU can). See benchmarks/README.md, "
           "'bench_gpu.py'.")


# ------------------------------------------------------------------ pure Python (tested)
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, action="append",
                   help="size of a large-tensor state dict in GiB (repeatable; default 1)")
    p.add_argument("--big", action="store_true", help="also 8 GiB")
    p.add_argument("--small-count", type=int, default=20000,
                   help="tensors in the small-tensor state dict (0: skip it)")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions per measurement")
    p.add_argument("--step-matmuls", type=int, default=8,
                   help="8192x8192 bf16 matmuls per training step (CPU: 512x512 fp32)")
    p.add_argument("--step-rounds", type=int, default=8,
                   help="alone / during-upload rounds per step-slowdown variant (0: skip)")
    p.add_argument("--step-variants", default="as is,nice 10,no fsync",
                   help="comma-separated: 'as is', 'nice 10', 'no fsync'")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache loads")
    p.add_argument("--no-async", action="store_true", help="skip the async_save rows")
    p.add_argument("--threads", type=int, default=None,
                   help="reader threads of the file-read reference (default: dcpx's)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--cpu", action="store_true",
                   help="no GPU: loads, async_save and the step slowdown on the CPU")
    p.add_argument("--dir", default=None, help="parent of the scratch directory")
    p.add_argument("--out", default=None,
                   help="path stem of the results (default benchmarks/results/gpu_<device>)")
    a = p.parse_args(argv)
    sizes = list(a.gib or [1.0])
    if a.big and 8.0 not in sizes:
        sizes.append(8.0)
    if any(s <= 0 for s in sizes) or a.repeat < 1 or a.small_count < 0 or a.step_rounds < 0:
        p.error("sizes and --repeat must be positive, --small-count and --step-rounds >= 0")
    variants = [v.strip() for v in a.step_variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in STEP_VARIANTS]
    if bad:
        p.error(f"unknown --step-variants {bad}; known: {list(STEP_VARIANTS)}")
    a.sizes, a.variants = sizes, variants
    return a


#: step-slowdown variants: environment for the upload, FileSystemWriter keywords.  "nice 10"
#: goes last in any run (a thread cannot take back a priority it gave up).
STEP_VARIANTS = {"as is": ({}, {}), "no fsync": ({}, {"sync_files": False}),
                 "nice 10": ({"DCPX_WRITER_NICE": "10"}, {})}


def slug(name: str) -> str:
    """A file-name-safe form of a device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt(x, nd=3) -> str:
    return "n/a" if x is None or x != x else f"{x:.{nd}f}"


def speed(ref_s, s):
    """How many times faster s is than ref_s (a speed ratio: ref_s / s)."""
    return ref_s / s if s and s == s and ref_s == ref_s and ref_s is not None else float("nan")


def verdict(value, goal, higher_is_better=True) -> str:
    if value is None or value != value:
        return "n/a"
    ok = value >= goal if higher_is_better else value < goal
    return "MET" if ok else "NOT MET"


def bootstrap_ci(xs, stat=statistics.median, n=2000, seed=0):
    """95 % percentile-bootstrap interval of stat over xs (nan, nan for fewer than 2)."""
    if len(xs) < 2:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    vals = sorted(stat([rng.choice(xs) for _ in xs]) for _ in range(n))
    return vals[int(0.025 * n)], vals[int(0.975 * n) - 1]


def slowdown_summary(alone_rounds, during_rounds) -> dict:
    """The step slowdown from interleaved rounds (lists of step times per round):
    per round median(during) / median(alone) - 1; the median of those, its 95 % bootstrap
    interval, and the noise: the same statistic between the two halves (even and odd steps)
    of each round's alone steps, whose interval a real slowdown must clear."""
    ratios, noise = [], []
    for alone, during in zip(alone_rounds, during_rounds):
        if alone and during:
            ratios.append(median(during) / median(alone) - 1)
        if len(alone) >= 4:
            noise.append(median(alone[1::2]) / median(alone[0::2]) - 1)
    lo, hi = bootstrap_ci(ratios)
    nlo, nhi = bootstrap_ci(noise)
    return {"slowdown": median(ratios), "ci": [lo, hi], "noise": median(noise),
            "noise_ci": [nlo, nhi], "rounds": len(ratios),
            "steps_alone": sum(map(len, alone_rounds)),
            "steps_during": sum(map(len, during_rounds)),
            "alone_s": median([t for r in alone_rounds for t in r]),
            "during_s": median([t for r in during_rounds for t in r])}


def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:+.2f} %"


def render(results: dict, meta: dict) -> str:
    """The Markdown report of a run's results (see main for the shape)."""
    out = [f"# bench_gpu: {meta['device']}", "",
           f"Run {meta['date']} on {meta['device']} (driver {meta['driver']}, torch "
           f"{meta['torch']}, dcpx {meta['dcpx_rev']}): `{meta['command']}`", ""]
    out += ["## Device-to-host staging (GB/s, medians)", "",
            "| state dict | GB | pinned copy_ per tensor | pinned copy_ one buffer | dcpx path | "
            "dcpx | dcpx / per tensor | dcpx / one buffer | goal |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results.get("staging", []):
        per = r["dcpx_gbps"] / r["ref_gbps"] if r.get("ref_gbps") else float("nan")
        one = r["dcpx_gbps"] / r["one_gbps"] if r.get("one_gbps") else float("nan")
        small = r.get("small", False)
        goal = (f"{verdict(one, STAGING_SMALL_GOAL)} (>= {STAGING_SMALL_GOAL} one buffer)" if small
                else f"{verdict(per, STAGING_GOAL)} (>= {STAGING_GOAL} per tensor)")
        out.append(f"| {r['case']} | {fmt(r['bytes'] / GB, 2)} | {fmt(r['ref_gbps'], 2)} | "
                   f"{fmt(r.get('one_gbps'), 2)} | {r.get('path', 'dcpx')} | "
                   f"{fmt(r['dcpx_gbps'], 2)} | {fmt(per, 2)} | {fmt(one, 2)} | {goal} |")
    out += ["", "## async_save (medians over saves 2..N, seconds)", "",
            "| state dict | library | blocked in call | staging_completion | upload done |",
            "|---|---|---|---|---|"]
    for r in results.get("async_save", []):
        if r.get("error"):
            out.append(f"| {r['case']} | {r['lib']} | failed: {r['error']} | | |")
            continue
        out.append(f"| {r['case']} | {r['lib']} | {fmt(r['call_s'], 4)} | "
                   f"{fmt(r['staged_s'], 4)} | {fmt(r['upload_s'], 3)} |")
    out += ["", "## Training step during the upload", "",
            "| state dict | upload | rounds | steps alone / during | step alone s | step during s "
            "| slowdown (median of rounds) | 95 % interval | noise (alone vs alone) | goal < 2 % |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results.get("step", []):
        if "slowdown" not in r:  # a run before the interleaved measurement (issue 11)
            r = {**r, "slowdown": r["during_s"] / r["alone_s"] - 1 if r["alone_s"] else
                 float("nan"), "ci": [float("nan")] * 2, "noise": float("nan"),
                 "noise_ci": [float("nan")] * 2, "rounds": 1, "variant": "as is"}
        if r.get("error"):
            out.append(f"| {r['case']} | {r.get('variant', '')} | failed: {r['error']} "
                       f"| | | | | | | |")
            continue
        ci, nci = r["ci"], r["noise_ci"]
        out.append(f"| {r['case']} | {r.get('variant', 'as is')} | {r['rounds']} | "
                   f"{r.get('steps_alone', 'n/a')} / {r.get('steps_during', 'n/a')} | "
                   f"{fmt(r['alone_s'], 5)} | {fmt(r['during_s'], 5)} | {_pct(r['slowdown'])} | "
                   f"{_pct(ci[0])} .. {_pct(ci[1])} | {_pct(r['noise'])} ({_pct(nci[0])} .. "
                   f"{_pct(nci[1])}) | {verdict(r['slowdown'], STEP_GOAL, False)} |")
    out += ["", "## Load references (the machine's limits, same run)", "",
            "| state dict | cache | GB | file read s (GB/s) | pinned host-to-device s (GB/s) | "
            "pipelined bound s = max |", "|---|---|---|---|---|---|"]
    for r in results.get("load", []):
        if "bound_s" not in r:
            continue
        gb = r["bytes"] / GB

        def rate(s):
            return f"{fmt(s)} ({fmt(gb / s, 2) if s and s == s else 'n/a'})"
        out.append(f"| {r['case']} | {r.get('cache', 'warm')} | {fmt(gb, 2)} | "
                   f"{rate(r['read_s'])} | {rate(r['h2d_s'])} | {fmt(r['bound_s'])} |")
    out += ["", "## Load into the device's tensors (seconds; warm: medians)", "",
            "| state dict | cache | torch DCP | dcpx | dcpx path | dcpx / torch | dcpx / bound "
            "| bit exact | goals (>= 1.2 torch, >= 0.9 bound) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results.get("load", []):
        vt = speed(r["torch_s"], r["dcpx_s"])
        vb = speed(r.get("bound_s", float("nan")), r["dcpx_s"])
        torch_cell = f"failed: {r['torch_error']}" if r.get("torch_error") else fmt(r["torch_s"])
        goals = f"{verdict(vt, LOAD_TORCH_GOAL)}, {verdict(vb, LOAD_BOUND_GOAL)}"
        out.append(f"| {r['case']} | {r.get('cache', 'warm')} | {torch_cell} | "
                   f"{fmt(r['dcpx_s'])} | {r.get('path', 'n/a')} | {fmt(vt, 2)} | {fmt(vb, 2)} | "
                   f"{'yes' if r['exact'] else 'NO'} | {goals} |")
    return "\n".join(out) + "\n"


def summary_line(results: dict) -> str:
    """One line of the figures the goals are about (the GPU check's summary shows it)."""
    parts = []
    for r in results.get("load", []):
        parts.append(f"load {r['case']} {r.get('cache', 'warm')} "
                     f"x{fmt(speed(r['torch_s'], r['dcpx_s']), 2)} torch "
                     f"x{fmt(speed(r.get('bound_s', float('nan')), r['dcpx_s']), 2)} bound")
    for r in results.get("staging", []):
        if r.get("small") and r.get("one_gbps"):
            parts.append(f"stage {r['case']} {fmt(r['dcpx_gbps'] / r['one_gbps'], 2)} of one "
                         f"buffer ({r.get('path', '')[:9]})")
    for r in results.get("step", []):
        parts.append(f"step {r.get('variant', 'as is')} {_pct(r.get('slowdown'))} "
                     f"(noise {_pct(r.get('noise'))})")
    return "; ".join(parts) or "nothing measured"


# ------------------------------------------------------------------ measuring
class Env:
    """Where the run measures: the device, synchronize, a step."""

    def __init__(self, cpu: bool, device: int) -> None:
        self.cpu = cpu
        self.dev = torch.device("cpu") if cpu else torch.device("cuda", device)

    def sync(self) -> None:
        if not self.cpu:
            torch.cuda.synchronize()


def make_large(gib: float, dev, n: int = 16) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    rows = max(1, int(gib * 2**30 / n / 4 / 1024))
    return {f"layers.{i}.weight": torch.randn(rows, 1024, generator=g, device=dev)
            for i in range(n)}


def make_small(count: int, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(1)
    return {f"blocks.{i // 4}.p{i % 4}": torch.randn(64 + (i * 7919) % 4033, generator=g,
                                                     device=dev) for i in range(count)}


def nbytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def _copy_stats_delta(before: dict) -> dict:
    from dcpx import _C
    after = _C.cuda_copy_stats()
    return {k: after[k] - before[k] for k in after if isinstance(after[k], int)
            and not isinstance(after[k], bool)}


def _staging_path(delta: dict, direction: str) -> str:
    calls, copies = delta.get(f"batch_{direction}_calls", 0), delta.get(f"batched_{direction}", 0)
    single = delta.get(f"{direction}_calls", 0)
    if calls:
        return f"batched ({calls} calls, {copies} copies; {single} single)"
    return f"one call per copy ({single} calls)"


def bench_staging(case, sd, repeat, env, small=False):
    import dcpx
    from dcpx import _C
    total = nbytes(sd)
    pinned = torch.empty(total + 64 * len(sd), dtype=torch.uint8, pin_memory=True)
    views, off = [], 0
    for t in sd.values():
        n = t.numel() * t.element_size()
        views.append((t, pinned[off:off + n].view(t.dtype).view(t.shape)))
        off += -(-n // 64) * 64
    ref = []
    for _ in range(repeat + 1):
        env.sync()
        t0 = perf()
        for src, dst in views:
            dst.copy_(src, non_blocking=True)
        env.sync()
        ref.append(perf() - t0)
    del views
    # the same bytes as one device buffer, one copy
    flat = torch.empty(total, dtype=torch.uint8, device=env.dev)
    one = []
    for _ in range(repeat + 1):
        env.sync()
        t0 = perf()
        pinned[:total].copy_(flat, non_blocking=True)
        env.sync()
        one.append(perf() - t0)
    del flat, pinned
    rows = []
    batch_api = _C.cuda_batch_copies()
    paths = [True] if batch_api is None else ([True, False] if small else [True])
    for batched in paths:
        if batch_api is not None:
            _C.cuda_batch_copies(batched)
        got, delta = [], {}
        try:
            with dcpx.DefaultStager(dcpx.StagingOptions(True, False, False, True)) as stager:
                for i in range(repeat + 1):
                    env.sync()
                    before = _C.cuda_copy_stats()
                    t0 = perf()
                    stager.stage(sd)
                    got.append(perf() - t0)
                    delta = _copy_stats_delta(before)
        finally:
            if batch_api is not None:
                _C.cuda_batch_copies(True)
        rows.append({"case": case, "bytes": total, "small": small, "ref_s": ref[1:],
                     "one_s": one[1:], "dcpx_s": got[1:], "path": _staging_path(delta, "dtoh"),
                     "ref_gbps": total / median(ref[1:]) / GB,
                     "one_gbps": total / median(one[1:]) / GB,
                     "dcpx_gbps": total / median(got[1:]) / GB, "copy_calls": delta})
    return rows


def _train_step(a, b, k, env):
    for _ in range(k):
        a = a @ b
    env.sync()
    return a


def stager_spent(stager) -> bool:
    """torch 2.10-2.12's DefaultStager empties its copy table (and its
    storage cache) at the end of every stage (staging.py ``_stage`` calls
    ``_state_dict_stager.close()``): staging again with it fails with
    ``KeyError: <class 'type'>``.  Such a stager is replaced before each
    save, as a training loop on those versions would have to."""
    inner = getattr(stager, "_state_dict_stager", None)
    table = getattr(inner, "_deepcopy_dispatch", None)
    return isinstance(table, dict) and not table


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip().replace("\n", " ").replace("|", "/")[:200]


def _async_libs(env):
    import dcpx
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.staging import DefaultStager as TorchStager
    from torch.distributed.checkpoint.staging import StagingOptions as TorchOptions
    pin = not env.cpu
    return [
        ("torch (pinned, shared memory)", tdcp.async_save,
         lambda: TorchStager(TorchOptions(pin, True, True, pin))),
        ("torch (pinned, private memory)", tdcp.async_save,
         lambda: TorchStager(TorchOptions(pin, False, True, pin))),
        ("dcpx", dcpx.async_save,
         lambda: dcpx.DefaultStager(dcpx.StagingOptions(pin, True, True, pin))),
    ]


def bench_async(case, sd, repeat, work, env):
    """One row per library and stager; a library that fails gets a row that says so."""
    rows = []
    for lib, save, make_stager in _async_libs(env):
        call, staged, upload, error, stager = [], [], [], None, None
        try:
            stager = make_stager()
            for i in range(repeat + 1):
                path = os.path.join(work, f"{slug(lib)}-{slug(case)}-{i}")
                if stager_spent(stager):  # torch 2.10-2.12: a new one per save
                    stager.close()
                    stager = make_stager()
                env.sync()
                t0 = perf()
                resp = save(sd, checkpoint_id=path, async_stager=stager)
                t1 = perf()
                fut_staged = getattr(resp, "staging_completion", None)
                fut_upload = getattr(resp, "upload_completion", resp)
                if fut_staged is not None:
                    fut_staged.result()
                t2 = perf()
                fut_upload.result()
                t3 = perf()
                if i > 0:
                    call.append(t1 - t0)
                    staged.append(t2 - t0)
                    upload.append(t3 - t0)
                shutil.rmtree(path, ignore_errors=True)
        except Exception as e:  # a result for torch; for dcpx too, but reported loudly
            error = _short(e)
            print(f"bench_gpu: {lib}'s async_save failed ({case}): {error}", file=sys.stderr)
            call = staged = upload = []
        finally:
            try:
                if stager is not None and getattr(stager, "close", None):
                    stager.close()
            except Exception as e:  # noqa: BLE001 - a failing close is part of the row
                error = error or _short(e)
        rows.append({"case": case, "lib": lib, "call_s": median(call), "staged_s": median(staged),
                     "upload_s": median(upload), "times": {"call": call, "staged": staged,
                                                           "upload": upload}, "error": error})
    return rows


def _step_operands(env, k):
    if env.cpu:
        a = torch.randn(512, 512)
        return a, a, k
    a = torch.randn(8192, 8192, device=env.dev, dtype=torch.bfloat16)
    return a, a, k


def bench_steps(case, sd, work, env, rounds, matmuls, variants, alone_steps=30):
    """Interleaved rounds per variant: alone_steps steps alone, then an async_save whose upload
    runs while steps go on (timed until it is done).  See slowdown_summary."""
    import dcpx
    a, b, k = _step_operands(env, matmuls)
    for _ in range(5):
        _train_step(a, b, k, env)
    order = sorted(variants, key=lambda v: v == "nice 10")  # nice last: it cannot be undone
    out = []
    for variant in order:
        env_vars, writer_kw = STEP_VARIANTS[variant]
        alone_rounds, during_rounds, error = [], [], None
        saved = {v: os.environ.get(v) for v in env_vars}
        os.environ.update(env_vars)
        try:
            with dcpx.DefaultStager(dcpx.StagingOptions(not env.cpu, False, True,
                                                        not env.cpu)) as stager:
                for r in range(rounds + 1):
                    alone = []
                    for _ in range(alone_steps):
                        t0 = perf()
                        _train_step(a, b, k, env)
                        alone.append(perf() - t0)
                    path = os.path.join(work, f"step-{slug(variant)}-{r}")
                    writer = dcpx.FileSystemWriter(path, **writer_kw)
                    resp = dcpx.async_save(sd, storage_writer=writer, async_stager=stager)
                    resp.staging_completion.result()
                    during = []
                    while True:
                        t0 = perf()
                        _train_step(a, b, k, env)
                        during.append(perf() - t0)
                        if resp.upload_completion.done():
                            break
                    resp.upload_completion.result()
                    shutil.rmtree(path, ignore_errors=True)
                    if r > 0:  # round 0 warms the stager and the files
                        alone_rounds.append(alone)
                        during_rounds.append(during)
        except Exception as e:  # noqa: BLE001 - reported in the row
            error = _short(e)
            print(f"bench_gpu: step slowdown ({variant}) failed: {error}", file=sys.stderr)
        finally:
            for v, old in saved.items():
                if old is None:
                    os.environ.pop(v, None)
                else:
                    os.environ[v] = old
        row = {"case": case, "variant": variant, "error": error,
               "alone": alone_rounds, "during": during_rounds}
        row.update(slowdown_summary(alone_rounds, during_rounds))
        out.append(row)
    return out


# -- loads and their references

def data_files(path: str) -> list:
    return sorted(os.path.join(path, f) for f in os.listdir(path)
                  if not f.startswith(".") and os.path.isfile(os.path.join(path, f)))


def drop_cache(paths) -> bool:
    """Drop the files' pages from the page cache (posix_fadvise DONTNEED: clean pages go, and
    dcpx.save fsyncs what it writes).  False where the call is not available."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def read_files(paths, threads: int, chunk: int = 4 << 20) -> float:
    """Seconds to read every byte of the files: 4 MiB preads into a buffer of each thread's
    own (reused), taken from one queue by `threads` threads (the GIL is released in preadv)."""
    work = []
    for p in paths:
        size = os.path.getsize(p)
        work += [(p, off, min(chunk, size - off)) for off in range(0, size, chunk)]
    it, lock = iter(work), threading.Lock()
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    errors = []

    def worker():
        buf = bytearray(chunk)
        mv = memoryview(buf)
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            p, off, n = job
            try:
                got = os.preadv(fds[p], [mv[:n]], off)
                if got != n:
                    raise OSError(f"short read of {p} at {off}")
            except OSError as e:
                errors.append(e)
                return

    try:
        t0 = perf()
        ts = [threading.Thread(target=worker) for _ in range(max(1, threads))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        secs = perf() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
    if errors:
        raise errors[0]
    return secs


def h2d_pinned(total: int, env, chunk: int = 1 << 30) -> float:
    """Seconds for a pinned host-to-device copy of `total` bytes (copies of at most `chunk`
    from one pinned buffer into one device buffer, then a synchronize)."""
    if env.cpu:
        return 0.0
    n = min(total, chunk)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=env.dev)
    dev.copy_(host, non_blocking=True)  # warm
    env.sync()
    t0 = perf()
    left = total
    while left > 0:
        m = min(n, left)
        dev[:m].copy_(host[:m], non_blocking=True)
        left -= m
    env.sync()
    secs = perf() - t0
    del host, dev
    return secs


def _pipeline_threads() -> int:
    return min(8, os.cpu_count() or 1)


def _load_path(reader) -> str:
    st = getattr(reader, "cuda_load_stats", {}) or {}
    ps = st.get("pipeline_stats", {})
    if not st:
        return "host (no CUDA tensors)"
    parts = [f"pipeline {st.get('pipeline', 0)} tensors"]
    if ps.get("batch_calls"):
        parts.append(f"{ps['batch_calls']} batched calls")
    if ps.get("htod_calls"):
        parts.append(f"{ps['htod_calls']} single copies")
    if st.get("torch_copy"):
        parts.append(f"{st['torch_copy']} via torch copy_")
    return ", ".join(parts)


def _timed_load(load, sd, path, env, reader=None):
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    env.sync()
    t0 = perf()
    if reader is None:
        load(dst, checkpoint_id=path)
    else:
        load(dst, storage_reader=reader)
    env.sync()
    secs = perf() - t0
    exact = all(torch.equal(dst[k], v) for k, v in sd.items())
    del dst
    return secs, exact


def bench_load(case, sd, repeat, work, env, threads, cold, small=False):
    """Rows (warm, and cold where caches can be dropped) of torch's and dcpx's loads of one
    dcpx checkpoint, with the read / copy references and their pipelined bound."""
    import dcpx
    import torch.distributed.checkpoint as tdcp
    from dcpx import _C
    path = os.path.join(work, f"load-{slug(case)}")
    dcpx.save(dict(sd), checkpoint_id=path)
    files = data_files(path)
    total = nbytes(sd)
    threads = threads or _pipeline_threads()
    read_w = median([read_files(files, threads) for _ in range(repeat)])
    h2d = median([h2d_pinned(total, env) for _ in range(repeat)])
    rows = []

    def loads(lib, n, batched=None):
        times, exact, err, readers = [], True, None, []
        switch = not env.cpu and batched is not None and _C.cuda_batch_copies() is not None
        try:
            if switch:
                _C.cuda_batch_copies(batched)
            for _ in range(n):
                if lib == "torch":
                    s, ok = _timed_load(tdcp.load, sd, path, env)
                else:
                    readers.append(dcpx.FileSystemReader(path))
                    s, ok = _timed_load(dcpx.load, sd, path, env, readers[-1])
                times.append(s)
                exact = exact and ok
        except Exception as e:  # torch's failure is a result; dcpx's is reported too
            err = _short(e)
            print(f"bench_gpu: {lib}'s load failed ({case}): {err}", file=sys.stderr)
        finally:
            if switch:
                _C.cuda_batch_copies(True)
        return times, exact, err, (_load_path(readers[-1]) if readers else "n/a")

    t_times, t_exact, t_err, _ = loads("torch", repeat + 1)
    variants = [None] if env.cpu or _C.cuda_batch_copies() is None else (
        [True, False] if small else [True])
    for batched in variants:
        d_times, d_exact, d_err, dpath = loads("dcpx", repeat + 1, batched)
        rows.append({"case": case, "cache": "warm", "bytes": total,
                     "torch_s": median(t_times[1:]), "dcpx_s": median(d_times[1:]),
                     "read_s": read_w, "h2d_s": h2d, "bound_s": max(read_w, h2d),
                     "path": dpath if d_err is None else f"failed: {d_err}",
                     "torch_error": t_err, "exact": t_exact and d_exact,
                     "times": {"torch": t_times, "dcpx": d_times}, "threads": threads})
    if cold and drop_cache(files):
        read_c = read_files(files, threads)
        drop_cache(files)
        t_times, t_exact, t_err, _ = loads("torch", 1)
        drop_cache(files)
        d_times, d_exact, d_err, dpath = loads("dcpx", 1)
        rows.append({"case": case, "cache": "cold", "bytes": total,
                     "torch_s": median(t_times), "dcpx_s": median(d_times),
                     "read_s": read_c, "h2d_s": h2d, "bound_s": max(read_c, h2d),
                     "path": dpath if d_err is None else f"failed: {d_err}",
                     "torch_error": t_err, "exact": t_exact and d_exact,
                     "times": {"torch": t_times, "dcpx": d_times}, "threads": threads})
    shutil.rmtree(path, ignore_errors=True)
    return rows


def machine(args, argv, env) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        rev = "unknown"
    rev = os.environ.get("DCPX_REV") or rev
    if env.cpu:
        device, driver, ndev = f"CPU ({platform.processor() or platform.machine()}, " \
                               f"{os.cpu_count()} cores)", "none", 0
    else:
        from dcpx import _C
        version, ndev = _C.cuda_driver_version()
        device = torch.cuda.get_device_name(args.device)
        driver = f"{version // 1000}.{(version % 1000) // 10}"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device, "devices_visible": ndev, "driver": driver,
            "torch": torch.__version__, "dcpx_rev": rev or "unknown",
            "python": platform.python_version(), "host": platform.node(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "command": "PYTHONPATH=$PWD python " + shlex.join([sys.argv[0], *argv])}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
    # torch's shared-memory staging holds a file descriptor per staged storage: 20,000 small
    # tensors pass the usual soft limit of 1,024 ("Too many open files").
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    env = Env(args.cpu, args.device)
    if not env.cpu:
        torch.cuda.set_device(args.device)
    meta = machine(args, argv, env)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"gpu_{slug(meta['device'])}")
    cases = [(f"{s:g} GiB", False, lambda s=s: make_large(s, env.dev)) for s in args.sizes]
    if args.small_count:
        cases.append((f"{args.small_count} small", True,
                      lambda: make_small(args.small_count, env.dev)))
    results: dict = {"staging": [], "async_save": [], "step": [], "load": []}
    work = tempfile.mkdtemp(prefix="dcpx-bench-gpu-", dir=args.dir)
    try:
        for n, (case, small, make) in enumerate(cases):
            print(f"bench_gpu: {case}", file=sys.stderr)
            sd = make()
            if not env.cpu:
                results["staging"] += bench_staging(case, sd, args.repeat, env, small)
            if not args.no_async:
                results["async_save"] += bench_async(case, sd, args.repeat, work, env)
            if n == 0 and args.step_rounds:
                results["step"] += bench_steps(case, sd, work, env, args.step_rounds,
                                               args.step_matmuls, args.variants)
            results["load"] += bench_load(case, sd, args.repeat, work, env, args.threads,
                                          not args.no_cold, small)
            del sd
            if not env.cpu:
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    md = render(results, meta)
    print(md)
    print("bench_gpu: summary: " + summary_line(results), file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1)
    with open(out + ".md", "w") as fh:
        fh.write(md)
    print(f"bench_gpu: wrote {out}.json and {out}.md", file=sys.stderr)
    return 0 if all(r["exact"] for r in results["load"]) else 1


if __name__ == "__main__":
    sys.exit(main())
