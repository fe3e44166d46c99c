"""The limits every compute capability 12.x GPU shares (CUDA C++ Programming Guide, compute capabilities
table): 99 KiB opt-in shared memory per block out of 100 KiB per SM, 64 K registers, 1536 resident threads
per SM, and bf16 and FP8 `mma.sync` (no warpgroup MMA). The sm_120 and sm_121 records add what differs per part."""

from __future__ import annotations

from typing import Any

CC12_LIMITS: dict[str, Any] = {
    "max_shared_memory_per_block": 99 * 1024,
    "shared_memory_per_sm": 100 * 1024,
    "registers_per_sm": 65536,
    "max_registers_per_block": 65536,
    "max_registers_per_thread": 255,
    "max_threads_per_block": 1024,
    "max_threads_per_sm": 1536,
    "warp_size": 32,
    "fp8_mma": True,
    "bf16_mma": True,
    "wgmma": False,
}
