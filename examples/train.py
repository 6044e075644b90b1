#!/usr/bin/env python3
"""dcpx demo: train a tiny GPT on CPU, checkpoint asynchronously, crash, resume exactly.

    python examples/train.py                    # uses dcpx and dcpx.CheckpointManager
    python examples/train.py --backend torch    # same run with torch.distributed.checkpoint

With no --phase, this script is the orchestrator. It runs itself twice:
  1. `--phase train`  trains, async-checkpoints every --ckpt-every steps into
                      <dir>/step-{N}, keeping the newest --keep, and is SIGKILLed
                      right after step --crash-at (a simulated crash, most likely
                      while that step's checkpoint is still being written);
  2. `--phase resume` (a fresh process) loads the latest *intact* checkpoint,
                      replays the steps after it, checks each loss equals the one
                      phase 1 logged, and trains on to --steps.
With dcpx, dcpx.CheckpointManager does the step folders, the interval, the
retention (in the background) and the resume (skipping, with a warning, a step
whose save the kill interrupted, or one that fails its CRC checks). With
torch, the script does them by hand, as training code does around torch DCP
(keeping every checkpoint).
Both phases append to <dir>/events.jsonl; the orchestrator prints a summary from it.
Single process, no torch.distributed.init_process_group (DCP's "no_dist" mode).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

# DCP warns once per save/load that it runs without a process group; that is the intent here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

VOCAB, SEQ, BATCH = 256, 64, 16
D_MODEL, N_HEADS, N_LAYERS = 192, 4, 3
SUCCESSORS = 4      # each token of the synthetic language has 4 plausible next tokens
LOSS_TOL = 1e-6     # resumed losses must match phase 1 to this (they are in fact bit-identical)


def say(msg: str = "") -> None:
    print(msg, flush=True)  # flush: phase 1 dies by SIGKILL, buffered output would be lost


def import_backend(name: str) -> Any:
    """`import dcpx as dcp` or `import torch.distributed.checkpoint as dcp`: same API."""
    if name == "torch":
        return importlib.import_module("torch.distributed.checkpoint")
    try:
        return importlib.import_module("dcpx")
    except ImportError:  # not installed: fall back to the source tree this example lives in
        sys.path.append(str(Path(__file__).resolve().parents[1]))
        return importlib.import_module("dcpx")


class MarkovData:
    """Synthetic "language": a fixed random first-order Markov chain over VOCAB tokens.

    The chain (derived from the seed) is constant; the stream position is the state of
    `self.gen`, which goes into the checkpoint so a resumed run sees the same batches.
    """

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        succ = torch.stack([torch.randperm(VOCAB, generator=g)[:SUCCESSORS] for _ in range(VOCAB)])
        weights = torch.rand(VOCAB, SUCCESSORS, generator=g) + 0.2
        self.probs = torch.zeros(VOCAB, VOCAB).scatter_(1, succ, weights / weights.sum(1, keepdim=True))
        self.gen = torch.Generator().manual_seed(seed + 1)

    def entropy(self) -> float:  # the best loss any model can reach
        p = self.probs.clamp_min(1e-12)
        return float(-(self.probs * p.log()).sum(1).mean())

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        x[:, 0] = torch.randint(VOCAB, (BATCH,), generator=self.gen)
        for t in range(SEQ):
            x[:, t + 1] = torch.multinomial(self.probs[x[:, t]], 1, generator=self.gen).squeeze(1)
        return x[:, :-1], x[:, 1:]


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
        layer = nn.TransformerEncoderLayer(D_MODEL, N_HEADS, 4 * D_MODEL, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, N_LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos[: idx.shape[1]]
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


class AppState(Stateful):
    """Everything needed for an exact resume, behind DCP's Stateful protocol.

    DCP calls state_dict() inside async_save (before staging) and, on load, calls
    state_dict() for the target layout, fills it in place, then load_state_dict().
    """

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer,
                 sched: torch.optim.lr_scheduler.LRScheduler, data: MarkovData) -> None:
        self.model, self.optim, self.sched, self.data = model, optim, sched, data
        self.step = 0  # optimizer steps completed

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict(),
                "step": self.step,
                "rng": {"torch": torch.get_rng_state(), "data": self.data.gen.get_state()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["sched"])
        self.step = sd["step"]
        torch.set_rng_state(sd["rng"]["torch"])     # dropout masks
        self.data.gen.set_state(sd["rng"]["data"])  # position in the data stream


class Checkpointer:
    """async_save with at most one save in flight, timing what each save costs the loop
    (by hand: the torch backend)."""

    def __init__(self, dcp: Any, root: Path, log: IO[str], phase: int, every: int) -> None:
        self.dcp, self.root, self.log, self.phase, self.every = dcp, root, log, phase, every
        self.pending: Any = None  # upload future of the save in flight
        self.rec: dict[str, Any] = {}
        # One stager for the whole run, as in PyTorch's async recipe: its staging
        # buffers are allocated on the first save and reused by every later one.
        # torch's stager refuses pinned memory / non-blocking copies without a GPU.
        staging = importlib.import_module(dcp.__name__ + ".staging")
        cuda = torch.cuda.is_available()
        self.stager = staging.DefaultStager(staging.StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
            use_non_blocking_copy=cuda))

    @property
    def in_flight(self) -> bool:
        return self.pending is not None and not self.pending.done()

    def _async_save(self, state: dict[str, Any], step: int) -> Any:
        return self.dcp.async_save(state, checkpoint_id=str(self.root / f"step-{step}"),
                                   async_stager=self.stager)

    def save(self, state: dict[str, Any], step: int) -> None:
        if step % self.every:
            return
        t0 = time.perf_counter()
        self.wait()  # like torch's recipe: the previous upload must finish before the next save
        t1 = time.perf_counter()
        resp = self._async_save(state, step)
        if hasattr(resp, "staging_completion"):  # AsyncSaveResponse: staging may still be running;
            resp.staging_completion.result()    # weights must not change until it is done
            upload = resp.upload_completion
        else:                                   # plain Future: the state is already staged
            upload = resp
        t2 = time.perf_counter()
        self.rec = {"kind": "ckpt", "phase": self.phase, "step": step,
                    "wait_prev_ms": 1e3 * (t1 - t0), "blocked_ms": 1e3 * (t2 - t1), "t_start": t2}
        upload.add_done_callback(lambda _f, rec=self.rec: rec.setdefault("t_done", time.perf_counter()))
        self.pending = upload
        say(f"  [ckpt] step {step:3d}: async_save started; training blocked {1e3 * (t2 - t0):7.1f} ms")

    def poll(self) -> None:
        if self.pending is not None and self.pending.done():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        self.pending.result()  # re-raises a failed upload
        self.pending, rec = None, self.rec
        path = self.root / f"step-{rec['step']}"
        # result() can return before the done-callback ran; then "now" is the completion time
        rec["upload_ms"] = 1e3 * (rec.pop("t_done", None) or time.perf_counter()) - 1e3 * rec.pop("t_start")
        rec["bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        say(f"  [ckpt] step {rec['step']:3d}: committed {path.name} ({rec['bytes'] / 2**20:.1f} MiB), "
            f"upload finished {rec['upload_ms']:.0f} ms after async_save returned")
        log_event(self.log, rec)

    def close(self) -> None:
        self.wait()
        self.stager.close()


class ManagedCheckpointer(Checkpointer):
    """The same, with dcpx.CheckpointManager doing the step folders, the interval and the
    retention (keep the newest `keep`, deleted on the manager's own thread)."""

    def __init__(self, dcp: Any, root: Path, log: IO[str], phase: int, every: int, keep: int) -> None:
        super().__init__(dcp, root, log, phase, every)
        self.manager = dcp.CheckpointManager(root, save_interval_steps=every, keep_latest_k=keep,
                                             async_stager=self.stager)

    def _async_save(self, state: dict[str, Any], step: int) -> Any:
        return self.manager.save(step, state)

    def close(self) -> None:
        super().close()
        self.manager.close()


def step_dirs(root: Path) -> list[Path]:
    """step-{N} folders, oldest first (by number: step-100 after step-20)."""
    return sorted((d for d in root.glob("step-*") if d.name[5:].isdigit()), key=lambda d: int(d.name[5:]))


def latest_complete(root: Path) -> Path | None:
    """DCP writes .metadata last, so a checkpoint without it was interrupted mid-save."""
    for d in reversed(step_dirs(root)):
        if (d / ".metadata").exists():
            return d
        say(f"  skipping incomplete checkpoint {d.name} (no .metadata)")
    return None


def resume(dcp: Any, root: Path, app: "AppState", backend: str) -> str | None:
    """Load the latest intact checkpoint into app; returns its folder name (None: none)."""
    if backend == "torch":
        latest = latest_complete(root)
        if latest is not None:
            dcp.load({"app": app}, checkpoint_id=str(latest))
        return None if latest is None else latest.name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", dcp.manager.StepSkippedWarning)
        step = dcp.CheckpointManager(root).load({"app": app})
    for w in caught:
        if issubclass(w.category, dcp.manager.StepSkippedWarning):
            say(f"  {str(w.message).replace('dcpx.CheckpointManager.load: ', '')}")
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return None if step is None else f"step-{step}"


def log_event(log: IO[str], rec: dict[str, Any]) -> None:
    log.write(json.dumps(rec) + "\n")
    log.flush()  # reaches the OS at once, so it survives the SIGKILL


def read_events(root: Path) -> list[dict[str, Any]]:
    path = root / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def run_phase(args: argparse.Namespace) -> int:
    phase = 1 if args.phase == "train" else 2
    dcp, root = import_backend(args.backend), Path(args.dir)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    data, model = MarkovData(args.seed), TinyGPT()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 10  # linear warmup, then cosine decay to 10% of the peak LR
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, max(0, s - warmup) / max(1, args.steps - warmup))))))
    app = AppState(model, optim, sched, data)

    say(f"\n=== phase {phase}: {'train' if phase == 1 else 'resume'} (pid {os.getpid()}, "
        f"backend {dcp.__name__}) ===")
    expected: dict[int, float] = {}
    if phase == 1:
        n = sum(p.numel() for p in model.parameters())
        say(f"  model: {N_LAYERS}-layer GPT, d_model {D_MODEL}, {n / 1e6:.2f}M params; "
            f"batch {BATCH}x{SEQ} tokens; loss floor of the synthetic data = {data.entropy():.3f}")
    else:
        t0 = time.perf_counter()
        latest = resume(dcp, root, app, args.backend)
        if latest is None:
            say("  no complete checkpoint found, starting from scratch")
        else:
            say(f"  loaded {latest} in {1e3 * (time.perf_counter() - t0):.0f} ms -> resuming after "
                f"step {app.step} (lr {sched.get_last_lr()[0]:.2e})")
        expected = {e["step"]: e["loss"] for e in read_events(root) if e["kind"] == "step" and e["phase"] == 1}

    with open(root / "events.jsonl", "a") as log:
        ckpt = (Checkpointer(dcp, root, log, phase, args.ckpt_every) if args.backend == "torch" else
                ManagedCheckpointer(dcp, root, log, phase, args.ckpt_every, args.keep))
        worst = train_loop(args, phase, app, ckpt, expected)
    if expected:
        ok = worst <= LOSS_TOL
        say(f"  resume check: replayed steps match phase 1: {'YES' if ok else 'NO'} (max |diff| {worst:.1e})")
        return 0 if ok else 1
    return 0


