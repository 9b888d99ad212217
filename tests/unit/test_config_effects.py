"""Config keys change what the trainer builds (no engines): each test loads a config with
``load_config`` overrides and shows the key's effect on the function, loss, plan or sampling
built from it. Keys whose effect needs a real run are set in the e2e recipes (tests/e2e)."""
import pytest
import torch

from megarl.config import load_config
from megarl.actors.algorithm import make_loss_fn, resolve


def algorithm(*overrides):
    return load_config(None, [f"algorithm.{o}" for o in overrides]).algorithm


def one_token_loss(cfg, log_ratio, advantage, kl_coef=0.0, **extras):
    """Loss and metrics of ``make_loss_fn(cfg)`` for one sequence of two equal tokens."""
    from megarl.policy import SequenceBatch

    old = torch.tensor([-1.0, -1.0])
    batch = SequenceBatch([torch.tensor([1, 2, 3])], [1], {
        "old_logprobs_T": old, "advantages_T": torch.full((2,), advantage),
        "mask_T": torch.ones(2, dtype=torch.bool), **extras})
    batch.num_global_tokens, batch.num_global_sequences = 2, 1
    loss, metrics = make_loss_fn(cfg, max_response_tokens=8, kl_coef=kl_coef)(old + log_ratio, batch)
    return loss.item(), {k: float(v) for k, v in metrics.items()}


def test_clip_low_and_high():
    # ratio e^-0.5 = 0.61 with A < 0 is clipped at 1 - clip_low = 0.8, not at 0.5
    assert one_token_loss(algorithm("clip_low=0.2"), -0.5, -1.0)[1]["clip_frac"] == 1.0
    assert one_token_loss(algorithm("clip_low=0.5"), -0.5, -1.0)[1]["clip_frac"] == 0.0
    # ratio e^0.22 = 1.246 with A > 0: clipped by grpo's 0.2, not by dapo's clip-higher 0.28
    assert one_token_loss(algorithm("name=grpo"), 0.22, 1.0)[1]["clip_frac"] == 1.0
    assert one_token_loss(algorithm("name=dapo"), 0.22, 1.0)[1]["clip_frac"] == 0.0
    assert one_token_loss(algorithm("clip_high=0.3"), 0.22, 1.0)[1]["clip_frac"] == 0.0


def test_dual_clip_caps_negative_advantage_losses():
    # ratio e^2 = 7.39, A = -1: the loss -A * r is capped at -A * c = 3
    assert one_token_loss(algorithm(), 2.0, -1.0)[0] == pytest.approx(torch.tensor(2.0).exp().item())
    assert one_token_loss(algorithm("dual_clip_c=3"), 2.0, -1.0)[0] == pytest.approx(3.0)


def test_gspo_policy_loss_clips_the_sequence_ratio_at_its_own_range():
    from megarl.algorithms import POLICY_LOSSES

    assert resolve(algorithm("name=gspo"))[2] is POLICY_LOSSES["gspo"]
    assert resolve(algorithm("policy_loss=gspo"))[2] is POLICY_LOSSES["gspo"]
    # a ratio of e^0.001 is outside gspo's 4e-4 but inside ppo's 0.2
    assert one_token_loss(algorithm("name=gspo"), 0.001, 1.0)[1]["clip_frac"] == 1.0
    assert one_token_loss(algorithm("name=grpo"), 0.001, 1.0)[1]["clip_frac"] == 0.0


def test_entropy_coef_adds_an_entropy_bonus():
    entropy = {"entropy_T": torch.tensor([2.0, 2.0])}
    base = one_token_loss(algorithm(), 0.0, 1.0, **entropy)[0]
    assert one_token_loss(algorithm("entropy_coef=0.1"), 0.0, 1.0, **entropy)[0] == pytest.approx(base - 0.2)


def test_kl_estimator_and_mode():
    ref = {"ref_logprobs_T": torch.tensor([-1.5, -1.5])}     # log(pi / ref) = 0.5 on both tokens
    k1 = one_token_loss(algorithm("kl_coef=0.1", "kl_estimator=k1"), 0.0, 1.0, kl_coef=0.1, **ref)[1]["kl"]
    k3 = one_token_loss(algorithm("kl_coef=0.1", "kl_estimator=k3"), 0.0, 1.0, kl_coef=0.1, **ref)[1]["kl"]
    assert k1 == pytest.approx(0.5) and k3 == pytest.approx(torch.tensor(-0.5).exp().item() - 1 + 0.5)
    # kl_mode=reward: the KL is a token reward of the advantages, not a loss term
    assert "kl" not in one_token_loss(algorithm("kl_coef=0.1", "kl_mode=reward"), 0.0, 1.0, kl_coef=0.1, **ref)[1]


