#!/usr/bin/env bash
# The main job: set up, then a small training run that checkpoints with
# dcpx.async_save, is killed, resumes from its latest checkpoint and shows
# the loss continuing, printing what each checkpoint cost.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/train.py "$@"
