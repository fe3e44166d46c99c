"""sm_90: Hopper data-center GPUs (H100 SXM / H200 SXM).

Numbers from NVIDIA's CUDA C++ Programming Guide (compute capability 9.0 limits) and the H100/H200
datasheets. Bandwidth is the H200's 4.8 TB/s; an H100 SXM has 3.35 TB/s, so the roofline is optimistic
there by that ratio.
"""

from __future__ import annotations

from .base import Target

SM90 = Target(
    name="sm_90",
    description="NVIDIA Hopper H100 / H200 (SXM)",
    arch="sm_90a",
    compute_capability=(9, 0),
    sm_count=132,
    max_shared_memory_per_block=227 * 1024,
    shared_memory_per_sm=228 * 1024,
    registers_per_sm=65536,
    max_registers_per_block=65536,
    max_registers_per_thread=255,
    max_threads_per_block=1024,
    max_threads_per_sm=2048,
    warp_size=32,
    l2_bytes=50 * 1024 * 1024,
    dram_bandwidth_bytes_per_s=4.8e12,
    fp8_mma=True,
    bf16_mma=True,
    wgmma=True,
)
