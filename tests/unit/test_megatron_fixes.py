"""megarl.compat.megatron_fixes: M1, the expert-bias token count under a padding mask."""
from types import SimpleNamespace

import torch

from megarl.compat import megatron_fixes


def test_m1_expert_bias_counts_only_real_tokens():
    megatron_fixes.apply()
    from megatron.core.transformer.moe.router import TopKRouter

    assert TopKRouter._apply_expert_bias is megatron_fixes._apply_expert_bias
    # 5 tokens routed to 2 of 3 experts each; tokens 3 and 4 are padding (True = padding, as
    # megarl's engine passes it and routing() flattens it to [tokens])
    routing_map = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    padding = torch.tensor([[False, False, False, True, True]])
    router = SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(3))
    megatron_fixes._apply_expert_bias(router, routing_map, padding.reshape(-1))
    assert router.local_tokens_per_expert.tolist() == [2.0, 2.0, 2.0]
    megatron_fixes._apply_expert_bias(router, routing_map, None)   # no mask: every token counts
    assert router.local_tokens_per_expert.tolist() == [5.0, 6.0, 5.0]
    with torch.no_grad():                                           # evaluation: nothing counted
        megatron_fixes._apply_expert_bias(router, routing_map, None)
    assert router.local_tokens_per_expert.tolist() == [5.0, 6.0, 5.0]
