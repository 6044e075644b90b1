"""Many threads through dcpx at once: the driver scripts/tsan.sh runs under
ThreadSanitizer (3 workers x 6 rounds), also run small by
tests/test_thread_stress.py.  It pins nothing but "no race, same bytes":
behaviour is pinned by tests/test_async.py and tests/test_staging.py.

Every worker thread, for each round, on its own directory:

* ``dcpx.save`` with 3 C writer threads and a file per item (so the writer
  threads really share the job), of a state dict with a 6 MiB tensor
  (streamed in 4 MiB chunks), a transposed (gathered) one, small ones and
  plain values;
* ``dcpx.async_save`` (THREAD) with its own long-lived ``DefaultStager``,
  background staging on even rounds, then changes its tensors while the
  upload runs (training goes on);
* ``dcpx.load`` with 3 C reader threads of both checkpoints, compared bit
  for bit with the values of the calls;
* ``dcpx._C.copy_into`` with 3 copy threads, and a ``WriteJob`` cancelled
  mid-write and one dropped while its threads run (dealloc cancels and
  joins).

All workers run at the same time, so the C threads of several saves, loads
and copies overlap, and the one ``dcpx-upload`` thread serves them all.

    python tests/thread_stress.py [--workers 3] [--rounds 4] [--dir DIR]

Exit status 0 and "thread_stress: ok" when every load was bit-exact.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import torch

import dcpx
from dcpx import _C

TIMEOUT = 300  # seconds: a hang is a failure, even under a sanitizer


def _state(w: int, r: int) -> dict:
    g = torch.Generator().manual_seed(1000 * w + r)
    return {
        "big": torch.randint(-2**31, 2**31 - 1, (6 << 18,), generator=g, dtype=torch.int32),
        "t": torch.randn(300, 200, generator=g).t(),  # non-contiguous: gathered
        "small": {f"s{i}": torch.randint(0, 255, (i + 1, 7), generator=g, dtype=torch.uint8)
                  for i in range(12)},
        "step": r,
        "name": f"worker{w}-round{r}",
    }


def _snapshot(sd: dict) -> dict:
    return {k: (_snapshot(v) if isinstance(v, dict) else
                v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}


def _blank(sd: dict) -> dict:
    return {k: (_blank(v) if isinstance(v, dict) else
                torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else None)
            for k, v in sd.items()}


def _check(got: dict, want: dict, where: str) -> None:
    for k, v in want.items():
        if isinstance(v, dict):
            _check(got[k], v, f"{where}.{k}")
        elif isinstance(v, torch.Tensor):
            if not torch.equal(got[k].contiguous().view(torch.uint8),
                               v.contiguous().view(torch.uint8)):
                raise AssertionError(f"{where}.{k}: bytes differ")
        elif got[k] != v:
            raise AssertionError(f"{where}.{k}: {got[k]!r} != {v!r}")


def _mutate(sd: dict) -> None:
    sd["big"].add_(1)
    sd["t"].mul_(-1)
    for t in sd["small"].values():
        t.add_(3)
    sd["step"] += 1000


def _load(path: str, template: dict) -> dict:
    out = _blank(template)
    dcpx.load(out, storage_reader=dcpx.FileSystemReader(path, thread_count=3))
    return out


def _copies(w: int) -> None:
    src = [torch.randn(1 << 18).t() for _ in range(3)] + [torch.randn(64, 64).t()]
    dst = [torch.empty(s.shape).contiguous() for s in src]
    _C.copy_into(list(zip(src, dst)), threads=3)
    for s, d in zip(src, dst):
        if not torch.equal(s, d):
            raise AssertionError(f"worker {w}: copy_into differs")


def _cancelled_jobs(root: str, w: int) -> None:
    big = torch.zeros(8 << 20, dtype=torch.uint8)
    files = [(os.path.join(root, f"cancel{w}_{i}"), [(big, "ByteStorage")]) for i in range(3)]
    job = _C.WriteJob(files, False, 3)
    job.start()
    job.cancel()
    try:
        job.wait()
    except OSError:
        pass  # ECANCELED, or it finished first
    job.release()
    job = _C.WriteJob(files, False, 3)
    job.start()
    del job  # dealloc cancels and joins


def _worker(w: int, rounds: int, root: str, errors: list) -> None:
    try:
        with dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True)) as bg, \
             dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=False)) as fg:
            for r in range(rounds):
                sd = _state(w, r)
                sync_dir = os.path.join(root, f"w{w}", "sync")
                dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(
                    sync_dir, sync_files=False, thread_count=3, single_file_per_rank=False))
                want = _snapshot(sd)
                async_dir = os.path.join(root, f"w{w}", "async")
                resp = dcpx.async_save(sd, storage_writer=dcpx.FileSystemWriter(
                    async_dir, sync_files=False, thread_count=2), async_stager=bg if r % 2 == 0 else fg)
                if isinstance(resp, dcpx.AsyncSaveResponse):
                    resp.staging_completion.result(timeout=TIMEOUT)
                    upload = resp.upload_completion
                else:
                    upload = resp
                _mutate(sd)  # training goes on while the upload writes
                _copies(w)
                _check(_load(sync_dir, want), want, f"worker {w} round {r} sync")
                upload.result(timeout=TIMEOUT)
                _check(_load(async_dir, want), want, f"worker {w} round {r} async")
                _cancelled_jobs(root, w)
    except BaseException as e:  # reported by main
        errors.append((w, e))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="dcpx-stress-") as root:
        errors: list = []
        threads = [threading.Thread(target=_worker, args=(w, args.rounds, root, errors),
                                    name=f"stress-{w}") for w in range(args.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
            if t.is_alive():
                print(f"thread_stress: {t.name} hung", file=sys.stderr)
                return 1
    for w, e in errors:
        print(f"thread_stress: worker {w}: {type(e).__name__}: {e}", file=sys.stderr)
    if errors:
        return 1
    print(f"thread_stress: ok ({args.workers} workers x {args.rounds} rounds, "
          f"{time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
