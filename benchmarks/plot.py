"""Plot the committed benchmark results: dcpx against torch DCP and against the machine's limits.

    PYTHONPATH=$PWD python3 benchmarks/plot.py                    # benchmarks/results/ -> docs/img/
    PYTHONPATH=$PWD python3 benchmarks/plot.py --results DIR --out DIR

Reads what the benchmark scripts wrote (nothing is re-measured here):

* ``io_local.json`` (bench_io.py)        -> ``io_throughput.png``: save / load GB/s of torch DCP, dcpx and the
  machine's limits (sequential write+fsync, read), each bar labelled with its ratio to the limit.
* ``async_local.json`` (bench_async.py)  -> ``async_save.png``: how long the training thread is blocked, and when
  the checkpoint is staged and on disk, per stager, against one memcpy and one write+fsync of the same bytes.
* ``dist_local.json`` (bench_dist.py)    -> ``dist_coordination.png``: seconds per save with 2/4/8 ranks.
* ``cast_local.md`` (bench_cast.py writes no JSON; its markdown table is parsed) -> ``cast_load.png``.

A missing input file skips its figure (with a line on stderr); a figure's machine line comes from the
result file's own metadata. Needs matplotlib.
"""

import argparse
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

DCPX_COLOR = "#1f77b4"
TORCH_COLOR = "#ff7f0e"
LIMIT_COLOR = "#7f7f7f"


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _load_json(path):
    with open(path) as f:
        return json.load(f)


def ratio_label(r):
    """A ratio as a label that never reads 0.00x: two decimals, or two
    significant digits below 0.1 (0.0019x)."""
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def _short_date(s):
    return str(s)[:10]


def machine_line(meta):
    """One line naming the machine from a bench_io / bench_async ``meta`` dict."""
    parts = []
    if meta.get("cores"):
        parts.append(f"{meta['cores']}-core {meta.get('cpu', 'CPU')}")
    ram = meta.get("ram") or (f"{meta['ram_gib']} GiB" if meta.get("ram_gib") else None)
    if ram:
        parts.append(f"{ram} RAM")
    if meta.get("fs_type"):
        parts.append(f"{meta['fs_type']} on {meta.get('fs_device', '?')}")
    if meta.get("torch"):
        parts.append(f"torch {meta['torch']}")
    if meta.get("date"):
        parts.append(_short_date(meta["date"]))
    return ", ".join(parts)


def _gib(nbytes):
    return nbytes / 2**30


def _case_label(n_tensors, nbytes):
    mib = nbytes / 2**20
    size = f"{_gib(nbytes):.0f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"
    return f"{n_tensors:,} tensors, {size}"


def _read_mode(meta):
    mode = meta.get("read_mode", "")
    if mode.startswith("warm"):
        return "loads from the page cache (not dropped)"
    if mode.startswith("cold"):
        return "cold loads (page cache dropped)"
    return mode


