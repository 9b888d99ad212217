"""Config errors name the full key path, the bad value and what is expected (exact text)."""
from pathlib import Path

import pytest
import yaml

from megarl.config import ConfigError, load_config, save_resolved
from megarl.config.docs import field_docs
from megarl.config.schema import MegaRLConfig, SECTIONS

REPO = Path(__file__).resolve().parents[2]


def error_of(overrides, recipe=None):
    with pytest.raises(ConfigError) as exc:
        load_config(recipe, overrides)
    return str(exc.value)


def test_unknown_key_suggests_closest():
    assert error_of(["trainer.stpes=5"]) == \
        "unknown config key 'trainer.stpes' (did you mean 'trainer.steps'?)"


def test_unknown_section_suggests_closest():
    assert error_of(["algoritm.name=grpo"]) == \
        "unknown config key 'algoritm' (did you mean 'algorithm'?)"


def test_wrong_type_names_key_value_and_type():
    assert error_of(["trainer.steps=abc"]) == \
        "wrong type for config key 'trainer.steps': got 'abc' (str), expected int"
    assert error_of(["topology.sp=3"]) == \
        "wrong type for config key 'topology.sp': got 3 (int), expected bool"


def test_invalid_choice():
    assert error_of(["algorithm.name=foo"]) == (
        "invalid value for config key 'algorithm.name': got 'foo', expected one of 'grpo', 'drgrpo', "
        "'dapo', 'ppo', 'rloo', 'reinforce_pp', 'gspo', 'remax', 'gpg', 'opo', 'cispo', 'sapo', 'gmpo', 'clip_cov', "
        "'kl_cov', 'grpo_passk', 'reinforce_pp_baseline', 'pf_ppo'")


def test_tp_that_does_not_divide_heads():
    # SmolLM2-135M has 9 attention heads and 3 KV heads
    msg = error_of(["model.path=fixture:tiny-qwen2", "topology.world_size=3", "topology.tp=3"])
    assert msg == ("invalid value for config key 'topology.tp': got 3, expected a divisor of "
                   "num_attention_heads=8 (model fixture:tiny-qwen2)")


def test_kv_heads_constraint():
    msg = error_of(["model.path=fixture:tiny-qwen2", "topology.world_size=8", "topology.tp=8"])
    assert msg == ("invalid value for config key 'topology.tp': got 8, expected a divisor of "
                   "num_key_value_heads=4 (megatron does not replicate KV heads) (model fixture:tiny-qwen2)")


def test_experts_and_layers_constraints():
    assert error_of(["model.path=fixture:tiny-qwen3_moe", "topology.world_size=3", "topology.ep=3"]) == (
        "invalid value for config key 'topology.ep': got 3, expected a divisor of the number of experts (8) "
        "(model fixture:tiny-qwen3_moe)")
    assert error_of(["model.path=fixture:tiny-llama", "topology.world_size=4", "topology.pp=4"]) == (
        "invalid value for config key 'topology.pp': got 4, expected pp*vpp (= 4) dividing "
        "num_hidden_layers=2; no topology.first_stage_layers / last_stage_layers pair splits 2 layers over pp=4 "
        "either (every stage needs at least one layer) (model fixture:tiny-llama)")


def test_section_rules():
    assert error_of(["topology.world_size=2", "topology.sp=true"]) == (
        "invalid value for config key 'topology.sp': got True, expected false when tp == 1 "
        "(sequence parallelism needs tp > 1)")
    assert error_of(["topology.tp=2"]) == (
        "invalid value for config key 'topology.world_size': got 1, expected a multiple of "
        "tp*cp*pp = 2*1*1 = 2")
    assert error_of(["rollout.top_p=1.5"]) == \
        "invalid value for config key 'rollout.top_p': got 1.5, expected a number in (0, 1]"
    assert error_of(["trainer.lr=1e-6", "trainer.min_lr=1e-5"]) == \
        "invalid value for config key 'trainer.min_lr': got 1e-05, expected a value <= lr (1e-06)"
    assert error_of(["rollout.sleep_level=3"]) == \
        "invalid value for config key 'rollout.sleep_level': got 3, expected 0 (off), 1 or 2"
    assert error_of(["rollout.placement=split", "trainer.offload_train_state=true"]) == (
        "invalid value for config key 'trainer.offload_train_state': got True, expected false with "
        "rollout.placement='split' (training and rollout do not share devices: nothing to make room for)")
    assert error_of(["trainer.mode=one_step_off", "trainer.offload_train_state=true"]) == (
        "invalid value for config key 'trainer.offload_train_state': got True, expected false with "
        "trainer.mode='one_step_off' (the engines generate while Megatron trains: its state stays on the devices)")
    assert error_of(["trainer.optimizer=sgd", "trainer.optimizer_offload=true"]) == (
        "invalid value for config key 'trainer.optimizer_offload': got True, expected false with "
        "trainer.optimizer='sgd' (megatron-core offloads its distributed optimizer, which wraps adam only)")
    assert error_of(["rollout.weight_noise_std=0.1", "bridge.verify=true"]).startswith(
        "invalid value for config key 'rollout.weight_noise_std': got 0.1, expected 0 with bridge.verify=true")
    assert error_of(["trainer.max_staleness=-1"]) == \
        "invalid value for config key 'trainer.max_staleness': got -1, expected a non-negative number"
    assert error_of(["algorithm.value_clip=0"]) == \
        "invalid value for config key 'algorithm.value_clip': got 0.0, expected null or a number > 0"


