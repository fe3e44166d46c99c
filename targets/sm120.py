"""sm_120: Blackwell consumer GPUs, sized for the GeForce RTX 5090.

Compute capability 12.0 limits from the CUDA C++ Programming Guide (99 KiB opt-in shared memory per block,
1536 resident threads per SM); SM count, 96 MiB L2 and 1.79 TB/s GDDR7 from the RTX 5090 specifications.
FP8 MMA is the `mma.sync ... kind::f8f6f4` path (no wgmma/tcgen05 on sm_120).
"""

from __future__ import annotations

from .base import Target
from .cc12 import CC12_LIMITS

SM120 = Target(
    name="sm_120",
    description="NVIDIA Blackwell GeForce RTX 5090",
    arch="sm_120a",
    compute_capability=(12, 0),
    sm_count=170,
    l2_bytes=96 * 1024 * 1024,
    dram_bandwidth_bytes_per_s=1.792e12,
    **CC12_LIMITS,
)
