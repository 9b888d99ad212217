"""Controller helpers without engines: rollout bookkeeping, plan round trip, alarm, algorithms."""
import pytest
import torch

from megarl.config.presets import resolve_algorithm
from megarl.config.schema import AlgorithmConfig
from megarl.data import BatchBudget, plan_batches
from megarl.parallel import Topology
from megarl.actors.algorithm import make_loss_fn, make_value_loss_fn, needs_critic, resolve
from megarl.data.batch import Rollout, compute_advantages, micro_batches_for, scatter_back
from megarl.driver.loop import WeightSyncAlarm, alarm_metrics, critic_metrics


def algorithm(**fields) -> AlgorithmConfig:
    """An algorithm section with its preset resolved, as load_config gives it."""
    return resolve_algorithm(AlgorithmConfig(**fields), max_response_tokens=8)


def rollout_of(response_lengths, rewards, n=2):
    gens = [[{"token_ids": list(range(10, 10 + L)), "logprobs": [-1.0] * L, "clipped": L >= 5}
             for L in response_lengths[i:i + n]] for i in range(0, len(response_lengths), n)]
    r = Rollout.from_generations([[1, 2, 3]] * len(gens), [str(i) for i in range(len(gens))], gens)
    r.rewards = list(rewards)
    return r


def test_from_generations_is_prompt_major():
    r = rollout_of([2, 3, 4, 5], [0, 1, 1, 1])
    assert r.group_ids == [0, 0, 1, 1] and r.answers == ["0", "0", "1", "1"]
    assert r.clipped == [False, False, False, True]
    assert r.lengths() == [5, 6, 7, 8]
    assert r.cu_seqlens_N1().tolist() == [0, 2, 5, 9, 14]


def test_select_and_concat_keep_every_field_aligned():
    gens = [[{"token_ids": [10 + i] * (i + 1), "logprobs": [-1.0] * (i + 1), "clipped": False}] * 2 for i in range(3)]
    r = Rollout.from_generations([[i] for i in range(3)], ["a", "b", "c"], gens, [{"k": i} for i in range(3)])
    assert r.extras == [{"k": 0}, {"k": 0}, {"k": 1}, {"k": 1}, {"k": 2}, {"k": 2}]
    picked = r.select([5, 2])
    assert picked.prompt_ids == [[2], [1]] and picked.answers == ["c", "b"] and picked.extras == [{"k": 2}, {"k": 1}]
    assert picked.rewards == []                    # not scored yet: stays empty
    r.rewards = [float(i) for i in range(6)]
    both = r.select([0]).concat(r.select([4, 3]))
    assert both.response_ids == [[10], [12, 12, 12], [11, 11]] and both.rewards == [0.0, 4.0, 3.0]
    assert both.extras == [{"k": 0}, {"k": 2}, {"k": 1}] and len(both) == 3
    assert Rollout.from_generations([[1]], ["a"], gens[:1]).extras == []   # built without extras


class LetterTokenizer:
    """Prompt text -> its character codes; response ids -> that many letters (no chat template)."""

    def __call__(self, text):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["x" * len(x) for x in ids]


def test_extra_columns_reach_the_reward_through_dynamic_sampling(tmp_path, monkeypatch):
    # A jsonl column `bonus` reaches rewards_for_tests.column_reward (bonus + parity of the response
    # length), with data_source, in the spawned reward workers; the `note` column is left out (the
    # function does not take it). DAPO keeps the informative group of each round: select + concat.
    from pathlib import Path

    from helpers import write_jsonl

    from megarl.config import load_config
    from megarl.rewards import RewardPool
    from megarl.driver.rollouts import Rollouts

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "e2e"))   # rewards_for_tests, for the workers too
    data = tmp_path / "prompts.jsonl"
    write_jsonl(data, [{"prompt": f"q{i}", "answer": "", "data_source": "t", "bonus": 10 * i, "note": "unused"}
                       for i in range(4)])
    cfg = load_config(None, [f"data.task={data}", "data.reward=rewards_for_tests:column_reward", "rollout.n=2",
                             "data.prompts_per_step=2", "data.use_chat_template=false", "algorithm.name=dapo",
                             "rollout.max_response_tokens=10"])
    rounds = []

    def sample_fn(ids, seeds, greedy, on_done=None):   # per round: prompt 1's samples differ in length, 2's not
        rounds.append(ids)
        return [[{"token_ids": [7] * L, "logprobs": [-1.0] * L, "clipped": False} for L in lengths]
                for lengths in ((4, 5), (4, 4))]

    with RewardPool(num_workers=1, timeout_s=10.0) as pool:
        batch, m = Rollouts(cfg, sample_fn, LetterTokenizer()).collect(1, pool)
    assert len(rounds) == 2 and m["reward/errors"] == 0 and len(batch) == 4
    bonus_of = {tuple(ord(c) for c in f"q{i}"): 10 * i for i in range(4)}
    assert [e["bonus"] for e in batch.extras] == [bonus_of[tuple(p)] for p in batch.prompt_ids]
    assert batch.rewards == [e["bonus"] + len(r) % 2 for e, r in zip(batch.extras, batch.response_ids)]
    assert batch.extras[0] == {"data_source": "t", "bonus": batch.extras[0]["bonus"], "note": "unused"}