def test_bad_override_and_missing_file(tmp_path):
    assert error_of(["trainer"]) == "override 'trainer' is not of the form section.field=value"
    missing = tmp_path / "nope.yaml"
    assert error_of([], recipe=missing) == f"config file '{missing}' not found"


def test_yaml_unknown_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  temprature: 0.7\n")
    assert error_of([], recipe=recipe) == \
        "unknown config key 'rollout.temprature' (did you mean 'rollout.temperature'?)"


def test_overrides_apply_and_resolved_config_is_written(tmp_path):
    cfg = load_config(REPO / "configs" / "quickstart.yaml",
                      ["trainer.steps=5", f"trainer.run_dir={tmp_path}", "rollout.temperature=0.5"])
    assert (cfg.trainer.steps, cfg.rollout.temperature, cfg.model.path) == (5, 0.5, "fixture:smollm2")
    assert isinstance(cfg.trainer.lr, float)
    written = yaml.safe_load(save_resolved(cfg, cfg.trainer.run_dir).read_text())
    assert written["trainer"]["steps"] == 5 and written["rollout"]["temperature"] == 0.5
    assert set(written) == set(SECTIONS)
    # the written file loads back to the same config
    assert load_config(tmp_path / "config.yaml") == cfg


def test_every_recipe_in_configs_is_valid():
    recipes = sorted((REPO / "configs").glob("*.yaml"))
    assert recipes
    for recipe in recipes:
        cfg = load_config(recipe, check_model=False)
        # the pipeline's later stages start from an earlier stage's export (runs/...): checked on the
        # model it is made from
        overrides = ["model.path=fixture:smollm2"] if cfg.model.path.startswith("runs/") else []
        assert isinstance(load_config(recipe, overrides), MegaRLConfig), recipe


def test_every_field_has_a_docstring():
    import dataclasses
    import typing
    for section in dataclasses.fields(MegaRLConfig):
        cls = typing.get_type_hints(MegaRLConfig)[section.name]
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, (section.name, missing)


@pytest.mark.parametrize("old, new, value", [
    ("rollout.offload_train_state", "trainer.offload_train_state", "true"),
    ("data.max_tokens_per_micro_batch", "trainer.max_tokens_per_micro_batch", "1024"),
    ("data.balance_cost", "trainer.balance_cost", "flops"),
])
def test_moved_keys_name_their_new_key(tmp_path, old, new, value):
    message = f"config key '{old}' moved to '{new}'"
    assert error_of([f"{old}={value}"]) == message
    section, field = old.split(".")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"{section}:\n  {field}: {value}\n")
    assert error_of([], recipe=recipe) == message
    assert load_config(None, [f"{new}={value}"]) is not None


def test_dtype_float16_is_refused_and_every_allowed_dtype_builds():
    import typing

    from megarl.config.schema import ModelConfig
    from megarl.policy.build import ModelOptions

    assert error_of(["model.dtype=float16"]) == (
        "invalid value for config key 'model.dtype': got 'float16', expected one of 'float32', 'bfloat16', 'auto'")
    for dtype in typing.get_args(typing.get_type_hints(ModelConfig)["dtype"]):
        cfg = load_config(None, [f"model.dtype={dtype}"])
        # the engine takes it; auto is resolved to a concrete dtype at load (tests/unit/test_precision_auto.py)
        assert ModelOptions(path=cfg.model.path, dtype=cfg.model.dtype).dtype == cfg.model.dtype
        assert cfg.model.dtype == dtype or (dtype == "auto" and cfg.model.dtype in ("float32", "bfloat16"))


