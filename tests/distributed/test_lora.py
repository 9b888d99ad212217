"""LoRA on the Megatron policy against transformers + peft (tests/distributed/workers/lora.py).

tiny-qwen2 (GQA, q/k/v biases), rank 8, random non-zero adapters on linear_qkv, linear_proj,
linear_fc1 and linear_fc2, at tp1 (dp2), tp2, tp2 with sequence parallelism, pp2 and cp2:
- the response log-probs equal peft's with the adapter folder the layout exported (< 1e-5, fp32;
  the adapters move them by ~3 nats, so the check is not vacuous);
- the merged export (W + alpha/r B A: what the weight bridge and the HF export send) loaded into
  transformers gives them too (< 2e-5: merging reorders the float sums; measured 6.8e-6 .. 8.7e-6);
- with the adapters off they equal transformers' plain model (the reference policy without a copy);
- one SGD step gives the same loss and adapters (< 1e-6) at every layout as at tp1; the base
  weights do not move; the optimizer holds no more elements than the rank's adapters.
Measured: peft vs engine 9e-7 (tp1, pp2) .. 4.2e-6 (tp2); step vs tp1 <= 9e-8.
The same for a 4-layer tiny-qwen2 at pp2 x vpp2 (interleaved virtual stages) against its tp1, and
for tiny-qwen3_moe (adapters on attention only) at ep2 against its tp1.
"""
import pytest

from launch import run_workers

pytestmark = pytest.mark.distributed
LAYOUTS = ["tp1", "tp2", "tp2.sp1", "pp2", "cp2"]


@pytest.fixture(scope="module")
def lora():
    return run_workers("lora.py", 2, "qwen2", "-,tp2,tp2.sp1,pp2,cp2", timeout=900)


@pytest.fixture(scope="module")
def lora_more():
    return run_workers("lora.py", 2, "qwen2-4l:-+pp2.vpp2,qwen3_moe:-+ep2", "-", timeout=900)


@pytest.mark.parametrize("key,adapters", [("qwen2-4l|tp1", 16), ("qwen2-4l|pp2.vpp2", 8), ("qwen3_moe|tp1", 4),
                                          ("qwen3_moe|ep2", 4)])
def test_lora_at_vpp_and_ep_equals_peft_and_tp1(lora_more, key, adapters):
    r = {k.split("|", 2)[2]: v for k, v in lora_more.items() if k.startswith(key + "|")}
    assert r["adapter_effect"] > 0.5, r
    assert r["peft_vs_engine"] < 1e-5 and r["merged_vs_engine"] < 2e-5 and r["off_vs_hf"] < 1e-5, r
    assert r["adapters"] == adapters and r["base_moved"] == 0.0 and r["update_successful"] is True, r
    if key.endswith("tp1"):
        assert r["step_moved"] > 1e-3, r
    else:
        assert r["step_vs_first"] < 1e-6 and r["loss_vs_first"] < 1e-6, r


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_logprobs_equal_peft_and_the_base_model_with_adapters_off(lora, layout):
    key = f"qwen2|{layout}"
    assert lora[f"{key}|adapter_effect"] > 0.5, lora        # the adapters change the log-probs
    assert lora[f"{key}|peft_vs_engine"] < 1e-5, lora
    assert lora[f"{key}|merged_vs_engine"] < 2e-5, lora
    assert lora[f"{key}|off_vs_hf"] < 1e-5, lora
    assert lora[f"{key}|adapters"] == (4 if layout == "pp2" else 8)   # 4 targets x 2 layers (1 a stage at pp2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_lora_step_trains_the_adapters_only_and_equals_tp1(lora, layout):
    key = f"qwen2|{layout}"
    assert lora[f"{key}|update_successful"] is True
    assert lora[f"{key}|base_moved"] == 0.0
    assert 0 < lora[f"{key}|optimizer_elements"] <= lora[f"{key}|adapter_elements"]
    if layout == "tp1":
        assert lora[f"{key}|step_moved"] > 1e-3      # the step changed the adapters
    else:
        assert lora[f"{key}|step_vs_first"] < 1e-6
        assert lora[f"{key}|loss_vs_first"] < 1e-6