def test_overlong_prompts_are_refused_or_dropped_and_counted(tmp_path, caplog):
    """data.overlong_prompts: error names the file, the rows and the limit when the run starts
    (preflight says it first: tests/unit/test_preflight.py); skip drops those rows from every
    epoch, logs how many, and the others keep their uid (their row)."""
    import logging

    from helpers import write_jsonl

    from megarl.config import load_config
    from megarl.driver.rollouts import Rollouts

    data = tmp_path / "prompts.jsonl"
    write_jsonl(data, [{"prompt": "q" * (30 if i in (1, 4, 6) else 5), "answer": "", "data_source": "t"}
                       for i in range(8)])
    over = [f"data.task={data}", "data.use_chat_template=false", "rollout.max_prompt_tokens=20",
            "data.prompts_per_step=5"]
    with pytest.raises(ValueError, match=r"3 of 8 prompts in .*prompts.jsonl have more than "
                                         r"rollout.max_prompt_tokens=20 tokens: row 1 \(30 tokens\), row 4"):
        Rollouts(load_config(None, over), None, LetterTokenizer())
    with caplog.at_level(logging.INFO, logger="megarl"):
        rollouts = Rollouts(load_config(None, over + ["data.overlong_prompts=skip"]), None, LetterTokenizer())
    assert rollouts.dropped_prompts == 3 and "dropped 3 of 8 prompts" in caplog.text
    seen = [r.uid for step in (1, 2) for r in rollouts.prompts.batch(step, 5)]   # 10 = an epoch of 5 and more
    assert sorted(set(seen)) == ["0", "2", "3", "5", "7"] and len(rollouts.encode(
        [r for step in (1, 2) for r in rollouts.prompts.batch(step, 5)])) == 10


def test_grpo_advantages_per_sample():
    # group 0 rewards (0, 1): mean 0.5, sample std sqrt(0.5) = 0.7071 -> (-0.7071, +0.7071);
    # group 1 all equal -> 0
    r = rollout_of([2, 3, 4, 5], [0, 1, 1, 1])
    adv_fn, opts, _ = resolve(algorithm(name="grpo"))
    adv, _ = compute_advantages(r, adv_fn, opts)
    assert [a.shape[0] for a in adv] == [2, 3, 4, 5]
    assert torch.allclose(adv[0], torch.full((2,), -0.5 / 0.5 ** 0.5), atol=1e-4)
    assert torch.allclose(adv[1], torch.full((3,), 0.5 / 0.5 ** 0.5), atol=1e-4)
    assert adv[2].abs().max() == 0 and adv[3].abs().max() == 0


@pytest.mark.parametrize("dp", [1, 2])
def test_micro_batches_and_scatter_back_round_trip(dp):
    r = rollout_of([2, 7, 4, 5, 1, 3], [0, 1, 1, 0, 1, 1])
    topo = Topology(world_size=dp)
    plan = plan_batches(r.lengths(), topo, BatchBudget(max_tokens_per_micro_batch=16))
    values = [torch.arange(len(x), dtype=torch.float32) + 100 * i for i, x in enumerate(r.response_ids)]
    outs = {}
    for rank in range(dp):
        batches = micro_batches_for(r, plan, rank, {"v_T": values})
        for b in batches:                        # every sequence = prompt + its response
            assert all(int(ids[:3].sum()) == 6 for ids in b.input_ids) and b.prompt_lengths == [3] * len(b.input_ids)
            assert sum(int(x.numel()) for x in b.input_ids) <= 16
        outs[rank] = [b.extras["v_T"] for b in batches]
    back = scatter_back(r, plan, outs)
    assert all(torch.equal(a, b) for a, b in zip(back, values))


