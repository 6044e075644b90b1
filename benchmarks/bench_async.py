#!/usr/bin/env python3
"""Async-save benchmark: dcpx.async_save vs torch.distributed.checkpoint.async_save.

For (a) ~2 GiB of large fp32 tensors and (b) 20,000 small ones, in one run: warm-memcpy and
write+fsync baselines of the same bytes; per save (one stager kept across saves, each upload
waited for) the time until async_save returns, staging completes and the upload completes;
a single-threaded compute loop's step time alone and during saves.  Checks the targets
(staging <= 1.25x memcpy from the 2nd save on; upload >= 0.9x the write limit), verifies the
last checkpoint of every configuration with torch.distributed.checkpoint.load (exit 1 if one
differs), prints a table and writes JSON + Markdown.
"""
import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import DefaultStager as TorchStager
from torch.distributed.checkpoint.staging import StagingOptions as TorchOptions

import dcpx

warnings.filterwarnings("ignore", message=".*torch.distributed.*")
GB = 1e9                   # throughputs in decimal GB/s
CHUNK = 64 << 20           # os.write chunk of the write limit
STAGING_TARGET, UPLOAD_TARGET = 1.25, 0.9
# issue 12, for the many-small-tensors case (b): staging <= 2x one warm memcpy, upload >= 0.7x
ISSUE12_STAGING, ISSUE12_UPLOAD = 2.0, 0.7
MEMCPY, WRITE = "memcpy (libc, one flat buffer)", "write + fsync (64 MiB os.write)"
perf = time.perf_counter


# ------------------------------------------------------------------ state dicts, helpers
def make_large(gib, n=16):
    g = torch.Generator().manual_seed(0)
    rows = max(1, int(gib * 2**30 / n / 4 / 1024))
    return {f"layers.{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(n)}


def make_small(count):
    """Mixed 1-D / 2-D fp32 tensors of 64..4096 elements (biases, norms, small projections)."""
    g = torch.Generator().manual_seed(1)
    kinds = ("norm.weight", "norm.bias", "proj.bias", "gate.weight")
    sd = {}
    for i, (a, b, c) in enumerate(torch.randint(0, 1 << 30, (count, 3), generator=g).tolist()):
        shape = (64 + a % 4033,) if a % 5 < 3 else (2 + b % 63, 32 + c % 33)
        sd[f"blocks.{i // 4}.{kinds[i % 4]}"] = torch.randn(shape, generator=g)
    return sd


def nbytes(sd):
    return sum(t.numel() * t.element_size() for t in sd.values())


def stamp(sd, value):
    """Make each save's content distinct: element 0 of every tensor = value."""
    for t in sd.values():
        t.view(-1)[0] = value


def disturb(sd):
    """Mutate the source once staging is complete: the checkpoint must not see it."""
    for k in (next(iter(sd)), next(reversed(sd))):
        sd[k].view(-1)[0] = -7.0


def med(xs):
    return statistics.median(xs) if xs else None


def timed(fn):
    t0 = perf()
    fn()
    return perf() - t0


def rss_gib():
    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30, 2)


def cpu_snapshot():
    with open("/proc/stat") as f:
        v = [int(x) / os.sysconf("SC_CLK_TCK") for x in f.readline().split()[1:]]
    t = os.times()
    return v[0] + v[1] + v[2] + v[5] + v[6], t.user + t.system, time.monotonic()


def others_cores(a, b):
    """CPU cores used on average by everything but this process (other jobs, kernel threads)."""
    return round((b[0] - a[0] - (b[1] - a[1])) / (b[2] - a[2]), 2)


