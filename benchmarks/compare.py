#!/usr/bin/env python3
"""Set two runs of the same benchmark side by side: OLD (today's tree) and NEW (the change).

    python3 benchmarks/compare.py OLD.json NEW.json [--out PREFIX]

Works on the JSON of bench_io.py, bench_async.py and bench_dist.py (the kind is recognised from
the file). Run the same (new) script twice in one session, once with PYTHONPATH on the old tree
and once on the new, so only dcpx differs; see benchmarks/README.md, "Issue 12 results".

* bench_io.py: per case, dcpx save / write limit and load / read limit (throughput, each run
  against its own limits) and the us per tensor over the limit.
* bench_async.py: per case and dcpx configuration, staging / memcpy and upload / write limit.
* bench_dist.py: per layout and rank count, dcpx's coordination seconds per save, old and new;
  issue 12's target is new <= 0.5x old.

"No regression beyond noise" (the large-tensor rows): a ratio counts as a regression only when
the new one is worse than the old by more than --tolerance (default 10 %) both from the medians
and from the best repeats (each run's fastest dcpx time against its fastest limit), so that one
slow repeat on either side decides nothing. The spread of the repeats (max / min - 1 of the
times that make up the ratio, both runs) is shown next to it.
Prints Markdown; --out writes PREFIX.md and PREFIX.json too.
"""
import argparse
import json
import sys


def _spread(times):
    times = [t for t in times if t > 0]
    return max(times) / min(times) - 1 if len(times) > 1 else 0.0


def _table(header, rows):
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


TOLERANCE = 0.10


def _worse(old, new, higher_is_better):
    return new < old / (1 + TOLERANCE) if higher_is_better else new > old * (1 + TOLERANCE)


def _verdict(old, new, old_best, new_best, higher_is_better):
    if _worse(old, new, higher_is_better) and _worse(old_best, new_best, higher_is_better):
        return f"REGRESSION (> {TOLERANCE:.0%} on medians and best)"
    return "no regression"


def kind(data):
    res = data.get("results")
    if isinstance(res, dict):
        return "io"
    if res and "configs" in res[0]:
        return "async"
    if res and "impl" in res[0]:
        return "dist"
    raise ValueError("not a bench_io / bench_async / bench_dist result file")


def compare_io(old, new):
    rows, out = [], []
    for case in new["results"]:
        if case not in old["results"]:
            continue
        o_ops, n_ops = old["results"][case]["ops"], new["results"][case]["ops"]
        for op, limit in (("save", "limit write+fsync"), ("load", "limit read")):
            key = f"dcpx {op}"
            if key not in o_ops or key not in n_ops:
                continue
            ratio = {w: ops[limit]["median_s"] / ops[key]["median_s"] for w, ops in
                     (("old", o_ops), ("new", n_ops))}
            best = {w: ops[limit]["min_s"] / ops[key]["min_s"] for w, ops in
                    (("old", o_ops), ("new", n_ops))}
            noise = max(_spread(ops[k]["times_s"]) for ops in (o_ops, n_ops) for k in (key, limit))
            n_tensors = new["results"][case]["n_tensors"]
            us = {w: (ops[key]["median_s"] - ops[limit]["median_s"]) / n_tensors * 1e6
                  for w, ops in (("old", o_ops), ("new", n_ops))}
            rows.append({"case": case, "op": f"dcpx {op} / {limit.split()[1]} limit",
                         "old": ratio["old"], "new": ratio["new"], "noise": noise,
                         "old_s": o_ops[key]["median_s"], "new_s": n_ops[key]["median_s"],
                         "old_us_per_tensor": us["old"], "new_us_per_tensor": us["new"],
                         "old_best": best["old"], "new_best": best["new"],
                         "verdict": _verdict(ratio["old"], ratio["new"], best["old"],
                                             best["new"], True)})
    out += _table(["case", "ratio (throughput)", "old", "new", "old best", "new best",
                   "spread of repeats", "old s", "new s", "old us/tensor", "new us/tensor",
                   "large tensors: issue 12"],
                  [(r["case"], r["op"], f"{r['old']:.3g}x", f"{r['new']:.3g}x",
                    f"{r['old_best']:.3g}x", f"{r['new_best']:.3g}x",
                    f"{r['noise'] * 100:.0f}%", f"{r['old_s']:.3f}", f"{r['new_s']:.3f}",
                    *(("", "") if r["case"] == "large" else  # per-byte bound there, not per tensor
                      (f"{r['old_us_per_tensor']:.2f}", f"{r['new_us_per_tensor']:.2f}")),
                    r["verdict"] if r["case"] == "large" else "")
                   for r in rows])
    peak = []
    for case in new["results"]:
        o_p = old["results"].get(case, {}).get("peak_extra_rss") or {}
        n_p = new["results"][case].get("peak_extra_rss") or {}
        peak += [{"case": case, "op": op, "old_mib": o_p[op]["extra_bytes"] / 2**20,
                  "new_mib": n_p[op]["extra_bytes"] / 2**20} for op in n_p if op in o_p]
    if peak:
        out += ["", "Peak extra memory (RSS high-water mark above the state dict, fresh process "
                "per library and operation):", ""]
        out += _table(["case", "operation", "old MiB", "new MiB"],
                      [(p["case"], p["op"], f"{p['old_mib']:.1f}", f"{p['new_mib']:.1f}")
                       for p in peak])
        rows = rows + [{"peak": p} for p in peak]
    return rows, out


