"""MoE routing in the loop: which routing each pass of a step uses (``algorithm.router_replay``),
the routing metrics (:meth:`StepRouting.metrics`), and ``<run_dir>/moe.jsonl``.

Per step (:mod:`megarl.policy.replay` does the work inside the MoE layers):

=========  =========================  ==================  ===========================
replay     old log-prob pass          reference pass      training passes
=========  =========================  ==================  ===========================
off        compare with vLLM's [1]_   own routing         own routing
r2         record own; compare [1]_   own routing         replay the recorded routing
r3         replay vLLM's (compared)   replay vLLM's       replay vLLM's
=========  =========================  ==================  ===========================

.. [1] when the samples carry vLLM's routing (``rollout.return_routing``).

Routing is kept in memory only, never in a checkpoint (see :class:`StepRouting` for resume).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from megarl.data.batch import Rollout
from megarl.data.readout import routing_sums


class StepRouting:
    """The routing of one run's steps (see the module docstring's table).

    Resume: vLLM's routing is stored with the samples only in memory; a resumed run generates the
    interrupted step's samples again (the same seeds), so their routing is recomputed by the
    engines rather than read back; r2's recorded routing is recomputed by the repeated old
    log-prob pass."""

    def __init__(self, cfg, run_dir: Path, resume_step: int):
        from megarl.observability.jsonl import keep_steps_before, read_jsonl

        self.mode = cfg.algorithm.router_replay
        self.path = Path(run_dir) / "moe.jsonl"
        if self.path.exists():
            keep_steps_before(self.path, read_jsonl(self.path), resume_step)

    def _check(self, rollout: Rollout) -> None:
        if self.mode == "r3" and not rollout.routed_experts:
            raise RuntimeError("algorithm.router_replay='r3' but the samples carry no routed_experts: the rollout "
                               "engines did not return their routing (see megarl.rollout.engine.captures_routing)")

    def old_pass(self, rollout: Rollout) -> dict:
        """Keyword arguments of the old log-prob pass (``WorkerGroup.logprobs``)."""
        self._check(rollout)
        if not rollout.routed_experts:
            return {"record_routing": self.mode == "r2"}
        return {"routing": rollout.routed_experts, "routing_action": "replay" if self.mode == "r3" else "compare",
                "record_routing": self.mode == "r2"}

    def reference_pass(self, rollout: Rollout) -> dict:
        if self.mode != "r3":
            return {}
        return {"routing": rollout.routed_experts, "routing_action": "replay"}

    def train_routing(self, rollout: Rollout, routing_out: dict):
        """Per sample, the routing the training passes replay (None: their own)."""
        if self.mode == "r3":
            return rollout.routed_experts
        if self.mode == "r2":
            return routing_out["recorded"]
        return None

    def metrics(self, rollout: Rollout, train_lp: list, routing_out: dict, version: int | None) -> dict:
        """routing/* of the old log-prob pass (empty without vLLM routing to compare) from
        per-token log-probs and per-token misses (``routing_out["misses"]``): the same numbers the
        ranks' per-sample :func:`routing_sums` give through :meth:`metrics_from_sums` (the oracle
        the tests compare them with).

        The metrics (every step the samples carry vLLM's routing): ``routing/agree`` (share of
        token-layer top-k sets where the trainer's own routing in the old log-prob pass equals
        vLLM's, compared as sets; ``routing/agree_layer<i>`` per MoE layer i, 0-based),
        ``routing/disagree_tokens`` (share of response tokens with at least one MoE layer routed
        differently) and the rollout-vs-train log-prob gap |vLLM - trainer| of the response tokens
        split by that: ``routing/logprob_diff_agree_mean`` / ``_disagree_mean`` (NaN without such
        tokens; only tokens of the trained version in the off-policy modes). With replay, the
        training passes report ``actor/routing_replayed`` (token-layers whose experts were replayed
        in the last training pass) and ``actor/routing_replay_mismatch`` (those whose routing map,
        what the token dispatcher used, was not exactly the replayed experts: 0)."""
        misses = routing_out.get("misses")
        if misses is None:
            return {}
        versions = rollout.token_versions if version is not None and rollout.token_versions else None
        return self.metrics_from_sums(routing_out, [
            routing_sums(torch.tensor(vllm_lp, dtype=torch.float64), lp, miss,
                         versions[i].tensor(torch.long) if versions else None, version)
            for i, (vllm_lp, lp, miss) in enumerate(zip(rollout.vllm_logprobs(), train_lp, misses))])

    @staticmethod
    def metrics_from_sums(routing_out: dict, sums: list[dict]) -> dict:
        """routing/* from the pass's report and the ranks' per-sample :func:`routing_sums`, in
        sample order."""
        report = routing_out.get("report") or {}
        if "routing_agree" not in report:
            return {}
        out = {"routing/agree": report["routing_agree"]}
        out.update({f"routing/agree_layer{i}": a for i, a in enumerate(report["routing_agree_per_layer"])})
        mean = lambda k: (sum(s[k][0] for s in sums) / n if (n := sum(s[k][1] for s in sums)) else math.nan)  # noqa: E731
        out.update({"routing/disagree_tokens": sum(s["disagree"] for s in sums) / max(sum(s["tokens"] for s in sums), 1),
                    "routing/logprob_diff_agree_mean": mean("agree"),
                    "routing/logprob_diff_disagree_mean": mean("disagree_diff")})
        return out

    def write(self, step: int, tokens_per_expert, routing_out: dict) -> None:
        """One line of ``moe.jsonl`` (MoE models only: ``tokens_per_expert`` [Lm][E] from the
        last training pass, None for a dense model): the per-expert token counts of every MoE
        layer and the per-layer agreement. The MoE load metrics of every step come from
        :class:`megarl.policy.moe_stats.MoEStats`: ``actor/moe_load_imbalance`` (max over mean
        tokens per expert, worst layer), ``actor/moe_aux_loss``, ``actor/moe_z_loss``."""
        if tokens_per_expert is None:
            return
        row = {"step": step, "tokens_per_expert": tokens_per_expert}
        report = routing_out.get("report") or {}
        if "routing_agree_per_layer" in report:
            row["routing_agree_per_layer"] = report["routing_agree_per_layer"]
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
