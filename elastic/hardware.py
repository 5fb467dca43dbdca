"""GPU kinds the planner sizes meshes for: memory, dense bf16 FLOP/s, NVLink and network bandwidth.

Pure values (no ray, no torch); used by ``elastic.planner`` on the driver or on a laptop.

Figures are per GPU, from the vendors' datasheets (dense bf16, no sparsity):

* H100 SXM5 80 GB: 989 TFLOP/s; NVLink 4 at 900 GB/s both directions together (450 GB/s each
  way); one 400 Gb/s NIC per GPU (DGX H100: 8 x ConnectX-7), which is also the network of the
  Llama 3 cluster.
* H200 SXM 141 GB: the H100's compute and links with more and faster memory.
* B200 (HGX/DGX B200) 180 GB: 2.25 PFLOP/s dense bf16 (4.5 with sparsity); NVLink 5 at 1.8 TB/s
  both directions (900 GB/s each way); 400 Gb/s per GPU (DGX B200: 8 x ConnectX-7).

A collective moves data in both directions at once, so its time uses the one-way figure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

GB = 1e9  # memory and bandwidth in decimal gigabytes, as the datasheets and the ZeRO paper count


@dataclass(frozen=True)
class GpuSpec:
    """One GPU and its links, as the cost model sees it."""

    name: str
    memory_gb: float
    # Peak dense bf16 tensor-core throughput.
    bf16_tflops: float
    # NVLink bandwidth inside a node, one direction, per GPU.
    nvlink_gb_per_s: float
    # Network bandwidth between nodes, per GPU (its own NIC), in gigabits per second.
    network_gbit_per_s: float

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GB

    @property
    def peak_flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_gb_per_s * GB

    @property
    def network_bytes_per_s(self) -> float:
        return self.network_gbit_per_s * GB / 8

    def problems(self) -> list[str]:
        """Every value that cannot describe a GPU, as sentences naming the flag."""
        flags = {
            "memory_gb": "--gpu-memory-gb",
            "bf16_tflops": "--gpu-tflops",
            "nvlink_gb_per_s": "--nvlink-gb-per-s",
            "network_gbit_per_s": "--network-gbit-per-s",
        }
        return [
            f"{flag}={getattr(self, name)!r} must be > 0" for name, flag in flags.items() if not getattr(self, name) > 0
        ]

    def describe(self) -> str:
        return (
            f"{self.name} ({self.memory_gb:g} GB, {self.bf16_tflops:g} TFLOP/s bf16, "
            f"NVLink {self.nvlink_gb_per_s:g} GB/s, network {self.network_gbit_per_s:g} Gb/s)"
        )


GPU_KINDS: dict[str, GpuSpec] = {
    "h100-80g": GpuSpec("h100-80g", memory_gb=80, bf16_tflops=989, nvlink_gb_per_s=450, network_gbit_per_s=400),
    # H100's compute with NVLink cut to 400 GB/s both ways (DeepSeek-V3's cluster: 8 x 400 Gb/s IB per node).
    "h800": GpuSpec("h800", memory_gb=80, bf16_tflops=989, nvlink_gb_per_s=200, network_gbit_per_s=400),
    "h200": GpuSpec("h200", memory_gb=141, bf16_tflops=989, nvlink_gb_per_s=450, network_gbit_per_s=400),
    "b200": GpuSpec("b200", memory_gb=180, bf16_tflops=2250, nvlink_gb_per_s=900, network_gbit_per_s=400),
}


def gpu_spec(kind: str = "h100-80g", **overrides: float | None) -> GpuSpec:
    """A known kind with any non-None field replaced (a custom GPU starts from the nearest kind)."""
    if kind not in GPU_KINDS:
        raise KeyError(kind)
    # Any: the overrides are float fields named at run time, so only replace() itself can check
    # the names (an unknown one raises TypeError); mypy would match them against ``name: str``.
    changes: dict[str, Any] = {key: value for key, value in overrides.items() if value is not None}
    spec = dataclasses.replace(GPU_KINDS[kind], **changes)
    if changes:
        spec = dataclasses.replace(spec, name=f"{kind} (custom)")
    return spec