def compare_async(old, new):
    rows = []
    o_by = {(r["case"], c["name"]): (r, c) for r in old["results"] for c in r["configs"]}
    for r in new["results"]:
        for c in r["configs"]:
            if not c["name"].startswith("dcpx") or (r["case"], c["name"]) not in o_by:
                continue
            ro, co = o_by[(r["case"], c["name"])]
            for metric, times_key, base_key, higher in (
                    ("staging / memcpy", "staging_s", "memcpy (libc, one flat buffer)", False),
                    ("upload / write limit", "upload_s", "write + fsync (64 MiB os.write)", True)):
                key = "staging_vs_memcpy" if not higher else "upload_vs_write_limit"
                noise = max(_spread([s[times_key] for s in x["saves"][1:]] or [1])
                            for x in (c, co))
                noise = max(noise, *(_spread(x["baselines"][base_key]) for x in (r, ro)))
                bests = [_best_ratio(x, rx, times_key, base_key) for x, rx in ((co, ro), (c, r))]
                rows.append({"case": r["case"], "config": c["name"], "metric": metric,
                             "old": co[key], "new": c[key], "old_best": bests[0],
                             "new_best": bests[1], "noise": noise,
                             "verdict": _verdict(co[key], c[key], *bests, higher)})
    out = _table(["case", "config", "ratio", "old", "new", "old best", "new best",
                  "spread of repeats", "large tensors: issue 12"],
                 [(r["case"], r["config"], r["metric"], f"{r['old']:.2f}x", f"{r['new']:.2f}x",
                   f"{r['old_best']:.2f}x", f"{r['new_best']:.2f}x",
                   f"{r['noise'] * 100:.0f}%", r["verdict"] if r["case"].startswith("a") else "")
                  for r in rows])
    return rows, out


def _best_ratio(c, r, times_key, base_key):
    """bench_async's ratio from the best repeats: fastest save 2..N against the fastest baseline
    (staging: seconds / memcpy seconds; upload: write seconds / (upload - staging) seconds)."""
    saves, base = c["saves"][1:] or c["saves"], min(r["baselines"][base_key])
    if times_key == "staging_s":
        return min(s["staging_s"] for s in saves) / base
    return base / min(s["upload_s"] - s["staging_s"] for s in saves)


def compare_dist(old, new):
    o_by = {(r["layout"], r["ranks"], r["impl"]): r for r in old["results"]}
    rows = []
    for r in new["results"]:
        o = o_by.get((r["layout"], r["ranks"], r["impl"]))
        if o is None or r["impl"] != "dcpx":
            continue
        oc, nc = o["median"]["coordination"], r["median"]["coordination"]
        rows.append({"layout": r["layout"], "ranks": r["ranks"], "count": r["count"],
                     "old_total": o["median"]["total"], "new_total": r["median"]["total"],
                     "old_write": o["median"]["write"], "new_write": r["median"]["write"],
                     "old_coordination": oc, "new_coordination": nc, "new_vs_old": nc / oc,
                     "met": nc / oc <= 0.5})
    out = _table(["layout", "ranks", "tensors/rank", "old total s", "new total s", "old write s",
                  "new write s", "old coord. s", "new coord. s", "new / old coord.",
                  "target <= 0.5x"],
                 [(r["layout"], r["ranks"], r["count"], f"{r['old_total']:.3f}",
                   f"{r['new_total']:.3f}", f"{r['old_write']:.3f}", f"{r['new_write']:.3f}",
                   f"{r['old_coordination']:.3f}", f"{r['new_coordination']:.3f}",
                   f"{r['new_vs_old']:.2f}x", "MET" if r["met"] else "NOT MET") for r in rows])
    return rows, out


def _command(data):
    return data.get("meta", {}).get("command") or data.get("command", "?")


def _source(data):
    m = data.get("meta", data.get("machine", {}))
    return ", ".join(f"{k} {m[k]}" for k in ("dcpx_path", "dcpx_git", "git", "date")
                     if m.get(k)) or "?"


def compare(old, new):
    k = kind(new)
    if kind(old) != k:
        raise ValueError(f"OLD is a {kind(old)} result, NEW a {k} result")
    rows, table = {"io": compare_io, "async": compare_async, "dist": compare_dist}[k](old, new)
    md = [f"## Old vs new ({k}): same script, same session", "",
          f"* old: `{_command(old)}` ({_source(old)})",
          f"* new: `{_command(new)}` ({_source(new)})", ""] + table
    return {"kind": k, "rows": rows}, "\n".join(md) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--out", help="also write PREFIX.md and PREFIX.json")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help="large tensors: relative worsening tolerated as noise (default 0.10)")
    a = p.parse_args(argv)
    globals()["TOLERANCE"] = a.tolerance
    with open(a.old) as f:
        old = json.load(f)
    with open(a.new) as f:
        new = json.load(f)
    data, md = compare(old, new)
    print(md)
    if a.out:
        with open(a.out + ".md", "w") as f:
            f.write(md)
        with open(a.out + ".json", "w") as f:
            json.dump({"old": a.old, "new": a.new, **data}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
