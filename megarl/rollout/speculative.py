"""Speculative rollouts (``rollout.speculative``): a prompt's response from the previous epoch is
a draft that the current policy verifies in one parallel pass; generation resumes at the first
rejected token with the remaining budget (SPEC-RL, arXiv 2509.23232, and the speculative-sampling
rule of Leviathan et al. 2023 / Chen et al. 2023 that makes one mode exact).

``q`` is the draft's policy (its log-prob and top-k log-probs per position stored with the draft),
``p`` the engine's. Token t is accepted when ``u_t <= min(1, l * p(x_t) / q(x_t))`` (seeded
``u_t``) until the first rejection. ``exact`` (l = 1) draws that token from ``max(0, p - q) / Z``,
so responses are distributed as plain sampling from ``p``, up to the unstored mass of ``q``'s
top-k at the rejected position (``spec/residual_tv_bound``; docs/speculative.md). ``lenient``
(l > 1, SPEC-RL's rule, default e^0.5) accepts more and samples from ``p``: biased toward ``q``.

:func:`accepted_prefix` and :func:`residual_token` are the pure rules; :func:`verify_and_resample`
runs them on a vLLM engine: one prefill of prompt + draft per sample for vLLM's prompt log-probs
(untempered and untruncated, hence temperature 1, top_p 1, top_k -1, checked at load), a 1-token
request per rejected sample in exact mode for the residual, and continuations as ordinary requests.
"""
from __future__ import annotations

import math
import time

import numpy as np

def draft_uniforms(seed: int, length: int) -> np.ndarray:
    """The uniforms of a sample's acceptance test: ``length`` for the draft's tokens, then one for
    the residual draw. A function of ``seed`` only (a resumed run draws the same)."""
    return np.random.Generator(np.random.PCG64(seed & (2**63 - 1))).random(length + 1)


def accepted_prefix(q_logprobs, p_logprobs, uniforms, lenience: float = 1.0) -> int:
    """How many leading draft tokens are accepted: token t is when ``u_t <= min(1, lenience *
    p_t / q_t)`` (log-space; ``p_t``/``q_t``: the current / drafting policy's probability of the
    draft's token t); the first rejection stops it. Pure."""
    log_l = math.log(lenience)
    for t, (q, p, u) in enumerate(zip(q_logprobs, p_logprobs, uniforms)):
        if u > 0.0 and math.log(u) > min(0.0, log_l + p - q):
            return t
    return min(len(q_logprobs), len(p_logprobs))


def residual_token(set_ids, p_logprobs, q_logprobs, outside_token, u: float) -> tuple[int, float, float]:
    """Draw the token at the first rejection from ``max(0, p - q) / Z`` with the uniform ``u``.

    ``set_ids``: the drafting policy's stored tokens S at that position (its top-k), with
    ``p_logprobs`` (the current policy) and ``q_logprobs`` (the drafting one) on them; a token
    outside S counts as q = 0, so there the residual is p itself. ``outside_token``: one draw from
    p restricted to the tokens outside S (None: S holds all of p's mass). The residual puts
    ``max(0, p(x) - q(x))`` on each x in S and ``p(outside S)`` on the outside draw, which is
    exact for the outside part because ``p(x | outside S)`` is what that draw samples.

    Returns ``(token, Z, unstored q mass)``. The unstored mass ``1 - q(S)`` bounds the total
    variation between this draw (joint with the rejection) and the exact one. When ``Z`` is 0 to
    rounding (p <= q everywhere: the rejection had probability ~0), the draw is from p. Pure."""
    ids = np.asarray(set_ids, dtype=np.int64)
    p = np.exp(np.asarray(p_logprobs, dtype=np.float64))
    q = np.exp(np.asarray(q_logprobs, dtype=np.float64))
    p_out = max(0.0, 1.0 - float(p.sum())) if outside_token is not None else 0.0
    inside = np.clip(p - q, 0.0, None)
    z = float(inside.sum()) + p_out
    if z <= 1e-12:   # p on S, p_out (0 without an outside draw) outside
        inside = p
    weights = np.append(inside, p_out)
    k = int(np.searchsorted(np.cumsum(weights), u * weights.sum(), side="right"))
    token = int(outside_token) if k >= len(ids) and outside_token is not None else int(ids[min(k, len(ids) - 1)])
    return token, z, max(0.0, 1.0 - float(q.sum()))


