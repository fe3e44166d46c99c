"""lm_head_argmax's epilogue on the tiled and warpgroup GEMMs: each block's best logit per row, then per row.

The GEMM kernels (`linear_tiled.py`, `linear_wgmma.py`) compute a `block_n × block_m` tile of the logits
`yᵀ = W · xᵀ` (FP8: times the row's scale), as for lm_head. Instead of storing it, `pick_macro` ranks the
tile's logits of each row of x by ARGMAX's order (argmax.py: the larger value, then the lower vocabulary
index) and writes the block's winner per row into a `[2, m, n_blocks]` float32 workspace (rank, value),
and `pick_merge_macro`'s kernel, one block per row, picks each row's winner among its blocks' and writes
its id. Both use the values the lm_head kernel of the same plan would store (one k split), so the ids are
ARGMAX's of those logits bit for bit; what goes is the logits' round trip through memory (`[m, vocab]`
float32 written and read back). Ranks are float32 (argmax.py), so the vocabulary stays below 2^24.

Within a block: a thread holds mma.sync's m16n8 accumulators (linear_tiled.store_macro): per 8-row x tile
two x rows, each with two weight rows of every 16-row weight tile. It ranks its candidates per x row, the
eight lanes that hold the same x rows (lane bits 2-4) combine theirs with xor shuffles, and the first of
them writes the warp's winner to shared memory, one slot per (warp along n, row of the block). After a
barrier one thread per row picks among the warps along n and writes the block's pair. The slots overlay the
start of the kernel's dynamic shared memory, which the copy pipeline no longer reads once every thread
passed a first barrier (every warpgroup has waited for its last wgmmas, every warp left its last slot).

Every thread of the block calls `pick`: it holds block barriers. Warps that hold no accumulators (the
tiled kernel's warps along k past the first, `active` false) join the shuffles and barriers only. x rows
past m and weight rows past n are never candidates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .argmax import NO_RANK, RANK, RANK_BASE, pick_macros, take_partials_macro
from .base import ScheduleError

if TYPE_CHECKING:
    from .linear import LinearSpec

PICK_MERGE_THREADS = 256
WARP = 32


def pick_bytes(plan: Any) -> int:
    """The shared memory `pick` overlays: a (value, rank) pair per warp along n and row of the block."""
    return 2 * plan.n_warps * plan.block_m * 4


def pick_blocks(spec: LinearSpec, plan: Any) -> int:
    """Blocks along n: each row's partial pairs in the workspace."""
    return -(-spec.n // plan.block_n)


def pick_macro(spec: LinearSpec, plan: Any, inactive_meet: bool = False) -> Any:
    """A TVMScript macro `pick(sc, part, m, acc, smem, bm, bn, wn, wm, g, t, tid, active)`: the block's
    best logit per row of x into part[:, row, bn] (module docstring); FP8 logits take the row scales in the
    thread's registers `sc` (linear_tiled.row_scales_macro). `smem` is the kernel's dynamic
    shared memory (at least `pick_bytes(plan)`), `plan` has the fields linear_tiled.store_macro reads and
    `n_warps`, `threads`. Threads not `active` write no slot; with `inactive_meet` they are threads past
    `plan.threads` that only meet the block barriers (a producer warp), and pick no row either."""
    from tvm.script import tirx as T

    n, fp8 = spec.n, spec.fp8
    if spec.picks and plan.shared_bytes() < pick_bytes(plan):
        raise ScheduleError(
            f"{spec.name}: the argmax epilogue's {pick_bytes(plan)} bytes of (value, rank) slots overlay the kernel's "
            f"{plan.shared_bytes()} bytes of shared memory and do not fit. Fix: more stages or fewer warps along n"
        )
    n_tiles, m_tiles, bn_rows, bm_rows = plan.n_tiles, plan.m_tiles, plan.block_n, plan.block_m
    n_warps, threads = plan.n_warps, plan.threads
    held = 2 * m_tiles  # x rows a thread holds: two per 8-row tile
    rounds = -(-bm_rows // threads)
    full = T.uint32(0xFFFFFFFF)
    floor = T.float32(float(np.finfo(np.float32).min))
    base = T.float32(float(RANK_BASE))
    take = pick_macros(WARP).take

    def logit(value: Any, sc: Any, nt: int, v: int) -> Any:
        return value * sc[nt * 2 + v] if fp8 else value

    @T.macro
    def pick(sc, part, m, acc, smem, bm, bn, wn, wm, g, t, tid, active):
        key = T.sblock_alloc_buffer((1,), "float32", scope="local")
        rank = T.sblock_alloc_buffer((1,), RANK, scope="local")
        best_key = T.sblock_alloc_buffer((held,), "float32", scope="local")
        best_rank = T.sblock_alloc_buffer((held,), RANK, scope="local")
        slots = T.decl_buffer((2, n_warps, bm_rows), "float32", data=smem.data, scope="shared.dyn")
        for mt in T.unroll(m_tiles):
            for h in T.unroll(2):
                key[0] = floor
                rank[0] = T.float32(NO_RANK)
                for nt in T.unroll(n_tiles):
                    for v in T.unroll(2):
                        j = T.meta_var(bn * bn_rows + (wn * n_tiles + nt) * 16 + v * 8 + g)
                        value = T.meta_var(acc[(nt * m_tiles + mt) * 4 + v * 2 + h])
                        if j < n:
                            # -inf is lifted to the lowest float, as ARGMAX does
                            take(key, rank, T.max(logit(value, sc, nt, v), floor), T.Cast(RANK, j) - base)
                # the eight lanes holding this x row: lane bits 2-4
                for o in T.unroll(3):
                    other_key: T.let[T.float32] = T.call_extern("float32", "__shfl_xor_sync", full, key[0],
                                                                16 >> o, WARP)  # fmt: skip
                    other_rank: T.let[T.float32] = T.call_extern("float32", "__shfl_xor_sync", full, rank[0],
                                                                 16 >> o, WARP)  # fmt: skip
                    take(key, rank, other_key, other_rank)
                best_key[mt * 2 + h] = key[0]
                best_rank[mt * 2 + h] = rank[0]
        # the pipeline's last reads of the slots are over
        T.tvm_storage_sync("shared")
        if active and g == 0:
            for mt in T.unroll(m_tiles):
                for h in T.unroll(2):
                    slots[0, wn, (wm * m_tiles + mt) * 8 + t * 2 + h] = best_key[mt * 2 + h]
                    slots[1, wn, (wm * m_tiles + mt) * 8 + t * 2 + h] = best_rank[mt * 2 + h]
        T.tvm_storage_sync("shared")
        for r in T.unroll(rounds):
            row = T.meta_var(r * threads + tid)
            if (active or not inactive_meet) and (bm_rows % threads == 0 or row < bm_rows) and bm * bm_rows + row < m:
                key[0] = slots[0, 0, row]
                rank[0] = slots[1, 0, row]
                for w in T.unroll(n_warps - 1):
                    # through lets: a shared-memory load may not sit in the condition take branches on
                    other_key: T.let[T.float32] = slots[0, w + 1, row]
                    other_rank: T.let[T.float32] = slots[1, w + 1, row]
                    take(key, rank, other_key, other_rank)
                part[0, bm * bm_rows + row, bn] = rank[0]
                part[1, bm * bm_rows + row, bn] = key[0]

    return pick


def pick_merge_macro(spec: LinearSpec, plan: Any) -> Any:
    """A TVMScript macro `pick_merge(part, ids, m)`: its own kernel, one block per row of x, ids[row] = the
    id of the best of the row's `pick_blocks` pairs in part."""
    from tvm.script import tirx as T

    blocks = pick_blocks(spec, plan)
    threads = min(PICK_MERGE_THREADS, -(-blocks // WARP) * WARP)
    warps = threads // WARP
    floor = T.float32(float(np.finfo(np.float32).min))
    base = T.float32(float(RANK_BASE))
    picks = pick_macros(WARP)
    take_partials = take_partials_macro(blocks, threads, WARP)

    @T.macro
    def pick_merge(part, ids, m):
        for row in T.thread_binding(m, thread="blockIdx.x"):
            for tid in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock("pick_merge"):
                    T.reads()
                    T.writes()
                    key = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    rank = T.sblock_alloc_buffer((1,), RANK, scope="local")
                    shared = T.sblock_alloc_buffer((2, warps), "float32", scope="shared")
                    key[0] = floor
                    rank[0] = T.float32(NO_RANK)
                    take_partials(key, rank, part, row, tid)
                    picks.block_reduce(key, rank, shared, tid % WARP, tid // WARP, warps)
                    if tid == 0:
                        ids[row] = T.Cast("int32", rank[0] + base)

    return pick_merge
