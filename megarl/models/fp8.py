"""DeepSeek-V3 FP8 block dequantisation.

The FP8 checkpoint stores each linear weight ``W`` [rows, cols] as float8_e4m3fn and a float32
``weight_scale_inv`` [ceil(rows/B), ceil(cols/B)] (B = 128): ``W_real[i, j] = W[i, j] *
scale_inv[i // B, j // B]``. A box of ``W`` starting at (r0, c0) is dequantised with the scale
rows/cols from ``r0 // B`` / ``c0 // B`` on; ``row_offset = r0 % B`` / ``col_offset = c0 % B`` say
where the box starts inside its first block. Shape legend: R, C rows / cols of the (box of the) weight.
"""
from __future__ import annotations

import torch


def dequantize_fp8_blocks(w_RC: torch.Tensor, scale_inv: torch.Tensor, block: int = 128, row_offset: int = 0,
                          col_offset: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantise a 2-D FP8 weight (or a box of one) with its per-block inverse scales."""
    if w_RC.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"FP8 dequantisation expects 2-D weight and scale, got {tuple(w_RC.shape)} and "
                         f"{tuple(scale_inv.shape)}")
    rows, cols = w_RC.shape
    need = (-(-(row_offset + rows) // block), -(-(col_offset + cols) // block))
    if tuple(scale_inv.shape) != need:
        raise ValueError(f"FP8 scale_inv shape {tuple(scale_inv.shape)} does not cover a {rows}x{cols} weight box "
                         f"at offset ({row_offset}, {col_offset}) with {block}x{block} blocks (expected {need})")
    scale_RC = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    scale_RC = scale_RC[row_offset:row_offset + rows, col_offset:col_offset + cols]
    return (w_RC.float() * scale_RC).to(dtype)


def quantize_fp8_blocks(w_RC: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse (for tests and synthetic checkpoints): per-block amax scaling to float8_e4m3fn."""
    rows, cols = w_RC.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(nr * block, nc * block, dtype=torch.float32)
    padded[:rows, :cols] = w_RC.float()
    blocks = padded.reshape(nr, block, nc, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn).reshape(nr * block, nc * block)
    return q[:rows, :cols].contiguous(), scale_inv
