"""Train step, reference engine and offload on 2 gloo processes (one torchrun launch).

1. Layout equality: one SGD step (PPO loss, token-mean over the global token count, grad clip)
   on the same global batch of 4 sequences at several layouts; the exported HF weights are
   compared with the first layout (tp1 = dp2: each DP rank holds 2 sequences, 1 micro-batch;
   tp2 / pp2 / cp2: one DP rank, 2 micro-batches; ep2: experts split, dense part dp2). A layout
   ``spec/full`` runs with recompute="full".
2. Reference engine: frozen, equals the policy's log-probs before training.
3. Offload/onload (Adam state present): values identical after onload, and a second step after
   offload+onload equals the same step of an engine that never offloaded.
4. LR warm-up, token counts, MoE aux / z loss and per-expert token counts reported.
   MoE models (qwen3-moe; DeepSeek-V3 on a 4-layer variant: dense first layer, 3 MoE layers, also
   at pp2 with recompute="full" and at pp2 x vpp2), with the same engine at
   every layout:
   - routing: the old log-prob pass records the layers' own routing (globally gathered per
     sequence, compared with tp1's), a compare pass with it measures agreement;
   - routing replay: the weights before the step are kept, the plain step runs, the weights are
     put back and the same step runs again with a fixed random routing (seeded, distinct experts
     per token) replayed in its old log-prob pass and its train step; at tp1 a third run replays
     the recorded own routing (must equal the plain step: replaying one's own routing changes
     nothing, and the weight restore is complete).
5. After one step, a NaN loss in one micro-batch on rank 1 (dp=2, Adam): no rank updates, every
   rank reports the skip, the grads are zeroed, and the next (finite) step takes the LR schedule's
   second value, not its third. Adam state created before any update (a checkpoint after skipped
   updates only) changes neither the weights nor the first update.
"""
import dataclasses
import gc
import os
import json
import sys
import time

import torch
import torch.distributed as dist

from engine_common import (deeper_variant, dp_share, export, fixture, groups_for, init, make_batch, max_diff,
                           remove_dir, report)
from megarl.algorithms.losses import ppo_policy_loss
from megarl.policy import ModelOptions, OptimOptions, PolicyModel, SequenceBatch, reference_model

SEQS4 = [(13, 4), (21, 7), (9, 3), (16, 5)]


def global_batch(vocab):
    ids, prompts = make_batch(vocab, seed=3, seqs=SEQS4)
    g = torch.Generator().manual_seed(11)
    adv = [torch.randn(n - p, generator=g) for n, p in SEQS4]
    return ids, prompts, adv


def my_sequences(engine, n):
    """Global indices of this DP rank's sequences, per micro-batch of 2 sequences."""
    sel = dp_share(engine, n)
    return [sel[start:start + 2] for start in range(0, len(sel), 2)]


def my_micro_batches(engine, ids, prompts, adv):
    """Split the 4 sequences over DP ranks, then into micro-batches of 2 sequences."""
    return [SequenceBatch([ids[i] for i in idx], [prompts[i] for i in idx],
                          extras={"advantages_T": torch.cat([adv[i] for i in idx])})
            for idx in my_sequences(engine, len(ids))]


def attach_old_logprobs(engine, mbs, routing=None):
    outs = engine.forward_logprobs(mbs, routing=routing)
    for mb, out in zip(mbs, outs):
        mb.extras["old_logprobs_T"] = out.logprobs_R.detach()
        mb.extras["mask_T"] = torch.ones_like(out.logprobs_R)
    return outs


def loss_fn(logprobs_R, batch):
    e = batch.extras
    return ppo_policy_loss(logprobs_R, e["old_logprobs_T"], e["advantages_T"], e["mask_T"], batch.cu_seqlens_N1,
                           agg_mode="token-mean", num_tokens=batch.num_global_tokens)


def random_routing(lengths, num_moe_layers, top_k, num_experts, seed=29):
    """Per sequence ``[L, Lm, K]`` int16: K distinct random experts per token and MoE layer."""
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(n * num_moe_layers)])
            .view(n, num_moe_layers, top_k).to(torch.int16) for n in lengths]


