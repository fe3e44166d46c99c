"""Tensor-core GEMV for the linear family: `mma.sync.m16n8k16` bf16 → f32 with the weight as the A operand.

The drafter's linears have few rows (m = 16…64 block rows, ~7 context rows) and large weights, so the kernel
is a weight stream: every weight byte is read once, and the rows of `x` ride along as the mma's 8-wide N
dimension ("swap AB": `y^T[n, m] = W[n, k] @ x^T[k, m]`). SIMT FMAs cannot keep up at m = 16 (16 FMAs per
weight element is the whole FP32 rate of an H200); one m16n8k16 does 2048 of them.

Layout (one warp, lane = 4·g + t): the A fragment of an m16n8k16 holds, per thread, the pairs at logical
columns {2t, 2t+1} and {2t+8, 2t+9} of rows g and g+8; the B fragment holds the same logical k rows of
column g. The sum over k does not care about the order of k, so logical k is mapped onto memory such that
each thread's share of a `4·V`-wide k step is V *contiguous* elements (V = 16 bytes of weight: 8 bf16 or 16
e4m3): mma j of the step takes logical 2t+e ↦ t·V + 4j + e and 2t+8+e ↦ t·V + 4j + 2 + e. The weight and `x`
both follow the map, so every global load is one 16-byte vector per thread, and the B fragment of mma j is
simply elements [4j, 4j+4) of the thread's `x` vector.

Work split: a block of `warps` warps owns `16·row_tiles` weight rows; its warps split k (each warp a
contiguous range of k steps) and their partial sums meet in shared memory, where the block adds them,
applies the FP8 per-row scale and stores. A warp issues the loads of `unroll` k steps (weight and x) as one
batch before any mma of it; with `stages` = 2 the next batch's loads are in flight while the current one
is multiplied (two register buffers, a loop unrolled by two so every buffer index is static). Rows of `x`
go `m_tile` at a time (a runtime loop over ceil(m / m_tile) passes over the block's weight); 8-row groups
past m neither load nor multiply. Out-of-range rows (the ragged last block of weight rows, the last group
of x rows) read a clamped, valid row instead: an mma's output row i depends only on A row i and output
column j only on B column j, and those outputs are never stored. FP8 weights are converted to bf16 in
registers (every e4m3 value is exact in bf16).

Before it reads `x`, every thread prefetches its first `stages · unroll` weight vectors into L2 and then
waits for the grid that wrote `x` (programmatic dependent launch, dependent_launch.py), so under a
dependent launch the weight stream starts while the previous kernel drains.

The kernel is written as TVMScript with explicit thread bindings and `T.ptx_legacy.mma`; TVM generates the
CUDA. It is not derived from the spec's TE computation (that stays the CPU oracle); it is checked against
the spec's numpy reference on the GPU (bench/linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_compiler.dependent_launch import PREFETCH_L2, WAIT

if TYPE_CHECKING:
    from .linear import LinearSpec

WARP = 32
MMA_ROWS = 16  # weight rows per m16n8k16 (its M)
MMA_COLS = 8  # rows of x per m16n8k16 (its N)


@dataclass(frozen=True)
class MmaPlan:
    """The resolved shape of one tensor-core GEMV kernel (knobs after fitting them to the spec)."""

    warps: int  # warps per block; they split k
    row_tiles: int  # 16-row weight tiles per block (every warp of the block works on all of them)
    unroll: int  # k steps of weight loads a warp issues before its first mma of the batch
    m_tile: int  # rows of x per pass (a multiple of 8)
    stages: int  # 1: load a batch, then multiply it; 2: the next batch's loads fly during the multiplies
    vector: int  # weight elements per 16-byte load (8 bf16, 16 e4m3)

    @property
    def step_k(self) -> int:
        """k elements one warp consumes per step (4 threads of a row group × one vector each)."""
        return 4 * self.vector

    @property
    def block_rows(self) -> int:
        return MMA_ROWS * self.row_tiles

    def knobs(self) -> dict[str, int]:
        """The plan as the rule's knob values (what the Kernel reports)."""
        return {"warps": self.warps, "row_tiles": self.row_tiles, "unroll": self.unroll, "m_tile": self.m_tile,
                "stages": self.stages}  # fmt: skip

    def shared_bytes(self) -> int:
        """The f32 partial sums of every warp: [warps, m_tile, block_rows]."""
        return 4 * self.warps * self.m_tile * self.block_rows


