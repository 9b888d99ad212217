"""LoRA on the Megatron policy (megarl.policy.lora), 2 gloo processes, fp32.

Per model (tiny-qwen2: GQA with q/k/v biases; tiny-llama) and layout (tp1 = dp2, tp2, tp2 with
sequence parallelism, pp2, cp2), one trainable engine with LoRA rank 8 on all four targets and
random non-zero adapters (the same whole tensors at every layout):

1. Oracle: the response log-probs equal transformers + peft's (``PeftModel.from_pretrained`` of
   the adapter folder this layout exported: adapter_config.json + adapter_model.safetensors).
   The merged export (W + alpha/r B A, what the weight bridge sends) loaded into transformers
   gives the same log-probs.
2. Adapters off (the reference policy without a copy): the log-probs equal the plain HF model's.
3. One SGD step (lr 0.5, clipped at 1) of a PPO loss over the same global batch (DP ranks their half): the adapters
   after it (PEFT tensors, gathered) are compared with the first layout's; the base weights did
   not move; the optimizer holds the adapters' elements only.

Reports max differences; the test (tests/distributed/test_lora.py) holds the tolerances.
"""
import dataclasses
import gc
import sys
import tempfile

import torch
import torch.distributed as dist

from engine_common import (deeper_variant, fixture, groups_for, hf_logprobs, init, make_batch, max_diff, micro_batches,
                           report)
from engine_train import attach_old_logprobs, global_batch, loss_fn, my_micro_batches
from megarl.policy import ModelOptions, OptimOptions, PolicyModel
from megarl.policy.lora import LoraOptions, adapters_disabled, peft_state, write_peft_folder

OPTIONS = LoraOptions(rank=8, alpha=16.0)


def randomize(adapters, seed: int = 5) -> None:
    """Non-zero A and B from their names: the same whole tensors at every layout."""
    for a in adapters:
        g = torch.Generator().manual_seed(seed + sum(map(ord, a.name)))
        a.load_full(torch.randn(a.a_logical.shape, generator=g) * 0.1, torch.randn(a.b_logical.shape, generator=g) * 0.05)


