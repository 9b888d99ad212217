"""megarl sft / rm on the engine, 2 gloo processes: ``run`` inside the launch of engine_parity.py
(tests/distributed/test_posttrain_engine.py), or this script alone under torchrun.

1. SFT: one SGD step of the SFT loss (token-mean, and seq-mean-token-sum) built as the workers
   build it (megarl.algorithms.posttrain.make_loss_fn) on 4 sequences (2 per micro-batch) at tp1
   (= dp2), tp2, pp2, cp2 (tiny-qwen2): the loss and the HF-exported weights are compared with tp1.
2. Reward model: the score head set to a seeded random weight; each sequence's score vs
   transformers' AutoModelForSequenceClassification loading the engine's own export (HF layout,
   reward_model_config) at every layout; then one SGD step of the Bradley-Terry loss on the 2
   pairs (one pair per micro-batch) whose weights (score.weight included) are compared with tp1.
"""
import gc
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from engine_common import dp_share, export, fixture, groups_for, init, make_batch, max_diff, report
from megarl.policy import ModelOptions, OptimOptions, PolicyModel, SequenceBatch
from megarl.algorithms.posttrain import make_loss_fn

SEQS4 = [(13, 4), (21, 7), (9, 3), (16, 5)]
LAYOUTS = ["", "tp2", "pp2", "cp2"]


def batch(path):
    cfg = json.load(open(f"{path}/config.json"))
    ids, prompts = make_batch(cfg["vocab_size"], seed=3, seqs=SEQS4)
    pad = cfg.get("pad_token_id", cfg.get("eos_token_id"))
    for x in ids:   # HF's classifier reads the last non-pad token; the engine the last token: make them one
        if int(x[-1]) == pad:
            x[-1] = (pad + 1) % cfg["vocab_size"]
    return ids, prompts


def my_micro_batches(engine, ids, prompts, per_mb=2, extras=None):
    """This DP rank's share of the 4 sequences, ``per_mb`` sequences per micro-batch."""
    sel = dp_share(engine, len(ids))
    groups = [sel[s:s + per_mb] for s in range(0, len(sel), per_mb)]
    return [SequenceBatch([ids[i] for i in g], [prompts[i] for i in g], dict(extras(g)) if extras else {})
            for g in groups], groups


def against_tp1(out, key, ref, weights, loss, before):
    """The first layout's step is the reference (and must change the weights from ``before``);
    a later one's weights and loss are compared with it. Returns the reference."""
    if ref is None:
        out[f"{key}|step_changed_weights"] = max_diff(weights, before)
        out[f"{key}|loss"] = loss
        return weights, loss
    out[f"{key}|weights_vs_tp1"] = max_diff(weights, ref[0])
    out[f"{key}|loss_diff"] = abs(loss - ref[1])
    return ref


def sft_layouts(path, world, out):
    ids, prompts = batch(path)
    for agg in ("token-mean", "seq-mean-token-sum"):
        ref = None
        for spec in LAYOUTS:
            engine = PolicyModel(ModelOptions(path=path), groups_for(spec, world),
                                  OptimOptions(optimizer="sgd", lr=0.5, grad_clip=1.0))
            before = export(engine) if ref is None else None
            mbs, _ = my_micro_batches(engine, ids, prompts)
            stats = engine.train_step(mbs, make_loss_fn("sft", loss_agg=agg))
            ref = against_tp1(out, f"sft|{agg}|{spec or 'tp1'}", ref, export(engine), stats["loss"], before)
            del engine
            gc.collect()


def hf_scores(folder, ids) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    with torch.no_grad():
        out = torch.stack([model(x[None]).logits[0, 0].double() for x in ids])
    del model
    gc.collect()
    return out


def gathered_scores(engine, mbs, groups, n):
    local = {i: float(s) for g, scores in zip(groups, engine.forward_scores(mbs)) for i, s in zip(g, scores)}
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, local)
    merged = {}
    for d in box:
        merged.update(d)
    return torch.tensor([merged[i] for i in range(n)], dtype=torch.float64)


def rm_layouts(path, world, out, rank):
    from megarl.policy.value import head_weight
    from megarl.models.seqcls import reward_model_config

    ids, prompts = batch(path)
    hidden = json.load(open(f"{path}/config.json"))["hidden_size"]
    w = torch.randn(1, hidden, generator=torch.Generator().manual_seed(5)) * hidden ** -0.5
    margins = lambda g: {"margin_P": torch.zeros(len(g) // 2)}   # noqa: E731
    ref = None
    tmp = tempfile.mkdtemp(prefix="megarl_rm_") if rank == 0 else None
    for spec in LAYOUTS:
        engine = PolicyModel(ModelOptions(path=path, score_head=True), groups_for(spec, world),
                              OptimOptions(optimizer="sgd", lr=0.5, grad_clip=1.0))
        head = head_weight(engine.model.modules)
        if head is not None:
            head.data.copy_(w)
        key = f"rm|{spec or 'tp1'}"
        mbs, groups = my_micro_batches(engine, ids, prompts, per_mb=2, extras=margins)
        scores = gathered_scores(engine, mbs, groups, len(ids))
        weights = export(engine)
        if rank == 0:
            folder = os.path.join(tmp, key.replace("|", "_"))
            os.makedirs(folder)
            for f in os.listdir(path):
                if not f.endswith(".safetensors") and f != "config.json" and os.path.isfile(f"{path}/{f}"):
                    shutil.copy2(f"{path}/{f}", folder)
            with open(f"{folder}/config.json", "w") as fh:
                fh.write(reward_model_config(path))
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in weights.items()}, f"{folder}/model.safetensors")
            out[f"{key}|vs_hf"] = (scores - hf_scores(folder, ids)).abs().max().item()
            out[f"{key}|scores"] = scores.tolist()
        stats = engine.train_step(mbs, make_loss_fn("rm", use_margin=True))
        ref = against_tp1(out, key, ref, export(engine), stats["loss"], weights)
        del engine
        gc.collect()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def run(rank: int, world: int) -> dict:
    out = {"world": world}
    sft_layouts(fixture("tiny-qwen2"), world, out)
    rm_layouts(fixture("tiny-qwen2"), world, out, rank)
    return out


def main():
    rank, world = init()
    report(run(rank, world))
    dist.barrier()


if __name__ == "__main__":
    main()
