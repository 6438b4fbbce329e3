"""The GPU models `plan.gpu` names: what `hpc-rlhf plan` checks memory against and estimates step time from.

Figures from the vendors' data sheets (dense bf16 tensor-core peak, without sparsity; SXM boards):
- A100-80G: NVIDIA A100 Tensor Core GPU data sheet: 80 GB HBM2e, 2,039 GB/s, bf16 312 TFLOP/s, NVLink 600 GB/s,
  PCIe Gen4 64 GB/s (both directions: 32 GB/s each way).
- A800-80G: NVIDIA A800 Tensor Core GPU data sheet: as the A100-80G, NVLink limited to 400 GB/s.
- H100-80G: NVIDIA H100 Tensor Core GPU data sheet (SXM5): 80 GB HBM3, 3.35 TB/s, bf16 989 TFLOP/s, NVLink 900 GB/s,
  PCIe Gen5 128 GB/s (64 GB/s each way).
- H200-141G: NVIDIA H200 Tensor Core GPU data sheet (SXM): 141 GB HBM3e, 4.8 TB/s, bf16 989 TFLOP/s, NVLink 900 GB/s,
  PCIe Gen5 128 GB/s.
Memory: what the driver reports (nvidia-smi) for the data sheet's 80 GB (A100, A800: 81,920 MiB; H100: 81,559 MiB)
and 141 GB (H200: 143,771 MiB).
Network per GPU: the DGX systems' data sheets (DGX A100: eight 200 Gb/s HDR InfiniBand ports, one per GPU: 25 GB/s;
DGX H100 and H200: eight 400 Gb/s NDR ports: 50 GB/s); `plan.network_gb_per_s` sets a cluster's own.
NVLink figures are the total of both directions; a one-way transfer (a broadcast, a gather) gets half.
"""
from __future__ import annotations

from dataclasses import dataclass

GB, MIB = 10 ** 9, 2 ** 20


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    bf16_flops: float        # dense tensor-core peak, FLOP/s
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # both directions
    pcie_bytes_per_s: float    # one direction
    network_bytes_per_s: float  # per GPU, one direction (the DGX system's)

    def link_bytes_per_s(self, across_nodes: bool, network_bytes_per_s: float | None = None) -> float:
        """One direction of the link between two of these GPUs: NVLink in a node, the network between nodes."""
        if across_nodes:
            return network_bytes_per_s or self.network_bytes_per_s
        return self.nvlink_bytes_per_s / 2


GPUS = {g.name: g for g in (
    GpuSpec("a800-80g", 81920 * MIB, 312e12, 2.039e12, 400 * GB, 32 * GB, 25 * GB),
    GpuSpec("a100-80g", 81920 * MIB, 312e12, 2.039e12, 600 * GB, 32 * GB, 25 * GB),
    GpuSpec("h100-80g", 81559 * MIB, 989e12, 3.35e12, 900 * GB, 64 * GB, 50 * GB),
    GpuSpec("h200-141g", 143771 * MIB, 989e12, 4.8e12, 900 * GB, 64 * GB, 50 * GB),
)}
