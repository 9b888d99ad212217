"""What an engine actor puts into the object store of the samples it generates.

A finished sample's token ids (prompt + response, int32, ``stored_ids``) and vLLM's log-probs
(float64, ``stored_logprobs``) are what the training ranks read of it; the engine keeps them in
its :class:`megarl.data.store.Outbox` and the sample carries their keys. The controller claims the
handles (:meth:`megarl.rollout.engine.EngineActor.take_stored`; why not stream a reference:
:mod:`megarl.data.store`), so the arrays go from the engine's node to the ranks without passing
through the controller, which gets the sample's metadata in their place (:func:`to_metadata`):
the response's length (the router, the metrics, the micro-batch plan), its text decoded here with
the model's tokenizer (the rewards; decoding where the sample is spares the controller a Python
int a token) and a digest of its ids (``rollout/distinct_frac``). With ``rollout.speculative``
both arrays stay in the sample (the next epoch's drafts). What an engine puts is owned by its
:class:`megarl.data.keeper.Keeper`, not by the engine: a restarted engine's samples keep them.
"""
from __future__ import annotations

import numpy as np


def to_metadata(samples: list, tokenizer) -> None:
    """Replace each sample's ``token_ids`` and ``logprobs`` (put into the object store already)
    by what the controller reads of it: ``response_length``, ``text`` (``tokenizer``'s decoding,
    special tokens skipped, as the rewards read it) and ``digest`` (:func:`megarl.data.store.digest`)."""
    from megarl.data.store import digest

    texts = tokenizer.batch_decode([s["token_ids"] for s in samples], skip_special_tokens=True)
    for sample, text in zip(samples, texts):
        sample.update(response_length=len(sample["token_ids"]), text=text, digest=digest(sample["token_ids"]),
                      token_ids=None, logprobs=None)


def _in_ray_actor() -> bool:
    """Whether this process runs a Ray actor (an engine actor of the fleet), not a script that
    built one in its own process (tests/e2e/spec_exactness.py): only the former's puts are
    claimed, and a ``ray.put`` in the latter would start a Ray of its own."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class Stash:
    """One engine's puts (see the module docstring): its :class:`megarl.data.store.Outbox`, and
    whether samples are put at all (:attr:`enabled`: in a Ray actor only, where a controller
    claims them) and keep their arrays (:attr:`inline`)."""

    def __init__(self, cfg, keeper=None):
        """``keeper``: the :class:`megarl.data.keeper.Keeper` actor that puts and owns what this
        engine puts (None: this process owns it)."""
        from megarl.data.store import Outbox

        self.cfg = cfg
        self.outbox = Outbox(keeper)   # arrays for the object store, until the controller claims them
        # an engine built in a script's own process has no controller to claim what it would put
        self.enabled = _in_ray_actor()
        # the controller gets a stored sample's metadata (length, text, digest), not the ids and log-probs the ranks
        # read from the store -- except with speculative rollouts, whose drafts are the samples themselves
        self.inline = not self.enabled or cfg.rollout.speculative != "off"
        self._tokenizer = None

    def take(self, keys: list) -> list:
        """The :class:`megarl.data.store.Stored` handles of the arrays streamed as ``keys``."""
        return self.outbox.take(keys)

    def object_refs(self) -> int:
        """The object references that what this engine put keeps alive."""
        return self.outbox.object_refs()

    def put_pairs(self, pairs: list, prompt_ids: list) -> list:
        """``pairs`` (``[(prompt index, samples)]``) with each sample's ``stored_ids`` and
        ``stored_logprobs`` put (when :attr:`enabled`), the arrays then replaced by the metadata
        (:meth:`to_metadata`) unless :attr:`inline`."""
        if self.enabled:
            for i, samples in pairs:
                for sample in samples:
                    self.put_sample(prompt_ids[i], sample)
                if not self.inline:   # in the object store only (Rollout.response_ids, sample_logprobs: None)
                    self.to_metadata(samples)
        return pairs

    def put_sample(self, prompt: list, sample: dict) -> None:
        """Put ``sample``'s ``stored_ids`` (``prompt`` + its tokens) and ``stored_logprobs``."""
        sample["stored_ids"] = self.outbox.put(np.asarray(list(prompt) + list(sample["token_ids"]), np.int32))
        sample["stored_logprobs"] = self.outbox.put(np.asarray(sample["logprobs"], np.float64))

    def to_metadata(self, samples: list) -> None:
        """:func:`to_metadata` with the model's own tokenizer (the controller's,
        :class:`megarl.driver.rollouts.Rollouts`), loaded at first use."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from megarl.models.fixtures import resolve_model_path

            self._tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(self.cfg.model.path))
        to_metadata(samples, self._tokenizer)
