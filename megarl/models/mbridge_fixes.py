"""Fixes for mbridge 0.15.1 under transformers 5 and megatron-core 0.16 (one bridge class per family).

mbridge was written for transformers 4 and megatron-core <= 0.15. Each fix below is applied by a
subclass of the mbridge bridge, never by editing mbridge, and each is asserted by a test
(``tests/unit/test_engine_registry.py``; numerics in ``tests/distributed/test_engine_parity.py``):

F1  transformers 5 moved ``rope_theta`` (and rope scaling) into ``config.rope_parameters``;
    mbridge reads ``hf_config.rope_theta`` (AttributeError). :func:`hf_config_for_mbridge` copies
    the config and sets ``rope_theta`` from ``rope_parameters``; only ``rope_type == "default"``
    is accepted (other rope types would be silently ignored by mbridge's llama/qwen path).
F2  Tied embeddings: ``LLaMABridge`` (SmolLM2 is llama with ``tie_word_embeddings``) maps the
    last pipeline stage's ``output_layer.weight`` to ``lm_head.weight``, which a tied checkpoint
    does not have (KeyError at pp > 1). Qwen2Bridge handles ties but *mutates the class-level*
    ``_DIRECT_MAPPING`` dict, so after one tied model every later qwen2/qwen3 bridge in the
    process loads ``lm_head`` from the embeddings. Here every bridge copies the mapping per
    instance before adjusting it.
F3  DeepSeek-V3: mbridge passes ``max_position_embeddings`` to ``MLATransformerConfig`` (renamed
    ``original_max_position_embeddings`` in megatron-core 0.16: TypeError).
F4  DeepSeek-V3: ``_get_safetensor_io`` imports a triton FP8 kernel for bf16 and raises
    ``NotImplemented(...)`` (itself a TypeError) otherwise; plain (non-FP8) checkpoints use the
    ordinary ``SafeTensorIO``.
F5  DeepSeek-V3: group-limited routing (HF ``n_group`` / ``topk_group``) is not mapped; without
    ``moe_router_num_groups`` / ``moe_router_group_topk`` the routing differs from HF
    (4.5e-2 logit gap measured).
F6  DeepSeek-V3: transformers 5 serialises ``num_nextn_predict_layers`` and mbridge then builds an
    MTP block whenever the key exists (and asserts 61 layers on export). MTP heads are not used
    for RL log-probs: megarl builds without MTP (``mtp_num_layers=None``).
F7  DeepSeek-V3: megatron's MLA always applies RoPE to de-interleaved rope dims, which equals HF
    only for ``rope_interleave=True``; False is rejected with a ValueError.
F8  Qwen3-MoE: mbridge hard-codes ``moe_router_pre_softmax=False`` (top-k then softmax, i.e.
    HF ``norm_topk_prob=True``); HF ``norm_topk_prob=False`` needs softmax-then-top-k. Mapped
    from the config; ``mlp_only_layers`` / ``decoder_sparse_step != 1`` are rejected.
"""
from __future__ import annotations

import copy
from typing import Any


def hf_config_for_mbridge(hf_config: Any) -> Any:
    """A copy of ``hf_config`` with the transformers-4 fields mbridge reads (fix F1)."""
    cfg = copy.deepcopy(hf_config)
    params = getattr(cfg, "rope_parameters", None) or {}
    if params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{cfg.model_type}: rope_parameters.rope_type={rope_type!r} is not supported "
                             "(expected 'default'; mbridge's llama/qwen mapping ignores rope scaling)")
    if getattr(cfg, "rope_theta", None) is None:
        if "rope_theta" not in params:
            raise ValueError(f"{cfg.model_type}: config has neither rope_theta nor rope_parameters.rope_theta")
        cfg.rope_theta = params["rope_theta"]
    if getattr(cfg, "rope_scaling", None) is not None and not params:
        raise ValueError(f"{cfg.model_type}: rope_scaling={cfg.rope_scaling!r} is not supported")
    return cfg


def _per_instance_tied_mapping(bridge) -> None:
    """Fix F2: copy the class mapping, then point output_layer at the embeddings when tied."""
    bridge._DIRECT_MAPPING = dict(type(bridge)._DIRECT_MAPPING)
    bridge._DIRECT_MAPPING["output_layer.weight"] = "lm_head.weight"
    if getattr(bridge.hf_config, "tie_word_embeddings", False):
        bridge._DIRECT_MAPPING["output_layer.weight"] = "model.embed_tokens.weight"


def _shared_keys(bridge) -> list[str]:
    return ["model.embed_tokens.weight"] if getattr(bridge.hf_config, "tie_word_embeddings", False) else []


def _bridge_classes() -> dict[str, type]:
    """model_type -> fixed mbridge bridge class (imports mbridge lazily)."""
    from mbridge.core.safetensor_io import SafeTensorIO
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge
    from mbridge.models.llama import LLaMABridge
    from mbridge.models.qwen2 import Qwen2Bridge
    from mbridge.models.qwen3 import Qwen3Bridge
    from mbridge.models.qwen3moe import Qwen3MoEBridge
    from megatron.core.transformer import MLATransformerConfig

    class TiedMappingMixin:
        def _adjust_mapping_for_shared_weights(self):
            _per_instance_tied_mapping(self)

        def _get_hf_shared_weight_keys(self):
            return _shared_keys(self)

    class Llama(TiedMappingMixin, LLaMABridge):
        pass

    class Qwen2(TiedMappingMixin, Qwen2Bridge):
        pass

    class Qwen3(TiedMappingMixin, Qwen3Bridge):
        pass

    class Qwen3Moe(TiedMappingMixin, Qwen3MoEBridge):
        def _build_config(self):
            hf = self.hf_config
            if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
                raise ValueError("qwen3_moe: mlp_only_layers / decoder_sparse_step != 1 are not supported "
                                 f"(got {hf.mlp_only_layers!r}, {hf.decoder_sparse_step!r}); expected every "
                                 "layer to be MoE")
            self.extra_args.setdefault("moe_router_pre_softmax", not getattr(hf, "norm_topk_prob", True))
            return super()._build_config()

    def _mla_config(**kwargs):
        if "max_position_embeddings" in kwargs:   # F3
            kwargs["original_max_position_embeddings"] = kwargs.pop("max_position_embeddings")
        return MLATransformerConfig(**kwargs)

    class DeepseekV3(TiedMappingMixin, DeepseekV3Bridge):
        TransformerConfigClass = staticmethod(_mla_config)

        def _build_config(self):
            hf = self.hf_config
            if not getattr(hf, "rope_interleave", True):   # F7
                raise ValueError("deepseek_v3: rope_interleave=False is not supported (megatron MLA "
                                 "de-interleaves rope dims, matching HF rope_interleave=True)")
            if getattr(hf, "q_lora_rank", None) is None:
                raise ValueError("deepseek_v3: q_lora_rank=None is not supported by this bridge")
            self.extra_args.setdefault("moe_router_num_groups", hf.n_group)       # F5
            self.extra_args.setdefault("moe_router_group_topk", hf.topk_group)    # F5
            self.extra_args.setdefault("mtp_num_layers", None)                    # F6
            return super()._build_config()

        def _get_safetensor_io(self, weights_path: str):   # F4
            return SafeTensorIO(self._get_actual_hf_path(weights_path))

    return {"llama": Llama, "qwen2": Qwen2, "qwen3": Qwen3, "qwen3_moe": Qwen3Moe,
            "deepseek_v3": DeepseekV3}