def gather_routing(seqs, outs, n):
    """The recorded routing of all ``n`` sequences (every rank's micro-batches, any copy), and the
    number of token-layers where two ranks' copies of one sequence differ (0 expected)."""
    local = {i: r for idx, o in zip(seqs, outs) for i, r in zip(idx, o.routing)}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged, copies_differ = {}, 0
    for part in parts:
        for i, r in part.items():
            if i in merged:
                copies_differ += int((merged[i] != r).any(dim=-1).sum())
            merged.setdefault(i, r)
    return [merged[i] for i in range(n)], copies_differ


def snapshot(engine):
    """Every parameter and buffer (DeepSeek's expert bias, router token counts) of this rank. With
    fp32 params megatron's optimizer updates the parameters in place (SGD: no state), so putting
    them back restores the engine's whole state before a step."""
    return [t.detach().clone() for m in engine.model.modules for t in (*m.parameters(), *m.buffers())]


def restore(engine, saved):
    tensors = [t for m in engine.model.modules for t in (*m.parameters(), *m.buffers())]
    assert len(tensors) == len(saved)
    with torch.no_grad():
        for t, v in zip(tensors, saved):
            t.copy_(v)


def layout_equality(path, layouts, world, out, tag, model_kw, routing=False, own_replay_check=False):
    """One SGD step per layout (``spec`` or ``spec/full`` for recompute="full"), compared with the
    first; ``routing`` (MoE): the routing record / compare and random-routing replay checks."""
    ids, prompts, adv = global_batch(json.load(open(f"{path}/config.json"))["vocab_size"])
    optim = OptimOptions(optimizer="sgd", lr=0.5, grad_clip=1.0)
    ref_weights = None
    for layout in layouts:
        t0 = time.perf_counter()
        spec, _, recompute = layout.partition("/")
        engine = PolicyModel(ModelOptions(path=path, recompute=recompute or "none", **model_kw),
                              groups_for(spec, world), optim)
        first = ref_weights is None
        before = export(engine) if first else None
        seqs = my_sequences(engine, len(ids))
        mbs = my_micro_batches(engine, ids, prompts, adv)
        key = f"{tag}|{layout or 'tp1'}"
        if routing:
            plain_outs = attach_old_logprobs(engine, mbs, routing="record")
            own, out[f"{key}|recorded_copies_differ"] = gather_routing(seqs, plain_outs, len(ids))
            lm, k = own[0].shape[1:]
            if first:
                ref_own = own
                num_experts = engine.config.num_moe_experts
                rand = random_routing([len(x) for x in ids], lm, k, num_experts)
                out[f"{tag}|num_moe_layers"] = lm
                out[f"{tag}|num_tokens"] = sum(len(x) for x in ids)
                # tokens per expert the random routing sends, per MoE layer (what replay must count)
                out[f"{tag}|random_tokens_per_expert"] = [
                    torch.bincount(torch.cat([r[:, row].reshape(-1) for r in rand]).long(),
                                   minlength=num_experts).tolist() for row in range(lm)]
            else:   # token-layers whose recorded top-k (in the router's order) differs from tp1's
                out[f"{key}|recorded_vs_tp1"] = sum(int((a != b).any(dim=-1).sum()) for a, b in zip(own, ref_own))
            for mb, idx in zip(mbs, seqs):
                mb.routing = [own[i] for i in idx]
            engine.forward_logprobs(mbs, routing="compare")
            out[f"{key}|compare_own"] = dict(engine.routing_report)
            saved = snapshot(engine)
        else:
            attach_old_logprobs(engine, mbs)
        stats = engine.train_step(mbs, loss_fn, return_logprobs=True)
        train_forward_vs_old_pass(mbs, stats.pop("outputs", None), out, key)
        after = export(engine)
        if first:
            ref_weights, ref_stats = after, stats
            out[f"{tag}|step_changed_weights"] = max_diff(after, before)
        else:
            out[f"{key}|weights_vs_tp1"] = max_diff(after, ref_weights)
            out[f"{key}|grad_norm_diff"] = abs(stats["grad_norm"] - ref_stats["grad_norm"])
            out[f"{key}|loss_diff"] = abs(stats["loss"] - ref_stats["loss"])
        out[f"{key}|stats"] = {k: v for k, v in stats.items() if k != "moe_tokens_per_expert"}
        if "moe_tokens_per_expert" in stats:
            out[f"{key}|moe_tokens_per_expert"] = stats["moe_tokens_per_expert"]
        if routing:
            replay_step(engine, mbs, seqs, rand, saved, out, key, tag, first, before, after)
            if first and own_replay_check:   # replaying the recorded own routing = the plain step
                restore(engine, saved)
                for mb, idx, o in zip(mbs, seqs, plain_outs):
                    mb.routing = [own[i] for i in idx]
                    mb.extras["old_logprobs_T"] = o.logprobs_R.detach()
                s = engine.train_step(mbs, loss_fn, replay_routing=True)
                out[f"{tag}|own_replay_vs_plain_step"] = max_diff(export(engine), after)
                out[f"{tag}|own_replay_stats"] = {k: v for k, v in s.items() if k.startswith("routing")}
        del engine
        gc.collect()
        out[f"{key}|seconds"] = round(time.perf_counter() - t0, 2)


