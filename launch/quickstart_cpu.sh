#!/usr/bin/env bash
# README command 1: set up the CPU environment and run the main job on CPU.
# Extra arguments are config overrides, e.g. `bash launch/quickstart_cpu.sh rollout.n=2`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_cpu.sh
export TMPDIR=${TMPDIR:-/tmp}/megarl-$$ && mkdir -p "$TMPDIR"
.venv/bin/megarl fixtures smollm2
.venv/bin/megarl generate configs/quickstart.yaml "$@"
