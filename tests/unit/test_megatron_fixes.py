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


def test_m3_frozen_linear_input_gradient_equals_autograd_and_folds_the_rows():
    """LinearWithFrozenWeight's input gradient, for a 3-D input and a non-contiguous output gradient
    (what the frozen output layer of a LoRA policy gets), equals autograd's through F.linear."""
    import torch
    import torch.nn.functional as F

    from megarl.compat import megatron_fixes
    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight

    megatron_fixes.apply()
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=g)
    x = torch.randn(6, 1, 8, generator=g, requires_grad=True)
    upstream = torch.randn(1, 6, 50, generator=g).transpose(0, 1)   # [6, 1, 50], not contiguous
    LinearWithFrozenWeight.apply(x, weight, None, False, None).backward(upstream)
    ours = x.grad.clone()
    x.grad = None
    F.linear(x, weight).backward(upstream)
    assert ours.shape == (6, 1, 8)
    torch.testing.assert_close(ours, x.grad, rtol=1e-6, atol=1e-6)
