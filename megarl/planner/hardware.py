"""Per-GPU hardware numbers the planner's roofline uses, each with the datasheet it comes from.

Every figure is *per GPU* and is the vendor's peak: dense (not 2:4 sparse) bf16 tensor-core
TFLOPS, HBM capacity and bandwidth, NVLink bandwidth (both directions together, as NVIDIA quotes
it), scale-out network bandwidth per GPU (one direction: a 400 Gb/s NIC per GPU is 50 GB/s each
way) and host-device bandwidth (one direction). Achieved fractions of these peaks are not here:
they are efficiencies, which the planner takes from published measurements and states next to
the number it prints (:mod:`megarl.planner.roofline`).

``hbm_gib`` is the memory a process can allocate as the driver reports it (``nvidia-smi``'s
total), not the marketing capacity in decimal GB: 80 GB of HBM3 on H100 is reported as
81,559 MiB. Where only the datasheet's figure is known it is converted with 1 GB = 10^9 bytes,
which errs on the small side (said in ``hbm_source``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model's peak numbers (per GPU)."""

    name: str
    bf16_tflops: float
    """Dense bf16 tensor-core peak, TFLOPS (10^12 FLOP/s)."""
    hbm_gib: float
    """Device memory a process can use, GiB (see the module docstring)."""
    hbm_tbps: float
    """HBM bandwidth, TB/s (10^12 B/s)."""
    nvlink_gbps: float
    """NVLink bandwidth per GPU, GB/s, both directions together (NVIDIA's figure); one
    direction is half of it."""
    internode_gbps: float
    """Scale-out network per GPU, GB/s, one direction (e.g. one 400 Gb/s NIC per GPU = 50)."""
    host_gbps: float
    """Host <-> device bandwidth, GB/s, one direction (PCIe Gen5 x16: 64; GB200: NVLink-C2C)."""
    gpus_per_node: int
    """GPUs per host (node) of the usual system: DGX/HGX 8; a GB200 NVL72 compute tray 4."""
    nvlink_domain: int
    """GPUs one NVLink fabric connects (DGX/HGX: the node's 8; GB200 NVL72: 72 across 18 trays)."""
    host_gib: float
    """Host (CPU) memory per node of the usual system, GiB (vendor TB = 10^12 bytes)."""
    source: str
    """Where the numbers come from."""
    hbm_source: str = ""
    key: str = ""
    """The name recipes use (``cluster.gpu``)."""

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * GIB)

    @property
    def nvlink_unidir_bytes_per_s(self) -> float:
        return self.nvlink_gbps / 2 * 1e9

    @property
    def internode_bytes_per_s(self) -> float:
        return self.internode_gbps * 1e9


_H100_DS = ("NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): BF16 1,979 TFLOPS with sparsity "
            "(989 dense), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions); "
            "DGX H100 user guide: 8x ConnectX-7 400 Gb/s InfiniBand, one per GPU, 2 TB system memory")
_H200_DS = ("NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): BF16 1,979 TFLOPS with sparsity "
            "(989 dense), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s; "
            "DGX H200: 8x ConnectX-7 400 Gb/s, one per GPU, 2 TB system memory")
_H20_DS = ("NVIDIA H20 product brief (HGX H20): BF16 148 TFLOPS dense (296 with sparsity), 96 GB HBM3 at "
           "4.0 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s; scale-out assumed one 400 Gb/s NIC per GPU "
           "and 2 TB host memory as on DGX H100 (H20 systems vary: not vendor figures)")
_GB200_DS = ("NVIDIA GB200 NVL72 datasheet: 72 Blackwell GPUs, FP16/BF16 360 PFLOPS with sparsity "
             "(180 dense = 2.5 PFLOPS dense per GPU), up to 13.4 TB HBM3e at 576 TB/s "
             "(186 GB, 8 TB/s per GPU), fifth-generation NVLink 130 TB/s (1.8 TB/s per GPU), "
             "NVLink-C2C 900 GB/s CPU<->GPU per Grace-Blackwell superchip, both directions, two GPUs "
             "share it (225 GB/s one way per GPU); "
             "compute tray: 2 superchips (4 GPUs), each Grace with up to 480 GB LPDDR5X, one ConnectX-7 "
             "400 Gb/s per GPU")

GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("NVIDIA H100 SXM5 80GB", bf16_tflops=989.0, hbm_gib=79.6, hbm_tbps=3.35, nvlink_gbps=900.0,
                    internode_gbps=50.0, host_gbps=64.0, gpus_per_node=8, nvlink_domain=8, host_gib=2e12 / GIB,
                    source=_H100_DS,
                    hbm_source="nvidia-smi reports 81,559 MiB total on H100 SXM5 80GB"),
    "h200": GPUSpec("NVIDIA H200 SXM 141GB", bf16_tflops=989.0, hbm_gib=140.4, hbm_tbps=4.8, nvlink_gbps=900.0,
                    internode_gbps=50.0, host_gbps=64.0, gpus_per_node=8, nvlink_domain=8, host_gib=2e12 / GIB,
                    source=_H200_DS,
                    hbm_source="nvidia-smi reports 143,771 MiB total on H200 SXM"),
    "h20": GPUSpec("NVIDIA H20 96GB", bf16_tflops=148.0, hbm_gib=95.6, hbm_tbps=4.0, nvlink_gbps=900.0,
                   internode_gbps=50.0, host_gbps=64.0, gpus_per_node=8, nvlink_domain=8, host_gib=2e12 / GIB,
                   source=_H20_DS,
                   hbm_source="nvidia-smi reports 97,871 MiB total on H20"),
    "gb200": GPUSpec("NVIDIA GB200 (Blackwell GPU of a GB200 NVL72)", bf16_tflops=2500.0, hbm_gib=186e9 / GIB,
                     hbm_tbps=8.0, nvlink_gbps=1800.0, internode_gbps=50.0, host_gbps=225.0, gpus_per_node=4,
                     nvlink_domain=72, host_gib=2 * 480e9 / GIB,
                     source=_GB200_DS,
                     hbm_source="datasheet 186 GB per GPU taken as 10^9-byte GB (173.2 GiB; errs small)"),
}


def get_gpu(name: str) -> GPUSpec:
    """The spec of GPU ``name`` (a key of :data:`GPUS`)."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU type {name!r}; known: {', '.join(sorted(GPUS))}")
    return dataclasses.replace(GPUS[name], key=name)
