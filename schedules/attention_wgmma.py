"""Block attention on warpgroup MMAs (sm_90a): the split kernel of `attention_mma.py` with both products as
`wgmma.mma_async`, so no warp reads a K/V fragment from shared memory itself.

The mma.sync kernel has each of a block's four warps read the whole staged group of K and V from shared
memory into registers for its own 16 query rows: 128 KiB of fragment loads per 64 keys and block, which
with the staging stores keeps the SM's shared-memory pipe busy and its warps waiting (on the H200 ~5,200
cycles per 64-key group, one block per SM, at 4.5 cycles per issued instruction). A warpgroup MMA reads
its operands once for the four warps, straight from shared memory.

Thread block = one warpgroup for (split, kv head, sequence), as in the mma kernel's grid; its 64 rows are
the query rows (block row r // group, head r % group of the kv head's group), rows past block · group
reading the last row and never stored. Shared memory holds Q and a ring of `stages` slots of one 64-key
group's K and V, every tile as [head_dim / 64 atoms][64 rows][64 bf16] with the 128-byte swizzle
(16-byte chunk c of row r at chunk c xor r mod 8; `dflash_compiler/wgmma.py`):

* S = Q·Kᵀ: `m64n64k16` per 16 head-dim columns, A = the Q tile, B = the K tile, both K-major (a K row is
  one key's head_dim elements). The accumulators are mma.sync's m16n8 layout per warp: n-tile j holds keys
  8j + 2t + {0, 1} of rows g and g + 8 (lane = 4g + t).
* online softmax in base 2 on them, as in the mma kernel: a row's scores sit in one lane quad, whose max is
  combined with two xor shuffles; a weight is one FFMA and one ex2.
* O += P·V: `m64n{head_dim}k16` per 16 keys with A = P from registers (the S accumulators of n-tiles 2i,
  2i + 1 are exactly the m16n8k16 A fragment of keys 16i .. 16i + 15) and B = the V tile read N-major
  (`imm-trans-b`): the same [atom][key][64] layout, whose rows now run along N (head dim), 64-column
  blocks one tile apart (the leading byte offset) and 8-key groups 1024 bytes apart.

The K/V of group grp + stages - 1 is copied with 16-byte `cp.async`s straight into its ring slot (cached
rows through the page table, whose entries are read one group earlier still, then the block's own rows)
while group grp is multiplied, so no register holds a load in flight (128 registers, against 201 for
staging through registers). Per group a thread waits for its own copies of the group, makes them visible
to the async proxy (`fence.proxy.async`), and a block barrier makes everyone's visible and ends every read
of the slot the next copies refill (the group before's wgmmas, waited for). Keys past the split's end read
its last key and score -inf, as do keys a mask hides. The splits, their spans and the partial results are
the mma kernel's (`attention_prim_func`), so `attention_merge.py`'s merge kernel serves both. Before the wait
for inputs the first `prefetch` groups' cached K/V lines are prefetched into L2, from the host-written
lengths and tables. With knob `early` the span, its length and the first group's page-table entries are
located before that wait too and kept in registers (the host writes them; no kernel of the step does), and
after it Q goes to shared memory by `cp.async` beside the first group's copies: the first K/V copies then
leave right after the wait, not behind the length, span, Q and table loads that each waited for the one
before (rows of Q in registers first, then in shared memory, block the copies after them). With knob
`trigger` each block lets the merge grid in once it has issued its last group's copies (after its prologue
when that held them all), so the merge grid is launched while the split's last groups run, and its blocks
wait on the SMs the split's blocks leave, instead of the grid being launched when the split completes.

With knob `cluster` (a power of two up to 16) a batch whose span count is 2, 4, .. `cluster` launches
instead one kernel whose spans of a (sequence, kv head) are one thread block cluster: each block leaves its
unnormalised rows and (max, sum) in its own shared memory, and the cluster merges them there
(`cluster_merge_macro`), so no workspace is written and no merge kernel runs. Other span counts keep the
two kernels. It is off by default (`AttentionWgmmaRule` has the figures).

With knob `l2_ahead` f > 0 each group, once it has issued the copies of group grp + stages - 1, also prefetches
into L2 the cached K/V lines of group grp + stages - 1 + f, through page-table entries it read one group earlier
(the prologue reads the first ones), so that those copies, when their turn comes, read L2 rather than DRAM:
the ring's depth in time without its shared memory. Off by default (`AttentionWgmmaRule` has the figures).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dflash_compiler.cluster import DIMS, LOAD4, MAX_CLUSTER, SYNC
from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, PREFETCH_L2, WAIT
from dflash_compiler.targets import Target
from dflash_compiler.wgmma import (
    COMMIT,
    FENCE,
    FENCE_ASYNC_SHARED,
    REQUIRE_ALIGNED,
    SWIZZLE_BYTES,
    mma_name,
    mma_rs_name,
    wait_name,
)

from .attention import BlockAttentionOp, BlockAttentionSpec, default_splits
from .attention_merge import DTYPE, NEG, attention_prim_func, span_count
from .attention_mma import CHUNK, LINE_ELEMENTS, locate_macro, row_sums_macro, softmax_macro
from .base import FamilyRule, Kernel, ScheduleError

WARP = 32
WARPGROUP = 4 * WARP
ROWS = 64  # query rows of a block: wgmma's M
KEYS = 64  # keys per group: the N of S = Q·Kᵀ
ATOM = SWIZZLE_BYTES // 2  # bf16 per swizzled row
TILE = ROWS * ATOM  # bf16 elements of one atom of a 64-row tile (Q, K and V tiles all have 64 rows)
WGMMA_K = 16
DEFAULT_STAGES = 3
MERGE_STATS = 8  # f32 past a row's outputs in the cluster merge's tile: (max, sum), then pad (16-byte rows)
MERGE_THREADS = WARPGROUP
DEFAULT_L2_AHEAD = 0  # off: slower in the step (AttentionWgmmaRule says why); a tuning database may turn it on
DEFAULT_CLUSTER = 0  # off: slower in the step (AttentionWgmmaRule says why); a tuning database may turn it on


def tile_offset(row: Any, vector: Any) -> Any:
    """The bf16 element offset of 16-byte vector `vector` (head-dim elements 8·vector ..) of row `row` of a
    tile (ints or TIR): atom vector // 8, then 128-byte rows, chunk vector mod 8 xor-swizzled by the row. Read
    K-major it is wgmma's 128-byte-swizzled tile with 8-row groups 1024 bytes apart; read N-major (a row per
    k, head dim along N) the same bytes are the N-major one with 64-column blocks TILE · 2 bytes apart."""
    return vector // 8 * TILE + row * ATOM + ((vector % 8) ^ (row % 8)) * 8


@dataclass(frozen=True)
class WgmmaAttentionPlan:
    """The resolved shape of one warpgroup attention kernel."""

    splits: int  # thread blocks per (sequence, kv head)
    slots: int = 0  # > 0: the grid a batch's splits aim at (blocks); a larger batch takes fewer splits
    prefetch: int = 0  # groups whose cached K/V lines are prefetched into L2 before the wait for inputs
    stages: int = DEFAULT_STAGES  # ring slots of one group's K and V; stages - 1 groups' copies fly ahead
    cluster: int = 0  # > 0: span counts 2, 4, .. cluster run as one cluster that merges itself
    early: int = 0  # 1: span, length and first table entries located before the wait, Q by cp.async after it
    trigger: int = 0  # 1: the split kernel lets its dependents in once its last copies are issued (0: never)
    l2_ahead: int = 0  # > 0: each group prefetches into L2 the cached K/V of the group this far past its copies

    @property
    def cluster_counts(self) -> tuple[int, ...]:
        """The span counts that get a cluster kernel: the powers of two from 2 up to `cluster`."""
        return tuple(1 << i for i in range(1, self.cluster.bit_length()) if 1 << i <= self.cluster)

    def shared_bytes(self, spec: BlockAttentionSpec) -> int:
        """The Q tile and the ring's slots of a group's K and V tiles."""
        return (1 + 2 * self.stages) * (spec.head_dim // ATOM) * TILE * 2

    @staticmethod
    def cluster_shared_bytes(spec: BlockAttentionSpec) -> int:
        """The cluster merge's f32 tile over the same memory: 64 rows of head_dim outputs, (max, sum) and pad."""
        return ROWS * (spec.head_dim + MERGE_STATS) * 4


