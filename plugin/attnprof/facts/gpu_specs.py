"""Vendor peak numbers of common datacenter GPUs: HBM/GDDR bandwidth and dense 16-bit tensor
FLOP/s, keyed by the device name NVML reports (``tools.provenance.hardware().gpu_name``,
e.g. ``NVIDIA H100 80GB HBM3``). The bandwidth probe is checked against them
(:func:`spec_ratio`); a device not in the table gets no spec rather than a guess.

Numbers are the vendors' datasheet values, dense (without 2:4 sparsity), FP16 and BF16 being
equal on every part listed. Bandwidth in bytes/s (decimal: 1 TB/s = 1e12 B/s).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["GPU_SPECS", "GpuSpec", "lookup", "spec_ratio"]


@dataclass(frozen=True)
class GpuSpec:
    name: str
    """Our name for the part (SKU and memory)."""
    bandwidth_bytes_per_second: float
    bf16_flops_per_second: float
    """Dense FP16/BF16 tensor-core peak (no sparsity)."""
    source: str
    """Where the numbers come from."""


_A100 = "NVIDIA A100 datasheet (2021): 312 TFLOPS BF16 dense"
_H100 = "NVIDIA H100 datasheet: BF16 1,979 (SXM) / 1,513 (PCIe) TFLOPS with sparsity, half dense"
GPU_SPECS: dict[str, GpuSpec] = {
    # A100: 40GB HBM2 1,555 GB/s (SXM and PCIe); 80GB HBM2e 2,039 GB/s SXM, 1,935 GB/s PCIe.
    "A100 40GB": GpuSpec("A100 40GB", 1555e9, 312e12, _A100 + ", 1,555 GB/s"),
    "A100 80GB SXM": GpuSpec("A100 80GB SXM", 2039e9, 312e12, _A100 + ", 2,039 GB/s"),
    "A100 80GB PCIe": GpuSpec("A100 80GB PCIe", 1935e9, 312e12, _A100 + ", 1,935 GB/s"),
    # H100 SXM5 80GB HBM3: 3.35 TB/s, 989 TFLOPS dense; PCIe 80GB HBM2e: 2 TB/s, 756 dense.
    "H100 SXM": GpuSpec("H100 SXM", 3.35e12, 989.5e12, _H100 + ", 3.35 TB/s"),
    "H100 PCIe": GpuSpec("H100 PCIe", 2.0e12, 756.5e12, _H100 + ", 2 TB/s"),
    # H200 SXM 141GB HBM3e: 4.8 TB/s; BF16 1,979 TFLOPS with sparsity (989 dense).
    "H200": GpuSpec("H200", 4.8e12, 989.5e12,
                    "NVIDIA H200 datasheet: 4.8 TB/s, BF16 1,979 TFLOPS with sparsity"),
    # L4 24GB GDDR6: 300 GB/s; BF16 242 TFLOPS with sparsity (121 dense).
    "L4": GpuSpec("L4", 300e9, 121e12,
                  "NVIDIA L4 datasheet: 300 GB/s, BF16 242 TFLOPS with sparsity"),
    # L40S 48GB GDDR6: 864 GB/s; BF16 362.05 TFLOPS dense (733 with sparsity).
    "L40S": GpuSpec("L40S", 864e9, 362.05e12,
                    "NVIDIA L40S datasheet: 864 GB/s, BF16 362.05 TFLOPS dense"),
    # A10G (AWS g5) has no NVIDIA datasheet of its own; these are the A10's (same GA102,
    # 24GB GDDR6, 600 GB/s, BF16 125 TFLOPS dense). AWS clocks it lower: the probe's
    # matmul number is the one to trust there.
    "A10G": GpuSpec("A10G", 600e9, 125e12,
                    "NVIDIA A10 datasheet (A10G: AWS variant, no own sheet): 600 GB/s, "
                    "BF16 125 TFLOPS dense"),
}


def _key(nvml_name: str) -> str | None:
    n = nvml_name.lower().replace("nvidia", " ")
    words = set(re.split(r"[^a-z0-9]+", n))
    if "nvl" in words:  # H100/H200 NVL: other clocks and memory, not in the table
        return None
    if "h200" in words:
        return "H200"
    if "h100" in words:
        if "pcie" in words:
            return "H100 PCIe"
        # NVML names the SXM5 part "NVIDIA H100 80GB HBM3".
        return "H100 SXM" if ("sxm" in n or "hbm3" in words) else None
    if "a100" in words:
        if "80gb" in words:
            return "A100 80GB PCIe" if "pcie" in words else "A100 80GB SXM"
        return "A100 40GB" if "40gb" in words else None
    if "l40s" in words:
        return "L40S"
    if "l4" in words:
        return "L4"
    if "a10g" in words:
        return "A10G"
    return None


def lookup(nvml_name: str | None) -> GpuSpec | None:
    """The spec of the GPU NVML (or ``torch.cuda.get_device_name``) calls ``nvml_name``;
    None for an unknown or ambiguous part. Never raises."""
    if not nvml_name:
        return None
    key = _key(str(nvml_name))
    return GPU_SPECS.get(key) if key is not None else None


def spec_ratio(measured: float | None, spec: float | None) -> float | None:
    """measured / spec (how much of the datasheet number the probe reached); None when
    either is missing or the spec is not positive."""
    if measured is None or spec is None or not spec > 0 or not measured >= 0:
        return None
    return measured / spec
