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
# the run folder: the config's, or the last trainer.run_dir= override (no second Python start-up: 3.4 s)
run_dir=$(sed -n 's/^  run_dir: *\([^ #]*\).*/\1/p' configs/quickstart.yaml)
for arg in "$@"; do case "$arg" in trainer.run_dir=*) run_dir=${arg#trainer.run_dir=} ;; esac; done
.venv/bin/megarl plot "$run_dir"
