"""megarl sft / rm on the engine (2 gloo processes, fp32, tiny-qwen2; issue 33's layout acceptance).

- SFT: one SGD step of the SFT loss as the workers build it (token-mean, and seq-mean-token-sum)
  at tp2, pp2 and cp2 equals tp1 (dp2) within 1e-5 in the loss and in every HF-exported weight
  (measured: weights <= 1.2e-7, loss <= 9.5e-7), and the step changes the weights.
- Reward model: each sequence's score (seeded random score head, read at the last token) equals
  transformers' AutoModelForSequenceClassification on the engine's own HF export (reward_model_config)
  within 1e-5 at tp1, tp2, pp2, cp2 (measured 2.1e-7..8.3e-7); one SGD step of the Bradley-Terry
  loss at tp2, pp2, cp2 equals tp1 within 1e-5 (score.weight included; measured <= 1.2e-7).
"""
import pytest
from test_engine_parity import two_process_launch

pytestmark = pytest.mark.distributed
TOL = 1e-5


@pytest.fixture(scope="module")
def result():   # workers/posttrain.py, run in the 2-process launch of test_engine_parity.py
    return two_process_launch()["posttrain"]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("layout", ["tp2", "pp2", "cp2"])
def test_sft_step_equals_tp1(result, agg, layout):
    assert result[f"sft|{agg}|{layout}|weights_vs_tp1"] < TOL
    assert result[f"sft|{agg}|{layout}|loss_diff"] < TOL * max(1.0, result[f"sft|{agg}|tp1|loss"])
    assert result[f"sft|{agg}|tp1|step_changed_weights"] > 1e-4


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2", "cp2"])
def test_reward_model_scores_equal_hf_sequence_classification(result, layout):
    assert result[f"rm|{layout}|vs_hf"] < TOL
    assert len(set(round(s, 4) for s in result[f"rm|{layout}|scores"])) == 4   # a head that reads something


@pytest.mark.parametrize("layout", ["tp2", "pp2", "cp2"])
def test_bradley_terry_step_equals_tp1(result, layout):
    assert result[f"rm|{layout}|weights_vs_tp1"] < TOL
    assert result[f"rm|{layout}|loss_diff"] < TOL
    assert result["rm|tp1|step_changed_weights"] > 1e-4
