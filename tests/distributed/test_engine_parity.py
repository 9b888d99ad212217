"""Megatron engine log-probs equal transformers' for every family and layout (gloo, fp32).

Three packed sequences of different lengths (13/21/9 tokens, THD, split in 2 micro-batches);
per family and layout the max |engine - HF| over the response tokens must be < 1e-4, and packed
(one row) must equal unpacked (one sequence per micro-batch) within 1e-5. The VPP layout runs on
a 4-layer variant of each tiny family built on the fly in a temp dir (the fixtures have 2
layers; pp=2 x vpp=2 needs 4); uneven pipeline stages (megatron's
num_layers_in_first/last_pipeline_stage, from topology.first_stage_layers / last_stage_layers)
on a 3-layer variant of llama and DeepSeek-V3 at pp=2 with 1 layer on the first stage, then on
the last (the stages' layers are checked too: DeepSeek's dense layer 0 alone, then with MoE layer 1;
measured: llama 8.6e-7, DeepSeek-V3 8.9e-6 at both splits). The weights are loaded through megarl's family mapping
(megarl.policy.export.fill_from_hf; tied embeddings: SmolLM2). mbridge fixes exercised here (see
megarl.models.mbridge_fixes): F1 rope_theta from rope_parameters (every family), F2-F5 DeepSeek (MLA
config rename, group-limited routing, no MTP, rope_interleave), F6 Qwen3-MoE router normalisation, F7
DeepSeek-V3's YaRN rope scaling (the tiny fixture keeps the real model's: factor 40, mscale 1). Measured: HF diffs 2e-6..1e-5 (SmolLM2 1.4e-5); packed vs unpacked <= 6.7e-6 (SmolLM2 2.5e-5).
"""
import functools

import pytest

from launch import run_workers

pytestmark = pytest.mark.distributed
TOL_HF = 1e-4
TOL_PACKED = 1e-5
FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]
MOE = {"qwen3_moe", "deepseek_v3"}
UNEVEN_FAMILIES = ["llama", "deepseek_v3"]
# 3 layers at pp=2: global decoder layers each stage builds
UNEVEN = {"pp2.first1": [[0], [1, 2]], "pp2.last1": [[0, 1], [2]]}


def _check(result: dict, expected: list[str]):
    missing = [k for k in expected if k not in result]
    assert not missing, f"layouts that did not report: {missing}"
    for key, value in result.items():
        if "|" not in key or key.endswith(("|seconds", "|stages")):
            continue
        tol = TOL_PACKED if "|packed_vs_unpacked|" in key else TOL_HF
        if key.startswith("smollm2|packed_vs_unpacked"):
            # 30 layers of real weights, log-probs ~ -10..-20 on random tokens: fp32 GEMM
            # blocking depends on the row count (43 packed vs 9-21 single rows); measured
            # 2.5e-5 absolute = 2e-6 relative. The tiny families hold 1e-5.
            tol = 1e-4
        assert value < tol, (key, value)


@functools.cache
def two_process_launch() -> dict:
    """The one 2-process launch of this file, tests/distributed/test_critic.py,
    tests/distributed/test_compat_parity.py and tests/distributed/test_posttrain_engine.py (they
    import this function; it runs once per session, for whichever file asks first):
    {"parity": ..., "critic": ..., "compat": ..., "posttrain": ...}."""
    # layouts (tp, pp, ep): (1,1,1) [dp=2], (2,1,1), (1,2,1), cp=2; MoE: (1,1,2), (2,1,2) with
    # etp=1 and (1,1,1) with etp=2; VPP: pp=2 x vpp=2 on 4 layers; uneven stages on 3 layers.
    return run_workers("engine_parity.py", 2, ",".join(FAMILIES + ["smollm2"]), "-,tp2,pp2,cp2",
                       "ep2,tp2.ep2.etp1,etp2", "pp2.vpp2", ",".join(UNEVEN), ",".join(UNEVEN_FAMILIES),
                       "--with-critic-and-compat", timeout=1200)


@pytest.fixture(scope="module")
def two_procs():
    return two_process_launch()["parity"]


def test_parity_two_processes(two_procs):
    expected = []
    for f in FAMILIES:
        layouts = ["tp1", "tp2", "pp2", "cp2"] + (["ep2", "tp2.ep2.etp1", "etp2"] if f in MOE else [])
        expected += [f"tiny-{f}|{s}" for s in layouts] + [f"tiny-{f}|packed_vs_unpacked|tp1", f"tiny-{f}-4l|pp2.vpp2"]
        expected += [f"tiny-{f}-3l|{s}" for s in UNEVEN] if f in UNEVEN_FAMILIES else []
    expected += ["smollm2|tp1", "smollm2|packed_vs_unpacked|tp1"]
    _check(two_procs, expected)
# Four processes, (tp, pp, ep) = (2, 2, 1) for every family and (2, 1, 2) for the MoE ones: the
# conversion launch (tests/distributed/test_conversion.py) checks the engine's log-probs there against
# transformers (< 1e-4) in ``verify``.


@pytest.mark.parametrize("family", UNEVEN_FAMILIES)
def test_uneven_stages_build_megatrons_split(two_procs, family):
    for spec, stages in UNEVEN.items():
        assert two_procs[f"tiny-{family}-3l|{spec}|stages"] == stages, spec
