"""Pure tests of the weight-bridge plan: coverage, locality, PP/EP ownership, execution of the plan
on synthetic shards, and the DeepSeek-V3 671B byte counts (shapes only)."""
from collections import defaultdict

import pytest
import torch

from megarl.bridge.mapping import (get_mapping, hf_to_megatron, hf_to_vllm_shard, slices, split_shard)
from megarl.bridge.plan import (MegatronLayout, Planner, VllmLayout, baseline_bytes_per_device, build_plan,
                                bytes_per_device)
from megarl.parallel import Topology

QWEN2 = dict(model_type="qwen2", num_hidden_layers=4, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
             head_dim=4, intermediate_size=24, vocab_size=128, tie_word_embeddings=False)
MOE = dict(QWEN2, model_type="qwen3_moe", num_experts=8, moe_intermediate_size=8, num_experts_per_tok=2)
DSV3 = dict(model_type="deepseek_v3", num_hidden_layers=4, hidden_size=16, num_attention_heads=4,
            num_key_value_heads=4, intermediate_size=24, moe_intermediate_size=8, n_routed_experts=8,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4, vocab_size=128, tie_word_embeddings=False)
LAYOUTS = [dict(world_size=2), dict(world_size=2, tp=2), dict(world_size=2, pp=2),
           dict(world_size=2, tp=2, ep=2, etp=1), dict(world_size=4, tp=2, pp=2), dict(world_size=4, ep=4, etp=1)]


def _coverage(mapping, src, dst):
    planner = Planner(mapping, src, dst)
    cov = {}
    for tr in planner.transfers():
        key = (tr.dst_rank, tr.dst_name)
        if key not in cov:
            cov[key] = torch.zeros(planner.dst_shapes(tr.dst_vllm_rank)[tr.dst_name], dtype=torch.int32)
        cov[key][slices(tr.dst_box)] += 1
    return planner, cov


@pytest.mark.parametrize("cfg", [QWEN2, MOE, DSV3], ids=["qwen2", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: ".".join(f"{k}{v}" for k, v in d.items()))
@pytest.mark.parametrize("vtp,fmt", [(1, "vllm_shard"), (2, "vllm_shard"), (2, "hf_full")])
def test_every_destination_element_written_once(cfg, layout, vtp, fmt):
    mapping = get_mapping(cfg)
    src = MegatronLayout(Topology(**layout))
    planner, cov = _coverage(mapping, src, VllmLayout.colocated(vtp, src.topology.world_size, fmt))
    for device in planner.dst.devices:
        vr = planner.dst.devices.index(device) % vtp
        for name, shape in planner.dst_shapes(vr).items():
            assert (device, name) in cov, (device, name)
            assert (cov[(device, name)] == 1).all(), (device, name)


@pytest.mark.parametrize("sizes", [dict(world_size=8, tp=2, pp=2), dict(world_size=8, tp=2, cp=2),
                                   dict(world_size=16, tp=2, pp=2, ep=4, etp=1), dict(world_size=8, pp=2, ep=2, etp=2),
                                   dict(world_size=8, tp=2, cp=2, pp=2, ep=2, etp=1)])
def test_topology_coords_match_megatron_rank_generator(sizes):
    """The plan's rank coordinates (Topology.coords) are megatron-core's own rank groups."""
    from megatron.core.parallel_state import RankGenerator

    topo = Topology(**sizes)
    order = "tp-cp-ep-dp-pp"   # initialize_model_parallel's default
    dense = RankGenerator(tp=topo.tp, ep=1, dp=topo.dp, pp=topo.pp, cp=topo.cp, order=order)
    expert = RankGenerator(tp=topo.expert_tp, ep=topo.ep, dp=topo.expert_dp, pp=topo.pp, cp=1, order=order)
    for gen, axes in ((dense, {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}),
                      (expert, {"etp": "tp", "ep": "ep", "edp": "dp", "pp": "pp"})):
        for coord, token in axes.items():
            for group in gen.get_ranks(token):
                coords = [topo.coords(r) for r in group]
                assert [c[coord] for c in coords] == list(range(len(group))), (coord, group)
                others = {tuple(c[k] for k in axes if k != coord) for c in coords}
                assert len(others) == 1, (coord, group)


def test_rank_to_rank_local_copies_when_tp_matches():
    for cfg in (QWEN2, DSV3, MOE):
        plan = build_plan(get_mapping(cfg), MegatronLayout(Topology(2, tp=2)), VllmLayout.colocated(2, 2))
        assert plan and all(tr.local for tr in plan)
    # with vLLM TP 1 on device 0, device 1 only sends its own TP shards
    plan = build_plan(get_mapping(QWEN2), MegatronLayout(Topology(2, tp=2)), VllmLayout(1, (0,)))
    assert {tr.dst_rank for tr in plan} == {0}


def test_pp_stages_send_only_their_layers():
    mapping = get_mapping(MOE)
    src = MegatronLayout(Topology(4, tp=2, pp=2))
    for tr in build_plan(mapping, src, VllmLayout.colocated(2, 4)):
        t = next(t for t in mapping.megatron_tensors() if t.name == tr.tensor)
        assert src.topology.coords(tr.src_rank)["pp"] == src.stage_of(t, 4)
        if t.layer is not None:
            assert src.topology.coords(tr.src_rank)["pp"] == t.layer // 2


def test_ep_ranks_send_only_their_experts():
    mapping = get_mapping(MOE)
    src = MegatronLayout(Topology(4, ep=4, etp=1))
    for tr in build_plan(mapping, src, VllmLayout.colocated(2, 4)):
        if ".experts." in tr.tensor:
            e0, e1 = tr.src_box[0]
            assert e1 <= 2     # local expert ids: 8 experts / ep 4
            assert src.topology.coords(tr.src_rank)["ep"] in range(4)


def test_no_rank_receives_more_than_its_shard():
    """vLLM TP 2 colocated with Megatron PP 2: each device receives exactly its vLLM shard."""
    mapping = get_mapping(QWEN2)
    src, dst = MegatronLayout(Topology(2, pp=2)), VllmLayout.colocated(2, 2)
    shard_bytes = sum(torch.Size(s).numel() for s in mapping.vllm_shapes(2).values()) * 2
    b = bytes_per_device(mapping, src, dst)
    for d in range(2):
        assert b["recv"].get(d, 0) + b["local"].get(d, 0) == shard_bytes


@pytest.mark.parametrize("cfg", [QWEN2, MOE, DSV3], ids=["qwen2", "qwen3_moe", "deepseek_v3"])
def test_executing_plan_on_synthetic_shards_gives_vllm_shards(cfg):
    """Run the plan by hand: shards of random HF weights -> destination tensors == hf_to_vllm_shard."""
    mapping = get_mapping(cfg)
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=g) for n, s in mapping.hf_shapes().items()}
    src = MegatronLayout(Topology(4, tp=2, pp=2, ep=2, etp=1))
    dst = VllmLayout.colocated(2, 4)
    planner = Planner(mapping, src, dst)
    shards = {}
    for t in mapping.megatron_tensors():
        full = hf_to_megatron(mapping, t, hf)
        for key, ranks in src.holders(t, mapping.cfg.num_layers).items():
            tp, ep = src.shard_sizes(t)
            for r in ranks:
                shards[(r, t.name)] = split_shard(t, full, tp, key[0], ep, key[1])
    out = defaultdict(dict)
    for tr in planner.transfers():
        d = out[tr.dst_rank]
        if tr.dst_name not in d:
            d[tr.dst_name] = torch.zeros(planner.dst_shapes(tr.dst_vllm_rank)[tr.dst_name])
        d[tr.dst_name][slices(tr.dst_box)] = shards[(tr.src_rank, tr.tensor)][slices(tr.src_box)]
    for device in range(4):
        want = hf_to_vllm_shard(mapping, hf, 2, device % 2)
        assert set(out[device]) == set(want)
        assert all(torch.equal(out[device][n], want[n]) for n in want)


