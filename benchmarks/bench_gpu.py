#!/usr/bin/env python3
"""GPU benchmark of dcpx's CUDA path (issue 11, "Verify on a GPU").

Run once on an H200 at 8 GiB (benchmarks/results/gpu_h200/); its pure-Python parts (arguments,
result formatting) are tested by tests/test_bench_gpu.py.  Without a CUDA device it prints why
and exits with status 2.

What one run measures, on one device (``--device``), for a state dict of large fp32 tensors
per ``--gib`` size (default 1; ``--big`` adds 8) and one of ``--small-count`` small tensors
(default 20,000):

* **staging**: device-to-host bandwidth of ``dcpx.DefaultStager.stage`` (synchronous staging
  into its page-locked buffer, buffer reused; dcpx's own stream and events) against a plain
  pinned copy of the same bytes (``torch`` ``copy_(non_blocking=True)`` of each tensor into
  one pinned buffer, then a synchronize: the driver's pinned ``cuMemcpyDtoHAsync``).  Goal:
  dcpx >= 0.9x the reference's GB/s.
* **async_save**: time blocked in the call, time to ``staging_completion`` and to the upload's
  completion, for ``dcpx.async_save`` with ``dcpx.DefaultStager`` and for torch DCP's
  ``async_save`` with its ``DefaultStager(StagingOptions(pinned, shared, async,
  non_blocking))``, each stager kept across ``--repeat`` saves, a fresh directory per save.
* **training-step slowdown**: median time of a GPU "training step" (``--step-matmuls``
  bf16 matmuls of 8192x8192 then a synchronize) alone, and while a dcpx upload runs (after
  its staging completed).  Goal: < 2 % slower.
* **load**: ``dcpx.load`` into preallocated CUDA tensors (read into the page-locked load
  buffer, host-to-device copies on dcpx's stream, overlapping the next read) against
  ``torch.distributed.checkpoint.load`` of the same checkpoint; both checked bit exact.

Results go to ``benchmarks/results/gpu_<device>.json`` and ``.md`` (``--out STEM`` for
another stem), with the device, driver, torch and dcpx revision named.  Exit status: 0, 1 if
a load was not bit exact, 2 without CUDA.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

GB = 1e9  # decimal GB/s
STAGING_GOAL, STEP_GOAL = 0.9, 0.02
perf = time.perf_counter
NO_CUDA = ("bench_gpu.py: needs a CUDA device (torch.cuda.is_available() is False); "
           "nothing measured. See benchmarks/README.md, 'bench_gpu.py'.")


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
                   help="8192x8192 bf16 matmuls per training step")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--dir", default=None, help="parent of the scratch directory")
    p.add_argument("--out", default=None,
                   help="path stem of the results (default benchmarks/results/gpu_<device>)")
    a = p.parse_args(argv)
    sizes = list(a.gib or [1.0])
    if a.big and 8.0 not in sizes:
        sizes.append(8.0)
    if any(s <= 0 for s in sizes) or a.repeat < 1 or a.small_count < 0:
        p.error("sizes and --repeat must be positive, --small-count >= 0")
    a.sizes = sizes
    return a


def slug(name: str) -> str:
    """A file-name-safe form of a device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt(x, nd=3) -> str:
    return "n/a" if x is None or x != x else f"{x:.{nd}f}"


def verdict(value, goal, higher_is_better=True) -> str:
    if value is None or value != value:
        return "n/a"
    ok = value >= goal if higher_is_better else value < goal
    return "MET" if ok else "NOT MET"


