"""Pure tests of the weight-bridge mapping: layouts against mbridge's own conversion functions and
the fixture checkpoints (bit-exact round trips), and vLLM's TP layout formulas."""
import json
from types import SimpleNamespace

import pytest
import torch

from megarl.bridge.mapping import (get_mapping, hf_to_megatron, hf_to_vllm_shard, megatron_to_hf, merge_shards,
                                   shard_segments, split_shard, unstack_hf)
from megarl.models.fixtures import ensure_fixture

SMALL = dict(model_type="qwen2", num_hidden_layers=1, hidden_size=6, num_attention_heads=4, num_key_value_heads=2,
             head_dim=3, intermediate_size=8, vocab_size=16, tie_word_embeddings=False)


def _fixture(name):
    from safetensors.torch import load_file

    folder = ensure_fixture(name)
    return json.load(open(folder / "config.json")), load_file(str(folder / "model.safetensors"))


def _stacked(mapping, sd):
    """HF checkpoint -> {name (stacked experts under '*'): tensor}."""
    out = {}
    for name, shape in mapping.hf_shapes().items():
        out[name] = torch.stack([sd[name.replace("*", str(e))] for e in range(shape[0])]) if "*" in name else sd[name]
    return out


def _mbridge_self(cfg):
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "model_type"}, model_type=cfg["model_type"]) \
        if isinstance(cfg, dict) else cfg
    return SimpleNamespace(hf_config=hf, dtype=None, make_vocab_size_divisible_by=None)


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError, match="deepseek_v3, llama, qwen2, qwen3, qwen3_moe"):
        get_mapping(dict(SMALL, model_type="gpt2"))


def test_qkv_deinterleave_matches_mbridge():
    from mbridge.core.bridge import Bridge

    m = get_mapping(SMALL)
    q, k, v = torch.randn(12, 6), torch.randn(6, 6), torch.randn(6, 6)
    t = next(t for t in m.megatron_tensors() if t.name.endswith("linear_qkv.weight"))
    hf = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
          "model.layers.0.self_attn.v_proj.weight": v}
    full = hf_to_megatron(m, t, hf)
    ref = Bridge._weight_to_mcore_format(_mbridge_self(SMALL), t.name, [q, k, v])
    assert torch.equal(full, ref)
    # group g = [q heads of g (2 x 3 rows); k_g (3); v_g (3)]
    assert torch.equal(full[0:6], q[0:6]) and torch.equal(full[6:9], k[0:3]) and torch.equal(full[9:12], v[0:3])
    back = megatron_to_hf(m, t, full)
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_gate_up_shards_match_mbridge_split():
    from mbridge.core.bridge import Bridge

    m = get_mapping(SMALL)
    t = next(t for t in m.megatron_tensors() if t.name.endswith("mlp.linear_fc1.weight"))
    full = torch.randn(16, 6)
    fake = SimpleNamespace(_get_mcore_config_by_name=lambda n: SimpleNamespace(gated_linear_unit=True))
    ref = Bridge._weight_split_across_tp(fake, t.name, full, None, 2)
    for r in range(2):
        assert torch.equal(split_shard(t, full, 2, r), ref[r])       # [gate_r; up_r]
    assert torch.equal(merge_shards(t, {(r, 0): ref[r] for r in range(2)}, 2), full)


def test_experts_local_to_global():
    cfg = dict(SMALL, model_type="qwen3_moe", num_experts=8, moe_intermediate_size=4, num_experts_per_tok=2)
    m = get_mapping(cfg)
    t = next(t for t in m.megatron_tensors() if t.name.endswith("experts.linear_fc1.weight"))
    assert t.expert and t.shape == (8, 8, 6)
    # EP rank 1 of 2, ETP rank 0 of 2: local experts 0..3 are global 4..7; rows [gate_0; up_0]
    segs = shard_segments(t, 2, 0, 2, 1)
    assert segs == [(((0, 4), (0, 2), (0, 6)), ((4, 8), (0, 2), (0, 6))),
                    (((0, 4), (2, 4), (0, 6)), ((4, 8), (4, 6), (0, 6)))]
    stack = torch.randn(8, 8, 6)
    hf = megatron_to_hf(m, t, stack)
    assert torch.equal(hf["model.layers.0.mlp.experts.*.gate_proj.weight"], stack[:, :4])
    names = [n for n, _ in unstack_hf("model.layers.0.mlp.experts.*.up_proj.weight", hf[
        "model.layers.0.mlp.experts.*.up_proj.weight"])]
    assert names[5] == "model.layers.0.mlp.experts.5.up_proj.weight"