def test_buckets_respect_load_groups_and_budget():
    mapping = get_mapping(MOE)
    planner = Planner(mapping, MegatronLayout(Topology(2, tp=2)), VllmLayout.colocated(2, 2, "hf_full"))
    buckets = planner.buckets(bucket_bytes=1)   # every group alone
    assert [b.groups for b in buckets] == [["embedding"], ["layer0"], ["layer1"], ["layer2"], ["layer3"], ["head"]]
    assert len(planner.buckets(bucket_bytes=1 << 30)) == 1


DSV3_671B = dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3,
                 n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=18432,
                 q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                 num_attention_heads=128, num_key_value_heads=128, vocab_size=129280, tie_word_embeddings=False)


def test_deepseek_v3_671b_plan_from_shapes_only():
    mapping = get_mapping(DSV3_671B)
    params = sum(torch.Size(t.shape).numel() for t in mapping.megatron_tensors())
    assert 670e9 < params < 672e9     # 671B without the MTP layer
    src = MegatronLayout(Topology(256, pp=16, ep=16, etp=1), layers_per_stage=(4,) * 13 + (3,) * 3)
    dst = VllmLayout.colocated(32, 256)
    plan = bytes_per_device(mapping, src, dst, itemsize=2)
    base = baseline_bytes_per_device(mapping, src, itemsize=2)
    per_device = {d: plan["recv"].get(d, 0) + plan["local"].get(d, 0) for d in range(256)}
    vllm_shard = sum(torch.Size(s).numel() for s in mapping.vllm_shapes(32).values()) * 2
    assert all(v == vllm_shard for v in per_device.values())       # each device gets exactly its shard
    assert max(plan["recv"].values()) * 20 < min(base.values())


def test_weighted_checksum_is_additive_and_permutation_sensitive():
    from megarl.bridge.verify import is_readable, weighted_checksum

    x = torch.randn(6, 4)
    whole = weighted_checksum(x, (6, 4))
    parts = weighted_checksum(x[:2], (6, 4), ((0, 2), (0, 4))) + weighted_checksum(x[2:], (6, 4), ((2, 6), (0, 4)))
    assert abs(whole - parts) < 1e-9
    assert abs(weighted_checksum(x.flip(0), (6, 4)) - whole) > 1e-6
    assert is_readable("model.layers.0.self_attn.kv_b_proj.weight") and not is_readable(
        "model.layers.0.self_attn.qkv_proj.weight")
