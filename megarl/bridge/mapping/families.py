"""Per-family tensor lists and name rules: dense GQA families, Qwen3-MoE and DeepSeek-V3 (MLA).

Megatron names are megatron-core 0.16's TE-spec names as built by mbridge (checked against real
models in ``tests/distributed/workers/bridge_sync.py``); HF names are the transformers
checkpoints' (``tests/unit/test_bridge_mapping.py`` compares with mbridge's conversions). Layouts:

* ``linear_qkv`` rows grouped per query group: ``[q_g; k_g; v_g]``; TP splits whole groups.
* ``linear_fc1`` is ``[gate; up]`` (TP rank r holds ``[gate_r; up_r]``: two segments).
* Routed experts: one stacked logical tensor per layer (:mod:`.base`), ``linear_fc1`` ``[E, 2I, H]``
  -> ``experts.*.gate_proj`` / ``up_proj``, ``linear_fc2`` ``[E, H, I]`` -> ``experts.*.down_proj``.
* DeepSeek-V3 MLA: the q / kv down projections are replicated over TP (vLLM's fused
  ``fused_qkv_a_proj`` too); the up projections are split by heads like vLLM's ``q_b_proj`` /
  ``kv_b_proj``; vLLM derives ``W_UK_T`` / ``W_UV`` from ``kv_b_proj``, so they are never sent.
"""
from __future__ import annotations

from typing import Optional

from megarl.bridge.mapping.base import FamilyMapping, MegatronTensor, Piece, full_box, replace_dim

T = MegatronTensor


def _same(t: T, hf: str) -> list[Piece]:
    return [Piece(full_box(t.shape), hf, full_box(t.shape))]


def _gated(t: T, gate: str, up: str, dim: int) -> list[Piece]:
    """[gate; up] along ``dim`` -> two HF tensors."""
    half = t.shape[dim] // 2
    box = full_box(t.shape)
    dst_shape = tuple(half if i == dim else s for i, s in enumerate(t.shape))
    return [Piece(replace_dim(box, dim, 0, half), gate, full_box(dst_shape)),
            Piece(replace_dim(box, dim, half, 2 * half), up, full_box(dst_shape))]


