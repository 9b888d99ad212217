"""Speculative rollouts on real vLLM: exactness. (The loop: PPO with a resume in the middle of
epoch 2 in tests/e2e/test_algorithms_e2e.py, one_step_off in tests/e2e/test_modes_e2e.py.)

Exactness (tests/e2e/spec_exactness.py, one vLLM engine, ~90 s): on a 4-token model with
responses of at most 3 tokens (40 outcomes), 40,000 responses each of plain sampling, ``exact``
and ``lenient`` (l = e^0.5) with drafts from another prompt (another policy) are compared with
the policy's law read from the engine. Pearson's chi-square at significance 1e-3 accepts plain
and exact and rejects lenient. Power: a shift of 2% in total variation has a noncentrality of at
least 4 * n * 0.02^2 = 64 (Cauchy-Schwarz), so the statistic's mean is about df + 64 ~ 103, well
past the critical value of ~72.
"""
import json
import math
import subprocess
import sys

import pytest
from e2e_common import HERE

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SAMPLES = 40_000
ALPHA_Z = 3.090   # the standard normal's 1 - 1e-3 quantile


def chi2_critical(df: int, z: float = ALPHA_Z) -> float:
    """Wilson-Hilferty: the chi-square quantile of the normal quantile z (1e-3: ~72.1 at df 39)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_exact_mode_samples_the_policy_and_lenient_does_not():
    proc = subprocess.run([sys.executable, str(HERE / "spec_exactness.py"), str(SAMPLES)], capture_output=True,
                          text=True, timeout=900)
    rows = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("SPEC ")]
    assert proc.returncode == 0 and rows, proc.stderr[-5000:]
    r = rows[0]
    print(json.dumps(r, indent=1))
    assert r["n"] == SAMPLES and r["outcomes"] == 40
    assert r["draft_tv_from_p"] > 0.05                      # the drafts' policy really differs
    for arm in ("plain", "exact"):
        assert r[arm]["chi2"] < chi2_critical(r[arm]["df"]), (arm, r[arm])
    assert r["lenient"]["chi2"] > 5 * chi2_critical(r["lenient"]["df"]), r["lenient"]
    assert r["lenient"]["tv"] > 0.05 > r["exact"]["tv"]
    # drafts were used: most tokens accepted, some rejected, none of the stored top-4 mass missing
    spec = r["exact_spec"]
    assert 0.5 < spec["accepted"] / spec["offered"] < 0.99 and spec["tv_bound_max"] < 1e-6
    assert r["lenient_spec"]["accepted"] > spec["accepted"]
    # the recorded log-probs are the policy's: sum over a response = log p(response)
    assert r["exact_logprob_err"] < 1e-4 and r["lenient_logprob_err"] < 1e-4