def plot_io(path, out_dir):
    plt = _plt()
    data = _load_json(path)
    meta, results = data["meta"], data["results"]
    cases = [c for c in ("large", "small") if c in results]
    fig, axes = plt.subplots(1, len(cases), figsize=(6.2 * len(cases), 4.8), squeeze=False)
    for ax, case in zip(axes[0], cases):
        r = results[case]
        ops = r["ops"]
        groups = [("save", "limit write+fsync", "write+fsync limit"), ("load", "limit read", "read limit")]
        width = 0.26
        for gi, (op, limit_key, limit_name) in enumerate(groups):
            limit = ops[limit_key]["gbps_median"]
            bars = [("torch DCP", ops.get(f"torch {op}"), TORCH_COLOR),
                    ("dcpx", ops.get(f"dcpx {op}"), DCPX_COLOR),
                    (limit_name, ops[limit_key], LIMIT_COLOR)]
            for bi, (name, o, color) in enumerate(bars):
                if not o:
                    continue
                v = o["gbps_median"]
                x = gi + (bi - 1) * width
                ax.bar(x, v, width, color=color, label=name if gi == 0 or bi == 2 else None,
                       hatch="//" if bi == 2 else None, edgecolor="white" if bi != 2 else "black")
                text = f"{v:.2f}" if bi == 2 else f"{v:.2f}\n{ratio_label(v / limit)}"
                ax.annotate(text, (x, v), ha="center", va="bottom", fontsize=8,
                            xytext=(0, 2), textcoords="offset points")
        ax.set_xticks([0, 1])
        ax.set_xticklabels(["save", "load"])
        ax.set_ylabel("GB/s (median; higher is better)")
        ax.set_title(f"({case}) {_case_label(r['n_tensors'], r['bytes'])}", fontsize=10)
        ymax = max(o["gbps_median"] for o in ops.values() if o)
        ymin = min(o["gbps_median"] for o in ops.values() if o)
        if ymax / ymin > 50:
            # many small tensors: torch's bars would be invisible on a linear axis
            ax.set_yscale("log")
            ax.set_ylim(ymin / 3, ymax * 6)
            ax.set_ylabel("GB/s (median; higher is better; log scale)")
        else:
            ax.set_ylim(0, ymax * 1.25)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("dcpx vs torch DCP vs the machine's limits: save / load throughput\n"
                 f"{machine_line(meta)}; {_read_mode(meta)}",
                 fontsize=10)
    fig.text(0.5, 0.005, "Label under each value: ratio to the limit. Source: benchmarks/results/"
             + os.path.basename(path) + " (bench_io.py)", ha="center", fontsize=7, color="#444")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out = os.path.join(out_dir, "io_throughput.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _async_short(name):
    return (name.replace("torch FileSystemWriter(cache_staged_state_dict)", "torch FileSystemWriter\n(cache_staged_state_dict)")
            .replace("dcpx async staging", "dcpx DefaultStager\n(async staging)")
            .replace("dcpx sync staging", "dcpx\n(sync staging)"))


def plot_async(path, out_dir):
    plt = _plt()
    data = _load_json(path)
    meta, results = data["meta"], data["results"]
    fig, axes = plt.subplots(len(results), 2, figsize=(12.5, 3.9 * len(results)), squeeze=False)
    for row, r in zip(axes, results):
        configs = r["configs"]
        names = [_async_short(c["name"]) for c in configs]
        colors = [DCPX_COLOR if c["name"].startswith("dcpx") else TORCH_COLOR for c in configs]
        y = list(range(len(configs)))[::-1]
        med = [c["median_2_to_n"] for c in configs]
        case = _case_label(r["tensors"], r["bytes"])

        ax = row[0]
        blocking = [m["blocking_s"] for m in med]
        ax.barh(y, blocking, color=colors)
        ax.set_xscale("log")
        for yi, v in zip(y, blocking):
            ax.annotate(f"{v * 1e3:.1f} ms", (v, yi), va="center", fontsize=8, xytext=(3, 0),
                        textcoords="offset points")
        ax.set_yticks(y)
        ax.set_yticklabels(names, fontsize=8)
        ax.set_xlabel("seconds the training thread is blocked (median of saves 2..N, log scale)")
        ax.set_title(f"({r['case']}) {case}: time async_save blocks", fontsize=10)
        ax.set_xlim(min(blocking) / 2, max(blocking) * 6)
        ax.grid(axis="x", alpha=0.3)

        ax = row[1]
        staged = [m["staging_s"] for m in med]
        uploaded = [m["upload_s"] for m in med]
        h = 0.38
        ax.barh([v + h / 2 for v in y], staged, h, color=colors, alpha=0.55, label="staged (source reusable)")
        ax.barh([v - h / 2 for v in y], uploaded, h, color=colors, label="on disk (upload_completion)")
        memcpy = r["baselines"].get("memcpy (libc, one flat buffer)")
        wlimit = r["baselines"].get("write + fsync (64 MiB os.write)")
        for vals, name, style in ((memcpy, "one memcpy", ":"), (wlimit, "one write+fsync", "--")):
            if vals:
                v = statistics.median(vals)
                ax.axvline(v, color=LIMIT_COLOR, linestyle=style, label=f"limit: {name} ({v:.2f} s)")
        for yi, s, u in zip(y, staged, uploaded):
            ax.annotate(f"{s:.2f}", (s, yi + h / 2), va="center", fontsize=7, xytext=(2, 0), textcoords="offset points")
            ax.annotate(f"{u:.2f}", (u, yi - h / 2), va="center", fontsize=7, xytext=(2, 0), textcoords="offset points")
        ax.set_yticks(y)
        ax.set_yticklabels([])
        ax.set_xlabel("seconds from the call (median of saves 2..N; lower is better)")
        ax.set_title(f"({r['case']}) {case}: staged and on disk", fontsize=10)
        ax.set_xlim(0, max(uploaded) * 1.15)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle("async_save: dcpx (blue) vs torch DCP (orange) vs one memcpy / one write+fsync of the same bytes\n"
                 + machine_line(meta), fontsize=10)
    fig.text(0.5, 0.005, "Source: benchmarks/results/" + os.path.basename(path) + " (bench_async.py)",
             ha="center", fontsize=7, color="#444")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    out = os.path.join(out_dir, "async_save.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_dist(path, out_dir):
    plt = _plt()
    data = _load_json(path)
    machine = data.get("machine", {})
    layouts = []
    for r in data["results"]:
        if r["layout"] not in layouts:
            layouts.append(r["layout"])
    fig, axes = plt.subplots(1, len(layouts), figsize=(6.2 * len(layouts), 4.6), squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        rows = [r for r in data["results"] if r["layout"] == layout]
        series = {}
        for r in rows:
            series.setdefault(r["impl"], []).append((r["ranks"], r["median"]["total"], r["median"]["coordination"]))
        for impl, color, label in (("torch", TORCH_COLOR, "torch DCP"), ("dcpx", DCPX_COLOR, "dcpx")):
            pts = sorted(series.get(impl, []))
            if not pts:
                continue
            ranks = [p[0] for p in pts]
            ax.plot(ranks, [p[1] for p in pts], "o-", color=color, label=f"{label}: whole save")
            ax.plot(ranks, [p[2] for p in pts], "s--", color=color, alpha=0.7, label=f"{label}: coordination part")
        d = {p[0]: p[1] for p in series.get("dcpx", [])}
        for rk, tot, _ in series.get("torch", []):
            if rk in d:
                ax.annotate(f"{tot / d[rk]:.1f}x", (rk, tot), ha="center", va="bottom", fontsize=8,
                            xytext=(0, 4), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ranks_all = sorted({r["ranks"] for r in rows})
        ax.set_xticks(ranks_all)
        ax.set_xticklabels([str(x) for x in ranks_all])
        ax.set_xlabel("ranks (processes, gloo)")
        ax.set_ylabel("seconds per save (median; log scale)")
        count = rows[0]["count"]
        ax.set_title(f"{layout}: {count:,} tensors per rank (label: torch / dcpx, whole save)", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    plat = machine.get("platform", "")
    fig.suptitle("Multi-rank save: dcpx vs torch DCP\n"
                 f"{machine.get('cpus', '?')} CPUs, torch {machine.get('torch', '?')}, {plat}, "
                 f"{_short_date(data.get('started', ''))}", fontsize=10)
    fig.text(0.5, 0.005, "Source: benchmarks/results/" + os.path.basename(path) + " (bench_dist.py)",
             ha="center", fontsize=7, color="#444")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out = os.path.join(out_dir, "dist_coordination.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def parse_md_tables(text):
    """Every markdown table in ``text`` as a list of dicts keyed by the header cells."""
    tables, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if line.startswith("|") and re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*\|?", nxt):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                rows.append(dict(zip(header, cells)))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def _num(s):
    m = re.search(r"[-+]?\d+(\.\d+)?", s or "")
    if not m:
        raise ValueError(f"no number in table cell {s!r}")
    return float(m.group(0))


def plot_cast(path, out_dir):
    plt = _plt()
    with open(path) as f:
        text = f.read()
    table = next((t for t in parse_md_tables(text) if t and "loader" in t[0]), None)
    if table is None:
        raise ValueError(f"{path}: no table with a 'loader' column")
    time_col = next(k for k in table[0] if k.startswith("time"))
    mem_col = next(k for k in table[0] if "RSS" in k)
    names = [r["loader"] for r in table]
    times = [_num(r[time_col]) for r in table]
    mems = [_num(r[mem_col]) for r in table]
    colors = [TORCH_COLOR if n.startswith("torch") else DCPX_COLOR for n in names]
    title = next((ln.lstrip("# ").strip() for ln in text.splitlines() if ln.startswith("# ")), "cast load")
    setting = next((ln.strip() for ln in text.splitlines() if ln.startswith("float32") or "median of" in ln), "")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, vals, label, fmt in ((axes[0], times, f"{time_col} (median)", "{:.2f}"),
                                 (axes[1], mems, mem_col, "{:.0f}")):
        ax.barh(range(len(names))[::-1], vals, color=colors)
        for yi, v in zip(range(len(names))[::-1], vals):
            ax.annotate(fmt.format(v), (v, yi), va="center", fontsize=8, xytext=(3, 0), textcoords="offset points")
        ax.set_yticks(range(len(names))[::-1])
        ax.set_yticklabels(names, fontsize=8)
        ax.set_xlabel(label)
        ax.set_xlim(0, max(vals) * 1.2)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_title("time (shared machine: not comparable, see the file)", fontsize=9)
    axes[1].set_title("peak memory above the destination (what the design bounds)", fontsize=9)
    fig.suptitle(f"{title}\n{setting}", fontsize=10)
    fig.text(0.5, 0.005, "Source: benchmarks/results/" + os.path.basename(path) + " (bench_cast.py)",
             ha="center", fontsize=7, color="#444")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out = os.path.join(out_dir, "cast_load.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


PLOTS = (("io_local.json", plot_io), ("async_local.json", plot_async),
         ("dist_local.json", plot_dist), ("cast_local.md", plot_cast))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=os.path.join(HERE, "results"), help="benchmark results folder")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "img"), help="where the PNGs go")
    args = p.parse_args(argv)
    try:
        _plt()
    except ImportError:
        print("plot.py needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    written = []
    for name, fn in PLOTS:
        src = os.path.join(args.results, name)
        if not os.path.exists(src):
            print(f"skipped: {src} does not exist", file=sys.stderr)
            continue
        out = fn(src, args.out)
        print(f"{src} -> {out}")
        written.append(out)
    if not written:
        print(f"no result files found in {args.results}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