def speculative_sample(draft, q_tables, p_fn, uniforms, lenience: float = 1.0, exact: bool = True,
                       sample_p=None):
    """Reference composition on explicit tables (tests, docs): accept a prefix of ``draft`` and
    replace its first rejected token. ``q_tables[t]``: the drafting policy's full distribution at
    draft position t as ``{token: prob}``; ``p_fn(prefix) -> {token: prob}`` the current
    policy's. Exact: the residual token (:func:`residual_token`); lenient: ``sample_p(prefix,
    u)``, a draw from ``p``. Returns (accepted count, the tokens kept, the replacement or None)."""
    q_lp = [math.log(q_tables[t][x]) for t, x in enumerate(draft)]
    p_lp = [math.log(max(p_fn(list(draft[:t])).get(x, 0.0), 1e-300)) for t, x in enumerate(draft)]
    m = accepted_prefix(q_lp, p_lp, uniforms[:len(draft)], lenience)
    if m == len(draft):
        return m, list(draft), None
    prefix = list(draft[:m])
    if not exact:
        return m, prefix, sample_p(prefix, uniforms[len(draft)])
    p, stored = p_fn(prefix), list(q_tables[m])   # tables: q is stored on its whole support
    token, _, _ = residual_token(stored, [math.log(max(p.get(x, 0.0), 1e-300)) for x in stored],
                                 [math.log(q_tables[m][x]) for x in stored], None, uniforms[len(draft)])
    return m, prefix, token


# ---------------------------------------------------------------------------------------- engine side
def top_logprobs(entry: dict, k: int) -> tuple[list[int], list[float]]:
    """The ``k`` most likely tokens of one position of vLLM's log-prob output (``{token:
    Logprob}``, which also holds the sampled token when it ranks below k), by rank."""
    ranked = sorted(((v.rank, t, v.logprob) for t, v in entry.items() if v.rank is not None and v.rank <= k))
    return [t for _, t, _ in ranked[:k]], [lp for _, _, lp in ranked[:k]]


def with_top(sample: dict, positions: list, k: int) -> dict:
    """``sample`` with ``top_ids``/``top_logprobs`` (int32 / float32 ``[R, k]``, -1 / -inf padded)
    read from vLLM's per-position log-prob dicts ``positions`` (one per response token)."""
    ids = np.full((len(positions), k), -1, np.int32)
    lps = np.full((len(positions), k), -np.inf, np.float32)
    for i, entry in enumerate(positions):
        t, lp = top_logprobs(entry, k)
        ids[i, :len(t)], lps[i, :len(lp)] = t, lp
    sample["top_ids"], sample["top_logprobs"] = ids, lps
    return sample


def verify_and_resample(llm, drafts: list[dict], mode: str, lenience: float, topk: int, max_tokens: int) -> tuple[list, dict]:
    """Verify ``drafts`` on the engine ``llm`` (the current policy ``p``) and draw each rejected
    position's replacement. ``drafts``: ``{"prompt_ids", "seed", "draft"}`` with ``draft``
    as stored (:class:`megarl.rollout.drafts.DraftStore`: ``token_ids``, ``logprobs`` (q), ``top_ids``,
    ``top_logprobs``, ``clipped``).

    Returns, per draft, ``{"token_ids", "logprobs", "top_ids", "top_logprobs", "done",
    "clipped", "spec"}``: the kept prefix (+ the replacement) with the current policy's log-probs
    (what the step records as the sampling log-probs: in exact mode each token's marginal law is
    ``p``), ``done`` when nothing is left to generate (the draft fully accepted, the replacement
    an end-of-sequence token or the budget spent), and ``spec``: ``offered``, ``accepted``,
    ``residual_tv_bound``; plus the seconds of the verification and the residual passes."""
    from vllm import SamplingParams, TokensPrompt

    from megarl.rollout.lora import adapter_request

    t0 = time.perf_counter()
    eos = _eos_ids(llm)
    # one prefill per distinct prompt + draft (a group's identical responses are verified once);
    # a draft longer than today's budget (rollout.max_response_tokens lowered) is cut to it
    seqs = [tuple(d["prompt_ids"]) + tuple(int(t) for t in d["draft"]["token_ids"][:max_tokens]) for d in drafts]
    unique = list(dict.fromkeys(seqs))
    # detokenize off: vLLM would otherwise decode every top-k token of every position (seconds)
    verify = SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=topk, logprobs=None, seed=0,
                            detokenize=False)
    got = llm.generate([TokensPrompt(prompt_token_ids=list(seq)) for seq in unique], [verify] * len(unique),
                       use_tqdm=False, lora_request=adapter_request(llm)) if drafts else []
    by_seq = dict(zip(unique, got))
    outs = [by_seq[seq] for seq in seqs]
    verify_s = time.perf_counter() - t0
    results, rejected = [], []
    for d, out in zip(drafts, outs):
        draft, start = d["draft"], len(d["prompt_ids"])
        tokens = [int(t) for t in draft["token_ids"][:max_tokens]]
        cut = len(draft["token_ids"]) > max_tokens
        positions = out.prompt_logprobs[start:start + len(tokens)]
        p_lp = [positions[i][t].logprob for i, t in enumerate(tokens)]
        u = draft_uniforms(d["seed"], len(tokens))
        m = accepted_prefix(np.asarray(draft["logprobs"][:max_tokens], np.float64).tolist(), p_lp, u[:len(tokens)],
                            1.0 if mode == "exact" else lenience)
        r = with_top({"token_ids": tokens[:m], "logprobs": p_lp[:m]}, positions[:m], topk)
        full = m == len(tokens)
        r.update(done=full, clipped=(bool(draft["clipped"]) or cut) if full else False,
                 spec={"offered": len(tokens), "accepted": m, "residual_tv_bound": 0.0})
        results.append(r)
        if not full:
            rejected.append((len(results) - 1, d, m, u[len(tokens)]))
    t1 = time.perf_counter()
    if mode == "exact" and rejected:
        # per rejected sample one 1-token request from its kept prefix: p on the stored set S
        # (logprob_token_ids; vLLM's raw log-probs, before the logit bias) and a token sampled
        # from p outside S (S biased away). Not shared between samples: each needs its own draw.
        sets = []
        for i, d, m, _ in rejected:
            ids, lps = np.asarray(d["draft"]["top_ids"][m]), np.asarray(d["draft"]["top_logprobs"][m])
            keep = (ids >= 0) & np.isfinite(lps)
            sets.append(([int(x) for x in ids[keep]], lps[keep].astype(np.float64)))
        params = [SamplingParams(n=1, temperature=1.0, max_tokens=1, logprob_token_ids=ids or None,
                                 logit_bias={x: -100.0 for x in ids} or None, seed=d["seed"] + 7919,
                                 detokenize=False) for (_, d, _, _), (ids, _) in zip(rejected, sets)]
        got = llm.generate([TokensPrompt(prompt_token_ids=list(d["prompt_ids"]) + results[i]["token_ids"])
                            for i, d, _, _ in rejected], params, use_tqdm=False, lora_request=adapter_request(llm))
        for (i, d, m, u), (ids, q_lps), out in zip(rejected, sets, got):
            o = out.outputs[0]
            entry, outside = o.logprobs[0], o.token_ids[0]
            outside = None if outside in ids else outside   # S held every token (tiny vocabularies)
            token, _, unstored = residual_token(ids, [entry[x].logprob for x in ids], q_lps, outside, u)
            r = results[i]
            r["token_ids"].append(token)
            r["logprobs"].append(entry[token].logprob)
            ranked = sorted(((v.logprob, t) for t, v in entry.items()), reverse=True)[:topk]   # p on S + the draw
            r["top_ids"] = np.concatenate([r["top_ids"], _row([t for _, t in ranked], topk, -1, np.int32)])
            r["top_logprobs"] = np.concatenate([r["top_logprobs"], _row([lp for lp, _ in ranked], topk, -np.inf,
                                                                        np.float32)])
            r["spec"]["residual_tv_bound"] = unstored
            r["done"] = token in eos or len(r["token_ids"]) >= max_tokens
            r["clipped"] = token not in eos and len(r["token_ids"]) >= max_tokens
    return results, {"verify_s": verify_s, "residual_s": time.perf_counter() - t1}


