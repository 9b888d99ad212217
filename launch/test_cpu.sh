#!/usr/bin/env bash
# README command 2: set up the CPU environment, build the model fixtures and run the test suite.
# Extra arguments go to pytest, e.g. `bash launch/test_cpu.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_cpu.sh
export TMPDIR=${TMPDIR:-/tmp}/megarl-test-$$ && mkdir -p "$TMPDIR"
trap 'rm -rf "$TMPDIR"' EXIT
.venv/bin/megarl fixtures
.venv/bin/python -m pytest tests "$@"
