"""Fixes for megatron-core 0.16 bugs that hit megarl on every device (CPU and GPU alike).

Applied by :func:`apply` (idempotent) before any model is built (``megarl.engine.build``); each
is replaced at its definition site in megatron-core, never by editing megatron-core, and each is
asserted by a test.

M1  ``TopKRouter._apply_expert_bias`` (moe/router.py): with a padding mask, the expert-bias token
    count computes ``routing_map & ~padding_mask`` where ``routing()`` has already flattened the
    mask to ``[tokens]`` and ``routing_map`` is ``[tokens, experts]``: the mask broadcasts along
    the expert axis, so every training forward of a model with expert bias (DeepSeek-V3's
    ``noaux_tc`` routing) fails ("size of tensor a (16) must match the size of tensor b (316)"),
    or, when the token count equals the expert count, silently counts the wrong tokens. Fixed:
    the mask is applied per token (``[tokens, 1]``). The count only updates the expert bias
    between steps (``moe_router_bias_update_rate``), never the forward values.
    Tested by tests/unit/test_megatron_fixes.py and, through the whole loop, by
    tests/e2e/test_deepseek_e2e.py.
"""
from __future__ import annotations

_APPLIED = False


def _apply_expert_bias(self, routing_map, padding_mask=None):
    import torch

    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def apply() -> None:
    """Install M1 (once per process)."""
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    TopKRouter._apply_expert_bias = _apply_expert_bias
    _APPLIED = True