def peft_logprobs(path: str, folder: str, ids, prompts, merged: dict = None) -> torch.Tensor:
    """transformers + peft: the base model with the adapter folder loaded, response log-probs;
    with ``merged`` (HF tensors) instead: the plain model with those weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    if merged is not None:
        # routed experts are not adapted (their merged weights are the base's), and transformers
        # fuses them into gate_up_proj / down_proj stacks: they are left as loaded
        merged = {k: v for k, v in merged.items() if ".mlp.experts." not in k}
        missing, unexpected = base.load_state_dict(merged, strict=False)
        assert not unexpected and all("lm_head" in k or ".mlp.experts." in k for k in missing), (missing, unexpected)
    model = (base if merged is not None else PeftModel.from_pretrained(base, folder)).eval()
    out = []
    with torch.no_grad():
        for x, p in zip(ids, prompts):
            logp = torch.log_softmax(model(x[None]).logits[0].double(), dim=-1)
            out.append(logp[p - 1:-1].gather(1, x[p:, None])[:, 0])
    del model, base
    gc.collect()
    return torch.cat(out)


def run_layout(path, spec, world, ids, prompts, batch, scratch, options=OPTIONS) -> dict:
    engine = PolicyModel(ModelOptions(path=path, lora=options), groups_for(spec, world),
                         OptimOptions(optimizer="sgd", lr=0.5, grad_clip=1.0))
    adapters = engine.model.adapters
    randomize(adapters)
    out = {"adapters": len(adapters)}
    folder = [f"{scratch}/{spec or 'tp1'}"]
    state = peft_state(adapters, engine.model.mapping, engine.groups)
    if dist.get_rank() == 0:
        write_peft_folder(folder[0], state, options, path)
    dist.barrier()
    got = torch.cat([o.logprobs_R for o in engine.forward_logprobs(micro_batches(ids, prompts))]).double()
    with adapters_disabled(adapters):
        off = torch.cat([o.logprobs_R for o in engine.forward_logprobs(micro_batches(ids, prompts))]).double()
    out["lora"], out["off"] = got, off
    merged = {k: v.detach().clone() for k, v in engine.export_hf()}   # W + scale * B A
    if dist.get_rank() == 0:
        out["folder"], out["merged"] = folder[0], merged
    with adapters_disabled(adapters):
        before = {k: v.detach().clone() for k, v in engine.export_hf()}
    mbs = my_micro_batches(engine, *batch)
    attach_old_logprobs(engine, mbs)
    result = engine.train_step(mbs, loss_fn)
    out["update_successful"], out["loss"] = bool(result["update_successful"]), float(result["loss"])
    with adapters_disabled(adapters):
        out["base_moved"] = max_diff(before, {k: v.detach().clone() for k, v in engine.export_hf()})
    out["trained"] = peft_state(adapters, engine.model.mapping, engine.groups)
    optimized = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]) \
        if hasattr(engine.optimizer, "param_groups") else None
    local_adapter = sum(a.lora_A.numel() + a.lora_B.numel() for a in adapters)
    out["optimizer_elements"], out["adapter_elements"] = optimized, local_adapter
    del engine
    gc.collect()
    return out


def main():
    rank, world = init()
    scratch = [tempfile.mkdtemp(prefix="megarl-lora-") if rank == 0 else None]
    dist.broadcast_object_list(scratch)
    report_out = {}
    for entry in sys.argv[1].split(","):
        # "family" (layouts: argv[2]) or "family:layout+layout"; "qwen2-4l": a 4-layer tiny-qwen2 (for vpp)
        family, _, own = entry.partition(":")
        layouts = own.split("+") if own else sys.argv[2].split(",")
        name, _, layers = family.partition("-")
        path = deeper_variant(name, int(layers.removesuffix("l"))) if layers else fixture(f"tiny-{family}")
        # MoE models: adapters on attention only (routed experts are not adapted)
        options = dataclasses.replace(OPTIONS, targets=("linear_qkv", "linear_proj")) if "moe" in name else OPTIONS
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(path).vocab_size
        ids, prompts = make_batch(vocab)
        batch = global_batch(vocab)
        plain = hf_logprobs(path, ids, prompts) if rank == 0 else None
        first = None
        for spec in layouts:
            spec = "" if spec == "-" else spec
            res = run_layout(path, spec, world, ids, prompts, batch, scratch[0], options)
            key = f"{family}|{spec or 'tp1'}"
            if rank == 0:
                oracle = peft_logprobs(path, res["folder"], ids, prompts)
                report_out[f"{key}|peft_vs_engine"] = (res["lora"] - oracle).abs().max().item()
                report_out[f"{key}|adapter_effect"] = (oracle - plain).abs().max().item()
                merged = peft_logprobs(path, None, ids, prompts, merged=res["merged"])
                report_out[f"{key}|merged_vs_engine"] = (res["lora"] - merged).abs().max().item()
                report_out[f"{key}|off_vs_hf"] = (res["off"] - plain).abs().max().item()
                report_out[f"{key}|base_moved"] = res["base_moved"]
                report_out[f"{key}|update_successful"] = res["update_successful"]
                report_out[f"{key}|adapters"] = res["adapters"]
                report_out[f"{key}|optimizer_elements"] = res["optimizer_elements"]
                report_out[f"{key}|adapter_elements"] = res["adapter_elements"]
                if first is None:
                    first, first_loss = res["trained"], res["loss"]
                    report_out[f"{key}|step_moved"] = max(
                        (res["trained"][k] - v).abs().max().item() for k, v in
                        peft_state_of_folder(res["folder"]).items())
                else:
                    report_out[f"{key}|step_vs_first"] = max_diff(first, res["trained"])
                    report_out[f"{key}|loss_vs_first"] = abs(res["loss"] - first_loss)
            dist.barrier()
    report(report_out)


def peft_state_of_folder(folder: str) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{folder}/adapter_model.safetensors")


if __name__ == "__main__":
    main()
