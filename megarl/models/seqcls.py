"""The HF layout of megarl's reward models: ``<Family>ForSequenceClassification`` with one label.

The weights are the decoder's (the causal LM's names, ``model.*``) plus ``score.weight`` ``[1, H]``
(no bias), with no ``lm_head``; ``config.json`` is the policy's with the architecture renamed,
``num_labels`` 1 and a ``pad_token_id`` (HF's classifier reads each row's last non-pad token, and
needs one to batch). ``AutoModelForSequenceClassification`` loads it as it is, and megarl loads
it back as a reward model (``data.reward=model:PATH``, ``ModelOptions(score_head=True)``).
"""
from __future__ import annotations

import json
from pathlib import Path


def pad_token_id(config: dict):
    """The pad token a classifier of ``config`` (a config.json's dict) reads past: its
    ``pad_token_id``, else its (first) EOS id."""
    pad = config.get("pad_token_id")
    if pad is None:
        eos = config.get("eos_token_id")
        pad = eos[0] if isinstance(eos, list) else eos
    return pad


def reward_model_config(model_path: str) -> str:
    """The ``config.json`` text of the reward model trained from the model at ``model_path``."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    arch = (cfg.get("architectures") or ["ForCausalLM"])[0]
    base = arch[:-len("ForCausalLM")] if arch.endswith("ForCausalLM") else arch.split("For")[0]
    cfg["architectures"] = [f"{base}ForSequenceClassification"]
    cfg["num_labels"] = 1
    cfg["id2label"], cfg["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    cfg["problem_type"] = "regression"
    cfg["pad_token_id"] = pad_token_id(cfg)
    return json.dumps(cfg, indent=2) + "\n"


def is_reward_model(path: str) -> bool:
    """Whether the HF folder at ``path`` is a sequence-classification model (megarl rm's export)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])
