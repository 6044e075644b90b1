#!/usr/bin/env python3
"""Save and load of a SAFETENSORS-format DCP checkpoint (~500 MB), dcpx
against torch, in one process, alternating, page cache warm.

    python3 benchmarks/bench_safetensors.py [--mb 512] [--tensors 64] [--rounds 3]
                                            [--out benchmarks/results/safetensors_local.md]

save: ``FileSystemWriter(dir, serialization_format=SAFETENSORS)`` (sync_files
True for both), torch's ``dcp.save`` vs ``dcpx.save``.
load: torch 2.13's FileSystemReader cannot load this format (it
``torch.load``s each extent), so the torch row is what its HF reader does
(``HuggingFaceStorageReader``: ``safetensors.safe_open``, then
``target.copy_``) over the same data file (tensors only, so the blob starts
it); dcpx's is ``dcpx.load`` of the checkpoint.  Each figure is the best of
``--rounds``; every load is checked bit-exact."""
import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.filesystem import SerializationFormat

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import dcpx  # noqa: E402

SF = SerializationFormat.SAFETENSORS


def make(mb: int, n: int) -> dict:
    per = mb * (1 << 20) // n // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def torch_save(sd, d):
    tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(d, serialization_format=SF), no_dist=True)


def dcpx_save(sd, d):
    dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(d, serialization_format=SF))


def torch_load(out, d):
    from safetensors import safe_open
    (name,) = [f for f in os.listdir(d) if f.endswith(".distcp")]
    with safe_open(os.path.join(d, name), framework="pt") as f:
        for k, t in out.items():
            t.copy_(f.get_slice(k)[:])


def dcpx_load(out, d):
    dcpx.load(out, checkpoint_id=d)


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    sd = make(a.mb, a.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    best = {k: float("inf") for k in ("torch save", "dcpx save", "torch load", "dcpx load")}
    work = tempfile.mkdtemp(prefix="bench-st-", dir=os.environ.get("BENCH_DIR"))
    try:
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        for r in range(a.rounds):
            for who, save in (("torch", torch_save), ("dcpx", dcpx_save))[::1 if r % 2 else -1]:
                d = os.path.join(work, f"{who}{r}")
                best[f"{who} save"] = min(best[f"{who} save"], timed(save, sd, d))
            # both loads read the same (torch-written) checkpoint
            d = os.path.join(work, f"torch{r}")
            for who, load in (("torch", torch_load), ("dcpx", dcpx_load))[::1 if r % 2 else -1]:
                for t in out.values():
                    t.zero_()
                best[f"{who} load"] = min(best[f"{who} load"], timed(load, out, d))
                assert all(torch.equal(out[k], sd[k]) for k in sd), who
            for who in ("torch", "dcpx"):
                shutil.rmtree(os.path.join(work, f"{who}{r}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cmd = "python3 benchmarks/bench_safetensors.py " + " ".join(sys.argv[1:])
    lines = [f"# SAFETENSORS-format DCP checkpoint, {nbytes / 1e6:.0f} MB in {a.tensors} "
             f"float32 tensors", "",
             f"`{cmd}` (torch {torch.__version__}, {os.cpu_count()} CPUs, best of {a.rounds}, "
             f"page cache warm, sync_files on)", "",
             "| | seconds | GB/s |", "| --- | --- | --- |"]
    for k, v in best.items():
        lines.append(f"| {k} | {v:.3f} | {nbytes / v / 1e9:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
