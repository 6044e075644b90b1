"""Per-save coordination cost of a multi-process save: dcpx vs torch DCP.

Spawns N ranks (gloo on localhost, one process each) holding a state dict of
``--count`` tensors (default 20,000) and times ``save`` into a fresh
directory on every rank, in two layouts:

* ``replicated``: every rank holds the same plain tensors (DDP); each tensor
  must be written once in all.
* ``sharded``: every tensor is a DTensor sharded on dim 0 over the ranks
  (FSDP); each rank writes its shards.

For each save:

* ``total``: from a barrier to the save returning, the slowest rank;
* ``write``: the time the storage layer spent writing data files, the
  slowest rank (torch: inside ``FileSystemWriter.write_data``, which includes
  torch's per-tensor serialization; dcpx: from starting its C write job to
  joining it);
* ``coordination`` = total - write: planning, the collectives, metadata and
  commit.  Counting torch's serialization as "write" favours torch;
* ``cpu``: CPU seconds (user + system, every thread) the save took, summed
  over the ranks.  On a shared machine the wall times above depend on what
  else runs; this depends much less on it.

Usage::

    PYTHONPATH=$PWD python3 benchmarks/bench_dist.py --out benchmarks/results/dist_local
    PYTHONPATH=$PWD python3 benchmarks/bench_dist.py --quick     # 2000 tensors, 2 ranks

Old vs new (issue 12): run this script twice, with ``PYTHONPATH`` on the old tree, then on the
new one with ``--compare OLD.json`` (the dcpx rows side by side, benchmarks/compare.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state_dict(count: int, layout: str, mesh):
    """``count`` fp32 tensors of 64..1024 elements per rank-part (fixed seed)."""
    g = torch.Generator().manual_seed(0)
    ws = mesh.size() if mesh is not None else 1
    sd = {}
    for i in range(count):
        rows = int(torch.randint(1, 17, (1,), generator=g)) * ws
        cols = 64
        name = f"layers.{i // 8}.p{i % 8}"
        if layout == "replicated":
            sd[name] = torch.full((rows, cols), float(i))
        else:
            from torch.distributed.tensor import DTensor, Shard
            local = torch.full((rows // ws, cols), float(i))
            sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                          shape=torch.Size((rows, cols)),
                                          stride=(cols, 1))
    return sd


def _rank_main(rank: int, ws: int, port: int, impl: str, layout: str, count: int,
               repeat: int, root: str, out: str) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    try:
        write_times: list[float] = []
        if impl == "torch":
            import torch.distributed.checkpoint as dcp

            def writer_for(path):
                w = dcp.FileSystemWriter(path)
                inner = w.write_data

                def timed(plan, planner):
                    t0 = time.perf_counter()
                    fut = inner(plan, planner)
                    fut.wait()
                    write_times.append(time.perf_counter() - t0)
                    return fut
                w.write_data = timed
                return w
        else:
            import dcpx as dcp
            from dcpx import filesystem as fs
            # the C write job's start and join; where a dcpx has none, write stays 0 and the
            # report says "not measured" (coordination is then the whole save)
            start, wait = fs.PendingWrite.start, fs.PendingWrite.wait

            def timed_start(self):
                self._t0 = time.perf_counter()
                return start(self)

            def timed_wait(self, *a, **kw):
                try:
                    return wait(self, *a, **kw)
                finally:
                    write_times.append(time.perf_counter() - self._t0)
            fs.PendingWrite.start, fs.PendingWrite.wait = timed_start, timed_wait

            def writer_for(path):
                return dcp.FileSystemWriter(path)
        mesh = None
        if layout == "sharded":
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (ws,))
        sd = _state_dict(count, layout, mesh)
        rows = []
        for it in range(repeat + 1):
            path = os.path.join(root, f"{impl}-{layout}-{ws}-{it}")
            write_times.clear()
            dist.barrier()
            c0 = time.process_time()
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=writer_for(path))
            total = time.perf_counter() - t0
            cpu = time.process_time() - c0
            rows.append({"total": total, "write": sum(write_times), "cpu": cpu})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def run_config(impl: str, layout: str, ws: int, count: int, repeat: int, root: str) -> dict:
    out = tempfile.mkdtemp(prefix="dcpx-bench-dist-")
    try:
        mp.spawn(_rank_main, args=(ws, _free_port(), impl, layout, count, repeat, root, out),
                 nprocs=ws)
        per_rank = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(ws)]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    saves = []
    for it in range(repeat + 1):
        total = max(pr[it]["total"] for pr in per_rank)
        write = max(pr[it]["write"] for pr in per_rank)
        cpu = sum(pr[it]["cpu"] for pr in per_rank)
        saves.append({"total": total, "write": write, "coordination": total - write, "cpu": cpu})
    measured = saves[1:]  # the first save warms up imports and caches
    med = {k: statistics.median(s[k] for s in measured)
           for k in ("total", "write", "coordination", "cpu")}
    return {"impl": impl, "layout": layout, "ranks": ws, "count": count,
            "saves": saves, "median": med}


def _dcpx_source() -> dict:
    """Which dcpx the ranks import (PYTHONPATH decides): its directory and git revision."""
    try:
        import dcpx
    except Exception as e:  # noqa: BLE001 - reported, torch can still run
        return {"dcpx_path": f"not importable ({type(e).__name__}: {e})"}
    d = os.path.dirname(os.path.dirname(os.path.abspath(dcpx.__file__)))
    git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                         text=True, cwd=d).stdout.strip()
    return {"dcpx_path": d, "dcpx_git": git or "?"}


def _load_avg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--count", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layouts", default="replicated,sharded")
    ap.add_argument("--impls", default="dcpx,torch")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--quick", action="store_true", help="2000 tensors, 2 ranks, 1 repeat")
    ap.add_argument("--compare", metavar="OLD.json",
                    help="a result of this script for another dcpx tree (run with PYTHONPATH on "
                         "it): adds old vs new dcpx coordination per save to the report")
    args = ap.parse_args()
    if args.quick:
        args.ranks, args.count, args.repeat = "2", 2000, 1
    root = args.dir or tempfile.mkdtemp(prefix="dcpx-bench-dist-ckpt-")
    results = []
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load_before = _load_avg()
    for layout in args.layouts.split(","):
        for ws in map(int, args.ranks.split(",")):
            for impl in args.impls.split(","):
                r = run_config(impl, layout, ws, args.count, args.repeat, root)
                m = r["median"]
                print(f"{layout:10s} ranks={ws} {impl:5s} total {m['total']:7.3f} s  "
                      f"write {m['write']:7.3f} s  coordination {m['coordination']:7.3f} s  "
                      f"cpu (all ranks) {m['cpu']:7.3f} s",
                      flush=True)
                results.append(r)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    env = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} " if "PYTHONPATH" in os.environ else ""
    report = {
        "command": env + shlex.join(["python3", *sys.argv]),
        "started": started,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "platform": platform.platform(),
                    "loadavg_before": load_before, "loadavg_after": _load_avg(),
                    **_dcpx_source()},
        "results": results,
    }
    md = _markdown(report)
    if args.compare:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import compare
        with open(args.compare) as f:
            old = json.load(f)
        report["compare"], cmp_md = compare.compare(old, report)
        report["compare"]["old"] = args.compare
        md += "\n" + cmp_md
    print(md)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(report, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(md)


def _markdown(report: dict) -> str:
    lines = [f"# Coordination cost per save: dcpx vs torch DCP", "",
             f"Command: `{report['command']}`  ",
             f"Started {report['started']}; machine: {report['machine']}", "",
             "Medians over the measured saves (the first save of each run is a warm-up and "
             "is not counted). coordination = total - write; see the script's docstring.", "",
             "| layout | ranks | tensors/rank | dcpx total | dcpx coord. | torch total "
             "| torch coord. | coord. ratio (torch/dcpx) | total ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    unmeasured = sorted({f"{r['impl']} {r['layout']} {r['ranks']}" for r in report["results"]
                         if r["median"]["write"] == 0})
    if unmeasured:
        lines[-2:-2] = [f"**write not measured (0 s) for: {', '.join(unmeasured)}: their "
                        "coordination is the whole save.**", ""]
    by = {(r["layout"], r["ranks"], r["impl"]): r for r in report["results"]}
    for (layout, ws, impl), r in by.items():
        if impl != "dcpx":
            continue
        t = by.get((layout, ws, "torch"))
        d = r["median"]
        if t is None:
            lines.append(f"| {layout} | {ws} | {r['count']} | {d['total']:.3f} s | "
                         f"{d['coordination']:.3f} s | n/a | n/a | n/a | n/a |")
            continue
        tm = t["median"]
        lines.append(
            f"| {layout} | {ws} | {r['count']} | {d['total']:.3f} s | {d['coordination']:.3f} s | "
            f"{tm['total']:.3f} s | {tm['coordination']:.3f} s | "
            f"{tm['coordination'] / max(d['coordination'], 1e-9):.1f}x | "
            f"{tm['total'] / max(d['total'], 1e-9):.1f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