def _row(values, k: int, fill, dtype) -> np.ndarray:
    row = np.full((1, k), fill, dtype)
    row[0, :len(values)] = values
    return row


def _eos_ids(llm) -> set:
    """The end-of-sequence token ids of the engine's model (generation_config's and config's)."""
    ids = set()
    try:
        gen = llm.llm_engine.model_config.try_get_generation_config()
        eos = gen.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except Exception:   # noqa: BLE001 - fall back to the model config's
        pass
    eos = getattr(llm.llm_engine.model_config.hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


POSITION_BUCKETS = ((0, 16), (16, 64), (64, None))
"""Draft positions over which ``spec/accept_rate_pos<a>_<b>`` is reported."""


def spec_metrics(records: list, lengths: list[int]) -> dict:
    """A step's speculation metrics from its samples' ``spec`` records (None: generated without a
    draft) and their response lengths: share of samples with a draft, draft tokens offered and accepted
    per drafted sample, acceptance, fully accepted drafts (no vLLM generation), the share of all
    response tokens reused from drafts, the acceptance rate by draft position (accepted / reached
    in each :data:`POSITION_BUCKETS` range), and the mean residual TV bound (exact mode)."""
    drafted = [r for r in records if r is not None]
    total = sum(lengths)
    m = {"spec/drafted_frac": len(drafted) / max(1, len(records))}
    if not drafted:
        return m
    offered, accepted = sum(r["offered"] for r in drafted), sum(r["accepted"] for r in drafted)
    m.update({"spec/offered_tokens": offered / len(drafted), "spec/accepted_tokens": accepted / len(drafted),
              "spec/acceptance": accepted / max(1, offered),
              "spec/full_accept_frac": sum(r["accepted"] == r["offered"] for r in drafted) / len(drafted),
              "spec/reused_frac": accepted / max(1, total),
              "spec/residual_tv_bound": sum(r["residual_tv_bound"] for r in drafted) / len(drafted)})
    for lo, hi in POSITION_BUCKETS:
        reached = ok = 0
        for r in drafted:   # positions 0..accepted-1 accepted; position `accepted` reached and rejected
            end = r["offered"] if hi is None else min(hi, r["offered"])
            ok += max(0, min(r["accepted"], end) - lo)
            reached += max(0, min(r["accepted"] + 1, end) - lo)
        if reached:
            m[f"spec/accept_rate_pos{lo}_{hi if hi is not None else 'end'}"] = ok / reached
    return m