def test_loss_agg_mode_weights_sequences():
    from megarl.policy import SequenceBatch

    # a 1-token sequence with A = 1 and a 3-token one with A = -1, at ratio 1 (loss = -A)
    lp = torch.full((4,), -1.0)
    batch = SequenceBatch([torch.tensor([1, 2]), torch.tensor([1, 2, 3, 4])], [1, 1], {
        "old_logprobs_T": lp, "advantages_T": torch.tensor([1.0, -1.0, -1.0, -1.0]),
        "mask_T": torch.ones(4, dtype=torch.bool)})
    batch.num_global_tokens, batch.num_global_sequences = 4, 2
    losses = {mode: make_loss_fn(algorithm(f"loss_agg_mode={mode}"), max_response_tokens=4)(lp, batch)[0].item()
              for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")}
    assert losses == pytest.approx({"token-mean": 0.5, "seq-mean-token-mean": 0.0, "seq-mean-token-sum": 1.0,
                                    "seq-mean-token-sum-norm": 0.25})
    # drgrpo's preset picks the constant normaliser
    assert make_loss_fn(algorithm("name=drgrpo"), max_response_tokens=4)(lp, batch)[0].item() == pytest.approx(0.25)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "dapo", "rloo", "reinforce_pp", "gspo", "ppo"])
def test_every_preset_names_registered_functions(name):
    # the loader checks only user-chosen advantage / policy_loss names (the registries import torch)
    from megarl.config.presets import ALGORITHM_PRESETS

    assert name in ALGORITHM_PRESETS
    adv_fn, _, loss_fn = resolve(algorithm(f"name={name}"))
    assert callable(adv_fn) and callable(loss_fn)


def test_advantage_norm_by_std_gamma_and_lam_reach_the_estimator():
    from megarl.algorithms import ADVANTAGE_ESTIMATORS

    fn, opts, _ = resolve(algorithm("name=grpo"))
    assert fn is ADVANTAGE_ESTIMATORS["grpo"] and opts == {"norm_by_std": True}
    assert resolve(algorithm("name=grpo", "norm_adv_by_std=false"))[1] == {"norm_by_std": False}
    assert resolve(algorithm("name=drgrpo"))[1] == {"norm_by_std": False}
    fn, opts, _ = resolve(algorithm("name=grpo", "advantage=rloo"))
    assert fn is ADVANTAGE_ESTIMATORS["rloo"] and opts == {}
    assert resolve(algorithm("name=reinforce_pp", "gamma=0.9"))[1] == {"gamma": 0.9}
    assert resolve(algorithm("name=ppo", "gamma=0.9", "lam=0.8"))[1] == {"gamma": 0.9, "lam": 0.8}


# ---------------------------------------------------------------------------------------- trainer


def test_micro_batch_budget_and_flops_balance_cost():
    """trainer.balance_cost=flops weighs long sequences quadratically: on a skewed length set it
    balances the FLOPs of the DP ranks that the token cost leaves 8% apart."""
    from megarl.config.loader import model_hf_config
    from megarl.data.batching import budget_from_config, flops_coefficients, plan_batches
    from megarl.parallel import Topology

    hf = model_hf_config("fixture:smollm2")        # its config.json (the fixture is built offline)
    a, b = flops_coefficients(hf)
    assert (a, b) == (268959744.0, 34560.0)        # 2 x matmul params (+ logits) per token; causal QK, AV
    lengths = [6000, 3000, 3000, 1500, 1500, 1500, 1500, 1000, 1000]
    plans = {}
    for cost in ("tokens", "flops"):
        trainer = load_config(None, ["trainer.max_tokens_per_micro_batch=8192", f"trainer.balance_cost={cost}"]).trainer
        budget = budget_from_config(trainer, hf)
        assert (budget.cost, budget.max_tokens_per_micro_batch) == (cost, 8192)
        plans[cost] = plan_batches(lengths, Topology(world_size=2), budget)
        assert max(max(t) for t in plans[cost].micro_batch_tokens()) <= 8192

    def flops_spread(plan):
        loads = [sum(a * lengths[i] + b * lengths[i] ** 2 for mb in mbs for i in mb) for mbs in plan.micro_batches]
        return max(loads) / min(loads) - 1

    assert plans["tokens"].micro_batches != plans["flops"].micro_batches
    assert flops_spread(plans["tokens"]) > 0.15 and flops_spread(plans["flops"]) < 0.01
    with pytest.raises(ValueError, match="trainer.balance_cost='flops' needs the model's config.json"):
        budget_from_config(trainer, None)
    # 10000 tokens per rank: two micro-batches under 8192, one under a larger budget
    assert plans["tokens"].num_micro_batches == 2
    large = load_config(None, ["trainer.max_tokens_per_micro_batch=10000"]).trainer
    assert plan_batches(lengths, Topology(world_size=2), budget_from_config(large)).num_micro_batches == 1


