"""Train step, reference engine and offload on 2 gloo processes (one torchrun launch).

1. Layout equality: one SGD step (PPO loss, token-mean over the global token count, grad clip)
   on the same global batch of 4 sequences at several layouts; the exported HF weights are
   compared with the first layout (tp1 = dp2: each DP rank holds 2 sequences, 1 micro-batch;
   tp2 / pp2: one DP rank, 2 micro-batches; ep2: experts split, dense part dp2).
2. Reference engine: frozen, equals the policy's log-probs before training.
3. Offload/onload (Adam state present): values identical after onload, and a second step after
   offload+onload equals the same step of an engine that never offloaded.
4. LR warm-up, token counts, MoE aux / z loss and per-expert token counts reported.
5. After one step, a NaN loss in one micro-batch on rank 1 (dp=2, Adam): no rank updates, every
   rank reports the skip, the grads are zeroed, and the next (finite) step takes the LR schedule's
   second value, not its third. Adam state created before any update (a checkpoint after skipped
   updates only) changes neither the weights nor the first update.
"""
import gc
import os
import json
import sys

import torch
import torch.distributed as dist

from engine_common import fixture, groups_for, init, make_batch, report
from megarl.algorithms.losses import ppo_policy_loss
from megarl.engine import ModelOptions, OptimOptions, PolicyEngine, SequenceBatch, reference_engine

SEQS4 = [(13, 4), (21, 7), (9, 3), (16, 5)]


def global_batch(vocab):
    ids, prompts = make_batch(vocab, seed=3, seqs=SEQS4)
    g = torch.Generator().manual_seed(11)
    adv = [torch.randn(n - p, generator=g) for n, p in SEQS4]
    return ids, prompts, adv


def my_micro_batches(engine, ids, prompts, adv):
    """Split the 4 sequences over DP ranks, then into micro-batches of 2 sequences."""
    dp, dp_rank = engine.groups.topology.dp, engine.groups.dp_rank
    per = len(ids) // dp
    sel = list(range(dp_rank * per, (dp_rank + 1) * per))
    mbs = []
    for start in range(0, len(sel), 2):
        idx = sel[start:start + 2]
        mbs.append(SequenceBatch([ids[i] for i in idx], [prompts[i] for i in idx],
                                 extras={"advantages_T": torch.cat([adv[i] for i in idx])}))
    return mbs


def attach_old_logprobs(engine, mbs):
    for mb, out in zip(mbs, engine.forward_logprobs(mbs)):
        mb.extras["old_logprobs_T"] = out.logprobs_R.detach()
        mb.extras["mask_T"] = torch.ones_like(out.logprobs_R)


def loss_fn(logprobs_R, batch):
    e = batch.extras
    return ppo_policy_loss(logprobs_R, e["old_logprobs_T"], e["advantages_T"], e["mask_T"], batch.cu_seqlens_N1,
                           agg_mode="token-mean", num_tokens=batch.num_global_tokens)


def export(engine):
    return {k: v.detach().clone() for k, v in engine.export_hf()}


