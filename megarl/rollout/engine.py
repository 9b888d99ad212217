"""The rollout side of a worker: a vLLM engine built from the config, its sampling, and a Ray
actor that holds it on separate devices for ``rollout.placement=split``.

Split placement (the same loop and the same weight bridge as colocated): the rollout engine runs
in a :class:`RolloutActor` on bundles of its own; Megatron rank 0 gets a :class:`RemoteEngine`
in place of the ``vllm.LLM`` object, which forwards the bridge's ``collective_rpc`` calls (load a
bucket, weight version, checksums) and the prefix-cache reset to the actor. The bytes themselves
do not pass through Ray: the bridge's transports write them into buffers the vLLM workers map
(shared memory on one host; on GPU, NCCL into the rollout devices). On CPU both pools share the
host's cores, so split is a layout test here, not a speed-up.
"""
from __future__ import annotations

import os


def make_rollout_llm(cfg, model_path: str, own_process: bool = False):
    """The ``vllm.LLM`` of ``cfg.rollout`` for the HF folder ``model_path`` (with the bridge's
    worker extension).

    On CPU, vLLM's engine core (scheduler) runs in the calling process, which saves one process
    start (~10 s of import on 2 cores) per engine. Its workers stay separate processes (the
    ``mp`` executor) unless ``own_process`` (tp 1, a process with no torch.distributed group of
    its own, e.g. ``megarl generate``): in a training rank, an in-process vLLM worker would join
    the rank's Megatron process group.
    """
    from megarl.compat import cuda_available
    from megarl.rollout.vllm_engine import make_llm

    r = cfg.rollout
    extra = {"enable_sleep_mode": True} if sleeps(cfg) else {}
    if not cuda_available():
        extra["distributed_executor_backend"] = "uni" if own_process and r.tp == 1 else "mp"
    return make_llm(model_path, tp=r.tp, dtype=cfg.model.dtype, seed=cfg.trainer.seed,
                    max_model_len=r.max_prompt_tokens + r.max_response_tokens, kv_cache_gib=r.kv_cache_gib,
                    enforce_eager=r.enforce_eager, gpu_memory_utilization=r.gpu_memory_utilization,
                    in_process=True, worker_extension_cls="megarl.rollout.worker_ext.BridgeWorkerExtension", **extra)


def sleeps(cfg) -> bool:
    """vLLM sleeps while Megatron trains: colocated, on GPU, ``rollout.sleep_level`` > 0."""
    from megarl.compat import cuda_available

    return cfg.rollout.placement == "colocated" and cfg.rollout.sleep_level > 0 and cuda_available()


def sample(llm, rollout_cfg, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False):
    """Per prompt, ``rollout.n`` samples (1 when greedy): token ids, vLLM's log-prob of each
    sampled token, and whether the response was cut at max_response_tokens."""
    from vllm import SamplingParams, TokensPrompt

    r = rollout_cfg
    sampling = dict(n=1, temperature=0.0) if greedy else dict(n=r.n, temperature=r.temperature, top_p=r.top_p,
                                                             top_k=r.top_k)
    params = [SamplingParams(**sampling, max_tokens=r.max_response_tokens, logprobs=0, seed=s) for s in seeds]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
    return [[{"token_ids": list(o.token_ids),
              "logprobs": [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)],
              "clipped": o.finish_reason == "length"} for o in out.outputs] for out in outs]


class RolloutActor:
    """Holds the vLLM engine on its own devices (``rollout.placement=split``)."""

    def __init__(self, cfg, log_file: str | None = None):
        """``log_file``: as :class:`megarl.trainer.worker.HybridWorker`'s."""
        if log_file is not None:
            from megarl.observability.console import redirect_process_output

            redirect_process_output(log_file, cfg.logging.level)
        from megarl.models.fixtures import resolve_model_path

        self.cfg = cfg
        self.llm = make_rollout_llm(cfg, str(resolve_model_path(cfg.model.path)))

    def generate(self, prompt_ids, seeds, greedy: bool = False):
        from megarl.rollout.vllm_engine import engine_errors

        with engine_errors(self.llm, f"the rollout actor (pid {os.getpid()}, rollout.placement=split)", "generate"):
            return sample(self.llm, self.cfg.rollout, prompt_ids, seeds, greedy)

    def collective_rpc(self, method: str, args: tuple = ()):
        return self.llm.collective_rpc(method, args=args)

    def reset_prefix_cache(self):
        return self.llm.reset_prefix_cache()

    def shutdown(self):
        from megarl.rollout.vllm_engine import shutdown_llm

        if self.llm is not None:
            shutdown_llm(self.llm)
            self.llm = None


class RemoteEngine:
    """What the weight bridge needs of ``vllm.LLM``, forwarded to a :class:`RolloutActor`."""

    def __init__(self, actor):
        self.actor = actor

    def collective_rpc(self, method: str, args: tuple = ()):
        import ray

        return ray.get(self.actor.collective_rpc.remote(method, args))

    def reset_prefix_cache(self):
        import ray

        return ray.get(self.actor.reset_prefix_cache.remote())
