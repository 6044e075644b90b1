"""Lose a node, resume from its partners' replicas (docs/tiers.md).

2 ranks on this machine stand in for 2 nodes of one rank each (gloo; each
node has its own local folder; tests/test_tiers.py runs 2 nodes of 2 ranks).  The first run trains and saves every step to
the node-local tier, each rank's piece replicated on the other node, and
every 4th step to the persistent tier; after step 6 the job dies, and node
1 is replaced: its local folder is deleted.  The second run resumes: rank
1 fetches its piece from node 0, every rank checks that its weights
are bit-exact those of step 6, and training goes on.

    python examples/lost_node.py [--dir DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dcpx  # noqa: E402

WORLD, PER_NODE = 2, 1


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def run(rank: int, work: str, last_step: int, die_after: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work}/pg-{last_step}",
                            rank=rank, world_size=WORLD)
    node = rank // PER_NODE
    torch.manual_seed(0)  # the same model on every rank (data parallel)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ckpt = dcpx.CheckpointManager(
        f"{work}/persistent", local_root=f"{work}/node{node}-local", node=f"node{node}",
        replicas=1, persist_interval_steps=4, keep_local_k=2, keep_latest_k=2)
    state = {"model": model, "optim": opt}
    start = ckpt.load(state) or 0
    log = f"{work}/digests.json"
    if start:
        with open(log) as f:
            want = json.load(f)[str(start)]
        assert digest(model) == want, "resumed weights differ from the saved step"
        how = ckpt.last_resume
        where = {"local": "every rank from its own node",
                 "replica": "the lost node's pieces fetched from their replicas",
                 "persistent": "the persistent tier"}[how["tier"]]
        print(f"rank {rank}: resumed at step {start} ({where}), weights bit-exact", flush=True)
    for step in range(start + 1, last_step + 1):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.save(step, state)
        if rank == 0:
            digests = json.load(open(log)) if os.path.exists(log) else {}
            digests[str(step)] = digest(model)
            with open(log, "w") as f:
                json.dump(digests, f)
        if step == die_after:
            ckpt.wait()
            t = ckpt.tier_timings[step]
            if rank == 0:
                print(f"step {step}: training blocked {t['blocked_s'] * 1e3:.1f} ms, local "
                      f"{t['local_s'] * 1e3:.1f} ms, replicated {t['replicated_s'] * 1e3:.1f} ms",
                      flush=True)
            dist.barrier()
            os._exit(0)  # the job dies: nothing closed, nothing flushed by dcpx afterwards
    ckpt.close()
    if rank == 0:
        print(f"trained to step {last_step}; persistent steps {ckpt.all_steps()}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="work folder (default: a new temporary one)")
    args = ap.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="dcpx-lost-node-")
    os.makedirs(work, exist_ok=True)
    mp.start_processes(run, args=(work, 6, 6), nprocs=WORLD, start_method="spawn")
    shutil.rmtree(f"{work}/node1-local")
    print("node 1 lost (its local folder deleted); restarting", flush=True)
    mp.start_processes(run, args=(work, 8, 0), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
