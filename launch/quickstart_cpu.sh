#!/usr/bin/env bash
# README command 1: set up the CPU environment and run the GRPO quickstart on CPU.
# Extra arguments are config overrides, e.g. `bash launch/quickstart_cpu.sh trainer.steps=5`.
# The terminal shows the progress line and a metrics table per step; Ray, vLLM and library output
# goes to <trainer.run_dir>/logs/ (`megarl train --verbose` shows it on the terminal instead).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_cpu.sh
export TMPDIR=${TMPDIR:-/tmp}/megarl-$$ && mkdir -p "$TMPDIR"
.venv/bin/megarl fixtures smollm2
.venv/bin/megarl train configs/quickstart.yaml "$@"
run_dir=$(.venv/bin/megarl config configs/quickstart.yaml "$@" | .venv/bin/python -c \
  "import sys, yaml; print(yaml.safe_load(sys.stdin)['trainer']['run_dir'])")
.venv/bin/megarl plot "$run_dir"
