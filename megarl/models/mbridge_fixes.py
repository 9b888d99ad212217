"""Fixes for mbridge 0.15.1 (written for transformers 4, megatron-core <= 0.15) under
transformers 5 and megatron-core 0.16.

megarl uses mbridge only to build the ``TransformerConfig`` and TE layer spec from an HF config;
weights go through :mod:`megarl.bridge.mapping`. Each fix is a subclass of the mbridge bridge (or
a copy of the HF config), never an edit of mbridge, and is asserted by
``tests/unit/test_engine_registry.py`` (numerics: ``tests/distributed/test_engine_parity.py``):

F1  ``rope_theta`` is read from transformers 5's ``rope_parameters``; only ``rope_type="default"``.
F2  DeepSeek-V3: ``max_position_embeddings`` is ``original_max_position_embeddings`` for MLA.
F3  DeepSeek-V3: group-limited routing (``n_group`` / ``topk_group``) is mapped (else a 4.5e-2 logit gap).
F4  DeepSeek-V3: built without MTP (``mtp_num_layers=None``): RL log-probs do not use it.
F5  DeepSeek-V3: ``rope_interleave=False`` is rejected (megatron's MLA equals HF only for True).
F6  Qwen3-MoE: ``moe_router_pre_softmax`` from ``norm_topk_prob``; ``mlp_only_layers`` rejected.
F7  DeepSeek-V3/R1 YaRN rope scaling is handed to megatron's MLA YaRN (mbridge misses it under
    transformers 5 and silently builds plain RoPE); other families refuse any rope scaling.
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