@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-qwen3_moe", "tiny-deepseek_v3"])
def test_flops_cost_loads_for_every_family(fixture):
    cfg = load_config(None, [f"model.path=fixture:{fixture}", "trainer.balance_cost=flops"])
    assert cfg.trainer.balance_cost == "flops"


# ---------------------------------------------------------------------------------------- rollout


def test_rollout_keys_reach_the_vllm_engine(monkeypatch):
    import megarl.compat
    import megarl.rollout.vllm_engine as vllm_engine
    from megarl.rollout.build import make_rollout_llm

    seen = {}
    monkeypatch.setattr(vllm_engine, "make_llm", lambda path, **kwargs: seen.update(kwargs, path=path))
    cfg = load_config(None, ["topology.world_size=3", "rollout.tp=3", "rollout.kv_cache_gib=2", "rollout.gpu_memory_utilization=0.3",
                             "rollout.enforce_eager=false", "rollout.max_prompt_tokens=100",
                             "rollout.max_response_tokens=50", "model.dtype=bfloat16", "trainer.seed=7"])
    make_rollout_llm(cfg, "/models/x")
    assert {k: seen[k] for k in ("path", "tp", "dtype", "seed", "max_model_len", "kv_cache_gib",
                                 "gpu_memory_utilization", "enforce_eager")} == dict(
        path="/models/x", tp=3, dtype="bfloat16", seed=7, max_model_len=150, kv_cache_gib=2.0,
        gpu_memory_utilization=0.3, enforce_eager=False)
    assert "enable_sleep_mode" not in seen                   # CPU: vLLM has no sleep mode
    assert seen["enable_chunked_prefill"] is False           # CPU: seeded sampling cannot resume a split prefill
    # on GPU, colocated, rollout.sleep_level > 0 builds the engine with sleep mode; 0 and split do not
    monkeypatch.setattr(megarl.compat, "cuda_available", lambda: True)
    for overrides, sleeps in ((["rollout.sleep_level=1"], True), (["rollout.sleep_level=0"], False),
                              (["rollout.placement=split"], False)):
        seen.clear()
        make_rollout_llm(load_config(None, overrides), "/models/x")
        assert seen.get("enable_sleep_mode", False) is sleeps, overrides
        assert "enable_chunked_prefill" not in seen, overrides


def test_kv_cache_is_sized_from_the_batch_when_unset(tmp_path):
    """rollout.kv_cache_gib null: one engine's share of a step's samples at full length, in whole
    128-token blocks, x1.5 layout slack; x2 in the off-policy modes; an evaluation's share when
    larger; a floor of 16 MiB; an explicit value as given."""
    import json

    from megarl.rollout.build import kv_cache_gib

    (tmp_path / "config.json").write_text(json.dumps({   # SmolLM2-135M's attention shapes
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152}))
    base = ["rollout.max_prompt_tokens=192", "rollout.max_response_tokens=96", "data.prompts_per_step=8", "rollout.n=4"]
    per_token = 30 * 2 * 3 * 64 * 4                         # fp32 K and V, every layer
    gib = lambda *o: kv_cache_gib(load_config(None, base + list(o)), str(tmp_path)) * 2**30   # noqa: E731
    assert gib() == 32 * 384 * per_token * 1.5               # 288 tokens -> 3 blocks of 128
    assert gib("model.dtype=bfloat16") == gib() / 2
    assert gib("topology.world_size=2", "rollout.dp=2") == gib() / 2
    assert gib("trainer.mode=one_step_off") == 2 * gib()
    assert gib("trainer.eval_every=5", "data.eval_prompts=64") == 2 * gib()
    assert gib("data.prompts_per_step=1", "rollout.n=1", "rollout.max_prompt_tokens=8",
               "rollout.max_response_tokens=8") == 16 << 20
    assert gib("rollout.kv_cache_gib=0.25") == 2**28