def train_loop(args: argparse.Namespace, phase: int, app: AppState, ckpt: Checkpointer,
               expected: dict[int, float]) -> float:
    """Train up to args.steps; return the largest |loss - phase 1's loss| over replayed steps."""
    model, optim, sched, data, log = app.model, app.optim, app.sched, app.data, ckpt.log
    state, worst = {"app": app}, 0.0
    while app.step < args.steps:
        step, busy = app.step + 1, ckpt.in_flight
        t0 = time.perf_counter()
        x, y = data.batch()
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()
        app.step, lv = step, loss.item()
        dt = time.perf_counter() - t0
        log_event(log, {"kind": "step", "phase": phase, "step": step, "loss": lv, "ms": 1e3 * dt, "busy": busy})
        note = ""
        if step in expected:  # a step phase 1 already ran before it crashed
            diff = abs(lv - expected[step])
            worst = max(worst, diff)
            note = f"  (phase 1 logged {expected[step]:.6f}, |diff| {diff:.1e})"
        if step % 5 == 0 or note or step == args.crash_at:
            say(f"  step {step:3d}  loss {lv:.6f}  {1e3 * dt:6.1f} ms{note}")
        ckpt.poll()
        ckpt.save(state, step)  # every --ckpt-every steps
        if phase == 1 and step == args.crash_at:
            say(f"  !!! simulated crash after step {step}: SIGKILL to self (no cleanup, no final save)")
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    return worst


