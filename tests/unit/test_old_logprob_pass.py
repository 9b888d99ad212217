"""The old-log-prob pass is skipped when a step updates the policy once
(:func:`megarl.config.passes.needs_old_logprob_pass`): which configs keep it, and the policy
loss that takes the training forward's own log-probs as the old ones (``make_loss_fn(...,
own_old_logprobs=True)``): ratio exactly 1, and exactly the loss and gradient of passing those
log-probs as ``old_logprobs_T``. The loop's side (who reads the forward's log-probs, the alarm
after the update) runs over a fake worker group in tests/unit/test_interrupt.py and on the real
stack in the e2e tests (the quickstart-like recipes there skip the pass)."""
import math

import pytest
import torch

from megarl.config import load_config
from megarl.config.passes import needs_old_logprob_pass
from megarl.actors.algorithm import make_loss_fn


@pytest.mark.parametrize("overrides", [
    [],                                                          # grpo, no KL
    ["algorithm.kl_coef=0.01"],                                  # KL loss, fixed coefficient: the reference pass runs
    ["algorithm.name=gspo", "algorithm.advantage=rloo", "algorithm.kl_coef=0.01"],   # the faults e2e recipe
    ["algorithm.name=ppo"],                                      # a critic: GAE reads the critic's own values pass
    ["algorithm.name=dapo", "algorithm.entropy_coef=0.01"],
    ["algorithm.name=reinforce_pp"],
    ["trainer.mode=one_step_off"],                               # the proximal policy is the current weights
    ["trainer.mode=async"],
    ["model.path=fixture:tiny-qwen3_moe"],                       # MoE without routing replay or vLLM routing
    ["algorithm.rollout_correction=tis"],                        # token-level tis: weights from the update's forward
    ["model.dtype=bfloat16"],                                    # tis by default, the same way
])
def test_one_update_per_step_skips_the_pass(overrides):
    assert needs_old_logprob_pass(load_config(None, overrides)) is False


@pytest.mark.parametrize("overrides", [
    ["algorithm.ppo_epochs=2"],                                  # later updates need the log-probs before the first
    ["algorithm.mini_batches=2"],
    ["algorithm.kl_coef=0.01", "algorithm.kl_mode=reward"],      # the KL shapes the advantages
    ["algorithm.kl_coef=0.01", "algorithm.kl_target=0.05"],      # adaptive: this step's KL sets this step's coefficient
    ["algorithm.rollout_correction=tis", "algorithm.correction_level=sequence"],   # a whole sequence's weight
    ["algorithm.rollout_correction=tis", "algorithm.ppo_epochs=2"],
    ["algorithm.rollout_correction=mask"],                       # masks change the loss's token counts
    ["algorithm.rollout_correction=icepop", "trainer.mode=one_step_off"],
    ["model.path=fixture:tiny-qwen3_moe", "algorithm.router_replay=r2"],   # records the routing there
    ["model.path=fixture:tiny-qwen3_moe", "algorithm.router_replay=r3"],   # compares with vLLM's routing there
    ["model.path=fixture:tiny-qwen3_moe", "rollout.return_routing=true"],
])
def test_what_needs_the_old_log_probs_before_the_update_keeps_the_pass(overrides):
    assert needs_old_logprob_pass(load_config(None, overrides)) is True


def test_the_quickstart_skips_the_pass():
    assert needs_old_logprob_pass(load_config("configs/quickstart.yaml")) is False


def _batch(extras: dict):
    """Two sequences of 3 and 2 response tokens, the last token masked out."""
    from megarl.policy import SequenceBatch

    batch = SequenceBatch([torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 3])], [1, 1], extras)
    batch.num_global_tokens, batch.num_global_sequences = 4, 2
    return batch


@pytest.mark.parametrize("overrides, kl_coef", [
    (["name=grpo"], 0.0),
    (["name=grpo", "dual_clip_c=3"], 0.0),
    (["name=gspo"], 0.0),                   # sequence ratios, a clip range of 3e-4 / 4e-4
    (["name=drgrpo"], 0.0),                 # seq-mean-token-sum-norm
    (["name=dapo", "entropy_coef=0.01"], 0.0),
    (["name=grpo", "kl_coef=0.1"], 0.1),    # a KL loss term against the reference
])
def test_own_old_logprobs_are_ratio_one_and_the_loss_and_gradient_of_passing_them(overrides, kl_coef):
    cfg = load_config(None, [f"algorithm.{o}" for o in overrides]).algorithm
    gen = torch.Generator().manual_seed(0)
    values = -torch.rand(5, generator=gen, dtype=torch.float64) * 3
    common = {"advantages_T": torch.tensor([1.5, 1.5, 1.5, -0.5, -0.5], dtype=torch.float64),
              "mask_T": torch.tensor([True, True, True, True, False]),
              "ref_logprobs_T": values - 0.3, "entropy_T": torch.full((5,), 2.0, dtype=torch.float64)}
    own_lp, given_lp = values.clone().requires_grad_(), values.clone().requires_grad_()
    loss, metrics = make_loss_fn(cfg, 8, kl_coef, own_old_logprobs=True)(own_lp, _batch(dict(common)))
    loss_given, metrics_given = make_loss_fn(cfg, 8, kl_coef)(
        given_lp, _batch({**common, "old_logprobs_T": values.clone()}))
    loss.backward()
    loss_given.backward()
    # exactly, not within a tolerance: the same arithmetic on the same numbers
    assert torch.equal(loss, loss_given) and torch.equal(own_lp.grad, given_lp.grad)
    assert {k: float(v) for k, v in metrics.items()} == {k: float(v) for k, v in metrics_given.items()}
    assert float(metrics["ratio_min"]) == float(metrics["ratio_max"]) == 1.0 and float(metrics["clip_frac"]) == 0.0
    assert float(metrics["approx_kl"]) == 0.0
    if overrides == ["name=grpo"]:   # at ratio 1 the clipped surrogate is REINFORCE: d loss / d lp_t = -A_t / tokens
        assert own_lp.grad.tolist() == pytest.approx([-1.5 / 4] * 3 + [0.5 / 4, 0.0], abs=1e-15)


