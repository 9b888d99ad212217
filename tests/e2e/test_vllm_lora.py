"""vLLM's LoRA path, as ``bridge.lora_sync: adapter`` drives it, against transformers + peft (fp32),
on tiny-llama (Llama: its logits layer is LoRA-wrapped, megarl.compat.vllm_cpu V5) and tiny-qwen2
(q/k/v biases): two random adapters loaded one after the other in place; after each, vLLM's prompt
log-probs of a batch and the log-probs of what it samples equal peft's (< 1e-4, the bound of the
plain-model parity in test_vllm_parity.py; measured 4e-6 .. 1e-5), while the adapter moves them by
far more; before any load the engine is the plain model. vLLM runs in a subprocess
(lora_vllm_check.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
MODELS = ["tiny-llama", "tiny-qwen2"]
TOL = 1e-4


@pytest.fixture(scope="module")
def rows():
    script = Path(__file__).with_name("lora_vllm_check.py")
    proc = subprocess.run([sys.executable, str(script), *[f"fixture:{m}" for m in MODELS]], capture_output=True,
                          text=True, timeout=900)
    found = [json.loads(line[len("LORA "):]) for line in proc.stdout.splitlines() if line.startswith("LORA ")]
    assert proc.returncode == 0 and len(found) == len(MODELS), proc.stderr[-5000:]
    return {r["model"][len("fixture:"):]: r for r in found}


@pytest.mark.parametrize("model", MODELS)
def test_vllm_with_the_adapter_loaded_in_place_equals_peft(rows, model):
    r = rows[model]
    assert r["plain_vs_hf"] < TOL, r
    for trial in (1, 2):
        assert r[f"effect{trial}"] > 100 * TOL, r       # the adapter changes the log-probs
        assert r[f"prompt{trial}_vs_peft"] < TOL, r
        assert r[f"sampled{trial}_vs_peft"] < TOL, r
        assert r[f"bytes{trial}"] > 0
