"""FP8 block dequantisation and box reads of safetensors files (no processes)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.models.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from megarl.models.safetensors_io import HFCheckpoint


def test_dequant_matches_reference_loop():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * 3
    q, scale_inv = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    got = dequantize_fp8_blocks(q, scale_inv, dtype=torch.float32)
    ref = torch.empty_like(w)
    for i in range(300):
        for j in range(0, 200, 64):
            ref[i, j:j + 64] = q[i, j:j + 64].float() * scale_inv[i // 128, j // 128]
    assert torch.equal(got, ref)
    assert (got - w).abs().max() / w.abs().max() < 0.07   # e4m3: 3 mantissa bits


def test_dequant_box_equals_slice_of_full():
    g = torch.Generator().manual_seed(1)
    q, scale_inv = quantize_fp8_blocks(torch.randn(384, 256, generator=g))
    full = dequantize_fp8_blocks(q, scale_inv, dtype=torch.float32)
    r0, r1, c0, c1 = 100, 300, 130, 256
    box = dequantize_fp8_blocks(q[r0:r1, c0:c1], scale_inv[r0 // 128:-(-r1 // 128), c0 // 128:-(-c1 // 128)],
                                row_offset=r0 % 128, col_offset=c0 % 128, dtype=torch.float32)
    assert torch.equal(box, full[r0:r1, c0:c1])


def test_dequant_rejects_wrong_scale_shape():
    q, scale_inv = quantize_fp8_blocks(torch.randn(256, 256))
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_fp8_blocks(q, scale_inv[:1])


def test_reader_boxes_and_fp8(tmp_path):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(260, 140, generator=g)
    q, scale_inv = quantize_fp8_blocks(w)
    tensors = {"a.weight": w, "b.weight": q, "b.weight_scale_inv": scale_inv,
               "c": torch.arange(24, dtype=torch.int64).reshape(2, 3, 4), "bf": w.to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    r = HFCheckpoint(str(tmp_path), dequant_dtype=torch.float32)
    assert torch.equal(r.read("a.weight", ((5, 77), (10, 130))), w[5:77, 10:130])
    assert torch.equal(r.read("c", ((1, 2), (0, 3), (1, 3))), tensors["c"][1:2, :, 1:3])
    assert torch.equal(r.read("bf"), tensors["bf"])
    full = dequantize_fp8_blocks(q, scale_inv, dtype=torch.float32)
    assert r.is_fp8("b.weight") and r.logical_dtype("b.weight") == torch.float32
    assert torch.equal(r.read("b.weight", ((129, 260), (3, 140))), full[129:260, 3:140])
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["c"], r.read("c"))


def test_reader_names_missing_shard(tmp_path):
    save_file({"x": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        HFCheckpoint(str(tmp_path))
