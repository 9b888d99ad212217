"""A reward model's term of ``data.reward`` (``[WEIGHT*]model:PATH``): scored on the training workers.

After a step's samples are generated (and their rule terms scored in the reward pool), the frozen
reward model (:class:`megarl.actors.roles.RewardModelRole`, beside the reference,
offloaded with it) scores every sample in one packed forward pass sharded over the DP ranks
(:meth:`megarl.actors.ranks.RankPasses.reward_model_scores`); the scores are normalised
(``data.reward_norm``) and added, weighted, to each sample's reward. The pass is its own phase:
``time/reward_model_s`` in the metrics, ``reward_scores`` spans in the timeline.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from megarl.rewards.spec import model_term, parse_reward

EPS = 1e-6


class RewardModelTerm:
    def __init__(self, cfg, state: dict | None = None):
        self.term = model_term(parse_reward(cfg.data.reward))
        self.norm = cfg.data.reward_norm
        from megarl.models.seqcls import pad_token_id

        self.pad_id = pad_token_id(json.loads((Path(self.term.path) / "config.json").read_text()))
        state = state or {}
        self.count, self.mean, self.m2 = state.get("count", 0), state.get("mean", 0.0), state.get("m2", 0.0)

    def state(self) -> dict:
        """The running whitening statistics (kept in checkpoints, so a resumed run goes on with them)."""
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def normalize(self, scores: list, group_ids: list) -> list:
        import torch

        x = torch.tensor(scores, dtype=torch.float64)
        if self.norm == "whiten":   # running mean and variance over every sample so far (this step's included)
            n_b, mean_b, m2_b = len(x), float(x.mean()), float(((x - x.mean()) ** 2).sum())
            n = self.count + n_b
            delta = mean_b - self.mean
            self.mean += delta * n_b / n
            self.m2 += m2_b + delta ** 2 * self.count * n_b / n
            self.count = n
            std = math.sqrt(self.m2 / n) if n > 1 else 1.0
            return ((x - self.mean) / (std + EPS)).tolist()
        if self.norm == "group":
            g = torch.tensor(group_ids)
            out = x.clone()
            for gid in g.unique():
                sel = g == gid
                v = x[sel]
                out[sel] = (v - v.mean()) / (v.std(unbiased=False) + EPS) if v.numel() > 1 else v - v.mean()
            return out.tolist()
        return x.tolist()

    def apply(self, rollout, group) -> dict:
        """Score ``rollout`` with the reward model and add the weighted, normalised scores to its
        rewards; the metrics (``reward_model/*``, the updated ``reward/*``)."""
        import torch

        t = time.perf_counter()
        scores = group.reward_model_scores(rollout, self.pad_id)
        normed = self.normalize(scores, rollout.group_ids)
        rollout.rewards = [r + self.term.weight * s for r, s in zip(rollout.rewards, normed)]
        if rollout.reward_terms:
            for part, s in zip(rollout.reward_terms, scores):
                part["model"] = s
        raw = torch.tensor(scores, dtype=torch.float64)
        return {"reward_model/score_mean": float(raw.mean()), "reward_model/score_std": float(raw.std(unbiased=False)),
                "reward_model/normalized_mean": sum(normed) / len(normed), **reward_metrics(rollout),
                "time/reward_model_s": time.perf_counter() - t}


def reward_metrics(rollout) -> dict:
    """A rollout's (:class:`megarl.data.batch.Rollout`) reward mean and std, and with a weighted
    sum each term's raw mean (``reward/<name>_mean``)."""
    import torch

    rewards = torch.tensor(rollout.rewards, dtype=torch.float64)
    out = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(unbiased=False))}
    for label in (rollout.reward_terms[0] if rollout.reward_terms else {}):
        out[f"reward/{label}_mean"] = sum(p[label] for p in rollout.reward_terms) / len(rollout)
    return out
