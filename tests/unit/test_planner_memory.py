"""The planner's arithmetic (megarl/planner/memory.py, flops.py, roofline.py) against values
computed by hand for the tiny fixtures' shapes, and its per-rank build (ranks.py: the real
megatron-core model on the meta device under a fake process group) against the fixture's own
weights: the counts must be the HF model's parameter count exactly."""
import math
from types import SimpleNamespace

import pytest

from megarl.config import ConfigError, load_config
from megarl.models.dims import ModelDims
from megarl.models.fixtures import ensure_fixture, tiny_config
from megarl.planner import memory as mem
from megarl.planner.flops import active_matmul_params, flops_per_token
from megarl.planner.hardware import GPUS
from megarl.planner.roofline import experts_touched, pipeline_bubble


@pytest.fixture(scope="module")
def moe():
    """tiny-qwen3_moe: h 256, 8 heads, 4 KV heads of 32, 8 experts (top 2) of 128, 2 layers, vocab 49152."""
    return ModelDims.from_hf(tiny_config("qwen3_moe").to_dict())


@pytest.fixture(scope="module")
def mla():
    """tiny-deepseek_v3: layer 0 dense (ffn 512), layer 1 MoE; q_lora 64, kv_lora 512, rope 64, nope 32, v 32."""
    return ModelDims.from_hf(tiny_config("deepseek_v3").to_dict())


