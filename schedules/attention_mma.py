"""Block attention on tensor cores: the split kernel of `attention.py` with `mma.sync.m16n8k16` bf16 → f32.

The SIMT split kernel spends ~70 µs per layer on an H200 on the FMAs of Q·Kᵀ and P·V for one sequence of
16 block rows × 32 heads against 4096 cached keys, while the K/V bytes take ~4 µs: the work is compute-bound
on CUDA cores. Here each warp owns 16 query rows of one (sequence, kv head) and runs both products as
m16n8k16 mmas, flash-attention style; the splits, their spans and the log-sum-exp merge kernel are the ones
of `attention_merge.py`, so the kernels write the same partial results.

Thread block = (split, kv head, sequence), `warps` = ceil(block·group / 16) warps (times `key_warps`, see
the rule); row r of the block's query rows is (block row r // group, head r % group of the kv head's group),
as in the SIMT kernel. Keys go in groups of `warps` chunks of 16: warp w fetches chunk w of the next group
into registers (16-byte loads, cached rows through the page table, then the block's own rows) while every
warp computes the current group from shared memory; a barrier separates the two. With `stages` >= 2 the
chunks are copied with cp.async straight into a ring of that many group slots, `stages - 1` groups ahead.
A group's page-table entries are read one group before its K/V. Before the wait for inputs, the first
`prefetch` groups' cached K/V lines are prefetched into L2 (their addresses from the step's host-written
lengths and tables, read again after the wait). A warp takes the group's
chunks `tile_chunks` at a time (one softmax step of 16·tile_chunks keys), skipping the last group's tiles
past the split's keys; per step:

* S = Q·Kᵀ: Q (A operand) stays in registers for the whole kernel; K rows are the B operand's columns.
  Logical k (head dim) is permuted as in `linear_mma.py` so that every fragment is one 16-byte vector per
  thread: mma j of a 32-wide step takes logical 2t+e ↦ 8t + 4j + e and 2t+8+e ↦ 8t + 4j + 2 + e. The
  head_dim / 16 mmas of one 8-key tile accumulate into `qk_chains` separate accumulators, summed after,
  so the chain of dependent mmas (each waits for the last one's result) is that many times shorter.
* online softmax in base 2 on the raw S accumulators: a row's scores sit in the 4 threads of a lane quad,
  whose max is combined with two xor shuffles; the running sum stays per thread until the end. The max,
  the shuffles and the rescale of the output accumulators (head_dim / 2 multiplies per thread) happen once
  per step, so a step of several chunks spends them on more keys. A weight costs one FFMA (scale and
  subtract the max) and one `ex2.approx` (fast_exp2.py); keys are compared against the split's end only
  in a tile that reaches past it (the causal and window masks compare every key).
* O += P·V per chunk of the step: the S accumulators of the chunk's two 8-key tiles are exactly the A
  fragment of P (keys in natural order). For V the output columns are permuted instead: column g of
  d-tile j is head-dim element g·(dim/8) + j, so a thread's B fragments for all d-tiles come from 2–4
  contiguous vectors of each of its 4 keys; the output is written back through the same map.

Keys past the split's end, or hidden by the mask, score -inf (weight exactly 0); their loads read the
split's last key instead, so no value is garbage. Rows past block·group (a ragged last warp) read row
rows - 1 and are never stored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dflash_compiler.dependent_launch import PREFETCH_L2, WAIT
from dflash_compiler.fast_exp2 import EXP2
from dflash_compiler.targets import Target

from .attention import BlockAttentionOp, BlockAttentionSpec, _visible, default_splits
from .attention_merge import DTYPE, NEG, attention_prim_func, span_count, split_span_macro
from .base import FamilyRule, Kernel, ScheduleError
from .mma import mma_m16n8k16

WARP = 32
CHUNK = 16  # keys per chunk: the k of the P·V mma, two n-tiles of the Q·Kᵀ mma
LINE_ELEMENTS = 64  # bf16 elements of a 128-byte cache line
_PAD = 8  # bf16 elements of padding per staged K/V row where the rows are not swizzled (head_dim 32, 96)


def staged_pitch(dim: int) -> int:
    """bf16 elements per staged K/V row: unpadded where `staged_chunk` swizzles (head_dim 64, 128)."""
    return dim if dim % 64 == 0 else dim + _PAD


def staged_chunk(row: Any, chunk: Any, dim: int) -> Any:
    """The 16-byte slot in its row where logical 16-byte chunk `chunk` of staged row `row` lies (ints or TIR).

    A quarter warp's 16-byte reads are one shared-memory wavefront when they fall in 8 different 16-byte
    bank groups. Q·Kᵀ's B fragments read 4 consecutive chunks of rows 2m and 2m + 1; P·V's read chunks
    (gq·dim/64 + cv) of rows b, b + 2, b + 4, b + 6 (b = 8·k + kk % 2). XOR-ing the chunk's low 3 bits
    with bit 2 = bit 0 of (row ^ row >> 2) (which tells 2m from 2m + 1, and rows b + 2tq apart in pairs)
    and with (row >> 1) & 1 in the bit the gq half does not use (0 for head_dim 128, 1 for 64) puts both on
    8 groups; rows padded by 16 bytes instead take 2 wavefronts for Q·Kᵀ (and for P·V at head_dim 128;
    tests/kernels/test_attention_mma.py counts them). Rows stay whole 16-byte chunks, and the 8 chunks a
    quarter warp stages are one group."""
    if dim % 64:
        return chunk
    low = 1 if dim == 64 else 0
    return chunk ^ ((((row ^ (row >> 2)) & 1) << 2) | (((row >> 1) & 1) << low))


@dataclass(frozen=True)
class MmaAttentionPlan:
    """The resolved shape of one tensor-core attention kernel."""

    warps: int  # 16 query rows each; also the chunks per group
    splits: int  # thread blocks per (sequence, kv head)
    qk_chains: int = 1  # independent accumulator chains of Q·Kᵀ's k steps (2 halves its mma latency chain)
    tile_chunks: int = 1  # chunks per softmax step (its max, rescale and shuffles amortised over 16·this keys)
    slots: int = 0  # > 0: the grid a batch's splits aim at (blocks); a larger batch takes fewer splits
    key_warps: int = 1  # warps per 16 query rows, each taking every key_warps-th tile of a group's keys
    stages: int = 0  # 0: a group's K/V staged through registers; >= 2: a ring of this many groups, cp.async
    prefetch: int = 0  # groups whose cached K/V lines are prefetched into L2 before the wait for inputs

    @property
    def threads(self) -> int:
        return WARP * self.warps * self.key_warps

    def shared_bytes(self, spec: BlockAttentionSpec) -> int:
        """The staged K and V chunks of one group (of `stages` groups); with key_warps > 1 at least the
        combine's floats."""
        combine = (spec.head_dim // 2 + 4) * self.warps * WARP * 4 if self.key_warps > 1 else 0
        return max(max(self.stages, 1) * 2 * self.warps * CHUNK * staged_pitch(spec.head_dim) * 2, combine)


def mma_attention_fits(spec: BlockAttentionSpec, target: Target) -> bool:
    """bf16 mma; head dims of whole 32-wide k steps up to 128 (the accumulators of 256 would spill); the
    warps of a (sequence, kv head) and their staged chunks fit the block."""
    if not (target.bf16_mma and target.warp_size == WARP and spec.head_dim % 32 == 0 and spec.head_dim <= 128):
        return False
    plan = MmaAttentionPlan(warps=_warps(spec), splits=1)
    return (
        WARP * plan.warps <= target.max_threads_per_block
        and plan.shared_bytes(spec) <= target.max_static_shared_memory_per_block
    )


def _warps(spec: BlockAttentionSpec) -> int:
    return -(-spec.block * spec.group // 16)


def fit_mma_attention(
    spec: BlockAttentionSpec,
    target: Target,
    splits: int,
    qk_chains: int = 1,
    tile_chunks: int = 1,
    slots: int = 0,
    key_warps: int = 1,
    stages: int = 0,
    prefetch: int = 0,
) -> MmaAttentionPlan:
    """The plan for `spec` (which `mma_attention_fits` `target`) with `splits` blocks per (sequence, kv head)."""
    if not 1 <= splits <= 256:
        raise ScheduleError(f"{AttentionMmaRule.name} knob splits={splits}: expected 1 to 256")
    if qk_chains not in (1, 2, 4) or (spec.head_dim // 16) % qk_chains:
        raise ScheduleError(
            f"{AttentionMmaRule.name} knob qk_chains={qk_chains}: expected 1, 2 or 4 dividing the "
            f"{spec.head_dim // 16} k steps of head_dim {spec.head_dim}"
        )
    warps = _warps(spec)
    if tile_chunks < 1 or warps % tile_chunks:
        raise ScheduleError(
            f"{AttentionMmaRule.name} knob tile_chunks={tile_chunks}: expected a divisor of the {warps} chunks "
            "a group stages (one per warp)"
        )
    if slots < 0:
        raise ScheduleError(f"{AttentionMmaRule.name} knob slots={slots}: expected 0 (off) or a block count")
    tiles, vectors = warps // tile_chunks, CHUNK * spec.head_dim // 8 // WARP
    if key_warps < 1 or tiles % key_warps or vectors % key_warps:
        raise ScheduleError(
            f"{AttentionMmaRule.name} knob key_warps={key_warps}: expected a divisor of both the {tiles} tiles "
            f"of a group (its {warps} chunks over tile_chunks={tile_chunks}) and the {vectors} vectors a warp "
            "fetches per chunk"
        )
    if not 0 <= prefetch <= 16:
        raise ScheduleError(
            f"{AttentionMmaRule.name} knob prefetch={prefetch}: expected 0 (off) to 16 groups prefetched before "
            "the wait for inputs"
        )
    plan = MmaAttentionPlan(warps, splits, qk_chains, tile_chunks, slots, key_warps, stages, prefetch)
    if plan.threads > target.max_threads_per_block:
        raise ScheduleError(
            f"{AttentionMmaRule.name} knob key_warps={key_warps}: {plan.threads} threads, expected at most "
            f"{target.max_threads_per_block} on {target.name}; lower key_warps"
        )
    if stages == 1 or stages < 0:
        raise ScheduleError(f"{AttentionMmaRule.name} knob stages={stages}: expected 0 (registers) or 2 and more")
    limit = target.max_shared_memory_per_block if stages else target.max_static_shared_memory_per_block
    if plan.shared_bytes(spec) > limit:
        fix = "fewer stages" if stages else "lower key_warps, or stages >= 2 (dynamic shared memory)"
        raise ScheduleError(
            f"{AttentionMmaRule.name} knobs stages={stages}, key_warps={key_warps}: {plan.shared_bytes(spec)} "
            f"bytes of shared memory, expected at most {limit} on {target.name}; {fix}"
        )
    return plan


def locate_macro(spec: BlockAttentionSpec, splits: int, slots: int, unit: int) -> Any:
    """`locate(span, s, n, p, blk_positions, nb)`: split p's keys [span[0], span[2]) of sequence s (n cached
    rows) and span[3], the units of `unit` keys (a chunk, or a group) that cover them: the spans of
    `split_span_macro` in multiples of CHUNK keys, which the merge kernel shares."""
    from tvm.script import tirx as T

    split_span = split_span_macro(spec, splits, CHUNK, slots)

    @T.macro
    def locate(span, s, n, p, blk_positions, nb):
        split_span(span, s, n, blk_positions, nb)
        span[0] = span[0] + p * span[1]
        span[2] = T.min(span[0] + span[1], n + spec.block)
        span[3] = T.if_then_else(span[0] < span[2], T.ceildiv(span[2] - span[0], unit), 0)

    return locate


def softmax_macro(spec: BlockAttentionSpec, nts: int) -> Any:
    """`softmax(sacc, pa, oacc, m_run, l_run, stat, q_at, blk_positions, s, n, k0, end, gq, tq)`: one online
    softmax step over the raw scores of `nts` 8-key n-tiles in mma.sync's m16n8 accumulator layout (both
    tensor-core kernels hold S that way): masks the hidden keys, moves the rows' running max and sum, turns
    the scores into weights `pa` (bf16, the A fragments of P·V) and rescales the output accumulators
    `oacc` (head_dim / 8 n-tiles of the same layout)."""
    from tvm import tirx
    from tvm.script import tirx as T

    blk, dts = spec.block, spec.head_dim // 8
    q_scale = math.log2(math.e) / math.sqrt(spec.head_dim)
    floor = NEG * q_scale * 0.5  # above a hidden key's scaled score, below every real one
    masked = spec.causal or spec.window is not None
    full = T.uint32(0xFFFFFFFF)

    def exp2(x: Any) -> Any:
        return T.call_extern("float32", EXP2, x)

    @T.macro
    def softmax(sacc, pa, oacc, m_run, l_run, stat, q_at, blk_positions, s, n, k0, end, gq, tq):
        # raw scores; accumulator e of n-tile nt: row gq + 8·(e // 2), key k0 + 8·nt + 2·tq + e % 2. Hidden
        # keys score NEG; without a mask only the split's last step holds keys past its end, so only a
        # step that reaches past `end` compares keys (a branch the whole block takes alike)
        if masked:
            for nt in T.unroll(nts):
                for e in T.unroll(4):
                    key = T.meta_var(k0 + nt * 8 + tq * 2 + e % 2)
                    sacc[nt * 4 + e] = T.if_then_else(
                        tirx.all(
                            key < end,
                            _visible(
                                spec,
                                q_at[e // 2],
                                T.if_then_else(
                                    key < n, key, blk_positions[s * blk + T.max(T.min(key, end - 1) - n, 0)]
                                ),
                            ),
                        ),
                        sacc[nt * 4 + e],
                        T.float32(NEG),
                    )
        elif k0 + nts * 8 > end:
            for nt in T.unroll(nts):
                for e in T.unroll(4):
                    key = T.meta_var(k0 + nt * 8 + tq * 2 + e % 2)
                    sacc[nt * 4 + e] = T.if_then_else(key < end, sacc[nt * 4 + e], T.float32(NEG))
        # online softmax in base 2: the running max m_run is in scaled units (q_scale > 0 keeps the raw
        # order), a weight is 2^(raw · q_scale - max), one FFMA and one ex2. A row that has seen only hidden
        # keys has max NEG · q_scale; its weights are taken against `floor` instead, so they are 0, not 1
        for h in T.unroll(2):
            stat[h] = T.max(sacc[h * 2], sacc[h * 2 + 1])
            for nt in T.unroll(1, nts):
                stat[h] = T.max(stat[h], T.max(sacc[nt * 4 + h * 2], sacc[nt * 4 + h * 2 + 1]))
            stat[h] = T.max(stat[h], T.call_extern("float32", "__shfl_xor_sync", full, stat[h], 1, WARP))
            stat[h] = T.max(stat[h], T.call_extern("float32", "__shfl_xor_sync", full, stat[h], 2, WARP))
            stat[h] = T.max(m_run[h], stat[h] * q_scale)  # the new running max
            stat[2 + h] = exp2(m_run[h] - stat[h])  # rescale of what came before
            m_run[h] = stat[h]
            stat[h] = T.max(stat[h], T.float32(floor))
        for nt in T.unroll(nts):
            for e in T.unroll(4):
                sacc[nt * 4 + e] = exp2(sacc[nt * 4 + e] * q_scale - stat[e // 2])
                pa[nt * 4 + e] = T.Cast(DTYPE, sacc[nt * 4 + e])
        for h in T.unroll(2):
            l_run[h] = l_run[h] * stat[2 + h]
            for nt in T.unroll(nts):
                l_run[h] = l_run[h] + (sacc[nt * 4 + h * 2] + sacc[nt * 4 + h * 2 + 1])
        for j in T.unroll(dts):
            for e in T.unroll(4):
                oacc[j * 4 + e] = oacc[j * 4 + e] * stat[2 + e // 2]

    return softmax


def row_sums_macro() -> Any:
    """`row_sums(l_run)`: each thread's partial sums of its two rows, added up over the row's lane quad."""
    from tvm.script import tirx as T

    full = T.uint32(0xFFFFFFFF)

    @T.macro
    def row_sums(l_run):
        for h in T.unroll(2):
            l_run[h] = l_run[h] + T.call_extern("float32", "__shfl_xor_sync", full, l_run[h], 1, WARP)
            l_run[h] = l_run[h] + T.call_extern("float32", "__shfl_xor_sync", full, l_run[h], 2, WARP)

    return row_sums


def attention_mma_func(spec: BlockAttentionSpec, plan: MmaAttentionPlan) -> Any:
    """The CUDA-scheduled PrimFunc (same parameters as the SIMT kernel's) following `plan`."""
    from tvm.script import tirx as T

    blk, hkv, dim, page, group = spec.block, spec.kv_heads, spec.head_dim, spec.page_size, spec.group
    rows, warps, splits = spec.block * spec.group, plan.warps, plan.splits
    steps = dim // 32  # 32-wide k steps of Q·Kᵀ (two mmas each)
    vcols = dim // 8  # d-tiles of P·V = head-dim elements of a V row per thread
    vvec = 8 if vcols % 8 == 0 else 4  # elements per V load (16 or 8 bytes)
    row_vectors = dim // 8  # 16-byte vectors per K/V row
    kw = plan.key_warps
    fetch = CHUNK * row_vectors // WARP // kw  # 16-byte vectors of K (and of V) a lane fetches per chunk
    pitch = staged_pitch(dim)

    def at(row: Any, chunk: Any) -> Any:
        # element offset of 16-byte chunk `chunk` of staged row `row` (within K or V)
        return row * pitch + staged_chunk(row, chunk, dim) * 8

    group_keys = warps * CHUNK
    chains = plan.qk_chains
    kt = plan.tile_chunks  # chunks per softmax step
    nts = 2 * kt  # 8-key n-tiles of S per step
    locate = locate_macro(spec, splits, plan.slots, CHUNK)
    softmax = softmax_macro(spec, nts)
    row_sums = row_sums_macro()
    mma = mma_m16n8k16()
    chunk_pages = (page + CHUNK - 2) // page + 1  # pages 16 consecutive keys can touch
    red_values = vcols * 4 + 4  # a thread's outputs, (max, sum) of its two rows
    kvs_elements = plan.shared_bytes(spec) // 2  # bf16 elements of the K/V staging (and the combine)
    slot_elements = 2 * group_keys * pitch  # one group's K and V
    ahead = max(plan.stages - 1, 1)  # groups fetched beyond the one computed
    async_copy = plan.stages > 0  # K/V copied straight into a ring of group slots
    smem_scope = "shared.dyn" if async_copy else "shared"

    def exp2(x: Any) -> Any:
        return T.call_extern("float32", EXP2, x)

    def page_slot(pslot: Any, e: Any) -> Any:
        # entry e of the chunk's pages as a chain of selects: a dynamic index would put pslot in local memory
        out = pslot[chunk_pages - 1]
        for i in reversed(range(chunk_pages - 1)):
            out = T.if_then_else(e == i, pslot[i], out)
        return out

    def vector_row(i: int, lane: Any, kg: Any) -> Any:
        # the chunk row (key) of lane's i-th 16-byte vector of a chunk's K or V (key_warps part kg)
        return ((kg * fetch + i) * WARP + lane) // row_vectors

    def vector_d0(i: int, lane: Any, kg: Any) -> Any:
        # the first head-dim element of that vector
        return ((kg * fetch + i) * WARP + lane) % row_vectors * 8

    def key_slot(pslot: Any, key: Any, first: Any, end: Any) -> Any:
        # the cache page slot of `key`, from the chunk's table entries (read_table)
        return page_slot(pslot, key // page - T.min(first, end - 1) // page)

    @T.macro
    def read_table(pslot, table, s, n, first, end):
        # the table entries of the pages a chunk's keys lie on (2 for pages of 16), unguarded (clamped to the
        # cache's last page): read one group before that group's K/V, so its loads never wait for them
        for e in T.unroll(chunk_pages):
            pslot[e] = table[s, T.min(T.min(first, end - 1) // page + e, T.max(T.min(n, end) - 1, 0) // page)]

    @T.macro
    def prefetch_chunk(pslot, kv, g, n, first, end, lane, kg):
        # the 128-byte lines of the chunk's cached K and V rows that fetch_chunk will load: a lane whose
        # vector starts a line prefetches it (a row of one kv head is dim·2 contiguous bytes); the slot is
        # clamped into the cache, since a prefetch's address must be valid
        for i in T.unroll(fetch):
            key = T.meta_var(T.min(first + vector_row(i, lane, kg), end - 1))
            d0 = T.meta_var(vector_d0(i, lane, kg))
            if key < n and d0 % LINE_ELEMENTS == 0:
                slot: T.let[T.int32] = T.max(T.min(key_slot(pslot, key, first, end), kv.shape[1] - 1), 0)
                for half in T.unroll(2):
                    T.evaluate(T.call_extern("void", PREFETCH_L2, T.address_of(kv[half, slot, key % page, g, d0])))

    @T.macro
    def fetch_chunk(kr, vr, kvs, base, pslot, kv, k, v, s, g, n, first, end, w, lane, kg):
        # lane's share of one chunk: vectors (kg·fetch + i)·32 + lane of the chunk's [16 keys, dim/8 vectors]
        # K and V (the chunk's key_warps warps take one part each), into registers (stages = 0) or straight
        # into the group's slot at `base` of the ring (cp.async)
        for i in T.unroll(fetch):
            key = T.meta_var(T.min(first + vector_row(i, lane, kg), end - 1))
            d0 = T.meta_var(vector_d0(i, lane, kg))
            dst = T.meta_var(base + at(w * CHUNK + vector_row(i, lane, kg), d0 // 8))
            if key < n:
                slot: T.let[T.int32] = key_slot(pslot, key, first, end)
                if async_copy:
                    T.evaluate(T.ptx["cp.async.cg.shared.global"](
                        T.address_of(kvs[dst]), T.address_of(kv[0, slot, key % page, g, d0]), 16))  # fmt: skip
                    T.evaluate(T.ptx["cp.async.cg.shared.global"](
                        T.address_of(kvs[dst + group_keys * pitch]), T.address_of(kv[1, slot, key % page, g, d0]),
                        16))  # fmt: skip
                else:
                    for x in T.vectorized(8):
                        kr[i, x] = kv[0, slot, key % page, g, d0 + x]
                    for x in T.vectorized(8):
                        vr[i, x] = kv[1, slot, key % page, g, d0 + x]
            elif async_copy:
                T.evaluate(T.ptx["cp.async.cg.shared.global"](
                    T.address_of(kvs[dst]), T.address_of(k[s * blk + key - n, g * dim + d0]), 16))  # fmt: skip
                T.evaluate(T.ptx["cp.async.cg.shared.global"](
                    T.address_of(kvs[dst + group_keys * pitch]), T.address_of(v[s * blk + key - n, g * dim + d0]),
                    16))  # fmt: skip
            else:
                for x in T.vectorized(8):
                    kr[i, x] = k[s * blk + key - n, g * dim + d0 + x]
                for x in T.vectorized(8):
                    vr[i, x] = v[s * blk + key - n, g * dim + d0 + x]

    @T.macro
    def stage_chunk(kr, vr, kvs, w, lane, kg):
        for i in T.unroll(fetch):
            c = T.meta_var(vector_row(i, lane, kg))
            d0 = T.meta_var(vector_d0(i, lane, kg))
            for x in T.vectorized(8):
                kvs[at(w * CHUNK + c, d0 // 8) + x] = kr[i, x]
            for x in T.vectorized(8):
                kvs[group_keys * pitch + at(w * CHUNK + c, d0 // 8) + x] = vr[i, x]

    @T.macro
    def compute_tile(c, k0, kvs, base, qf, kl, kb, vl, vb, sacc, pa, oacc, m_run, l_run, stat, q_at,
                     blk_positions, s, n, end, gq, tq):  # fmt: skip
        # S = Q·Kᵀ over the tile's 16·kt keys (the group's chunks c·kt ...): n-tile nt holds keys k0 + 8·nt + gq
        for i in T.unroll(4 * nts * chains):
            sacc[i] = T.float32(0)
        for nt in T.unroll(nts):
            for st in T.unroll(steps):
                for x in T.vectorized(8):
                    kl[x] = kvs[base + at(c * kt * CHUNK + nt * 8 + gq, st * 4 + tq) + x]
                for x in T.unroll(8):
                    kb[(nt * steps + st) * 8 + x] = kl[x]
        for nt in T.unroll(nts):
            for st in T.unroll(steps):
                for j in T.unroll(2):
                    # k step st·2 + j accumulates into chain (st·2 + j) % chains; the chains are summed below
                    mma(qf, (st * 2 + j) * 8, kb, (nt * steps + st) * 8 + 4 * j, sacc,
                        ((st * 2 + j) % chains) * 4 * nts + nt * 4)  # fmt: skip
        for i in T.unroll(4 * nts * (chains - 1)):
            sacc[i % (4 * nts)] = sacc[i % (4 * nts)] + sacc[4 * nts + i]
        softmax(sacc, pa, oacc, m_run, l_run, stat, q_at, blk_positions, s, n, k0, end, gq, tq)
        # O += P·V per chunk ks of the tile: its P fragment is n-tiles 2ks, 2ks + 1 of S (keys in natural
        # order); B fragment of d-tile j = element j of the thread's V vectors of keys 2tq, 2tq+1, 8+2tq, 9+2tq
        for ks_ in T.unroll(kt):
            for kk in T.unroll(4):
                for cv in T.unroll(vcols // vvec):
                    for x in T.vectorized(vvec):
                        vrow = T.meta_var((c * kt + ks_) * CHUNK + kk // 2 * 8 + tq * 2 + kk % 2)
                        vbase = T.meta_var(base + group_keys * pitch)  # the slot's V
                        if dim % 64 == 0:  # whole 16-byte chunks gq·dim/64 + cv, swizzled
                            vl[kk, cv * vvec + x] = kvs[vbase + at(vrow, gq * (vcols // 8) + cv) + x]
                        else:
                            vl[kk, cv * vvec + x] = kvs[vbase + vrow * pitch + gq * vcols + cv * vvec + x]
            for j in T.unroll(vcols):
                for kk in T.unroll(4):
                    vb[j * 4 + kk] = vl[kk, j]
            for j in T.unroll(vcols):
                mma(pa, ks_ * 8, vb, j * 4, oacc, j * 4)

    @T.macro
    def split(q, k, v, kv, block_table, cache_lens, blk_positions, part_o, part_ml, nb):
        for s in T.thread_binding(nb, thread="blockIdx.z"):
            for g in T.thread_binding(hkv, thread="blockIdx.y"):
                for p in T.thread_binding(span_count(spec, splits, plan.slots, nb), thread="blockIdx.x"):
                    for ty in T.thread_binding(warps * kw, thread="threadIdx.y"):
                        for lane in T.thread_binding(WARP, thread="threadIdx.x"):
                            with T.sblock("split"):
                                T.reads()
                                T.writes()
                                # one allocation: per group slot the staged K, then V; at the end the warps'
                                # partial results of the key_warps > 1 combine
                                kvs = T.sblock_alloc_buffer((kvs_elements,), DTYPE, scope=smem_scope)
                                red = T.decl_buffer((red_values, warps * WARP), "float32", data=kvs.data,
                                                    scope=smem_scope)  # fmt: skip
                                span = T.sblock_alloc_buffer((4,), "int32", scope="local")
                                ql = T.sblock_alloc_buffer((8,), DTYPE, scope="local")
                                qf = T.sblock_alloc_buffer((steps * 16,), DTYPE, scope="local")
                                kr = T.sblock_alloc_buffer((fetch, 8), DTYPE, scope="local")
                                vr = T.sblock_alloc_buffer((fetch, 8), DTYPE, scope="local")
                                pslot = T.sblock_alloc_buffer((chunk_pages,), "int32", scope="local")
                                kl = T.sblock_alloc_buffer((8,), DTYPE, scope="local")
                                kb = T.sblock_alloc_buffer((nts * steps * 8,), DTYPE, scope="local")
                                vl = T.sblock_alloc_buffer((4, vcols), DTYPE, scope="local")
                                vb = T.sblock_alloc_buffer((vcols * 4,), DTYPE, scope="local")
                                sacc = T.sblock_alloc_buffer((4 * nts * chains,), "float32", scope="local")
                                pa = T.sblock_alloc_buffer((4 * nts,), DTYPE, scope="local")
                                oacc = T.sblock_alloc_buffer((vcols * 4,), "float32", scope="local")
                                m_run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                                l_run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                                stat = T.sblock_alloc_buffer((4,), "float32", scope="local")
                                q_at = T.sblock_alloc_buffer((2,), "int32", scope="local")

                                gq = T.meta_var(lane // 4)
                                tq = T.meta_var(lane % 4)
                                w = T.meta_var(ty % warps)  # the warp's 16 query rows
                                kg = T.meta_var(ty // warps)  # and its share of each group's tiles
                                me = T.meta_var(w * WARP + lane)  # the thread's column of `red`
                                # waits first and never triggers: its dependents, launched early, would sit
                                # resident beside it for its whole run (dependent_launch.py)
                                start = T.meta_var(span[0])
                                end = T.meta_var(span[2])
                                chunks = T.meta_var(span[3])
                                if plan.prefetch > 0:
                                    # before the wait, the step's lengths and block tables (the host writes
                                    # them, no kernel of the step does) locate the first groups' cached K/V,
                                    # prefetched into L2 while the kernel before drains. Only prefetches use
                                    # them: after the wait everything is read again, so a stale value could
                                    # cost a useless prefetch, never a wrong result
                                    n_early: T.let[T.int32] = cache_lens[s]
                                    locate(span, s, n_early, p, blk_positions, nb)
                                    for j in T.unroll(plan.prefetch):
                                        if j * warps < chunks:
                                            first_key = T.meta_var(start + (j * warps + w) * CHUNK)
                                            read_table(pslot, block_table, s, n_early, first_key, end)
                                            prefetch_chunk(pslot, kv, g, n_early, first_key, end, lane, kg)
                                T.evaluate(T.call_extern("void", WAIT))
                                n: T.let[T.int32] = cache_lens[s]
                                locate(span, s, n, p, blk_positions, nb)

                                # Q fragments of rows gq, gq + 8 of this warp (rows past the block read the last)
                                for h in T.unroll(2):
                                    r = T.meta_var(T.min(w * 16 + h * 8 + gq, rows - 1))
                                    q_at[h] = blk_positions[s * blk + r // group]
                                    for st in T.unroll(steps):
                                        for x in T.vectorized(8):
                                            ql[x] = q[s * blk + r // group, (g * group + r % group) * dim + st * 32
                                                      + tq * 8 + x]  # fmt: skip
                                        for j in T.unroll(2):
                                            for hi in T.unroll(2):
                                                for e in T.unroll(2):
                                                    qf[(st * 2 + j) * 8 + hi * 4 + h * 2 + e] = ql[4 * j + hi * 2 + e]
                                for h in T.unroll(2):
                                    m_run[h] = T.float32(NEG)
                                    l_run[h] = T.float32(0)
                                for i in T.unroll(vcols * 4):
                                    oacc[i] = T.float32(0)

                                # the groups in flight: `ahead` beyond the one computed (its table entries one
                                # further); group j's chunk w starts at key start + (j·warps + w)·16
                                for j in T.unroll(ahead):
                                    if j * warps < chunks:
                                        read_table(pslot, block_table, s, n, start + (j * warps + w) * CHUNK, end)
                                        fetch_chunk(kr, vr, kvs, j * slot_elements, pslot, kv, k, v, s, g, n,
                                                    start + (j * warps + w) * CHUNK, end, w, lane, kg)  # fmt: skip
                                    if async_copy:
                                        T.evaluate(T.ptx["cp.async.commit_group"]())
                                if ahead * warps < chunks:
                                    read_table(pslot, block_table, s, n, start + (ahead * warps + w) * CHUNK, end)
                                for grp in T.serial(T.ceildiv(chunks, warps)):
                                    if async_copy:
                                        T.evaluate(T.ptx["cp.async.wait_group"](plan.stages - 2))
                                    else:
                                        stage_chunk(kr, vr, kvs, w, lane, kg)
                                    # group grp is staged; every warp left group grp - 1, whose slot refills
                                    T.tvm_storage_sync("shared")
                                    nxt = T.meta_var(grp + ahead)  # the group whose copies go out now
                                    if nxt * warps < chunks:
                                        fetch_chunk(kr, vr, kvs, nxt % max(plan.stages, 1) * slot_elements, pslot, kv,
                                                    k, v, s, g, n, start + (nxt * warps + w) * CHUNK, end, w, lane,
                                                    kg)  # fmt: skip
                                        if (nxt + 1) * warps < chunks:
                                            read_table(pslot, block_table, s, n,
                                                       start + ((nxt + 1) * warps + w) * CHUNK, end)  # fmt: skip
                                    if async_copy:
                                        T.evaluate(T.ptx["cp.async.commit_group"]())
                                    for cc in T.unroll(warps // kt // kw):
                                        c = T.meta_var(cc * kw + kg)
                                        # the last group's tiles past the split's chunks hold no key: skipped
                                        if grp * warps + c * kt < chunks:
                                            compute_tile(c, start + (grp * warps + c * kt) * CHUNK, kvs,
                                                         grp % max(plan.stages, 1) * slot_elements, qf, kl, kb, vl,
                                                         vb, sacc, pa, oacc, m_run, l_run, stat, q_at, blk_positions,
                                                         s, n, end, gq, tq)  # fmt: skip
                                    if not async_copy:
                                        T.tvm_storage_sync("shared")  # the slot is staged again next group
                                if async_copy and kw > 1:
                                    # the combine reuses the ring: every copy landed, every warp left its group
                                    T.evaluate(T.ptx["cp.async.wait_all"]())
                                    T.tvm_storage_sync("shared")
                                for r in T.unroll(1, kw):
                                    # warps kg = r hand their (max, per-thread sum, outputs) to warps kg = 0, which
                                    # rescale both to the larger max, as a softmax step does
                                    if kg == r:
                                        for h in T.unroll(2):
                                            red[h, me] = m_run[h]
                                            red[2 + h, me] = l_run[h]
                                        for i in T.unroll(vcols * 4):
                                            red[4 + i, me] = oacc[i]
                                    T.tvm_storage_sync("shared")
                                    if kg == 0:
                                        for h in T.unroll(2):
                                            stat[h] = T.max(m_run[h], red[h, me])
                                            stat[2 + h] = exp2(red[h, me] - stat[h])
                                            m_run[h] = exp2(m_run[h] - stat[h])  # own factor; max set below
                                            l_run[h] = l_run[h] * m_run[h] + red[2 + h, me] * stat[2 + h]
                                        for i in T.unroll(vcols * 4):
                                            oacc[i] = (oacc[i] * m_run[i % 4 // 2]
                                                       + red[4 + i, me] * stat[2 + i % 4 // 2])  # fmt: skip
                                        for h in T.unroll(2):
                                            m_run[h] = stat[h]
                                    T.tvm_storage_sync("shared")

                                # this split's unnormalised rows and (max, sum); an empty split leaves sum 0
                                row_sums(l_run)
                                for h in T.unroll(2):
                                    if kg == 0 and w * 16 + h * 8 + gq < rows:
                                        if chunks > 0:
                                            # a thread's columns (2tq + e)·vcols + j are contiguous in j:
                                            # float4 stores, a quarter of the scattered scalar ones
                                            for e in T.unroll(2):
                                                for jv in T.unroll(vcols // 4):
                                                    for x in T.vectorized(4):
                                                        part_o[s, g, p, w * 16 + h * 8 + gq,
                                                               (tq * 2 + e) * vcols + jv * 4 + x] = (
                                                            oacc[(jv * 4 + x) * 4 + h * 2 + e]
                                                        )  # fmt: skip
                                        if tq == 0:
                                            part_ml[s, g, p, w * 16 + h * 8 + gq, 0] = m_run[h]
                                            part_ml[s, g, p, w * 16 + h * 8 + gq, 1] = l_run[h]

    return attention_prim_func(spec, splits, CHUNK, True, split, plan.slots).with_attr("tirx.is_scheduled", True)


class AttentionMmaRule(BlockAttentionOp, FamilyRule):
    """`block_attention` on tensor cores where `mma_attention_fits` (else the SIMT AttentionRule takes it).

    Knobs: `splits`, thread blocks one (sequence, kv head) is split across at most (spans adapt to each
    length); `slots`, the grid a batch's splits aim at (0: off), so a larger batch takes fewer splits;
    `tile_chunks`, chunks per softmax step (by default the most, up to 2, that divide the warps);
    `qk_chains`, accumulator chains of Q·Kᵀ; `key_warps`, warps per 16 query rows, which take turns over a
    group's tiles and combine their results through shared memory at the end; `stages`, 0 to stage each
    group's K/V through registers, or the group slots of a cp.async ring in dynamic shared memory;
    `prefetch`, the groups whose cached K/V lines go to L2 before the wait for inputs (dependent_launch.py),
    so under a dependent launch they stream while the kernel before drains.

    Defaults from the H200 (bench/attention.py shapes, Qwen3-8B drafter, 4096 cached keys; µs of split +
    merge with the launch): 4 blocks per SM of slots (two waves of the two blocks an SM holds at the
    kernel's ~255 registers) take 8 splits at 8 sequences and 4 at 16: 52.9 µs at nb = 8 and 117.3 at
    nb = 16, against 70.4 and 153.8 with 16 splits for every batch; a quarter of that grid (4 splits at
    nb = 8) took 68.1. Two chunks per step with two Q·Kᵀ chains: 52.9 / 117.3 against 56.3 / 125.2 for one
    and one. One sequence keeps its 16 splits (29.5 µs either way; 8 splits: 35.2).

    One warp per row tile: two (226 registers, one 256-thread block per SM) took 25.5 against 25.6 µs for
    one sequence and 65.1 / 141.4 against 52.4 / 124.1 at nb = 8 / 16.

    Swizzled unpadded rows (one wavefront per fragment read) with the table read a group ahead, 16 splits
    for every batch: 24.8 / 49.6 / 110.3 µs at nb = 1 / 8 / 16 against 25.6 / 52.8 / 124.2 with padded rows.
    The cp.async ring gave nothing on top: 25.8 / 49.6 / 109.9 with two slots, 25.7 / 50.3 / 110.2 with
    three, 26.1 / 63.7 / 137.9 with four (its shared memory leaves one block per SM), so stages stays 0.
    Neither more loads in flight (the ring) nor more blocks per SM (two slots at 168 registers, three blocks
    per SM: 23.7 / 48.7 / 99.4 against 23.0 / 47.0 / 101.1) moves it: each warp's chain of dependent work
    per group sets the pace, which is why fewer instructions per score (one FFMA and one ex2) did.
    Prefetching two groups before the wait: the split kernel added 74.0 µs to a one-sequence drafter step
    (five layers) against 78.8-79.3 without; at nb = 8, 372.4 against 366.8-372.2.
    """

    name = "block_attention_mma"
    knob_names = ("splits", "qk_chains", "tile_chunks", "slots", "key_warps", "stages", "prefetch")

    def default_knobs(self, target: Target) -> dict[str, int]:
        return {
            "splits": default_splits(target),
            "qk_chains": 2,
            "tile_chunks": 2,
            "slots": 4 * target.sm_count,
            "key_warps": 1,
            "stages": 0,
            "prefetch": 2,
        }

    def apply(self, subject: Any, target: Target, knobs: Mapping[str, int] | None = None) -> Kernel | None:
        spec = self.spec_of(subject)
        if spec is None or not mma_attention_fits(spec, target):
            return None
        if "tile_chunks" not in (knobs or {}):
            # the default step takes as many chunks as divide the group (a group of one warp has one)
            default = self.default_knobs(target)["tile_chunks"]
            warps = _warps(spec)
            knobs = {**(knobs or {}), "tile_chunks": max(d for d in range(1, default + 1) if warps % d == 0)}
        return super().apply(spec, target, knobs)

    def schedule(self, spec: BlockAttentionSpec, target: Target, knobs: Mapping[str, int]) -> Any:
        plan = fit_mma_attention(
            spec,
            target,
            knobs["splits"],
            knobs["qk_chains"],
            knobs["tile_chunks"],
            knobs["slots"],
            knobs["key_warps"],
            knobs["stages"],
            knobs["prefetch"],
        )
        return attention_mma_func(spec, plan)
