"""Exactness of speculative rollouts on a real vLLM engine (run by test_speculative_e2e.py).

A random tiny Llama with a 4-token vocabulary (token 3 ends a response) and responses of at
most 3 tokens: 40 possible responses. One :class:`megarl.rollout.engine.EngineActor` (in this
process, not a Ray actor) samples
- plain: ``N`` responses to prompt P (``generate_stream``, no drafts);
- drafts: ``N`` responses to another prompt P' (the "old policy" q = the model given P', with
  its top-4 = whole-vocabulary log-probs stored);
- exact / lenient: ``N`` responses to P with those drafts (``generate_stream(drafts=...)``).
The reference law p of a complete response to P comes from the engine too: the whole-vocabulary
log-probs of every prefix (prompt log-probs, ``-1``). Prints one ``SPEC {json}`` line: each arm's
chi-square statistic against p over the 40 outcomes, its degrees of freedom, its total variation
from p, and the speculation counts.
"""
from __future__ import annotations

import itertools
import json
import math
import sys
import tempfile
import time
from collections import Counter

VOCAB, EOS, MAX_TOKENS = 4, 3, 3
PROMPT, OTHER = [0, 1, 2, 0], [2, 2, 1, 0]


def build_model(out: str) -> None:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=EOS,
                         pad_token_id=EOS, max_position_embeddings=64, tie_word_embeddings=False,
                         initializer_range=0.08)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token=f"t{EOS}", unk_token="t0",
                               pad_token=f"t{EOS}").save_pretrained(out)


def outcomes() -> list[tuple]:
    """Every complete response: it ends at EOS or after MAX_TOKENS tokens."""
    out = []
    for length in range(1, MAX_TOKENS + 1):
        for seq in itertools.product(range(VOCAB), repeat=length):
            if EOS not in seq[:-1] and (seq[-1] == EOS or length == MAX_TOKENS):
                out.append(seq)
    return out


def reference_law(llm) -> dict:
    """p(response | PROMPT) from the engine's whole-vocabulary log-probs of every prefix."""
    from vllm import SamplingParams, TokensPrompt

    prefixes = [seq for n in range(MAX_TOKENS) for seq in itertools.product(range(EOS), repeat=n)]
    params = SamplingParams(max_tokens=1, logprobs=-1, temperature=1.0, seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT + list(p)) for p in prefixes], [params] * len(prefixes),
                        use_tqdm=False)
    nxt = {p: {t: math.exp(v.logprob) for t, v in o.outputs[0].logprobs[0].items()} for p, o in zip(prefixes, outs)}
    return {seq: math.prod(nxt[seq[:t]][seq[t]] for t in range(len(seq))) for seq in outcomes()}


def chi_square(counts: Counter, law: dict, n: int) -> tuple[float, int, float]:
    """Pearson's statistic over the outcomes with expected count >= 5 (the others pooled into one
    cell), its degrees of freedom, and the empirical total variation from ``law``."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for seq, p in law.items():
        if n * p >= 5:
            stat += (counts[seq] - n * p) ** 2 / (n * p)
            cells += 1
        else:
            pooled_obs, pooled_exp = pooled_obs + counts[seq], pooled_exp + n * p
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    tv = 0.5 * sum(abs(counts[s] / n - p) for s, p in law.items())
    return stat, cells - 1, tv


def main(n: int) -> None:
    from megarl.config import load_config
    from megarl.rollout.engine import EngineActor

    groups = 100   # prompts per call; rollout.n samples each
    per = n // groups
    folder = tempfile.mkdtemp(prefix="megarl-spec-")
    build_model(folder)

    def engine(mode: str):
        cfg = load_config(None, [f"model.path={folder}", f"rollout.n={per}", f"rollout.max_response_tokens={MAX_TOKENS}",
                                 "rollout.max_prompt_tokens=16", "trainer.max_tokens_per_micro_batch=64",
                                 f"rollout.speculative={mode}", f"rollout.speculative_topk={VOCAB}",
                                 "data.num_prompts=1", "rollout.kv_cache_gib=0.05"])
        return EngineActor(cfg, 0)

    def run(actor, prompt, seed0, drafts=None) -> list:
        t0 = time.perf_counter()
        seeds = [seed0 + 1000 * i for i in range(groups)]
        got, spec_s = [None] * groups, {}
        for item in actor.generate_stream([list(prompt)] * groups, seeds, drafts=drafts):
            for i, samples in item["done"]:
                got[i] = samples
            spec_s = item.get("spec_s") or spec_s
        print(f"arm done in {time.perf_counter() - t0:.1f}s {spec_s}", file=sys.stderr, flush=True)
        return [s for g in got for s in g], spec_s

    actor = engine("exact")
    law = reference_law(actor.llm)
    t = time.perf_counter()
    plain, _ = run(actor, PROMPT, 1)
    plain_s = time.perf_counter() - t
    old, _ = run(actor, OTHER, 2)                        # the drafts: another prompt's responses
    drafts = [old[i * per:(i + 1) * per] for i in range(groups)]
    result = {"n": per * groups, "outcomes": len(law), "plain_s": plain_s}
    arms = {"plain": plain}
    for mode in ("exact", "lenient"):
        actor.cfg.rollout.speculative = mode
        t = time.perf_counter()
        arms[mode], spec_s = run(actor, PROMPT, 3, drafts)
        recs = [s["spec"] for s in arms[mode]]
        result[f"{mode}_s"] = time.perf_counter() - t
        result[f"{mode}_spec"] = {"accepted": sum(r["accepted"] for r in recs), "offered": sum(r["offered"] for r in recs),
                                  "full": sum(r["accepted"] == r["offered"] for r in recs),
                                  "tv_bound_max": max(r["residual_tv_bound"] for r in recs), **spec_s}
        # what the step records as sampling log-probs: p of each token
        worst = 0.0
        for s in arms[mode][:200]:
            seq = tuple(s["token_ids"])
            lp = sum(s["logprobs"])
            worst = max(worst, abs(lp - math.log(law[seq])))
        result[f"{mode}_logprob_err"] = worst
    old_counts = Counter(tuple(s["token_ids"]) for s in old)
    result["draft_tv_from_p"] = 0.5 * sum(abs(old_counts[s] / len(old) - p) for s, p in law.items())
    for name, samples in arms.items():
        counts = Counter(tuple(s["token_ids"]) for s in samples)
        assert sum(counts[s] for s in law) == len(samples), "a response outside the 40 outcomes"
        result[name] = dict(zip(("chi2", "df", "tv"), chi_square(counts, law, len(samples))))
    print("SPEC " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 48_000)
