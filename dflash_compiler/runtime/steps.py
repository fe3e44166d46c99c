"""Per-step inputs of the two phases, derived from the page allocator (shared by every executor).

The numpy graph runner and the GPU runtime feed the phase graphs the same inputs: page slots and positions
for the context rows, and cache lengths, block positions and page tables for a propose step. Computing them
in one place keeps the cache protocol identical in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dflash_compiler.runtime.pages import SCRATCH_PAGE, PageAllocator

# A launch of the context phase takes its rows padded to a multiple of this, so that a server whose row counts
# vary from step to step captures one CUDA graph per multiple (and sequence count), not one per count. The
# few-rows linear kernels take x in 16-row tiles: a piece of 7 rows and one of 16 launch the same grid.
CONTEXT_ROW_QUANTUM = 16


@dataclass(frozen=True)
class ContextStep:
    positions: np.ndarray  # int32 [C]
    slots: np.ndarray  # int32 [C]: page * page_size + row of each context row


@dataclass(frozen=True)
class ProposeStep:
    cache_lens: np.ndarray  # int32 [nb]
    block_table: np.ndarray  # int32 [nb, maxp], unused entries are the scratch page
    positions: np.ndarray  # int32 [nb * blk]: the anchor sits at the sequence's cached length


def context_step(pages: PageAllocator, seq_ids: Sequence[int], positions: Sequence[np.ndarray]) -> ContextStep:
    """Reserve pages for each sequence's new rows and return their positions and slots.

    Positions must be consecutive and start at or before the sequence's length (rewriting rows after a
    rollback is allowed); pages are reserved for all sequences at once, so exhaustion changes nothing.
    """
    ends = {}
    for seq_id, pos in zip(seq_ids, positions, strict=True):
        pos = np.asarray(pos)
        length = pages.length(seq_id)
        if len(pos) and (pos[0] > length or np.any(np.diff(pos) != 1)):
            raise ValueError(
                f"sequence {seq_id}: context positions must be consecutive and start at or before its "
                f"length {length}, got {pos.tolist()}"
            )
        ends[seq_id] = max(length, int(pos[-1]) + 1) if len(pos) else length
    pages.reserve(ends)
    slots = [pages.slot(s, int(p)) for s, pos in zip(seq_ids, positions, strict=True) for p in np.asarray(pos)]
    all_pos = [np.asarray(p, np.int64).reshape(-1) for p in positions]
    return ContextStep(
        positions=(np.concatenate(all_pos) if all_pos else np.zeros(0)).astype(np.int32),
        slots=np.asarray(slots, np.int32),
    )


def padded_context(step: ContextStep, most: int, page_size: int) -> ContextStep:
    """`step`'s rows followed by pad rows up to the next multiple of CONTEXT_ROW_QUANTUM, at most `most` rows
    (the phase's launch limit; `step` must not hold more). A pad row sits at position 0 with its slot in the
    scratch page, which no sequence owns and no attention reads unmasked; its taps are the caller's to zero,
    which makes every value the phase derives from them zero (its projections have no biases: the front end
    refuses them), so the scratch page stays zero."""
    rows = len(step.slots)
    if rows > most:
        raise ValueError(f"a context launch takes at most {most} rows, got {rows}")
    pad = min(most, -(-rows // CONTEXT_ROW_QUANTUM) * CONTEXT_ROW_QUANTUM) - rows
    # where a page holds fewer rows than the pad, pad rows share slots: they write the same values
    scratch = SCRATCH_PAGE * page_size + np.arange(pad, dtype=np.int32) % page_size
    return ContextStep(
        positions=np.concatenate([step.positions, np.zeros(pad, np.int32)]).astype(np.int32),
        slots=np.concatenate([step.slots, scratch]).astype(np.int32),
    )


def propose_step(pages: PageAllocator, seq_ids: Sequence[int], block: int, maxp: int | None = None) -> ProposeStep:
    """Cache lengths, page tables (`maxp` columns, default: the longest table) and block positions."""
    lens = np.array([pages.length(s) for s in seq_ids], np.int32)
    owned = [pages.pages(s) for s in seq_ids]
    width = max(1, *(len(p) for p in owned)) if maxp is None else maxp
    table = np.zeros((len(seq_ids), width), np.int32)
    for i, row in enumerate(owned):
        if len(row) > width:
            raise ValueError(f"sequence {seq_ids[i]} holds {len(row)} pages, the page table has {width} columns")
        table[i, : len(row)] = row
    positions = (lens[:, None] + np.arange(block, dtype=np.int32)[None, :]).reshape(-1).astype(np.int32)
    return ProposeStep(cache_lens=lens, block_table=table, positions=positions)
