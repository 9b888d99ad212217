"""YAML recipe + dotted command-line overrides -> a validated :class:`MegaRLConfig`.

OmegaConf parses the YAML, the ``key=value`` overrides (YAML value grammar) and ``${...}``
interpolations; the schema walk here checks every key and type itself so that each error names
the full key path, the offending value and what is expected, and suggests the closest valid key
for a typo.

A relative ``model.path`` written in a recipe file that names a folder next to the recipe is
taken relative to the recipe (``configs/grpo_*.yaml`` say ``models/deepseek-v3``), so a recipe
works from any working directory; otherwise, and on the command line, paths are relative to the
working directory.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from megarl.config.errors import ConfigError, ConfigValueError, invalid_value
from megarl.config.schema import MegaRLConfig

_TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str", type(None): "null"}
# keys that moved to the section that owns them: the old name is an error naming the new one
MOVED_KEYS = {
    "rollout.offload_train_state": "trainer.offload_train_state",
    "data.max_tokens_per_micro_batch": "trainer.max_tokens_per_micro_batch",
    "data.balance_cost": "trainer.balance_cost",
    "logging.jsonl": "logging.trackers (a list of jsonl, tensorboard, wandb, mlflow)",
    "logging.tensorboard": "logging.trackers (a list of jsonl, tensorboard, wandb, mlflow)",
}


def all_keys(cls=MegaRLConfig, prefix: str = "") -> list[str]:
    """Every valid dotted key of the schema (sections and fields)."""
    keys = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            keys += all_keys(hint, key + ".")
    return keys


def _describe(hint) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if origin is list:
        return "a list of " + _describe(typing.get_args(hint)[0])
    return _TYPE_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _coerce(value, hint, key: str):
    """Return ``value`` checked against the annotation ``hint`` (int is accepted for float)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(hint):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        for arg in typing.get_args(hint):   # Optional[Literal]: a value of the choices' type is a bad choice
            if typing.get_origin(arg) is Literal and any(type(value) is type(c) for c in typing.get_args(arg)):
                raise invalid_value(key, value, _describe(arg))
        raise _type_error(key, value, hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, (list, tuple)):
            return [_coerce(v, item, key) for v in value]
        raise _type_error(key, value, hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value in choices and not isinstance(value, bool):
            return value
        if isinstance(value, bool) and ("on" if value else "off") in choices:
            return "on" if value else "off"   # YAML 1.1 reads a bare off / on as a boolean
        if any(type(value) is type(c) for c in choices):
            raise invalid_value(key, value, _describe(hint))
        raise _type_error(key, value, hint)
    if hint is type(None):
        if value is None:
            return None
        raise _type_error(key, value, hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key, value, hint)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(key, value, hint)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _type_error(key, value, hint)
    if hint is str:
        if isinstance(value, str):
            return value
        raise _type_error(key, value, hint)
    raise TypeError(f"schema type {hint!r} of {key} is not supported by the loader")


def _type_error(key, value, hint) -> ConfigError:
    return ConfigError(key, f"wrong type for config key '{key}': got {value!r} "
                            f"({type(value).__name__}), expected {_describe(hint)}")


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip("."), f"config key '{prefix.rstrip('.')}' must be a mapping of "
                                              f"fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for name in data:
        if name not in known:
            key = f"{prefix}{name}"
            if key in MOVED_KEYS:
                raise ConfigError(key, f"config key '{key}' moved to '{MOVED_KEYS[key]}'")
            close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(key, f"unknown config key '{key}'{hint}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value if value is not None else {}, key + ".")
        else:
            kwargs[name] = _coerce(value, hint, key)
    section = cls(**kwargs)
    if hasattr(section, "validate"):
        try:
            section.validate()
        except ConfigValueError as err:
            raise invalid_value(f"{prefix}{err.field}", err.value, err.expected) from None
    return section


def _parse_overrides(overrides: list[str]):
    from omegaconf import OmegaConf

    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(item, f"override {item!r} is not of the form section.field=value")
    return OmegaConf.from_dotlist(list(overrides))


def load_config(recipe: str | os.PathLike | None = None, overrides: list[str] = (), *,
                check_model: bool = True) -> MegaRLConfig:
    """Load ``recipe`` (YAML; None for the defaults), apply ``overrides`` and validate."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.create({})
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError("", f"config file {str(path)!r} not found")
        try:
            base = OmegaConf.load(path)
        except Exception as err:
            raise ConfigError("", f"config file {str(path)!r} is not valid YAML: {err}") from None
        if not isinstance(OmegaConf.to_container(base), dict):
            raise ConfigError("", f"config file {str(path)!r} must hold a mapping of sections")
        _model_path_next_to_recipe(base, path.parent)
    try:
        merged = OmegaConf.merge(base, _parse_overrides(list(overrides)))
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(getattr(err, "full_key", "") or "", f"config error: {err}") from None
    cfg = _build(MegaRLConfig, data, "")
    cfg = resolve_presets(cfg)
    check_sections(cfg)
    if check_model:
        cross_validate(cfg)
    return cfg


def _model_path_next_to_recipe(base, folder: Path) -> None:
    """A recipe's relative ``model.path`` naming a folder next to the recipe -> that folder."""
    model = base.get("model")
    value = model.get("path") if hasattr(model, "get") else None
    if isinstance(value, str) and not value.startswith("fixture:") and not os.path.isabs(value) \
            and (folder / value).is_dir():
        model["path"] = str(folder / value)


def resolve_presets(cfg: MegaRLConfig) -> MegaRLConfig:
    """``cfg`` with the algorithm fields left null filled from ``algorithm.name``'s preset
    (:mod:`megarl.config.presets`), ``rollout.dp`` from the devices and
    ``trainer.logprob_diff_threshold`` and ``algorithm.rollout_correction`` from ``model.dtype``
    (:data:`LOGPROB_DIFF_THRESHOLDS`; tis under bfloat16, else none)."""
    from megarl.config.presets import resolve_algorithm

    if cfg.model.dtype == "auto":   # once, here: every process gets the same concrete dtype
        from megarl.precision import resolve_auto

        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=resolve_auto()))
    if cfg.algorithm.rollout_correction is None:   # bf16's rollout-training mismatch: tis, at no extra pass
        cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(
            cfg.algorithm, rollout_correction="tis" if cfg.model.dtype == "bfloat16" else "none"))
    cfg = dataclasses.replace(cfg, algorithm=resolve_algorithm(cfg.algorithm, cfg.rollout.max_response_tokens))
    if cfg.rollout.dp is None:   # the fleet's size: as many engines as the devices hold
        dp = cfg.topology.world_size // cfg.rollout.tp if cfg.rollout.placement == "colocated" else 1
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, dp=max(1, dp)))
    if cfg.trainer.logprob_diff_threshold is None:   # the alarm's default for the run's precision
        from megarl.config.schema import LOGPROB_DIFF_THRESHOLDS

        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(
            cfg.trainer, logprob_diff_threshold=LOGPROB_DIFF_THRESHOLDS[cfg.model.dtype]))
    if cfg.data.epochs:   # the run's length in passes over the prompt set
        steps = math.ceil(cfg.data.epochs * prompt_count(cfg.data) / cfg.data.prompts_per_step)
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, steps=steps))
    return cfg


