"""vLLM's sampling parameters of megarl's samples, and the samples read from vLLM's outputs.

A sample is a dict: ``token_ids`` (the response), ``logprobs`` (vLLM's log-prob of each sampled
token), ``clipped`` (cut at the token budget); with ``rollout.speculative``, each position's top-k
log-probs; with routing capture, ``routed_experts`` (:mod:`megarl.rollout.moe_routing`).
"""
from __future__ import annotations

from megarl.rollout.moe_routing import routing_reader


def child_id(internal_id: str, index: int, n: int) -> str:
    """vLLM's internal id of sample ``index`` of a request of ``n`` samples (n > 1: child requests
    ``"<index>_<parent id>"``, vllm/v1/engine/parallel_sampling.py)."""
    return internal_id if n == 1 else f"{index}_{internal_id}"


def sampling_params(rollout_cfg, seeds: list[int], greedy: bool = False, n: int | None = None,
                    max_tokens: list[int] | None = None) -> list:
    """One ``vllm.SamplingParams`` per prompt: ``rollout.n`` samples (``n`` when given; 1 when
    greedy) of at most ``max_tokens[i]`` (default ``rollout.max_response_tokens``) with vLLM's
    log-prob of each sampled token; with ``rollout.speculative`` on (not greedy), the top
    ``rollout.speculative_topk`` log-probs of each position too (a later epoch's draft needs them)."""
    from vllm import SamplingParams

    r = rollout_cfg
    sampling = dict(n=1, temperature=0.0) if greedy else dict(n=r.n if n is None else n, temperature=r.temperature,
                                                             top_p=r.top_p, top_k=r.top_k)
    if r.speculative != "off" and not greedy:   # megarl decodes itself: vLLM would decode k tokens a position
        sampling.update(logprobs=r.speculative_topk, detokenize=False)
    budgets = max_tokens or [r.max_response_tokens] * len(seeds)
    return [SamplingParams(**{"logprobs": 0, **sampling}, max_tokens=b, seed=s) for s, b in zip(seeds, budgets)]


def request_params(rollout_cfg, requests: list[dict]) -> list:
    """One ``vllm.SamplingParams`` per request of
    :meth:`megarl.rollout.engine.EngineActor.generate_requests`: one sample (greedy, or
    ``rollout``'s temperature, top_p, top_k) of at most the request's ``max_tokens``, with its
    ``seed`` (and its optional ``stop_token_ids``), vLLM's log-prob of each sampled token, and
    outputs that carry only the tokens new since the previous output (``RequestOutputKind.DELTA``:
    the actor accumulates every request's tokens and log-probs so far, which a pause returns)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    r, out = rollout_cfg, []
    for q in requests:
        if not isinstance(q["max_tokens"], int) or q["max_tokens"] < 1:
            raise ValueError(f"generate_requests: request {q['id']!r} has max_tokens={q['max_tokens']!r}; expected "
                             "an integer >= 1 (the tokens it may still generate)")
        sampling = dict(temperature=0.0) if q["greedy"] else dict(temperature=r.temperature, top_p=r.top_p,
                                                                  top_k=r.top_k)
        if q.get("stop_token_ids"):   # e.g. the chat template's end-of-turn token (the agent loop)
            sampling["stop_token_ids"] = list(q["stop_token_ids"])
        out.append(SamplingParams(n=1, **sampling, max_tokens=q["max_tokens"], logprobs=0, seed=q["seed"],
                                  output_kind=RequestOutputKind.DELTA))
    return out


def samples_of(out, topk: int = 0) -> list[dict]:
    """A finished ``RequestOutput`` as megarl's samples: token ids, vLLM's log-prob of each
    sampled token, and whether the response was cut at max_response_tokens; with ``topk``, each
    position's top-k log-probs too (:func:`megarl.rollout.speculative.with_top`)."""
    from megarl.rollout.speculative import with_top

    samples = [{"token_ids": list(o.token_ids),
                "logprobs": [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)],
                "clipped": o.finish_reason == "length"} for o in out.outputs]
    if topk:
        for s, o in zip(samples, out.outputs):
            with_top(s, o.logprobs, topk)
    return samples


def sample(llm, rollout_cfg, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False):
    """Per prompt, ``rollout.n`` samples (1 when greedy): :func:`samples_of` each output, with
    ``routed_experts`` when the engine captures routing (:func:`routing_reader`; then the engine is
    stepped here and each step's finished requests' routing fetched at once)."""
    from vllm import TokensPrompt

    from megarl.rollout.lora import adapter_request

    prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
    params = sampling_params(rollout_cfg, seeds, greedy)
    reader = routing_reader(llm)
    lora = adapter_request(llm)
    if reader is None:
        return [samples_of(out) for out in llm.generate(prompts, params, use_tqdm=False, lora_request=lora)]
    ids = llm.enqueue(prompts, params, use_tqdm=False, lora_request=lora)
    index = {rid.split("-", 1)[0]: (i, rid) for i, rid in enumerate(ids)}   # see megarl.rollout.generation
    result = [None] * len(ids)
    engine = llm.llm_engine
    while engine.has_unfinished_requests():
        routed = []
        for out in engine.step():
            if out.finished:
                i, internal = index[out.request_id.split("-", 1)[0]]
                result[i] = samples_of(out)
                routed += [(child_id(internal, o.index, params[i].n), s, len(prompt_ids[i]), o)
                           for o, s in zip(out.outputs, result[i])]
        reader.attach(routed)
    return result

