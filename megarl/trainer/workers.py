"""The controller's handle on the HybridWorkers: Ray placement, prompts, and fan-out of each phase.

One Ray actor per device (per GPU; on CPU ``topology.world_size`` gloo ranks), placed with a
placement group (one bundle per worker, packed on as few nodes as possible). Collective phases
call every worker at once; generation runs on rank 0, which drives the vLLM engine, or with
``rollout.placement=split`` on a :class:`megarl.rollout.engine.RolloutActor` placed on
``rollout.tp`` bundles of its own (rank 0 then drives the bridge through a proxy of it).
"""
from __future__ import annotations

import os
import socket
import time

import torch

from megarl.config.schema import MegaRLConfig
from megarl.trainer.batch import Rollout, micro_batches_for, scatter_back


def _free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _rendezvous_address() -> tuple[str, int]:
    """(IP, free port) of the node this runs on: torch.distributed's master for rank 0."""
    import ray

    ip = ray.util.get_node_ip_address()
    return ip, _free_port(ip)


def _init_ray(num_devices: int) -> str:
    """Join the cluster named by RAY_ADDRESS (multi-node, e.g. launch/slurm/megarl.sbatch), or
    start a local one-node Ray with ``num_devices`` CPUs. Returns the bundle's device resource:
    "GPU" when the cluster has GPUs, else "CPU"."""
    import ray

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True, configure_logging=False)
            print(f"megarl: joined the Ray cluster at {os.environ['RAY_ADDRESS']} "
                  f"({len(ray.nodes())} node(s), {ray.cluster_resources()})", flush=True)
        else:
            ray.init(num_cpus=max(num_devices, 1), include_dashboard=False, log_to_driver=True,
                     configure_logging=False)
    return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"


class PromptSource:
    """Prompts of step ``s``: a deterministic function of (data.seed, s): resuming repeats them."""

    def __init__(self, data_cfg):
        from megarl.tasks import load_prompt_dataset

        self.cfg = data_cfg
        self.records = None if data_cfg.task == "arithmetic" else load_prompt_dataset(data_cfg.task)

    def batch(self, step: int, count: int, offset: int = 0):
        from megarl.tasks import generate_arithmetic

        if self.records is None:
            return generate_arithmetic(count, level=self.cfg.difficulty, seed=self.cfg.seed * 1_000_003 + step * 7 + offset)
        n = len(self.records)
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + ((step - 1) * self.cfg.prompts_per_step) // n)
        order = torch.randperm(n, generator=g).tolist()
        start = ((step - 1) * self.cfg.prompts_per_step + offset * count) % n
        return [self.records[order[(start + i) % n]] for i in range(count)]

    def eval_batch(self, count: int):
        from megarl.tasks import generate_arithmetic

        if self.records is None:
            return generate_arithmetic(count, level=self.cfg.difficulty, seed=self.cfg.seed * 1_000_003 - 1)
        return self.records[-count:]


