"""The controller's handle on the HybridWorkers: one call per phase, fanned out over the workers.

Collective phases (log-probs, values, train steps, weight sync, checkpoints) call every worker
at once with its DP rank's micro-batches and gather the DP leaders' outputs. Generation runs on
rank 0, which drives the vLLM engine, or on the split rollout actor; what is generated and how it
is scored is :mod:`megarl.trainer.rollout`'s business, where the actors live is
:mod:`megarl.trainer.placement`'s.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megarl.config.schema import MegaRLConfig
from megarl.trainer.batch import Rollout, micro_batches_for, scatter_back


class WorkerGroup:
    """The HybridWorkers of a run; a context manager that releases them (and Ray) on exit."""

    def __init__(self, cfg: MegaRLConfig, log_dir: Path | None = None, verbose: bool = False):
        import ray

        from megarl.data.plan import budget_from_config
        from megarl.engine.build import read_hf_config
        from megarl.trainer.algorithm import needs_critic
        from megarl.trainer.placement import Placement

        self.cfg = cfg
        self.has_reference = cfg.algorithm.kl_coef > 0
        self.has_critic = needs_critic(cfg.algorithm)
        self.offloaded_bytes = 0
        # trainer.balance_cost=flops: the FLOPs coefficients come from the model's config.json
        self.budget = budget_from_config(cfg.trainer, read_hf_config(cfg.model.path))
        # last: from here on, anything that raises must release the placement
        self.placement = Placement(cfg, log_dir, verbose)
        self.workers = self.placement.workers
        try:
            self.info = ray.get([w.info.remote() for w in self.workers])
        except BaseException:
            self.placement.close()
            raise

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the engines and actors, remove the placement group, stop Ray if the run started it."""
        self.placement.close()

    def _all(self, method: str, *args):
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    # ------------------------------------------------------------------ rollout
    def generate(self, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False) -> list:
        """Samples of the engine (rank 0's or the split actor's): the ``sample_fn`` of
        :class:`megarl.trainer.rollout.Rollouts`. With ``trainer.offload_train_state`` the
        Megatron state is in host memory meanwhile."""
        import ray

        offload = self.cfg.trainer.offload_train_state
        if offload:
            self.offloaded_bytes = sum(o["offloaded_bytes"] for o in self._all("offload"))
        engine = self.placement.rollout_actor or self.workers[0]
        gens = ray.get(engine.generate.remote(prompt_ids, seeds, greedy))
        if offload:
            self._all("onload")
        return gens

    def end_rollout(self) -> dict:
        """After a step's generation: GPU colocated, vLLM sleeps to free memory for training."""
        import ray

        ray.get(self.workers[0].sleep_rollout.remote())
        return {"memory/offloaded_gb": self.offloaded_bytes / 1e9} if self.cfg.trainer.offload_train_state else {}

    # ------------------------------------------------------------------ training
    def plan(self, rollout: Rollout):
        from megarl.data import plan_batches

        return plan_batches(rollout.lengths(), self.cfg.topology.to_topology(), self.budget)

    def _per_rank(self, rollout, plan, per_sample) -> list:
        return [micro_batches_for(rollout, plan, i["dp_rank"], per_sample) for i in self.info]

    def _forward(self, method: str, rollout: Rollout, plan, *args) -> dict:
        """A forward-only worker method on every rank's micro-batches: the DP leaders' outputs
        (one per micro-batch) by DP rank."""
        import ray

        batches = self._per_rank(rollout, plan, {})
        outs = ray.get([getattr(w, method).remote(b, *args) for w, b in zip(self.workers, batches)])
        return {i["dp_rank"]: o for i, o in zip(self.info, outs) if o is not None}

    def logprobs(self, rollout: Rollout, plan, reference: bool):
        with_entropy = not reference
        by_rank = self._forward("logprobs", rollout, plan, reference, with_entropy)
        logprobs = scatter_back(rollout, plan, {r: [lp for lp, _ in o] for r, o in by_rank.items()})
        entropy = (scatter_back(rollout, plan, {r: [e for _, e in o] for r, o in by_rank.items()})
                   if with_entropy else None)
        return logprobs, entropy

    def values(self, rollout: Rollout, plan) -> list[torch.Tensor]:
        """The critic's value of every response token, per sample."""
        return scatter_back(rollout, plan, self._forward("values", rollout, plan))

    def train(self, rollout: Rollout, plan, per_sample: dict, kl_coef: float) -> dict:
        return self._optimize("train", "actor", rollout, plan, per_sample, kl_coef)

    def train_critic(self, rollout: Rollout, plan, per_sample: dict) -> dict:
        return self._optimize("train_critic", "critic", rollout, plan, per_sample)

    def _optimize(self, method: str, tag: str, rollout: Rollout, plan, per_sample: dict, *args) -> dict:
        """``ppo_epochs`` passes over ``mini_batches`` chunks of whole groups, one optimizer step each."""
        import ray

        a = self.cfg.algorithm
        chunks = _mini_batches(rollout, a.mini_batches)
        results = []
        for _ in range(a.ppo_epochs):
            for keep in chunks:
                sub = rollout.select(keep) if len(chunks) > 1 else rollout
                sub_plan = self.plan(sub) if len(chunks) > 1 else plan
                sub_samples = {k: [v[i] for i in keep] for k, v in per_sample.items()} if len(chunks) > 1 \
                    else per_sample
                batches = self._per_rank(sub, sub_plan, sub_samples)
                results.append(ray.get([getattr(w, method).remote(b, *args)
                                        for w, b in zip(self.workers, batches)])[0])
        out = {f"{tag}/{k}": v for k, v in results[-1].items() if isinstance(v, (int, float))}
        out[f"{tag}/grad_norm"] = sum(r["grad_norm"] for r in results) / len(results)
        out[f"{tag}/optimizer_steps"] = len(results)
        return out

    def sync_weights(self) -> dict:
        import ray

        ray.get(self.workers[0].wake_rollout.remote())
        stats = self._all("sync_weights")[0]
        return {f"sync/{k}": v for k, v in stats.items() if isinstance(v, (int, float))}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ckpt, step: int, metadata: dict):
        partial = ckpt.partial_dir(step, tag="run")
        self._all("save_checkpoint", str(partial))
        ckpt.commit(step, partial, metadata)

    def load_checkpoint(self, folder):
        self._all("load_checkpoint", str(folder))
        self._all("sync_weights")


def _mini_batches(rollout: Rollout, count: int) -> list[list[int]]:
    """Split sample indices into ``count`` chunks of whole groups."""
    groups = sorted(set(rollout.group_ids))
    per = [groups[i::count] for i in range(count)]
    chunks = [[j for j, g in enumerate(rollout.group_ids) if g in set(gs)] for gs in per]
    return [c for c in chunks if c]
