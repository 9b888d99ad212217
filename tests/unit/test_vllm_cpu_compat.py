"""megarl.compat.vllm_cpu: the vLLM sites its fixes depend on still exist, the plugin is
registered, V1 rotates DeepSeek's strided MLA views exactly like vLLM's own torch implementation,
and the V2/V3 repairs touch only what they should."""
import importlib
import inspect
from importlib.metadata import entry_points

import pytest
import torch

from megarl.compat.vllm_cpu import SITES

pytestmark = pytest.mark.vllm
T, H, NOPE, ROPE, LORA = 6, 8, 32, 64, 512


@pytest.mark.parametrize("site", SITES, ids=[f"{s.patch}:{s.attr}" for s in SITES])
def test_patched_site_still_upstream(site):
    obj = importlib.import_module(site.module)
    for part in site.attr.split("."):
        assert hasattr(obj, part), f"{site.patch}: {site.module}.{site.attr} is gone; revisit megarl/compat/vllm_cpu.py"
        obj = getattr(obj, part)
    assert site.needle in inspect.getsource(obj), (
        f"{site.patch}: {site.module}.{site.attr} no longer contains {site.needle!r}: the upstream bug may be "
        "fixed or moved; revisit megarl/compat/vllm_cpu.py")


def test_registered_as_vllm_general_plugin():
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("megarl_vllm_cpu") == "megarl.compat.vllm_cpu:apply"


def reference_gptj(x, positions):
    """GPT-J (interleaved pairs) rotation, theta 10000, written out."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    ang = positions[:, None].double() * inv[None]
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [ROPE // 2]
    c, s = ang.cos().view(shape), ang.sin().view(shape)
    xd = x.double()
    out = torch.empty_like(xd)
    out[..., 0::2] = xd[..., 0::2] * c - xd[..., 1::2] * s
    out[..., 1::2] = xd[..., 1::2] * c + xd[..., 0::2] * s
    return out.float()


@pytest.fixture(scope="module")
def rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from megarl.compat import vllm_cpu

    vllm_cpu.apply()
    with set_current_vllm_config(VllmConfig()):
        yield get_rope(ROPE, max_position=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       is_neox_style=False)


def test_mla_strided_views_are_rotated_and_nothing_else_is_touched(rope):
    # the exact call of vllm/model_executor/layers/mla.py: q[..., nope:] and k_pe sliced from the latent
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(T, H, NOPE + ROPE, generator=g), torch.randn(T, LORA + ROPE, generator=g)
    q0, kv0 = q.clone(), kv.clone()
    positions = torch.arange(T)
    k_pe = kv[:, LORA:].unsqueeze(1)
    q[..., NOPE:], k_out = rope.forward_cpu(positions, q[..., NOPE:], k_pe)
    assert torch.allclose(q[..., NOPE:], reference_gptj(q0[..., NOPE:], positions), atol=1e-5)
    assert torch.allclose(k_out, reference_gptj(kv0[:, LORA:].unsqueeze(1), positions), atol=1e-5)
    assert torch.equal(q[..., :NOPE], q0[..., :NOPE])          # the no-rope part of q
    assert torch.equal(kv[:, :LORA], kv0[:, :LORA])            # the compressed KV latent


def test_contiguous_2d_calls_keep_the_kernel(rope):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(T, H * ROPE, generator=g), torch.randn(T, ROPE, generator=g)
    positions = torch.arange(T)
    q_out, k_out = rope.forward_cpu(positions, q.clone(), k.clone())
    assert torch.allclose(q_out.view(T, H, ROPE), reference_gptj(q.view(T, H, ROPE), positions), atol=1e-5)
    assert torch.allclose(k_out, reference_gptj(k.view(T, 1, ROPE), positions).view(T, ROPE), atol=1e-5)


class _Module(torch.nn.Module):
    pass


def test_refresh_tied_lm_head_only_when_tied():
    from megarl.compat.vllm_cpu import refresh_tied_lm_head

    calls = []

    class Method:
        def process_weights_after_loading(self, layer):
            calls.append(layer)

    model, model.model, model.lm_head = _Module(), _Module(), _Module()
    model.model.embed_tokens = _Module()
    model.model.embed_tokens.weight = torch.nn.Parameter(torch.ones(4, 2))
    model.lm_head.quant_method = Method()
    model.lm_head.weight = torch.nn.Parameter(torch.ones(4, 2))      # untied: a weight of its own
    assert refresh_tied_lm_head(model) is False and not calls
    model.lm_head.weight = model.model.embed_tokens.weight            # tied
    assert refresh_tied_lm_head(model) is True and calls == [model.lm_head]


def test_repack_cpu_moe_packs_only_the_layers_loaded():
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    from megarl.compat.vllm_cpu import repack_cpu_moe

    def moe_layer(seed):
        layer, experts = _Module(), _Module()
        experts.quant_method, experts.quant_method.moe_kernel = _Module(), _Module()
        experts.quant_method.moe_kernel.fused_experts = object.__new__(CPUUnquantizedExperts)   # isa "vec"
        g = torch.Generator().manual_seed(seed)
        experts.w13_weight = torch.nn.Parameter(torch.randn(4, 64, 32, generator=g), requires_grad=False)
        experts.w2_weight = torch.nn.Parameter(torch.randn(4, 32, 32, generator=g), requires_grad=False)
        layer.mlp = _Module()
        layer.mlp.experts = experts
        return layer

    model = _Module()
    model.model = _Module()
    model.model.layers = torch.nn.ModuleList([moe_layer(0), moe_layer(1)])
    before = [{n: getattr(layer.mlp.experts, n).clone() for n in ("w13_weight", "w2_weight")}
              for layer in model.model.layers]
    assert repack_cpu_moe(model, {1}) == 1
    for n, w in before[0].items():          # layer 0 was not loaded: untouched (else packed twice)
        assert torch.equal(getattr(model.model.layers[0].mlp.experts, n), w)
    for n, w in before[1].items():
        assert torch.equal(getattr(model.model.layers[1].mlp.experts, n), ops.cpu_prepack_moe_weight(w, "vec"))