def test_logging_level_is_validated():
    assert load_config(None, ["logging.level=debug"]).logging.level == "debug"
    assert error_of(["logging.level=verbose"]) == (
        "invalid value for config key 'logging.level': got 'verbose', expected one of 'debug', 'info', "
        "'warning', 'error'")


def test_dapo_preset_turns_on_its_parts_and_each_stays_overridable(tmp_path):
    a = load_config(None, ["algorithm.name=dapo", "rollout.max_response_tokens=100"]).algorithm
    assert (a.advantage, a.policy_loss, a.clip_low, a.clip_high, a.loss_agg_mode, a.norm_adv_by_std,
            a.dynamic_sampling, a.overlong_buffer, a.kl_coef) == \
        ("grpo", "ppo", 0.2, 0.28, "token-mean", True, True, 20, 0.0)
    # overlong buffer: a fifth of the response limit, at least one token
    assert load_config(None, ["algorithm.name=dapo", "rollout.max_response_tokens=3"]).algorithm.overlong_buffer == 1
    # an explicit value wins over the preset, for each of DAPO's parts
    a = load_config(None, ["algorithm.name=dapo", "algorithm.clip_high=0.3", "algorithm.dynamic_sampling=false",
                           "algorithm.overlong_buffer=0", "algorithm.loss_agg_mode=seq-mean-token-mean",
                           "algorithm.kl_coef=0.01"]).algorithm
    assert (a.clip_high, a.dynamic_sampling, a.overlong_buffer, a.loss_agg_mode, a.kl_coef) == \
        (0.3, False, 0, "seq-mean-token-mean", 0.01)
    # the written config shows the effective values and loads back to the same config
    cfg = load_config(None, ["algorithm.name=dapo", f"trainer.run_dir={tmp_path}"])
    written = yaml.safe_load(save_resolved(cfg, tmp_path).read_text())["algorithm"]
    assert (written["clip_high"], written["dynamic_sampling"], written["overlong_buffer"]) == (0.28, True, 25)
    assert load_config(tmp_path / "config.yaml") == cfg


