"""Pure tests of the weight-bridge plan: coverage, locality, PP/EP ownership (uneven first/last
pipeline stages and vpp included), execution of the plan on synthetic shards, bytes by link type,
and the DeepSeek-V3 671B byte counts (shapes only, 61 layers at PP16: 3 + 14 x 4 + 2)."""
import time
from collections import defaultdict

import pytest
import torch

from megarl.bridge.mapping import (get_mapping, hf_to_megatron, hf_to_vllm_shard, slices, split_shard)
from megarl.bridge.transfers import (LINK_TYPES, MegatronLayout, Planner, VllmLayout, baseline_bytes_per_device,
                                build_plan, bytes_per_device, link_bytes, link_of)
from megarl.parallel import Topology

QWEN2 = dict(model_type="qwen2", num_hidden_layers=4, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
             head_dim=4, intermediate_size=24, vocab_size=128, tie_word_embeddings=False)
MOE = dict(QWEN2, model_type="qwen3_moe", num_experts=8, moe_intermediate_size=8, num_experts_per_tok=2)
DSV3 = dict(model_type="deepseek_v3", num_hidden_layers=4, hidden_size=16, num_attention_heads=4,
            num_key_value_heads=4, intermediate_size=24, moe_intermediate_size=8, n_routed_experts=8,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4, vocab_size=128, tie_word_embeddings=False)
LAYOUTS = [dict(world_size=2), dict(world_size=2, tp=2), dict(world_size=2, pp=2),
           dict(world_size=2, tp=2, ep=2, etp=1), dict(world_size=4, tp=2, pp=2), dict(world_size=4, ep=4, etp=1),
           dict(world_size=4, tp=2, pp=2, first_stage_layers=1)]


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


@pytest.mark.parametrize("layout,stages", [
    (dict(world_size=4, tp=2, pp=2, first_stage_layers=1), [0, 1, 1, 1, 1, 1]),
    (dict(world_size=2, pp=2, last_stage_layers=1), [0, 0, 0, 0, 0, 1]),
    (dict(world_size=6, pp=3, first_stage_layers=1, last_stage_layers=1), [0, 1, 1, 1, 1, 2]),
    (dict(world_size=2, pp=2, vpp=2, first_stage_layers=4), [0, 0, 1, 0, 0, 1]),
], ids=["first1", "last1", "pp3.first1.last1", "vpp2.first4"])
@pytest.mark.parametrize("cfg", [QWEN2, DSV3], ids=["qwen2", "deepseek_v3"])
def test_uneven_stages_send_each_layer_from_its_stage(cfg, layout, stages):
    """6 layers at uneven pipeline splits: every transfer of layer i leaves a rank of stage
    ``stages[i]`` (megatron's split, tests/unit/test_topology_uneven.py), the embedding leaves
    stage 0, the head the last stage, and every destination element is still written once."""
    mapping = get_mapping(dict(cfg, num_hidden_layers=6))
    src = MegatronLayout(Topology(**layout))
    layers = {t.name: t.layer for t in mapping.megatron_tensors()}
    planner, cov = _coverage(mapping, src, VllmLayout.colocated(2, src.topology.world_size))
    sent_by = defaultdict(set)
    for tr in planner.transfers():
        layer = layers[tr.tensor]
        key = "embedding" if tr.tensor.startswith("embedding.") else "head" if layer is None else layer
        sent_by[key].add(src.topology.coords(tr.src_rank)["pp"])
    last = src.topology.pp - 1
    assert dict(sent_by) == {"embedding": {0}, "head": {last}, **{i: {s} for i, s in enumerate(stages)}}
    assert all((c == 1).all() for c in cov.values())


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
@pytest.mark.parametrize("first", [None, 1], ids=["even", "first1"])
def test_executing_plan_on_synthetic_shards_gives_vllm_shards(cfg, first):
    """Run the plan by hand: shards of random HF weights -> destination tensors == hf_to_vllm_shard
    (pipeline stages of 2 + 2 layers, and uneven 1 + 3)."""
    mapping = get_mapping(cfg)
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=g) for n, s in mapping.hf_shapes().items()}
    src = MegatronLayout(Topology(4, tp=2, pp=2, ep=2, etp=1, first_stage_layers=first))
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


