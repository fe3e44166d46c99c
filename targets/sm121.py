"""sm_121: the GB10 superchip's Blackwell GPU (DGX Spark).

Compute capability 12.1 has the 12.x limits of the CUDA C++ Programming Guide (99 KiB opt-in shared memory
per block). 48 SMs; memory is 128 GB of LPDDR5X shared with the CPU at 273 GB/s, so decode-style kernels
are bandwidth-bound far earlier than on the other targets. L2 is 24 MiB as the device reports it.
This is the default build target when no GPU is present (DESIGN.md, Targets).
"""

from __future__ import annotations

from .base import Target
from .cc12 import CC12_LIMITS

SM121 = Target(
    name="sm_121",
    description="NVIDIA GB10 Grace Blackwell (DGX Spark)",
    arch="sm_121a",
    compute_capability=(12, 1),
    sm_count=48,
    l2_bytes=24 * 1024 * 1024,
    dram_bandwidth_bytes_per_s=273e9,
    **CC12_LIMITS,
)
