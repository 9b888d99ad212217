"""Oracle check: vLLM's load of a checkpoint against transformers' for the same folder.

For fixed prompts it compares greedy continuations (token ids) and the log-probs of the prompt
tokens. transformers is the oracle: its greedy loop here is a plain argmax over full forwards (no
KV cache, no generation heuristics). For MoE models it also compares the routing vLLM returns
(:mod:`megarl.rollout.moe_routing`'s ``routed_experts``, captured by :mod:`megarl.compat.vllm_cpu` V4)
for each prompt + greedy continuation with the top-k of transformers' routers on the same full
sequence (:func:`hf_routing`), as sets per token and layer. Run as a module it prints one JSON
line per model::

    python -m megarl.rollout.parity fixture:tiny-qwen2 fixture:smollm2 fixture:tiny-deepseek_v3

Legend: P prompt tokens, N new tokens, S = P + N, L MoE layers, K experts per token.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

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


_GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate$")


def hf_routing(path: str, sequences: list[list[int]]) -> list:
    """Per token sequence, transformers' routing as int64 ``[S, L, K]`` (L: the MoE layers in
    order). Read by forward hooks on the MoE blocks' gates (``model.layers.<i>.mlp.gate``): in
    transformers 5 a gate returns (logits, weights, top-k indices), Qwen3-MoE's the top-k of the
    softmax, DeepSeek-V3's the grouped top-k of sigmoid + ``e_score_correction_bias``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        m = _GATE.match(name)
        if m is not None:
            def hook(_mod, _args, out, layer=int(m.group(1))):
                seen[layer] = out[-1].reshape(-1, out[-1].shape[-1])
            hooks.append(module.register_forward_hook(hook))
    out = []
    with torch.no_grad():
        for ids in sequences:
            seen.clear()
            model(torch.tensor([ids]))
            out.append(torch.stack([seen[k] for k in sorted(seen)], dim=1).numpy())
    for h in hooks:
        h.remove()
    return out


def vllm_outputs(llm, prompt_ids: list[list[int]], num_new: int, one_at_a_time: bool, routing: bool = False):
    """(greedy token ids, prompt log-probs) from a vLLM engine for tokenised prompts; with
    ``routing``, also each prompt + continuation's ``routed_experts`` (the engine must capture
    routing and have megarl's worker extension: :class:`megarl.rollout.moe_routing.RoutingReader`)."""
    from vllm import SamplingParams, TokensPrompt

    from megarl.rollout.lora import adapter_request

    reader = None
    if routing:
        from megarl.rollout.moe_routing import RoutingReader

        reader = RoutingReader(llm)
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True, prompt_logprobs=0)
    batches = [[p] for p in prompt_ids] if one_at_a_time else [prompt_ids]
    greedy, prompt_lp, routed = [], [], []
    for batch in batches:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in batch]
        if reader is None:
            outs, internal = llm.generate(prompts, params, use_tqdm=False, lora_request=adapter_request(llm)), None
        else:   # vLLM's internal ids (the routing's keys) come from enqueue; outputs in enqueue order
            internal = llm.enqueue(prompts, params, use_tqdm=False, lora_request=adapter_request(llm))
            outs = llm.wait_for_completion(use_tqdm=False)
        samples = []
        for j, (out, ids) in enumerate(zip(outs, batch)):
            greedy.append(list(out.outputs[0].token_ids))
            prompt_lp.append([out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(ids) if i > 0])
            if internal is not None:
                assert out.request_id == internal[j].split("-", 1)[0]
                samples.append((internal[j], {"token_ids": greedy[-1]}, len(ids), out.outputs[0]))
        if reader is not None:
            reader.attach(samples)
            routed += [s["routed_experts"] for _, s, _, _ in samples]
    return (greedy, prompt_lp, routed) if routing else (greedy, prompt_lp)


def routing_report(prompt_ids: list[list[int]], greedy: list[list[int]], vllm_routing: list, hf: list) -> dict:
    """vLLM's routing against transformers' for the same sequences: the shapes, the rows holding
    -1 (expected: only the last, the token never run through the model), and the share of
    (token, MoE layer) pairs of every other row whose top-k sets are equal."""
    import numpy as np

    equal = total = 0
    shapes, minus_rows = [], []
    for p, g, v, h in zip(prompt_ids, greedy, vllm_routing, hf):
        shapes.append([list(v.shape), len(p) + len(g), list(h.shape)])
        minus_rows.append([int(i) for i in np.flatnonzero((v < 0).any(axis=(1, 2)))])
        n = min(len(v), len(h)) - 1
        if v.shape[1:] != h.shape[1:] or n <= 0:
            continue
        same = np.sort(v[:n], axis=-1) == np.sort(h[:n], axis=-1)
        equal += int(same.all(axis=-1).sum())
        total += same.shape[0] * same.shape[1]
    return {"agreement": equal / total if total else 0.0, "count": total, "shapes": shapes,
            "minus_one_rows": minus_rows,
            "shapes_ok": all(v == [s, h[1], h[2]] and h[0] == s for v, s, h in shapes)}


def compare(path: str, num_new: int = 16, one_at_a_time: bool = False, tp: int = 1) -> dict:
    """The parity of one model (see the module docstring); MoE models add ``routing``
    (:func:`routing_report`, with the seconds of the generation and of the capture's own code
    in it: ``capture_hooks_s``, the cost of capturing)."""
    from megarl.compat import vllm_cpu
    from megarl.models.fixtures import resolve_model_path
    from megarl.rollout.vllm_engine import make_llm, shutdown_llm
    from megarl.rollout.worker_ext import MOE_LAYOUT, WORKER_EXTENSION

    folder = resolve_model_path(path)
    hf_greedy, hf_lp, prompt_ids = hf_reference(folder, PROMPTS, num_new)
    os.environ[vllm_cpu.CAPTURE_ENV] = "1"   # V4 captures in this process (tp 1) and in the workers it starts
    try:
        llm = make_llm(folder, tp=tp, max_model_len=256, kv_cache_gib=1, enable_prefix_caching=False,
                       in_process=tp == 1, worker_extension_cls=WORKER_EXTENSION)
    finally:
        os.environ.pop(vllm_cpu.CAPTURE_ENV)
    routing = None
    if llm.collective_rpc(MOE_LAYOUT)[0]["layers"]:
        os.environ[vllm_cpu.CAPTURE_ENV] = "1"
        try:
            # tp 1: the worker is this process, its capture time and store are read here (tp > 1: 0, 0)
            captured_s, t = vllm_cpu.CAPTURE_SECONDS[0], time.perf_counter()
            vl_greedy, vl_lp, vl_routing = vllm_outputs(llm, prompt_ids, num_new, one_at_a_time, routing=True)
            gen_s, captured_s = time.perf_counter() - t, vllm_cpu.CAPTURE_SECONDS[0] - captured_s
        finally:
            os.environ.pop(vllm_cpu.CAPTURE_ENV)
        routing = routing_report(prompt_ids, vl_greedy, vl_routing,
                                 hf_routing(folder, [p + g for p, g in zip(prompt_ids, vl_greedy)]))
        routing.update(generate_s=gen_s, capture_hooks_s=captured_s, left_in_store=len(vllm_cpu.STORE))
    else:
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
        "routing": routing,
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