def test_rollout_keys_set_the_sampling_params():
    from types import SimpleNamespace

    from megarl.rollout.sampling import sample

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm=False, lora_request=None):
            self.params = params
            out = SimpleNamespace(token_ids=[5], logprobs=[{5: SimpleNamespace(logprob=-0.5)}], finish_reason="length")
            return [SimpleNamespace(outputs=[out] * p.n) for p in params]

    cfg = load_config(None, ["rollout.n=3", "rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=20",
                             "rollout.max_response_tokens=33"]).rollout
    llm = FakeLLM()
    gens = sample(llm, cfg, [[1, 2], [3]], seeds=[11, 12])
    p = llm.params[1]
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (3, 0.7, 0.9, 20, 33, 12)
    assert [len(g) for g in gens] == [3, 3] and gens[0][0] == {"token_ids": [5], "logprobs": [-0.5], "clipped": True}
    sample(llm, cfg, [[1, 2]], seeds=[11], greedy=True)      # evaluation: one greedy sample
    assert (llm.params[0].n, llm.params[0].temperature) == (1, 0.0)


# ---------------------------------------------------------------------------------------- logging


def test_logging_sinks(tmp_path):
    import io

    from megarl.observability import MetricsLogger

    for stdout, jsonl in ((True, True), (False, False)):
        cfg = load_config(None, [f"logging.stdout={stdout}", f"logging.trackers=[{'jsonl' if jsonl else ''}]",
                                 "logging.progress=false"]).logging
        run_dir, stream = tmp_path / f"{stdout}-{jsonl}", io.StringIO()
        run_dir.mkdir()
        with MetricsLogger(run_dir, stdout=cfg.stdout, jsonl="jsonl" in cfg.trackers, tensorboard=False,
                           progress=cfg.progress, total_steps=1, stream=stream) as log:
            log.log(1, {"reward/mean": 0.5})
        assert ("0.5" in stream.getvalue()) is stdout
        assert (run_dir / "metrics.jsonl").exists() is jsonl


# ------------------------------------------------------------------------------ prompts and rewards


