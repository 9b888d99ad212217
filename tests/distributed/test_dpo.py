"""megarl dpo's step against TRL's DPOTrainer and across layouts (tests/distributed/workers/dpo.py).

- Oracle (SmolLM2-135M, fp32, 8 arithmetic pairs tokenised by TRL, beta 0.1, two AdamW steps at
  lr 1e-5 with grad-norm clipping at 1, the same pairs twice): step 2's loss and rewards/* (after
  one update: no longer ln 2 and 0) equal TRL's (< 1e-5), and the weights after it equal TRL's
  within 1e-6 of the largest weight. Aligned with TRL: the loss
  is the mean over the step's pairs (megarl: each micro-batch's sum over the global pair count),
  log-probs summed over the completion tokens (TRL appends EOS to each completion: its token ids
  are used as they are), Adam's epsilon 1e-8, no weight decay, a constant LR.
- Layouts (tiny-qwen2, SGD lr 0.5): one step at tp2, pp2 and cp2 gives the weights of tp1 (dp2)
  (<= 1e-6) and the same loss, ln 2 exactly (the policy is its reference before the step).
- LoRA (tiny-llama, rank 8, random non-zero adapters, the reference: the policy with its adapters
  off): the loss is not ln 2 (the adapters move the policy off its reference), tp2 gives tp1's
  loss and adapters after the step (<= 1e-6), and the frozen base does not move.
"""
import math

import pytest

from launch import run_workers

pytestmark = pytest.mark.distributed
LAYOUTS = ["tp2", "pp2", "cp2"]


@pytest.fixture(scope="module")
def layouts():
    return run_workers("dpo.py", 2, "layouts", "qwen2", "-,tp2,pp2,cp2", timeout=900)


@pytest.fixture(scope="module")
def trl():
    return run_workers("dpo.py", 1, "trl", "smollm2", timeout=900)


def test_one_dpo_step_equals_trls(trl):
    assert trl["compared"] == trl["tensors"] > 0, trl
    assert abs(trl["megarl|loss"] - trl["trl|loss"]) < 1e-5, trl
    assert abs(trl["megarl|loss"] - math.log(2)) > 1e-4, trl      # the first update moved the policy
    for name in ("chosen", "rejected", "margins", "accuracies"):
        assert abs(trl[f"megarl|rewards/{name}"] - trl[f"trl|rewards/{name}"]) < 1e-5, (name, trl)
    assert trl["weights_rel"] < 1e-6, trl


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_dpo_step_at_every_layout_equals_tp1(layouts, layout):
    assert layouts["tp1|moved"] > 1e-4, layouts          # the step changed the policy
    assert layouts[f"{layout}|update_successful"] is True
    assert layouts[f"{layout}|vs_first"] <= 1e-6, layouts
    assert layouts[f"{layout}|loss"] == pytest.approx(math.log(2), rel=1e-6), layouts
    assert layouts["tp1|loss"] == pytest.approx(math.log(2), rel=1e-6), layouts


@pytest.fixture(scope="module")
def lora():
    return run_workers("dpo.py", 2, "lora", "llama", "-,tp2", timeout=900)


def test_a_lora_dpo_step_against_the_policy_with_its_adapters_off(lora):
    assert lora["tp1|adapters"] > 0 and all(lora[f"{k}|update_successful"] for k in ("tp1", "tp2")), lora
    assert abs(lora["tp1|loss"] - math.log(2)) > 1e-4, lora   # the reference is the adapter-free policy
    assert abs(lora["tp2|loss"] - lora["tp1|loss"]) <= 1e-6 * lora["tp1|loss"], lora
    assert lora["tp2|vs_first"] <= 1e-6, lora
    assert lora["tp1|base_moved"] == 0.0 and lora["tp2|base_moved"] == 0.0, lora