def test_train_state_bytes_by_hand():
    # 1000 dense + 600 expert parameters in bf16 with Adam: 2 B weights, 4 B fp32 grads, 12 B of
    # optimizer state (fp32 master + 2 moments) sharded over dp*cp = 4 (dense) and expert-dp = 2
    state = mem.train_state(1000, 600, dtype="bfloat16", optimizer="adam", dp_cp=4, expert_dp=2)
    assert (state.params, state.grads, state.optimizer) == (3200, 6400, 1000 * 12 // 4 + 600 * 12 // 2)
    assert state.total == 3200 + 6400 + 6600
    # fp32 weights need no master copy: the moments only
    fp32 = mem.train_state(1000, 600, dtype="float32", optimizer="adam", dp_cp=4, expert_dp=2)
    assert (fp32.params, fp32.grads, fp32.optimizer) == (6400, 6400, 2000 + 2400)
    # SGD (no momentum in megarl): the master copy only
    assert mem.train_state(1000, 600, dtype="bfloat16", optimizer="sgd", dp_cp=4, expert_dp=2).optimizer == 1000 + 1200
    with pytest.raises(ValueError, match="dtype='float16'"):
        mem.train_state(1, 1, dtype="float16", optimizer="adam", dp_cp=1, expert_dp=1)


def test_lora_state_by_hand():
    # hidden 64, 4 heads x 16 (q 64), 2 KV heads (kv 32), MLP 128; rank 8 at tp 2, 3 layers:
    # qkv: A 64 + B (64 + 2 x 32) / 2; proj: A 64 / 2 + B 64; fc1: A 64 + B 256 / 2; fc2: A 128 / 2 + B 64
    dims = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16, num_kv_heads=2)
    n = mem.lora_params(dims, [0, 1, 2], rank=8, targets=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                        tp=2)
    assert n == 3 * 8 * ((64 + 64) + (32 + 64) + (64 + 128) + (64 + 64))
    assert mem.lora_params(dims, [0], rank=8, targets=["linear_qkv"], tp=1) == 8 * (64 + 128)
    # the frozen base keeps its bf16 bytes, nothing else; the adapters: weights, fp32 grads, master + moments
    state = mem.train_state(1000, 0, dtype="bfloat16", optimizer="adam", dp_cp=4, expert_dp=1, adapters=100)
    assert (state.params, state.grads, state.optimizer) == (2200, 400, 100 * 12 // 4)


def test_layer_activations_by_hand(moe, mla):
    # GQA attention: 2h (norm in, qkv in) + 2*8*32 (q, out) + 2*4*32 (k, v) = 512 + 768 = 1280;
    # MoE: 2h + top2 * (h + 3*128) + 2*8 fp32 router scores = 512 + 1280 + 16 = 1808
    assert mem.layer_activation_elements(moe, 1, tp=1, etp=1, sp=False) == 1280 + 1808
    # tp2 + sp: h-wide tensors and head tensors halve, the experts (etp 1) do not
    assert mem.layer_activation_elements(moe, 1, tp=2, etp=1, sp=True) == (256 + 384) + (256 + 1280 + 16)
    # MLA: 2h + 2*q_lora + (kv_lora + rope) + kv_lora + heads*(2*(32+64) + 2*32) = 512 + 128 + 576 + 512 + 8*256
    attention = 512 + 128 + 576 + 512 + 8 * 256
    assert mem.layer_activation_elements(mla, 0, tp=1, etp=1, sp=False) == attention + 512 + 3 * 512   # dense MLP
    # MoE layer with one shared expert of 128: 2h + 2*(h + 384) + 3*128 + 2*8
    assert mem.layer_activation_elements(mla, 1, tp=1, etp=1, sp=False) == attention + 512 + 1280 + 384 + 16


def test_activation_bytes_recompute_and_logits(moe):
    per_layer = 1280 + 1808
    none = mem.activation_bytes(moe, [0, 1], tokens=100, tp=1, etp=1, sp=False, recompute="none", in_flight=3,
                                last_stage=False)
    assert none == 2 * 100 * 3 * 2 * per_layer
    assert mem.activation_bytes(moe, [0, 1], tokens=100, tp=1, etp=1, sp=False, recompute="selective", in_flight=3,
                                last_stage=False) == none
    # full: each layer's input (h) per micro-batch in flight, plus one layer's activations
    full = mem.activation_bytes(moe, [0, 1], tokens=100, tp=1, etp=1, sp=False, recompute="full", in_flight=3,
                                last_stage=False)
    assert full == 2 * 100 * (3 * 2 * 256 + per_layer)
    # the last stage adds one micro-batch of logits: tokens * vocab/tp * 10 bytes
    last = mem.activation_bytes(moe, [0, 1], tokens=100, tp=2, etp=1, sp=True, recompute="full", in_flight=1,
                                last_stage=True)
    assert last == int(2 * 100 * (2 * 128 + (256 + 384) + (256 + 1280 + 16)) + 100 * 49152 / 2 * 10)


def test_in_flight_micro_batches():
    assert mem.in_flight_micro_batches(0, pp=4, vpp=1, micro_batches=10) == 4
    assert mem.in_flight_micro_batches(3, pp=4, vpp=1, micro_batches=10) == 1
    assert mem.in_flight_micro_batches(0, pp=4, vpp=1, micro_batches=2) == 2
    # interleaved: 2*(pp-1) + (vpp-1)*pp + 1 = 11 chunk micro-batches of half the stage's layers
    assert mem.in_flight_micro_batches(0, pp=4, vpp=2, micro_batches=8) == 5.5
    assert mem.in_flight_micro_batches(0, pp=1, vpp=1, micro_batches=8) == 1


def test_kv_cache_and_vllm_weights(moe, mla):
    # GQA: 2 (K, V) x KV heads on the rank x 32 x 2 bytes x 2 layers; 4 KV heads over tp 2 -> 2 each,
    # over tp 8 -> replicated, 1 each
    assert mem.kv_bytes_per_token(moe, 2) == 2 * 2 * 32 * 2 * 2
    assert mem.kv_bytes_per_token(moe, 8) == 2 * 1 * 32 * 2 * 2
    # MLA: one latent (512 + 64) x 2 bytes per layer, on every TP rank
    assert mem.kv_bytes_per_token(mla, 1) == mem.kv_bytes_per_token(mla, 32) == 576 * 2 * 2
    assert mem.vllm_weight_bytes(1001, 2) == 1001   # ceil(1001 * 2 / 2)
    assert mem.vllm_weight_bytes(671_000_000_000, 32) == 41_937_500_000


def test_flops_and_roofline_helpers(moe):
    # active matmul weights: attention 2*256*256 + 2*256*128 per layer, 2 routed experts of
    # 3*256*128 plus the router 256*8, the LM head 256*49152
    attention, experts = 2 * 256 * 256 + 2 * 256 * 128, 2 * 3 * 256 * 128 + 256 * 8
    assert active_matmul_params(moe) == 2 * (attention + experts) + 256 * 49152
    # attention scores of a 9-token sequence: mean causal context 5 keys, 2*8*(32+32) FLOPs per key
    forward = 2 * active_matmul_params(moe) + 2 * 8 * 64 * 5 * 2
    assert flops_per_token(moe, 9, False) == forward
    assert flops_per_token(moe, 9, True) == 3 * forward
    assert flops_per_token(moe, 9, False, causal=False) == 2 * active_matmul_params(moe) + 2 * 8 * 64 * 9 * 2
    assert experts_touched(1, 256, 8) == pytest.approx(8 / 256)
    assert experts_touched(64, 256, 8) == pytest.approx(1 - (1 - 8 / 256) ** 64)
    assert pipeline_bubble(16, 16, 1) == pytest.approx(31 / 16)
    assert pipeline_bubble(16, 16, 2) == pytest.approx((16 + 7.5) / 16)
    assert pipeline_bubble(5, 1, 1) == 1.0
    assert GPUS["h100"].hbm_bytes == int(79.6 * 2**30)


def test_cluster_and_plan_keys_are_validated():
    cfg = load_config(None, ["cluster.gpu=h200", "cluster.gpus_per_node=4", "cluster.host_memory_gib=512",
                             "plan.mean_prompt_tokens=100", "plan.mean_response_tokens=300"])
    assert (cfg.cluster.gpu, cfg.cluster.gpus_per_node, cfg.cluster.host_memory_gib) == ("h200", 4, 512)
    assert (cfg.plan.mean_prompt_tokens, cfg.plan.mean_response_tokens) == (100, 300)
    with pytest.raises(ConfigError, match="cluster.gpu"):
        load_config(None, ["cluster.gpu=a100"])
    with pytest.raises(ConfigError, match="cluster.gpus_per_node"):
        load_config(None, ["cluster.gpus_per_node=0"])
    with pytest.raises(ConfigError, match="plan.mean_response_tokens"):
        load_config(None, ["plan.mean_response_tokens=-5"])


def test_recipe_model_path_is_next_to_the_recipe(tmp_path, monkeypatch):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)   # not the repository: the recipe's models/ folder is found all the same
    cfg = load_config(repo / "configs" / "grpo_deepseek_v3_h100x256.yaml", [f"trainer.run_dir={tmp_path}"])
    assert cfg.model.path == str(repo / "configs" / "models" / "deepseek-v3")
    # on the command line a relative path stays relative to the working directory
    with pytest.raises(ConfigError, match="model.path"):
        load_config(repo / "configs" / "grpo_deepseek_v3_h100x256.yaml", ["model.path=models/deepseek-v3"])


