"""The family registry is the single list of supported model types, and the mbridge fixes
(megarl.models.mbridge_fixes F1-F6) hold, without any process group (mbridge builds the
TransformerConfig from explicit ParallelStates)."""
import copy

import pytest
import torch

from megarl.bridge.mapping import FamilyMapping, get_mapping, mapping_class
from megarl.models.dims import ModelDims
from megarl.models.fixtures import TINY_FAMILIES, ensure_fixture
from megarl.models.registry import FAMILIES, get_family


def _hf(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(ensure_fixture(f"tiny-{model_type}"))


def _config(hf):
    """The TransformerConfig the family's bridge builds for ``hf`` (tp = pp = ep = 1)."""
    from mbridge.core.parallel_states import ParallelStates

    from megarl.models.mbridge_fixes import hf_config_for_mbridge

    family = get_family(hf.model_type)
    return family.bridge_class()(hf_config_for_mbridge(hf), dtype=torch.float32,
                                 parallel_states=ParallelStates(vpp_size=None)).config


def test_every_family_has_a_mapping_a_bridge_and_a_fixture():
    from mbridge.core.bridge import Bridge

    assert set(FAMILIES) == {"llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"}
    assert set(TINY_FAMILIES) == set(FAMILIES)
    for model_type, family in FAMILIES.items():
        assert family.model_type == model_type
        assert issubclass(mapping_class(model_type), FamilyMapping) and issubclass(family.bridge_class(), Bridge)
        hf = _hf(model_type)
        assert type(get_mapping(hf)).__name__ == family.mapping
        assert family.is_moe == (ModelDims.from_hf(hf).num_experts > 0)
    assert len({f.mapping for f in FAMILIES.values()}) == len(FAMILIES)   # one mapping class per family


def test_unknown_model_type_lists_the_known_ones():
    known = "deepseek_v3, llama, qwen2, qwen3, qwen3_moe"
    with pytest.raises(ValueError, match=f"unsupported model_type 'mistral'; supported model types: {known}"):
        get_family("mistral")
    with pytest.raises(ValueError, match=known):
        get_mapping(dict(model_type="gpt2", num_hidden_layers=1, hidden_size=4, num_attention_heads=1,
                         vocab_size=8))


def test_model_dims_names_missing_keys():
    with pytest.raises(ValueError, match="has no hidden_size, vocab_size"):
        ModelDims.from_hf(dict(model_type="llama", num_hidden_layers=2, num_attention_heads=4))


def test_fix_f1_rope_theta_from_rope_parameters():
    """transformers 5 has no config.rope_theta; mbridge reads it."""
    from megarl.models.mbridge_fixes import hf_config_for_mbridge

    cfg = _hf("llama")
    assert getattr(cfg, "rope_theta", None) is None
    fixed = hf_config_for_mbridge(cfg)
    assert fixed.rope_theta == cfg.rope_parameters["rope_theta"] and getattr(cfg, "rope_theta", None) is None
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        hf_config_for_mbridge(cfg)


def test_fixes_f2_to_f5_deepseek_v3():
    hf = _hf("deepseek_v3")
    config = _config(hf)
    assert config.original_max_position_embeddings == 4096                                        # F2
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (hf.n_group, hf.topk_group)  # F3
    assert config.mtp_num_layers is None                                                           # F4
    bad = copy.deepcopy(hf)
    bad.rope_interleave = False
    with pytest.raises(ValueError, match="rope_interleave=False is not supported"):               # F5
        _config(bad)


def test_fix_f7_deepseek_v3_yarn_reaches_megatron():
    """The tiny fixture keeps the real model's YaRN rope scaling; megatron's MLA gets all of it."""
    hf = _hf("deepseek_v3")
    assert hf.rope_parameters["rope_type"] == "yarn"
    config = _config(hf)
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim,
            config.beta_fast, config.beta_slow, config.original_max_position_embeddings) == (
        "yarn", 40, 1.0, 1.0, 32, 1, 4096)
    # written by transformers 5 with rope_type only (no legacy "type" key)
    only_type = copy.deepcopy(hf)
    only_type.rope_parameters = {k: v for k, v in hf.rope_parameters.items() if k != "type"}
    assert _config(only_type).rope_type == "yarn"


def test_fix_f6_qwen3_moe_router():
    hf = _hf("qwen3_moe")
    assert _config(hf).moe_router_pre_softmax is (not hf.norm_topk_prob)
    flipped = copy.deepcopy(hf)
    flipped.norm_topk_prob = not hf.norm_topk_prob
    assert _config(flipped).moe_router_pre_softmax is hf.norm_topk_prob
    sparse = copy.deepcopy(hf)
    sparse.decoder_sparse_step = 2
    with pytest.raises(ValueError, match="decoder_sparse_step != 1 are not supported"):
        _config(sparse)
