"""megarl.compat on 2 gloo processes: the TE layer spec with CPU TE modules at TP=2 (and SP),
CP=2, THD packing and THD+CP=2 equals the TP=1 / one-sequence-at-a-time computation."""
import pytest
from test_engine_parity import two_process_launch

pytestmark = pytest.mark.distributed
TOL = 1e-5   # fp32 per-token loss; measured ~4.8e-7 (float rounding of a ~4.9 loss)


@pytest.fixture(scope="module")
def result():   # workers/compat_parity.py, run in the 2-process launch of test_engine_parity.py
    return two_process_launch()["compat"]


@pytest.mark.parametrize("key", ["tp2_max_abs_diff", "tp2_sp_max_abs_diff", "cp2_max_abs_diff",
                                 "thd_tp1_vs_unpacked_max_abs_diff", "thd_tp2_vs_unpacked_max_abs_diff",
                                 "thd_cp2_vs_unpacked_max_abs_diff"])
def test_layout_matches_reference(result, key):
    assert result[key] < TOL, (key, result[key])


def test_tp2_mean_loss_equals_tp1(result):
    assert result["tp2_mean_loss_diff"] < TOL
    # a random 128-token vocabulary gives ~ln(128) = 4.85 nats: the model really ran
    assert 4.0 < result["ref_loss_mean"] < 6.0