@pytest.mark.parametrize("name,tp,ep", [("tiny-llama", 2, 1), ("tiny-qwen2", 2, 1), ("tiny-qwen3", 2, 1),
                                        ("tiny-qwen3_moe", 2, 2), ("tiny-deepseek_v3", 2, 2), ("smollm2", 3, 1)])
def test_round_trip_shards_to_hf_is_bit_exact(name, tp, ep):
    """HF checkpoint -> Megatron full tensors -> shards (tp, ep) -> merged -> HF == checkpoint."""
    cfg, sd = _fixture(name)
    m = get_mapping(cfg)
    hf = _stacked(m, sd)
    rebuilt = {}
    for t in m.megatron_tensors():
        full = hf_to_megatron(m, t, hf)
        t_tp = tp if t.tp_dim is not None else 1
        t_ep = ep if t.expert else 1
        shards = {(r, e): split_shard(t, full, t_tp, r, t_ep, e) for r in range(t_tp) for e in range(t_ep)}
        rebuilt.update(megatron_to_hf(m, t, merge_shards(t, shards, t_tp, t_ep)))
    flat = dict(p for n, x in rebuilt.items() for p in unstack_hf(n, x))
    assert set(flat) == set(sd)
    assert all(torch.equal(flat[n], sd[n]) for n in sd)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3_moe", "tiny-deepseek_v3"])
def test_megatron_layout_matches_mbridge_import(name):
    """Our Megatron full tensors equal mbridge's HF -> Megatron conversion (QKV, fc1, MLA, experts)."""
    from mbridge.core.bridge import Bridge

    cfg, sd = _fixture(name)
    m = get_mapping(cfg)
    hf = _stacked(m, sd)
    fake = _mbridge_self(json.load(open(ensure_fixture(name) / "config.json")))
    for t in m.megatron_tensors():
        if t.expert:
            continue
        pieces = m.to_hf(t)
        ref = Bridge._weight_to_mcore_format(fake, t.name, [hf[p] for p in dict.fromkeys(x.dst_name for x in pieces)])
        assert torch.equal(hf_to_megatron(m, t, hf), ref), t.name


def test_vllm_tp2_layout_formulas():
    """qkv_proj[r] = cat(q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]) etc. (vLLM QKVParallelLinear / MergedColumnParallelLinear sharding)."""
    cfg, sd = _fixture("tiny-qwen2")
    m = get_mapping(cfg)
    p = "model.layers.0."
    for r in range(2):
        out = hf_to_vllm_shard(m, sd, 2, r)
        qkv = torch.cat([sd[p + f"self_attn.{x}_proj.weight"].chunk(2)[r] for x in "qkv"])
        assert torch.equal(out[p + "self_attn.qkv_proj.weight"], qkv)
        assert torch.equal(out[p + "self_attn.qkv_proj.bias"], torch.cat([sd[p + f"self_attn.{x}_proj.bias"].chunk(2)[r]
                                                                         for x in "qkv"]))
        assert torch.equal(out[p + "self_attn.o_proj.weight"], sd[p + "self_attn.o_proj.weight"].chunk(2, 1)[r])
        gu = torch.cat([sd[p + "mlp.gate_proj.weight"].chunk(2)[r], sd[p + "mlp.up_proj.weight"].chunk(2)[r]])
        assert torch.equal(out[p + "mlp.gate_up_proj.weight"], gu)
        assert torch.equal(out["lm_head.weight"], sd["lm_head.weight"].chunk(2)[r])
    cfg, sd = _fixture("tiny-qwen3_moe")
    m = get_mapping(cfg)
    out = hf_to_vllm_shard(m, _stacked(m, sd), 2, 1)
    w13 = out["model.layers.1.mlp.experts.routed_experts.w13_weight"]
    assert w13.shape == (8, 128, 256)
    e = 5
    assert torch.equal(w13[e], torch.cat([sd[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].chunk(2)[1],
                                          sd[f"model.layers.1.mlp.experts.{e}.up_proj.weight"].chunk(2)[1]]))
    cfg, sd = _fixture("tiny-deepseek_v3")
    m = get_mapping(cfg)
    out = hf_to_vllm_shard(m, _stacked(m, sd), 2, 0)
    a = "model.layers.0.self_attn."
    assert torch.equal(out[a + "fused_qkv_a_proj.weight"], torch.cat([sd[a + "q_a_proj.weight"],
                                                                      sd[a + "kv_a_proj_with_mqa.weight"]]))
    assert torch.equal(out[a + "kv_b_proj.weight"], sd[a + "kv_b_proj.weight"].chunk(2)[0])
