"""PPO critic: the policy's GPTModel with a scalar value head (2 gloo processes, fp32).

- Values equal transformers' final hidden state (after the last norm) at the position before
  each response token, dotted with the head's (w, b): < 1e-4 (measured 1.4e-6..2.2e-6) at tp1
  (dp2), tp2, tp2+SP, pp2, cp2 (tiny-qwen2) and tp2 x ep2 + SP (tiny-qwen3_moe).
- One SGD step of the clipped value loss gives the same values at every layout as at tp1:
  < 1e-5 (measured 0..5.4e-6; an SP gather that summed the replicated head's gradient over TP
  would be off by the step itself), and moves the values towards the returns.
"""
import pytest
from test_engine_parity import two_process_launch

pytestmark = pytest.mark.distributed
DENSE = ["tp1", "tp2", "tp2.sp1", "pp2", "cp2"]
MOE = ["tp1", "tp2.ep2.etp1.sp1"]


@pytest.fixture(scope="module")
def result():   # workers/critic.py, run in the 2-process launch of test_engine_parity.py
    return two_process_launch()["critic"]


@pytest.mark.parametrize("key", [f"qwen2|{s}" for s in DENSE] + [f"qwen3_moe|{s}" for s in MOE])
def test_values_equal_hf_hidden_state_times_head(result, key):
    assert result[f"{key}|vs_hf"] < 1e-4


@pytest.mark.parametrize("key", [f"qwen2|{s}" for s in DENSE[1:]] + [f"qwen3_moe|{s}" for s in MOE[1:]])
def test_value_step_equals_tp1(result, key):
    assert result[f"{key}|after_vs_tp1"] < 1e-5


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_value_step_moves_towards_returns(result, family):
    before, after = result[f"{family}|tp1|mse_before"], result[f"{family}|tp1|mse_after"]
    assert after < 0.9 * before, (before, after)
    assert result[f"{family}|tp1|grad_norm"] > 0
