"""User errors of the HF -> Megatron conversion are raised before any process group exists."""
import json
import os

import pytest

from megarl.conversion.convert import hf_to_megatron
from megarl.models.fixtures import ensure_fixture
from megarl.parallel.topology import Topology, TopologyError


def _copy_with_config(tmp_path, **changes):
    src = ensure_fixture("tiny-llama")
    for fn in os.listdir(src):
        if fn != "config.json" and not fn.startswith("."):
            os.symlink(os.path.join(src, fn), tmp_path / fn)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_unsupported_model_type_lists_supported(tmp_path):
    folder = _copy_with_config(tmp_path, model_type="gpt2")
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*llama.*qwen3_moe"):
        hf_to_megatron(folder, str(tmp_path / "out"), Topology())


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    cfg = json.load(open(os.path.join(ensure_fixture("tiny-llama"), "config.json")))
    folder = _copy_with_config(tmp_path, intermediate_size=cfg["intermediate_size"] * 2)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*checkpoint shape .*config"):
        hf_to_megatron(folder, str(tmp_path / "out"), Topology())


def test_missing_shard_file_named(tmp_path):
    folder = _copy_with_config(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00001.safetensors"):
        hf_to_megatron(folder, str(tmp_path / "out"), Topology())


def test_invalid_layout_uses_topology_error(tmp_path):
    cfg = json.load(open(os.path.join(ensure_fixture("tiny-llama"), "config.json")))
    tp = cfg["num_attention_heads"] * 2
    with pytest.raises(TopologyError, match="topology.tp"):
        hf_to_megatron(str(ensure_fixture("tiny-llama")), str(tmp_path / "out"), Topology(world_size=tp, tp=tp))


def test_keep_mtp_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy_with_config(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    tensors = load_file(os.path.join(ensure_fixture("tiny-llama"), "model.safetensors"))
    tensors["model.layers.2.input_layernorm.weight"] = tensors["model.layers.0.input_layernorm.weight"].clone()   # MTP-like
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="multi-token-prediction"):
        hf_to_megatron(folder, str(tmp_path / "out"), Topology(), keep_mtp=True)
