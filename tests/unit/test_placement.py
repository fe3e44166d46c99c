"""Spreading a dependent grid over the SMs (runtime/placement.py), against the occupancy rule of shared
memory: an SM holds as many blocks as their shared memory, rounded up to the allocation granularity and
plus the system's reserve per block, fits in its own."""

from __future__ import annotations

import pytest

from dflash_compiler.runtime.cuda import CudaError
from dflash_compiler.runtime.placement import SmLimits, spread_dynamic_shared

H200 = SmLimits(count=132, shared_per_sm=233472, reserved_per_block=1024, max_dynamic_per_block=232448)
GB10 = SmLimits(count=48, shared_per_sm=102400, reserved_per_block=1024, max_dynamic_per_block=101376)
GRANULE = 128


def _blocks_by_shared(sm: SmLimits, per_block: int) -> int:
    return sm.shared_per_sm // (-(-(per_block + sm.reserved_per_block) // GRANULE) * GRANULE)


@pytest.mark.parametrize("sm", [H200, GB10], ids=["h200", "gb10"])
@pytest.mark.parametrize(
    ("blocks_per_sm_count", "per_sm", "static", "dynamic"),
    [
        (0.97, 2, 6144, 0),  # the attention split kernel at nb = 1: 128 blocks, two fit by registers
        (1.94, 4, 0, 49152),  # a tiled GEMM of 256 blocks, four fit by shared memory
        (2.5, 8, 0, 16384),
        (0.2, 16, 1024, 0),
    ],
)
def test_a_one_wave_grid_gets_its_fair_share_per_sm(sm, blocks_per_sm_count, per_sm, static, dynamic):
    blocks = max(1, int(blocks_per_sm_count * sm.count))
    share = -(-blocks // sm.count)
    padded = spread_dynamic_shared(blocks, per_sm, static, dynamic, sm)
    assert padded >= dynamic  # the kernel keeps what it uses
    assert _blocks_by_shared(sm, static + padded) == share
    assert static + padded <= sm.max_dynamic_per_block


def test_grids_that_fill_every_sm_keep_their_shared_memory():
    # several waves: every SM is full anyway
    assert spread_dynamic_shared(1536, 3, 0, 65536, H200) == 65536
    # the fair share is already what fits
    assert spread_dynamic_shared(256, 2, 0, 98304, H200) == 98304
    assert spread_dynamic_shared(264, 2, 0, 0, H200) == 0


def test_a_share_the_allocation_units_cannot_hold_keeps_its_shared_memory():
    # 31 blocks per SM of GB10: 3200 bytes each would fit 32, the next 128-byte unit only 30
    assert _blocks_by_shared(GB10, 3200 - 1024) == 32 and _blocks_by_shared(GB10, 3328 - 1024) == 30
    assert spread_dynamic_shared(31 * GB10.count, 32, 0, 0, GB10) == 0
    # while 30 per SM is one unit away
    padded = spread_dynamic_shared(30 * GB10.count, 32, 0, 0, GB10)
    assert _blocks_by_shared(GB10, padded) == 30


def test_what_cannot_be_spread_is_refused():
    with pytest.raises(CudaError, match="expected blocks and occupancy"):
        spread_dynamic_shared(0, 2, 0, 0, H200)
    tight = SmLimits(count=4, shared_per_sm=233472, reserved_per_block=1024, max_dynamic_per_block=65536)
    with pytest.raises(CudaError, match="needs 115840 B of shared memory per block; the device allows 65536"):
        spread_dynamic_shared(4, 2, 0, 0, tight)