# name -> (advantage, policy_loss, norm_adv_by_std, loss_agg_mode, clip_low, clip_high, dynamic_sampling,
# overlong_buffer) at rollout.max_response_tokens=128; every name but drgrpo and dapo as before presets
PRESETS = {
    "grpo": ("grpo", "ppo", True, "token-mean", 0.2, 0.2, False, 0),
    "drgrpo": ("drgrpo", "ppo", False, "seq-mean-token-sum-norm", 0.2, 0.2, False, 0),
    "dapo": ("grpo", "ppo", True, "token-mean", 0.2, 0.28, True, 25),
    "rloo": ("rloo", "ppo", None, "token-mean", 0.2, 0.2, False, 0),
    "reinforce_pp": ("reinforce_pp", "ppo", None, "token-mean", 0.2, 0.2, False, 0),
    "gspo": ("grpo", "gspo", True, "token-mean", 3e-4, 4e-4, False, 0),
    "ppo": ("gae", "ppo", None, "token-mean", 0.2, 0.2, False, 0),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_algorithm_presets(name):
    a = load_config(None, [f"algorithm.name={name}"]).algorithm
    assert (a.advantage, a.policy_loss, a.norm_adv_by_std, a.loss_agg_mode, a.clip_low, a.clip_high,
            a.dynamic_sampling, a.overlong_buffer) == PRESETS[name]


def test_preset_follows_overridden_policy_loss_and_advantage():
    a = load_config(None, ["algorithm.name=grpo", "algorithm.policy_loss=gspo"]).algorithm
    assert (a.clip_low, a.clip_high) == (3e-4, 4e-4)            # the clip range of the gspo loss
    a = load_config(None, ["algorithm.name=dapo", "algorithm.policy_loss=gspo"]).algorithm
    assert (a.clip_low, a.clip_high) == (3e-4, 4e-4)            # dapo's 0.28 is for token ratios
    a = load_config(None, ["algorithm.name=gspo", "algorithm.advantage=rloo"]).algorithm
    assert a.norm_adv_by_std is None                            # no std division in rloo
    a = load_config(None, ["algorithm.name=drgrpo", "algorithm.norm_adv_by_std=true"]).algorithm
    assert (a.advantage, a.norm_adv_by_std) == ("drgrpo", True)


def test_algorithm_combinations_that_would_do_nothing_fail_at_load():
    assert error_of(["algorithm.name=rloo", "algorithm.norm_adv_by_std=false"]) == (
        "invalid value for config key 'algorithm.norm_adv_by_std': got False, expected null with "
        "algorithm.advantage='rloo' (only the grpo and drgrpo advantages divide by the group std)")
    assert error_of(["algorithm.name=gspo", "algorithm.dual_clip_c=3"]) == (
        "invalid value for config key 'algorithm.dual_clip_c': got 3.0, expected null with "
        "algorithm.policy_loss='gspo' (dual-clip is an option of the ppo loss)")
    assert error_of(["algorithm.name=cispo", "algorithm.dual_clip_c=3"]).endswith(
        "null with algorithm.policy_loss='cispo' (dual-clip is an option of the ppo loss)")
    # the algorithm-breadth options: out of range, named
    assert error_of(["algorithm.cov_low=5"]) == \
        "invalid value for config key 'algorithm.cov_low': got 5.0, expected less than cov_high=5.0"
    assert error_of(["algorithm.cov_clip_ratio=2"]) == \
        "invalid value for config key 'algorithm.cov_clip_ratio': got 2.0, expected a share of tokens in (0, 1]"
    assert error_of(["algorithm.kl_cov_ratio=0"]) == \
        "invalid value for config key 'algorithm.kl_cov_ratio': got 0.0, expected a positive number"
    assert error_of(["algorithm.tau_neg=-1"]) == \
        "invalid value for config key 'algorithm.tau_neg': got -1.0, expected a positive number"
    assert error_of(["algorithm.kl_cov_coef=-1"]) == \
        "invalid value for config key 'algorithm.kl_cov_coef': got -1.0, expected a non-negative number"
    assert error_of(["algorithm.tau_pos=0"]).endswith("expected a positive number")
    assert error_of(["algorithm.cov_high=0.5"]).endswith("expected less than cov_high=0.5")
    assert error_of(["algorithm.name=pf_ppo", "rollout.n=1"]) == (
        "invalid value for config key 'algorithm.sample_filter': got 'best_worst', expected 'none' with "
        "rollout.n=1 (it keeps 2 of each prompt's responses)")
    assert error_of(["algorithm.sample_filter=best_random", "trainer.mode=async"]).startswith(
        "invalid value for config key 'algorithm.sample_filter': got 'best_random', expected 'none' with "
        "trainer.mode='async'")
    assert error_of(["algorithm.name=remax", "trainer.mode=async"]).startswith(
        "invalid value for config key 'trainer.mode': got 'async', expected on_policy or one_step_off with "
        "algorithm.advantage='remax'")
    assert error_of(["algorithm.critic_lr=1e-5"]) == (
        "invalid value for config key 'algorithm.critic_lr': got 1e-05, expected null with "
        "algorithm.advantage='grpo' (only the gae advantage trains a critic)")
    assert error_of(["algorithm.dual_clip_c=1"]) == \
        "invalid value for config key 'algorithm.dual_clip_c': got 1.0, expected null or a number > 1"
    assert error_of(["algorithm.kl_target=0.1"]) == (
        "invalid value for config key 'algorithm.kl_target': got 0.1, expected null while kl_coef is 0 "
        "(the adaptive controller scales kl_coef: set an initial kl_coef > 0)")
    assert load_config(None, ["algorithm.kl_target=0.1", "algorithm.kl_coef=0.01"]).algorithm.kl_target == 0.1
    assert error_of(["algorithm.name=dapo", "algorithm.overlong_buffer=200"]) == (
        "invalid value for config key 'algorithm.overlong_buffer': got 200, expected at most "
        "rollout.max_response_tokens=128 (the soft penalty starts this many tokens before the limit)")
    assert error_of(["algorithm.clip_low=1.5"]) == \
        "invalid value for config key 'algorithm.clip_low': got 1.5, expected a number in (0, 1] (1: no lower bound)"
    assert error_of(["algorithm.clip_high=-0.1"]) == \
        "invalid value for config key 'algorithm.clip_high': got -0.1, expected a positive number"


def test_function_names_are_resolved_at_load():
    assert error_of(["algorithm.policy_loss=ppo2"]) == (
        "invalid value for config key 'algorithm.policy_loss': unknown policy loss 'ppo2'; known: "
        "['cispo', 'clip_cov', 'geo_mean', 'gpg', 'gspo', 'kl_cov', 'ppo', 'sapo'] (or a dotted path "
        "'package.module:function')")
    assert error_of(["algorithm.advantage=grpoo"]).startswith(
        "invalid value for config key 'algorithm.advantage': unknown advantage estimator 'grpoo'; known: ")
    assert error_of(["data.reward=nope"]).startswith(
        "invalid value for config key 'data.reward': unknown reward function 'nope'; known: ")
    assert error_of(["data.reward=no_such_module:fn"]).startswith(
        "invalid value for config key 'data.reward': cannot import module 'no_such_module'")


@pytest.mark.parametrize("override, expected", [
    ("rollout.top_k=0", "got 0, expected -1 (disabled) or a positive integer"),
    ("rollout.kv_cache_gib=0", "got 0.0, expected a positive number"),
    ("rollout.gpu_memory_utilization=1.5", "got 1.5, expected a number in (0, 1]"),
    ("rollout.tp=0", "got 0, expected a positive number"),
    ("rollout.dp=0", "got 0, expected a positive number"),
    ("rollout.engine_timeout_s=0", "got 0.0, expected a positive number"),
    ("rollout.engine_restarts=-1", "got -1, expected a non-negative number"),
    ("rollout.ep=3", "got 3, expected 1 or rollout.tp=1 (vLLM's expert parallelism spans an engine's TP ranks)"),
    ("rollout.enforce_eager=3", None),
    ("model.recompute=layer", "got 'layer', expected one of 'none', 'selective', 'full'"),
    ("model.moe_aux_loss_coeff=-1", "got -1.0, expected a non-negative number"),
    ("model.moe_z_loss_coeff=-1", "got -1.0, expected a non-negative number"),
    ("algorithm.kl_estimator=k4", "got 'k4', expected one of 'k1', 'k2', 'k3'"),
    ("algorithm.loss_agg_mode=mean", "got 'mean', expected one of 'token-mean', 'seq-mean-token-sum', "
                                     "'seq-mean-token-mean', 'seq-mean-token-sum-norm'"),
    ("algorithm.dynamic_sampling=3", None),
    ("algorithm.entropy_coef=-0.1", "got -0.1, expected a non-negative number"),
    ("data.task=prompts.csv", "got 'prompts.csv', expected 'arithmetic', 'calculator' or a path ending in .parquet or .jsonl"),
    ("data.difficulty=0", "got 0, expected a positive number"),
    ("data.reward_timeout_s=0", "got 0.0, expected a positive number"),
    ("data.use_chat_template=maybe", None),
    ("data.seed=1.5", None),
    ("trainer.warmup_steps=-1", "got -1, expected a non-negative number"),
    ("trainer.weight_decay=-0.1", "got -0.1, expected a non-negative number"),
    ("trainer.grad_clip=-1", "got -1.0, expected a non-negative number"),
    ("trainer.optimizer=lion", "got 'lion', expected one of 'adam', 'sgd'"),
    ("trainer.adam_beta1=1.0", "got 1.0, expected a number in (0, 1)"),
    ("trainer.adam_beta2=0", "got 0.0, expected a positive number"),
    ("trainer.seed=1.5", None),
    ("trainer.balance_cost=time", "got 'time', expected one of 'tokens', 'flops'"),
    ("trainer.max_tokens_per_micro_batch=0", "got 0, expected a positive number"),
    ("checkpoint.keep_last=0", "got 0, expected a positive number"),
    ("checkpoint.resume=2", None),
    ("logging.stdout=2", None),
    ("logging.samples_every=0", "got 0, expected a positive number"),
    ("topology.etp=0", "got 0, expected null or an integer >= 1"),
])
def test_invalid_values_name_the_key(override, expected):
    key, _, value = override.partition("=")
    message = error_of([override])
    if expected is None:   # a type error: the message names the key, the value and the type
        assert message.startswith(f"wrong type for config key '{key}': got "), message
    else:
        assert message == f"invalid value for config key '{key}': {expected}"


def test_micro_batch_budget_must_hold_one_sequence():
    assert error_of(["rollout.max_prompt_tokens=200", "rollout.max_response_tokens=100",
                     "trainer.max_tokens_per_micro_batch=256"]) == (
        "invalid value for config key 'trainer.max_tokens_per_micro_batch': got 256, expected at least "
        "rollout.max_prompt_tokens + rollout.max_response_tokens = 300 (one whole sequence must fit a "
        "micro-batch)")


def test_expert_tensor_parallel_size_reaches_the_topology():
    base = ["model.path=fixture:tiny-qwen3_moe", "topology.world_size=4", "topology.tp=2", "topology.ep=2"]
    assert load_config(None, base).topology.to_topology().expert_tp == 2          # null: etp = tp
    topo = load_config(None, base + ["topology.etp=1"]).topology.to_topology()
    assert (topo.expert_tp, topo.expert_dp) == (1, 2)
    assert error_of(["topology.etp=2"]) == (
        "invalid value for config key 'topology.ep': got 1, expected a size for which world_size=1 is a "
        "multiple of etp*ep*pp = 2*1*1 = 2")


def test_rollout_fleet_size_defaults_to_the_devices_and_fits_them():
    assert load_config(None, ["topology.world_size=4", "rollout.tp=2", "model.path=fixture:tiny-qwen2"]).rollout.dp == 2
    assert load_config(None, ["topology.world_size=4", "rollout.placement=split"]).rollout.dp == 1
    assert load_config(None, ["topology.world_size=2", "rollout.dp=1"]).rollout.dp == 1   # device 1: no engine
    assert error_of(["topology.world_size=2", "rollout.dp=2", "rollout.tp=2", "model.path=fixture:tiny-qwen2"]) == (
        "invalid value for config key 'rollout.dp': got 2, expected rollout.dp * rollout.tp <= topology.world_size "
        "= 2 (colocated, each vLLM TP rank shares a training device; rollout.dp=2, rollout.tp=2)")
    assert error_of(["rollout.tp=2", "model.path=fixture:tiny-qwen2"]).startswith("invalid value for config key 'rollout.tp': got 2, expected "
                                                 "rollout.dp * rollout.tp <= topology.world_size = 1")


def test_lora_section_parses_and_bad_values_name_the_key():
    cfg = load_config(None, ["model.lora.rank=8", "model.lora.alpha=16", "model.lora.targets=[linear_qkv,linear_proj]"])
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.targets) == (8, 16.0, ["linear_qkv", "linear_proj"])
    assert load_config(None, []).model.lora.rank == 0      # off by default
    assert "model.lora.rank" in error_of(["model.lora.rank=-1"])
    zero = error_of(["model.lora.rank=0", "model.lora.alpha=16"])          # a LoRA block left at rank 0
    assert "model.lora.rank" in zero and "model.lora.alpha is set" in zero
    assert "expected a non-empty list of distinct names from" in error_of(["model.lora.targets=[q_proj]"])
    assert "expected a list of str" in error_of(["model.lora.targets=linear_qkv"])
    assert "model.lora.dropout" in error_of(["model.lora.dropout=1.0"])
    assert "did you mean 'model.lora.rank'" in error_of(["model.lora.rnk=2"])