def write_fsync(mv, path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(mv), CHUNK):
            view = mv[off:off + CHUNK]
            while len(view):
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def baselines(sd, workdir, repeat):
    """Seconds of each repetition: warm memcpys of the same bytes, and write+fsync of them."""
    flat = torch.cat([t.reshape(-1) for t in sd.values()])  # all fp32
    dst = torch.empty_like(flat)
    dst.copy_(flat)  # warm: allocated, faulted, written once
    n = flat.numel() * flat.element_size()
    out = {MEMCPY: [timed(lambda: ctypes.memmove(dst.data_ptr(), flat.data_ptr(), n))
                    for _ in range(repeat)],
           "torch copy_ (one flat buffer)": [timed(lambda: dst.copy_(flat)) for _ in range(repeat)]}
    del dst
    pairs = [(t, torch.empty_like(t)) for t in sd.values()]

    def per_tensor():
        for s, d in pairs:
            d.copy_(s)
    per_tensor()
    out["torch copy_ (tensor by tensor)"] = [timed(per_tensor) for _ in range(repeat)]
    del pairs
    mv = memoryview(flat.view(torch.uint8).numpy()).cast("B")
    out[WRITE] = []
    for i in range(repeat):
        path = os.path.join(workdir, f"write-limit-{i}")
        os.sync()
        out[WRITE].append(timed(lambda: write_fsync(mv, path)))
        os.unlink(path)
    return out


# ------------------------------------------------------------------ library configurations
def saver(lib, stager_kw="async_stager"):
    """async_save of `lib` with the configuration's stager object (a writer: save() resets it)."""
    return lambda sd, path, stager: lib.async_save(sd, checkpoint_id=path, **{stager_kw: stager})


class CpuCachedWriter(tdcp.FileSystemWriter):
    """torch's FileSystemWriter.stage for cache_staged_state_dict=True, line for line, minus
    the pin_memory=True that raises on a CPU-only torch (see probe_torch_writer)."""

    def stage(self, state_dict):
        self.per_thread_copy_ahead = 0
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=False)
        return _copy_state_dict(state_dict, self.state_dict_cache)


def probe_torch_writer(base):
    """Can torch's own FileSystemWriter(cache_staged_state_dict=True) stage here?"""
    try:
        tdcp.FileSystemWriter(base, cache_staged_state_dict=True).stage({"x": torch.zeros(1)})
        return "works"
    except Exception as e:  # noqa: BLE001 - reported
        return f"raises {type(e).__name__}: {e}"


PROBE = {}
NOSTAGER_DCPX, NOSTAGER_TORCH = "dcpx no stager (default call)", "torch no stager (default call)"
CONFIGS = [  # (name, stager factory(first checkpoint path), save function)
    ("dcpx async staging",
     lambda p: dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True)), saver(dcpx)),
    ("dcpx sync staging",
     lambda p: dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=False)), saver(dcpx)),
    ("torch DefaultStager",
     lambda p: TorchStager(TorchOptions(use_pinned_memory=False, use_shared_memory=False,
                                        use_async_staging=True, use_non_blocking_copy=False)),
     saver(tdcp)),
    ("torch FileSystemWriter(cache_staged_state_dict)",
     lambda p: (tdcp.FileSystemWriter if PROBE.get("writer") == "works" else CpuCachedWriter)(
         p, cache_staged_state_dict=True), saver(tdcp, "storage_writer")),
    # The default call, async_save(sd, checkpoint_id=...) every N steps (torchtitan's async
    # mode): torch makes a DefaultStager per call, dcpx reuses the buffers it keeps.
    (NOSTAGER_DCPX, lambda p: None, saver(dcpx)),
    (NOSTAGER_TORCH, lambda p: None, saver(tdcp)),
]
NOTES = [
    "torch DefaultStager: StagingOptions(use_pinned_memory=False, use_shared_memory=False, "
    "use_async_staging=True, use_non_blocking_copy=False); without an accelerator torch's raises "
    "'Non-blocking copy requires that the current accelerator is available' for non-blocking copy.",
    "torch FileSystemWriter(cache_staged_state_dict=True) as the stager: where its stage() raises "
    "(it allocates the cache with pin_memory=True; see torch_writer_probe) the benchmark uses "
    "CpuCachedWriter, a subclass whose stage() is torch's with pin_memory=False.",
    "dcpx DefaultStager: its default options (use_shared_memory=True: a memfd buffer; pinning "
    "is ignored without CUDA).",
    "Each upload is waited for before the next save (torch's recipe). Once staging is complete "
    "the benchmark overwrites element 0 of the first and last source tensors, so a checkpoint "
    "holding values read after staging fails verification.",
    f"Staging target reference: {MEMCPY} (median).",
    "No stager (default call): async_save(sd, checkpoint_id=path) with nothing else, as "
    "torchtitan's async mode calls it; torch makes DefaultStager(StagingOptions(False, False, "
    "False, False)) per call, dcpx reuses the staging buffers it keeps between such calls "
    "(dcpx.release_staging_buffers() after the configuration). Blocking = time in the call.",
]


