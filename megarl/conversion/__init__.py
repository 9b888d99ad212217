"""HF <-> Megatron distributed-checkpoint conversion (streaming: each process reads its shard only).

CLIs: ``conversion/hf_to_megatron.py``, ``conversion/megatron_to_hf.py``, ``conversion/verify.py``.
"""
from megarl.conversion.convert import hf_to_megatron, init_distributed, megatron_to_hf, peak_memory
from megarl.conversion.megatron_ckpt import build_model_from_checkpoint, load_megatron_checkpoint, read_meta
from megarl.conversion.verify import VerifyResult, verify
from megarl.models.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from megarl.models.safetensors_io import HFCheckpoint

__all__ = ["HFCheckpoint", "VerifyResult", "build_model_from_checkpoint", "dequantize_fp8_blocks", "hf_to_megatron",
           "init_distributed", "load_megatron_checkpoint", "megatron_to_hf", "peak_memory", "quantize_fp8_blocks",
           "read_meta", "verify"]
