"""The sizes of a model, read once from its HF config (pure: no torch, no transformers).

:class:`ModelDims` is the one HF-config parser: the layout checks (``Topology.check_model``, the
config loader), the engine build, the conversion and the weight mapping
(:mod:`megarl.bridge.mapping`) all read the model through it. Fields are named after the HF keys
they come from where one exists; families differ only in which keys their config has:

* MLA (DeepSeek, ``kv_lora_rank`` set): every head has its own K/V, so ``num_kv_heads`` is the
  head count and ``head_dim`` 0 (the MLA dims are ``q_lora_rank`` .. ``v_head_dim``).
* Routed experts: ``num_experts`` / ``n_routed_experts`` / ``num_local_experts``; the first
  ``first_k_dense_replace`` layers keep a dense MLP; ``n_shared_experts`` shared experts are one
  MLP of ``n_shared_experts * moe_intermediate_size`` rows.
"""
from __future__ import annotations

from dataclasses import dataclass

_REQUIRED = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class ModelDims:
    """Model sizes from an HF config (dict or transformers config object)."""

    model_type: str
    num_layers: int
    """``num_hidden_layers`` (without DeepSeek's multi-token-prediction layers)."""
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    """``num_key_value_heads`` (default: one per attention head; MLA: one per head)."""
    head_dim: int
    """``head_dim`` (default ``hidden_size // num_attention_heads``); 0 for MLA."""
    intermediate_size: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """HF ``attention_bias`` (MLA: always False)."""
    num_experts: int = 0
    num_experts_per_tok: int = 0
    """Routed experts each token goes to (HF ``num_experts_per_tok``; 0 for a dense model)."""
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    shared_expert_intermediate_size: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    padded_vocab_size: int = 0
    """Megatron's (padded) vocabulary rows; 0 = ``vocab_size`` (megarl pads nothing when building)."""

    @classmethod
    def from_hf(cls, cfg) -> "ModelDims":
        """Parse an HF config (a config.json dict or a transformers config object)."""
        if isinstance(cfg, dict):
            def get(key, default=None):
                return cfg.get(key, default)
        else:
            def get(key, default=None):
                return getattr(cfg, key, default)
        missing = [k for k in _REQUIRED if get(k) is None]
        if missing:
            raise ValueError(f"HF config (model_type {get('model_type')!r}) has no {', '.join(missing)} "
                             f"(expected every one of {', '.join(_REQUIRED)})")
        heads, hidden = int(get("num_attention_heads")), int(get("hidden_size"))
        mla = bool(get("kv_lora_rank"))
        experts = get("num_experts") or get("n_routed_experts") or get("num_local_experts") or 0
        moe_intermediate = int(get("moe_intermediate_size") or 0)
        return cls(
            model_type=get("model_type"), num_layers=int(get("num_hidden_layers")), hidden_size=hidden,
            vocab_size=int(get("vocab_size")), num_attention_heads=heads,
            num_kv_heads=heads if mla else int(get("num_key_value_heads") or heads),
            head_dim=0 if mla else int(get("head_dim") or hidden // heads),
            intermediate_size=int(get("intermediate_size") or 0),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)) and not mla,
            num_experts=int(experts), num_experts_per_tok=int(get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate_size=moe_intermediate,
            first_k_dense_replace=int(get("first_k_dense_replace") or 0),
            shared_expert_intermediate_size=int(get("n_shared_experts") or 0) * moe_intermediate,
            q_lora_rank=int(get("q_lora_rank") or 0), kv_lora_rank=int(get("kv_lora_rank") or 0),
            qk_rope_head_dim=int(get("qk_rope_head_dim") or 0), qk_nope_head_dim=int(get("qk_nope_head_dim") or 0),
            v_head_dim=int(get("v_head_dim") or 0))

    @property
    def megatron_vocab_size(self) -> int:
        return self.padded_vocab_size or self.vocab_size

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense_replace

    def num_parameters(self) -> int:
        """Parameter count of the HF model (weight matrices, embeddings and norms; biases, routers'
        bias terms and DeepSeek's multi-token-prediction layers are left out): an estimate for
        sizing checkpoints, within ~1% for the supported families."""
        h, heads = self.hidden_size, self.num_attention_heads
        if self.kv_lora_rank:
            qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * heads * qk_dim if self.q_lora_rank else h * heads * qk_dim
            attention = (q + h * (self.kv_lora_rank + self.qk_rope_head_dim)
                         + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
                         + heads * self.v_head_dim * h)
        else:
            attention = 2 * h * heads * self.head_dim + 2 * h * self.num_kv_heads * self.head_dim
        dense_mlp = 3 * h * self.intermediate_size   # gated (SwiGLU) MLP in every supported family
        moe_mlp = 3 * h * (self.num_experts * self.moe_intermediate_size + self.shared_expert_intermediate_size) \
            + h * self.num_experts
        layers = sum(attention + 2 * h + (moe_mlp if self.is_moe_layer(i) else dense_mlp)
                     for i in range(self.num_layers))
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + embeddings + h


def check_model_layout(hf_config: dict, topology, *, train: bool = False) -> ModelDims:
    """The model-dependent layout rules, read from config.json alone (no process, no torch): a
    supported ``model_type`` (ValueError listing the known ones), ``topology.check_model`` (heads,
    KV heads, layers, experts) and, when ``train``, megatron-core's refusal to train a
    mixture-of-experts model with tp > 1 unless sequence parallelism is on (TopologyError).

    ``topology`` is a :class:`megarl.parallel.Topology`. The engine
    (:func:`megarl.policy.build.check_layout`) and :mod:`megarl.preflight` both call this.
    """
    from megarl.models.registry import get_family
    from megarl.parallel.topology import TopologyError

    family = get_family(hf_config.get("model_type", "<missing>"))
    dims = ModelDims.from_hf(hf_config)
    topology.check_model(dims)
    if train and topology.tp > 1 and not topology.sp and family.is_moe:
        raise TopologyError("sp", topology.sp, f"true for training a mixture-of-experts model with "
                            f"tp={topology.tp} (megatron-core requires sequence parallelism with MoE and TP)")
    return dims