def _hf_parameter_count(folder) -> int:
    """Parameters of the fixture's HF weights; DeepSeek's routing bias is a megatron buffer, not a
    parameter (no optimizer state), so it is left out."""
    from megarl.models.safetensors_io import read_header

    total = 0
    for path in folder.glob("*.safetensors"):
        for name, info in read_header(str(path)).items():
            if "e_score_correction_bias" not in name:
                total += math.prod(info.shape)
    return total


@pytest.mark.parametrize("name,world,layout", [
    ("tiny-deepseek_v3", 4, dict(pp=2, ep=2)),       # stage 0: dense layer + embedding; stage 1: MoE + head
    ("tiny-qwen3_moe", 4, dict(tp=2, sp=True, ep=2)),
])
def test_meta_build_counts_equal_the_fixture(name, world, layout):
    from transformers import AutoConfig

    from megarl.compat import setup_cpu
    from megarl.policy.build import ModelOptions
    from megarl.parallel.topology import Topology
    from megarl.planner.ranks import count_rank, stage_kinds

    folder = ensure_fixture(name)
    setup_cpu()
    topology = Topology(world_size=world, **layout)
    hf_config = AutoConfig.from_pretrained(folder)
    dims = ModelDims.from_hf(hf_config)
    kinds = stage_kinds(topology, dims)
    counts = [count_rank(str(folder), hf_config, topology, k, ModelOptions(path=str(folder), dtype="bfloat16"))
              for k in kinds]
    total = sum((c.model_dense + c.model_expert) * len(c.kind.stages) for c in counts)
    assert total == _hf_parameter_count(folder)
    if name == "tiny-deepseek_v3":
        assert [(k.stages, k.dense_layers, k.moe_layers, k.first, k.last) for k in kinds] == \
            [((0,), 1, 0, True, False), ((1,), 0, 1, False, True)]
        assert [c.rank for c in counts] == [0, 2]
        assert counts[0].expert == 0 and counts[0].embedding == 49152 * 256
        # stage 1 holds 4 of the 8 experts (ep 2): 4 x 3 x 256 x 128 routed-expert weights
        assert counts[1].expert == 4 * 3 * 256 * 128 and counts[1].output == 49152 * 256
    else:   # tp 2: the rank holds half of every tensor-parallel weight and 4 of 8 experts
        assert counts[0].expert == 2 * 4 * 3 * 256 * 128 // 2


