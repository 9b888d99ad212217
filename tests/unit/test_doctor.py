"""megarl doctor on this machine: no crash, every component named with a status, and the CPU
flag reading on faked /proc/cpuinfo files."""
import io

from megarl.doctor import CPU_FLAGS, checks, cpu_flags, main

COMPONENTS = ["python", "megarl", "torch", "megatron-core", "mbridge", "vllm", "ray", "transformers", "nvidia-ml-py",
              "transformer-engine", "apex", "cpu", "cpu matmul", "slurm", "munge", "sandbox", "disk: cache",
              "disk: runs", "fixtures"]


def test_doctor_names_every_component_on_this_machine(tmp_path):
    out = io.StringIO()
    code = main(probe=True, run_dir=tmp_path / "runs", stream=out)
    lines = out.getvalue().splitlines()
    names = [c.name for c in checks(probe=False, run_dir=tmp_path)]
    for component in COMPONENTS:
        assert any(line.split(maxsplit=1)[1].startswith(component) for line in lines[:-1]), (component, lines)
    assert all(line.split()[0] in ("ok", "warning", "missing") for line in lines[:-1])
    assert any(n.startswith("gpu") for n in names)
    assert lines[-1].startswith("megarl doctor: ") and code == 0   # the test environment has what megarl needs
    matmul = next(line for line in lines if line.split(maxsplit=1)[1].startswith("cpu matmul"))
    assert "float32" in matmul and "GFLOP/s" in matmul


def test_cpu_flags_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16\n")
    model, flags = cpu_flags(str(info))
    assert flags == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"} and set(flags) <= set(CPU_FLAGS)
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2\n")
    assert cpu_flags(str(info))[1] == {"avx2"}
    assert cpu_flags(str(tmp_path / "missing"))[1] == set()
