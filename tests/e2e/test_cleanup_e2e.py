"""A failing run cleans up after itself: the weight-sync alarm tripped on purpose.

``trainer.logprob_diff_threshold=1e-12`` on the tied tiny llama in fp32 (vLLM and Megatron differ
by ~1e-6 there, see test_grpo_e2e.py) stops the real loop at step 1, after generation, log-probs,
the reward workers and the vLLM engine are all running. The loop runs in this process, so a
process it leaves behind would still be a child of the test (atexit handlers, which stop a local
Ray when the interpreter exits, have not run yet). Asserted: the alarm is raised with its message,
step 1's metrics (with the difference that tripped it) and the logs (vLLM's in the engine's log)
are on disk, the console stayed quiet, and every process the run started (Ray's, the training
worker's and the engine's actors, the reward worker's) is gone. At rollout.tp 1 vLLM runs inside
the engine's actor (megarl/rollout/engine.py): no vLLM process of its own.
"""
import pytest
from e2e_common import ProcessWatch, metrics, ray_tmpdir, recipe, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
def test_weight_sync_alarm_stops_the_run_and_leaves_no_process(tmp_path, monkeypatch, capfd):
    from megarl.config import load_config
    from megarl.trainer.loop import WeightSyncAlarm, train

    monkeypatch.setenv("RAY_TMPDIR", ray_tmpdir())
    cfg = load_config(write_recipe(tmp_path, "alarm", recipe("  name: grpo", steps=1)),
                      ["trainer.logprob_diff_threshold=1e-12"])
    with ProcessWatch() as watch:
        with pytest.raises(WeightSyncAlarm, match=r"> trainer\.logprob_diff_threshold=1e-12: vLLM is not sampling"):
            train(cfg)
    cmds = "\n".join(c[:150] for names in watch.cmds.values() for c in names)
    # the watch saw the run's processes: Ray's, the training worker, the engine (vLLM inside it)
    assert all(name in cmds for name in ("raylet", "ray::HybridWorker", "ray::EngineActor")), cmds
    assert "VLLM::" not in cmds, cmds
    left = watch.wait_gone()
    assert not left, "\n".join(left)

    run_dir = tmp_path / "alarm"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1]   # the failed step's metrics, up to the alarm
    assert rows[0]["rollout/logprob_diff_mean"] > 1e-12 and "reward/mean" in rows[0]
    assert "WeightSyncAlarm" in (run_dir / "logs" / "driver.log").read_text()
    assert "vllm" in (run_dir / "logs" / "engine_0.log").read_text().lower()
    console = capfd.readouterr()
    terminal = console.out + console.err
    assert "pid=" not in terminal and len(terminal.splitlines()) <= 30, terminal
    assert "logprob_diff_mean=" in terminal   # the failed step's table