def prompt_count(data) -> int:
    """How many prompts one epoch visits: ``data.num_prompts`` of a generated task, or the rows of
    ``data.task``'s file (raises ConfigError naming data.epochs when there is no fixed set)."""
    from megarl.tasks import GENERATED_TASKS

    if data.task in GENERATED_TASKS:
        if not data.num_prompts:
            raise invalid_value("data.epochs", data.epochs, f"null with data.task={data.task!r} and no "
                                "data.num_prompts (new problems every step: there is no epoch to repeat)")
        return data.num_prompts
    from megarl.tasks import load_prompt_dataset

    try:
        return len(load_prompt_dataset(data.task))
    except (OSError, ValueError) as err:
        raise invalid_value("data.task", data.task, f"a readable prompt file to count data.epochs over ({err})") \
            from None


def check_sections(cfg: MegaRLConfig) -> None:
    """Rules that involve several sections but not the model; the functions named by
    ``algorithm.advantage``, ``algorithm.policy_loss`` and ``data.reward`` must resolve."""
    total = cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
    if total > cfg.trainer.max_tokens_per_micro_batch:
        raise invalid_value("trainer.max_tokens_per_micro_batch", cfg.trainer.max_tokens_per_micro_batch,
                            f"at least rollout.max_prompt_tokens + rollout.max_response_tokens = {total} "
                            "(one whole sequence must fit a micro-batch)")
    r, world = cfg.rollout, cfg.topology.world_size
    if r.dp * r.tp > world:
        why = "colocated, each vLLM TP rank shares a training device" if r.placement == "colocated" else \
            "split, each vLLM TP rank's weight buffers are written by one training rank"
        raise invalid_value("rollout.dp" if r.dp > 1 else "rollout.tp", r.dp if r.dp > 1 else r.tp,
                            f"rollout.dp * rollout.tp <= topology.world_size = {world} ({why}; rollout.dp="
                            f"{r.dp}, rollout.tp={r.tp})")
    if cfg.rollout.weight_noise_std > 0 and cfg.bridge.verify:
        raise invalid_value("rollout.weight_noise_std", cfg.rollout.weight_noise_std,
                            "0 with bridge.verify=true (verification compares the engines' weights with the "
                            "trained ones, which the noise changes on purpose)")
    if cfg.trainer.mode != "on_policy" and cfg.trainer.offload_train_state:
        raise invalid_value("trainer.offload_train_state", True, f"false with trainer.mode={cfg.trainer.mode!r} "
                            "(the engines generate while Megatron trains: its state stays on the devices)")
    if cfg.rollout.agent == "tools" and cfg.trainer.mode != "on_policy":
        raise invalid_value("rollout.agent", "tools", f"'single_turn' with trainer.mode={cfg.trainer.mode!r} (the "
                            "agent loop runs in on_policy mode only)")
    if cfg.rollout.agent == "tools" and (cfg.algorithm.router_replay != "off" or cfg.rollout.return_routing):
        raise invalid_value("rollout.agent", "tools", "'single_turn' with algorithm.router_replay or "
                            "rollout.return_routing (the routing of a multi-turn trajectory is not collected yet)")
    if cfg.rollout.agent == "tools" and cfg.rollout.search_corpus and not Path(cfg.rollout.search_corpus).is_file():
        raise invalid_value("rollout.search_corpus", cfg.rollout.search_corpus, "an existing .txt or .jsonl file")
    if r.speculative != "off":
        check_speculative(cfg)
    a = cfg.algorithm
    if a.advantage == "remax" and (cfg.rollout.agent == "tools" or cfg.trainer.mode == "async"):
        key, value = ("rollout.agent", "tools") if cfg.rollout.agent == "tools" else ("trainer.mode", "async")
        raise invalid_value(key, value, f"{'single_turn' if key == 'rollout.agent' else 'on_policy or one_step_off'} "
                            "with algorithm.advantage='remax' (its greedy baseline is generated with each step's "
                            "single-turn samples)")
    if a.sample_filter != "none" and cfg.trainer.mode == "async":
        raise invalid_value("algorithm.sample_filter", a.sample_filter, "'none' with trainer.mode='async' (the "
                            "filter picks from each prompt's whole group, which async mode trains as it finishes)")
    if a.sample_filter != "none" and cfg.rollout.n < 2:
        raise invalid_value("algorithm.sample_filter", a.sample_filter, f"'none' with rollout.n={cfg.rollout.n} "
                            "(it keeps 2 of each prompt's responses)")
    if cfg.trainer.optimizer_offload and cfg.trainer.optimizer != "adam":
        raise invalid_value("trainer.optimizer_offload", True, f"false with trainer.optimizer="
                            f"{cfg.trainer.optimizer!r} (megatron-core offloads its distributed optimizer, which "
                            "wraps adam only)")
    if cfg.trainer.offload_train_state and cfg.rollout.placement == "split":
        raise invalid_value("trainer.offload_train_state", True, "false with rollout.placement='split' "
                            "(training and rollout do not share devices: nothing to make room for)")
    from megarl.config.presets import ALGORITHM_PRESETS
    from megarl.rewards import get_reward_fn
    from megarl.rewards.spec import parse_reward

    # every rule term must resolve (a model term's folder is preflight's: megarl.preflight)
    checks = [("data.reward", t.name, get_reward_fn) for t in parse_reward(cfg.data.reward) if not t.is_model]
    preset = ALGORITHM_PRESETS[cfg.algorithm.name]
    if (cfg.algorithm.advantage, cfg.algorithm.policy_loss) != (preset["advantage"], preset["policy_loss"]):
        # a name the user chose (the presets' own are registry names): importing the registries
        # imports torch, so `megarl config` skips it otherwise
        from megarl.algorithms import get_advantage_estimator, get_policy_loss

        checks += [("algorithm.advantage", cfg.algorithm.advantage, get_advantage_estimator),
                   ("algorithm.policy_loss", cfg.algorithm.policy_loss, get_policy_loss)]
    for key, value, get in checks:
        try:
            get(value)
        except (ValueError, TypeError) as err:
            raise ConfigError(key, f"invalid value for config key '{key}': {err}") from None


