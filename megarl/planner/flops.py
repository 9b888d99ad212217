"""Model FLOPs of one token: what MFU divides by and what the planner's roofline costs compute at.

Counted per token, forward, as the usual MFU convention (Megatron-LM's
``num_floating_point_operations``, PaLM appendix B):

* matmuls: 2 FLOPs per weight of every matrix the token passes through (attention projections,
  dense MLPs, and in MoE layers the router, the shared expert and only the routed experts the
  token is sent to, plus the LM head); embedding lookups and element-wise ops (under 1%) count nothing.
* attention: per layer and key, ``2 * heads * qk_head_dim`` for Q.K^T and ``2 * heads *
  v_head_dim`` for P.V (MLA in its expanded form). ``causal=True`` (default) counts
  ``(seq_len + 1) / 2`` keys on average, what flash-attention kernels compute; ``causal=False``
  counts all keys (Megatron-LM's and PaLM's convention, 2x the causal work).

Training is 3 x forward. Activation recompute is hardware work, not model FLOPs: the planner adds
it separately. DeepSeek-V3's multi-token-prediction layers are not counted (RL does not use them).
"""
from __future__ import annotations

from megarl.models.dims import ModelDims


def attention_matmul_params(dims: ModelDims) -> int:
    """Weights of one layer's attention projections (MLA or GQA), biases excluded."""
    h, heads = dims.hidden_size, dims.num_attention_heads
    if dims.kv_lora_rank:
        qk_dim = dims.qk_nope_head_dim + dims.qk_rope_head_dim
        q = h * dims.q_lora_rank + dims.q_lora_rank * heads * qk_dim if dims.q_lora_rank else h * heads * qk_dim
        kv = h * (dims.kv_lora_rank + dims.qk_rope_head_dim) \
            + dims.kv_lora_rank * heads * (dims.qk_nope_head_dim + dims.v_head_dim)
        return q + kv + heads * dims.v_head_dim * h
    return 2 * h * heads * dims.head_dim + 2 * h * dims.num_kv_heads * dims.head_dim


def mlp_matmul_params(dims: ModelDims, layer: int, *, active: bool) -> int:
    """Weights of layer ``layer``'s MLP (gated: gate, up, down); for an MoE layer with ``active``
    only the routed experts one token uses (plus router and shared expert), else all of them."""
    h = dims.hidden_size
    if not dims.is_moe_layer(layer):
        return 3 * h * dims.intermediate_size
    routed = dims.num_experts_per_tok if active else dims.num_experts
    if active and not routed:
        raise ValueError(f"model_type {dims.model_type!r} has {dims.num_experts} experts but no num_experts_per_tok "
                         "in its config.json (needed to count the active parameters)")
    return 3 * h * (routed * dims.moe_intermediate_size + dims.shared_expert_intermediate_size) \
        + h * dims.num_experts


def active_matmul_params(dims: ModelDims) -> int:
    """Weights one token multiplies through in a forward pass: every layer's attention and
    (active) MLP, and the LM head."""
    layers = sum(attention_matmul_params(dims) + mlp_matmul_params(dims, i, active=True)
                 for i in range(dims.num_layers))
    return layers + dims.hidden_size * dims.vocab_size


def attention_score_flops(dims: ModelDims, context: float) -> float:
    """Forward FLOPs of Q.K^T and P.V for one token attending to ``context`` keys, all layers."""
    heads = dims.num_attention_heads
    if dims.kv_lora_rank:
        qk_dim, v_dim = dims.qk_nope_head_dim + dims.qk_rope_head_dim, dims.v_head_dim
    else:
        qk_dim = v_dim = dims.head_dim
    return 2.0 * heads * (qk_dim + v_dim) * context * dims.num_layers


def flops_per_token(dims: ModelDims, seq_len: int, training: bool, *, causal: bool = True) -> float:
    """Model FLOPs of one token of a ``seq_len``-token sequence: forward only, or forward and
    backward (3x) when ``training``. See the module docstring for what is counted."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}, expected a positive number of tokens")
    context = (seq_len + 1) / 2 if causal else float(seq_len)
    forward = 2.0 * active_matmul_params(dims) + attention_score_flops(dims, context)
    return 3.0 * forward if training else forward