@pytest.mark.parametrize("cfg", [MOE, DSV3], ids=["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("layout,devices,fmt", [
    (dict(world_size=8, pp=2, ep=4, etp=1), None, "vllm_shard"),
    (dict(world_size=8, tp=2, pp=2, ep=2, etp=1), None, "hf_full"),
    (dict(world_size=8, tp=2, pp=2, ep=2, etp=1), (9, 8, 11, 10), "vllm_shard"),     # split: engines of their own
], ids=["pp2.ep4", "tp2.pp2.ep2.hf_full", "split"])
def test_link_bytes_equal_a_count_over_transfers(cfg, layout, devices, fmt):
    mapping = get_mapping(cfg)
    src = MegatronLayout(Topology(**layout))
    dst = VllmLayout(2, devices, fmt) if devices else VllmLayout.colocated(2, 8, fmt)
    got = link_bytes(mapping, src, dst, devices_per_node=4, itemsize=2)
    recv = {link: dict.fromkeys(dst.devices, 0) for link in LINK_TYPES}
    sent = {link: defaultdict(int) for link in LINK_TYPES[1:]}
    engines = [dict.fromkeys(LINK_TYPES, 0) for _ in range(len(dst.devices) // 2)]
    for tr in Planner(mapping, src, dst).transfers():
        link = link_of(tr.src_rank, tr.dst_rank, 4)
        recv[link][tr.dst_rank] += tr.numel * 2
        engines[dst.devices.index(tr.dst_rank) // 2][link] += tr.numel * 2
        if link != "local":
            sent[link][tr.src_rank] += tr.numel * 2
    assert got.recv == recv and got.sent == {k: dict(v) for k, v in sent.items()} and got.engines == engines
    if devices is None:   # colocated: all three link types occur at 4 devices per node
        assert all(sum(recv[link].values()) for link in LINK_TYPES)
        b = bytes_per_device(mapping, src, dst)
        assert {d: got.recv["local"][d] for d in b["local"]} == b["local"]
        assert {d: got.recv["intra_node"][d] + got.recv["inter_node"][d] for d in b["recv"]} == b["recv"]
    # every engine receives the whole model: its TP ranks' vLLM shards (vocab 128 needs no padding rows),
    # or with hf_full every HF byte on each TP rank
    if fmt == "hf_full":
        want = 2 * sum(torch.Size(s).numel() for s in mapping.hf_shapes().values()) * 2
    else:
        want = 2 * sum(torch.Size(s).numel() for s in mapping.vllm_shapes(2).values()) * 2
    assert [got.engine_total(k) for k in range(len(engines))] == [want] * len(engines)


DSV3_671B = dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3,
                 n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=18432,
                 q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                 num_attention_heads=128, num_key_value_heads=128, vocab_size=129280, tie_word_embeddings=False)
# 61 layers over PP16: megatron's uneven first/last stages, 3 + 14 x 4 + 2 (stage 0 holds the three
# dense layers, first_k_dense_replace=3)
TOPOLOGY_671B = Topology(256, pp=16, ep=16, etp=1, first_stage_layers=3, last_stage_layers=2)


@pytest.fixture(scope="module")
def dsv3_671b():
    mapping = get_mapping(DSV3_671B)
    src = MegatronLayout(TOPOLOGY_671B)
    return mapping, src, baseline_bytes_per_device(mapping, src, itemsize=2)


def _stage_bytes(mapping, tp):
    """Bytes of one vLLM TP shard per training stage: (dense, routed experts) lists of 16."""
    dense, expert = [0] * 16, [0] * 16
    for name, shape in mapping.vllm_shapes(tp).items():
        n = torch.Size(shape).numel() * 2
        if name.startswith("model.layers."):
            stage = TOPOLOGY_671B.stage_of_layer(int(name.split(".")[2]), 61)
        else:
            stage = 0 if name.startswith("model.embed_tokens.") else 15
        (expert if ".mlp.experts." in name else dense)[stage] += n
    return dense, expert


@pytest.mark.parametrize("tp", [32, 8], ids=["8_engines_x_tp32", "32_engines_x_tp8"])
def test_deepseek_v3_671b_link_bytes_from_shapes_only(dsv3_671b, tp):
    """Training PP16 x EP16 (tp1) on 256 devices, 8 devices per node, vLLM colocated (format vllm_shard).

    Node math: stage s = ranks 16s..16s+15 = nodes 2s and 2s+1; device d has stage s = d // 16, EP rank
    j = d % 16 (experts 16j..16j+15 of the stage's MoE layers) and every dense tensor of its stage (tp1,
    replicated over the stage). Every vLLM TP rank needs 1/tp of every tensor incl. a slice of all 256
    experts, so with D(s) / X(s) the dense / routed-expert bytes of one vLLM shard in stage s's layers
    (equal for all TP ranks: even splits, 128 heads, vocab 129280 a multiple of 64 * 32):
    * local = D(s) + X(s)/16 (its own stage's dense tensors and its own 16 experts);
    * intra_node = 7 * X(s)/16: only its 7 node mates (same stage, other EP ranks) share its node;
    * inter_node = the rest of its shard: the other node's 8 EP ranks and all 15 other stages;
    * sent intra_node = 7 * X(s)/16 (its experts to its node mates); sent inter_node = 15 * D(s)
      (the sender rule picks replica d % 16: one device per other stage) + 248 * X(s)/16 (its experts
      to every device off its node).
    """
    mapping, src, base = dsv3_671b
    params = sum(torch.Size(t.shape).numel() for t in mapping.megatron_tensors())
    assert 670e9 < params < 672e9     # 671B without the MTP layer
    start = time.perf_counter()
    got = link_bytes(mapping, src, VllmLayout.colocated(tp, 256), devices_per_node=8, itemsize=2)
    assert time.perf_counter() - start < 20     # 2-6 s (TP32) / 1 s (TP8) on 2 shared cores; per Transfer: 6-10 s
    shard = sum(torch.Size(s).numel() for s in mapping.vllm_shapes(tp).values()) * 2
    dense, expert = _stage_bytes(mapping, tp)
    assert sum(dense) + sum(expert) == shard and all(x % 16 == 0 for x in expert)
    assert TOPOLOGY_671B.stage_layers(61) == (3,) + (4,) * 14 + (2,)
    assert expert[0] == 0 and all(expert[1:])    # stage 0 holds layers 0-2, the dense ones
    for d in range(256):
        s, x16 = d // 16, expert[d // 16] // 16
        assert got.recv["local"][d] == dense[s] + x16 > 0, d
        assert got.recv["intra_node"][d] == 7 * x16, d
        assert got.recv["inter_node"][d] == shard - dense[s] - 8 * x16, d
        assert got.device_total(d) == shard, d                  # each device gets exactly its vLLM shard
        assert got.sent["intra_node"].get(d, 0) == 7 * x16, d     # stage 0 has no experts to send
        assert got.sent["inter_node"][d] == 15 * dense[s] + 248 * x16, d
    assert [got.engine_total(k) for k in range(256 // tp)] == [tp * shard] * (256 // tp)
    # the naive export (every full tensor gathered to every rank) moves >= 5x (TP8) / 20x (TP32) more
    assert max(got.recv["inter_node"].values()) * (tp * 5 // 8) < min(base.values())


def test_weighted_checksum_is_additive_and_permutation_sensitive():
    from megarl.bridge.verify import is_readable, weighted_checksum

    x = torch.randn(6, 4)
    whole = weighted_checksum(x, (6, 4))
    parts = weighted_checksum(x[:2], (6, 4), ((0, 2), (0, 4))) + weighted_checksum(x[2:], (6, 4), ((2, 6), (0, 4)))
    assert abs(whole - parts) < 1e-9
    assert abs(weighted_checksum(x.flip(0), (6, 4)) - whole) > 1e-6
    assert is_readable("model.layers.0.self_attn.kv_b_proj.weight") and not is_readable(
        "model.layers.0.self_attn.qkv_proj.weight")