def summarize(root: Path, backend: str) -> None:
    ev = read_events(root)
    clean = [e["ms"] for e in ev if e["kind"] == "step" and not e["busy"]]
    busy = [e["ms"] for e in ev if e["kind"] == "step" and e["busy"]]
    if not clean:
        return
    med = statistics.median(clean)  # median: robust to the first (warm-up) steps and to noisy neighbours
    say(f"\n=== summary ({backend}) ===")
    say(f"  median step time, no save in flight:       {med:7.1f} ms  ({len(clean)} steps)")
    if busy:
        say(f"  median step time, upload in background:    {statistics.median(busy):7.1f} ms  ({len(busy)} steps)")
    say(f"  {'phase':>5} {'step':>5} {'blocked ms':>11} {'= steps':>8} {'upload ms':>10} {'MiB':>7} {'MiB/s':>7}")
    for c in (e for e in ev if e["kind"] == "ckpt"):
        blocked, total = c["wait_prev_ms"] + c["blocked_ms"], c["blocked_ms"] + c["upload_ms"]
        say(f"  {c['phase']:>5} {c['step']:>5} {blocked:>11.1f} {blocked / med:>8.2f} {c['upload_ms']:>10.1f} "
            f"{c['bytes'] / 2**20:>7.1f} {c['bytes'] / 2**20 / total * 1e3:>7.1f}")
    say("  blocked: the training loop waited this long (async_save call + staging); '= steps': the same in steps\n"
        "  upload:  from async_save returning until the checkpoint was committed (runs behind training)")