def render(results: dict, meta: dict) -> str:
    """The Markdown report of a run's results (see main for the shape)."""
    out = [f"# bench_gpu: {meta['device']}", "",
           f"Run {meta['date']} on {meta['device']} (driver {meta['driver']}, torch "
           f"{meta['torch']}, dcpx {meta['dcpx_rev']}): `{meta['command']}`", ""]
    out += ["## Device-to-host staging", "",
            "| state dict | GB | pinned copy_ GB/s | dcpx stage GB/s | dcpx / pinned | goal >= 0.9 |",
            "|---|---|---|---|---|---|"]
    for r in results.get("staging", []):
        ratio = r["dcpx_gbps"] / r["ref_gbps"] if r["ref_gbps"] else float("nan")
        out.append(f"| {r['case']} | {fmt(r['bytes'] / GB, 2)} | {fmt(r['ref_gbps'], 2)} | "
                   f"{fmt(r['dcpx_gbps'], 2)} | {fmt(ratio, 2)} | {verdict(ratio, STAGING_GOAL)} |")
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
            "| state dict | step alone s | step during upload s | slowdown | goal < 2 % |",
            "|---|---|---|---|---|"]
    for r in results.get("step", []):
        slow = r["during_s"] / r["alone_s"] - 1 if r["alone_s"] else float("nan")
        out.append(f"| {r['case']} | {fmt(r['alone_s'], 5)} | {fmt(r['during_s'], 5)} | "
                   f"{fmt(100 * slow, 2)} % | {verdict(slow, STEP_GOAL, False)} |")
    out += ["", "## Load into CUDA tensors (seconds, median)", "",
            "| state dict | torch DCP | dcpx | torch / dcpx | bit exact |", "|---|---|---|---|---|"]
    for r in results.get("load", []):
        ratio = r["torch_s"] / r["dcpx_s"] if r["dcpx_s"] else float("nan")
        out.append(f"| {r['case']} | {fmt(r['torch_s'])} | {fmt(r['dcpx_s'])} | "
                   f"{fmt(ratio, 2)} | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ measuring (needs CUDA)
def _sync():
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


def bench_staging(case, sd, repeat):
    import dcpx
    total = nbytes(sd)
    pinned = torch.empty(total + 64 * len(sd), dtype=torch.uint8, pin_memory=True)
    views, off = [], 0
    for t in sd.values():
        n = t.numel() * t.element_size()
        views.append((t, pinned[off:off + n].view(t.dtype).view(t.shape)))
        off += -(-n // 64) * 64
    ref = []
    for _ in range(repeat + 1):
        _sync()
        t0 = perf()
        for src, dst in views:
            dst.copy_(src, non_blocking=True)
        _sync()
        ref.append(perf() - t0)
    del views, pinned
    got = []
    with dcpx.DefaultStager(dcpx.StagingOptions(True, False, False, True)) as stager:
        for _ in range(repeat + 1):
            _sync()
            t0 = perf()
            stager.stage(sd)
            got.append(perf() - t0)
    return {"case": case, "bytes": total, "ref_s": ref[1:], "dcpx_s": got[1:],
            "ref_gbps": total / median(ref[1:]) / GB, "dcpx_gbps": total / median(got[1:]) / GB}


def _train_step(a, b, k):
    for _ in range(k):
        a = a @ b
    _sync()
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


def bench_async(case, sd, repeat, work, step_matmuls, with_steps):
    import dcpx
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.staging import DefaultStager as TorchStager
    from torch.distributed.checkpoint.staging import StagingOptions as TorchOptions
    rows, steps = [], None
    libs = [("torch", tdcp.async_save, lambda: TorchStager(TorchOptions(True, True, True, True))),
            ("dcpx", dcpx.async_save,
             lambda: dcpx.DefaultStager(dcpx.StagingOptions(True, True, True, True)))]
    for lib, save, make_stager in libs:
        stager = make_stager()
        call, staged, upload, alone, during = [], [], [], [], []
        if with_steps and lib == "dcpx":
            a = torch.randn(8192, 8192, device=sd[next(iter(sd))].device, dtype=torch.bfloat16)
            for _ in range(3):
                _train_step(a, a, step_matmuls)
            for _ in range(20):
                t0 = perf()
                _train_step(a, a, step_matmuls)
                alone.append(perf() - t0)
        error = None
        try:
            for i in range(repeat + 1):
                path = os.path.join(work, f"{lib}-{case}-{i}")
                if stager_spent(stager):  # torch 2.10-2.12: a new one per save
                    stager.close()
                    stager = make_stager()
                _sync()
                t0 = perf()
                resp = save(sd, checkpoint_id=path, async_stager=stager)
                t1 = perf()
                fut_staged = getattr(resp, "staging_completion", None)
                fut_upload = getattr(resp, "upload_completion", resp)
                if fut_staged is not None:
                    fut_staged.result()
                t2 = perf()
                if with_steps and lib == "dcpx" and i > 0:
                    while not fut_upload.done():
                        s0 = perf()
                        _train_step(a, a, step_matmuls)
                        during.append(perf() - s0)
                fut_upload.result()
                t3 = perf()
                if i > 0:
                    call.append(t1 - t0)
                    staged.append(t2 - t0)
                    upload.append(t3 - t0)
                shutil.rmtree(path, ignore_errors=True)
        except Exception as e:  # torch's stager failing is a result; dcpx's is not
            if lib != "torch":
                raise
            error = f"{type(e).__name__}: {e}".strip()[:200]
            print(f"bench_gpu: torch's async_save failed ({case}): {error}", file=sys.stderr)
            call = staged = upload = []
        close = getattr(stager, "close", None)
        if close is not None:
            close()
        rows.append({"case": case, "lib": lib, "call_s": median(call), "staged_s": median(staged),
                     "upload_s": median(upload), "times": {"call": call, "staged": staged,
                                                           "upload": upload}, "error": error})
        if with_steps and lib == "dcpx":
            steps = {"case": case, "alone_s": median(alone), "during_s": median(during),
                     "alone": alone, "during": during}
    return rows, steps


def bench_load(case, sd, repeat, work):
    import dcpx
    import torch.distributed.checkpoint as tdcp
    path = os.path.join(work, f"load-{case}")
    dcpx.save({k: v for k, v in sd.items()}, checkpoint_id=path)
    out = {}
    exact = True
    for lib, load in (("torch", tdcp.load), ("dcpx", dcpx.load)):
        times = []
        for _ in range(repeat + 1):
            dst = {k: torch.zeros_like(v) for k, v in sd.items()}
            _sync()
            t0 = perf()
            load(dst, checkpoint_id=path)
            _sync()
            times.append(perf() - t0)
            exact = exact and all(torch.equal(dst[k], v) for k, v in sd.items())
            del dst
        out[lib] = times[1:]
    shutil.rmtree(path, ignore_errors=True)
    return {"case": case, "torch_s": median(out["torch"]), "dcpx_s": median(out["dcpx"]),
            "times": out, "exact": exact}


def machine(args, argv) -> dict:
    from dcpx import _C
    version, ndev = _C.cuda_driver_version()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        rev = "unknown"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(args.device),
            "devices_visible": ndev,
            "driver": f"{version // 1000}.{(version % 1000) // 10}",
            "torch": torch.__version__, "dcpx_rev": rev or "unknown",
            "python": platform.python_version(), "host": platform.node(),
            "command": "PYTHONPATH=$PWD python " + shlex.join([sys.argv[0], *argv])}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
    # torch's shared-memory staging (StagingOptions(use_shared_memory=True))
    # holds a file descriptor per staged storage: 20,000 small tensors pass
    # the usual soft limit of 1,024 ("Too many open files").
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    torch.cuda.set_device(args.device)
    dev = torch.device("cuda", args.device)
    meta = machine(args, argv)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"gpu_{slug(meta['device'])}")
    cases = [(f"{s:g} GiB", lambda s=s: make_large(s, dev)) for s in args.sizes]
    if args.small_count:
        cases.append((f"{args.small_count} small", lambda: make_small(args.small_count, dev)))
    results: dict = {"staging": [], "async_save": [], "step": [], "load": []}
    work = tempfile.mkdtemp(prefix="dcpx-bench-gpu-", dir=args.dir)
    try:
        for n, (case, make) in enumerate(cases):
            print(f"bench_gpu: {case}", file=sys.stderr)
            sd = make()
            results["staging"].append(bench_staging(case, sd, args.repeat))
            rows, steps = bench_async(case, sd, args.repeat, work, args.step_matmuls,
                                      with_steps=(n == 0))
            results["async_save"] += rows
            if steps is not None:
                results["step"].append(steps)
            results["load"].append(bench_load(case, sd, args.repeat, work))
            del sd
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    md = render(results, meta)
    print(md)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1)
    with open(out + ".md", "w") as fh:
        fh.write(md)
    print(f"bench_gpu: wrote {out}.json and {out}.md", file=sys.stderr)
    return 0 if all(r["exact"] for r in results["load"]) else 1


if __name__ == "__main__":
    sys.exit(main())
