#!/usr/bin/env bash
# The main job: set up, then a small training run that checkpoints with
# dcpx.CheckpointManager (async_save every 10 steps, keep the newest 2), is
# SIGKILLed while a checkpoint is being written, resumes from the newest
# intact checkpoint (skipping the interrupted one) and shows the loss
# continuing, printing what each checkpoint cost.  --backend torch: the same
# with torch.distributed.checkpoint and hand-written checkpoint handling.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/train.py "$@"
