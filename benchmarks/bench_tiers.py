"""What the node-local tier costs and saves (issues 19 and 29; docs/tiers.md).

``--world`` ranks (gloo, one process each) stand in for nodes of
``--per-node`` ranks (default: 4 ranks as 2 nodes; ``--world 2 --per-node
1``: 2 ranks as 2 nodes); each rank holds ``--mib`` MiB of fp32 tensors
(``--count`` of them, half the bytes its own, half a replicated part every
rank holds, as data-parallel weights are).  Two managers save the same
steps, one after the other:

* ``tiered``: ``CheckpointManager(root, local_root=<node's folder>,
  replicas=1, persist_interval_steps=P)``, a save every step;
* ``direct``: ``CheckpointManager(root)`` saving every step straight to
  ``root`` (async).

Both are measured alike (issue 29, item 8): a step is a barrier of all
ranks (the training's collectives), then ``save()`` and the wait for its
staging (the training may not change its tensors before) -- that is the
time the training thread is blocked -- then ``--step-s`` seconds of
"training" (a sleep: on a GPU node the host cores are idle meanwhile).
Neither manager is waited for anywhere else until ``close()`` after the
last step (its time is reported apart).  The direct save's commit time is
taken by a callback on its upload future; the tiered one's stages from
``tier_timings``.  Per save: medians over the saves after the first, of
the slowest rank.  Per resume (tiered): from the local tier, from a
partner's replica (node 1's local folder deleted), and from the persistent
tier (both deleted).  The machine's limits, in the same run: memcpy of a
rank's bytes, a sequential write + fsync of them to root's file system and
to the local tier's, a read, a gloo send to the partner (all ranks at
once), the cores and the load average at the start and the end.

The local tier defaults to a folder under /dev/shm (node memory, as in
production: docs/tiers.md), root to a folder on the disk
(``--root-dir``); here all ranks share this machine's cores and memory bus,
so the "network" is loopback TCP, not a NIC.

Usage::

    PYTHONPATH=$PWD python3 benchmarks/bench_tiers.py --out benchmarks/results/tiers_4r_256m
    PYTHONPATH=$PWD python3 benchmarks/bench_tiers.py --world 2 --per-node 1 --mib 64
    PYTHONPATH=$PWD python3 benchmarks/bench_tiers.py --quick
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _state(rank: int, mib: float, count: int, step: int) -> dict:
    n = max(1, int(mib * (1 << 20) / 4 / count))
    sd = {}
    for i in range(count):
        owner = "shared" if i % 2 == 0 else f"rank{rank}"
        sd[f"{owner}.t{i}"] = torch.full((n,), float(step * 1000 + i))
    return sd


def _limits(local: str, root: str, nbytes: int) -> dict:
    """memcpy, write + fsync (root's and local's file systems), read."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = []
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        t.append(time.perf_counter() - t0)
    out = {"memcpy_s": min(t)}
    data = src.numpy().tobytes()
    for name, d in (("write_root_s", root), ("write_local_s", local)):
        os.makedirs(d, exist_ok=True)
        p = os.path.join(d, "limit.bin")
        best = None
        for _ in range(2):
            t0 = time.perf_counter()
            with open(p, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        out[name] = best
        t0 = time.perf_counter()
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
        out[name.replace("write", "read")] = time.perf_counter() - t0
        os.unlink(p)
    return out


def _rank(rank: int, work: str, mode: str, args: dict, out: str) -> None:
    import torch.distributed as dist
    sys.path.insert(0, args["repo"])
    import dcpx
    world, per_node = args["world"], args["per_node"]
    dist.init_process_group("gloo", init_method=f"file://{work}/pg-{mode}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    node = rank // per_node
    local = os.path.join(args["local_dir"], f"node{node}")
    root = os.path.join(args["root_dir"], mode)
    res: dict = {"rank": rank}
    if mode in ("tiered", "direct"):
        kw = {}
        if mode == "tiered":
            kw = dict(local_root=local, node=f"node{node}", replicas=1,
                      persist_interval_steps=args["persist"], keep_local_k=2)
            # the "network" limit here: one rank's bytes to its partner, all at once
            buf = torch.ones(int(args["mib"] * (1 << 20)) // 4)
            got = torch.empty_like(buf)
            partner = (rank + per_node) % world
            best = None
            for _ in range(2):
                dist.barrier()
                t0 = time.monotonic()
                w = dist.isend(buf, partner)
                dist.recv(got, partner)
                w.wait()
                dist.barrier()
                dt = time.monotonic() - t0
                best = dt if best is None else min(best, dt)
            res["p2p_s"] = best
            del buf, got
        m = dcpx.CheckpointManager(root, keep_latest_k=2, **kw)
        saves: list = []
        for step in range(1, args["steps"] + 1):
            sd = _state(rank, args["mib"], args["count"], step)
            dist.barrier()  # the training's collectives: the ranks start each step together
            t0 = time.monotonic()
            r = m.save(step, sd)
            staged = getattr(r, "staging_completion", None)
            if staged is not None:
                staged.result()  # the tensors may change only after staging
            row = {"step": step, "blocked_s": time.monotonic() - t0}
            if mode == "direct":
                upload = getattr(r, "upload_completion", r)
                upload.add_done_callback(
                    lambda f, row=row, t0=t0: row.__setitem__("committed_s", time.monotonic() - t0))
            saves.append(row)
            time.sleep(args["step_s"])  # training between saves
        t0 = time.monotonic()
        m.close()
        res["close_s"] = time.monotonic() - t0
        if mode == "tiered":
            saves = []
            for step, t in sorted(m.tier_timings.items()):
                saves.append({"step": step, **{k: v for k, v in t.items()
                                               if isinstance(v, (int, float, str))}})
        res["saves"] = saves
        res["piece_bytes"] = m._tiers.last_piece_bytes if mode == "tiered" else None
    else:  # resume-{local,replica,persistent}
        m = dcpx.CheckpointManager(os.path.join(args["root_dir"], "tiered"), local_root=local,
                                   node=f"node{node}", replicas=1,
                                   persist_interval_steps=args["persist"])
        sd = _state(rank, args["mib"], args["count"], 0)
        dist.barrier()
        t0 = time.monotonic()
        step = m.load(sd)
        res["load_s"] = time.monotonic() - t0
        res["step"] = step
        res["tier"] = (m.last_resume or {}).get("tier")
        want = _state(rank, args["mib"], args["count"], step)
        res["exact"] = all(torch.equal(sd[k], want[k]) for k in want)
        m.close()
    with open(os.path.join(out, f"{mode}.{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _spawn(work: str, mode: str, args: dict) -> list:
    out = os.path.join(work, "out")
    os.makedirs(out, exist_ok=True)
    mp.start_processes(_rank, args=(work, mode, args, out), nprocs=args["world"],
                       start_method="spawn")
    got = []
    for r in range(args["world"]):
        with open(os.path.join(out, f"{mode}.{r}.json")) as f:
            got.append(json.load(f))
    return got


def _slowest(per_rank: list, key: str) -> list:
    """Per step, the slowest rank's value of ``key`` (saves after the first)."""
    steps: dict = {}
    for r in per_rank:
        for s in r["saves"]:
            if key in s:
                steps.setdefault(s["step"], []).append(s[key])
    return [max(v) for k, v in sorted(steps.items()) if k > 1 and len(v) == len(per_rank)]


def _med(xs: list):
    return statistics.median(xs) if xs else None


def _count(per_rank: list, key: str, prefix: str) -> int:
    """Saves (after the first) whose ``key`` starts with ``prefix`` on rank 0."""
    return sum(1 for row in per_rank[0]["saves"]
               if row["step"] > 1 and str(row.get(key, "")).startswith(prefix))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=256.0, help="MiB per rank (default 256)")
    ap.add_argument("--count", type=int, default=64, help="tensors per rank")
    ap.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--per-node", type=int, default=2, help="ranks per node (default 2)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--persist", type=int, default=4, help="persist_interval_steps")
    ap.add_argument("--step-s", type=float, default=1.0, help="seconds of 'training' between saves")
    ap.add_argument("--local-dir", default=None, help="default: a folder under /dev/shm")
    ap.add_argument("--root-dir", default=None, help="default: a folder under the working dir")
    ap.add_argument("--label", default="", help="what code is measured (shown with the result)")
    ap.add_argument("--quick", action="store_true", help="32 MiB per rank, 6 steps")
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    a = ap.parse_args()
    if a.quick:
        a.mib, a.steps, a.step_s = 32.0, 6, 0.3
    if a.world % a.per_node or a.world // a.per_node < 2:
        ap.error("--world must be a multiple of --per-node, with at least 2 nodes")
    load_start = os.getloadavg()
    work = tempfile.mkdtemp(prefix="dcpx-bench-tiers-", dir=os.getcwd())
    local_dir = a.local_dir or tempfile.mkdtemp(prefix="dcpx-bench-tiers-",
                                                dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    root_dir = a.root_dir or os.path.join(work, "root")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = {"mib": a.mib, "count": a.count, "steps": a.steps, "persist": a.persist,
            "step_s": a.step_s, "local_dir": local_dir, "root_dir": root_dir, "repo": repo,
            "world": a.world, "per_node": a.per_node}
    try:
        nbytes = int(a.mib * (1 << 20))
        limits = _limits(os.path.join(local_dir, "limits"), os.path.join(root_dir, "limits"),
                         nbytes)
        direct = _spawn(work, "direct", args)
        tiered = _spawn(work, "tiered", args)
        resumes = {}
        resumes["local"] = _spawn(work, "resume-local", args)
        shutil.rmtree(os.path.join(local_dir, "node1"))
        resumes["replica"] = _spawn(work, "resume-replica", args)
        for node in range(a.world // a.per_node):
            shutil.rmtree(os.path.join(local_dir, f"node{node}"), ignore_errors=True)
        resumes["persistent"] = _spawn(work, "resume-persistent", args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if a.local_dir is None:
            shutil.rmtree(local_dir, ignore_errors=True)
    rows = {
        "direct": {"blocked_s": _med(_slowest(direct, "blocked_s")),
                   "committed_s": _med(_slowest(direct, "committed_s")),
                   "close_s": max(r["close_s"] for r in direct)},
        "tiered": {k: _med(_slowest(tiered, k))
                   for k in ("blocked_s", "waited_s", "local_s", "replicated_s", "persisted_s")},
    }
    t = rows["tiered"]
    t["close_s"] = max(r["close_s"] for r in tiered)
    t["saves"] = a.steps - 1
    t["replicated"] = len(_slowest(tiered, "replicated_s"))
    t["replication_skipped"] = _count(tiered, "replication", "skipped")
    t["persists_due"] = sum(1 for s in range(2, a.steps + 1) if s % a.persist == 0)
    t["persisted"] = len(_slowest(tiered, "persisted_s"))
    res = {k: {"load_s": max(r["load_s"] for r in v), "step": v[0]["step"],
               "tier": v[0]["tier"], "exact": all(r["exact"] for r in v)}
           for k, v in resumes.items()}
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo,
                             capture_output=True, text=True).stdout.strip() or "?"
    except OSError:
        git = "?"
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "git": git, "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "argv": " ".join(sys.argv[1:]), "loadavg_start": load_start,
            "loadavg": os.getloadavg(), "label": a.label,
            "piece_bytes": tiered[0]["piece_bytes"], **args}
    limits["p2p_s"] = max(r["p2p_s"] for r in tiered)
    result = {"meta": meta, "limits": limits, "saves": rows, "resumes": res}
    text = _markdown(result)
    print(text)
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(a.out + ".md", "w") as f:
            f.write(text)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _markdown(r: dict) -> str:
    m, lim, s, res = r["meta"], r["limits"], r["saves"], r["resumes"]
    mib, d, t = m["mib"], s["direct"], s["tiered"]
    nodes = m["world"] // m["per_node"]
    la = lambda x: "(" + ", ".join(f"{v:.2f}" for v in x) + ")"  # noqa: E731
    L = ["# The node-local tier: cost per save and per resume", "",
         f"Command: `PYTHONPATH=$PWD python3 benchmarks/bench_tiers.py {m['argv']}`".rstrip() + "  ",
         f"Run {m['date']} at {m['git']}{' (' + m['label'] + ')' if m['label'] else ''}; "
         f"{m['cpus']} cores, Python {m['python']}, torch {m['torch']}; load average (1, 5, 15 "
         f"min) at the start {la(m['loadavg_start'])}, at the end {la(m['loadavg'])}.", "",
         f"{m['world']} ranks as {nodes} nodes x {m['per_node']} rank(s) (gloo), {mib:g} MiB per "
         f"rank in {m['count']} fp32 tensors (half of them the same on every rank), a save "
         f"every step ({m['steps']} steps, {m['step_s']:g} s of 'training' between saves), "
         f"replicas=1, persist_interval_steps={m['persist']}. Local tier: `{m['local_dir']}` "
         f"(tmpfs, node memory); root: `{m['root_dir']}` (disk). Both managers measured alike: "
         f"blocked = save() plus the wait for its staging, nothing waited for outside it until "
         f"close(). Medians over saves 2..N of the slowest rank; seconds from the save() call.",
         "",
         "Machine limits, same run, one rank's bytes "
         f"({mib:g} MiB): memcpy {lim['memcpy_s']:.3f} s, write + fsync to root's disk "
         f"{lim['write_root_s']:.3f} s (read back {lim['read_root_s']:.3f} s), to the local "
         f"tier {lim['write_local_s']:.3f} s; gloo send to the partner rank, all ranks at "
         f"once (this machine's 'network': loopback TCP) {lim['p2p_s']:.3f} s.", "",
         "| per save | direct to root, every step | tiered | tiered / direct |",
         "| --- | --- | --- | --- |",
         f"| training thread blocked | {_fmt(d['blocked_s'])} | {_fmt(t['blocked_s'])} | "
         f"{_ratio(t['blocked_s'], d['blocked_s'])} |",
         f"| of which waiting for the previous save | | {_fmt(t['waited_s'])} | |",
         f"| step durable (direct: committed under root; tiered: local piece committed) | "
         f"{_fmt(d['committed_s'])} | {_fmt(t['local_s'])} | "
         f"{_ratio(t['local_s'], d['committed_s'])} |",
         f"| step survives the loss of a node (direct: committed; tiered: replicated) | "
         f"{_fmt(d['committed_s'])} | {_fmt(t['replicated_s'])} | "
         f"{_ratio(t['replicated_s'], d['committed_s'])} |",
         f"| step persistent under root (tiered: every {m['persist']} steps) | "
         f"{_fmt(d['committed_s'])} | {_fmt(t['persisted_s'])} | |",
         f"| close() after the last save | {_fmt(d['close_s'])} | {_fmt(t['close_s'])} | |", "",
         f"Tiered: {t['replicated']} of {t['saves']} saves replicated, "
         f"{t['replication_skipped']} skipped because replication was behind (the next one "
         f"replicated instead); {t['persisted']} of {t['persists_due']} persistences due done.",
         ""]
    if t["local_s"] and t["replicated_s"]:
        L.append(f"Against the machine: tiered local durability / the local tier's write+fsync "
                 f"= {t['local_s'] / lim['write_local_s']:.2f}x; direct commit / root's "
                 f"write+fsync = {_ratio(d['committed_s'], lim['write_root_s'])}; tiered "
                 f"replication (replicated - local) / the gloo send = "
                 f"{(t['replicated_s'] - t['local_s']) / lim['p2p_s']:.2f}x.")
        L.append("")
    L += [f"| resume (all {m['world']} ranks, slowest) | step | tier | seconds | / local | "
          f"bit-exact |", "| --- | --- | --- | --- | --- | --- |"]
    for k, v in res.items():
        L.append(f"| {k} | {v['step']} | {v['tier']} | {v['load_s']:.3f} s | "
                 f"{_ratio(v['load_s'], res['local']['load_s'])} | "
                 f"{'yes' if v['exact'] else 'NO'} |")
    L.append("")
    return "\n".join(L)


if __name__ == "__main__":
    main()