def test_lora_is_refused_where_it_cannot_work_before_any_process_starts():
    from megarl.config.schema import LORA_TARGETS
    from megarl.policy.lora import LORA_TARGETS as ENGINE_TARGETS

    assert tuple(LORA_TARGETS) == ENGINE_TARGETS
    moe = error_of(["model.path=fixture:tiny-qwen3_moe", "model.lora.rank=4"])
    assert "model.lora.targets" in moe and "MoE" in moe and "[linear_qkv, linear_proj]" in moe
    load_config(None, ["model.path=fixture:tiny-qwen3_moe", "model.lora.rank=4",
                       "model.lora.targets=[linear_qkv,linear_proj]", "checkpoint.save_every=0"])
    assert "MLA" in error_of(["model.path=fixture:tiny-deepseek_v3", "model.lora.rank=4",
                              "model.lora.targets=[linear_qkv]", "checkpoint.save_every=0"])
    assert "bridge.verify" in error_of(["model.lora.rank=4", "bridge.verify=true"])
    load_config(None, ["model.lora.rank=4", "bridge.verify=true", "bridge.lora_sync=merged"])
    assert "rollout.weight_noise_std" in error_of(["model.lora.rank=4", "rollout.weight_noise_std=0.1"])
    big = error_of(["model.lora.rank=1024"])
    assert "model.lora.rank" in big and "at most 512" in big
    load_config(None, ["model.lora.rank=1024", "bridge.lora_sync=merged"])
    assert "bridge.lora_sync" in error_of(["bridge.lora_sync=full"])
    load_config(None, ["model.lora.rank=4", "checkpoint.save_every=5"])   # LoRA checkpoints hold the adapters