def train_forward_vs_old_pass(mbs, outputs, out, key):
    """|training forward's own log-probs (train_step(return_logprobs=True), last stage) - the old
    log-prob pass's| over all ranks, the ranks that returned them, and whether the entropies are
    finite: what a step that skips the old pass uses instead (megarl.config.passes.needs_old_logprob_pass)."""
    diff, has, finite = -1.0, 0, 1
    if outputs is not None:
        diff = max((o.logprobs_R - mb.extras["old_logprobs_T"]).abs().max().item() for o, mb in zip(outputs, mbs))
        has, finite = 1, int(all(bool(torch.isfinite(o.entropy_R).all()) for o in outputs))
    t = torch.tensor([diff, has, -finite], dtype=torch.float64)
    dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)
    dist.all_reduce(t[1:2])
    dist.all_reduce(t[2:], op=dist.ReduceOp.MAX)
    out[f"{key}|train_forward_vs_old_lp"] = t[0].item()
    out[f"{key}|train_forward_ranks"] = int(t[1].item())
    out[f"{key}|train_forward_entropy_finite"] = t[2].item() == -1


def replay_step(engine, mbs, seqs, rand, saved, out, key, tag, first, before, plain_after):
    """Back to the weights before the plain step; the same step with ``rand`` replayed."""
    restore(engine, saved)
    if first:
        out[f"{tag}|restored_vs_initial"] = max_diff(export(engine), before)
    plain_lp = [mb.extras["old_logprobs_T"] for mb in mbs]
    for mb, idx in zip(mbs, seqs):
        mb.routing = [rand[i] for i in idx]
    attach_old_logprobs(engine, mbs, routing="replay")
    out[f"{key}|replay_logprobs"] = dict(engine.routing_report)
    out[f"{key}|replay_changed_logprobs"] = max((mb.extras["old_logprobs_T"] - lp).abs().max().item()
                                                for mb, lp in zip(mbs, plain_lp))
    stats = engine.train_step(mbs, loss_fn, replay_routing=True)
    after = export(engine)
    out[f"{key}|replay_stats"] = {k: v for k, v in stats.items() if k != "moe_tokens_per_expert"}
    out[f"{key}|replay_tokens_per_expert"] = stats["moe_tokens_per_expert"]
    if first:
        out[f"{tag}|replay_ref_weights"] = after   # popped before the report
        out[f"{tag}|replay_vs_plain_step"] = max_diff(after, plain_after)
    else:
        ref, ref_stats = out[f"{tag}|replay_ref_weights"], out[f"{tag}|tp1|replay_stats"]
        out[f"{key}|replay_weights_vs_tp1"] = max_diff(after, ref)
        out[f"{key}|replay_grad_norm_diff"] = abs(stats["grad_norm"] - ref_stats["grad_norm"])
        out[f"{key}|replay_loss_diff"] = abs(stats["loss"] - ref_stats["loss"])


