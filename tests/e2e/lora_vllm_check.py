"""vLLM's LoRA path as the adapter sync drives it (``python lora_vllm_check.py MODEL...``; one JSON
line ``LORA {...}`` per model): an engine built with megarl's LoRA options, two random PEFT adapters
(transformers + peft, rank 8 on q/k/v/o/gate/up/down) loaded one after the other in place through
:func:`megarl.rollout.lora.load_adapter`; after each load, vLLM's prompt log-probs of a batch of
prompts (one batch: the prompt-log-prob path that megarl.compat.vllm_cpu V5 fixes) and the
log-probs of the tokens it samples, both against peft's; before any load, against the plain model."""
import json
import sys
import tempfile

import torch


def hf_logprobs(model, seqs, starts) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for seq, start in zip(seqs, starts):
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), -1)
            out.append([logp[i - 1, seq[i]].item() for i in range(start, len(seq))])
    return out


def worst(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def check(name: str) -> dict:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams, TokensPrompt

    from megarl.models.fixtures import resolve_model_path
    from megarl.rollout.lora import adapter_request, engine_options, load_adapter
    from megarl.rollout.parity import vllm_outputs
    from megarl.rollout.vllm_engine import make_llm, shutdown_llm

    path = str(resolve_model_path(name))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    plain_model = base
    prompts = [[1, 5, 9, 22, 17, 40, 3, 8], [4, 9, 2, 7], [11, 12, 13, 14, 15, 16]]
    llm = make_llm(path, in_process=True, distributed_executor_backend="uni", enable_chunked_prefill=False,
                   worker_extension_cls="megarl.rollout.worker_ext.BridgeWorkerExtension", **engine_options(8))
    row = {"model": name}
    _, plp = vllm_outputs(llm, prompts, 1, one_at_a_time=False)
    row["plain_vs_hf"] = worst(plp, hf_logprobs(plain_model, prompts, [1] * 3))
    peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).eval()
    for trial in (1, 2):
        for n, p in peft.named_parameters():
            if "lora_" in n:
                torch.nn.init.normal_(p, std=0.05 if "lora_B" in n else 0.2)
        with tempfile.TemporaryDirectory() as folder:
            peft.save_pretrained(folder)
            tensors = load_file(f"{folder}/adapter_model.safetensors")
            config = json.load(open(f"{folder}/adapter_config.json"))
        loaded = load_adapter(llm, tensors, config, trial)
        row[f"bytes{trial}"] = loaded["bytes"]
        _, plp = vllm_outputs(llm, prompts, 1, one_at_a_time=False)
        with peft.disable_adapter():
            effect = worst(hf_logprobs(peft, prompts, [1] * 3), plp)
        row[f"prompt{trial}_vs_peft"] = worst(plp, hf_logprobs(peft, prompts, [1] * 3))
        row[f"effect{trial}"] = effect
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(n=2, max_tokens=6, logprobs=0, temperature=1.0, seed=3),
                            lora_request=adapter_request(llm), use_tqdm=False)
        seqs, starts, got = [], [], []
        for p, out in zip(prompts, outs):
            for o in out.outputs:
                seqs.append(p + list(o.token_ids))
                starts.append(len(p))
                got.append([o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)])
        row[f"sampled{trial}_vs_peft"] = worst(got, hf_logprobs(peft, seqs, starts))
    shutdown_llm(llm)
    return row


if __name__ == "__main__":
    for model in sys.argv[1:]:
        print("LORA " + json.dumps(check(model)), flush=True)
