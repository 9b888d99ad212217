"""``data.reward`` as a weighted sum of terms: rule-based reward functions and reward models.

    gsm8k                               one rule (weight 1): the reward as it is
    model:runs/rm/hf                    a reward model's score (megarl rm's HF export)
    1.0*model:runs/rm/hf + 0.5*gsm8k    a weighted sum
    1.0*model:runs/rm/hf + 0*gsm8k      weight 0: scored and logged, not added (a monitor)

Rule terms run in the reward pool (:mod:`megarl.rewards.pool`) while samples stream in; a model
term runs on the training workers after generation (:meth:`megarl.actors.group.WorkerGroup.reward_model_scores`)
and is normalised by ``data.reward_norm`` before it is weighted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MODEL_PREFIX = "model:"


@dataclass(frozen=True)
class RewardTerm:
    weight: float
    name: str
    """A reward function's name or dotted path, or ``model:PATH``."""

    @property
    def is_model(self) -> bool:
        return self.name.startswith(MODEL_PREFIX)

    @property
    def path(self) -> str:
        """The reward model's folder (model terms)."""
        return self.name[len(MODEL_PREFIX):]

    @property
    def label(self) -> str:
        """The term's metric name: ``model`` or the function's name."""
        return "model" if self.is_model else self.name.rsplit(":", 1)[-1].rsplit(".", 1)[-1]


def parse_reward(text: str) -> list[RewardTerm]:
    """The terms of ``data.reward`` (ValueError naming what is wrong)."""
    terms = []
    for part in text.split("+"):
        part = part.strip()
        if not part:
            raise ValueError(f"empty term in {text!r}; expected NAME or WEIGHT*NAME terms joined by '+'")
        weight, name = 1.0, part
        head, star, tail = part.partition("*")
        if star:
            try:
                weight = float(head)
            except ValueError:
                raise ValueError(f"term {part!r}: {head.strip()!r} is not a number (WEIGHT*NAME)") from None
            name = tail.strip()
            if not math.isfinite(weight):
                raise ValueError(f"term {part!r}: weight must be finite")
        if not name:
            raise ValueError(f"term {part!r} has no reward name")
        if name.startswith(MODEL_PREFIX) and not name[len(MODEL_PREFIX):]:
            raise ValueError(f"term {part!r}: model: needs the reward model's folder (model:PATH)")
        terms.append(RewardTerm(weight, name))
    if sum(t.is_model for t in terms) > 1:
        raise ValueError(f"{text!r} names {sum(t.is_model for t in terms)} reward models; one is supported")
    return terms


def is_plain(terms: list[RewardTerm]) -> bool:
    """One rule term of weight 1: the reward is exactly that function's (no weighted sum)."""
    return len(terms) == 1 and not terms[0].is_model and terms[0].weight == 1.0


def model_term(terms: list[RewardTerm]):
    return next((t for t in terms if t.is_model), None)
