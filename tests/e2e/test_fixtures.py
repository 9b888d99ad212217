"""Offline fixtures: deterministic builds, and SmolLM2's HF folder reproduces the GGUF model."""
import hashlib
import os
import subprocess
import sys

import pytest

from megarl.models import fixtures


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_unknown_fixture_lists_known():
    with pytest.raises(ValueError) as exc:
        fixtures.fixture_dir("tiny-gpt2")
    assert str(exc.value) == ("unknown fixture 'tiny-gpt2'; known fixtures: smollm2, tiny-llama, tiny-qwen2, "
                              "tiny-qwen3, tiny-qwen3_moe, tiny-deepseek_v3, mini-deepseek_v3")


def test_tiny_fixture_build_is_deterministic(tmp_path, monkeypatch):
    cached = fixtures.ensure_fixture("tiny-qwen3_moe")
    monkeypatch.setenv("MEGARL_CACHE", str(tmp_path))
    rebuilt = fixtures.ensure_fixture("tiny-qwen3_moe")
    assert rebuilt.parent.parent == tmp_path
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert _sha(rebuilt / name) == _sha(cached / name), name


def test_tiny_fixtures_divisible_layouts():
    for family in fixtures.TINY_FAMILIES:
        cfg = fixtures.tiny_config(family)
        assert cfg.num_attention_heads % 4 == 0 and cfg.num_key_value_heads % 4 == 0, family
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None)
        if experts:
            assert experts % 4 == 0, family
    dsv3 = fixtures.tiny_config("deepseek_v3")
    assert (dsv3.kv_lora_rank, dsv3.qk_rope_head_dim) == (512, 64)   # vLLM CPU MLA constraint


@pytest.mark.slow
def test_smollm2_folder_equals_gguf_logits():
    # exact: the folder stores the de-quantised GGUF values in fp32
    assert fixtures.verify_smollm2() == 0.0


def test_cli_fixtures_lists_cached_paths():
    out = subprocess.run([sys.executable, "-m", "megarl.cli", "fixtures", "tiny-qwen2"], capture_output=True,
                         text=True, check=True, env=dict(os.environ)).stdout
    assert str(fixtures.fixture_dir("tiny-qwen2")) in out
