"""Warpgroup GEMM for many rows of `x` on sm_90a: `wgmma.mma_async.m64nNk16`, both operands in shared memory.

Same product as linear_tiled.py, `yᵀ = W · xᵀ` (weight rows as the mma's M, rows of x as its N). A block
has `warpgroups` warpgroups of four warps; warpgroup i owns weight rows [64i, 64i + 64) of the block's
`block_n = 64 · warpgroups` and all `block_m` rows of x (wgmma's N), so one instruction does 64 × block_m
× 16 and its operands never pass through registers (dflash_compiler/wgmma.py).

The pipeline is linear_tiled.py's: `stages` shared-memory slots, each `k_atoms` atoms of 64 k (one
128-byte swizzle row), filled with 16-byte `cp.async` copies `lead = stages - mma_groups` slots ahead of
the one multiplied. Slot s holds, per atom, a K-major 128-byte-swizzled tile of the block's weight rows
and one of its x rows (the layout wgmma's descriptors describe: 16-byte chunk c of row r at chunk c xor
r mod 8). Eight consecutive threads copy one 128-byte row segment, so every global read is one full line.
Per slot a thread waits for its own copies, makes them visible to the async proxy (`fence.proxy.async`),
and a block barrier makes everyone's visible and ends every read of the slot the next copies overwrite.
Then the warpgroup issues 4 · k_atoms wgmmas and commits them as one group. With `mma_groups` 1 it waits
for the group before the next slot; with 2 it waits only for the slot before's, so the current slot's
wgmmas run on while the next slot is waited for (and, FP8, converted into the other of two tiles): the
slot they read is `lead` slots behind the copies, and every thread has waited for them by the barrier
after next. Weight rows past n read row n - 1 and rows of x past m are zero-filled
(ignore-src); neither is stored.

e4m3 weights (FP8) are copied as they are, 64 bytes a row per atom, and converted to bf16 where `convert`
says. CONVERT_TILE: after the slot's barrier each thread converts the chunks it copied into a bf16 tile of
the swizzled layout (four values per call of fp8_convert.py's integer conversion, exact); a second fence
and barrier then let the wgmmas read it. CONVERT_REGISTERS: each thread loads the e4m3 bytes of its own A
fragments (its warp's 16 of the warpgroup's 64 rows) from the slot and converts them into registers, and the
wgmmas take A from there (`mma_rk_name`) and only x from shared memory: no bf16 tile is written or read, and
no second fence or barrier. Its fragments of a slot are one 16-byte load per row and k16 step, so the raw
rows are stored with their four 16-byte chunks swizzled by row (`raw_chunk`): the eight rows a load
instruction reads then fall on eight distinct 16-byte bank groups. With two groups in flight the k loop is
unrolled by two, so that a slot's fragments have registers of their own while the slot before's wgmmas still
read theirs. The per-row scale is applied where the accumulators are stored (or by the k-split merge).

With `roles` 2 (PRODUCER_ROLES) the copies leave the multiplying warpgroups: one more warpgroup (the
producer) copies every slot, and each slot has a "full" and a "free" mbarrier (dflash_compiler/mbarrier.py)
instead of the block barrier. The producer issues the first `stages` slots (their weight before the wait
for x's writer), then per slot c waits for its copies (`cp.async.wait_group`), fences them to the async
proxy and arrives on full[c]; then it refills the ring slot of slot c - mma_groups, once the multiplying
threads have all arrived on its free barrier, which they do after waiting for the wgmmas that read it
(its x rows, and its weight rows or, FP8, the bf16 tile each warpgroup converted its own 64 weight rows of
it into, between two barriers of the warpgroup's four warps alone: a thread's wgmma wait covers its own
warp's part of the product). Only the multiplying warps store; the producer meets the argmax epilogue's
block barriers and writes nothing. A phase of a barrier is one use of its slot, waited for by parity.

The accumulators of a warp follow mma.sync's m16n8 layout, one 16-row weight tile by block_m / 8 x tiles,
so linear_tiled.py's store and k-split merge serve both kernels: the grid is (m tiles, n tiles, k splits),
the m tiles of one weight tile neighbours in launch order (the weight crosses from DRAM once), and with
`k_splits > 1` the blocks write f32 partial sums that a second kernel adds, or, with `k_reduce` 2, the
splits of a tile are one thread block cluster that adds them in shared memory (`cluster_store_macro`): no
workspace, no second launch; with `k_reduce` 3 the tile's last block to finish adds them from the workspace
(`last_store_macro`): no second launch. The first slots' weight copies are issued before the wait for the grid that
writes x (dependent_launch.py), the next grid is let in once a block has issued its last weight copies.

The slots need a 1024-byte aligned base: the kernel's only shared memory is this dynamic allocation, and
CUDA places dynamic shared memory at the start of the block's window, which is 1024-byte aligned. The
kernel checks it first thing and traps otherwise, rather than multiply scrambled tiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_compiler.cluster import ADD4, DIMS, SYNC
from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, WAIT
from dflash_compiler.fp8_convert import E4M3_A_FRAGMENT, E4M3X4_TO_BF16
from dflash_compiler.mbarrier import ARRIVE, BARRIER_BYTES, INIT, NAMED_SYNC, WAIT_PARITY
from dflash_compiler.weight_tiles import tile_index
from dflash_compiler.wgmma import (
    COMMIT,
    FENCE,
    FENCE_ASYNC_SHARED,
    REQUIRE_ALIGNED,
    SWIZZLE_BYTES,
    WAIT_PRIOR,
    mma_name,
    mma_rk_name,
    wait_name,
)

from .base import ScheduleError
from .linear_argmax import pick_macro, pick_merge_macro
from .linear_tiled import MERGE_VECTOR, merge_macro, row_scale_count, row_scales_macro, split_sum, store_macro

if TYPE_CHECKING:
    from dflash_compiler.targets import Target

    from .linear import LinearSpec

WARP = 32
WARPGROUP = 4 * WARP
ATOM_K = SWIZZLE_BYTES // 2  # bf16 per swizzled row
WGMMA_K = 16
# the plan's knob fields (LinearMmaRule takes them as wgmma_<name>)
WGMMA_KNOBS = (
    "warpgroups", "block_m", "stages", "k_atoms", "k_splits", "mma_groups", "k_reduce", "roles", "convert",
)  # fmt: skip
# how the k splits of a tile add up (k_reduce): a workspace and a merge kernel, within a thread block cluster, or
# by the tile's last block to finish (last_store_macro)
KERNEL_REDUCE, CLUSTER_REDUCE, LAST_REDUCE = 1, 2, 3
# who copies (roles): every warp copies and multiplies, or one more warp copies for the multiplying warpgroups
SHARED_ROLES, PRODUCER_ROLES = 1, 2
# where e4m3 weights become bf16 (convert): a shared-memory tile the wgmmas read, or their A fragments in registers
CONVERT_TILE, CONVERT_REGISTERS = 1, 2
PRODUCER_WARPS = 4  # one warp alone issued the copies too slowly (H200, bf16 step at nb = 16: 3.108 against 2.338 ms)
THREAD_FENCE = "__threadfence"  # orders a thread's global writes before its later ones, device-wide
CLUSTER_PAD = 4  # floats past each row of the cluster's f32 tile: rows stay 16-byte aligned, banks shift


@dataclass(frozen=True)
class WgmmaPlan:
    """The resolved shape of one warpgroup GEMM kernel."""

    warpgroups: int  # 64 weight rows each
    block_m: int  # rows of x per block: wgmma's N (a multiple of 8, at most 256)
    stages: int  # shared-memory slots of the copy pipeline
    k_atoms: int  # 64-wide k atoms per slot
    k_splits: int  # blocks along k (> 1: partial sums added by a second kernel, a cluster or the last: k_reduce)
    mma_groups: int = 1  # slots' wgmma groups a warpgroup has in flight: 2 keeps one running into the next slot
    weight_bytes: int = 2  # per weight element: 2 bf16, 1 e4m3 (converted to bf16 in shared memory)
    k_reduce: int = KERNEL_REDUCE  # KERNEL_REDUCE, CLUSTER_REDUCE or LAST_REDUCE (module docstring)
    roles: int = SHARED_ROLES  # SHARED_ROLES or PRODUCER_ROLES (module docstring)
    convert: int = CONVERT_TILE  # CONVERT_TILE or CONVERT_REGISTERS (e4m3 weights only; module docstring)

    # the store's view of a warp (linear_tiled.store_macro): one 16-row weight tile by block_m / 8 x tiles
    n_tiles = 1
    m_warps = 1

    @property
    def block_n(self) -> int:
        return 64 * self.warpgroups

    @property
    def m_tiles(self) -> int:
        return self.block_m // 8

    @property
    def n_warps(self) -> int:
        return 4 * self.warpgroups

    @property
    def threads(self) -> int:
        """The threads that multiply (and, without a producer, copy): the accumulators' and epilogues' threads."""
        return WARPGROUP * self.warpgroups

    @property
    def producer(self) -> bool:
        """One more warp copies every slot, and the multiplying warpgroups only wait for and free slots."""
        return self.roles == PRODUCER_ROLES

    @property
    def block_warps(self) -> int:
        """Warps per block: the multiplying ones, then the producer."""
        return self.n_warps + (PRODUCER_WARPS if self.producer else 0)

    @property
    def slot_k(self) -> int:
        return ATOM_K * self.k_atoms

    @property
    def fp8(self) -> bool:
        return self.weight_bytes == 1

    @property
    def registers(self) -> bool:
        """e4m3 weights converted into the wgmmas' A fragments in registers, not into a shared bf16 tile."""
        return self.fp8 and self.convert == CONVERT_REGISTERS

    def stage_bytes(self) -> int:
        """One slot: the weight rows' k atoms as stored (64 bytes a row per e4m3 atom), x's as bf16."""
        return self.k_atoms * (self.block_n * ATOM_K * self.weight_bytes + self.block_m * SWIZZLE_BYTES)

    @property
    def lead(self) -> int:
        """Slots whose copies are in flight ahead of the one multiplied (the others' wgmmas may still read)."""
        return self.stages - self.mma_groups

    def converted_bytes(self) -> int:
        """FP8: the bf16 tiles of a slot's weight that the wgmmas read, one per group in flight (none for bf16,
        or converted into registers)."""
        return self.mma_groups * self.k_atoms * self.block_n * SWIZZLE_BYTES if self.fp8 and not self.registers else 0

    @property
    def cluster(self) -> bool:
        """The k splits of a tile are one thread block cluster that adds them in shared memory."""
        return self.k_splits > 1 and self.k_reduce == CLUSTER_REDUCE

    @property
    def last(self) -> bool:
        """The k splits of a tile are added by whichever of its blocks finishes last (last_store_macro)."""
        return self.k_splits > 1 and self.k_reduce == LAST_REDUCE

    def reduce_bytes(self) -> int:
        """The cluster's f32 tile of a block's partial sums, over the pipeline's slots (none without one)."""
        return self.block_m * (self.block_n + CLUSTER_PAD) * 4 if self.cluster else 0

    def barrier_bytes(self) -> int:
        """A producer's slots' full and free barriers (mbarrier.py), after the slots and converted tiles."""
        return 2 * self.stages * BARRIER_BYTES if self.producer else 0

    def shared_bytes(self) -> int:
        slots = self.stages * self.stage_bytes() + self.converted_bytes()
        return max(slots + self.barrier_bytes(), self.reduce_bytes())

    def knobs(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in WGMMA_KNOBS}

    def blocks_per_sm(self, target: Target) -> int:
        """The blocks of this plan an SM of `target` holds at once, by shared memory and threads."""
        return min(target.shared_memory_per_sm // self.shared_bytes(), target.max_threads_per_sm // self.threads)


def raw_chunk(chunk: Any, row: Any) -> Any:
    """CONVERT_REGISTERS: where 16-byte chunk `chunk` (0-3) of a raw e4m3 row's atom sits in the row's 64
    bytes: xor'd with bits 1-2 of the row. A fragment load reads one chunk of rows g = 0..7 (then 8..15) of a
    16-row tile, at bytes 64·g + 16·position: eight distinct 16-byte bank groups of 128 bytes."""
    return chunk ^ (row // 2 % 4)


def _slot_macros(spec: LinearSpec, plan: WgmmaPlan, threads: int, converters: int, rows: int) -> tuple[Any, Any, Any]:
    """`(load_w_stage, load_x_stage, convert)`: TVMScript macros by which `threads` threads (tid 0 ..
    threads - 1) copy a slot's weight rows and x rows, and (FP8) `converters` threads convert `rows` weight
    rows of a slot from `row0` on into the bf16 tile the wgmmas read."""
    from tvm.script import tirx as T

    n, k, fp8 = spec.n, spec.k, spec.fp8
    bn_rows, bm_rows, k_atoms = plan.block_n, plan.block_m, plan.k_atoms
    per_split = k // plan.slot_k // plan.k_splits  # slots per split
    w_row_chunks = ATOM_K * plan.weight_bytes // 16  # 16-byte chunks of a weight row's atom: 8 bf16, 4 e4m3
    w_chunks, x_chunks = k_atoms * bn_rows * w_row_chunks, k_atoms * bm_rows * 8  # 16-byte chunks per slot
    w_rounds, x_rounds = -(-w_chunks // threads), -(-x_chunks // threads)
    c_chunks = k_atoms * rows * w_row_chunks  # the chunks one converter set converts
    c_rounds = -(-c_chunks // converters)

    def w_column(c: Any, row: Any) -> Any:
        # where a weight chunk lands in its row: bf16 chunks straight into the swizzled tile, e4m3 ones
        # unswizzled where the conversion writes the swizzled bf16 tile, by raw_chunk where the fragment loads
        # read them
        if not fp8:
            return T.bitwise_xor(c % 8, row % 8) * 8
        return raw_chunk(c % w_row_chunks, row) * 16 if plan.registers else c % w_row_chunks * 16

    @T.macro
    def load_w_stage(w, ws, bn, ks, tid, slot, step):
        if step < per_split:
            for i in T.unroll(w_rounds):
                c = T.meta_var(i * threads + tid)
                atom = T.meta_var(c // (bn_rows * w_row_chunks))
                row = T.meta_var(c // w_row_chunks % bn_rows)
                if w_chunks % threads == 0 or c < w_chunks:
                    T.evaluate(T.ptx["cp.async.cg.shared.global"](
                        T.address_of(ws[slot, atom, row, w_column(c, row)]),
                        T.address_of(w[tile_index(
                            spec.tiles,
                            T.min(bn * bn_rows + row, n - 1),
                            ((ks * per_split + step) * k_atoms + atom) * ATOM_K
                            + c % w_row_chunks * (16 // plan.weight_bytes),
                            k,
                        )]),
                        16,
                    ))  # fmt: skip

    @T.macro
    def load_x_stage(x, m, xs, bm, ks, tid, slot, step):
        # closes the step's copy group: wait_group counts one group per step, empty or not
        if step < per_split:
            for i in T.unroll(x_rounds):
                c = T.meta_var(i * threads + tid)
                atom = T.meta_var(c // (bm_rows * 8))
                row = T.meta_var(c // 8 % bm_rows)
                if x_chunks % threads == 0 or c < x_chunks:
                    T.evaluate(T.ptx["cp.async.cg.shared.global"](
                        T.address_of(xs[slot, atom, row, T.bitwise_xor(c % 8, row % 8) * 8]),
                        T.address_of(x[T.min(bm * bm_rows + row, m - 1),
                                       ((ks * per_split + step) * k_atoms + atom) * ATOM_K + c % 8 * 8]),
                        16,
                        bm * bm_rows + row >= m,
                    ))  # fmt: skip
        T.evaluate(T.ptx["cp.async.commit_group"]())

    @T.macro
    def convert(ws, wc, tid, slot, tile, row0):
        # FP8: each 16-byte e4m3 chunk of the slot becomes two bf16 chunks of the swizzled tile, four values
        # per call (fp8_convert.py); the tile is free once the warpgroups reading it waited for their wgmmas
        for i in T.unroll(c_rounds):
            c = T.meta_var(i * converters + tid)
            atom = T.meta_var(c // (rows * w_row_chunks))
            row = T.meta_var(row0 + c // w_row_chunks % rows)
            if c_chunks % converters == 0 or c < c_chunks:
                for q in T.unroll(4):
                    col = T.meta_var(T.bitwise_xor(c % w_row_chunks * 2 + q // 2, row % 8) * 8 + q % 2 * 4)
                    T.evaluate(T.call_extern(
                        "void", E4M3X4_TO_BF16,
                        T.address_of(wc[tile, atom, row, col]),
                        T.address_of(wc[tile, atom, row, col + 2]),
                        T.address_of(ws[slot, atom, row, c % w_row_chunks * 16 + q * 4]),
                    ))  # fmt: skip

    return load_w_stage, load_x_stage, convert


def wgmma_body_macro(spec: LinearSpec, plan: WgmmaPlan) -> Any:
    """The kernel(s) of `plan` as a TVMScript macro `body(x, w, scale, y, m, part)`, as linear_tiled's."""
    from tvm.script import tirx as T

    k, fp8, wdtype = spec.k, spec.fp8, spec.weight_dtype
    bn_rows, bm_rows, stages = plan.block_n, plan.block_m, plan.stages
    k_atoms, k_splits = plan.k_atoms, plan.k_splits
    per_split = k // plan.slot_k // k_splits  # slots per split
    n_acc = bm_rows // 2
    groups, lead = plan.mma_groups, plan.lead
    n_blocks = -(-spec.n // bn_rows)
    w_elems = stages * k_atoms * bn_rows * ATOM_K * plan.weight_bytes // 2  # the weight slots, in bf16 units
    x_elems = stages * k_atoms * bm_rows * ATOM_K
    mma, wait = mma_name(bm_rows), wait_name(bm_rows)
    registers, kks = plan.registers, ATOM_K // WGMMA_K
    mma_rk = mma_rk_name(bm_rows)
    frag_elems = groups * k_atoms * kks * 8  # CONVERT_REGISTERS: a thread's A fragments, per group in flight
    # slots per k-loop iteration: two where fragment set u of a pair fills while the other set's wgmmas run on
    # (step u a Python constant: with a loop variable TVM would fold the two sets onto one, as each is written
    # and read within its step, not seeing that the wgmmas read them on after it)
    unroll = groups if registers else 1
    store = store_macro(spec, plan)
    row_scales = row_scales_macro(spec, plan)
    merge = merge_macro(spec, k_splits)
    picks = spec.picks
    cluster = plan.cluster
    cluster_store = cluster_store_macro(spec, plan) if cluster else None
    last = plan.last
    last_store = last_store_macro(spec, plan) if last else None
    producer = plan.producer
    if producer and last:
        raise ScheduleError(
            f"{spec.name}: wgmma roles={PRODUCER_ROLES} (a producer warpgroup) with k_reduce={LAST_REDUCE}: the last "
            f"block's sum is shared by the multiplying threads alone. Fix: k_reduce {KERNEL_REDUCE}, or roles "
            f"{SHARED_ROLES}"
        )
    if producer and cluster:
        raise ScheduleError(
            f"{spec.name}: wgmma roles={PRODUCER_ROLES} (a producer warpgroup) with k_reduce={CLUSTER_REDUCE}: the "
            "cluster's store meets every thread of the cluster, and the producer has left. Fix: k_reduce "
            f"{KERNEL_REDUCE}, or roles {SHARED_ROLES}"
        )
    # lm_head_argmax's epilogue, built only for it (every macro parses its source)
    pick, pick_merge = (pick_macro(spec, plan, producer), pick_merge_macro(spec, plan)) if picks else (None, None)
    # who copies, and who converts which weight rows (FP8): the producer warpgroup and each multiplying
    # warpgroup its own 64,
    # or every thread all of them
    load_w_stage, load_x_stage, convert = (
        _slot_macros(spec, plan, PRODUCER_WARPS * WARP, WARPGROUP, 64) if producer else
        _slot_macros(spec, plan, plan.threads, plan.threads, bn_rows)
    )  # fmt: skip
    # the barriers after the slots and converted tiles, in bf16 units (8-byte aligned: every part is)
    bar_elems = w_elems + x_elems + plan.converted_bytes() // 2

    @T.macro
    def fragments(ws, af, slot, row, quad, u):
        # CONVERT_REGISTERS: the thread's A fragments of the slot (rows `row` and row + 8 of its warp's 16),
        # into fragment set u, one 16-byte load per row and k16 step (fp8_convert.py)
        for atom in T.unroll(k_atoms):
            for kk in T.unroll(kks):
                col = T.meta_var(raw_chunk(kk, row) * 16)
                T.evaluate(T.call_extern(
                    "void", E4M3_A_FRAGMENT, af.access_ptr("w", offset=((u * k_atoms + atom) * kks + kk) * 8, extent=8),
                    T.address_of(ws[slot, atom, row, col]), T.address_of(ws[slot, atom, row + 8, col]), quad,
                ))  # fmt: skip

    @T.macro
    def multiply(acc, ws, wc, af, xs, wg, kt, u):
        T.evaluate(T.call_extern("void", FENCE))
        for atom in T.unroll(k_atoms):
            for kk in T.unroll(kks):
                if registers:
                    T.evaluate(T.call_extern(
                        "void", mma_rk, T.address_of(acc[0]),
                        af.access_ptr("r", offset=((u * k_atoms + atom) * kks + kk) * 8, extent=8),
                        T.address_of(xs[kt % stages, atom, 0, kk * WGMMA_K]),
                    ))  # fmt: skip
                else:
                    T.evaluate(T.call_extern(
                        "void", mma, T.address_of(acc[0]),
                        T.address_of(wc[kt % groups, atom, wg * 64, kk * WGMMA_K]) if fp8 else
                        T.address_of(ws[kt % stages, atom, wg * 64, kk * WGMMA_K]),
                        T.address_of(xs[kt % stages, atom, 0, kk * WGMMA_K]),
                    ))  # fmt: skip
        T.evaluate(T.call_extern("void", COMMIT))

    @T.macro
    def first_slots(x, w, m, ws, xs, bm, bn, ks, tid, count):
        # the first `count` slots: their weight before the wait for the grid that writes x, then x, a copy
        # group per slot
        for s in T.unroll(count):
            load_w_stage(w, ws, bn, ks, tid, s, s)
        T.evaluate(T.call_extern("void", WAIT))
        for s in T.unroll(count):
            load_x_stage(x, m, xs, bm, ks, tid, s, s)

    @T.macro
    def shared_step(x, w, m, acc, ws, wc, af, xs, bm, bn, ks, tid, wg, row, quad, kt, u):
        T.evaluate(T.ptx["cp.async.wait_group"](lead - 1))
        T.evaluate(T.call_extern("void", FENCE_ASYNC_SHARED))
        # everyone's copies of slot kt landed, and every wgmma that read the slot
        # (and FP8 tile) overwritten next has completed (each thread waited)
        T.tvm_storage_sync("shared")
        load_w_stage(w, ws, bn, ks, tid, (kt + lead) % stages, kt + lead)
        load_x_stage(x, m, xs, bm, ks, tid, (kt + lead) % stages, kt + lead)
        if kt == max(per_split - 1 - lead, 0):  # the last weight copies are out
            T.evaluate(T.call_extern("void", LAUNCH_DEPENDENTS))
        if registers:
            fragments(ws, af, kt % stages, row, quad, u)
        elif fp8:
            convert(ws, wc, tid, kt % stages, kt % groups, 0)
            T.evaluate(T.call_extern("void", FENCE_ASYNC_SHARED))
            T.tvm_storage_sync("shared")
        multiply(acc, ws, wc, af, xs, wg, kt, u)
        if groups == 1:
            T.evaluate(T.call_extern("void", wait, T.address_of(acc[0])))
        else:  # the slot before's group has completed; this one runs on
            T.evaluate(T.call_extern("void", WAIT_PRIOR))

    @T.macro
    def shared_loop(x, w, m, acc, ws, wc, af, xs, bm, bn, ks, tid, wg, row, quad):
        # every warp copies its share of each slot and multiplies; a block barrier per slot
        first_slots(x, w, m, ws, xs, bm, bn, ks, tid, lead)
        for kt in range(per_split // unroll):
            shared_step(x, w, m, acc, ws, wc, af, xs, bm, bn, ks, tid, wg, row, quad, kt * unroll, 0)
            if unroll == 2:
                shared_step(x, w, m, acc, ws, wc, af, xs, bm, bn, ks, tid, wg, row, quad, kt * 2 + 1, 1)
        if per_split % unroll == 1:  # the odd last slot, after the loop: no branch inside it (ptxas then serialises)
            shared_step(x, w, m, acc, ws, wc, af, xs, bm, bn, ks, tid, wg, row, quad, per_split - 1, 0)
        if groups > 1:
            T.evaluate(T.call_extern("void", wait, T.address_of(acc[0])))

    @T.macro
    def produce(x, w, m, ws, xs, bars, bm, bn, ks, ptid):
        # the producer warpgroup. Iteration c marks slot c full once its copies landed, then refills the ring
        # slot of slot c - mma_groups, which the consumers free once they have waited for its wgmmas (which
        # needs slot c - mma_groups + 1 full, marked already), with slot c - mma_groups + stages. One copy
        # group per slot in the first `stages`, then one per iteration (empty where nothing is left): slot
        # c >= stages is group c + mma_groups, so waiting for it leaves stages - mma_groups - 1 newer ones
        first_slots(x, w, m, ws, xs, bm, bn, ks, ptid, stages)
        for c in range(per_split):
            T.evaluate(T.ptx["cp.async.wait_group"](stages - groups - 1))
            T.evaluate(T.call_extern("void", FENCE_ASYNC_SHARED))
            T.evaluate(T.call_extern("void", ARRIVE, T.address_of(bars[0, c % stages])))
            if c >= groups:
                if c - groups + stages < per_split:
                    T.evaluate(T.call_extern("void", WAIT_PARITY, T.address_of(bars[1, (c - groups) % stages]),
                                             (c - groups) // stages % 2))  # fmt: skip
                load_w_stage(w, ws, bn, ks, ptid, (c - groups) % stages, c - groups + stages)
                load_x_stage(x, m, xs, bm, ks, ptid, (c - groups) % stages, c - groups + stages)
            else:
                T.evaluate(T.ptx["cp.async.commit_group"]())
            if c == max(per_split - 1 - stages + groups, 0):  # the last weight copies are out
                T.evaluate(T.call_extern("void", LAUNCH_DEPENDENTS))

    @T.macro
    def consume_step(acc, ws, wc, af, xs, bars, tid, wg, row, quad, kt, u):
        # a multiplying warpgroup: wait for slot kt to be full, multiply, free it once its wgmmas completed
        T.evaluate(T.call_extern("void", WAIT_PARITY, T.address_of(bars[0, kt % stages]), kt // stages % 2))
        if registers:  # each thread its own fragments; the slot is freed after the wgmmas, as for x
            fragments(ws, af, kt % stages, row, quad, u)
        elif fp8:  # the warpgroup converts its own 64 weight rows into its part of the bf16 tile
            # a thread's wait covers its own warp's part of the wgmmas: all four must be past the last
            # reads of the tile before any of them overwrites it
            T.evaluate(T.call_extern("void", NAMED_SYNC, 2 + wg, WARPGROUP))
            convert(ws, wc, tid % WARPGROUP, kt % stages, kt % groups, wg * 64)
            T.evaluate(T.call_extern("void", FENCE_ASYNC_SHARED))
            T.evaluate(T.call_extern("void", NAMED_SYNC, 2 + wg, WARPGROUP))
        multiply(acc, ws, wc, af, xs, wg, kt, u)
        # the slot's x rows are read by its wgmmas (and its bf16 weight rows): free once they completed
        if groups == 1:
            T.evaluate(T.call_extern("void", wait, T.address_of(acc[0])))
            T.evaluate(T.call_extern("void", ARRIVE, T.address_of(bars[1, kt % stages])))
        else:  # the slot before's group has completed; this one runs on
            T.evaluate(T.call_extern("void", WAIT_PRIOR))
            if kt > 0:
                T.evaluate(T.call_extern("void", ARRIVE, T.address_of(bars[1, (kt - 1) % stages])))

    @T.macro
    def consume(acc, ws, wc, af, xs, bars, tid, wg, row, quad):
        for kt in range(per_split // unroll):
            consume_step(acc, ws, wc, af, xs, bars, tid, wg, row, quad, kt * unroll, 0)
            if unroll == 2:
                consume_step(acc, ws, wc, af, xs, bars, tid, wg, row, quad, kt * 2 + 1, 1)
        if per_split % unroll == 1:  # the odd last slot, after the loop
            consume_step(acc, ws, wc, af, xs, bars, tid, wg, row, quad, per_split - 1, 0)
        if groups > 1:
            T.evaluate(T.call_extern("void", wait, T.address_of(acc[0])))

    @T.macro
    def body(x, w, scale, y, m, part):
        for bm in T.thread_binding(T.ceildiv(m, bm_rows), thread="blockIdx.x"):
            for bn in T.thread_binding(n_blocks, thread="blockIdx.y"):
                for ks in T.thread_binding(k_splits, thread="blockIdx.z"):
                    for ty in T.thread_binding(plan.block_warps, thread="threadIdx.y"):
                        for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                            with T.sblock("wgmma"):
                                T.reads()
                                T.writes()
                                # one allocation carved in four: the weight slots, the x slots, (FP8) the
                                # converted weight tiles, then (producer) the slots' full and free barriers
                                smem = T.sblock_alloc_buffer((plan.shared_bytes() // 2,), "bfloat16",
                                                             scope="shared.dyn")  # fmt: skip
                                ws = T.decl_buffer((stages, k_atoms, bn_rows, ATOM_K), wdtype, data=smem.data,
                                                   scope="shared.dyn")  # fmt: skip
                                xs = T.decl_buffer((stages, k_atoms, bm_rows, ATOM_K), "bfloat16", data=smem.data,
                                                   elem_offset=w_elems, scope="shared.dyn")  # fmt: skip
                                wc = T.decl_buffer((groups, k_atoms, bn_rows, ATOM_K), "bfloat16", data=smem.data,
                                                   elem_offset=w_elems + x_elems, scope="shared.dyn")  # fmt: skip
                                bars = T.decl_buffer((2, stages), "uint64", data=smem.data,
                                                     elem_offset=bar_elems // 4, scope="shared.dyn")  # fmt: skip
                                acc = T.sblock_alloc_buffer((n_acc,), "float32", scope="local")
                                af = T.sblock_alloc_buffer((frag_elems,), "bfloat16", scope="local")
                                sc = T.sblock_alloc_buffer((row_scale_count(plan),), "float32", scope="local")
                                tid = T.meta_var(ty * WARP + tx)
                                wg = T.meta_var(ty // 4)
                                row = T.meta_var(ty * 16 + tx // 4)  # of the thread's A fragments (registers)
                                T.evaluate(T.call_extern("void", REQUIRE_ALIGNED, T.address_of(smem[0])))
                                if cluster:  # a tile's k splits are one cluster (dflash_compiler.cluster)
                                    T.evaluate(T.call_extern("void", DIMS, 1, 1, k_splits))
                                for i in T.unroll(n_acc):
                                    acc[i] = T.float32(0)
                                row_scales(scale, sc, bn, ty, tx // 4)  # the store's view: warp ty's 16 rows
                                if producer:
                                    if tid == 0:
                                        for s in T.unroll(stages):
                                            T.evaluate(T.call_extern("void", INIT, T.address_of(bars[0, s]),
                                                                     PRODUCER_WARPS * WARP))  # fmt: skip
                                            T.evaluate(T.call_extern("void", INIT, T.address_of(bars[1, s]),
                                                                     plan.threads))  # fmt: skip
                                    T.tvm_storage_sync("shared")
                                    if ty >= plan.n_warps:
                                        produce(x, w, m, ws, xs, bars, bm, bn, ks, tid - plan.threads)
                                    else:
                                        consume(acc, ws, wc, af, xs, bars, tid, wg, row, tx % 4)
                                else:
                                    shared_loop(x, w, m, acc, ws, wc, af, xs, bm, bn, ks, tid, wg, row, tx % 4)
                                if cluster:
                                    cluster_store(scale, y, m, acc, smem, bm, bn, ks, ty, tx, tid)
                                elif picks and producer:  # the producer meets the pick's block barriers only
                                    pick(sc, part, m, acc, smem, bm, bn, ty, 0, tx // 4, tx % 4, tid,
                                         ty < plan.n_warps)  # fmt: skip
                                elif picks:
                                    pick(sc, part, m, acc, smem, bm, bn, ty, 0, tx // 4, tx % 4, tid, True)
                                elif producer:  # the producer has no accumulators to store
                                    if ty < plan.n_warps:
                                        store(sc, y, part, m, acc, bm, bn, ks, ty, 0, tx // 4, tx % 4)
                                else:
                                    store(sc, y, part, m, acc, bm, bn, ks, ty, 0, tx // 4, tx % 4)
                                if last:
                                    last_store(scale, y, part, m, smem, bm, bn, tid)
        if k_splits > 1 and not cluster and not last:
            merge(scale, y, part, m)
        if picks:
            pick_merge(part, y, m)

    return body


def last_store_macro(spec: LinearSpec, plan: WgmmaPlan) -> Any:
    """A TVMScript macro `last_store(scale, y, part, m, smem, bm, bn, tid)`, run by every thread of a block
    once it has stored its partial sums into the workspace part[:, ks] (`linear_tiled.store_macro`): the tile's
    last block to get here adds the k splits' sums, in split order, applies the FP8 row scale and stores y, so no
    merge kernel is launched.

    The threads' stores are made visible device-wide (`__threadfence`) before a block barrier, after which
    thread 0 counts the block with one atomic add to the tile's count, part[bm, k_splits, bn] (the workspace's
    plane after the splits', `partials_shape`; an f32 count, exact at these sizes); the block that finds
    k_splits - 1 before it is the last, resets the count to zero for the next call (every split has counted by
    then) and, after a fence that orders its reads after the count, adds the tile: MERGE_VECTOR neighbouring
    outputs a thread (one 16-byte load a split) where n is a multiple of it, as the merge kernel does, so the
    sums are the same to the bit. The runtime zero-fills a workspace once, when it allocates it; the count a
    block found goes to the others through the first word of its slots, free once every copy has landed and
    every wgmma has completed (each thread waited for its own before storing).

    It saves the merge launch but leaves one block of 128 threads a tile's whole sum at the end of the grid, and
    lost, so it is off by default (linear_plans.DEFAULT_K_REDUCE). H100, one run of the builds between two copies of the
    default (bench/propose.py, ms of the step at nb = 1 / 4 / 8 / 16; µs o_proj's five calls add at nb = 8,
    timeline): bf16 1.256 / 1.470 / 1.703 / 2.501 → 1.264 / 1.499 / 1.749 / 2.605, o_proj 17.5 + 2.1 (GEMM +
    merge) → 23.2 a call; FP8 0.747 / 0.998 / 1.328 / 2.424 → 0.748 / 1.023 / 1.392 / 2.528. It is correct
    (bench/linear.py --gemm: 566/566 checks with its odd-shape cases; bench/kernels.py and the GPU tests with the
    knob: 43/43 and 45 passed), and stays a knob for a tuning database."""
    from tvm.script import tirx as T

    n, fp8, out_dtype = spec.n, spec.fp8, spec.out_dtype
    bn_rows, bm_rows, threads, splits = plan.block_n, plan.block_m, plan.threads, plan.k_splits
    vector = MERGE_VECTOR if n % MERGE_VECTOR == 0 else 1
    per_row = bn_rows // vector  # vectors of a tile row
    chunks = bm_rows * per_row
    rounds = -(-chunks // threads)

    @T.macro
    def last_store(scale, y, part, m, smem, bm, bn, tid):
        flag = T.decl_buffer((1,), "float32", data=smem.data, scope="shared.dyn")
        before = T.sblock_alloc_buffer((1,), "float32", scope="local")  # splits counted before this block
        out = T.sblock_alloc_buffer((vector,), out_dtype, scope="local")
        T.evaluate(T.call_extern("void", THREAD_FENCE))
        T.tvm_storage_sync("shared")
        if tid == 0:
            before[0] = T.call_extern("float32", "atomicAdd", T.address_of(part[bm, splits, bn]), T.float32(1))
            flag[0] = before[0]
            if before[0] == T.float32(splits - 1):
                part[bm, splits, bn] = T.float32(0)
        T.tvm_storage_sync("shared")
        before[0] = flag[0]  # a register: TVM takes no shared-memory load in a branch's condition
        if before[0] == T.float32(splits - 1):
            T.evaluate(T.call_extern("void", THREAD_FENCE))
            for r in T.unroll(rounds):
                c = T.meta_var(r * threads + tid)
                i = T.meta_var(bm * bm_rows + c // per_row)
                j = T.meta_var(bn * bn_rows + c % per_row * vector)
                if (chunks % threads == 0 or c < chunks) and i < m and j < n:
                    for v in T.vectorized(vector):
                        out[v] = T.Cast(out_dtype, split_sum(part, scale, i, j + v, splits, fp8))
                    for v in T.vectorized(vector):
                        y[i, j + v] = out[v]

    return last_store


def cluster_store_macro(spec: LinearSpec, plan: WgmmaPlan) -> Any:
    """A TVMScript macro `cluster_store(scale, y, m, acc, smem, bm, bn, ks, ty, tx, tid)`: the k splits of a
    tile, launched as one cluster of `k_splits` blocks along z (block ks is the cluster's rank ks), add up
    through distributed shared memory instead of a workspace and a merge kernel.

    Each block puts its partial sums into an f32 tile `[block_m, block_n + CLUSTER_PAD]` over its pipeline
    slots (once every copy has landed and every warpgroup has waited for its wgmmas, behind a block barrier);
    accumulator e of x tile mt holds weight row 16 · warp + g + 8 · (e // 2) and x row 8 · mt + 2t + e % 2
    (mma.sync's m16n8 layout, as `linear_tiled.store_macro` reads it). After a cluster barrier block ks adds
    the x rows [ks · r, (ks + 1) · r) (r = ceil(block_m / k_splits)) of every block's tile, four columns a
    thread per 16-byte remote load, in rank order (the sum does not depend on timing), applies the FP8 row
    scale and stores y; a second cluster barrier keeps every block's tile alive until the last remote read.

    Measured on the H200 (bench/linear.py --gemm, 128 rows, dependent launches; merge kernel → cluster, same
    run; 388/388 numpy checks including clusters of 2-8 blocks): qkv bf16 26.3 → 20.6 µs with two warpgroups
    and 4 splits, but o_proj 17.1 → 19.9, down 36.9 → 48.0, and FP8 down 51.0 → 86.4, o_proj_fp8 20.5 →
    32.1; the whole step at nb = 8 with every split GEMM clustered took 1.557 against 1.388 ms. On an H100
    qkv alone gained too (bench/linear.py: 32.6 → 25.2 µs with two warpgroups), but clustering only the
    split GEMMs of two or more warpgroups (qkv, three) made its 128-row calls in the step (bench/propose.py
    --timeline, nb = 8, same run) 40.5 µs a layer against 29.5 with the merge kernel, and the step 1.857
    against 1.824 ms. Hence KERNEL_REDUCE stays the default; the knob is there for a tuning database.
    """
    from tvm.script import tirx as T

    n, fp8, out_dtype = spec.n, spec.fp8, spec.out_dtype
    bn_rows, bm_rows, threads, splits = plan.block_n, plan.block_m, plan.threads, plan.k_splits
    quads = bn_rows // 4  # 16-byte column groups of a tile row
    rows_per = -(-bm_rows // splits)  # x rows each block of the cluster adds and stores
    chunks = rows_per * quads
    rounds = -(-chunks // threads)

    def scaled(value: Any, scale: Any, j: Any) -> Any:
        return value * scale[j] if fp8 else value

    @T.macro
    def cluster_store(scale, y, m, acc, smem, bm, bn, ks, ty, tx, tid):
        tile = T.decl_buffer((bm_rows, bn_rows + CLUSTER_PAD), "float32", data=smem.data, scope="shared.dyn")
        total = T.sblock_alloc_buffer((4,), "float32", scope="local")
        # the slots are free: every copy has landed (trailing groups are empty) and every wgmma has completed
        T.evaluate(T.ptx["cp.async.wait_all"]())
        T.tvm_storage_sync("shared")
        for mt in T.unroll(plan.m_tiles):
            for e in T.unroll(4):
                tile[mt * 8 + tx % 4 * 2 + e % 2, ty * 16 + e // 2 * 8 + tx // 4] = acc[mt * 4 + e]
        T.evaluate(T.call_extern("void", SYNC))
        for r in T.unroll(rounds):
            c = T.meta_var(r * threads + tid)
            row = T.meta_var(ks * rows_per + c // quads)
            col = T.meta_var(c % quads * 4)
            if (chunks % threads == 0 or c < chunks) and row < bm_rows and bm * bm_rows + row < m:
                for q in T.unroll(4):
                    total[q] = T.float32(0)
                for rank in T.unroll(splits):
                    T.evaluate(T.call_extern("void", ADD4, T.address_of(total[0]), T.address_of(tile[row, col]), rank))
                for q in T.unroll(4):
                    if bn * bn_rows + col + q < n:
                        y[bm * bm_rows + row, bn * bn_rows + col + q] = T.Cast(
                            out_dtype, scaled(total[q], scale, bn * bn_rows + col + q)
                        )
        T.evaluate(T.call_extern("void", SYNC))  # no block leaves while another may read its tile

    return cluster_store