class FakeTokenizer:
    """A word -> the sum of its character codes (chat template: a leading 0); responses -> their length."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True):
        return [0] + self(messages[0]["content"]).input_ids

    def __call__(self, text):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=[sum(map(ord, w)) for w in text.split()])

    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(len(x)) for x in ids]


class FakeRewards:
    """``RewardPool.score``: reward 1 for responses of even length."""

    def __init__(self):
        self.calls = []

    def score(self, name, texts, answers, extras=None):
        from types import SimpleNamespace

        self.calls.append(name)
        return SimpleNamespace(rewards=[1.0 - int(t) % 2 for t in texts], n_errors=0, n_timeouts=0)


def rollouts(*overrides):
    """:class:`Rollouts` of a config whose engine answers responses of 4 and 4 tokens per prompt
    in the first round, 8 and 9 in later ones."""
    from megarl.driver.rollouts import Rollouts

    cfg = load_config(None, ["rollout.n=2", "data.prompts_per_step=2", "rollout.max_response_tokens=10", *overrides])
    calls = []

    def sample_fn(ids, seeds, greedy, on_done=None):
        calls.append((ids, seeds, greedy))
        lengths = (4, 4) if len(calls) == 1 else (8, 9)
        n = 1 if greedy else cfg.rollout.n
        return [[{"token_ids": [7] * lengths[j], "logprobs": [-1.0] * lengths[j], "clipped": False}
                 for j in range(n)] for _ in ids]

    return Rollouts(cfg, sample_fn, FakeTokenizer()), calls


def test_dynamic_sampling_and_overlong_shaping_of_the_dapo_preset():
    # dapo: round 1's groups all have equal rewards and are dropped, round 2's are kept; a response
    # of 9 tokens under max_response_tokens=10 with the preset's buffer of 2 loses half a point
    # (reward 0 - 0.5)
    r, calls = rollouts("algorithm.name=dapo")
    batch, m = r.collect(1, FakeRewards())
    assert len(calls) == 2 and m["rollout/num_samples"] == 4
    assert batch.rewards == [1.0, -0.5] * 2
    # grpo: one round, the equal groups are trained on, no shaping
    r, calls = rollouts("algorithm.name=grpo")
    batch, _ = r.collect(1, FakeRewards())
    assert len(calls) == 1 and batch.rewards == [1.0, 1.0] * 2
    # max_sampling_tries=1 stops after the first round: nothing informative is left
    r, _ = rollouts("algorithm.name=dapo", "algorithm.max_sampling_tries=1")
    with pytest.raises(RuntimeError, match="dynamic sampling kept no group in 1 rounds"):
        r.collect(1, FakeRewards())


def test_remax_greedy_baseline_and_pf_ppo_filtration():
    # remax: one greedy response per prompt (4 tokens: reward 1) after the samples (8 and 9 tokens),
    # generated on the same engines, scored, not trained on; its reward is every sample's baseline
    r, calls = rollouts("algorithm.name=remax")
    r.sample_fn = _lengths_by_call(r, [(8, 9), (4,)])
    batch, m = r.collect(1, FakeRewards())
    assert [c[2] for c in r.sample_fn.calls] == [False, True] and len(batch) == 4
    assert batch.baseline_rewards == [1.0] * 4 and batch.rewards == [1.0, 0.0] * 2
    assert m["remax/greedy_reward_mean"] == 1.0 and m["remax/greedy_length_mean"] == 4.0
    # pf_ppo (best_worst) of groups of 4 keeps each group's best and worst response
    r, _ = rollouts("algorithm.name=pf_ppo", "rollout.n=4")
    r.sample_fn = _lengths_by_call(r, [(5, 6, 7, 8)])
    batch, m = r.collect(1, FakeRewards())
    # rewards 0, 1, 0, 1 (even lengths): the best is the first 1 (6 tokens), the worst the first 0 (5)
    assert [len(x) for x in batch.response_ids] == [5, 6] * 2 and batch.group_ids == [0, 0, 1, 1]
    assert m["pf/kept_frac"] == 0.5 and m["rollout/num_samples"] == 4
    # best_random: the best plus a seeded random other one
    from megarl.data.batch import Rollout
    from megarl.driver.rollouts import filter_samples

    roll = Rollout([[1]] * 4, [[1]] * 4, [[0.0]] * 4, [0] * 4, [""] * 4, [False] * 4, rewards=[0.2, 0.9, 0.1, 0.9])
    kept, share = filter_samples(roll, "best_worst", seed=0)
    assert kept.rewards == [0.9, 0.1] and share == 0.5   # the first of equal bests
    picks = {tuple(filter_samples(roll, "best_random", seed=s)[0].rewards) for s in range(20)}
    assert picks <= {(0.2, 0.9), (0.9, 0.1), (0.9, 0.9)} and len(picks) > 1


def _lengths_by_call(r, lengths_per_call):
    """A sample_fn whose k-th call answers every prompt with responses of ``lengths_per_call[k]``."""
    n = r.cfg.rollout.n

    def sample_fn(ids, seeds, greedy, on_done=None):
        lengths = lengths_per_call[len(sample_fn.calls)]
        sample_fn.calls.append((ids, seeds, greedy))
        assert len(lengths) == (1 if greedy else n)
        return [[{"token_ids": [7] * k, "logprobs": [-1.0] * k, "clipped": False} for k in lengths] for _ in ids]

    sample_fn.calls = []
    return sample_fn


def test_data_and_seed_keys_choose_the_prompts_and_the_sampling_seeds(tmp_path):
    from megarl.tasks import PromptRecord, save_prompt_dataset

    def prompts(*overrides):
        r, calls = rollouts(*overrides)
        r.collect(1, FakeRewards())
        return calls[0][0], calls[0][1]

    ids, seeds = prompts()
    assert all(p[0] == 0 for p in ids)                                   # chat template
    assert all(p[0] != 0 for p in prompts("data.use_chat_template=false")[0])
    assert prompts("data.seed=1")[0] != ids and prompts("data.difficulty=3")[0] != ids
    assert prompts("trainer.seed=1")[1] != seeds and prompts("trainer.seed=1")[0] == ids
    data = tmp_path / "prompts.jsonl"
    save_prompt_dataset([PromptRecord(prompt="a bb ccc", answer="1", data_source="t")] * 3, data)
    assert prompts(f"data.task={data}")[0] == [[0, 97, 196, 297]] * 2
    # evaluation: data.eval_prompts greedy samples
    r, calls = rollouts("data.eval_prompts=5")
    rewards = FakeRewards()
    r.evaluate(rewards)
    assert len(calls[0][0]) == 5 and calls[0][2] is True
    assert rewards.calls == ["gsm8k"]                                    # data.reward names the function
