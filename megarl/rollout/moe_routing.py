"""The MoE routing of the rollout engines' samples (rollout routing replay).

An engine that captures routing (:func:`captures_routing`) gives every sample ``routed_experts``,
an int16 array ``[P + R, Lm, K]``: row j is token j of prompt (P tokens) + response (R tokens);
Lm the MoE layers in model order (dense layers skipped); K the experts per token; values the
global expert ids vLLM's router chose for that token in that layer; -1 for tokens that never went
through the model (the last sampled token; everything of a request aborted before its prefill). A
partial sample carries the routing of what was computed so far; its continuation (prompt + prefix)
covers all of it again. On CPU the rows are captured inside vLLM (:mod:`megarl.compat.vllm_cpu`,
V4) and fetched from the workers after each engine step that finished requests; on GPU they come
from vLLM's own ``CompletionOutput.routed_experts`` (``enable_return_routed_experts``), converted.
In an engine actor each sample's array goes to its :class:`megarl.data.store.Outbox` and the
sample carries a key (:mod:`megarl.rollout.stash`): the routing goes from the engine's node to the
training ranks without passing through the controller.
"""
from __future__ import annotations

import weakref

import numpy as np

from megarl.data.batch import response_length


def captures_routing(cfg) -> bool:
    """Whether the engines return every sample's routing (``routed_experts``, see the module
    docstring): ``rollout.return_routing``, or ``algorithm.router_replay: r3``, which needs it."""
    return bool(cfg.rollout.return_routing) or cfg.algorithm.router_replay == "r3"


_ROUTING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""The engines of :func:`megarl.rollout.build.make_rollout_llm` that capture routing -> their
:class:`RoutingReader` (None until first used)."""


def track(llm) -> None:
    """Mark ``llm`` (an engine built to capture routing) for :func:`routing_reader`."""
    _ROUTING[llm] = None


def sample_routing(raw_SLK, num_rows: int, num_layers: int, top_k: int, layers: list[int] | None = None) -> np.ndarray:
    """A sample's ``routed_experts``: int16 ``[num_rows, num_layers, top_k]``, row j from row j of
    ``raw_SLK`` (None: nothing computed), -1 where ``raw_SLK`` has no row. ``layers``: the MoE
    layers' indices along ``raw_SLK``'s layer axis (vLLM's GPU output indexes every decoder layer,
    dense ones too); None: that axis is the MoE layers already. Pure numpy."""
    out = np.full((num_rows, num_layers, top_k), -1, np.int16)
    if raw_SLK is not None and len(raw_SLK):
        raw = np.asarray(raw_SLK)
        if layers is not None:
            raw = raw[:, layers]
        if raw.shape[1:] != out.shape[1:]:
            raise ValueError(f"routing of shape {raw.shape}: expected [tokens, {num_layers}, {top_k}]")
        n = min(len(raw), num_rows)
        out[:n] = raw[:n]
    return out


class RoutingReader:
    """Attaches ``routed_experts`` (:func:`sample_routing`) to the samples of a capturing engine.

    CPU: one ``collective_rpc`` (:data:`megarl.rollout.worker_ext.TAKE_ROUTING`) per call fetches
    and forgets the rows V4 captured for the given vLLM internal request ids. GPU: vLLM's
    ``CompletionOutput.routed_experts`` is ``[tokens - 1, decoder layers, K]`` (rows from the first
    prompt token, ``SamplingParams.routed_experts_prompt_start`` = 0, to the last computed token;
    the layer axis is ``MoERunner.layer_id``, the decoder layer index, so dense layers have rows
    too): the MoE layers (:data:`megarl.rollout.worker_ext.MOE_LAYOUT`) are taken and a -1 row is
    added for the last token. vLLM attaches it only to finished outputs: on GPU a partial
    (aborted) sample gets -1 rows (its continuation covers it). Untested here (no GPU)."""

    def __init__(self, llm):
        from megarl.compat import cuda_available
        from megarl.rollout.worker_ext import MOE_LAYOUT

        self.llm, self.gpu = llm, cuda_available()
        self.outbox = None
        """In an engine actor: its
        :class:`megarl.data.store.Outbox`; each sample's routing is put into Ray's object store
        and the sample carries its :class:`~megarl.data.store.Pending` key (the controller claims
        the handle) instead of the array."""
        layout = llm.collective_rpc(MOE_LAYOUT)[0]
        self.layers, self.top_k = [int(x) for x in layout["layers"]], int(layout["top_k"])
        if not self.layers:
            raise ValueError("rollout.return_routing / algorithm.router_replay=r3: the rollout model has no MoE layer")

    def attach(self, items: list) -> None:
        """``items``: (vLLM internal request id or None, sample, prompt length, its
        ``CompletionOutput`` or None); sets each sample's ``routed_experts``."""
        if not items:
            return
        num_layers = len(self.layers)
        if self.gpu:
            for _, sample, num_prompt, out in items:
                self._set(sample, sample_routing(getattr(out, "routed_experts", None),
                                                 num_prompt + response_length(sample), num_layers,
                                                 self.top_k, layers=self.layers))
            return
        rows = self._take([rid for rid, *_ in items if rid is not None])
        for rid, sample, num_prompt, _ in items:
            got = rows.get(rid)
            raw = None if got is None else np.frombuffer(got[0], np.int16).reshape(got[1], num_layers, self.top_k)
            self._set(sample, sample_routing(raw, num_prompt + response_length(sample), num_layers, self.top_k))

    def _set(self, sample: dict, routing: np.ndarray) -> None:
        sample["routed_experts"] = self.outbox.put(routing) if self.outbox is not None else routing

    def forget(self, request_ids: list) -> None:
        """Drop the captured rows of requests nobody will read (CPU)."""
        if not self.gpu:
            self._take([rid for rid in request_ids if rid is not None])

    def _take(self, request_ids: list) -> dict:
        from megarl.rollout.worker_ext import TAKE_ROUTING

        if not request_ids:
            return {}
        reply = self.llm.collective_rpc(TAKE_ROUTING, args=(request_ids,))[0]
        if (reply["layers"], reply["top_k"]) != (len(self.layers), self.top_k):
            raise RuntimeError(f"routing capture: the worker's layout ({reply['layers']} MoE layers, top-k "
                               f"{reply['top_k']}) changed from ({len(self.layers)}, {self.top_k})")
        return reply["rows"]


def routing_reader(llm) -> RoutingReader | None:
    """The :class:`RoutingReader` of an engine that captures routing (:func:`track`); None for
    every other engine."""
    try:
        if llm not in _ROUTING:
            return None
    except TypeError:   # not weak-referenceable: not an engine of make_rollout_llm
        return None
    if _ROUTING[llm] is None:
        _ROUTING[llm] = RoutingReader(llm)
    return _ROUTING[llm]