def test_alarm_reports_and_stops():
    r = rollout_of([2, 2], [0, 1])
    close = [torch.full((2,), -1.0 + 1e-6), torch.full((2,), -1.0)]
    m = alarm_metrics(r, close, threshold=0.01)
    assert m["rollout/logprob_diff_max"] == pytest.approx(1e-6, abs=1e-7)   # fp32 rounding of -1 + 1e-6
    far = [torch.full((2,), -1.5), torch.full((2,), -1.0)]
    with pytest.raises(WeightSyncAlarm, match=r"mean \|vLLM - Megatron\| log-prob of sampled tokens is 0.25 "
                                               r"\(max 0.5\) > trainer.logprob_diff_threshold=0.01"):
        alarm_metrics(r, far, threshold=0.01)


def test_loss_fn_at_ratio_one_is_minus_mean_advantage():
    from megarl.policy import SequenceBatch

    cfg = algorithm(name="grpo", kl_coef=0.0)
    loss_fn = make_loss_fn(cfg, max_response_tokens=8)
    lp = torch.tensor([-1.0, -2.0, -0.5])
    batch = SequenceBatch([torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7])], [1, 3],
                          {"old_logprobs_T": lp.clone(), "advantages_T": torch.tensor([1.0, 1.0, -0.5]),
                           "mask_T": torch.ones(3, dtype=torch.bool)})
    batch.num_global_tokens, batch.num_global_sequences = 3, 2
    loss, metrics = loss_fn(lp, batch)
    assert loss.item() == pytest.approx(-(1.0 + 1.0 - 0.5) / 3)     # token-mean of -A at ratio 1
    assert float(metrics["clip_frac"]) == 0.0


def test_ppo_uses_gae_with_the_critic_values():
    # rewards 1 and 0 at the last token, gamma = lam = 1: A_t = R - V_t before whitening over the
    # batch, returns = A + V = R on every token
    cfg = algorithm(name="ppo", gamma=1.0, lam=1.0)
    assert needs_critic(cfg) and not needs_critic(algorithm(name="grpo"))
    adv_fn, opts, _ = resolve(cfg)
    assert opts == {"gamma": 1.0, "lam": 1.0}
    r = rollout_of([3, 2], [1.0, 0.0])
    values = [torch.tensor([0.5, 0.25, 0.0]), torch.tensor([0.2, 0.1])]
    adv, returns = compute_advantages(r, adv_fn, opts, values=values)
    assert torch.allclose(returns[0], torch.ones(3)) and torch.allclose(returns[1], torch.zeros(2))
    raw = torch.tensor([0.5, 0.75, 1.0, -0.2, -0.1])                  # returns - values
    expect = (raw - raw.mean()) / raw.std()
    assert torch.allclose(torch.cat(adv), expect, atol=1e-5)
    m = critic_metrics(values, returns)
    assert m["critic/returns_mean"] == pytest.approx(0.6)
    assert m["critic/explained_variance"] == pytest.approx(1 - raw.double().var(unbiased=False).item() /
                                                           torch.tensor([1., 1, 1, 0, 0]).var(unbiased=False).item())


def test_kl_penalty_as_token_reward_lowers_grpo_scores():
    # kl_mode=reward: the outcome estimators add the summed token rewards to each sequence's score
    r = rollout_of([2, 2], [1.0, 1.0])
    adv_fn, opts, _ = resolve(algorithm(name="grpo"))
    adv, _ = compute_advantages(r, adv_fn, opts, token_rewards=[torch.tensor([-0.1, -0.1]), torch.zeros(2)])
    assert (adv[0] < 0).all() and (adv[1] > 0).all()


def test_value_loss_fn_clips_around_old_values():
    from megarl.policy import SequenceBatch

    cfg = algorithm(name="ppo", value_clip=0.1)
    loss_fn = make_value_loss_fn(cfg, max_response_tokens=8)
    batch = SequenceBatch([torch.tensor([1, 2, 3])], [1],
                          {"old_values_T": torch.tensor([0.0, 0.0]), "returns_T": torch.tensor([1.0, 1.0]),
                           "mask_T": torch.ones(2, dtype=torch.bool)})
    batch.num_global_tokens, batch.num_global_sequences = 2, 1
    loss, metrics = loss_fn(torch.tensor([0.5, 0.5]), batch)
    # unclipped (0.5-1)^2 = 0.25, clipped (0.1-1)^2 = 0.81: max -> 0.81, times 0.5
    assert loss.item() == pytest.approx(0.405)
    assert float(metrics["vf_clip_frac"]) == 1.0