def reference_and_offload(path, world, out):
    ids, prompts, adv = global_batch(json.load(open(f"{path}/config.json"))["vocab_size"])
    groups = groups_for("tp2", world)
    optim = OptimOptions(optimizer="adam", lr=1e-3, warmup_steps=2, grad_clip=1.0)
    ref = reference_model(ModelOptions(path=path), groups)
    out["ref_requires_grad"] = any(p.requires_grad for c in ref.model.chunks for p in c.parameters())
    out["ref_has_optimizer"] = ref.optimizer is not None

    engines = {}
    for name in ("plain", "offloaded", "optimizer_offload"):
        # optimizer_offload: megatron-core's HybridDeviceOptimizer keeps the fp32 main params and
        # Adam state on the host (trainer.optimizer_offload); it also offloads + onloads the rest
        engine = PolicyModel(ModelOptions(path=path), groups,
                              dataclasses.replace(optim, cpu_offload=name == "optimizer_offload"))
        mbs = my_micro_batches(engine, ids, prompts, adv)
        attach_old_logprobs(engine, mbs)
        if name == "plain":
            ref_lp = torch.cat([o.logprobs_R for o in ref.forward_logprobs(mbs)])
            out["ref_vs_policy_logprobs"] = (ref_lp - torch.cat([m.extras["old_logprobs_T"] for m in mbs])).abs().max().item()
        s1 = engine.train_step(mbs, loss_fn, with_entropy=True)
        out[f"{name}|lr_step1"] = s1["lr"]
        if name == "optimizer_offload":
            from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
            from megarl.policy.offload import _torch_optimizers

            inner = _torch_optimizers(engine.optimizer)
            out["optimizer_offload|hybrid"] = all(isinstance(o, HybridDeviceOptimizer) for o in inner)
            model_ptrs = {p.untyped_storage().data_ptr() for c in engine.model.chunks for p in c.parameters()}
            masters = [st["master_param"] for o in inner for st in o.state.values()]
            # the host copies are their own storage (not views of the model's parameter buffer)
            out["optimizer_offload|host_copies"] = len(masters) > 0 and not any(
                m.untyped_storage().data_ptr() in model_ptrs for m in masters)
            engine.offload()
            out["optimizer_offload|offloaded_bytes"] = engine.offloader.offloaded_bytes
            engine.onload()
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
    out["optimizer_offload|vs_plain"] = max_diff(engines["optimizer_offload"], engines["plain"])