def on_disk(root: Path) -> str:
    names = [d.name + ("" if (d / ".metadata").exists() else " [incomplete]") for d in step_dirs(root)]
    return ", ".join(names) or "(nothing)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["dcpx", "torch"], default="dcpx")
    p.add_argument("--dir", default="runs/demo", help="checkpoint directory (step-* inside are replaced)")
    p.add_argument("--steps", type=int, default=100, help="total training steps")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep (dcpx: CheckpointManager's keep_latest_k)")
    p.add_argument("--crash-at", type=int, default=50, help="phase 1 is killed right after this step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phase", choices=["all", "train", "resume"], default="all", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not (args.ckpt_every >= 1 and args.keep >= 1 and 0 < args.crash_at < args.steps):
        p.error("need --ckpt-every >= 1, --keep >= 1 and 0 < --crash-at < --steps")
    if args.phase != "all":
        return run_phase(args)

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    for old in [*root.glob("step-*"), *root.glob(".deleting-step-*"), *root.glob("step_*")]:
        shutil.rmtree(old)  # only our own artifacts: a stale checkpoint would hijack the resume
    (root / "events.jsonl").unlink(missing_ok=True)
    t0 = time.perf_counter()
    base = [sys.executable, __file__, "--backend", args.backend, "--dir", str(root), "--steps", str(args.steps),
            "--ckpt-every", str(args.ckpt_every), "--keep", str(args.keep), "--crash-at", str(args.crash_at),
            "--seed", str(args.seed)]
    rc = subprocess.run(base + ["--phase", "train"]).returncode
    if rc != -signal.SIGKILL:
        say(f"phase 1 exited with {rc}, expected to be killed by SIGKILL")
        return 1
    say(f"\n  (orchestrator) phase 1 died with SIGKILL as planned; on disk: {on_disk(root)}")
    rc = subprocess.run(base + ["--phase", "resume"]).returncode
    say(f"\n  (orchestrator) on disk after phase 2: {on_disk(root)}")
    summarize(root, args.backend)
    say(f"\n  total wall time {time.perf_counter() - t0:.1f} s; checkpoints in {root}/; "
        f"result: {'OK' if rc == 0 else 'FAILED'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
