"""Read boxes of tensors out of HF safetensors files without mapping whole files.

An HF folder holds ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
:class:`HFCheckpoint` reads only the headers up front (name -> file, dtype, shape, byte range);
:meth:`HFCheckpoint.read` then reads one box (a ``(start, stop)`` per dim) of one tensor with
plain ``readinto`` calls: the rows of the box (dim 0) are one contiguous byte range, read into a
fresh buffer and sliced on the other dims. No mmap is used, so the resident memory of a process
is its own shard plus at most one tensor's row range (safetensors' ``safe_open`` maps the file
and the pages it touches count as resident memory).

DeepSeek-V3 FP8 checkpoints store ``W`` as float8_e4m3fn with ``W_scale_inv`` of shape
``[ceil(rows/128), ceil(cols/128)]``; :meth:`HFCheckpoint.read` dequantises such boxes on the fly
(:func:`megarl.models.fp8.dequantize_fp8_blocks`) to ``dequant_dtype``.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from megarl.models.fp8 import dequantize_fp8_blocks

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: torch.dtype
    shape: tuple
    offset: int
    """Absolute byte offset of the tensor's data in ``file``."""


def read_header(path: str) -> dict[str, TensorInfo]:
    """Tensor name -> :class:`TensorInfo` for one safetensors file (reads the header only)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"safetensors file {path!r} does not exist")
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path!r} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{path!r}: tensor {name!r} has unsupported dtype {meta['dtype']!r}")
        out[name] = TensorInfo(path, _DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + n + meta["data_offsets"][0])
    return out


class HFCheckpoint:
    """The tensors of an HF folder (headers only until :meth:`read`)."""

    def __init__(self, folder: str, dequant_dtype: torch.dtype = torch.bfloat16):
        self.folder, self.dequant_dtype = folder, dequant_dtype
        index = os.path.join(folder, INDEX_NAME)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [fn for fn in files if not os.path.exists(os.path.join(folder, fn))]
            if missing:
                raise FileNotFoundError(f"{folder}: shard file(s) listed in {INDEX_NAME} are missing: "
                                        f"{', '.join(missing)}")
        elif os.path.exists(os.path.join(folder, SINGLE_NAME)):
            files = [SINGLE_NAME]
        else:
            raise FileNotFoundError(f"{folder}: neither {INDEX_NAME} nor {SINGLE_NAME} exists")
        self.tensors: dict[str, TensorInfo] = {}
        for fn in files:
            self.tensors.update(read_header(os.path.join(folder, fn)))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise KeyError(f"{self.folder}: tensor {name!r} is not in the checkpoint")
        return self.tensors[name]

    def is_fp8(self, name: str) -> bool:
        return self.info(name).dtype in FP8_DTYPES

    def logical_dtype(self, name: str) -> torch.dtype:
        """The dtype :meth:`read` returns for ``name`` (FP8 is dequantised)."""
        dtype = self.info(name).dtype
        return self.dequant_dtype if dtype in FP8_DTYPES else dtype

    def read_raw(self, name: str, box=None) -> torch.Tensor:
        """``tensor[box]`` as stored (``box`` None: the whole tensor)."""
        info = self.info(name)
        shape = info.shape
        box = tuple((0, s) for s in shape) if box is None else tuple(box)
        if not shape:
            r0, r1, rest = 0, 1, ()
        else:
            (r0, r1), rest = box[0], box[1:]
        row_elems = 1
        for s in shape[1:]:
            row_elems *= s
        itemsize = torch.empty((), dtype=info.dtype).element_size()
        nbytes = (r1 - r0) * row_elems * itemsize
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with open(info.file, "rb") as f:
            f.seek(info.offset + r0 * row_elems * itemsize)
            got = f.readinto(buf.numpy())
        if got != nbytes:
            raise ValueError(f"{info.file}: tensor {name!r} is truncated (read {got} of {nbytes} bytes)")
        rows = buf.view(info.dtype).reshape((r1 - r0,) + tuple(shape[1:]) if shape else ())
        if not rest or all(a == 0 and b == s for (a, b), s in zip(rest, shape[1:])):
            return rows
        return rows[(slice(None),) + tuple(slice(a, b) for a, b in rest)].clone()

    def read(self, name: str, box=None) -> torch.Tensor:
        """``tensor[box]``; FP8 block-quantised weights are dequantised with their ``_scale_inv``."""
        if not self.is_fp8(name):
            return self.read_raw(name, box)
        shape = self.info(name).shape
        box = tuple((0, s) for s in shape) if box is None else tuple(box)
        scale_name = name + "_scale_inv"
        if scale_name not in self.tensors:
            raise KeyError(f"{self.folder}: FP8 tensor {name!r} has no {scale_name!r}")
        block = 128
        (r0, r1), (c0, c1) = box
        scale_box = ((r0 // block, -(-r1 // block)), (c0 // block, -(-c1 // block)))
        scale = self.read_raw(scale_name, scale_box)
        return dequantize_fp8_blocks(self.read_raw(name, box), scale, block=block, row_offset=r0 % block,
                                     col_offset=c0 % block, dtype=self.dequant_dtype)
