"""Where the blocks of a grid launched as a programmatic dependent land: spread over the SMs, not piled up.

A grid launched as a dependent (`dflash_compiler.dependent_launch`) reaches the block scheduler while the
grid before it still holds some SMs. Its blocks then go where there is room, and a grid of one wave or
less, whose blocks could share an SM (two attention blocks by their registers, four tiled-GEMM blocks by
their shared memory), piles them onto the SMs that were free first: those SMs run two or three blocks
while others run none, and the grid takes as long as its most loaded SM. Launched plainly the same grid
starts on an idle GPU and spreads one block per SM first. On the H200 (`bench/propose.py --timeline`,
Qwen3-8B drafter, bf16) the attention split kernel took 29 µs instead of 19 at nb = 1 and the tiled GEMMs
30 µs instead of 23 at nb = 4 when let in early.

The cure is to make a block claim enough shared memory that no more than the grid's fair share,
ceil(blocks / SMs), fits on one SM; a grid of several waves fills every SM anyway and keeps what it asked
for. The extra shared memory is never touched: a kernel's dynamic shared memory only has to be at least
what it uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_compiler.runtime.cuda import CudaError


@dataclass(frozen=True)
class SmLimits:
    """What bounds the blocks one SM holds, as the driver reports it for the device."""

    count: int  # SMs
    shared_per_sm: int  # shared memory of one SM, bytes
    reserved_per_block: int  # shared memory the system keeps per resident block, bytes
    max_dynamic_per_block: int  # the opt-in limit of one block's shared memory, bytes
    granule: int = 128  # a block's shared memory, its reserve included, is allocated in these units (sm_90, sm_12x)

    def fair_share(self, blocks: int) -> int:
        """Blocks per SM of a grid of `blocks` spread evenly: ceil(blocks / SMs)."""
        return -(-blocks // self.count)

    def blocks_by_shared(self, per_block: int) -> int:
        """Blocks of `per_block` bytes of shared memory (static + dynamic) that fit on one SM."""
        return self.shared_per_sm // (-(-(per_block + self.reserved_per_block) // self.granule) * self.granule)


def spread_dynamic_shared(blocks: int, per_sm: int, static: int, dynamic: int, sm: SmLimits) -> int:
    """Dynamic shared-memory bytes for a grid of `blocks` blocks, each using `static` + `dynamic` bytes, of
    which at most `per_sm` fit on one SM (by every limit: registers, threads, shared memory), such that at
    most ceil(blocks / SMs) share an SM; `dynamic` where the grid fills every SM anyway (several waves, or
    its fair share is already `per_sm`) and where no allocation holds exactly that share (a share of 30 or
    more blocks on a 100 KiB SM, whose 128-byte units cannot split it that finely).
    """
    if blocks < 1 or per_sm < 1:
        raise CudaError(f"spread_dynamic_shared: expected blocks and occupancy of at least 1, got {blocks}, {per_sm}")
    share = sm.fair_share(blocks)
    if share >= per_sm:
        return dynamic
    # the smallest allocation at which share + 1 blocks no longer fit
    allocation = -(-(sm.shared_per_sm // (share + 1) + 1) // sm.granule) * sm.granule
    padded = max(dynamic, allocation - sm.reserved_per_block - static)
    if sm.blocks_by_shared(static + padded) != share:
        return dynamic
    if static + padded > sm.max_dynamic_per_block:
        raise CudaError(
            f"spreading {blocks} blocks as {share} per SM needs {static + padded} B of shared memory per block; "
            f"the device allows {sm.max_dynamic_per_block}"
        )
    return padded
