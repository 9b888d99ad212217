"""megarl dpo's step (megarl.algorithms.posttrain.dpo_loss) on 2 gloo processes, fp32.

``layouts MODEL SPECS``: one DPO step (SGD, lr 0.5, clipped at 1) of the policy against its frozen
reference (a second engine of the same weights) on 4 fixed pairs at each layout; reports the loss
(ln 2 exactly: the policy is its reference before the step), and the weights after it against the
first layout's.

``lora MODEL SPECS``: the same step with LoRA (rank 8 on all four targets, random non-zero adapters,
the same whole tensors at every layout): the reference is the policy itself with its adapters off
(megarl.actors.roles.ReferenceRole, no second model). Reports the loss (not ln 2: the adapters
make the policy differ from its reference), the adapters after the step against the first
layout's, and how far the frozen base moved.

``trl MODEL``: the oracle (rank 0 only; the other rank waits). TRL's DPOTrainer tokenises 8
arithmetic pairs and takes one step (sigmoid loss, beta 0.1, AdamW lr 1e-5, no weight decay,
eps 1e-8, grad norm clipped at 1, constant LR, fp32 on the CPU, 8 pairs per step); megarl's engine
(tp1, megatron's Adam with the same settings) takes the same step on TRL's token ids (its prompt,
chosen and rejected ids, EOS included). Two steps on the same pairs (TRL: its second epoch), so
that step 2's loss and rewards/* follow one update. Reports the two losses and rewards/* of step
2, and the largest weight difference after it relative to the largest weight.
"""
import math
import sys
import tempfile

import torch
import torch.distributed as dist

from engine_common import export, fixture, groups_for, init, make_batch, max_diff, report
from megarl.algorithms.posttrain import make_loss_fn
from megarl.policy import ModelOptions, OptimOptions, PolicyModel, SequenceBatch, reference_model

PAIRS = [(13, 4, 9), (21, 7, 12), (9, 3, 14), (16, 5, 6)]   # (chosen length, prompt, rejected length)
OPTIONS = {"beta": 0.1, "loss": "sigmoid", "label_smoothing": 0.0, "sft_weight": 0.0}