def wgmma_attention_fits(spec: BlockAttentionSpec, target: Target) -> bool:
    """Targets with wgmma; one warpgroup's 64 rows hold the block's query rows of a kv head; head dims of
    whole 64-wide swizzle atoms up to 128 (the output accumulators of 256 would not fit the registers)."""
    return (
        target.wgmma
        and target.warp_size == WARP
        and spec.block * spec.group <= ROWS
        and spec.head_dim in (64, 128)
        and WgmmaAttentionPlan(splits=1).shared_bytes(spec) <= target.max_shared_memory_per_block
    )


def fit_wgmma_attention(
    spec: BlockAttentionSpec,
    target: Target,
    splits: int,
    slots: int = 0,
    prefetch: int = 0,
    stages: int = DEFAULT_STAGES,
    cluster: int = 0,
    early: int = 0,
    trigger: int = 0,
    l2_ahead: int = 0,
) -> WgmmaAttentionPlan:
    """The plan for `spec` (which `wgmma_attention_fits` `target`) with these knobs, checked."""
    if not 1 <= splits <= 256:
        raise ScheduleError(f"{AttentionWgmmaRule.name} knob splits={splits}: expected 1 to 256")
    if slots < 0:
        raise ScheduleError(f"{AttentionWgmmaRule.name} knob slots={slots}: expected 0 (off) or a block count")
    if not 0 <= prefetch <= 16:
        raise ScheduleError(
            f"{AttentionWgmmaRule.name} knob prefetch={prefetch}: expected 0 (off) to 16 groups prefetched before "
            "the wait for inputs"
        )
    if cluster and (cluster & (cluster - 1) or not 2 <= cluster <= min(splits, MAX_CLUSTER)):
        raise ScheduleError(
            f"{AttentionWgmmaRule.name} knob cluster={cluster}: expected 0 (a merge kernel) or a power of two from 2 "
            f"to min(splits={splits}, {MAX_CLUSTER}), the largest cluster of spans that merges itself"
        )
    if early not in (0, 1):
        raise ScheduleError(
            f"{AttentionWgmmaRule.name} knob early={early}: expected 0 (everything located after the wait for "
            "inputs) or 1 (the span and the first table entries before it, Q copied by cp.async after it)"
        )
    if trigger not in (0, 1):
        raise ScheduleError(
            f"{AttentionWgmmaRule.name} knob trigger={trigger}: expected 0 (the merge kernel comes in as the split's "
            "blocks exit) or 1 (once every split block has issued its last copies)"
        )
    if not 0 <= l2_ahead <= 16:
        raise ScheduleError(
            f"{AttentionWgmmaRule.name} knob l2_ahead={l2_ahead}: expected 0 (off) to 16 groups past the ring's copies "
            "whose cached K/V each group prefetches into L2"
        )
    # the cluster merge's tile always fits: 64 · (head_dim + 8) floats against (1 + 2 · stages) · 64 · head_dim bf16
    plan = WgmmaAttentionPlan(splits, slots, prefetch, stages, cluster, early, trigger, l2_ahead)
    if stages < 2:
        raise ScheduleError(
            f"{AttentionWgmmaRule.name} knob stages={stages}: expected 2 or more ring slots (one group multiplied "
            "while the next ones' copies fly)"
        )
    if plan.shared_bytes(spec) > target.max_shared_memory_per_block:
        raise ScheduleError(
            f"{AttentionWgmmaRule.name} knob stages={stages}: {plan.shared_bytes(spec)} bytes of shared memory, "
            f"expected at most {target.max_shared_memory_per_block} on {target.name}; fewer stages"
        )
    return plan