def check_speculative(cfg: MegaRLConfig) -> None:
    """What ``rollout.speculative`` needs (docs/speculative.md)."""
    from megarl.tasks import GENERATED_TASKS

    r, mode = cfg.rollout, cfg.rollout.speculative
    why = f"'off' with {{}} (rollout.speculative={mode!r} {{}})"
    if cfg.data.task in GENERATED_TASKS and not cfg.data.num_prompts:
        raise invalid_value("rollout.speculative", mode, why.format(
            f"data.task={cfg.data.task!r} and no data.num_prompts", "reuses a prompt's responses from its previous "
            "epoch; set data.num_prompts for a fixed pool of problems"))
    if r.agent == "tools":
        raise invalid_value("rollout.speculative", mode, why.format(
            "rollout.agent='tools'", "verifies single-turn responses; a trajectory's tool results are not the model's"))
    if cfg.trainer.mode == "async":
        raise invalid_value("rollout.speculative", mode, why.format(
            "trainer.mode='async'", "runs in on_policy and one_step_off; async generates one request per sample"))
    if r.return_routing or cfg.algorithm.router_replay == "r3":
        raise invalid_value("rollout.speculative", mode, why.format(
            "rollout.return_routing / algorithm.router_replay='r3'", "does not collect the routing of a reused prefix"))
    for key, value, plain in (("temperature", r.temperature, 1.0), ("top_p", r.top_p, 1.0), ("top_k", r.top_k, -1)):
        if value != plain:
            raise invalid_value(f"rollout.{key}", value, f"{plain} with rollout.speculative={mode!r} (the verification "
                                "reads vLLM's prompt log-probs, which are of the untempered, untruncated distribution)")