def one_save(save_fn, sd, path, stager, value, between=None):
    """Times one save; `between()` (the compute loop) runs until the upload completes."""
    stamp(sd, value)
    gc.collect()
    t0 = perf()
    resp = save_fn(sd, path, stager)
    t_ret = perf() - t0
    staging, upload = ((resp.staging_completion, resp.upload_completion)
                       if hasattr(resp, "staging_completion") else (None, resp))
    steps, t_stage = [], None
    while between is not None and not upload.done():
        staged = staging is None or staging.done()
        if staged and t_stage is None:  # within one step of staging completion
            t_stage = t_ret if staging is None else perf() - t0
            disturb(sd)
        steps.append((staged, between()))
    if t_stage is None:
        if staging is not None:
            staging.result()
        t_stage = t_ret if staging is None else perf() - t0
        disturb(sd)
    upload.result()
    t_up = perf() - t0
    return {"blocking_s": t_ret, "staging_s": t_stage, "upload_s": t_up, "rss_gib": rss_gib(),
            "upload_gbps": nbytes(sd) / (t_up - t_stage) / GB}, steps


def run_config(cfg, sd, case_dir, repeat):
    """`repeat` timed saves with one stager, one more with the compute loop running, verify."""
    name, make_stager, save_fn = cfg
    paths = [os.path.join(case_dir, f"{name.split('(')[0].replace(' ', '-')}-{i}")
             for i in range(repeat + 1)]
    stager = make_stager(paths[0])
    saves = []
    try:
        cpu0 = cpu_snapshot()
        for i in range(repeat):
            saves.append(one_save(save_fn, sd, paths[i], stager, float(i))[0])
            if i:
                shutil.rmtree(paths[i - 1])
        cpu1 = cpu_snapshot()
        steps = step_test(save_fn, sd, paths[repeat], stager, float(repeat))
        shutil.rmtree(paths[repeat - 1])
        alloc = getattr(stager, "alloc_count", None)
        if name == NOSTAGER_DCPX and hasattr(dcpx.staging, "_pool"):  # absent before the pool
            alloc = dcpx.staging._pool.stats()["thread"]["alloc_count"]
    finally:
        if hasattr(stager, "close"):
            stager.close()
        if name == NOSTAGER_DCPX and hasattr(dcpx, "release_staging_buffers"):
            dcpx.release_staging_buffers()
        del stager
        gc.collect()
    stamp(sd, float(repeat))  # the values of the last call
    ok, msg = verify(sd, paths[repeat])
    shutil.rmtree(paths[repeat])
    keys = ("blocking_s", "staging_s", "upload_s", "upload_gbps")
    return {"name": name, "saves": saves, "first": saves[0],
            "median_2_to_n": {k: med([s[k] for s in saves[1:]]) for k in keys},
            "step_test": steps, "verified": ok, "verify_msg": msg,
            "others_cores": others_cores(cpu0, cpu1), "stager_alloc_count": alloc}


def step_test(save_fn, sd, path, stager, value, alone_steps=30, min_steps=40, max_saves=5):
    """Step time (4 single-threaded 512x512 matmuls) alone (before and after), then while
    saves run (warm stager), repeated until min_steps steps overlapped a save."""
    g = torch.Generator().manual_seed(2)
    a, b, c = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g), \
        torch.empty(512, 512)

    def train_step():
        t0 = perf()
        for _ in range(4):
            torch.mm(a, b, out=c)
        return perf() - t0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = [train_step() for _ in range(alone_steps + 5)][5:]
        saves, steps = [], []
        while len(saves) < max_saves and (len(steps) < min_steps or not saves):
            if saves:
                shutil.rmtree(path)
            save, more = one_save(save_fn, sd, path, stager, value, between=train_step)
            saves.append(save)
            steps += more
        alone = med(alone + [train_step() for _ in range(alone_steps)])
    finally:
        torch.set_num_threads(threads)
    out = {"alone_step_s": alone, "saves": len(saves),
           **{k: med([s[k] for s in saves]) for k in ("blocking_s", "staging_s", "upload_s")}}
    for phase, staged in (("staging", False), ("writing", True)):
        xs = [dt for s, dt in steps if s == staged]
        out.update({f"{phase}_steps": len(xs), f"{phase}_step_s": med(xs),
                    f"{phase}_ratio": med(xs) / alone if xs else None})
    return out


