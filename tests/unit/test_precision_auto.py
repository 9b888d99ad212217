"""model.dtype: auto: the rule on faked CPU flag sets and probe results, and its resolution at load
(a concrete dtype in the resolved config, the alarm bound of that dtype, the reason remembered
for the run's precision line)."""
import pytest

from megarl.precision import BF16_MIN_SPEEDUP, choose_dtype


def never():
    raise AssertionError("an AVX2-only CPU (or a GPU) must not be probed")


@pytest.mark.parametrize("gpu, flags, probe, expected", [
    (True, set(), never, "bfloat16"),                                    # GPU: bf16
    (False, {"avx2"}, never, "float32"),                                 # AVX2-only EPYC: fp32, no probe
    (False, {"avx2", "avx512f"}, never, "float32"),                      # AVX-512 without bf16
    (False, {"avx512f", "avx512_bf16"}, lambda: (64.0, 300.0), "bfloat16"),   # the native-bf16 CPU
    (False, {"amx_bf16", "amx_tile"}, lambda: (60.0, 900.0), "bfloat16"),
    (False, {"avx512_bf16"}, lambda: (100.0, 100.0 * BF16_MIN_SPEEDUP - 1), "float32"),   # flags, but not faster
])
def test_auto_rule(gpu, flags, probe, expected):
    dtype, reason = choose_dtype(gpu, flags, probe)
    assert dtype == expected and reason
    if expected == "float32" and flags & {"avx512_bf16", "amx_bf16"}:
        assert "GFLOP/s" in reason


def test_auto_resolves_at_load_on_this_machine(monkeypatch):
    from megarl import precision
    from megarl.config import load_config
    from megarl.config.schema import LOGPROB_DIFF_THRESHOLDS

    flags = precision.cpu_flags()[1]
    cfg = load_config(None, ["model.dtype=auto"])
    assert cfg.model.dtype in ("float32", "bfloat16")
    assert cfg.trainer.logprob_diff_threshold == LOGPROB_DIFF_THRESHOLDS[cfg.model.dtype]
    if not flags & {"avx512_bf16", "amx_bf16"}:   # this machine (AVX2 EPYC) and CI's: float32
        assert cfg.model.dtype == "float32"
    print(precision.auto_reason())
    assert precision.auto_reason().startswith(f"model.dtype auto -> {cfg.model.dtype} (")
    # a faked native-bf16 CPU whose probe says bf16 is 4x faster resolves to bfloat16, alarm 0.1
    monkeypatch.setattr(precision, "cpu_flags", lambda: ("fake", {"avx512_bf16"}))
    monkeypatch.setattr(precision, "matmul_gflops", lambda name: 300.0 if name == "bfloat16" else 75.0)
    cfg = load_config(None, ["model.dtype=auto"])
    assert cfg.model.dtype == "bfloat16" and cfg.trainer.logprob_diff_threshold == LOGPROB_DIFF_THRESHOLDS["bfloat16"]
    assert "bf16 300 vs fp32 75 GFLOP/s" in precision.auto_reason()


def test_cpu_line_names_the_model_cores_and_flags(monkeypatch):
    """What every benchmark prints beside its numbers (perf/bench_*.py)."""
    from megarl import precision

    monkeypatch.setattr(precision, "cpu_flags", lambda: ("Some CPU", {"avx512_bf16", "avx2"}))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert precision.cpu_line() == "Some CPU, 2 cores, flags: avx2 avx512_bf16"
    monkeypatch.setattr(precision, "cpu_flags", lambda: ("Other", set()))
    assert precision.cpu_line().endswith("flags: none of avx2/avx512f/avx512_bf16/amx_bf16/amx_tile")
