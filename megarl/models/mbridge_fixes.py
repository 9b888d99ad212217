"""Fixes for mbridge 0.15.1 under transformers 5 and megatron-core 0.16.

megarl uses mbridge only to build the Megatron ``TransformerConfig`` and the TE layer spec (model
chunks) from an HF config; weights go through megarl's own mapping (:mod:`megarl.bridge.mapping`).
mbridge was written for transformers 4 and megatron-core <= 0.15. Each fix below is applied by a
subclass of the mbridge bridge (or a copy of the HF config), never by editing mbridge, and each is
asserted by a test (``tests/unit/test_engine_registry.py``; numerics in
``tests/distributed/test_engine_parity.py``):

F1  transformers 5 moved ``rope_theta`` (and rope scaling) into ``config.rope_parameters``;
    mbridge reads ``hf_config.rope_theta`` (AttributeError). :func:`hf_config_for_mbridge` copies
    the config and sets ``rope_theta`` from ``rope_parameters``; only ``rope_type == "default"``
    is accepted (other rope types would be silently ignored by mbridge's llama/qwen path).
F2  DeepSeek-V3: mbridge passes ``max_position_embeddings`` to ``MLATransformerConfig`` (renamed
    ``original_max_position_embeddings`` in megatron-core 0.16: TypeError).
F3  DeepSeek-V3: group-limited routing (HF ``n_group`` / ``topk_group``) is not mapped; without
    ``moe_router_num_groups`` / ``moe_router_group_topk`` the routing differs from HF
    (4.5e-2 logit gap measured).
F4  DeepSeek-V3: transformers 5 serialises ``num_nextn_predict_layers`` and mbridge then builds an
    MTP block whenever the key exists. MTP heads are not used for RL log-probs: megarl builds
    without MTP (``mtp_num_layers=None``).
F5  DeepSeek-V3: megatron's MLA always applies RoPE to de-interleaved rope dims, which equals HF
    only for ``rope_interleave=True``; False is rejected with a ValueError.
F6  Qwen3-MoE: mbridge hard-codes ``moe_router_pre_softmax=False`` (top-k then softmax, i.e.
    HF ``norm_topk_prob=True``); HF ``norm_topk_prob=False`` needs softmax-then-top-k. Mapped
    from the config; ``mlp_only_layers`` / ``decoder_sparse_step != 1`` are rejected.
F7  DeepSeek-V3/R1 use YaRN rope scaling (factor 40 over 4096 positions): transformers 5 keeps it
    in ``rope_parameters``; mbridge looks for ``"rope_scaling" in hf_config``, which is False
    under transformers 5, and then silently builds plain RoPE. The DeepSeek bridge hands
    rope_type, factor, mscale, mscale_all_dim, beta_fast/slow and the original context to
    megatron's MLA YaRN itself (other families still refuse any rope scaling, which mbridge's
    llama/qwen path would ignore).

The families without a fix (llama, qwen2, qwen3) use mbridge's classes as they are.
"""
from __future__ import annotations

import copy
import functools
from typing import Any


def hf_config_for_mbridge(hf_config: Any) -> Any:
    """A copy of ``hf_config`` with the transformers-4 fields mbridge reads (fix F1)."""
    cfg = copy.deepcopy(hf_config)
    params = getattr(cfg, "rope_parameters", None) or {}
    if params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "yarn" and cfg.model_type == "deepseek_v3":
            pass   # F7: handed to megatron's MLA YaRN by DeepseekV3FixedBridge
        elif rope_type != "default":
            raise ValueError(f"{cfg.model_type}: rope_parameters.rope_type={rope_type!r} is not supported "
                             "(expected 'default', or 'yarn' for deepseek_v3; mbridge's llama/qwen mapping "
                             "ignores rope scaling)")
    if getattr(cfg, "rope_theta", None) is None:
        if "rope_theta" not in params:
            raise ValueError(f"{cfg.model_type}: config has neither rope_theta nor rope_parameters.rope_theta")
        cfg.rope_theta = params["rope_theta"]
    if getattr(cfg, "rope_scaling", None) is not None and not params:
        raise ValueError(f"{cfg.model_type}: rope_scaling={cfg.rope_scaling!r} is not supported")
    return cfg


@functools.cache
def bridge_classes() -> dict[str, type]:
    """Class name -> mbridge bridge class, fixed where needed (the registry's ``Family.bridge``
    names one). mbridge and megatron-core are imported here, on first use, so that the registry
    stays importable without them."""
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge
    from mbridge.models.llama import LLaMABridge
    from mbridge.models.qwen2 import Qwen2Bridge
    from mbridge.models.qwen3 import Qwen3Bridge
    from mbridge.models.qwen3moe import Qwen3MoEBridge
    from megatron.core.transformer import MLATransformerConfig

    class Qwen3MoeBridge(Qwen3MoEBridge):
        def _build_config(self):
            hf = self.hf_config
            if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
                raise ValueError("qwen3_moe: mlp_only_layers / decoder_sparse_step != 1 are not supported "
                                 f"(got {hf.mlp_only_layers!r}, {hf.decoder_sparse_step!r}); expected every "
                                 "layer to be MoE")
            self.extra_args.setdefault("moe_router_pre_softmax", not getattr(hf, "norm_topk_prob", True))   # F6
            return super()._build_config()

    def _mla_config(**kwargs):
        if "max_position_embeddings" in kwargs:   # F2
            kwargs["original_max_position_embeddings"] = kwargs.pop("max_position_embeddings")
        return MLATransformerConfig(**kwargs)

    class DeepseekV3FixedBridge(DeepseekV3Bridge):
        TransformerConfigClass = staticmethod(_mla_config)

        def _build_config(self):
            hf = self.hf_config
            if not getattr(hf, "rope_interleave", True):   # F5
                raise ValueError("deepseek_v3: rope_interleave=False is not supported (megatron MLA "
                                 "de-interleaves rope dims, matching HF rope_interleave=True)")
            if getattr(hf, "q_lora_rank", None) is None:
                raise ValueError("deepseek_v3: q_lora_rank=None is not supported by this bridge")
            self.extra_args.setdefault("moe_router_num_groups", hf.n_group)       # F3
            self.extra_args.setdefault("moe_router_group_topk", hf.topk_group)    # F3
            self.extra_args.setdefault("mtp_num_layers", None)                    # F4
            rope = getattr(hf, "rope_parameters", None) or {}
            if rope.get("rope_type", rope.get("type")) == "yarn":                 # F7
                self.extra_args.update(
                    rope_type="yarn", rotary_scaling_factor=rope["factor"],
                    max_position_embeddings=rope.get("original_max_position_embeddings", 4096),
                    beta_fast=rope.get("beta_fast", 32), beta_slow=rope.get("beta_slow", 1),
                    mscale=rope.get("mscale", 1.0), mscale_all_dim=rope.get("mscale_all_dim", 0.0))
            return super()._build_config()

    return {cls.__name__: cls for cls in (LLaMABridge, Qwen2Bridge, Qwen3Bridge, Qwen3MoeBridge,
                                          DeepseekV3FixedBridge)}