def verify(expected, path):
    """Load with torch.distributed.checkpoint.load into fresh NaN tensors and compare."""
    fresh = {k: torch.full_like(v, float("nan")) for k, v in expected.items()}
    try:
        tdcp.load(fresh, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # a BaseException; reported as a failure
        return False, f"load failed: {type(e).__name__}: {str(e).strip().splitlines()[-1]}"
    bad = [k for k, v in expected.items() if not torch.equal(v, fresh[k])]
    return (False, f"{len(bad)} tensors differ, e.g. {bad[:3]}") if bad else (True, "equal")


# ------------------------------------------------------------------ driving and reporting
def run_case(label, sd, args, base):
    n = nbytes(sd)
    case_dir = tempfile.mkdtemp(prefix=f"{label}-", dir=base)
    print(f"[{label}] {len(sd)} tensors, {n / 2**20:.1f} MiB: baselines", flush=True)
    res = {"case": label, "tensors": len(sd), "bytes": n,
           "baselines": baselines(sd, case_dir, args.repeat), "configs": []}
    for cfg in CONFIGS:
        if args.only and not any(o in cfg[0] for o in args.only):
            continue
        print(f"[{label}] {cfg[0]}", flush=True)
        res["configs"].append(run_config(cfg, sd, case_dir, args.repeat))
    shutil.rmtree(case_dir)
    memcpy, write = med(res["baselines"][MEMCPY]), med(res["baselines"][WRITE])
    res["write_limit_gbps"] = n / write / GB
    for c in res["configs"]:
        m = c["median_2_to_n"]
        c["staging_vs_memcpy"] = m["staging_s"] / memcpy
        c["upload_vs_write_limit"] = m["upload_gbps"] / res["write_limit_gbps"]
        c["staging_met"] = c["staging_vs_memcpy"] <= STAGING_TARGET
        c["upload_met"] = c["upload_vs_write_limit"] >= UPLOAD_TARGET
        # issue 12: per-tensor overhead = (median time - the byte-limited time of the same bytes
        # from this run) / tensors; upload time = upload done - staging done, per save
        upload_only = med([s["upload_s"] - s["staging_s"] for s in c["saves"][1:]])
        c["us_per_tensor"] = {"staging": (m["staging_s"] - memcpy) / len(sd) * 1e6,
                              "upload": (upload_only - write) / len(sd) * 1e6}
        c["issue12_staging_met"] = c["staging_vs_memcpy"] <= ISSUE12_STAGING
        c["issue12_upload_met"] = c["upload_vs_write_limit"] >= ISSUE12_UPLOAD
    by = {c["name"]: c["median_2_to_n"] for c in res["configs"]}
    plain = [c for c in by if c not in (NOSTAGER_DCPX, NOSTAGER_TORCH)]
    pairs = [(d, t) for d in plain if d.startswith("dcpx") for t in plain if t.startswith("torch")]
    pairs += [(NOSTAGER_DCPX, NOSTAGER_TORCH)] if NOSTAGER_DCPX in by and NOSTAGER_TORCH in by \
        else []
    res["speedups"] = [{"dcpx": d, "torch": t, **{k: by[t][k] / by[d][k] for k in
                                                   ("blocking_s", "staging_s", "upload_s")}}
                       for d, t in pairs]
    return res


def machine_info(base, argv):
    def grep(path, key):
        with open(path) as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith(key)), "?")
    real = os.path.realpath(base)
    with open("/proc/mounts") as f:
        mnt = max((m for m in (ln.split() for ln in f)
                   if real == m[1] or real.startswith(m[1].rstrip("/") + "/")),
                  key=lambda m: len(m[1]))
    git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                         text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    env = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} " if "PYTHONPATH" in os.environ else ""
    return {"command": env + shlex.join(["python3", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": grep("/proc/cpuinfo", "model name"), "cores": os.cpu_count(),
            "ram_gib": round(int(grep("/proc/meminfo", "MemTotal").split()[0]) / 2**20, 1),
            "dir": real, "fs_type": mnt[2], "fs_device": mnt[0], "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "dcpx": dcpx.__version__,
            "git": git.strip(), **dcpx_source(), "loadavg_start": os.getloadavg()}


def dcpx_source():
    """Which dcpx tree was measured (PYTHONPATH decides; the script may be another tree's)."""
    d = os.path.dirname(os.path.dirname(os.path.abspath(dcpx.__file__)))
    git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                         text=True, cwd=d).stdout.strip()
    return {"dcpx_path": d, "dcpx_git": git or "?"}


def f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def table(header, rows):
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def render(results, meta):
    out = ["# dcpx async_save benchmark", "", f"`{meta['command']}`", ""]
    out += table(["machine / setting", "value"], [(k, v) for k, v in meta.items() if k != "command"])
    out += ["", "Notes:"] + [f"* {n}" for n in NOTES]
    for r in results:
        n = r["bytes"]
        out += ["", f"## ({r['case']}) {r['tensors']} tensors, {n / 2**20:.1f} MiB", ""]
        out += table(["baseline", "median s", "min s", "GB/s (median)"],
                     [(k, f(med(v)), f(min(v)), f(n / med(v) / GB, 2))
                      for k, v in r["baselines"].items()])
        out += ["", "Seconds from the call. 1st = first save (allocates); med = median of saves "
                "2..N. Upload GB/s = bytes / (upload done - staging done).", ""]
        out += table(["config", "blocking 1st", "med", "staged 1st", "med", "uploaded 1st", "med",
                      "upload GB/s med", "other procs (cores)", "verified"],
                     [(c["name"], *(f(c[w][k]) for k in ("blocking_s", "staging_s", "upload_s")
                                    for w in ("first", "median_2_to_n")),
                       f(c["median_2_to_n"]["upload_gbps"], 2), c["others_cores"],
                       "ok" if c["verified"] else f"**FAILED: {c['verify_msg']}**")
                      for c in r["configs"]])
        out += ["", f"Targets, saves 2..N: staging <= {STAGING_TARGET}x memcpy; upload >= "
                f"{UPLOAD_TARGET}x write limit ({r['write_limit_gbps']:.2f} GB/s).", ""]
        out += table(["config", "staging / memcpy", "", "upload / write limit", ""],
                     [(c["name"], f(c["staging_vs_memcpy"], 2), "met" if c["staging_met"]
                       else "NOT met", f(c["upload_vs_write_limit"], 2),
                       "met" if c["upload_met"] else "NOT met") for c in r["configs"]])
        out += ["", f"Issue 12 targets for (b) (saves 2..N): staging <= {ISSUE12_STAGING}x one warm "
                f"memcpy; upload >= {ISSUE12_UPLOAD}x the write limit"
                + ("" if r["case"].startswith("b") else " (shown for reference: (a) keeps today's "
                   "ratios, see benchmarks/compare.py)")
                + ". us per tensor = (median - the memcpy (staging) or write+fsync (upload) "
                "median of the same bytes) / tensors.", ""]
        ok = (lambda v: "MET" if v else "NOT MET") if r["case"].startswith("b") else (lambda v: "")
        out += table(["config", "staging / memcpy", "", "upload / write limit", "",
                      "staging us/tensor", "upload us/tensor"],
                     [(c["name"], f(c["staging_vs_memcpy"], 2), ok(c["issue12_staging_met"]),
                       f(c["upload_vs_write_limit"], 2), ok(c["issue12_upload_met"]),
                       f(c["us_per_tensor"]["staging"], 2), f(c["us_per_tensor"]["upload"], 2))
                      for c in r["configs"]])
        out += ["", "Speedups, torch median / dcpx median, saves 2..N:", ""]
        out += table(["dcpx", "torch", "blocking", "to staging done", "to upload done"],
                     [(s["dcpx"], s["torch"], *(f"{s[k]:.2f}x" for k in
                                                ("blocking_s", "staging_s", "upload_s")))
                      for s in r["speedups"]])
        nost = {c["name"]: c for c in r["configs"] if c["name"] in (NOSTAGER_DCPX, NOSTAGER_TORCH)}
        if len(nost) == 2:
            d, t = nost[NOSTAGER_DCPX]["saves"], nost[NOSTAGER_TORCH]["saves"]
            out += ["", "No stager (default call): seconds blocked in async_save, call by call "
                    f"(dcpx staging-buffer allocations: {nost[NOSTAGER_DCPX]['stager_alloc_count']}):",
                    ""]
            out += table(["call", "dcpx blocking s", "torch blocking s", "dcpx / torch"],
                         [(i + 1, f(a["blocking_s"], 4), f(b["blocking_s"], 4),
                           f(a["blocking_s"] / b["blocking_s"], 2))
                          for i, (a, b) in enumerate(zip(d, t))])
        out += ["", "Training-step slowdown: 4x 512x512 matmul, torch.set_num_threads(1), during "
                "extra saves (warm stager; until >= 40 steps overlapped one, at most 5 saves); "
                "ratio = median step / median step alone (before + after); save times are medians.",
                ""]
        out += table(["config", "saves", "step alone ms", "steps while staging", "ratio",
                      "steps while writing", "ratio", "blocking s", "staged s", "uploaded s"],
                     [(c["name"], s["saves"], f(s["alone_step_s"] * 1e3, 2), s["staging_steps"],
                       f(s["staging_ratio"], 2), s["writing_steps"], f(s["writing_ratio"], 2),
                       f(s["blocking_s"]), f(s["staging_s"]), f(s["upload_s"]))
                      for c in r["configs"] for s in [c["step_test"]]])
    return "\n".join(out) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--which", choices=("large", "small", "both"), default="both")
    p.add_argument("--gib", type=float, default=2.0, help="size of the large state dict")
    p.add_argument("--small-count", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=5, help="saves per configuration (>= 2)")
    p.add_argument("--quick", action="store_true", help="64 MiB / 2000 tensors / 3 saves")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints are written")
    p.add_argument("--only", action="append", default=[], metavar="TEXT",
                   help="run only the configurations whose name contains TEXT (repeatable), "
                   "e.g. --only 'no stager'")
    p.add_argument("--out", help="path stem of the .json/.md results "
                   "(default benchmarks/results/async_local, async_quick with --quick)")
    a = p.parse_args(argv)
    if a.quick:
        a.gib, a.small_count, a.repeat = 1 / 16, 2000, 3
    if a.repeat < 2:
        p.error("--repeat must be >= 2 (first save vs the rest)")
    if a.out is None:
        a.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                             "async_quick" if a.quick else "async_local")
    return a


def main(argv=None):
    argv = sys.argv if argv is None else argv
    args = parse_args(argv[1:])
    base = tempfile.mkdtemp(prefix="dcpx-async-bench-", dir=args.dir)
    meta = machine_info(base, argv)
    PROBE["writer"] = probe_torch_writer(base)
    meta.update(repeat=args.repeat, torch_writer_probe=PROBE["writer"])
    results = []
    try:
        for which, label, make, size in (("large", "a-large", make_large, args.gib),
                                         ("small", "b-small", make_small, args.small_count)):
            if args.which in (which, "both"):
                results.append(run_case(label, make(size), args, base))
                gc.collect()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    meta.update(loadavg_end=os.getloadavg(),
                peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2))
    md = render(results, meta)
    print(md)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as fh:
        json.dump({"meta": meta, "notes": NOTES, "results": results}, fh, indent=1)
    with open(args.out + ".md", "w") as fh:
        fh.write(md)
    print(f"wrote {args.out}.json and {args.out}.md")
    failed = [(r["case"], c["name"]) for r in results for c in r["configs"] if not c["verified"]]
    if failed:
        print(f"VERIFICATION FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