def max_diff(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((a[k] - b[k]).abs().max().item() for k in a)


def layout_equality(path, layouts, world, out, tag, model_kw):
    ids, prompts, adv = global_batch(json.load(open(f"{path}/config.json"))["vocab_size"])
    optim = OptimOptions(optimizer="sgd", lr=0.5, grad_clip=1.0)
    ref_weights = None
    for spec in layouts:
        engine = PolicyEngine(ModelOptions(path=path, **model_kw), groups_for(spec, world), optim)
        before = export(engine) if ref_weights is None else None
        mbs = my_micro_batches(engine, ids, prompts, adv)
        attach_old_logprobs(engine, mbs)
        stats = engine.train_step(mbs, loss_fn)
        after = export(engine)
        key = f"{tag}|{spec or 'tp1'}"
        if ref_weights is None:
            ref_weights, ref_stats = after, stats
            out[f"{tag}|step_changed_weights"] = max_diff(after, before)
        else:
            out[f"{key}|weights_vs_tp1"] = max_diff(after, ref_weights)
            out[f"{key}|grad_norm_diff"] = abs(stats["grad_norm"] - ref_stats["grad_norm"])
            out[f"{key}|loss_diff"] = abs(stats["loss"] - ref_stats["loss"])
        out[f"{key}|stats"] = {k: v for k, v in stats.items() if k != "moe_tokens_per_expert"}
        if "moe_tokens_per_expert" in stats:
            out[f"{key}|moe_tokens_per_expert"] = stats["moe_tokens_per_expert"]
        del engine
        gc.collect()


def reference_and_offload(path, world, out):
    ids, prompts, adv = global_batch(json.load(open(f"{path}/config.json"))["vocab_size"])
    groups = groups_for("tp2", world)
    optim = OptimOptions(optimizer="adam", lr=1e-3, warmup_steps=2, grad_clip=1.0)
    ref = reference_engine(ModelOptions(path=path), groups)
    out["ref_requires_grad"] = any(p.requires_grad for c in ref.model.chunks for p in c.parameters())
    out["ref_has_optimizer"] = ref.optimizer is not None

    engines = {}
    for name in ("plain", "offloaded"):
        engine = PolicyEngine(ModelOptions(path=path), groups, optim)
        mbs = my_micro_batches(engine, ids, prompts, adv)
        attach_old_logprobs(engine, mbs)
        if name == "plain":
            ref_lp = torch.cat([o.logprobs_R for o in ref.forward_logprobs(mbs)])
            out["ref_vs_policy_logprobs"] = (ref_lp - torch.cat([m.extras["old_logprobs_T"] for m in mbs])).abs().max().item()
        s1 = engine.train_step(mbs, loss_fn, with_entropy=True)
        out[f"{name}|lr_step1"] = s1["lr"]
        if name == "offloaded":
            before = export(engine)
            opt_before = [v.clone() for v in _opt_tensors(engine)]
            engine.offload()
            out["offloaded_bytes"] = engine.offloader.offloaded_bytes
            out["param_storage_freed"] = all(c.buffers[0].param_data.untyped_storage().nbytes() == 0
                                             for c in engine.model.chunks)
            engine.onload()
            out["params_after_onload_diff"] = max_diff(export(engine), before)
            out["optimizer_state_after_onload_diff"] = max(
                (a - b).abs().max().item() for a, b in zip(_opt_tensors(engine), opt_before))
            out["num_optimizer_state_tensors"] = len(opt_before)
        s2 = engine.train_step(mbs, loss_fn, with_entropy=True)
        out[f"{name}|lr_step2"] = s2["lr"]
        out[f"{name}|loss_step2"] = s2["loss"]
        engines[name] = export(engine)
        out["num_response_tokens"] = s2["num_response_tokens"]
        del engine
        gc.collect()
    out["offload_then_step_vs_plain"] = max_diff(engines["offloaded"], engines["plain"])


def nan_skip(path, world, out):
    ids, prompts, adv = global_batch(json.load(open(f"{path}/config.json"))["vocab_size"])
    first_step = {}
    for name in ("plain", "ensured"):   # Adam state made before any update (to save a checkpoint) changes nothing
        engine = PolicyEngine(ModelOptions(path=path), groups_for("", world),
                              OptimOptions(optimizer="adam", lr=1e-3, warmup_steps=2, grad_clip=1.0, weight_decay=0.1))
        mbs = my_micro_batches(engine, ids, prompts, adv)
        attach_old_logprobs(engine, mbs)
        if name == "ensured":
            initial = export(engine)
            engine.ensure_optimizer_state()
            out["nan|ensured_state_tensors"] = len(_opt_tensors(engine))
            out["nan|ensured_state_kept_weights"] = max_diff(export(engine), initial)
        engine.train_step(mbs, loss_fn)
        first_step[name] = export(engine)
        if name == "plain":
            del engine
            gc.collect()
    out["nan|ensured_state_then_step_vs_plain"] = max_diff(first_step["ensured"], first_step["plain"])
    before = first_step["ensured"]
    opt_before = [v.clone() for v in _opt_tensors(engine)]
    out["nan|num_optimizer_state_tensors"] = len(opt_before)

    def nan_on_rank1(logprobs_R, batch):
        loss, metrics = loss_fn(logprobs_R, batch)
        return (loss * float("nan") if dist.get_rank() == 1 else loss), metrics

    stats = engine.train_step(mbs, nan_on_rank1)
    skipped = [None] * world
    dist.all_gather_object(skipped, (stats["update_successful"], stats["step"], stats["grad_norm"]))
    out["nan|per_rank"] = [[ok, step, str(norm)] for ok, step, norm in skipped]
    after = export(engine)
    out["nan|weights_bit_identical"] = all(torch.equal(after[k], before[k]) for k in before)
    out["nan|optimizer_state_unchanged"] = all(torch.equal(a, b) for a, b in zip(_opt_tensors(engine), opt_before))
    out["nan|grads_zeroed"] = all(bool((b.grad_data == 0).all()) for c in engine.model.chunks for b in c.buffers)
    good = engine.train_step(mbs, loss_fn)
    out["nan|next_step"] = [good["update_successful"], good["step"], good["lr"]]
    out["nan|next_step_changed_weights"] = max_diff(export(engine), before)
    del engine
    gc.collect()


def _opt_tensors(engine):
    from megarl.engine.offload import _torch_optimizers

    return [v for opt in _torch_optimizers(engine.optimizer) for st in opt.state.values()
            for v in st.values() if torch.is_tensor(v) and v.numel() > 1]


def main():
    rank, world = init()
    out = {"world": world}
    dense = sys.argv[1].split(",") if len(sys.argv) > 1 else ["-", "tp2", "pp2"]
    moe = sys.argv[2].split(",") if len(sys.argv) > 2 else ["-", "ep2", "tp2.ep2.etp1.sp1", "pp2"]
    layout_equality(fixture("tiny-qwen2"), [s.replace("-", "") for s in dense], world, out, "qwen2", {})
    layout_equality(fixture("tiny-qwen3_moe"), [s.replace("-", "") for s in moe], world, out, "qwen3_moe",
                    dict(moe_aux_loss_coeff=float(os.environ.get("AUX", 0.01)), moe_z_loss_coeff=float(os.environ.get("ZL", 0.001))))
    reference_and_offload(fixture("tiny-qwen2"), world, out)
    nan_skip(fixture("tiny-qwen2"), world, out)
    report(out)
    dist.barrier()


if __name__ == "__main__":
    main()
