"""A small model of what the node-local tier buys a large job
(docs/tiers.md, "Does it pay?").

Expected fraction of the job's time lost to checkpointing and failures,
with checkpoints every tau seconds (Young's first-order model):

    waste = blocked / tau  +  (lost work per failure + restart) / MTBF

* blocked: seconds a save holds the training thread, per GB of a rank's
  state: by default dcpx's async_save staging on an H200, the same for a
  direct save and a local-tier save (both stage into host memory); with
  ``--measured FILE.json`` each one's from a bench_tiers.py run;
* lost work per failure: tau / 2 on average, plus the time until a started
  checkpoint is safe (it cannot be used before): the upload to shared
  storage (direct), or the local write and the copy to a partner node
  (tiered);
* restart: the time to read the state back: from shared storage (direct),
  from node memory or a partner (tiered; a replaced node fetches its
  ranks' pieces over the network);
* tau: the best interval for each (Young: sqrt(2 x blocked x MTBF)), but
  never shorter than the time one checkpoint takes to become safe (a save
  waits for the previous one).

Failures: the Llama 3 report's rate, 419 unexpected interruptions in 54
days on 16,384 GPUs, as a per-GPU rate; about 2 % of them would take out
both partners of a piece (two nodes of one replica set within one
checkpoint interval is much rarer; the 2 % stands for correlated failures:
a switch, a rack) and fall back to the persistent tier.

Every bandwidth and size below is an assumption, printed with the table;
change them with the options.  ``python3 benchmarks/tier_model.py``
"""
from __future__ import annotations

import argparse
import json
import math

LLAMA3_RATE_PER_GPU_H = 419 / (54 * 24 * 16384)


def model(gpus: int, ckpt_tb: float, storage_gbs: float, nic_gbs: float,
          local_gbs: float, blocked_s_per_gb: float, gpus_per_node: int,
          double_loss: float, persist_every: int,
          tiered_blocked_s_per_gb: float = None) -> dict:
    mtbf_s = 3600 / (gpus * LLAMA3_RATE_PER_GPU_H)
    total_gb = ckpt_tb * 1000
    per_gpu_gb = total_gb / gpus
    per_node_gb = per_gpu_gb * gpus_per_node
    blocked = blocked_s_per_gb * per_gpu_gb
    blocked_t = (blocked_s_per_gb if tiered_blocked_s_per_gb is None
                 else tiered_blocked_s_per_gb) * per_gpu_gb
    # direct: every rank writes its part to shared storage, which all share
    upload = total_gb / storage_gbs
    read = total_gb / storage_gbs
    tau_d = max(math.sqrt(2 * blocked * mtbf_s), upload)
    waste_d = blocked / tau_d + (tau_d / 2 + upload + read) / mtbf_s
    # tiered: local write (node memory) + one replica over the node's NIC
    safe = per_node_gb / local_gbs + per_node_gb / nic_gbs
    tau_l = max(math.sqrt(2 * blocked_t * mtbf_s), safe)
    restart_l = per_node_gb / nic_gbs  # the replaced node fetches its pieces
    tau_p = tau_l * persist_every
    lost_single = tau_l / 2 + safe + restart_l
    lost_double = tau_p / 2 + upload + read
    # the persistent tier's uploads run in the background: no blocked time
    waste_t = (blocked_t / tau_l + ((1 - double_loss) * lost_single
                                  + double_loss * lost_double) / mtbf_s)
    return {"gpus": gpus, "mtbf_h": mtbf_s / 3600, "per_gpu_gb": per_gpu_gb,
            "direct": {"tau_s": tau_d, "safe_s": upload, "lost_per_failure_s":
                       tau_d / 2 + upload + read, "waste": waste_d},
            "tiered": {"tau_s": tau_l, "safe_s": safe, "lost_per_failure_s": lost_single,
                       "waste": waste_t}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt-tb", type=float, default=1.12,
                    help="checkpoint size, TB (default: 70B parameters x 16 bytes, weights + "
                         "Adam state)")
    ap.add_argument("--storage-gbs", type=float, default=100.0,
                    help="shared storage bandwidth for the whole job, GB/s")
    ap.add_argument("--nic-gbs", type=float, default=25.0, help="per node, GB/s (200 Gb/s)")
    ap.add_argument("--local-gbs", type=float, default=20.0,
                    help="node-local tier write, per node, GB/s (memory / NVMe)")
    ap.add_argument("--blocked-s-per-gb", type=float, default=0.02,
                    help="training held per GB of a rank's state: dcpx's async_save staging "
                         "on an H200, 8 GiB to staging_completion in 0.157 s "
                         "(benchmarks/results/gpu_h200/); --measured replaces it")
    ap.add_argument("--measured", help="a bench_tiers.py JSON: blocked seconds per GB from it")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--double-loss", type=float, default=0.02)
    ap.add_argument("--persist-every", type=int, default=10)
    a = ap.parse_args()
    blocked = a.blocked_s_per_gb
    blocked_t = None
    src = "dcpx's async_save staging measured on an H200"
    if a.measured:
        with open(a.measured) as f:
            r = json.load(f)
        gb = r["meta"]["mib"] * (1 << 20) / 1e9
        blocked = r["saves"]["direct"]["blocked_s"] / gb
        blocked_t = r["saves"]["tiered"]["blocked_s"] / gb
        src = f"direct; tiered {blocked_t:.3f} s per GB; measured: {a.measured}"
    print(f"checkpoint {a.ckpt_tb:g} TB; shared storage {a.storage_gbs:g} GB/s; NIC "
          f"{a.nic_gbs:g} GB/s per node; local tier {a.local_gbs:g} GB/s per node; "
          f"{a.gpus_per_node} GPUs per node; blocked {blocked:.3f} s per GB ({src}); "
          f"{a.double_loss:.0%} of failures lose both partners; persist every "
          f"{a.persist_every} local checkpoints; failure rate: Llama 3's.\n")
    print("| GPUs | MTBF | GB per GPU | direct: interval / lost per failure / waste | "
          "tiered: interval / lost per failure / waste | waste saved |")
    print("| --- | --- | --- | --- | --- | --- |")
    for gpus in (512, 2048, 16384):
        m = model(gpus, a.ckpt_tb, a.storage_gbs, a.nic_gbs, a.local_gbs, blocked,
                  a.gpus_per_node, a.double_loss, a.persist_every, blocked_t)
        d, t = m["direct"], m["tiered"]
        print(f"| {gpus} | {m['mtbf_h']:.1f} h | {m['per_gpu_gb']:.2f} | {d['tau_s']:.0f} s / "
              f"{d['lost_per_failure_s']:.0f} s / {d['waste']:.2%} | {t['tau_s']:.0f} s / "
              f"{t['lost_per_failure_s']:.0f} s / {t['waste']:.2%} | "
              f"{d['waste'] - t['waste']:.2%} of the job |")


if __name__ == "__main__":
    main()
