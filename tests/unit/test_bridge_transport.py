"""The bridge's transport choice per transfer (megarl.bridge.transport.auto): shared memory between
ranks of one node, gloo between nodes, decided from the node names the ranks gather.

Two gloo processes run a real WeightBridge (no megatron: synthetic shards of a tiny Qwen2 at pp2,
vLLM TP 2 on both ranks) into an engine stand-in that copies what it is asked to load; once as one
node, once as two. The loaded tensors must equal vLLM's shards of the same HF weights either way,
and the stats must split the bytes by path exactly as the plan says."""
import os
import pickle
import tempfile
from types import SimpleNamespace

import pytest
import torch

from megarl.bridge import rpc
from megarl.bridge.buffer import open_manifest
from megarl.bridge.mapping import get_mapping, hf_to_megatron, hf_to_vllm_shard, split_shard
from megarl.bridge.transfers import MegatronLayout, Planner, Transfer, VllmLayout
from megarl.bridge.transport import AutoTransport
from megarl.parallel import Topology

QWEN2 = dict(model_type="qwen2", num_hidden_layers=4, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
             head_dim=4, intermediate_size=24, vocab_size=128, tie_word_embeddings=False)
TOPOLOGY = dict(world_size=2, pp=2)
VTP = 2


def _hf_weights(mapping):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in mapping.hf_shapes().items()}


def _shards(mapping, hf, src, rank):
    """This rank's shards, with the fields of megarl.policy.export.LocalShard the bridge reads."""
    out = []
    for t in mapping.megatron_tensors():
        full = hf_to_megatron(mapping, t, hf)
        tp, ep = src.shard_sizes(t)
        for (tp_rank, ep_rank), ranks in src.holders(t, mapping.cfg.num_layers).items():
            if rank in ranks:
                out.append(SimpleNamespace(name=t.name, tensor=split_shard(t, full, tp, tp_rank, ep, ep_rank),
                                           tp_size=tp, is_expert=t.expert, ep_rank=ep_rank, ep_size=ep))
    return out


class RecordingEngine:
    """Stands in for the vLLM engine rank 0 drives: keeps a copy of every tensor it loads."""

    def __init__(self):
        self.loaded = {}

    def collective_rpc(self, method, args=()):
        if method == rpc.WEIGHT_VERSION:
            return [0] * VTP
        assert method == rpc.LOAD_BUCKET, method
        for vllm_rank, manifest in args[0].items():
            for name, tensor in open_manifest(manifest):
                self.loaded[(int(vllm_rank), name)] = tensor.clone()
        return []

    def reset_prefix_cache(self):
        pass


def _worker(rank, tmp):
    import torch.distributed as dist

    from megarl.bridge import SyncOptions, WeightBridge

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=rank, world_size=2)
    mapping = get_mapping(QWEN2)
    hf = _hf_weights(mapping)
    shards = _shards(mapping, hf, MegatronLayout(Topology(**TOPOLOGY)), rank)
    out = {}
    for case, node in (("one_node", "node"), ("two_nodes", f"node{rank}")):
        engine = RecordingEngine() if rank == 0 else None
        bridge = WeightBridge(lambda: shards, QWEN2, Topology(**TOPOLOGY), VTP, llm=engine, node=node,
                              options=SyncOptions(bucket_bytes=1, format="vllm_shard"))
        stats = bridge.sync()
        out[case] = {"nodes": bridge.nodes, "stats": stats}
        if rank == 0:
            want = {(r, n): t for r in range(VTP) for n, t in hf_to_vllm_shard(mapping, hf, VTP, r).items()}
            out[case]["loaded_equal"] = (set(engine.loaded) == set(want)
                                         and all(torch.equal(engine.loaded[k], want[k]) for k in want))
    try:
        WeightBridge(lambda: shards, QWEN2, Topology(**TOPOLOGY), VTP, node=f"node{rank}",
                     options=SyncOptions(transport="shm", format="vllm_shard"))
    except ValueError as err:
        out["shm_error"] = str(err)
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(tmp,), nprocs=2, join=True)
        return [pickle.load(open(os.path.join(tmp, f"rank{rank}.pkl"), "rb")) for rank in range(2)]


def _plan_bytes(rank):
    """(bytes rank sends to itself, bytes it sends to the other rank, messages it sends or receives)."""
    mapping = get_mapping(QWEN2)
    planner = Planner(mapping, MegatronLayout(Topology(**TOPOLOGY)), VllmLayout.colocated(VTP, 2, "vllm_shard"))
    transfers = list(planner.transfers())
    local = sum(tr.numel for tr in transfers if tr.src_rank == tr.dst_rank == rank) * 4
    other = sum(tr.numel for tr in transfers if tr.src_rank == rank != tr.dst_rank) * 4
    return local, other, sum(1 for tr in transfers if not tr.local and rank in (tr.src_rank, tr.dst_rank))


def test_one_node_writes_through_shared_memory(two_ranks):
    assert two_ranks[0]["one_node"]["loaded_equal"]
    for rank, out in enumerate(two_ranks):
        local, other, _ = _plan_bytes(rank)
        s = out["one_node"]["stats"]
        assert local > 0 and other > 0
        assert out["one_node"]["nodes"] == ["node", "node"]
        assert (s["transport"], s["bytes_by_path"], s["p2p_messages"]) == ("auto", {"local": local, "shm": other}, 0)
        assert s["bytes_sent_by_rank"] == local + other


def test_two_nodes_send_with_gloo(two_ranks):
    assert two_ranks[0]["two_nodes"]["loaded_equal"]
    for rank, out in enumerate(two_ranks):
        local, other, messages = _plan_bytes(rank)
        s = out["two_nodes"]["stats"]
        assert out["two_nodes"]["nodes"] == ["node0", "node1"]
        assert s["bytes_by_path"] == {"local": local, "gloo": other}
        assert s["p2p_messages"] == messages > 0
        assert s["bytes_sent_by_rank"] == local + other


def test_explicit_shm_across_nodes_names_the_ranks(two_ranks):
    want = ("transport 'shm': rank 0 (node 'node0') writes to rank 1 (node 'node1'), but shared memory only "
            "reaches processes on the same node; use transport auto, gloo or nccl")
    assert [out.get("shm_error") for out in two_ranks] == [want, want]


def test_path_of_each_transfer_follows_the_nodes():
    def transfer(src, dst):
        return Transfer("t", src, (), dst, 0, "d", (), 6)

    auto = AutoTransport(0, None, nodes=["a", "a", "b"])
    assert [auto.path(transfer(s, d)) for s, d in [(0, 0), (0, 1), (1, 0), (0, 2), (2, 1)]] == \
        ["local", "shm", "shm", "gloo", "gloo"]
    one = AutoTransport(0, None, nodes=["a", "a"])
    assert one.p2p is None and one.path(transfer(1, 0)) == "shm"
