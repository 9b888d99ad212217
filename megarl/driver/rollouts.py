"""The rollout side of a step: prompts -> token ids -> samples -> rewards, and evaluation.

``Rollouts`` does everything between the prompt data and a scored :class:`Rollout`; the samples
themselves come from a ``sample_fn(prompt_ids, seeds, greedy, on_done=None)`` with the contract of
:func:`megarl.rollout.engine.sample` (per prompt, a list of ``{"token_ids", "logprobs",
"clipped"}``); a ``sample_fn`` that streams calls ``on_done([(prompt index, samples), ...])`` as
prompts finish, and those samples are scored right away, while the engines generate the rest.
Training passes :meth:`megarl.actors.group.WorkerGroup.generate` (the rollout fleet, which
streams); ``megarl generate`` passes a local ``vllm.LLM``. Both then share the prompt order, the
chat template, the sampling seeds and the scoring.

Determinism: prompts and vLLM seeds are functions of (``data.seed``, ``trainer.seed``, step), so a
run resumed from step k's checkpoint repeats steps k+1.. of an uninterrupted run.

DAPO parts (deviations from plain GRPO, both opt-in by ``algorithm``): overlong shaping adds a
soft length penalty to the rewards; dynamic sampling drops groups whose rewards are all equal and
samples the next prompts (up to ``algorithm.max_sampling_tries`` rounds) until
``data.prompts_per_step`` groups are informative or the rounds run out (then a smaller batch).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from megarl.data.batch import Rollout

SampleFn = Callable[..., list]


class PromptSource:
    """Prompts of step ``s``: a deterministic function of (data.seed, s): resuming repeats them.

    A prompt file's rows, or a generated task's fixed pool (``data.num_prompts``, drawn once),
    are visited in epochs, each in its own order (a permutation seeded by data.seed and the
    epoch): step s takes the next ``prompts_per_step`` positions of that sequence, across an
    epoch's end too. Each record's ``uid`` is its row (its place in the pool). Without a pool a
    generated task draws new problems every step (no uid)."""

    def __init__(self, data_cfg):
        from megarl.tasks import GENERATED_TASKS, load_prompt_dataset

        self.cfg = data_cfg
        self.from_file = data_cfg.task not in GENERATED_TASKS
        if self.from_file:
            self.records = load_prompt_dataset(data_cfg.task)
        elif data_cfg.num_prompts:
            self.records = self._generate(data_cfg.num_prompts, data_cfg.seed * 1_000_003 - 2)
        else:
            self.records = None
        for i, rec in enumerate(self.records or ()):
            rec.uid = str(i)
        self._orders: dict[int, list[int]] = {}

    def _generate(self, count: int, seed: int):
        if self.cfg.task == "calculator":
            from megarl.tasks.word_problems import generate_word_problems

            return generate_word_problems(count, level=self.cfg.difficulty, seed=seed, demo=True)
        from megarl.tasks import generate_arithmetic

        return generate_arithmetic(count, level=self.cfg.difficulty, seed=seed)

    def drop(self, rows: list[int]) -> None:
        """Leave the file's rows ``rows`` out of every epoch (the others keep their uid: their row)."""
        gone = set(rows)
        self.records = [r for i, r in enumerate(self.records) if i not in gone]
        self._orders = {}

    def order(self, epoch: int) -> list[int]:
        """The records' order in ``epoch`` (0-based)."""
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.records), generator=g).tolist()}
        return self._orders[epoch]

    def epoch(self, step: int) -> int:
        """The epoch (0-based) of step ``step``'s first prompt; 0 without a fixed prompt set."""
        return 0 if self.records is None else (step - 1) * self.cfg.prompts_per_step // len(self.records)

    def batch(self, step: int, count: int, offset: int = 0):
        if self.records is None:
            return self._generate(count, self.cfg.seed * 1_000_003 + step * 7 + offset)
        n, first = len(self.records), (step - 1) * self.cfg.prompts_per_step + offset * count
        return [self.records[self.order(pos // n)[pos % n]] for pos in range(first, first + count)]

    def eval_batch(self, count: int):
        """Held-out prompts: generated from a seed no training step (nor the pool) uses, else the
        dataset's last rows."""
        from megarl.tasks import GENERATED_TASKS

        if self.cfg.task in GENERATED_TASKS:
            return self._generate(count, self.cfg.seed * 1_000_003 - 1)
        return self.records[-count:]


class Rollouts:
    def __init__(self, cfg, sample_fn: SampleFn, tokenizer=None, fleet=None):
        """``fleet``: with ``rollout.agent: tools``, a callable giving the rollout fleet (default:
        ``sample_fn``'s owner's ``fleet``, i.e. :meth:`WorkerGroup.generate`'s group); the agent
        loop (:class:`megarl.agent.loop.AgentLoop`) then replaces ``sample_fn``."""
        if tokenizer is None:
            from transformers import AutoTokenizer

            from megarl.models.fixtures import resolve_model_path

            tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.path))
        self.cfg, self.sample_fn, self.tokenizer = cfg, sample_fn, tokenizer
        self.prompts = PromptSource(cfg.data)
        from megarl.rewards.spec import is_plain, parse_reward

        terms = parse_reward(cfg.data.reward)
        # a weighted sum: the rule terms are scored here, a reward-model term after generation (RewardModelTerm)
        self.rule_terms = None if is_plain(terms) else [t for t in terms if not t.is_model]
        self._counts, self.score_s = [0, 0], 0.0   # the last scoring's (errors, timeouts) and seconds
        self.agent = self.formatter = self.runner = None
        if cfg.rollout.agent == "tools":
            self._start_agent(fleet)
        self.drafts = None   # rollout.speculative: the previous epoch's responses per prompt
        if cfg.rollout.speculative != "off":
            from megarl.rollout.drafts import DraftStore

            self.drafts = DraftStore(int(cfg.rollout.draft_store_mb * 2**20))
        self.spec_samples: list = []   # the last collect's samples' speculation records
        self.dropped_prompts = 0
        """Rows of the prompt file left out for their length (``data.overlong_prompts: skip``)."""
        if self.prompts.from_file:
            self._drop_overlong_prompts()

    def _start_agent(self, fleet) -> None:
        from megarl.agent.loop import AgentLoop
        from megarl.agent.parse import TurnFormatter
        from megarl.agent.tools import ToolRunner, build_registry

        r = self.cfg.rollout
        if fleet is None:
            owner = getattr(self.sample_fn, "__self__", None)
            if owner is None or not hasattr(owner, "fleet"):
                raise ValueError("rollout.agent='tools' runs on the rollout fleet (megarl train); this entry point "
                                 "samples with a local engine: set rollout.agent='single_turn'")
            fleet = lambda: owner.fleet   # noqa: E731 (the group may replace engines, not the fleet)
        registry = build_registry([t.strip() for t in r.tools.split(",") if t.strip()], timeout_s=r.tool_timeout_s,
                                  memory_mb=r.python_memory_mb, output_limit=r.tool_output_chars,
                                  search_corpus=r.search_corpus or None)
        # the python tool kills its process at tool_timeout_s itself; the pool waits a little longer
        self.runner = ToolRunner(registry, workers=r.tool_workers, timeout_s=r.tool_timeout_s + 3.0)
        self.formatter = TurnFormatter(self.tokenizer, registry.schemas())
        self.agent = AgentLoop(self.cfg, self.tokenizer, self.formatter, self.runner, fleet)
        self.sample_fn = self.agent

    def close(self) -> None:
        """Stop the agent loop's tool pool (if any)."""
        if self.runner is not None:
            self.runner.close()

    def prompt_ids(self, rec) -> list[int]:
        """``rec``'s prompt token ids (through the chat template when ``data.use_chat_template``; an
        agent's prompt: the template with the tools' schemas)."""
        from megarl.tasks.dataset import prompt_ids

        if self.formatter is not None:
            messages = rec.prompt if isinstance(rec.prompt, list) else [{"role": "user", "content": rec.prompt}]
            return list(self.formatter.prompt_ids(messages))
        return prompt_ids(self.tokenizer, rec.prompt, self.cfg.data.use_chat_template)

    def _drop_overlong_prompts(self) -> None:
        """A prompt file's rows over ``rollout.max_prompt_tokens``: refused (``data.overlong_prompts:
        error``; preflight says so first for single-turn runs) or dropped and counted (skip)."""
        from megarl.tasks.dataset import overlong_message, overlong_rows

        records, limit = self.prompts.records, self.cfg.rollout.max_prompt_tokens
        overlong = overlong_rows([len(self.prompt_ids(r)) for r in records], limit)
        if not overlong:
            return
        message = overlong_message(self.cfg.data.task, overlong, len(records), limit)
        if self.cfg.data.overlong_prompts == "error":
            raise ValueError(f"data.task: {message}")
        if len(overlong) == len(records):
            raise ValueError(f"data.task: every prompt of {self.cfg.data.task} has more than "
                             f"rollout.max_prompt_tokens={limit} tokens: nothing to train on")
        self.prompts.drop([row for row, _ in overlong])
        self.dropped_prompts = len(overlong)
        logging.getLogger("megarl").info(f"data.overlong_prompts=skip: dropped {len(overlong)} of {len(records)} "
                                         f"prompts of {self.cfg.data.task} (> rollout.max_prompt_tokens={limit} "
                                         f"tokens; first: row {overlong[0][0]}, {overlong[0][1]} tokens)")

    def encode(self, records) -> list[list[int]]:
        """Prompt token ids (:meth:`prompt_ids`); one over ``rollout.max_prompt_tokens`` raises."""
        out = []
        for rec in records:
            ids = self.prompt_ids(rec)
            if len(ids) > self.cfg.rollout.max_prompt_tokens:
                text = rec.prompt if isinstance(rec.prompt, str) else rec.prompt[-1]["content"]
                raise ValueError(f"prompt {text[:60]!r}... has {len(ids)} tokens > "
                                 f"rollout.max_prompt_tokens={self.cfg.rollout.max_prompt_tokens}")
            out.append(list(ids))
        return out

    def generate(self, step: int, records, greedy: bool = False, rewards=None) -> Rollout:
        """The samples of ``records``; with the reward pool ``rewards``, scored as they stream in
        (``rollout.rewards`` holds the raw rewards; :meth:`score` completes it)."""
        ids = self.encode(records)
        base = (self.cfg.trainer.seed * 1_000_003 + step * 1009) * 64
        seeds = [base + 64 * i for i in range(len(ids))]   # vLLM gives sample j of a request seed + j
        answers = [r.answer for r in records]
        # the reward's keyword arguments: every column of the row but the prompt and the answer
        extras = [{"data_source": r.data_source, **r.extra} for r in records]
        scored: dict = {}   # prompt index -> its samples' raw rewards
        self._counts, self.score_s = [0, 0], 0.0

        def on_done(pairs: list) -> None:   # score what finished while the engines go on
            t = time.perf_counter()
            owners = [i for i, samples in pairs for _ in samples]
            flat = [s for _, samples in pairs for s in samples]
            if self.agent is not None:   # the final turn's text, and the trajectory's tool-call counts
                texts = [s["reward_text"] for s in flat]
                kw = [dict(extras[i], **s["reward_extra"]) for i, s in zip(owners, flat)]
            else:
                texts = self.response_texts([s["token_ids"] for s in flat], [s.get("text") for s in flat])
                kw = [extras[i] for i in owners]
            values, parts = self._score(rewards, texts, [answers[i] for i in owners], kw)
            for i, reward, part in zip(owners, values, parts):
                scored.setdefault(i, []).append((reward, part))
            self.score_s += time.perf_counter() - t

        speculate = self.drafts is not None and not greedy
        drafts = [self.drafts.get(r.uid, p) for r, p in zip(records, ids)] if speculate else []
        kw = {"drafts": drafts} if any(d is not None for d in drafts) else {}
        gens = self.sample_fn(ids, seeds, greedy, on_done=on_done if rewards is not None else None, **kw)
        if speculate:   # this epoch's responses are the next one's drafts
            for rec, prompt, samples in zip(records, ids, gens):
                self.drafts.put(rec.uid, prompt, samples)
                self.spec_samples += [s.get("spec") for s in samples]
        rollout = Rollout.from_generations(ids, answers, gens, extras)
        if rewards is not None:
            missing = [(i, g) for i, g in enumerate(gens) if i not in scored]
            if missing:   # a sample_fn that does not stream
                on_done(missing)
            rollout.rewards = [r for i in range(len(gens)) for r, _ in scored[i]]
            if self.rule_terms is not None:
                rollout.reward_terms = [part for i in range(len(gens)) for _, part in scored[i]]
        return rollout

    def _score(self, rewards, texts: list, answers: list, extras) -> tuple[list, list]:
        """(reward, per-term raw rewards or None) of each text: ``data.reward`` as it is, or the
        weighted sum of its rule terms (a reward-model term is added after generation)."""
        from megarl.rewards.spec import RewardTerm

        total, parts = [0.0] * len(texts), [{} for _ in texts]
        for term in self.rule_terms if self.rule_terms is not None else [RewardTerm(1.0, self.cfg.data.reward)]:
            result = rewards.score(term.name, texts, answers, extras=extras)
            self._counts[0] += result.n_errors
            self._counts[1] += result.n_timeouts
            for j, r in enumerate(result.rewards):
                total[j] += term.weight * r   # one term of weight 1: the reward itself, exactly
                parts[j][term.label] = r
        return total, parts if self.rule_terms is not None else [None] * len(texts)

    def response_texts(self, ids: list, texts: list) -> list[str]:
        """Each response's text as the rewards read it (special tokens skipped): the engine's
        decoding where it sent one (its ids stayed in the object store), else the ids' here."""
        todo = [j for j, t in enumerate(texts) if t is None]
        out = list(texts)
        if todo:
            for j, t in zip(todo, self.tokenizer.batch_decode([ids[j] for j in todo], skip_special_tokens=True)):
                out[j] = t
        return out

    def decode(self, rollout: Rollout) -> list[str]:
        return self.response_texts(rollout.response_ids, rollout.texts or [None] * len(rollout))

    def score(self, rollout: Rollout, rewards) -> dict:
        """Fill ``rollout.rewards`` (``data.reward`` with each sample's row columns as keywords, then
        overlong shaping) with the :class:`megarl.rewards.RewardPool` ``rewards``, unless
        :meth:`generate` scored the samples already; the reward metrics."""
        if len(rollout.rewards) != len(rollout):
            t = time.perf_counter()
            self._counts = [0, 0]
            rollout.rewards, parts = self._score(rewards, self.decode(rollout), rollout.answers, rollout.extras or None)
            if self.rule_terms is not None:
                rollout.reward_terms = parts
            self.score_s = time.perf_counter() - t
        raw = list(rollout.rewards)
        if rollout.reward_terms and self.rule_terms:   # a weighted sum: accuracy by its first rule term
            raw = [part[self.rule_terms[0].label] for part in rollout.reward_terms]
        if self.cfg.algorithm.overlong_buffer:
            from megarl.algorithms.dapo import overlong_penalty

            pen = overlong_penalty(rollout.response_lengths(), self.cfg.rollout.max_response_tokens,
                                   self.cfg.algorithm.overlong_buffer)
            rollout.rewards = [r + float(p) for r, p in zip(rollout.rewards, pen)]
        return {"reward/errors": self._counts[0], "reward/timeouts": self._counts[1],
                "reward/accuracy": sum(r >= 1.0 for r in raw) / len(raw)}

    def collect(self, step: int, rewards) -> tuple[Rollout, dict]:
        """Generate and score one step's samples (DAPO: resample groups whose rewards are all equal)."""
        from megarl.algorithms.dapo import informative_group_mask

        cfg, gen_s, score_s = self.cfg, 0.0, 0.0
        tries = cfg.algorithm.max_sampling_tries if cfg.algorithm.dynamic_sampling else 1
        kept: Rollout | None = None
        m: dict = {}
        self.spec_samples = []
        for attempt in range(tries):
            t0 = time.perf_counter()
            records = self.prompts.batch(step, cfg.data.prompts_per_step, offset=attempt)
            part = self.generate(step, records, rewards=rewards)
            m_part = self.score(part, rewards)
            round_score_s = self.score_s              # most of it overlapped with generation
            if cfg.algorithm.advantage == "remax":
                m_part.update(self._greedy_baselines(step, records, part, rewards))
                round_score_s += self.score_s
            score_s += round_score_s
            gen_s += time.perf_counter() - t0 - round_score_s
            if not m:   # the first round's raw statistics are the step's reward metrics
                m = dict(m_part, **_sample_metrics(part))
                if self.drafts is not None:
                    from megarl.rollout.speculative import spec_metrics

                    m.update(spec_metrics(self.spec_samples, part.response_lengths()), **self.drafts.metrics())
            if cfg.algorithm.sample_filter != "none":
                part, m["pf/kept_frac"] = filter_samples(part, cfg.algorithm.sample_filter,
                                                         seed=cfg.trainer.seed * 1_000_003 + step)
            if cfg.algorithm.dynamic_sampling:
                keep = informative_group_mask(torch.tensor(part.rewards), torch.tensor(part.group_ids))
                part = part.select([i for i, k in enumerate(keep.tolist()) if k])
                part.group_ids = [g + attempt * cfg.data.prompts_per_step for g in part.group_ids]
            kept = part if kept is None else kept.concat(part)
            if len(kept) >= cfg.data.prompts_per_step * cfg.rollout.n:
                break
        if len(kept) == 0:
            raise RuntimeError(f"dynamic sampling kept no group in {tries} rounds (every group's rewards were "
                               "equal); raise algorithm.max_sampling_tries or change data.difficulty")
        m.update({"time/generate_s": gen_s, "time/score_s": score_s, "rollout/num_samples": len(kept)})
        if self.agent is not None:
            m.update(self.agent.metrics)
        return kept, m

    def _greedy_baselines(self, step: int, records, part: Rollout, rewards) -> dict:
        """ReMax: one greedy response per prompt, on the fleet, scored like the samples and not
        trained on; its reward becomes each sample's ``baseline_rewards``."""
        greedy = self.generate(step, records, greedy=True, rewards=rewards)
        self.score(greedy, rewards)
        part.baseline_rewards = [greedy.rewards[g] for g in part.group_ids]
        return {"remax/greedy_reward_mean": sum(greedy.rewards) / len(greedy),
                "remax/greedy_length_mean": sum(greedy.response_lengths()) / len(greedy)}

    def evaluate(self, rewards) -> dict:
        """Greedy accuracy on ``data.eval_prompts`` held-out prompts."""
        rollout = self.generate(0, self.prompts.eval_batch(self.cfg.data.eval_prompts), greedy=True, rewards=rewards)
        m = self.score(rollout, rewards)
        return {"eval/accuracy": m["reward/accuracy"], "eval/reward_mean": sum(rollout.rewards) / len(rollout)}


def filter_samples(rollout: Rollout, mode: str, seed: int) -> tuple[Rollout, float]:
    """PF-PPO's policy filtration (Shen et al. 2024, "Policy Filtration in RLHF to Fine-Tune LLM for
    Code Generation"): per prompt group keep the highest-rewarded sample and the lowest
    (``best_worst``) or one other drawn at random (``best_random``, seeded); the first of equal
    rewards wins. A group of one keeps its sample. Returns the kept samples (in their order) and
    the kept share."""
    import random

    rng = random.Random(seed)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(rollout.group_ids):
        members.setdefault(g, []).append(i)
    keep = []
    for idx in members.values():
        best = max(idx, key=lambda i: (rollout.rewards[i], -i))
        rest = [i for i in idx if i != best]
        if rest:
            other = (min(rest, key=lambda i: (rollout.rewards[i], i)) if mode == "best_worst" else rng.choice(rest))
            keep += [best, other]
        else:
            keep.append(best)
    keep.sort()
    return rollout.select(keep), len(keep) / len(rollout)


def _sample_metrics(rollout: Rollout) -> dict:
    from megarl.rewards.model import reward_metrics

    return {**reward_metrics(rollout), **_length_metrics(rollout)}


def _length_metrics(rollout: Rollout) -> dict:
    """Response lengths, clipping, and ``rollout/distinct_frac``: the mean share of distinct
    responses in a prompt's group (reused drafts must not collapse a group's diversity unseen)."""
    lengths = torch.tensor(rollout.response_lengths(), dtype=torch.float64)
    groups: dict = {}
    for g, key in zip(rollout.group_ids, rollout.response_digests()):   # equal ids, equal digests
        groups.setdefault(g, []).append(key)
    return {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": sum(rollout.clipped) / len(rollout),
            "rollout/distinct_frac": sum(len(set(r)) / len(r) for r in groups.values()) / len(groups)}
