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
        "'dapo', 'ppo', 'rloo', 'reinforce_pp', 'gspo'")


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
        "num_hidden_layers=2 (model fixture:tiny-llama)")


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
    assert error_of(["rollout.placement=split", "rollout.offload_train_state=true"]) == (
        "invalid value for config key 'rollout.offload_train_state': got True, expected false with "
        "placement='split' (training and rollout do not share devices: nothing to make room for)")
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
        assert isinstance(load_config(recipe), MegaRLConfig), recipe


def test_every_field_has_a_docstring():
    import dataclasses
    import typing
    for section in dataclasses.fields(MegaRLConfig):
        cls = typing.get_type_hints(MegaRLConfig)[section.name]
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, (section.name, missing)