def test_without_own_old_logprobs_the_old_ones_must_be_given():
    cfg = load_config(None, []).algorithm
    lp = torch.zeros(5, requires_grad=True)
    with pytest.raises(KeyError, match="old_logprobs_T"):
        make_loss_fn(cfg, 8)(lp, _batch({"advantages_T": torch.ones(5), "mask_T": torch.ones(5, dtype=torch.bool)}))


@pytest.mark.parametrize("dtype, expected", [("float32", "none"), ("bfloat16", "tis")])
def test_rollout_correction_defaults_to_tis_under_bf16(dtype, expected):
    assert load_config(None, [f"model.dtype={dtype}"]).algorithm.rollout_correction == expected
    explicit = load_config(None, [f"model.dtype={dtype}", "algorithm.rollout_correction=none"])
    assert explicit.algorithm.rollout_correction == "none"


@pytest.mark.parametrize("lp_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_tis_from_the_updates_forward_is_the_driver_path_exactly(lp_dtype, agg):
    """Token-level tis with one update per step: the loss computes the weights from its own
    forward's log-probs and vLLM's (``rollout_logprobs_T``) -- the same loss, gradient and metrics
    as the driver's path (a separate old-log-prob pass, :func:`correct_rollout`'s ``is_weights_T``
    and ``mask_T``, passed with those log-probs as ``old_logprobs_T``). Sample 0's second token
    has no vLLM log-prob (a tool result: NaN), two weights exceed the cap."""
    from megarl.algorithms.offpolicy import correct_rollout
    from megarl.config.passes import correction_in_forward

    cfg = load_config(None, ["algorithm.rollout_correction=tis", "algorithm.correction_cap=1.5",
                             f"algorithm.loss_agg_mode={agg}"]).algorithm
    assert correction_in_forward(cfg)
    train = [torch.tensor([-1.2, -0.7, -2.0], dtype=lp_dtype), torch.tensor([-0.3, -1.9], dtype=lp_dtype)]
    rollout = [[-1.0, float("nan"), -2.6], [-1.5, -2.1]]       # w = e^-0.2, -, e^0.6; e^1.2 (both capped), e^0.2
    loss_mask = torch.tensor([True, True, True, True, False])
    advantages = torch.tensor([1.5, 1.5, 1.5, -0.5, -0.5], dtype=lp_dtype)

    driver, metrics = correct_rollout(train, rollout, cfg)
    mask = torch.cat(driver["mask_T"]) & loss_mask
    given = {"old_logprobs_T": torch.cat(train), "is_weights_T": torch.cat(driver["is_weights_T"]),
             "advantages_T": advantages, "mask_T": mask}
    rollout_T = [torch.tensor(r, dtype=torch.float64) for r in rollout]
    own = {"rollout_logprobs_T": torch.cat(rollout_T), "advantages_T": advantages,
           "mask_T": torch.cat([~r.isnan() for r in rollout_T]) & loss_mask}
    assert torch.equal(own["mask_T"], mask) and mask.tolist() == [True, False, True, True, False]
    assert metrics["rollout_corr/weight_max"] == pytest.approx(1.5)

    def batch(extras):
        b = _batch(extras)
        b.num_global_tokens, b.num_global_sequences = int(mask.sum()), 2
        return b

    given_lp, own_lp = torch.cat(train).requires_grad_(), torch.cat(train).requires_grad_()
    loss_given, m_given = make_loss_fn(cfg, 8)(given_lp, batch(given))
    loss_own, m_own = make_loss_fn(cfg, 8, own_old_logprobs=True)(own_lp, batch(own))
    loss_given.backward()
    loss_own.backward()
    assert torch.equal(loss_own, loss_given) and torch.equal(own_lp.grad, given_lp.grad)
    assert {k: float(v) for k, v in m_own.items()} == {k: float(v) for k, v in m_given.items()}
    # at ratio 1 the token-mean loss's gradient is -A_t * w_t / tokens, zero where masked
    if agg == "token-mean":
        w = [math.exp(-0.2), 0.0, 1.5, 1.5, 0.0]
        expected = [-a * x / 3 for a, x in zip([1.5, 1.5, 1.5, -0.5, -0.5], w)]
        assert own_lp.grad.tolist() == pytest.approx(expected, rel=1e-6)
