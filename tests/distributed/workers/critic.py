"""Critic (value head on the Megatron GPTModel) on 2 gloo processes: ``run`` inside the launch of
engine_parity.py (tests/distributed/test_critic.py), or this script alone under torchrun.

Per family (tiny-qwen2: untied; tiny-qwen3_moe) and layout:
1. Values vs transformers: the head is set to a seeded random (w, b); the engine's value of each
   response token must equal HF's final hidden state (after the last norm) at the position before
   it, dotted with w, plus b.
2. One SGD step of the clipped value loss towards seeded returns: the values after the step are
   compared across layouts (tp1 = dp2 is the reference) and the value loss must drop.
"""
import gc
import json

import torch
import torch.distributed as dist

from engine_common import dp_share, fixture, groups_for, init, make_batch, report
from megarl.algorithms.losses import value_loss
from megarl.policy import ModelOptions, OptimOptions, PolicyModel, SequenceBatch

SEQS4 = [(13, 4), (21, 7), (9, 3), (16, 5)]


def head_params(hidden: int):
    g = torch.Generator().manual_seed(5)
    return torch.randn(1, hidden, generator=g) * hidden ** -0.5, torch.randn(1, generator=g)


def hf_values(path, ids, prompts, w, b) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for x, p in zip(ids, prompts):
            h = model.model(x[None]).last_hidden_state[0].double()
            out.append((h @ w.double().T)[:, 0][p - 1:-1] + b.double())
    del model
    gc.collect()
    return torch.cat(out)


def set_head(engine, w, b):
    for chunk in engine.model.modules:
        if getattr(chunk, "post_process", False):
            chunk.output_layer.weight.data.copy_(w)
            chunk.output_layer.bias.data.copy_(b)


def my_micro_batches(engine, ids, prompts, returns):
    sel = dp_share(engine, len(ids))
    return [SequenceBatch([ids[i] for i in sel[s:s + 2]], [prompts[i] for i in sel[s:s + 2]],
                          extras={"returns_T": torch.cat([returns[i] for i in sel[s:s + 2]])})
            for s in range(0, len(sel), 2)], sel


def all_values(engine, mbs, sel, n):
    """Values of every sequence (gathered over DP) in sequence order."""
    local = engine.forward_values(mbs)
    mine = {}
    for mb, v in zip(mbs, local):
        for i, part in zip(range(len(mb.input_ids)), torch.split(v, mb.response_lengths)):
            mine[len(mine)] = part
    box = [None] * dist.get_world_size()
    leader = engine.groups.tp_rank == 0 and engine.groups.cp_rank == 0 and engine.groups.is_last_stage
    dist.all_gather_object(box, {s: mine[k] for k, s in enumerate(sel)} if leader else {})
    merged = {}
    for d in box:
        merged.update(d)
    return torch.cat([merged[i] for i in range(n)]).double()


def loss_fn(values_R, batch):
    e = batch.extras
    return value_loss(values_R, e["old_values_T"], e["returns_T"], torch.ones_like(values_R, dtype=torch.bool),
                      batch.cu_seqlens_N1, clip_range=10.0, agg_mode="token-mean",
                      num_tokens=batch.num_global_tokens)


def run_family(tag, path, layouts, world, out, lr):
    cfg = json.load(open(f"{path}/config.json"))
    ids, prompts = make_batch(cfg["vocab_size"], seed=3, seqs=SEQS4)
    w, b = head_params(cfg["hidden_size"])
    ref = hf_values(path, ids, prompts, w, b)
    g = torch.Generator().manual_seed(9)
    returns = [torch.randn(n - p, generator=g) for n, p in SEQS4]
    first_after = None
    for spec in layouts:
        engine = PolicyModel(ModelOptions(path=path, value_head=True), groups_for(spec, world),
                              OptimOptions(optimizer="sgd", lr=lr, grad_clip=0.0))
        set_head(engine, w, b)
        mbs, sel = my_micro_batches(engine, ids, prompts, returns)
        before = all_values(engine, mbs, sel, len(ids))
        key = f"{tag}|{spec or 'tp1'}"
        out[f"{key}|vs_hf"] = (before - ref).abs().max().item()
        for mb, v in zip(mbs, engine.forward_values(mbs)):
            mb.extras["old_values_T"] = v
        stats = engine.train_step(mbs, loss_fn)
        after = all_values(engine, mbs, sel, len(ids))
        target = torch.cat(returns).double()
        out[f"{key}|mse_before"] = ((before - target) ** 2).mean().item()
        out[f"{key}|mse_after"] = ((after - target) ** 2).mean().item()
        out[f"{key}|vf_loss"] = stats["vf_loss"]
        out[f"{key}|grad_norm"] = stats["grad_norm"]
        if first_after is None:
            first_after = after
        else:
            out[f"{key}|after_vs_tp1"] = (after - first_after).abs().max().item()
        del engine
        gc.collect()


def run(world: int) -> dict:
    """Every family and layout (the process group is up); what rank 0 reports."""
    out = {"world": world}
    run_family("qwen2", fixture("tiny-qwen2"), ["", "tp2", "tp2.sp1", "pp2", "cp2"], world, out, lr=0.02)
    run_family("qwen3_moe", fixture("tiny-qwen3_moe"), ["", "tp2.ep2.etp1.sp1"], world, out, lr=0.002)
    return out


def main():
    rank, world = init()
    report(run(world))
    dist.barrier()


if __name__ == "__main__":
    main()
