#!/usr/bin/env python3
"""I/O benchmark: dcpx vs torch.distributed.checkpoint vs the machine's limits.

For (a) a few large tensors and (b) many small tensors, measures in one run:
memcpy / sequential write+fsync / sequential read of the same byte count with
plain Python (the "limits"), then torch DCP and dcpx save + load (each load is
verified against the source).  Prints a table and writes JSON + Markdown.
See benchmarks/README.md.
"""
import argparse
import datetime
import gc
import json
import os
import platform
import resource
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

CHUNK = 64 << 20          # bytes per os.write / readv call in the limit measurements
PACK_BELOW = 1 << 20      # tensors smaller than this are packed into one buffer for the limits
GB = 1e9                  # throughputs are decimal GB/s


# ----------------------------------------------------------------- state dicts
def make_large(gib, n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    numel = max(1024, int(gib * 2**30 / n / 4)) // 1024 * 1024
    return {f"layers.{i}.weight": torch.randn(numel // 1024, 1024, generator=g) for i in range(n)}


def make_small(count, seed=1):
    """Mixed 1-D / 2-D fp32 tensors of 64..4096 elements, like biases, norms, tiny projections."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    kinds = ["norm.weight", "norm.bias", "proj.bias", "gate.weight"]
    sd = {}
    for i in range(count):
        if rng.random() < 0.6:
            shape = (int(rng.integers(64, 4097)),)
        else:
            shape = (int(rng.integers(2, 65)), int(rng.integers(32, 65)))
        sd[f"blocks.{i // 4}.{kinds[i % 4]}"] = torch.randn(shape, generator=g)
    return sd


def make_tiny(count, seed=2):
    """Optimizer-state-like tiny fp32 tensors: per parameter a 0-d `step` and two 1-D moments of
    1..64 elements (one length per parameter), i.e. where the cost is per tensor, not per byte."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 65, (count // 3 + 1,), generator=g).tolist()
    kinds = ("step", "exp_avg", "exp_avg_sq")
    sd = {}
    for i in range(count):
        p, k = divmod(i, 3)
        sd[f"state.{p}.{kinds[k]}"] = (torch.randn((), generator=g) if k == 0
                                       else torch.randn(lens[p], generator=g))
    return sd


def make_case(name, args):
    if name == "large":
        return make_large(args.gib)
    return make_small(args.small_count) if name == "small" else make_tiny(args.tiny_count)


CASE_LETTER = {"large": "a", "small": "b", "tiny": "c"}


def empty_like_sd(sd):
    return {k: torch.empty_like(v) for k, v in sd.items()}


def nbytes(sd):
    return sum(t.numel() * t.element_size() for t in sd.values())


def verify(expected, got, what):
    if expected.keys() != got.keys():
        raise RuntimeError(f"{what}: key mismatch after load")
    for k, t in expected.items():
        if not torch.equal(t, got[k]):
            raise RuntimeError(f"{what}: tensor {k!r} differs from the original after load")


# ------------------------------------------------------------------- helpers
def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def quiesce():
    """Untimed: collect garbage and flush unrelated dirty pages before a timed op."""
    gc.collect()
    os.sync()


def cpu_snapshot():
    with open("/proc/stat") as f:
        v = [int(x) / os.sysconf("SC_CLK_TCK") for x in f.readline().split()[1:]]
    t = os.times()
    return {"busy": v[0] + v[1] + v[2] + v[5] + v[6], "steal": v[7],
            "self": t.user + t.system, "wall": time.monotonic()}


def cpu_noise(a, b):
    """CPU (in cores, averaged over the wall time) used by everything but this
    process (other processes, kernel writeback threads), and stolen by the host."""
    wall = b["wall"] - a["wall"]
    return {"others_cores": round((b["busy"] - a["busy"] - (b["self"] - a["self"])) / wall, 2),
            "steal_cores": round((b["steal"] - a["steal"]) / wall, 2)}


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def as_bytes(t):
    return memoryview(t.numpy()).cast("B")


def limit_buffers(sd, dst_sd):
    """(src, dst) byte buffers covering the same bytes: big tensors as-is, small ones packed."""
    small = {k for k, t in sd.items() if t.numel() * t.element_size() < PACK_BELOW}
    src = [t for k, t in sd.items() if k not in small]
    dst = [dst_sd[k] for k in sd if k not in small]
    if small:
        src.append(torch.cat([sd[k].reshape(-1) for k in small]))
        dst.append(torch.empty_like(src[-1]))
    for t in dst:
        t.fill_(0)  # pre-fault
    return src, dst


def rm(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def du(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# ------------------------------------------------------------ limit measures
def limit_memcpy(src, dst):
    for s, d in zip(src, dst):
        np.copyto(d.numpy(), s.numpy())


def limit_write(src, path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in src:
            mv = as_bytes(t)
            off = 0
            while off < len(mv):
                off += os.write(fd, mv[off:off + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def limit_read(path, dst):
    fd = os.open(path, os.O_RDONLY)
    try:
        for t in dst:
            mv = as_bytes(t)
            off = 0
            while off < len(mv):
                n = os.readv(fd, [mv[off:off + CHUNK]])
                if n == 0:
                    raise RuntimeError("limit read: short file")
                off += n
    finally:
        os.close(fd)


# --------------------------------------------------------- checkpoint libs
def ckpt_save(mod, sd, path, thread_count):
    if thread_count is None:
        mod.save(sd, checkpoint_id=path, no_dist=True)
    else:
        writer = mod.FileSystemWriter(path, thread_count=thread_count)
        mod.save(sd, checkpoint_id=path, storage_writer=writer, no_dist=True)


def ckpt_load(mod, sd, path):
    mod.load(sd, checkpoint_id=path, no_dist=True)


def load_dcpx():
    try:
        import dcpx
        for name in ("save", "load", "FileSystemWriter", "FileSystemReader"):
            getattr(dcpx, name)
        return dcpx, None
    except Exception as e:  # not built / not finished yet: benchmark torch only
        return None, f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------ the runs
def run_case(name, sd, libs, args, workdir):
    size, dst = nbytes(sd), empty_like_sd(sd)
    src_bufs, dst_bufs = limit_buffers(sd, dst)
    times = {op: [] for op in ["limit memcpy", "limit write+fsync", "limit read"]
             + [f"{lib} {op}" for lib in libs for op in ("save", "load")]}
    disk, cpu0 = {}, cpu_snapshot()

    def measure(op, fn, read=False):
        quiesce()
        if read and args.drop_caches:
            drop_caches()
        times[op].append(timed(fn))

    def check_limit():
        if not all(torch.equal(s, d) for s, d in zip(src_bufs, dst_bufs)):
            raise RuntimeError("limit read returned wrong bytes")

    for _ in range(args.repeat):
        measure("limit memcpy", lambda: limit_memcpy(src_bufs, dst_bufs))
    # who: (write op, read op, write(path), read(path), buffers read into, check after read)
    subjects = {"limit": ("write+fsync", "read", lambda p: limit_write(src_bufs, p),
                          lambda p: limit_read(p, dst_bufs), dst_bufs, check_limit)}
    for lib, mod in libs.items():
        subjects[lib] = ("save", "load", lambda p, m=mod: ckpt_save(m, sd, p, args.thread_count),
                         lambda p, m=mod: ckpt_load(m, dst, p), list(dst.values()),
                         lambda lib=lib: verify(sd, dst, f"{lib} load ({name})"))
    for who, (wop, rop, write, read, bufs, check) in subjects.items():
        path = os.path.join(workdir, f"{name}-{who}")
        # Untimed warm-up write. Each timed write then follows the deletion of the same writer's
        # previous output, so it refills the page cache that output just freed (see README).
        write(path)
        read(path)  # untimed warm-up load too: timed saves and loads are the 2nd..Nth
        for _ in range(args.repeat):
            rm(path)
            measure(f"{who} {wop}", lambda: write(path))
            disk[who] = du(path)
            for t in bufs:
                t.zero_()
            measure(f"{who} {rop}", lambda: read(path), read=True)
            check()
        rm(path)
        print(f"  [{name}] {who}: {args.repeat} repeats done", file=sys.stderr, flush=True)
    ops = {op: {"times_s": ts, "median_s": statistics.median(ts), "min_s": min(ts),
                "gbps_median": size / GB / statistics.median(ts)} for op, ts in times.items()}
    for lib in libs:  # issue 12: (median - the byte-limited time of the same bytes) / tensors
        for op, limit in (("save", "limit write+fsync"), ("load", "limit read")):
            o = ops[f"{lib} {op}"]
            o["us_per_tensor_over_limit"] = (o["median_s"] - ops[limit]["median_s"]) / len(sd) * 1e6
    noise = cpu_noise(cpu0, cpu_snapshot())
    gc.collect()
    peak = peak_memory(name, libs, args, workdir) if name in args.peak_mem else {}
    return {"n_tensors": len(sd), "bytes": size, "ops": ops, "disk_bytes": disk,
            "cpu_noise": noise, "ratios": ratios(name, ops), "peak_extra_rss": peak,
            "targets_issue12": targets_issue12(name, ops, peak)}


def ratios(name, ops):
    """(label, value, target, met) rows; value None when an operand is missing."""
    def med(op):
        return ops[op]["median_s"] if op in ops else None

    def div(a, b):
        return a / b if a is not None and b is not None else None

    rows = [
        ("dcpx save thrpt / write limit", div(med("limit write+fsync"), med("dcpx save")),
         0.9 if name == "large" else None),
        ("dcpx load thrpt / read limit", div(med("limit read"), med("dcpx load")),
         0.9 if name == "large" else None),
        ("torch save thrpt / write limit", div(med("limit write+fsync"), med("torch save")), None),
        ("torch load thrpt / read limit", div(med("limit read"), med("torch load")), None),
        ("save speedup dcpx vs torch", div(med("torch save"), med("dcpx save")),
         5.0 if name == "small" else None),
        ("load speedup dcpx vs torch", div(med("torch load"), med("dcpx load")),
         5.0 if name == "small" else None),
    ]
    return [{"label": l, "value": v, "target": tg,
             "met": None if tg is None or v is None else v >= tg} for l, v, tg in rows]


# -------------------------------------------------------------- peak memory
def _status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))


def peak_child(spec):
    """In a fresh process (so the high-water mark is this library's alone): build the case's state
    dict, warm the library up on a one-tensor checkpoint (lazy imports), then reset VmHWM
    (/proc/self/clear_refs 5) and run one save or load; prints VmHWM - VmRSS before it, in bytes."""
    warnings.filterwarnings("ignore", module=r"torch\.distributed")
    if spec["lib"] == "dcpx":
        import dcpx as mod
    else:
        import torch.distributed.checkpoint as mod
    args = argparse.Namespace(**spec["args"])
    sd = make_case(spec["case"], args)
    warm = os.path.join(spec["dir"], f"warm-{spec['lib']}-{spec['op']}")
    w = {"w": torch.zeros(4)}
    ckpt_save(mod, w, warm, args.thread_count)
    ckpt_load(mod, w, warm)
    rm(warm)
    if spec["op"] == "load":
        for t in sd.values():
            t.zero_()
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        method = "VmHWM reset by /proc/self/clear_refs before the operation"
    except OSError as e:  # the high-water mark then includes building the state dict
        method = f"VmHWM not reset ({e}): a lower bound"
    base = _status_kib("VmRSS")
    if spec["op"] == "save":
        ckpt_save(mod, sd, spec["path"], args.thread_count)
    else:
        ckpt_load(mod, sd, spec["path"])
    peak = _status_kib("VmHWM")
    print(json.dumps({"extra_bytes": (peak - base) * 1024, "base_bytes": base * 1024,
                      "method": method}))


def peak_memory(name, libs, args, workdir):
    """Per library: a save child, then a load child reading what it wrote. Bytes above the RSS
    with the state dict (the source for save, the destination for load) built."""
    out = {}
    for lib in libs:
        path = os.path.join(workdir, f"{name}-{lib}-peak")
        for op in ("save", "load"):
            spec = {"lib": lib, "op": op, "case": name, "path": path, "dir": workdir,
                    "args": {k: getattr(args, k) for k in ("gib", "small_count", "tiny_count",
                                                           "thread_count")}}
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--peak-child",
                                json.dumps(spec)], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"peak-memory child {lib} {op} ({name}) failed:\n{r.stderr}")
            out[f"{lib} {op}"] = json.loads(r.stdout.strip().splitlines()[-1])
        rm(path)
        print(f"  [{name}] {lib}: peak memory measured", file=sys.stderr, flush=True)
    return out


# ------------------------------------------------------------ issue-12 targets
def targets_issue12(name, ops, peak):
    """(label, value, unit, target text, met) rows for the targets of issue 12. `met` is None
    where dcpx (or torch, for a comparison) was not measured or there is no fixed target."""
    def med(op):
        return ops[op]["median_s"] if op in ops else None

    def row(label, value, unit, target, ok):
        return {"label": label, "value": value, "unit": unit, "target": target,
                "met": None if value is None or ok is None else bool(ok(value))}

    def div(a, b):
        return a / b if a is not None and b is not None else None

    save_r = div(med("limit write+fsync"), med("dcpx save"))
    load_r = div(med("limit read"), med("dcpx load"))
    rows = []
    if name == "small":
        rows += [row("dcpx save / write limit (throughput)", save_r, "x", ">= 0.6x", lambda v: v >= 0.6),
                 row("dcpx load / read limit (throughput)", load_r, "x", ">= 0.6x", lambda v: v >= 0.6),
                 row("save speedup vs torch DCP", div(med("torch save"), med("dcpx save")), "x",
                     ">= 20x", lambda v: v >= 20),
                 row("load speedup vs torch DCP", div(med("torch load"), med("dcpx load")), "x",
                     ">= 20x", lambda v: v >= 20)]
    elif name == "tiny":
        rows += [row("dcpx save", med("dcpx save"), "s", "<= 1.0 s", lambda v: v <= 1.0),
                 row("dcpx load", med("dcpx load"), "s", "<= 1.0 s", lambda v: v <= 1.0)]
        for op in ("save", "load"):
            d, t = peak.get(f"dcpx {op}"), peak.get(f"torch {op}")
            rows.append(row(f"dcpx {op} peak extra RSS (torch: "
                            + ("n/a" if t is None else f"{t['extra_bytes'] / 2**20:.1f} MiB") + ")",
                            None if d is None else d["extra_bytes"] / 2**20, "MiB", "<= torch's",
                            None if t is None else (lambda v, t=t: v * 2**20 <= t["extra_bytes"])))
    else:  # large: keep today's ratios; benchmarks/compare.py sets them against the old tree's
        rows += [row("dcpx save / write limit (throughput)", save_r, "x", "today's (compare.py)", None),
                 row("dcpx load / read limit (throughput)", load_r, "x", "today's (compare.py)", None)]
    for lib in ("dcpx", "torch"):
        for op in ("save", "load"):
            o = ops.get(f"{lib} {op}")
            rows.append(row(f"{lib} {op}: us per tensor over the limit",
                            None if o is None else o["us_per_tensor_over_limit"], "us", "", None))
    return rows


def fmt_target(r):
    v = r["value"]
    v = "n/a" if v is None else (f"{v:.3g}x" if r["unit"] == "x" else
                                 f"{v:.3f} s" if r["unit"] == "s" else f"{v:.2f} {r['unit']}")
    return [r["label"], v, r["target"], "" if r["met"] is None else "MET" if r["met"] else "NOT MET"]


# ------------------------------------------------------------------- report
def machine_info(workdir, dcpx_mod, dcpx_err):
    def first(path, key):
        try:
            with open(path) as f:
                return next((l.split(":", 1)[1].strip() for l in f if l.startswith(key)), "?")
        except OSError:
            return "?"

    real, fs = os.path.realpath(workdir), ("?", "?", "?")
    with open("/proc/mounts") as f:
        for dev, mnt, typ, *_ in (l.split() for l in f):
            if (real + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(fs[1]):
                fs = (dev, mnt, typ)
    git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu": first("/proc/cpuinfo", "model name"), "cores": os.cpu_count(),
        "ram": f"{int(first('/proc/meminfo', 'MemTotal').split()[0]) / 2**20:.1f} GiB",
        "bench_dir": real, "fs_type": fs[2], "fs_device": fs[0], "fs_mount": fs[1],
        "kernel": platform.release(), "python": platform.python_version(),
        "torch": torch.__version__, "numpy": np.__version__, "torch_threads": torch.get_num_threads(),
        "dcpx": getattr(dcpx_mod, "__version__", "unknown") if dcpx_mod else f"not available ({dcpx_err})",
        "git": git or "?",
        **dcpx_source(dcpx_mod),
        # on VMs, freed guest memory handed back to the host makes the next first touch slow
        "free_page_reporting": os.path.exists("/sys/module/page_reporting"),
    }


def dcpx_source(mod):
    """Which dcpx tree was measured (PYTHONPATH decides; the script may be another tree's)."""
    if mod is None:
        return {}
    d = os.path.dirname(os.path.dirname(os.path.abspath(mod.__file__)))
    git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                         text=True, cwd=d).stdout.strip()
    return {"dcpx_path": d, "dcpx_git": git or "?"}


def fmt_ratio(r):
    v = "n/a" if r["value"] is None else f"{r['value']:.3g}x"
    if r["target"] is None:
        return v, "", ""
    status = "n/a" if r["met"] is None else ("MET" if r["met"] else "NOT MET")
    return v, f">= {r['target']:.1f}x", status


def render(results, meta, md):
    def table(header, rows):
        if md:
            out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            return out + ["| " + " | ".join(r) + " |" for r in rows]
        w = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        line = lambda r: "  ".join(str(x).ljust(n) for x, n in zip(r, w)).rstrip()
        return [line(header), line(["-" * n for n in w])] + [line(r) for r in rows]

    h = (lambda s, lvl: ("#" * lvl + " " + s) if md else f"== {s} ==")
    q = "`" if md else ""
    out = [h("dcpx I/O benchmark", 1), "", q + meta["command"] + q, ""]
    keys = ["date", "hostname", "cpu", "cores", "ram", "bench_dir", "fs_type", "fs_device", "kernel",
            "python", "torch", "numpy", "torch_threads", "dcpx", "git", "dcpx_path", "dcpx_git", "read_mode", "thread_count",
            "repeat", "peak_rss_gib", "free_page_reporting"]
    out += table(["machine / setting", "value"], [[k, str(meta.get(k))] for k in keys])
    for name, res in results.items():
        out += ["", h(f"({CASE_LETTER[name]}) {name}: {res['n_tensors']} tensors, "
                      f"{res['bytes'] / 2**20:.1f} MiB", 2), ""]
        rows = []
        for op, o in res["ops"].items():
            lib = op.split()[0]
            d = res["disk_bytes"].get(lib) if op.endswith(("save", "fsync")) else None
            us = o.get("us_per_tensor_over_limit")
            rows.append([op, f"{o['median_s']:.3f}", f"{o['min_s']:.3f}", f"{o['gbps_median']:.2f}",
                         "" if d is None else f"{d / 2**20:.1f}", "" if us is None else f"{us:.2f}"])
        out += table(["operation", "median s", "min s", "GB/s (median)", "on-disk MiB",
                      "us/tensor over limit"], rows)
        n = res["cpu_noise"]
        out += ["", f"CPU used by other processes + kernel threads during this case: {n['others_cores']} "
                    f"of {meta['cores']} cores (avg); stolen by the host: {n['steal_cores']} cores"
                + ("  <-- busy machine, timings are noisy" if n["others_cores"] > 0.3 else "")]
        out.append("")
        out += table(["ratio (medians)", "value", "target", "status"],
                     [[r["label"], *fmt_ratio(r)] for r in res["ratios"]])
        if res.get("peak_extra_rss"):
            out += ["", f"Peak extra memory: RSS high-water mark above the RSS with the state dict "
                        f"({res['bytes'] / 2**20:.1f} MiB) built, one fresh process per library and "
                        f"operation ({next(iter(res['peak_extra_rss'].values()))['method']}).", ""]
            out += table(["operation", "peak extra MiB", "x state dict"],
                         [[op, f"{p['extra_bytes'] / 2**20:.1f}", f"{p['extra_bytes'] / res['bytes']:.2f}"]
                          for op, p in res["peak_extra_rss"].items()])
        if res.get("targets_issue12"):
            out += ["", "Issue 12 targets (medians of saves / loads 2..N; us per tensor = (median - "
                        "the limit's median for the same bytes) / tensors):", ""]
            out += table(["issue 12", "value", "target", "status"],
                         [fmt_target(r) for r in res["targets_issue12"]])
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="parent dir for checkpoints (a fresh subdir is made and removed); "
                                 "default: the system temp dir")
    p.add_argument("--which", choices=["large", "small", "tiny", "both", "all"], default="both",
                   help="both = large + small; all = large + small + tiny")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--gib", type=float, default=2.0, help="size of the large state dict (16 tensors)")
    p.add_argument("--small-count", type=int, default=20000)
    p.add_argument("--tiny-count", type=int, default=100000,
                   help="tensors in the tiny case (0-d steps and 1..64-element moments)")
    p.add_argument("--peak-mem", default="small,tiny", metavar="CASES",
                   help="cases whose per-library peak extra RSS is measured in fresh child "
                        "processes (comma list, '' for none; default small,tiny)")
    p.add_argument("--peak-child", help=argparse.SUPPRESS)
    p.add_argument("--thread-count", type=int, default=None,
                   help="pass FileSystemWriter(path, thread_count=N) to both libraries "
                        "(default: plain checkpoint_id=, i.e. the writers' defaults)")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop the page cache before every read/load measurement (needs root)")
    p.add_argument("--no-dcpx", action="store_true", help="benchmark torch DCP and the limits only")
    p.add_argument("--no-torch", action="store_true",
                   help="dcpx and the limits only (e.g. the old tree's run for compare.py)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 64 MiB, 2000 small tensors, 5000 tiny tensors, 1 repeat")
    p.add_argument("--out", help="results path prefix (default: benchmarks/results/io_<host>[_quick])")
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.small_count, args.tiny_count, args.repeat = 1 / 16, 2000, 5000, 1
    args.peak_mem = [c for c in args.peak_mem.split(",") if c]
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.peak_child:
        return peak_child(json.loads(args.peak_child))
    warnings.filterwarnings("ignore", module=r"torch\.distributed")
    if args.drop_caches:
        try:
            drop_caches()
        except OSError as e:
            sys.exit(f"--drop-caches: cannot write /proc/sys/vm/drop_caches ({e}); run as root")
    import torch.distributed.checkpoint as tdcp
    libs = {} if args.no_torch else {"torch": tdcp}
    dcpx_mod, dcpx_err = (None, "--no-dcpx given") if args.no_dcpx else load_dcpx()
    if dcpx_mod:
        libs["dcpx"] = dcpx_mod
    else:
        print(f"NOTE: dcpx skipped: {dcpx_err}", file=sys.stderr)

    workdir = tempfile.mkdtemp(prefix="dcpx-bench-", dir=args.dir)
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("PYTHONPATH",) if k in os.environ)
    meta = machine_info(workdir, dcpx_mod, dcpx_err)
    meta.update(command=(env + " " if env else "") + shlex.join(["python"] + sys.argv),
                cwd=os.getcwd(), read_mode="cold (page cache dropped before each read)"
                if args.drop_caches else "warm (page cache NOT dropped; reads come from RAM)",
                thread_count=args.thread_count if args.thread_count is not None else "default",
                repeat=args.repeat, args=vars(args))
    results = {}
    try:
        cases = {"both": ["large", "small"], "all": ["large", "small", "tiny"]}
        for name in cases.get(args.which, [args.which]):
            print(f"building {name} state dict ...", file=sys.stderr, flush=True)
            sd = make_case(name, args)
            results[name] = run_case(name, sd, libs, args, workdir)
            del sd
            gc.collect()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    meta["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)

    print(render(results, meta, md=False))
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "local"
    prefix = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                      f"io_{host}" + ("_quick" if args.quick else ""))
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    with open(prefix + ".md", "w") as f:
        f.write(render(results, meta, md=True))
    print(f"wrote {prefix}.json and {prefix}.md", file=sys.stderr)
    failed = [r["label"] for res in results.values() for r in res["ratios"] + res["targets_issue12"]
              if r["met"] is False]
    if failed:
        print("targets not met: " + "; ".join(failed), file=sys.stderr)


if __name__ == "__main__":
    main()