def test_data_plane_bytes_by_hand():
    # 512 samples of 128 + 700 tokens; DeepSeek-V3's 58 MoE layers x top-8, int16
    d = mem.data_plane_bytes(samples=512, mean_prompt=128, mean_response=700, moe_layers=58, topk=8, routing=True,
                             dp=16, ranks_per_node=8)
    routing = 512 * 828 * 58 * 8 * 2
    assert d.routing == routing and routing / (512 * 828) == 928          # 928 B a token
    # the engines send each sample's text (about 4 B a token), its digest, length and two handles; the routing goes
    # from the engines to the ranks
    assert d.controller_in == 512 * (4 * 700 + 32 + 2 * mem.HANDLE_BYTES) and not d.samples_copy
    # out: two handles a sample, an outcome advantage and the loss mask as one run of equal values a sample each
    # (value + int32 length: 8 + 5 B; megarl.data.wire)
    assert d.controller_out == 512 * (2 * mem.HANDLE_BYTES + 8 + 5)
    # a rank reads the ids and the float64 log-probs from the engines' nodes, and its share of the routing
    assert d.per_rank == (512 * (4 * 828 + 8 * 700 + 8 + 5) + routing) // 16 and d.per_node == 8 * d.per_rank
    assert d.advantages_rank0 == 0
    # with a copy of the ids and log-probs on the controller (speculative rollouts, the agent loop)
    copy = mem.data_plane_bytes(samples=512, mean_prompt=128, mean_response=700, moe_layers=58, topk=8, routing=True,
                                dp=16, ranks_per_node=8, samples_copy=True)
    assert copy.controller_in == 512 * (4 * 828 + 8 * 700) and copy.controller_out == d.controller_out
    assert copy.per_rank == d.per_rank
    # per-token advantages (GAE, a KL reward): rank 0 computes them where their inputs are and the controller
    # sends a handle a sample
    gae = mem.data_plane_bytes(samples=512, mean_prompt=128, mean_response=700, moe_layers=58, topk=8, routing=True,
                               dp=16, ranks_per_node=8, token_advantages=True)
    assert gae.controller_out == d.controller_out + 512 * (mem.HANDLE_BYTES - 8)
    assert gae.per_rank == d.per_rank + 512 * (4 * 700 - 8) // 16 and gae.advantages_rank0 == 512 * 700 * 4
    plain = mem.data_plane_bytes(samples=512, mean_prompt=128, mean_response=700, moe_layers=58, topk=8,
                                 routing=False, dp=16, ranks_per_node=8)
    assert plain.routing == 0 and plain.controller_in == d.controller_in
    assert plain.per_rank == d.per_rank - routing // 16


def test_data_plane_bytes_of_the_forward_passes():
    """An old-log-prob pass, a reference model and a rollout correction: their per-token outputs go
    rank to rank (old, reference, weights: 12 B a response token) and the controller gets
    per-sample read-outs."""
    kw = dict(samples=512, mean_prompt=128, mean_response=700, moe_layers=58, topk=8, routing=False, dp=16,
              ranks_per_node=8, old_pass=True, reference=True, correction=True)
    plain = mem.data_plane_bytes(**{**kw, "old_pass": False, "reference": False, "correction": False})
    store = mem.data_plane_bytes(**kw)
    assert plain.passes == 0 and store.passes == 512 * 700 * 12
    assert store.controller_in == plain.controller_in + 512 * mem.READOUT_BYTES
    assert store.controller_out == plain.controller_out
    assert store.per_rank == plain.per_rank + store.passes // 16
    # a PPO critic with a KL reward: its update reads the values and the returns (8 B a token); rank 0 reads old,
    # reference and values (12 B a token) to write advantages and returns (8 B)
    ppo = mem.data_plane_bytes(**{**kw, "token_advantages": True, "critic": True, "kl_reward": True})
    assert ppo.passes == 512 * 700 * 20 and ppo.advantages_rank0 == 512 * 700 * 20
    assert ppo.controller_in == store.controller_in
    assert ppo.controller_out == store.controller_out + 512 * (mem.HANDLE_BYTES - 8)
    # the reference pass alone (one update a step): its log-probs, 4 B a token, and the read-outs
    ref = mem.data_plane_bytes(**{**kw, "old_pass": False})
    assert ref.passes == 512 * 700 * 4 and ref.controller_in == store.controller_in
