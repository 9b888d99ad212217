"""megarl.compat.vllm_cpu: the vLLM sites its fixes depend on still exist, the plugin is
registered, V1 rotates DeepSeek's strided MLA views exactly like vLLM's own torch implementation,
the V2/V3 repairs touch only what they should, and V4's pure parts (a step's token layout, the
per-request store, the sample format) place routing rows where they belong. V4 end to end (vLLM's
routing against transformers') is tests/e2e/test_vllm_parity.py."""
import importlib
import inspect
from importlib.metadata import entry_points

import numpy as np
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


# ---------------------------------------------------------------------------------------- V4


def test_step_layout_assigns_tokens_to_requests_and_positions():
    from megarl.compat.vllm_cpu import step_layout

    # request 0 decodes one token at position 7, request 1 prefills 3 from 0, request 2 resumes a
    # chunked prefill: 2 tokens from position 4; request 3 has nothing scheduled this step
    req_T, pos_T = step_layout([1, 3, 2, 0], [7, 0, 4, 9])
    assert req_T.tolist() == [0, 1, 1, 1, 2, 2]
    assert pos_T.tolist() == [7, 0, 1, 2, 4, 5]
    assert [a.tolist() for a in step_layout([], [])] == [[], []]
    with pytest.raises(ValueError, match="equally long"):
        step_layout([1, 2], [0])


def test_routing_store_writes_at_positions_and_hands_out_once():
    from megarl.compat.vllm_cpu import RoutingStore

    store = RoutingStore(keep_finished=2)
    rows = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)
    store.write("a", np.array([0, 1, 2]), rows)                    # prefill
    store.write("a", np.array([3]), rows[:1] + 100)               # a decode step
    store.write("a", np.array([1]), rows[2:3])                    # recompute overwrites
    got = store.take(["a", "unknown"])
    assert list(got) == ["a"] and got["a"].dtype == np.int16 and got["a"].shape == (4, 2, 2)
    assert np.array_equal(got["a"][[0, 2]], rows[[0, 2]]) and np.array_equal(got["a"][1], rows[2])
    assert np.array_equal(got["a"][3], rows[0] + 100)
    assert store.take(["a"]) == {} and len(store) == 0             # forgotten once fetched
    store.write("b", np.array([2]), rows[:1])                     # a gap: rows 0-1 were never computed
    assert (store.take(["b"])["b"][:2] == -1).all()
    for rid in "cdef":                                           # finished, never fetched: at most 2 kept
        store.write(rid, np.array([0]), rows[:1])
    store.write("running", np.array([0]), rows[:1])
    store.finish(["c", "d", "e", "f", "not-captured"])
    assert sorted(store.take(["c", "d", "e", "f", "running"])) == ["e", "f", "running"] and store.dropped == 2


def test_sample_routing_pads_with_minus_one_and_picks_moe_layers():
    from megarl.rollout.moe_routing import sample_routing

    raw = np.arange(4 * 3 * 2).reshape(4, 3, 2).astype(np.uint8)   # vLLM GPU: every decoder layer, tokens - 1 rows
    out = sample_routing(raw, 5, 2, 2, layers=[1, 2])
    assert out.dtype == np.int16 and out.shape == (5, 2, 2)
    assert np.array_equal(out[:4], raw[:, 1:].astype(np.int16)) and (out[4] == -1).all()
    assert (sample_routing(None, 3, 2, 2) == -1).all()            # nothing computed (aborted before prefill)
    assert sample_routing(raw[:, :2], 2, 2, 2).shape == (2, 2, 2)  # more rows than wanted: cut
    with pytest.raises(ValueError, match="expected"):
        sample_routing(raw, 5, 2, 2)


def test_cpu_router_hook_sees_deepseek_grouped_topk_ids():
    """The hook V4 binds (``BaseRouter.capture_fn``) receives exactly the ids ``CPURouter``
    routes with, for DeepSeek-V3's grouped top-k with the correction bias; written out below."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    g = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(5, 8, generator=g), torch.randn(8, generator=g) * 0.1
    router = CPURouter(top_k=2, global_num_experts=8, use_grouped_topk=True, num_expert_group=2, topk_group=1,
                       scoring_func="sigmoid", e_score_correction_bias=bias)
    seen = []
    router.set_capture_fn(seen.append)
    _, ids = router.select_experts(torch.zeros(5, 4), logits)
    assert len(seen) == 1 and torch.equal(seen[0], ids)
    choice = logits.sigmoid() + bias                               # transformers' DeepseekV3TopkRouter
    group = choice.view(5, 2, 4).topk(2, dim=-1)[0].sum(-1).argmax(-1)
    masked = choice.view(5, 2, 4).masked_fill(torch.arange(2)[None, :, None] != group[:, None, None], float("-inf"))
    expected = masked.view(5, 8).topk(2, dim=-1)[1]
    assert [set(r) for r in ids.tolist()] == [set(r) for r in expected.tolist()]


def test_capture_is_installed_but_idle_without_the_environment(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from megarl.compat import vllm_cpu

    vllm_cpu.apply()
    assert GPUModelRunner._model_forward.__megarl_patch__ == "V4"
    monkeypatch.delenv(vllm_cpu.CAPTURE_ENV, raising=False)
    assert not vllm_cpu.capturing()

    class Runner:
        _megarl_in_step = True
        model = staticmethod(lambda **kw: "out")

    assert GPUModelRunner._model_forward(Runner(), input_ids=None) == "out"   # straight through
    monkeypatch.setenv(vllm_cpu.CAPTURE_ENV, "1")
    assert vllm_cpu.capturing()


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-capture", "gpu-vllm-output"])
def test_routing_reader_attaches_rows_per_sample(monkeypatch, gpu):
    """Both fetch paths of :class:`RoutingReader` against fakes of what vLLM hands it: CPU, the
    worker extension's reply (rank 0 answers); GPU, ``CompletionOutput.routed_experts``
    ``[tokens - 1, decoder layers, K]`` with a dense layer 0 (DeepSeek-V3's layout)."""
    from types import SimpleNamespace

    import megarl.compat
    from megarl.rollout.moe_routing import RoutingReader
    from megarl.rollout.worker_ext import MOE_LAYOUT, TAKE_ROUTING

    monkeypatch.setattr(megarl.compat, "cuda_available", lambda: gpu)
    moe = np.arange(5 * 2 * 2, dtype=np.int16).reshape(5, 2, 2)          # 3 prompt + 2 computed response tokens

    class FakeLLM:
        def collective_rpc(self, method, args=()):
            if method == MOE_LAYOUT:
                return [{"layers": [1, 2], "top_k": 2}, {"layers": [1, 2], "top_k": 2}]
            assert method == TAKE_ROUTING and args == (["r-1"],)
            return [{"layers": 2, "top_k": 2, "rows": {"r-1": (moe.tobytes(), 5)}}, None]

    dense = np.full((5, 1, 2), 99, np.uint8)
    out = SimpleNamespace(routed_experts=np.concatenate([dense, moe.astype(np.uint8)], axis=1))
    done, partial = {"token_ids": [7, 8, 9]}, {"token_ids": [7]}
    RoutingReader(FakeLLM()).attach([("r-1", done, 3, out), (None, partial, 3, None)])
    assert done["routed_experts"].shape == (6, 2, 2) and done["routed_experts"].dtype == np.int16
    assert np.array_equal(done["routed_experts"][:5], moe) and (done["routed_experts"][5] == -1).all()
    assert partial["routed_experts"].shape == (4, 2, 2) and (partial["routed_experts"] == -1).all()
