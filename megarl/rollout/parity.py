"""Oracle check: vLLM's load of a checkpoint against transformers' for the same folder.

For fixed prompts it compares greedy continuations (token ids) and the log-probs of the prompt
tokens. transformers is the oracle: its greedy loop here is a plain argmax over full forwards (no
KV cache, no generation heuristics). Run as a module it prints one JSON line per model::

    python -m megarl.rollout.parity fixture:tiny-qwen2 fixture:smollm2 fixture:tiny-deepseek_v3

Legend: P prompt tokens, N new tokens.
"""
from __future__ import annotations

import argparse
import json
import sys

PROMPTS = [
    "The capital of France is",
    "Question: what is 12 + 7? Answer:",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


def hf_reference(path: str, prompts: list[str], num_new: int):
    """(greedy token ids, prompt log-probs) per prompt from transformers in fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    greedy, prompt_lp = [], []
    with torch.no_grad():
        for text in prompts:
            ids_P = tok(text, return_tensors="pt").input_ids
            logp = torch.log_softmax(model(ids_P).logits[0].double(), dim=-1)
            prompt_lp.append(logp[:-1].gather(1, ids_P[0, 1:, None])[:, 0].tolist())
            ids = ids_P
            for _ in range(num_new):
                nxt = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            greedy.append(ids[0, ids_P.shape[1]:].tolist())
    return greedy, prompt_lp, [tok(t).input_ids for t in prompts]


def vllm_outputs(llm, prompt_ids: list[list[int]], num_new: int, one_at_a_time: bool):
    """(greedy token ids, prompt log-probs) from a vLLM engine for tokenised prompts."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True, prompt_logprobs=0)
    batches = [[p] for p in prompt_ids] if one_at_a_time else [prompt_ids]
    greedy, prompt_lp = [], []
    for batch in batches:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        for out, ids in zip(outs, batch):
            greedy.append(list(out.outputs[0].token_ids))
            prompt_lp.append([out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(ids) if i > 0])
    return greedy, prompt_lp


def compare(path: str, num_new: int = 16, one_at_a_time: bool = False, tp: int = 1) -> dict:
    from megarl.models.fixtures import resolve_model_path
    from megarl.rollout.vllm_engine import make_llm, shutdown_llm

    folder = resolve_model_path(path)
    hf_greedy, hf_lp, prompt_ids = hf_reference(folder, PROMPTS, num_new)
    llm = make_llm(folder, tp=tp, max_model_len=256, kv_cache_gib=1, enable_prefix_caching=False,
                   in_process=tp == 1)
    vl_greedy, vl_lp = vllm_outputs(llm, prompt_ids, num_new, one_at_a_time)
    shutdown_llm(llm)
    diffs = [abs(a - b) for x, y in zip(hf_lp, vl_lp) for a, b in zip(x, y)]
    first_mismatch = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                      for x, y in zip(hf_greedy, vl_greedy)]
    return {
        "model": path,
        "greedy_equal": [x == y for x, y in zip(hf_greedy, vl_greedy)],
        "first_mismatch": first_mismatch,
        "prompt_logprob_max_abs_diff": max(diffs),
        "prompt_logprob_count": len(diffs),
        # the first scored position attends to one key only: rope- and softmax-scale-invariant
        "first_position_max_abs_diff": max(abs(x[0] - y[0]) for x, y in zip(hf_lp, vl_lp)),
        "hf_greedy": hf_greedy,
        "vllm_greedy": vl_greedy,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="HF folders or fixture:<name>")
    ap.add_argument("--num-new", type=int, default=16)
    ap.add_argument("--one-at-a-time", nargs="*", default=[],
                    help="model_type values compared one prompt per call (to separate batch effects)")
    args = ap.parse_args(argv)
    from megarl.models.fixtures import resolve_model_path

    for model in args.models:
        model_type = json.load(open(f"{resolve_model_path(model)}/config.json"))["model_type"]
        result = compare(model, args.num_new, one_at_a_time=model_type in args.one_at_a_time)
        result["model_type"] = model_type
        print("PARITY " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