def attention_wgmma_func(spec: BlockAttentionSpec, plan: WgmmaAttentionPlan) -> Any:
    """The CUDA-scheduled PrimFunc (same parameters and partial results as the mma kernel's) of `plan`."""
    from tvm.script import tirx as T

    blk, hkv, dim, page, group = spec.block, spec.kv_heads, spec.head_dim, spec.page_size, spec.group
    rows, splits, stages = spec.block * spec.group, plan.splits, plan.stages
    ahead = stages - 1  # groups whose copies are in flight beyond the one multiplied
    atoms = dim // ATOM
    vecs = dim // 8  # 16-byte vectors per row
    fetch = ROWS * vecs // WARPGROUP  # vectors of a tile (Q, or one group's K and V each) per thread
    nts = KEYS // 8  # 8-key n-tiles of S
    dts = dim // 8  # 8-column n-tiles of O
    q_elems = atoms * TILE
    slot_elems = 2 * atoms * TILE  # one group's K, then its V
    lbo = TILE * 2  # bytes between the 64-column blocks of a V tile read N-major
    mma_s, wait_s = mma_name(KEYS), wait_name(KEYS)
    mma_o, wait_o = mma_rs_name(dim), wait_name(dim)
    # the mma kernel's span logic (in groups of KEYS), softmax step (KEYS at once) and row sums
    locate = locate_macro(spec, splits, plan.slots, KEYS)
    softmax = softmax_macro(spec, nts)
    row_sums = row_sums_macro()

    def vector_row(i: int, tid: Any) -> Any:
        return (i * WARPGROUP + tid) // vecs

    def vector_index(i: int, tid: Any) -> Any:
        return (i * WARPGROUP + tid) % vecs

    def group_key(first: Any, i: int, tid: Any, end: Any) -> Any:
        # the key of the thread's i-th vector of a group starting at `first`; past the split's end, its last
        return T.min(first + vector_row(i, tid), end - 1)

    @T.macro
    def read_table(pt, table, s, n, first, end, tid):
        # the page slot of each of the thread's keys of the group at `first` (clamped into the cache)
        for i in T.unroll(fetch):
            pt[i] = table[s, T.max(T.min(group_key(first, i, tid, end), n - 1), 0) // page]

    @T.macro
    def prefetch_group(pt, kv, g, n, first, end, tid):
        # a vector that starts a 128-byte line of a cached K or V row prefetches that line into L2
        for i in T.unroll(fetch):
            key = T.meta_var(group_key(first, i, tid, end))
            if key < n and vector_index(i, tid) * 8 % LINE_ELEMENTS == 0:
                slot: T.let[T.int32] = T.max(T.min(pt[i], kv.shape[1] - 1), 0)
                for half in T.unroll(2):
                    T.evaluate(T.call_extern(
                        "void", PREFETCH_L2, T.address_of(kv[half, slot, key % page, g, vector_index(i, tid) * 8])
                    ))  # fmt: skip

    @T.macro
    def copy16(dst, src):
        T.evaluate(T.ptx["cp.async.cg.shared.global"](T.address_of(dst), T.address_of(src), 16))

    @T.macro
    def copy_group(sm, base, pt, kv, k, v, s, g, n, first, end, tid):
        # the thread's 16-byte vectors of the group's K and V, copied straight into slot `base` (cp.async):
        # cached rows through the page table, the block's own rows from k and v
        for i in T.unroll(fetch):
            key = T.meta_var(group_key(first, i, tid, end))
            d0 = T.meta_var(vector_index(i, tid) * 8)
            dst = T.meta_var(base + tile_offset(vector_row(i, tid), vector_index(i, tid)))
            if key < n:
                copy16(sm[dst], kv[0, pt[i], key % page, g, d0])
                copy16(sm[dst + atoms * TILE], kv[1, pt[i], key % page, g, d0])
            else:
                copy16(sm[dst], k[s * blk + key - n, g * dim + d0])
                copy16(sm[dst + atoms * TILE], v[s * blk + key - n, g * dim + d0])

    early = bool(plan.early)
    trigger = bool(plan.trigger)
    far = plan.l2_ahead
    far_entries = fetch if far > 0 else 1

    def split_macro(cluster: int) -> Any:
        # cluster 0: the split kernel, partial results to the workspaces; else the kernel of `cluster` spans
        # launched as one cluster, merging them itself into `out`
        merge_in_cluster = cluster_merge_macro(spec, cluster) if cluster else None

        @T.macro
        def split(q, k, v, kv, block_table, cache_lens, blk_positions, part_o, part_ml, out, nb):
            for s in T.thread_binding(nb, thread="blockIdx.z"):
                for g in T.thread_binding(hkv, thread="blockIdx.y"):
                    for p in T.thread_binding(cluster if cluster > 0 else span_count(spec, splits, plan.slots, nb),
                                              thread="blockIdx.x"):  # fmt: skip
                        for ty in T.thread_binding(4, thread="threadIdx.y"):
                            for lane in T.thread_binding(WARP, thread="threadIdx.x"):
                                with T.sblock("split"):
                                    T.reads()
                                    T.writes()
                                    # the Q tile, then per slot the group's K tile and V tile
                                    sm = T.sblock_alloc_buffer((q_elems + stages * slot_elems,), DTYPE,
                                                               scope="shared.dyn")  # fmt: skip
                                    span = T.sblock_alloc_buffer((4,), "int32", scope="local")
                                    pt = T.sblock_alloc_buffer((fetch,), "int32", scope="local")
                                    # l2_ahead: the table entries of the next group to prefetch into L2
                                    pf = T.sblock_alloc_buffer((far_entries,), "int32", scope="local")
                                    sacc = T.sblock_alloc_buffer((4 * nts,), "float32", scope="local")
                                    pa = T.sblock_alloc_buffer((4 * nts,), DTYPE, scope="local")
                                    oacc = T.sblock_alloc_buffer((4 * dts,), "float32", scope="local")
                                    m_run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                                    l_run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                                    stat = T.sblock_alloc_buffer((4,), "float32", scope="local")
                                    q_at = T.sblock_alloc_buffer((2,), "int32", scope="local")
                                    length = T.sblock_alloc_buffer((1,), "int32", scope="local")  # early

                                    tid = T.meta_var(ty * WARP + lane)
                                    gq = T.meta_var(lane // 4)
                                    tq = T.meta_var(lane % 4)
                                    start = T.meta_var(span[0])
                                    end = T.meta_var(span[2])
                                    groups = T.meta_var(span[3])
                                    T.evaluate(T.call_extern("void", REQUIRE_ALIGNED, T.address_of(sm[0])))
                                    if cluster > 0:  # the spans of a (sequence, kv head) are one cluster along x
                                        T.evaluate(T.call_extern("void", DIMS, cluster, 1, 1))
                                    if early:
                                        # the step's lengths, positions and block tables are the host's (no
                                        # kernel of the step writes them): the span and the first group's table
                                        # entries are located once, here, and kept
                                        length[0] = cache_lens[s]
                                        locate(span, s, length[0], p, blk_positions, nb)
                                    if plan.prefetch > 0:
                                        # before the wait, the step's lengths and block tables (the host writes
                                        # them, no kernel of the step does) locate the first groups' cached K/V;
                                        # only prefetches use them (without `early`, everything is read again
                                        # after the wait)
                                        n_early: T.let[T.int32] = length[0] if early else cache_lens[s]
                                        if not early:
                                            locate(span, s, n_early, p, blk_positions, nb)
                                        for j in T.unroll(plan.prefetch):
                                            if j < groups:
                                                read_table(pt, block_table, s, n_early, start + j * KEYS, end, tid)
                                                prefetch_group(pt, kv, g, n_early, start + j * KEYS, end, tid)
                                    if early and groups > 0:
                                        read_table(pt, block_table, s, length[0], start, end, tid)
                                    # waits first (dependent_launch.py); the split kernel triggers only with
                                    # `trigger`, once its last copies are out, and a cluster kernel once its keys
                                    # are done
                                    T.evaluate(T.call_extern("void", WAIT))
                                    n: T.let[T.int32] = length[0] if early else cache_lens[s]
                                    if not early:
                                        locate(span, s, n, p, blk_positions, nb)

                                    # Q: rows past the block's read its last row; early, by cp.async in the
                                    # first group's commit group, so the group's copies follow at once
                                    for i in T.unroll(fetch):
                                        r = T.meta_var(T.min(vector_row(i, tid), rows - 1))
                                        q_col = T.meta_var((g * group + r % group) * dim + vector_index(i, tid) * 8)
                                        if early:
                                            copy16(sm[tile_offset(vector_row(i, tid), vector_index(i, tid))],
                                                   q[s * blk + r // group, q_col])  # fmt: skip
                                        else:
                                            for x in T.vectorized(8):
                                                sm[tile_offset(vector_row(i, tid), vector_index(i, tid)) + x] = q[
                                                    s * blk + r // group, q_col + x
                                                ]
                                    for h in T.unroll(2):
                                        q_at[h] = blk_positions[
                                            s * blk + T.min(ty * 16 + h * 8 + gq, rows - 1) // group
                                        ]
                                        m_run[h] = T.float32(NEG)
                                        l_run[h] = T.float32(0)
                                    for i in T.unroll(4 * dts):
                                        oacc[i] = T.float32(0)
                                    # the first `ahead` groups' copies, one commit group each (empty or not: the
                                    # waits count them), then the table entries of the group after
                                    for j in T.unroll(ahead):
                                        if j < groups:
                                            if not early or j > 0:  # early: the first group's entries are there
                                                read_table(pt, block_table, s, n, start + j * KEYS, end, tid)
                                            copy_group(sm, q_elems + j * slot_elems, pt, kv, k, v, s, g, n,
                                                       start + j * KEYS, end, tid)  # fmt: skip
                                        T.evaluate(T.ptx["cp.async.commit_group"]())
                                    if ahead < groups:
                                        read_table(pt, block_table, s, n, start + ahead * KEYS, end, tid)
                                    if far > 0 and ahead + far < groups:
                                        read_table(pf, block_table, s, n, start + (ahead + far) * KEYS, end, tid)
                                    if cluster == 0 and trigger and groups <= ahead:
                                        # every copy is out: the merge grid may be launched
                                        T.evaluate(T.call_extern("void", LAUNCH_DEPENDENTS))
                                    for grp in T.serial(groups):
                                        base = T.meta_var(q_elems + grp % stages * slot_elems)
                                        # group grp's copies (this thread's) landed: the younger ones may fly on
                                        T.evaluate(T.ptx["cp.async.wait_group"](ahead - 1))
                                        T.evaluate(T.call_extern("void", FENCE_ASYNC_SHARED))
                                        # everyone's landed, and every wgmma that read the slot refilled next
                                        # (group grp - 1's) has completed
                                        T.tvm_storage_sync("shared")
                                        nxt = T.meta_var(grp + ahead)
                                        if nxt < groups:
                                            copy_group(sm, q_elems + nxt % stages * slot_elems, pt, kv, k, v, s, g, n,
                                                       start + nxt * KEYS, end, tid)  # fmt: skip
                                        T.evaluate(T.ptx["cp.async.commit_group"]())
                                        if cluster == 0 and trigger and nxt == groups - 1:
                                            T.evaluate(T.call_extern("void", LAUNCH_DEPENDENTS))  # the last copies
                                        if nxt + 1 < groups:
                                            read_table(pt, block_table, s, n, start + (nxt + 1) * KEYS, end, tid)
                                        if far > 0 and nxt + far < groups:
                                            # L2 lines of the group `far` past this copy, whose entries were read
                                            # one group ago; then the entries of the next one
                                            prefetch_group(pf, kv, g, n, start + (nxt + far) * KEYS, end, tid)
                                            if nxt + far + 1 < groups:
                                                read_table(pf, block_table, s, n, start + (nxt + far + 1) * KEYS, end,
                                                           tid)  # fmt: skip
                                        for i in T.unroll(4 * nts):
                                            sacc[i] = T.float32(0)
                                        T.evaluate(T.call_extern("void", FENCE))
                                        for kk in T.unroll(dim // WGMMA_K):
                                            T.evaluate(T.call_extern(
                                                "void", mma_s, T.address_of(sacc[0]),
                                                T.address_of(sm[kk // 4 * TILE + kk % 4 * WGMMA_K]),
                                                T.address_of(sm[base + kk // 4 * TILE + kk % 4 * WGMMA_K]),
                                            ))  # fmt: skip
                                        T.evaluate(T.call_extern("void", COMMIT))
                                        T.evaluate(T.call_extern("void", wait_s, T.address_of(sacc[0])))
                                        softmax(sacc, pa, oacc, m_run, l_run, stat, q_at, blk_positions, s, n,
                                                start + grp * KEYS, end, gq, tq)  # fmt: skip
                                        T.evaluate(T.call_extern("void", FENCE))
                                        for kc in T.unroll(KEYS // WGMMA_K):
                                            T.evaluate(T.call_extern(
                                                "void", mma_o, T.address_of(oacc[0]), T.address_of(pa[kc * 8]),
                                                T.address_of(sm[base + atoms * TILE + kc * WGMMA_K * ATOM]), lbo,
                                            ))  # fmt: skip
                                        T.evaluate(T.call_extern("void", COMMIT))
                                        # every wgmma of the group completes here: the barrier of the next group
                                        # then frees this slot for copies (leaving P·V in flight across groups
                                        # would need a later wait before that barrier)
                                        T.evaluate(T.call_extern("void", wait_o, T.address_of(oacc[0])))

                                    # this split's unnormalised rows and (max, sum); an empty split leaves sum 0
                                    row_sums(l_run)
                                    if cluster > 0:
                                        # the next grid may come in: what is left is the short merge
                                        T.evaluate(T.call_extern("void", LAUNCH_DEPENDENTS))
                                        merge_in_cluster(sm, oacc, m_run, l_run, out, s, g, p, ty, gq, tq, tid)
                                    else:
                                        for h in T.unroll(2):
                                            if ty * 16 + h * 8 + gq < rows:
                                                if groups > 0:
                                                    for j in T.unroll(dts):
                                                        for e in T.vectorized(2):
                                                            part_o[
                                                                s, g, p, ty * 16 + h * 8 + gq, j * 8 + tq * 2 + e
                                                            ] = oacc[j * 4 + h * 2 + e]
                                                if tq == 0:
                                                    part_ml[s, g, p, ty * 16 + h * 8 + gq, 0] = m_run[h]
                                                    part_ml[s, g, p, ty * 16 + h * 8 + gq, 1] = l_run[h]

        return split

    two = split_macro(0)

    @T.macro
    def split(q, k, v, kv, block_table, cache_lens, blk_positions, part_o, part_ml, nb):
        two(q, k, v, kv, block_table, cache_lens, blk_positions, part_o, part_ml, part_o, nb)

    def clustered_macro(count: int) -> Any:
        inner = split_macro(count)

        @T.macro
        def clustered(q, k, v, kv, block_table, cache_lens, blk_positions, out, nb):
            inner(q, k, v, kv, block_table, cache_lens, blk_positions, out, out, out, nb)

        return clustered

    clustered = {count: clustered_macro(count) for count in plan.cluster_counts}
    func = attention_prim_func(spec, splits, CHUNK, True, split, plan.slots, clustered)
    return func.with_attr("tirx.is_scheduled", True)


def cluster_merge_macro(spec: BlockAttentionSpec, count: int) -> Any:
    """`cluster_merge(sm, oacc, m_run, l_run, out, s, g, p, ty, gq, tq, tid)`: the `count` spans of one
    (sequence, kv head), launched as one cluster (block p is rank p), add up their rows in distributed
    shared memory instead of a workspace and a merge kernel.

    Each block puts its unnormalised rows and their (max, sum) into an f32 tile `[64, head_dim +
    MERGE_STATS]` over the Q tile and the ring (behind a block barrier: every copy landed, every wgmma
    completed). After a cluster barrier block p merges the query rows [p · r, (p + 1) · r) (r = ceil(rows /
    count)), four outputs a thread: the spans' (max, sum) and outputs, one 16-byte remote load each, all
    issued before any is used, then weights 2^(max - the rows' max) and the bf16 store, as the merge kernel
    (`attention_merge.merge_macro`) does it. A second cluster barrier keeps every tile alive until the last
    remote read. An empty span has max NEG, sum 0 and outputs 0, and weighs nothing."""
    from tvm.script import tirx as T

    blk, group, dim = spec.block, spec.group, spec.head_dim
    rows, dts, quads = blk * group, dim // 8, dim // 4
    rows_per = -(-rows // count)
    chunks = rows_per * quads
    rounds = -(-chunks // MERGE_THREADS)

    @T.macro
    def cluster_merge(sm, oacc, m_run, l_run, out, s, g, p, ty, gq, tq, tid):
        tile = T.decl_buffer((ROWS, dim + MERGE_STATS), "float32", data=sm.data, scope="shared.dyn")
        stats = T.sblock_alloc_buffer((count, 4), "float32", scope="local")  # max, sum, (pad), weight
        parts = T.sblock_alloc_buffer((count, 4), "float32", scope="local")
        total = T.sblock_alloc_buffer((6,), "float32", scope="local")  # four outputs, max, sum
        # every copy has landed (the trailing groups are empty) and every wgmma has completed
        T.evaluate(T.ptx["cp.async.wait_all"]())
        T.tvm_storage_sync("shared")
        for h in T.unroll(2):
            for j in T.unroll(dts):
                for e in T.vectorized(2):
                    tile[ty * 16 + h * 8 + gq, j * 8 + tq * 2 + e] = oacc[j * 4 + h * 2 + e]
            if tq == 0:
                tile[ty * 16 + h * 8 + gq, dim] = m_run[h]
                tile[ty * 16 + h * 8 + gq, dim + 1] = l_run[h]
        T.evaluate(T.call_extern("void", SYNC))
        for r in T.unroll(rounds):
            c = T.meta_var(r * MERGE_THREADS + tid)
            row = T.meta_var(p * rows_per + c // quads)
            col = T.meta_var(c % quads * 4)
            if (chunks % MERGE_THREADS == 0 or c < chunks) and row < rows:
                for rank in T.unroll(count):
                    T.evaluate(T.call_extern("void", LOAD4, T.address_of(stats[rank, 0]), T.address_of(tile[row, dim]),
                                             rank))  # fmt: skip
                for rank in T.unroll(count):
                    T.evaluate(T.call_extern("void", LOAD4, T.address_of(parts[rank, 0]), T.address_of(tile[row, col]),
                                             rank))  # fmt: skip
                total[4] = T.float32(NEG)
                for rank in T.unroll(count):
                    total[4] = T.max(total[4], stats[rank, 0])
                total[5] = T.float32(0)
                for x in T.unroll(4):
                    total[x] = T.float32(0)
                for rank in T.unroll(count):
                    stats[rank, 3] = T.exp2(stats[rank, 0] - total[4])
                    total[5] = total[5] + stats[rank, 3] * stats[rank, 1]
                    for x in T.unroll(4):
                        total[x] = total[x] + stats[rank, 3] * parts[rank, x]
                total[5] = T.if_then_else(total[5] > T.float32(0), T.float32(1) / total[5], T.float32(0))
                for x in T.unroll(4):
                    out[s * blk + row // group, (g * group + row % group) * dim + col + x] = T.Cast(
                        DTYPE, total[x] * total[5]
                    )
        T.evaluate(T.call_extern("void", SYNC))  # no block leaves while another may read its tile

    return cluster_merge


class AttentionWgmmaRule(BlockAttentionOp, FamilyRule):
    """`block_attention` on warpgroup MMAs where `wgmma_attention_fits` (else the mma.sync rule takes it).

    Knobs (as the mma rule's): `splits`, thread blocks one (sequence, kv head) is split across at most;
    `slots`, the grid a batch's splits aim at (0: off), so a larger batch takes fewer splits; `prefetch`,
    the groups whose cached K/V lines go to L2 before the wait for inputs; `stages`, the slots of the
    cp.async ring (stages - 1 groups' copies in flight beyond the one multiplied); `early` 1, the span and
    first table entries located before that wait and Q copied by cp.async after it (module docstring);
    `trigger` 1, the split kernel lets the merge grid in once each block has issued its last group's copies, so
    the merge grid is launched before the split completes and its blocks take the SMs the split's blocks leave
    (0: it is launched as the last split block exits). On the H200 no merge block fits beside a split block
    at nb = 1 or 8: the split's 116,736-byte blocks fill an SM's 233,472 bytes of shared memory two at a time
    at nb = 8, and at nb = 1 both grids claim 116,864 bytes a block to spread (runtime/placement.py). Only
    the merge's launch latency could be gained, and was not: the bf16 step on an H100 (bench/propose.py, both
    builds in one run, 0 → 1) took 1.288 → 1.296 ms at nb = 1 and 1.822 → 1.827 at nb = 8. So it is off.
    `l2_ahead` f, each group prefetching into L2 the cached K/V of the group f past its copies (module
    docstring), is correct (bench/kernels.py on an H100, f = 2: 3/3 cases at nb = 1 / 4 / 8 against numpy) and
    lost, most at nb = 8 (H100, one run of four builds; µs the split kernel adds a layer at nb = 8, timeline;
    bf16 step ms at nb = 1 / 8): 0 (default) 57.6, 1.260 / 1.739; 1: 61.0, 1.278 / 1.763; 2: 65.1, 1.275 /
    1.783; 4: 74.9, 1.271 / 1.830 (FP8 at nb = 8: 1.473 → 1.488, 1.510, 1.560).
    Nsight Compute on the split kernel at nb = 8, 0 → 2: 31.2 → 37.3 µs, DRAM 52 → 44 % busy. The ring's
    copies do not wait on DRAM latency that a prefetch could hide; the prefetches only add requests. It
    stays a knob for targets with slower memory (a tuning database may turn it on).

    Defaults from the H200, Qwen3-8B drafter step (`bench/propose.py --timeline`, 4096 cached rows, µs the
    split kernel adds over five layers at nb = 8; ms of the bf16 step at nb = 1 / 4 / 8 / 16):
    * the mma.sync kernel: 369.4 µs; 1.024 / 1.417 / 1.654 / 2.719 ms;
    * this kernel staging K/V through registers, two slots: 307.9 µs; 1.002 / 1.344 / 1.567 / 2.580 ms;
    * a three-slot cp.async ring (128 registers instead of 201): 281.6 µs; 0.986 / 1.313 / 1.533 / 2.533;
    * four slots (one block per SM): 354.3 µs; 0.985 / 1.338 / 1.585 / 2.602;
    * three slots, `slots` 2 blocks per SM (one wave of 4 splits at nb = 8, 8 at nb = 4): 277.7 µs, merge
      42.0 against 46.6; 0.982 / 1.262 / 1.501 / 2.501, the default;
    * the same with the grid along the splits cut to the spans a batch uses (`span_count`; before, 3 of 4
      blocks at nb = 8 only exited, and went through the SMs mixed in with the used ones): 212.5 µs against
      273.0; 0.964 / 1.251 / 1.441 / 2.352 against 0.966 / 1.255 / 1.475 / 2.462 in the same run.
    One sequence keeps its 16 splits (8 × 16 blocks): 9.1 µs per layer against 14.7 for the mma kernel.
    32 (256 blocks of two 64-key groups, two per SM, and a merge of two passes) lost on an H100 (one run, both
    builds; µs the attention and its merge add over five layers at nb = 1, timeline): 73.9 → 101.3, the bf16
    step 1.259 → 1.299 ms and FP8 0.794 → 0.813 ms; nb ≥ 2 is unchanged (`slots` leaves it 16 spans or fewer).
    So did 17, 20 and 24, though at nb = 1 the step's 4,119 keys are 65 groups of 64 and 16 splits leave 13 spans
    of five groups (H100, one run of four builds; bf16 / FP8 step ms at nb = 1 and µs the split kernel adds over
    five layers): 16: 1.288 / 0.796, 54.3; 17: 1.316 / 0.812, 56.1 (17 spans of four groups, 136 blocks, merged
    in passes of 16 and 1: 36.3 µs against 18.4); 20: 1.311 / 0.804, 61.8; 24: 1.310 / 0.804, 55.0 (22 spans of
    three groups; 20 and 24 merged in one pass, 18.8 and 22.3 µs). The split kernel takes about the same time
    whatever its blocks' group count: blocks sharing an SM set its pace, not the length of one block's chain.
    `prefetch` 4 or 8 instead of 2 (at nb = 1 a split's every group in L2 before the wait) lost on an H100 (one
    run, three builds; ms of the step at nb = 1 / 8): bf16 1.256 / 1.737 → 1.281 / 1.770 and 1.276 / 1.801,
    FP8 0.782 / 1.477 → 0.787 / 1.488 and 0.787 / 1.509.
    `bench/attention.py` times one kernel over random lengths (the first sequence full) on a cache that
    fits L2 at nb = 1, so its µs flatter both kernels; the step is the measure.
    At nb = 8 the split kernel is bound by its own work per group, not by its reads: the same grid and
    cp.async ring reading one layer's K/V and nothing else (`bench/stream.py`, H100) takes 44.9 µs (100.8 %
    of the copy bandwidth; 45.3 with head-major pages, so the page layout is not what costs), against 58.9 µs
    for this kernel in the step. One block per SM does as well as two: `slots` 132 (2 splits, 128 blocks of
    32 groups) against the default 264 (4 splits, 256 blocks of 16 groups, two per SM), µs the split kernel
    adds over five layers at nb = 8, one run: 283.6 against 294.4, the bf16 step 1.793 against 1.795 ms;
    528 (8 splits) 314.1, 1.839 ms. So an SM takes ~1.8 µs per 64-key group whatever its block count; at
    nb = 1 (128 blocks of five groups) the reads alone take 7.2 µs and the kernel ~11. There the one warpgroup
    an SM holds sets the pace: Nsight Compute (H100, nb = 1, 4,144 cached keys, the profiler's clocks at 1.49
    GHz) put the kernel at 15.8 µs with DRAM 33 % busy, one warp per scheduler issuing every 4.9 cycles and no
    eligible warp in 80 % of the cycles (SM active 18,100 of 23,600 cycles: ~3,700 instructions a warp).
    Nor does the kernel's own work per group set that pace. Nsight Compute (H100, nb = 4, one cold launch)
    put a warp's group at ~545 instructions, 6.8 cycles apart: 127 for the copies (20 of them reloads of kernel
    parameters, whose waits were a tenth of the loop's stalls), 121 for Q·Kᵀ (~90 building wgmma descriptors
    from pointers), 252 for the softmax, and waits for the copies (12 %), the barrier (10 %) and the wgmmas
    (14 %). Cutting it to ~400 (a copy branch for groups of cached keys alone, V as K one cache half on;
    descriptors built once per tile and offset by constants), leaving each group's P·V in flight into the
    next group (one ring slot fewer ahead), and four to six slots at one block per SM all left the split
    kernel where it was (H100, two runs, µs it adds a layer at nb = 8, timeline; the default 57.2-57.6):
    fewer instructions 57.7; `slots` 132 with them 55.9; four slots 55.9, six 57.6; P·V in flight at three
    slots and two blocks per SM 55.7, at four and five slots and one block 55.5 and 55.4; the bf16 step at nb
    = 8 1.730-1.741 ms against 1.735-1.736, FP8 1.462-1.477 against 1.476-1.480. So 134 MB a layer move at
    ~80 % of the copy bandwidth whatever the instruction count, ring depth, block count or overlap; none of
    these was kept.
    Nor is it the blocks of the eight kv heads, out of step, each reading 256 of every 2048 bytes of a cached
    token's K and V rows: the kernel reading the same bytes as head-major pages (each block's rows of a page
    one 4 KiB run; a prototype, its numbers not checked) added 57.2 µs a layer at nb = 8 against 55.6 / 55.6
    for the kernel as it is (H100, timeline, one run, the prototype between two copies), the bf16 step 1.738
    against 1.718 / 1.759 ms.

    `cluster` (0: off) is the largest span count merged in a cluster. 16 (the spans of 1-2, 4, 7-8 and 12-16
    sequences merged in their cluster, no merge kernel) is correct (bench/attention.py on an H200: 24/24 cases
    of every mask against numpy, clusters of 16, 8 and 4 included) and, alone, faster at 8 and 16 sequences
    (bench/kernels.py, µs per call, merge kernel → cluster: 36.7 → 33.2 at nb = 8, 65.8 → 61.8 at nb = 16, 18.9
    → 20.0 at nb = 1), but slower in the step: µs the attention adds over five layers (timeline, same run) 72.0
    → 74.3 at nb = 1 and 239.9 → 326.6 at nb = 8; the bf16 step 0.952 → 0.972 ms at nb = 1 and 1.408 → 1.488 at
    nb = 8. On an H100 (same run) 1.295 → 1.313 and 1.824 → 1.905 ms, and 1.326 and 1.912 with the cluster
    kernel letting the next grid in only as it exits (instead of before its merge); with plain launches (no
    kernel a dependent of the one before) the attention still added 81.7 → 83.7 µs at nb = 1 and 317.2 → 375.7
    at nb = 8. So neither the trigger nor dependent launch is the cause (not profiled further). The warpgroup
    GEMM's cluster reduction loses in the step the same way (linear_wgmma.cluster_store_macro). So it is off by
    default.

    `early` 1 is correct (bench/attention.py on an H200: 24/24 cases of every mask against numpy; the Qwen3-8B
    kernel at nb = 1 / 4 / 8 through bench/kernels.py) but not faster in the step (same run, µs the attention
    adds over five layers, 0 → 1): 78.0 → 76.3 at nb = 1 and 241.2 → 248.0 at nb = 8; the bf16 step 0.970 → 0.979
    ms at nb = 1 and 1.393 → 1.402 at nb = 8, where a second copy of the default build took 0.981 and 1.405. The
    round trips it removes after the wait are not what the split kernel waits on. So it is off by default.
    """

    name = "block_attention_wgmma"
    knob_names = ("splits", "slots", "prefetch", "stages", "cluster", "early", "trigger", "l2_ahead")

    def default_knobs(self, target: Target) -> dict[str, int]:
        return {
            "splits": default_splits(target),
            "slots": 2 * target.sm_count,
            "prefetch": 2,
            "stages": DEFAULT_STAGES,
            "cluster": DEFAULT_CLUSTER,
            "early": 0,
            "trigger": 0,
            "l2_ahead": DEFAULT_L2_AHEAD,
        }

    def apply(self, subject: Any, target: Target, knobs: Mapping[str, int] | None = None) -> Kernel | None:
        spec = self.spec_of(subject)
        if spec is None or not wgmma_attention_fits(spec, target):
            return None
        return super().apply(spec, target, knobs)

    def schedule(self, spec: BlockAttentionSpec, target: Target, knobs: Mapping[str, int]) -> Any:
        plan = fit_wgmma_attention(spec, target, **{name: knobs[name] for name in self.knob_names})
        return attention_wgmma_func(spec, plan)