def mma_gemv_func(spec: LinearSpec, plan: MmaPlan) -> Any:
    """The CUDA-scheduled PrimFunc of `spec` (params x, w[, scale], y) following `plan`."""
    from tvm.script import tirx as T

    n, k = spec.n, spec.k
    fp8, out_dtype, wdtype = spec.fp8, spec.out_dtype, spec.weight_dtype
    warps, row_tiles, unroll, m_tile, vec = plan.warps, plan.row_tiles, plan.unroll, plan.m_tile, plan.vector
    step_k, block_rows = plan.step_k, plan.block_rows
    steps_per_warp = k // step_k // warps
    batches = steps_per_warp // unroll  # batches of `unroll` k steps per warp
    stages = plan.stages
    m_groups = m_tile // MMA_COLS
    mmas_per_step = vec // 4  # 16 logical k per mma, 4 physical k per thread per mma
    x_vectors = vec // 8  # 16-byte loads of x (bf16) per step
    blocks = -(-n // block_rows)
    threads = WARP * warps
    outputs = m_tile * block_rows
    out_rounds = -(-outputs // threads)
    frag_a = row_tiles * mmas_per_step * 8
    prefetch_steps = min(stages * unroll, steps_per_warp)
    symbol = spec.name

    @T.macro
    def load_batch(x, w, m, wl, xl, bx, ty, tx, mc, slot, batch):
        # every load of `unroll` k steps (weight and x) before any mma: that many 16-byte loads in flight
        for u in T.unroll(unroll):
            for rt in T.unroll(row_tiles):
                for h in T.unroll(2):
                    for v in T.vectorized(vec):
                        # rows past n (ragged last block) read row n-1: mma row i only feeds output row i
                        wl[slot, u, rt, h, v] = w[
                            T.min(bx * block_rows + rt * 16 + h * 8 + tx // 4, n - 1),
                            (ty * steps_per_warp + batch * unroll + u) * step_k + tx % 4 * vec + v,
                        ]
            for mg in T.unroll(m_groups):
                if mc * m_tile + mg * 8 < m:  # warp-uniform: 8-row groups past m load nothing
                    for xv in T.unroll(x_vectors):
                        for v in T.vectorized(8):
                            # rows past m read row m-1: mma column j only feeds output row j, never stored
                            xl[slot, u, mg, xv * 8 + v] = x[
                                T.min(mc * m_tile + mg * 8 + tx // 4, m - 1),
                                (ty * steps_per_warp + batch * unroll + u) * step_k + tx % 4 * vec + xv * 8 + v,
                            ]

    @T.macro
    def compute_batch(m, mc, wl, xl, af, bf, acc, slot):
        for u in T.unroll(unroll):
            # B fragments through a scalar copy (free in registers): TVM retypes a local buffer that is
            # only ever accessed as whole vectors (uint4 xl[]), which would break the mma's element offsets
            for mg in T.unroll(m_groups):
                for v in T.unroll(vec):
                    bf[mg * vec + v] = xl[slot, u, mg, v]
            # A fragment of mma j: rows g, g+8 at physical 4j + {0,1}, then at 4j + {2,3} (FP8: converted)
            for rt in T.unroll(row_tiles):
                for j in T.unroll(mmas_per_step):
                    for c in T.unroll(4):
                        for e in T.unroll(2):
                            af[(rt * mmas_per_step + j) * 8 + c * 2 + e] = T.Cast(
                                "bfloat16", wl[slot, u, rt, c % 2, 4 * j + c // 2 * 2 + e]
                            )
            for mg in T.unroll(m_groups):
                if mc * m_tile + mg * 8 < m:
                    for rt in T.unroll(row_tiles):
                        for j in T.unroll(mmas_per_step):
                            T.evaluate(
                                T.ptx_legacy.mma(
                                    "m16n8k16",
                                    "row",
                                    "col",
                                    "bf16",
                                    "bf16",
                                    "fp32",
                                    af.data,
                                    (rt * mmas_per_step + j) * 8,
                                    bf.data,
                                    mg * vec + 4 * j,
                                    acc.data,
                                    (rt * m_groups + mg) * 4,
                                    False,
                                    dtype="float32",
                                )
                            )

    @T.macro
    def store_output(scale, y, m, bx, mc, red, total, idx):
        # one output per thread per round: the block's partial sums of all warps, in row-major order
        if idx < outputs and mc * m_tile + idx // block_rows < m and bx * block_rows + idx % block_rows < n:
            total[0] = T.float32(0)
            for ww in T.unroll(warps):
                total[0] = total[0] + red[ww, idx // block_rows, idx % block_rows]
            if fp8:
                total[0] = total[0] * scale[bx * block_rows + idx % block_rows]
            y[mc * m_tile + idx // block_rows, bx * block_rows + idx % block_rows] = T.Cast(out_dtype, total[0])

    @T.macro
    def chunk(x, w, scale, y, m, bx, ty, tx, mc, red, wl, xl, af, bf, acc, total):
        for rt in T.unroll(row_tiles):
            for mg in T.unroll(m_groups):
                for e in T.unroll(4):
                    acc[rt, mg, e] = T.float32(0)
        if stages == 1:
            for b in range(batches):
                load_batch(x, w, m, wl, xl, bx, ty, tx, mc, 0, b)
                compute_batch(m, mc, wl, xl, af, bf, acc, 0)
        else:
            # double buffer: the loads of batch b + 1 are in flight while batch b is multiplied
            load_batch(x, w, m, wl, xl, bx, ty, tx, mc, 0, 0)
            for b2 in range(batches // 2):
                load_batch(x, w, m, wl, xl, bx, ty, tx, mc, 1, 2 * b2 + 1)
                compute_batch(m, mc, wl, xl, af, bf, acc, 0)
                if 2 * b2 + 2 < batches:
                    load_batch(x, w, m, wl, xl, bx, ty, tx, mc, 0, 2 * b2 + 2)
                compute_batch(m, mc, wl, xl, af, bf, acc, 1)
            if batches % 2 == 1:
                compute_batch(m, mc, wl, xl, af, bf, acc, 0)
        # accumulator e holds weight row g + 8 * (e // 2) times x row 2t + e % 2
        for rt in T.unroll(row_tiles):
            for mg in T.unroll(m_groups):
                for e in T.unroll(4):
                    red[ty, mg * 8 + tx % 4 * 2 + e % 2, rt * 16 + e // 2 * 8 + tx // 4] = acc[rt, mg, e]
        T.tvm_storage_sync("shared")
        for r in range(out_rounds):
            store_output(scale, y, m, bx, mc, red, total, r * threads + ty * WARP + tx)
        T.tvm_storage_sync("shared")

    @T.macro
    def body(x, w, scale, y, m):
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                    with T.sblock("gemv"):
                        T.reads()
                        T.writes()
                        red = T.sblock_alloc_buffer((warps, m_tile, block_rows), "float32", scope="shared")
                        wl = T.sblock_alloc_buffer((stages, unroll, row_tiles, 2, vec), wdtype, scope="local")
                        xl = T.sblock_alloc_buffer((stages, unroll, m_groups, vec), "bfloat16", scope="local")
                        af = T.sblock_alloc_buffer((frag_a,), "bfloat16", scope="local")
                        bf = T.sblock_alloc_buffer((m_groups * vec,), "bfloat16", scope="local")
                        acc = T.sblock_alloc_buffer((row_tiles, m_groups, 4), "float32", scope="local")
                        total = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        # weights are never written by a kernel: fetch the first batches into L2 before
                        # waiting for the grid that writes x (dependent_launch.py)
                        for u in T.unroll(prefetch_steps):
                            for rt in T.unroll(row_tiles):
                                for h in T.unroll(2):
                                    T.evaluate(T.call_extern("void", PREFETCH_L2, T.address_of(w[
                                        T.min(bx * block_rows + rt * 16 + h * 8 + tx // 4, n - 1),
                                        (ty * steps_per_warp + u) * step_k + tx % 4 * vec,
                                    ])))  # fmt: skip
                        T.evaluate(T.call_extern("void", WAIT))
                        for mc in range(T.ceildiv(m, m_tile)):
                            chunk(x, w, scale, y, m, bx, ty, tx, mc, red, wl, xl, af, bf, acc, total)

    if spec.fp8:

        @T.prim_func(s_tir=True)
        def scaled(x_h: T.handle, w_h: T.handle, s_h: T.handle, y_h: T.handle):
            T.func_attr({"global_symbol": symbol, "tirx.noalias": True, "tirx.is_scheduled": True})
            m = T.int32()
            x = T.match_buffer(x_h, (m, k), "bfloat16")
            w = T.match_buffer(w_h, (n, k), wdtype)
            scale = T.match_buffer(s_h, (n,), "float32")
            y = T.match_buffer(y_h, (m, n), out_dtype)
            body(x, w, scale, y, m)

        return scaled

    @T.prim_func(s_tir=True)
    def plain(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": symbol, "tirx.noalias": True, "tirx.is_scheduled": True})
        m = T.int32()
        x = T.match_buffer(x_h, (m, k), "bfloat16")
        w = T.match_buffer(w_h, (n, k), wdtype)
        y = T.match_buffer(y_h, (m, n), out_dtype)
        body(x, w, x, y, m)  # no scale buffer: the body reads it only for FP8 weights

    return plain