def nan_skip(path, world, out):
    ids, prompts, adv = global_batch(json.load(open(f"{path}/config.json"))["vocab_size"])
    first_step = {}
    for name in ("plain", "ensured"):   # Adam state made before any update (to save a checkpoint) changes nothing
        engine = PolicyModel(ModelOptions(path=path), groups_for("", world),
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


NEW_LOSSES = ("sapo", "cispo", "geo_mean", "clip_cov", "kl_cov", "gpg")


def loss_layouts(path, world, out):
    """One SGD step with each policy loss of the algorithm-breadth issue, built the trainer's way
    (megarl.actors.algorithm.make_loss_fn from a resolved AlgorithmConfig), at tp2 and cp2 against
    tp1 (dp2): the same micro-batches at every layout (2 sequences each), old log-probs shifted by
    a fixed ramp so the ratios leave 1 (clips, gates and covariance selections act; the cov losses
    select 20% of the tokens). One engine per layout, its weights restored between losses."""
    from megarl.config.presets import resolve_algorithm
    from megarl.config.schema import AlgorithmConfig
    from megarl.actors.algorithm import make_loss_fn

    ids, prompts, adv = global_batch(json.load(open(f"{path}/config.json"))["vocab_size"])
    optim = OptimOptions(optimizer="sgd", lr=0.5, grad_clip=1.0)
    refs = {}
    for layout in ("", "tp2", "cp2"):
        engine = PolicyModel(ModelOptions(path=path), groups_for(layout, world), optim)
        saved = snapshot(engine)
        for name in NEW_LOSSES:
            cfg = resolve_algorithm(AlgorithmConfig(policy_loss=name, cov_clip_ratio=0.2, cov_low=0.0,
                                                    cov_high=1e3, kl_cov_ratio=0.2), 16)
            restore(engine, saved)
            mbs = my_micro_batches(engine, ids, prompts, adv)
            attach_old_logprobs(engine, mbs)
            for mb in mbs:
                old = mb.extras["old_logprobs_T"]
                mb.extras["old_logprobs_T"] = old + torch.linspace(-0.6, 0.6, old.numel())
            stats = engine.train_step(mbs, make_loss_fn(cfg, 16))
            weights = export(engine)
            key = f"loss|{name}|{layout or 'tp1'}"
            if not layout:
                refs[name] = (weights, stats)
                out[f"{key}|step_changed_weights"] = max_diff(weights, {k: v for k, v in export_before(engine, saved)})
                out[f"{key}|loss"] = stats["loss"]
            else:
                out[f"{key}|weights_vs_tp1"] = max_diff(weights, refs[name][0])
                out[f"{key}|loss_diff"] = abs(stats["loss"] - refs[name][1]["loss"])
            out[f"{key}|metrics"] = {k: v for k, v in stats.items() if k.startswith(("cov_", "clip_frac", "gate_"))}
        del engine
        gc.collect()


def export_before(engine, saved):
    """The HF export of ``engine`` at the ``saved`` weights (then put back as they were)."""
    now = snapshot(engine)
    restore(engine, saved)
    before = export(engine)
    restore(engine, now)
    return before.items()


def _opt_tensors(engine):
    from megarl.policy.offload import _torch_optimizers

    return [v for opt in _torch_optimizers(engine.optimizer) for st in opt.state.values()
            for v in st.values() if torch.is_tensor(v) and v.numel() > 1]


def main():
    rank, world = init()
    out = {"world": world}
    dense = sys.argv[1].split(",") if len(sys.argv) > 1 else ["-", "tp2", "pp2"]
    moe = sys.argv[2].split(",") if len(sys.argv) > 2 else ["-", "ep2", "tp2.ep2.etp1.sp1", "pp2", "cp2"]
    dsv3 = sys.argv[3].split(",") if len(sys.argv) > 3 else ["-", "tp2.ep2.etp1.sp1", "pp2/full", "pp2.vpp2"]
    moe_kw = dict(moe_aux_loss_coeff=float(os.environ.get("AUX", 0.01)), moe_z_loss_coeff=float(os.environ.get("ZL", 0.001)))
    t0 = time.perf_counter()   # seconds|<section>: cumulative since here
    layout_equality(fixture("tiny-qwen2"), [s.replace("-", "") for s in dense], world, out, "qwen2", {})
    out["seconds|qwen2"] = round(time.perf_counter() - t0, 2)
    layout_equality(fixture("tiny-qwen3_moe"), [s.replace("-", "") for s in moe], world, out, "qwen3_moe", moe_kw,
                    routing=True, own_replay_check=True)
    out["seconds|qwen3_moe"] = round(time.perf_counter() - t0, 2)
    if dsv3 != [""]:
        ds_path = deeper_variant("deepseek_v3", 4)   # dense first layer + 3 MoE layers: MoE on both pp2 stages
        # megatron's global aux-loss tracker keeps the layer count of the first MoE model of the
        # process (2 here): a deeper model then indexes past it. MoEStats.reset only zeroes it.
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
        # aux loss on, no z-loss (DeepSeek-V3 has none; under SP megatron's z-loss differs by ~3e-6 between layouts)
        layout_equality(ds_path, [s.replace("-", "") for s in dsv3], world, out, "deepseek_v3",
                        dict(moe_aux_loss_coeff=moe_kw["moe_aux_loss_coeff"]), routing=True)
        remove_dir(ds_path)
    out["seconds|deepseek_v3"] = round(time.perf_counter() - t0, 2)
    for k in [k for k in out if k.endswith("|replay_ref_weights")]:
        del out[k]
    loss_layouts(fixture("tiny-qwen2"), world, out)
    out["seconds|loss_layouts"] = round(time.perf_counter() - t0, 2)
    reference_and_offload(fixture("tiny-qwen2"), world, out)
    nan_skip(fixture("tiny-qwen2"), world, out)
    out["seconds|total"] = round(time.perf_counter() - t0, 2)
    report(out)
    dist.barrier()


if __name__ == "__main__":
    main()