class DenseGQAMapping(FamilyMapping):
    """GQA attention with fused QKV, gated MLP, optional routed experts (llama and the qwen families)."""

    qkv_bias: Optional[bool] = None
    """Biases on q/k/v: True for every model of the family, None: from HF ``attention_bias``."""
    qk_norm = False
    """Per-head RMSNorm of queries and keys (``q_layernorm`` / ``k_layernorm``)."""

    # -- Megatron tensors ----------------------------------------------------------------
    def attention_tensors(self, i: int) -> list[T]:
        c, p = self.cfg, f"decoder.layers.{i}.self_attention."
        rows = (c.num_attention_heads + 2 * c.num_kv_heads) * c.head_dim
        out = [T(p + "linear_qkv.layer_norm_weight", (c.hidden_size,), i),
               T(p + "linear_qkv.weight", (rows, c.hidden_size), i, tp_dim=0)]
        if self.qkv_bias or c.attention_bias:
            out.append(T(p + "linear_qkv.bias", (rows,), i, tp_dim=0))
        if self.qk_norm:
            out += [T(p + "q_layernorm.weight", (c.head_dim,), i), T(p + "k_layernorm.weight", (c.head_dim,), i)]
        out.append(T(p + "linear_proj.weight", (c.hidden_size, c.num_attention_heads * c.head_dim), i, tp_dim=1))
        return out

    def dense_mlp_tensors(self, i: int) -> list[T]:
        c, p = self.cfg, f"decoder.layers.{i}.mlp."
        return [T(p + "linear_fc1.layer_norm_weight", (c.hidden_size,), i),
                T(p + "linear_fc1.weight", (2 * c.intermediate_size, c.hidden_size), i, tp_dim=0, gated=True),
                T(p + "linear_fc2.weight", (c.hidden_size, c.intermediate_size), i, tp_dim=1)]

    def moe_tensors(self, i: int) -> list[T]:
        c, p = self.cfg, f"decoder.layers.{i}."
        e, m = c.num_experts, c.moe_intermediate_size
        out = [T(p + "pre_mlp_layernorm.weight", (c.hidden_size,), i),
               T(p + "mlp.router.weight", (e, c.hidden_size), i)]
        if self.has_expert_bias:
            out.append(T(p + "mlp.router.expert_bias", (e,), i))
        out += [T(p + "mlp.experts.linear_fc1.weight", (e, 2 * m, c.hidden_size), i, tp_dim=1, gated=True, expert=True),
                T(p + "mlp.experts.linear_fc2.weight", (e, c.hidden_size, m), i, tp_dim=2, expert=True)]
        if c.shared_expert_intermediate_size:
            s = c.shared_expert_intermediate_size
            out += [T(p + "mlp.shared_experts.linear_fc1.weight", (2 * s, c.hidden_size), i, tp_dim=0, gated=True),
                    T(p + "mlp.shared_experts.linear_fc2.weight", (c.hidden_size, s), i, tp_dim=1)]
        return out

    has_expert_bias = False

    def layer_tensors(self, i: int) -> list[T]:
        mlp = self.moe_tensors(i) if self.cfg.is_moe_layer(i) else self.dense_mlp_tensors(i)
        return self.attention_tensors(i) + mlp

    # -- Megatron -> HF ------------------------------------------------------------------
    def qkv_pieces(self, t: T, hf: str) -> list[Piece]:
        c = self.cfg
        q_per_group = c.num_attention_heads // c.num_kv_heads * c.head_dim
        group = q_per_group + 2 * c.head_dim
        cols = t.shape[1:]
        out = []
        for g in range(c.num_kv_heads):
            base = g * group
            for proj, off, rows, dst_start in (("q_proj", 0, q_per_group, g * q_per_group),
                                               ("k_proj", q_per_group, c.head_dim, g * c.head_dim),
                                               ("v_proj", q_per_group + c.head_dim, c.head_dim, g * c.head_dim)):
                src = ((base + off, base + off + rows),) + full_box(cols)
                dst = ((dst_start, dst_start + rows),) + full_box(cols)
                out.append(Piece(src, f"{hf}.{proj}.{t.name.rpartition('.')[2]}", dst))
        return out

    def hf_rules(self, t: T) -> list[Piece]:
        i = t.layer
        hf = f"model.layers.{i}."
        suffix = t.name[len(f"decoder.layers.{i}."):]
        direct = {
            "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "input_layernorm.weight": "input_layernorm.weight",
            "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
            "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
            "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
            "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
            "mlp.linear_fc2.weight": "mlp.down_proj.weight",
            "mlp.router.weight": "mlp.gate.weight",
            "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
            "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
            "mlp.experts.linear_fc2.weight": "mlp.experts.*.down_proj.weight",
            "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
            "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
            "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
            "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
            "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
            "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
        }
        if suffix in direct:
            return _same(t, hf + direct[suffix])
        if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            return self.qkv_pieces(t, hf + "self_attn")
        if suffix == "mlp.linear_fc1.weight":
            return _gated(t, hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight", 0)
        if suffix == "mlp.shared_experts.linear_fc1.weight":
            return _gated(t, hf + "mlp.shared_experts.gate_proj.weight", hf + "mlp.shared_experts.up_proj.weight", 0)
        if suffix == "mlp.experts.linear_fc1.weight":
            return _gated(t, hf + "mlp.experts.*.gate_proj.weight", hf + "mlp.experts.*.up_proj.weight", 1)
        return []

    # -- HF -> vLLM ----------------------------------------------------------------------
    def vllm_rules(self, name: str, shape: tuple, tp: int, rank: int) -> Optional[list[Piece]]:
        if ".experts.*." not in name:
            return None
        layer_prefix = name.split(".experts.*.")[0]
        box = full_box(shape)
        if name.endswith("down_proj.weight"):       # [E, H, I] -> w2 [E, H, I/tp]
            per = shape[2] // tp
            return [Piece(replace_dim(box, 2, rank * per, (rank + 1) * per),
                          f"{layer_prefix}.experts.routed_experts.w2_weight", replace_dim(box, 2, 0, per))]
        per = shape[1] // tp                          # [E, I, H] -> w13 [E, 2I/tp, H]
        off = 0 if name.endswith("gate_proj.weight") else per
        return [Piece(replace_dim(box, 1, rank * per, (rank + 1) * per),
                      f"{layer_prefix}.experts.routed_experts.w13_weight", replace_dim(box, 1, off, off + per))]


class LlamaMapping(DenseGQAMapping):
    """Llama / SmolLM2: the plain dense GQA layout."""


class Qwen2Mapping(DenseGQAMapping):
    """Qwen2 / Qwen2.5: biases on q/k/v always (its HF config has no ``attention_bias``)."""

    qkv_bias = True


class Qwen3Mapping(DenseGQAMapping):
    """Qwen3 dense: QK RMSNorm."""

    qk_norm = True


class Qwen3MoeMapping(Qwen3Mapping):
    """Qwen3-MoE: Qwen3 attention, every layer's MLP routed experts."""


class DeepseekV3Mapping(DenseGQAMapping):
    """MLA attention (below), routed experts with a routing bias and shared experts."""

    has_expert_bias = True

    def attention_tensors(self, i: int) -> list[T]:
        c, p = self.cfg, f"decoder.layers.{i}."
        a = p + "self_attention."
        heads = c.num_attention_heads
        return [T(p + "input_layernorm.weight", (c.hidden_size,), i),
                T(a + "linear_q_down_proj.weight", (c.q_lora_rank, c.hidden_size), i),
                T(a + "linear_q_up_proj.layer_norm_weight", (c.q_lora_rank,), i),
                T(a + "linear_q_up_proj.weight", (heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.q_lora_rank), i,
                  tp_dim=0),
                T(a + "linear_kv_down_proj.weight", (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size), i),
                T(a + "linear_kv_up_proj.layer_norm_weight", (c.kv_lora_rank,), i),
                T(a + "linear_kv_up_proj.weight", (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), i,
                  tp_dim=0),
                T(a + "linear_proj.weight", (c.hidden_size, heads * c.v_head_dim), i, tp_dim=1)]

    def vllm_rules(self, name: str, shape: tuple, tp: int, rank: int) -> Optional[list[Piece]]:
        c = self.cfg
        parent = name.rpartition(".")[0].rpartition(".")[0]
        if name.endswith("q_a_proj.weight"):
            return [Piece(full_box(shape), f"{parent}.fused_qkv_a_proj.weight",
                          replace_dim(full_box(shape), 0, 0, c.q_lora_rank))]
        if name.endswith("kv_a_proj_with_mqa.weight"):
            return [Piece(full_box(shape), f"{parent}.fused_qkv_a_proj.weight",
                          replace_dim(full_box(shape), 0, c.q_lora_rank, c.q_lora_rank + shape[0]))]
        if name.endswith("q_b_proj.weight") or name.endswith("kv_b_proj.weight"):
            per = shape[0] // tp
            return [Piece(replace_dim(full_box(shape), 0, rank * per, (rank + 1) * per), name,
                          replace_dim(full_box(shape), 0, 0, per))]
        return super().vllm_rules(name, shape, tp, rank)