def model_hf_config(path: str) -> dict | None:
    """config.json of the model, if it can be read without building anything."""
    from megarl.models.fixtures import FIXTURES, fixture_config, fixture_dir

    if path.startswith("fixture:"):
        name = path[len("fixture:"):]
        if name not in FIXTURES:
            return None
        folder = fixture_dir(name)
        if not (folder / "config.json").exists():
            return fixture_config(name).to_dict() if name != "smollm2" else None
    else:
        folder = Path(path)
    cfg_file = folder / "config.json"
    return json.loads(cfg_file.read_text()) if cfg_file.is_file() else None


def cross_validate(cfg: MegaRLConfig) -> None:
    """Rules that involve several sections or the model's own config.json."""
    from megarl.models.dims import ModelDims
    from megarl.models.fixtures import FIXTURES
    from megarl.parallel.topology import TopologyError

    if cfg.bridge.transport == "cuda_ipc" and cfg.rollout.placement == "split":
        raise invalid_value("bridge.transport", "cuda_ipc", "auto, nccl, shm or gloo with rollout.placement='split' "
                            "(CUDA IPC hands a buffer to the vLLM worker on the same GPU; split placement gives "
                            "vLLM GPUs of its own)")
    from megarl.rewards.spec import model_term, parse_reward

    if model_term(parse_reward(cfg.data.reward)) is not None:
        a = cfg.algorithm   # these read the rewards while the samples are generated, before the model scores them
        for key, value, bad in (("algorithm.dynamic_sampling", a.dynamic_sampling, bool(a.dynamic_sampling)),
                                ("algorithm.sample_filter", a.sample_filter, a.sample_filter != "none"),
                                ("algorithm.advantage", a.advantage, a.advantage == "remax")):
            if bad:
                raise invalid_value(key, value, f"off with a reward model in data.reward={cfg.data.reward!r} (it "
                                    "reads the rewards during generation, before the reward model scores the samples)")
    path = cfg.model.path
    if path.startswith("fixture:") and path[len("fixture:"):] not in FIXTURES:
        raise invalid_value("model.path", path, "fixture:<name> with name one of " + ", ".join(FIXTURES))
    if not path.startswith("fixture:") and not Path(path).is_dir():
        raise invalid_value("model.path", path, "an existing HF checkpoint folder or fixture:<name>")
    hf = model_hf_config(path)
    if hf is not None and not path.startswith("fixture:") and "model_type" not in hf:
        raise invalid_value("model.path", path, "a folder whose config.json has a model_type")
    if hf is None:
        return
    dims = ModelDims.from_hf(hf)
    if (cfg.algorithm.router_replay != "off" or cfg.rollout.return_routing) and not dims.num_experts:
        key, value = (("algorithm.router_replay", cfg.algorithm.router_replay) if cfg.algorithm.router_replay != "off"
                      else ("rollout.return_routing", True))
        raise invalid_value(key, value, f"{'off' if key.startswith('algorithm') else 'false'} for model {path}: it "
                            "has no MoE layer (no router whose routing could be returned or replayed)")
    check_lora(cfg, dims)
    try:
        cfg.topology.to_topology().check_model(dims)
    except TopologyError as err:
        raise invalid_value(f"topology.{err.field}", err.value,
                            f"{err.expected} (model {path})") from None
    if dims.num_attention_heads % cfg.rollout.tp:
        raise invalid_value("rollout.tp", cfg.rollout.tp,
                            f"a divisor of num_attention_heads={dims.num_attention_heads} (model {path})")
    max_len = hf.get("max_position_embeddings")
    total = cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
    if max_len and total > max_len:
        raise invalid_value("rollout.max_response_tokens", cfg.rollout.max_response_tokens,
                            f"max_prompt_tokens + max_response_tokens <= max_position_embeddings={max_len}")
    if cfg.trainer.balance_cost == "flops":
        from megarl.data.batching import flops_coefficients

        try:
            flops_coefficients(hf)
        except (ValueError, KeyError, TypeError) as err:
            raise invalid_value("trainer.balance_cost", "flops", f"'tokens' for model {path}: its config.json "
                                f"gives no FLOPs model ({err})") from None