class WorkerGroup:
    def __init__(self, cfg: MegaRLConfig):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from transformers import AutoTokenizer

        from megarl.models.fixtures import resolve_model_path
        from megarl.rollout.engine import RolloutActor
        from megarl.trainer.worker import HybridWorker

        self.cfg = cfg
        world = cfg.topology.world_size
        split = cfg.rollout.placement == "split"
        rollout_devices = cfg.rollout.tp if split else 0
        kind = _init_ray(world + rollout_devices)
        # one bundle per training device, then (split) one holding the rollout devices; on GPU
        # clusters a bundle is a GPU (+1 CPU), packed on as few nodes as possible
        bundle = (lambda n: {"GPU": n, "CPU": n}) if kind == "GPU" else (lambda n: {"CPU": n})
        self.pg = placement_group([bundle(1)] * world + ([bundle(rollout_devices)] if split else []),
                                  strategy="PACK")
        ray.get(self.pg.ready())
        on = lambda i: PlacementGroupSchedulingStrategy(self.pg, i)   # noqa: E731
        threads = str(max(1, (os.cpu_count() or 2) // (world + rollout_devices))) if kind == "CPU" else "4"
        env = {"env_vars": {"OMP_NUM_THREADS": threads}}
        self.rollout_actor = None
        if split:
            self.rollout_actor = ray.remote(RolloutActor).options(
                scheduling_strategy=on(world), runtime_env=env,
                **{"num_cpus": rollout_devices, **({"num_gpus": rollout_devices} if kind == "GPU" else {})}).remote(cfg)
        # torch.distributed rendezvous on the node of rank 0 (bundle 0), not on the driver's
        master, port = ray.get(ray.remote(num_cpus=0)(_rendezvous_address).options(scheduling_strategy=on(0)).remote())
        actor = ray.remote(HybridWorker)
        per_worker = {"num_cpus": 1, **({"num_gpus": 1} if kind == "GPU" else {})}
        self.workers = [actor.options(scheduling_strategy=on(i), runtime_env=env, **per_worker)
                        .remote(cfg, i, world, master, port, self.rollout_actor) for i in range(world)]
        self.info = ray.get([w.info.remote() for w in self.workers])
        self.leaders = {i["dp_rank"]: w for w, i in zip(self.workers, self.info) if i["dp_leader"]}
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.path))
        self.prompts = PromptSource(cfg.data)
        self.has_reference = cfg.algorithm.kl_coef > 0
        from megarl.trainer.algorithm import needs_critic

        self.has_critic = needs_critic(cfg.algorithm)

    def _all(self, method: str, *args):
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    # ------------------------------------------------------------------ rollout
    def _encode(self, records) -> list[list[int]]:
        out = []
        for rec in records:
            if self.cfg.data.use_chat_template:
                ids = self.tokenizer.apply_chat_template([{"role": "user", "content": rec.prompt}],
                                                         tokenize=True, add_generation_prompt=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = self.tokenizer(rec.prompt).input_ids
            if len(ids) > self.cfg.rollout.max_prompt_tokens:
                raise ValueError(f"prompt {rec.prompt[:60]!r}... has {len(ids)} tokens > "
                                 f"rollout.max_prompt_tokens={self.cfg.rollout.max_prompt_tokens}")
            out.append(list(ids))
        return out

    def generate(self, step: int, records, greedy: bool = False) -> Rollout:
        import ray

        ids = self._encode(records)
        base = (self.cfg.trainer.seed * 1_000_003 + step * 1009) * 64
        seeds = [base + 64 * i for i in range(len(ids))]   # vLLM gives sample j of a request seed + j
        offload = self.cfg.rollout.offload_train_state
        if offload:
            self.offloaded_bytes = sum(o["offloaded_bytes"] for o in self._all("offload"))
        engine = self.rollout_actor or self.workers[0]
        gens = ray.get(engine.generate.remote(ids, seeds, greedy))
        if offload:
            self._all("onload")
        return Rollout.from_generations(ids, [r.answer for r in records], gens)

    def score(self, rollout: Rollout, rewards) -> dict:
        texts = self.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        result = rewards.score(self.cfg.data.reward, texts, rollout.answers)
        rollout.rewards = list(result.rewards)
        if self.cfg.algorithm.overlong_buffer:
            from megarl.algorithms.dapo import overlong_penalty

            pen = overlong_penalty([len(r) for r in rollout.response_ids], self.cfg.rollout.max_response_tokens,
                                   self.cfg.algorithm.overlong_buffer)
            rollout.rewards = [r + float(p) for r, p in zip(rollout.rewards, pen)]
        return {"reward/errors": result.n_errors, "reward/timeouts": result.n_timeouts,
                "reward/accuracy": sum(r >= 1.0 for r in result.rewards) / len(result.rewards)}

    def rollout(self, step: int, rewards) -> tuple[Rollout, dict]:
        """Generate and score one step's samples (DAPO: resample groups whose rewards are all equal)."""
        from megarl.algorithms.dapo import informative_group_mask

        cfg, gen_s, score_s = self.cfg, 0.0, 0.0
        tries = cfg.algorithm.max_sampling_tries if cfg.algorithm.dynamic_sampling else 1
        kept: Rollout | None = None
        m: dict = {}
        for attempt in range(tries):
            t0 = time.perf_counter()
            part = self.generate(step, self.prompts.batch(step, cfg.data.prompts_per_step, offset=attempt))
            t1 = time.perf_counter()
            m_part = self.score(part, rewards)
            score_s += time.perf_counter() - t1
            gen_s += t1 - t0
            if not m:   # the first round's raw statistics are the step's reward metrics
                m = dict(m_part, **_sample_metrics(part, cfg.rollout.max_response_tokens))
            if cfg.algorithm.dynamic_sampling:
                keep = informative_group_mask(torch.tensor(part.rewards), torch.tensor(part.group_ids))
                part = part.select([i for i, k in enumerate(keep.tolist()) if k])
                part.group_ids = [g + attempt * cfg.data.prompts_per_step for g in part.group_ids]
            kept = part if kept is None else _concat(kept, part)
            if len(kept) >= cfg.data.prompts_per_step * cfg.rollout.n:
                break
        if len(kept) == 0:
            raise RuntimeError(f"dynamic sampling kept no group in {tries} rounds (every group's rewards were "
                               "equal); raise algorithm.max_sampling_tries or change data.difficulty")
        import ray

        ray.get(self.workers[0].sleep_rollout.remote())   # GPU colocated: free vLLM's memory for training
        m.update({"time/generate_s": gen_s, "time/score_s": score_s, "rollout/num_samples": len(kept)})
        if cfg.rollout.offload_train_state:
            m["memory/offloaded_gb"] = self.offloaded_bytes / 1e9
        return kept, m

    def evaluate(self, rewards) -> dict:
        records = self.prompts.eval_batch(self.cfg.data.eval_prompts)
        rollout = self.generate(0, records, greedy=True)
        m = self.score(rollout, rewards)
        return {"eval/accuracy": m["reward/accuracy"], "eval/reward_mean": sum(rollout.rewards) / len(rollout)}

    # ------------------------------------------------------------------ training
    def plan(self, rollout: Rollout):
        from megarl.data import BatchBudget, plan_batches

        topo = self.cfg.topology.to_topology()
        budget = BatchBudget(max_tokens_per_micro_batch=self.cfg.data.max_tokens_per_micro_batch,
                             cost=self.cfg.data.balance_cost)
        return plan_batches(rollout.lengths(), topo, budget)

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

    def shutdown(self):
        import ray

        self._all("shutdown")
        for w in self.workers:
            ray.kill(w)
        if self.rollout_actor is not None:
            ray.get(self.rollout_actor.shutdown.remote())
            ray.kill(self.rollout_actor)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


def _sample_metrics(rollout: Rollout, max_tokens: int) -> dict:
    rewards = torch.tensor(rollout.rewards, dtype=torch.float64)
    lengths = torch.tensor([len(r) for r in rollout.response_ids], dtype=torch.float64)
    return {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(unbiased=False)),
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": sum(rollout.clipped) / len(rollout)}


def _concat(a: Rollout, b: Rollout) -> Rollout:
    return Rollout(a.prompt_ids + b.prompt_ids, a.response_ids + b.response_ids,
                   a.sample_logprobs + b.sample_logprobs, a.group_ids + b.group_ids, a.answers + b.answers,
                   a.clipped + b.clipped, a.rewards + b.rewards)


def _mini_batches(rollout: Rollout, count: int) -> list[list[int]]:
    """Split sample indices into ``count`` chunks of whole groups."""
    groups = sorted(set(rollout.group_ids))
    per = [groups[i::count] for i in range(count)]
    chunks = [[j for j, g in enumerate(rollout.group_ids) if g in set(gs)] for gs in per]
    return [c for c in chunks if c]