def pair_batches(vocab: int, engine) -> list:
    """This DP rank's pairs, one pair (chosen, rejected: the same prompt) per micro-batch."""
    chosen, prompts = make_batch(vocab, seed=3, seqs=[(n, p) for n, p, _ in PAIRS])
    rest, _ = make_batch(vocab, seed=4, seqs=[(r, 1) for _, _, r in PAIRS])
    rejected = [torch.cat([c[:p], r[:n - p]]) for c, p, r, (_, _, n) in zip(chosen, prompts, rest, PAIRS)]
    dp, dp_rank = engine.groups.topology.dp, engine.groups.dp_rank
    mine = range(dp_rank * len(PAIRS) // dp, (dp_rank + 1) * len(PAIRS) // dp)
    return [SequenceBatch([chosen[i], rejected[i]], [prompts[i], prompts[i]]) for i in mine]


def dpo_step(engine, ref, mbs, options=OPTIONS) -> dict:
    """One DPO step of ``engine`` against ``ref`` (a frozen engine, or ``engine`` itself under LoRA:
    its adapters off), the reference's log-probs attached as megarl dpo's ranks attach them."""
    from megarl.actors.roles import ReferenceRole

    ReferenceRole(None, ref).attach_logprobs(mbs)
    return engine.train_step(mbs, make_loss_fn("dpo", **options))


def record(out: dict, key: str, result: dict, state: dict, first: dict | None) -> dict:
    """The step's loss and outcome under ``key``, and ``state`` against the first layout's (the
    first layout's own ``state`` is returned as ``first``)."""
    out[f"{key}|loss"] = float(result["loss"])
    out[f"{key}|update_successful"] = bool(result["update_successful"])
    if first is not None:
        out[f"{key}|vs_first"] = max_diff(state, first)
    return state if first is None else first


def layouts(path: str, specs: list, world: int) -> dict:
    vocab = __import__("json").load(open(f"{path}/config.json"))["vocab_size"]
    out, first = {}, None
    for spec in specs:
        spec = "" if spec == "-" else spec
        groups = groups_for(spec, world)
        engine = PolicyModel(ModelOptions(path=path), groups, OptimOptions(optimizer="sgd", lr=0.5, grad_clip=1.0))
        ref = reference_model(ModelOptions(path=path), groups)
        result = dpo_step(engine, ref, pair_batches(vocab, engine))
        weights, key = export(engine), spec or "tp1"
        if first is None:
            out[f"{key}|moved"] = max_diff(weights, export(ref))
        first = record(out, key, result, weights, first)
        del engine, ref
    return out


def lora_layouts(path: str, specs: list, world: int) -> dict:
    from lora import randomize

    from megarl.policy.lora import LoraOptions, adapters_disabled, peft_state

    vocab = __import__("json").load(open(f"{path}/config.json"))["vocab_size"]
    out, first = {}, None
    for spec in specs:
        spec = "" if spec == "-" else spec
        groups = groups_for(spec, world)
        engine = PolicyModel(ModelOptions(path=path, lora=LoraOptions(rank=8, alpha=16.0)), groups,
                             OptimOptions(optimizer="sgd", lr=0.5, grad_clip=1.0))
        adapters = engine.model.adapters
        randomize(adapters)
        with adapters_disabled(adapters):
            base = export(engine)
        result = dpo_step(engine, engine, pair_batches(vocab, engine))   # the reference: the policy, adapters off
        trained = peft_state(adapters, engine.model.mapping, engine.groups)
        key = spec or "tp1"
        with adapters_disabled(adapters):
            out[f"{key}|base_moved"] = max_diff(base, export(engine))
        if first is None:
            out[f"{key}|adapters"] = len(trained)
        first = record(out, key, result, trained, first)
        del engine
    return out


ROWS = [("What is 12 + 7?", " 12 + 7 = 19.\n#### 19", " 12 + 7 = 18.\n#### 18"),
        ("Compute 6 * 4.", " 6 * 4 = 24.\n#### 24", " 6 * 4 is the result."),
        ("What is 30 - 9?", " 30 - 9 = 21.\n#### 21", " 30 - 9 = 21.\n#### 22"),
        ("Compute 5 * 5 + 1.", " 5 * 5 = 25. 25 + 1 = 26.\n#### 26", " 5 * 5 = 25. 25 + 1 = 27.\n#### 27"),
        ("What is 100 / 4?", " 100 / 4 = 25.\n#### 25", " I think it is about 26."),
        ("Compute 8 + 8 + 8.", " 8 + 8 = 16. 16 + 8 = 24.\n#### 24", " 8 + 8 = 16. 16 + 8 = 25.\n#### 25"),
        ("What is 7 * 3?", " 7 * 3 = 21.\n#### 21", " 7 * 3 = 21.\n#### 12"),
        ("Compute 50 - 25.", " 50 - 25 = 25.\n#### 25", " 50 - 25 is the result.")]
LR = 1e-5


def trl_oracle(path: str) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in ROWS])
    args = DPOConfig(output_dir=tempfile.mkdtemp(prefix="megarl-trl-"), per_device_train_batch_size=len(ROWS),
                     max_steps=2, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
                     adam_epsilon=1e-8, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, beta=0.1,
                     loss_type=["sigmoid"], logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                     save_strategy="no", seed=0, dataloader_num_workers=0)
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=data, processing_class=tok)
    rows = list(trainer.train_dataset)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][-1]   # step 2's: after one update
    trl_weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    del trainer, model, ref_model

    groups = groups_for("", 1)
    engine = PolicyModel(ModelOptions(path=path), groups, OptimOptions(optimizer="adam", lr=LR, grad_clip=1.0,
                                                                      adam_eps=1e-8))
    ref = reference_model(ModelOptions(path=path), groups)
    seqs, prompts = [], []
    for row in rows:
        for side in ("chosen_ids", "rejected_ids"):
            seqs.append(torch.tensor(row["prompt_ids"] + row[side]))
            prompts.append(len(row["prompt_ids"]))
    mbs = [SequenceBatch(seqs[i:i + 4], prompts[i:i + 4]) for i in range(0, len(seqs), 4)]
    dpo_step(engine, ref, mbs)
    result = dpo_step(engine, ref, mbs)   # the same 8 pairs again, as TRL's second step (its epoch 2)
    ours = export(engine)
    scale = max(v.abs().max().item() for v in ours.values())
    diff = max((ours[k] - trl_weights[k]).abs().max().item() for k in ours if k in trl_weights)
    pairs = float(result["pairs"])   # the metrics are averaged over micro-batches alike: ratios are exact
    out = {"trl|loss": logged["loss"], "megarl|loss": float(result["loss"])}
    for name, key in (("chosen", "rewards_chosen_sum"), ("rejected", "rewards_rejected_sum"),
                      ("margins", "margin_sum"), ("accuracies", "correct_sum")):
        out[f"trl|rewards/{name}"] = logged[f"rewards/{name}"]
        out[f"megarl|rewards/{name}"] = float(result[key]) / pairs
    return {**out,
            "weights_rel": diff / scale, "compared": sum(k in trl_weights for k in ours), "tensors": len(ours),
            "ln2": math.log(2)}


def main():
    rank, world = init()
    mode = sys.argv[1]
    if mode == "layouts":
        report(layouts(fixture(f"tiny-{sys.argv[2]}"), sys.argv[3].split(","), world))
    elif mode == "lora":
        report(lora_layouts(fixture(f"tiny-{sys.argv[2]}"), sys.argv[3].split(","), world))
    elif mode == "trl":
        out = trl_oracle(fixture(sys.argv[2])) if rank == 0 else {}
        dist.barrier()
        report(out)


if __name__ == "__main__":
    main()