def check_lora(cfg: MegaRLConfig, dims) -> None:
    """``model.lora`` against the model (``dims``: its :class:`megarl.models.dims.ModelDims`) and the
    run: no adapters on routed experts or on MLA attention (DeepSeek-V3's projections are not
    linear_qkv / linear_proj); adapter sync's own rules (:func:`check_adapter_sync`)."""
    lora = cfg.model.lora
    if not lora.rank:
        return
    path = cfg.model.path
    mlp = [t for t in lora.targets if t in ("linear_fc1", "linear_fc2")]
    if dims.num_experts and mlp:
        raise invalid_value("model.lora.targets", lora.targets, f"no {' / '.join(mlp)} for model {path}: it has MoE "
                            "layers, and adapters on routed experts are not supported (use [linear_qkv, linear_proj])")
    if dims.kv_lora_rank:
        raise invalid_value("model.lora.rank", lora.rank, f"0 for model {path}: its MLA attention has no linear_qkv "
                            "/ linear_proj to adapt (LoRA covers dense GQA attention and dense MLPs)")
    if cfg.bridge.lora_sync == "adapter":
        check_adapter_sync(cfg)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (vllm.config.lora.MaxLoRARanks; a unit test compares
them with the installed vLLM): an engine is built with the smallest one >= model.lora.rank."""


def check_adapter_sync(cfg: MegaRLConfig) -> None:
    """``bridge.lora_sync: adapter`` against the run: the engines hold the base weights they
    loaded and run the adapter beside them, so nothing may change or check the base in the sync."""
    lora = cfg.model.lora
    if lora.rank > VLLM_LORA_RANKS[-1]:
        raise invalid_value("model.lora.rank", lora.rank, f"at most {VLLM_LORA_RANKS[-1]} with bridge.lora_sync "
                            "adapter (vLLM's largest max_lora_rank), or bridge.lora_sync merged")
    if cfg.bridge.verify:
        raise invalid_value("bridge.verify", True, "false with bridge.lora_sync adapter (it compares the engines' "
                            "base weights with the merged ones; use bridge.lora_sync merged to verify syncs)")
    if cfg.rollout.weight_noise_std:
        raise invalid_value("rollout.weight_noise_std", cfg.rollout.weight_noise_std, "0 with bridge.lora_sync "
                            "adapter (the noise is added to the weights the bridge loads; the adapter sync "
                            "loads none)")


def to_yaml(cfg: MegaRLConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_resolved(cfg: MegaRLConfig, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config to <run_dir>/config.yaml (atomically) and return the path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    tmp = out.with_suffix(".yaml.tmp")
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, out)
    return out
