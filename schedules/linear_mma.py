"""Tensor-core linear kernel: `mma.sync.m16n8k16` bf16 → f32 with the weight as the A operand.

The drafter's linears have few rows (m = 16…256 block rows, ~7 context rows) and large weights, so the
kernel is a weight stream: the rows of `x` ride along as the mma's 8-wide N dimension ("swap AB":
`y^T[n, m] = W[n, k] @ x^T[k, m]`). SIMT FMAs cannot keep up at m = 16 (16 FMAs per weight element is the
whole FP32 rate of an H200); one m16n8k16 does 2048 of them.

Layout (one warp, lane = 4·g + t): the A fragment of an m16n8k16 holds, per thread, the pairs at logical
columns {2t, 2t+1} and {2t+8, 2t+9} of rows g and g+8; the B fragment holds the same logical k rows of
column g; accumulator e holds row g + 8·(e // 2), column 2t + e % 2. The sum over k does not care about the
order of k, so logical k is mapped onto memory such that each thread's share of a `4·V`-wide k step is V
*contiguous* elements (V = 16 bytes of weight: 8 bf16 or 16 e4m3): mma j of the step takes logical
2t+e ↦ t·V + 4j + e and 2t+8+e ↦ t·V + 4j + 2 + e. The weight and `x` both follow the map, so every global
load is one 16-byte vector per thread, and the B fragment of mma j is simply elements [4j, 4j+4) of the
thread's `x` (8 bf16 per 16-byte x vector: x vector i feeds mmas 2i and 2i + 1).

Work split: a block is `warps` × `n_warps` warps and owns `16·row_tiles·n_warps` weight rows. Its n warps
each own `16·row_tiles` of those rows; its k warps split k (each a contiguous range of k steps), and the
partial sums of the k warps meet in shared memory, where the block adds them, applies the FP8 per-row
scale and stores. A warp issues the weight loads of `unroll` k steps as one batch
before any mma of it; with `stages` = 2 the next batch's loads are in flight while the current one is
multiplied (two register buffers, a loop unrolled by two so every buffer index is static). Rows of `x` go
`m_tile` at a time: a runtime loop over ceil(m / m_tile) passes, each streaming the block's weight again,
and 8-row groups past m neither load nor multiply. Out-of-range weight rows (the ragged last block) read
a clamped, valid row: an mma's output row i depends only on A row i and output column j only on B column
j, and those outputs are never stored. FP8 weights are converted to bf16 in registers (every e4m3 value
is exact in bf16), four bytes per call of the integer conversion in fp8_convert.py.

Where `x` goes is the `x_stages` knob:

* 0, GEMV mode: the x fragments of a batch are loaded with its weight, straight into registers. Those
  registers (stages · unroll · m_tile / 8 · V / 2) cap m_tile at 16-32, so m = 128 re-streams the weight
  eight times; by default calls above `gemm_rows` rows go to the tiled GEMM of `linear_tiled.py` (or
  `linear_wgmma.py`'s warpgroup GEMM on sm_90) instead,
  which the host code picks per call, and for all but wide FP8 weights the calls up to gemm_rows rows go to a
  small plan of the same kernel (`small_tiled_plan` in linear_plans.py), whose weight in flight sits in shared
  memory instead of registers.
* n >= 1, GEMM mode (a knob setting; the tiled GEMM is 1.2-1.7x faster at 64-256 rows on the H200;
  m_tile 64-256, the weight streamed once for up to m_tile rows): the registers hold the accumulators
  (row_tiles · m_tile / 8 · 4 floats) and x goes through shared memory. Each thread copies the 16-byte x
  vectors it will use as B fragments with `cp.async` (global → shared: a copy in flight costs no register)
  into its own slots of a ring [n, m_tile / 8 row groups, warps, 32 threads, 16 B], n - 1 x
  vectors ahead of the one it multiplies, and reads each back with one 16-byte load per row group (a warp
  reads 512 contiguous bytes: no bank conflict). A thread reads only what it copied itself, so
  `cp.async.wait_group` orders it and the k loop needs no barrier. Shared memory brings no reuse here
  (every x element feeds one thread of one warp); it is the landing buffer that lets the loads fly
  without registers. The ring advances per x vector rather than per weight batch, so it holds n vectors,
  not stages · unroll steps: 64 KiB for m_tile 128, 4 warps and n = 2. In the last row group the rows past
  m are zero-filled (`cp.async` ignore-src) instead of clamped, which keeps one x address per thread
  rather than one per row group. The partial sums are laid over the ring (TVM merges the two dynamic
  shared buffers; a barrier after the last x read separates them), so a block needs the larger of the two.
  Every block reads its k range of all m rows of x, so x crosses from L2 m / (16 · row_tiles · n_warps)
  times the weight's bytes (8 times at m = 128 with one row tile and one n warp), which can bound the speed
  at large m rather than DRAM. More n warps cut that: the n warps of a k slice need the same x, so each
  copies a share of the row groups (warp j: groups j, j + n_warps, ...) and reads all of them, which needs
  a block barrier per x vector (after waiting for its own copies, before the next copy reuses the slot
  everyone has finished reading) and a ring of at least two slots.

Before it reads `x`, every thread prefetches its first `stages · unroll` weight vectors into L2 and then
waits for the grid that wrote `x` (programmatic dependent launch, dependent_launch.py), so under a
dependent launch the weight stream starts while the previous kernel drains; once its last pass has
multiplied its weight, it lets the next grid in, for its reduction and stores.

The kernel is written as TVMScript with explicit thread bindings, `T.ptx_legacy.mma` and `T.ptx` cp.async;
TVM generates the CUDA. It is not derived from the spec's TE computation (that stays the CPU oracle); it is
checked against the spec's numpy reference on the GPU (bench/linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, PREFETCH_L2, WAIT
from dflash_compiler.weight_tiles import tile_index

from .base import ScheduleError
from .linear_argmax import pick_blocks
from .linear_tiled import TiledPlan, tiled_body_macro
from .linear_wgmma import WgmmaPlan, wgmma_body_macro
from .mma import a_fragments_macro, mma_m16n8k16

if TYPE_CHECKING:
    from .linear import LinearSpec

WARP = 32
MMA_ROWS = 16  # weight rows per m16n8k16 (its M)
MMA_COLS = 8  # rows of x per m16n8k16 (its N)


@dataclass(frozen=True)
class MmaPlan:
    """The resolved shape of one tensor-core linear kernel (knobs after fitting them to the spec)."""

    warps: int  # warps per block along k: they split k
    row_tiles: int  # 16-row weight tiles per warp (every k warp of the block works on all of its n slice)
    unroll: int  # k steps of weight loads a warp issues before its first mma of the batch
    m_tile: int  # rows of x per pass (a multiple of 8)
    stages: int  # 1: load a batch, then multiply it; 2: the next batch's loads fly during the multiplies
    vector: int  # weight elements per 16-byte load (8 bf16, 16 e4m3)
    x_stages: int = 0  # 0: x fragments straight into registers; n: through a ring of n shared-memory slots
    n_warps: int = 1  # warps per block along n, each with its own row_tiles; in GEMM mode they share x

    @property
    def x_vectors(self) -> int:
        """16-byte vectors of x (8 bf16) per thread, row group and k step."""
        return self.vector // 8

    @property
    def step_k(self) -> int:
        """k elements one warp consumes per step (4 threads of a row group × one vector each)."""
        return 4 * self.vector

    @property
    def block_rows(self) -> int:
        return MMA_ROWS * self.row_tiles * self.n_warps

    @property
    def threads(self) -> int:
        return WARP * self.warps * self.n_warps

    def knobs(self) -> dict[str, int]:
        """The plan as the rule's knob values (what the Kernel reports)."""
        return {"warps": self.warps, "row_tiles": self.row_tiles, "unroll": self.unroll, "m_tile": self.m_tile,
                "stages": self.stages, "x_stages": self.x_stages, "n_warps": self.n_warps}  # fmt: skip

    def reduction_bytes(self) -> int:
        """The f32 partial sums of every k warp: [warps, m_tile, block_rows]."""
        return 4 * self.warps * self.m_tile * self.block_rows

    def x_ring_bytes(self) -> int:
        return x_ring_bytes(self.x_stages, self.m_tile, self.warps)

    def shared_bytes(self) -> int:
        """Shared memory per block. With x in shared memory both buffers are dynamic, and TVM's merge of
        them places the partial sums (live only after a barrier that follows the last x read) in the ring's
        space when they fit there and after it when they do not: the block needs the ring alone or the sum."""
        if not self.x_stages:
            return self.reduction_bytes()
        ring, partial = self.x_ring_bytes(), self.reduction_bytes()
        return ring if partial <= ring else ring + partial


def x_ring_bytes(x_stages: int, m_tile: int, warps: int) -> int:
    """The x ring: [x_stages, m_tile / 8 row groups, k warps, 32 threads, 16 bytes]."""
    return x_stages * (m_tile // MMA_COLS) * warps * WARP * 16


def _gemm_body(spec: LinearSpec, plan: TiledPlan | WgmmaPlan) -> Any:
    """The body macro of a tiled GEMM plan: `linear_wgmma.py`'s for a WgmmaPlan, else `linear_tiled.py`'s."""
    return wgmma_body_macro(spec, plan) if isinstance(plan, WgmmaPlan) else tiled_body_macro(spec, plan)


def mma_gemv_func(
    spec: LinearSpec,
    plan: MmaPlan,
    gemm: tuple[int, TiledPlan | WgmmaPlan] | None = None,
    small: TiledPlan | WgmmaPlan | None = None,
    mid: WgmmaPlan | None = None,
    tall: tuple[int, WgmmaPlan] | None = None,
) -> Any:
    """The CUDA-scheduled PrimFunc of `spec` (params x, w[, scale], y) following `plan`.

    With `gemm = (rows, tiled_plan)` the PrimFunc also holds the tiled GEMM of `linear_tiled.py` (or, for
    a WgmmaPlan, the warpgroup GEMM of `linear_wgmma.py`) and its host code picks per call: `plan`'s kernel
    for m <= rows (or, with `small`, a second tiled kernel of that plan, or a warpgroup GEMM for a WgmmaPlan,
    which must not split k), the GEMM above (with, for k splits, its workspace and merge kernel); the kernel
    table records each launch's condition (codegen.KernelLaunch.when). With `mid`, a second warpgroup GEMM,
    the calls above rows and up to mid.block_m rows go to it instead; with `tall = (tall_rows, plan)`, a
    third, the calls above those and up to tall_rows rows, in x tiles of plan.block_m rows.
    """
    from tvm.script import tirx as T

    n, k = spec.n, spec.k
    out_dtype, wdtype, symbol = spec.out_dtype, spec.weight_dtype, spec.name
    body = _body_macro(spec, plan)
    if small is not None and (gemm is None or small.k_splits != 1):
        raise ScheduleError(
            f"{spec.name}: a tiled kernel for few rows was given with gemm={gemm} and {small.k_splits} k splits; "
            "expected gemm = (rows, plan), which it shares the calls with, and one k split (it has no workspace)"
        )
    if mid is not None and (gemm is None or not gemm[0] < mid.block_m):
        raise ScheduleError(
            f"{spec.name}: a GEMM for calls up to {mid.block_m} rows was given with gemm={gemm}; expected gemm = "
            "(rows, plan) with rows below its tile, whose calls above it go to the larger GEMM"
        )
    below = mid.block_m if mid is not None else gemm[0] if gemm is not None else 0
    if tall is not None and (gemm is None or not below < tall[0] or tall[1].block_m > tall[0]):
        raise ScheduleError(
            f"{spec.name}: a GEMM for calls up to {tall[0]} rows in tiles of {tall[1].block_m} was given with "
            f"gemm={gemm}, mid={mid}; expected a GEMM above rows, and tall rows above the tiers below it, at least "
            "its tile's"
        )
    if spec.tiled_only and (gemm is None or small is None or gemm[1].k_splits != 1):
        raise ScheduleError(
            f"{spec.name}: its epilogue runs on tiled kernels without k splits; found gemm={gemm}, "
            f"small={small}. Fix: gemm_rows > 0, gemv_tiled_stages > 0 and one k split"
        )
    if gemm is not None:
        rows, tiled = gemm
        few = body if small is None else _gemm_body(spec, small)
        large = _gemm_body(spec, tiled)
        middle = wgmma_body_macro(spec, mid) if mid is not None else None
        mid_rows = mid.block_m if mid is not None else 0

        @T.macro
        def run_large(x, w, scale, y, m):
            part = T.sblock_alloc_buffer(partials_shape(spec, tiled, m), "float32")
            large(x, w, scale, y, m, part)

        run_above_mid = run_large
        if tall is not None:
            tall_rows, tall_plan = tall
            taller = wgmma_body_macro(spec, tall_plan)

            @T.macro
            def run_above_mid(x, w, scale, y, m):
                if m <= tall_rows:
                    tall_part = T.sblock_alloc_buffer(partials_shape(spec, tall_plan, m), "float32")
                    taller(x, w, scale, y, m, tall_part)
                else:
                    run_large(x, w, scale, y, m)

        @T.macro
        def body(x, w, scale, y, m):
            if m <= rows:
                if small is None:
                    few(x, w, scale, y, m)
                else:
                    few_ws = T.sblock_alloc_buffer(partials_shape(spec, small, m), "float32")
                    few(x, w, scale, y, m, few_ws)
            elif mid is not None:
                if m <= mid_rows:
                    mid_part = T.sblock_alloc_buffer(partials_shape(spec, mid, m), "float32")
                    middle(x, w, scale, y, m, mid_part)
                else:
                    run_above_mid(x, w, scale, y, m)
            else:
                run_above_mid(x, w, scale, y, m)

    if spec.fp8:

        @T.prim_func(s_tir=True)
        def scaled(x_h: T.handle, w_h: T.handle, s_h: T.handle, y_h: T.handle):
            T.func_attr({"global_symbol": symbol, "tirx.noalias": True, "tirx.is_scheduled": True})
            m = T.int32()
            x = T.match_buffer(x_h, (m, k), "bfloat16")
            w = T.match_buffer(w_h, (n, k), wdtype)
            scale = T.match_buffer(s_h, (n,), "float32")
            y = T.match_buffer(y_h, spec.out_dims(m), out_dtype)
            body(x, w, scale, y, m)

        return scaled

    @T.prim_func(s_tir=True)
    def plain(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": symbol, "tirx.noalias": True, "tirx.is_scheduled": True})
        m = T.int32()
        x = T.match_buffer(x_h, (m, k), "bfloat16")
        w = T.match_buffer(w_h, (n, k), wdtype)
        y = T.match_buffer(y_h, spec.out_dims(m), out_dtype)
        body(x, w, x, y, m)  # no scale buffer: the body reads it only for FP8 weights

    return plain


def partials_shape(spec: LinearSpec, plan: TiledPlan | WgmmaPlan, m: Any) -> tuple[Any, ...]:
    """The host workspace of a tiled or warpgroup GEMM's call of `m` rows: lm_head_argmax's best (rank, value)
    per row and block along n, `[2, m, blocks]` (linear_argmax.py); the k splits' f32 partial sums `[m,
    splits, n]` for the merge kernel (a row's splits apart by a constant stride, so that the merge's loads of
    them are vector loads), unless a cluster adds them (linear_wgmma.py), with a plane past the splits' for the
    tiles' counts where the last block adds them (`last_store_macro`); else one slot of nothing."""
    if spec.picks:
        return (2, m, pick_blocks(spec, plan))
    if isinstance(plan, WgmmaPlan) and plan.last:  # and a plane past the splits': the tiles' counts
        return (m, plan.k_splits + 1, spec.n)
    if plan.k_splits > 1 and not (isinstance(plan, WgmmaPlan) and plan.cluster):
        return (m, plan.k_splits, spec.n)
    return (1,)


def _body_macro(spec: LinearSpec, plan: MmaPlan) -> Any:
    """The kernel of `plan` as a TVMScript macro `body(x, w, scale, y, m)` (bound threads included)."""
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
    x_vectors = plan.x_vectors  # 16-byte vectors of x (bf16) per step; each feeds 2 mmas
    x_stages = plan.x_stages
    x_ahead = max(x_stages - 1, 0)  # x vectors in flight while one is multiplied
    x_units = steps_per_warp * x_vectors  # x vectors per thread and row group over the warp's k range
    blocks = -(-n // block_rows)
    n_warps = plan.n_warps
    warp_rows = MMA_ROWS * row_tiles  # weight rows of one warp
    threads = plan.threads
    outputs = m_tile * block_rows
    out_rounds = -(-outputs // threads)
    frag_a = row_tiles * mmas_per_step * 8
    prefetch_steps = min(stages * unroll, steps_per_warp)
    if x_stages:  # x ring [slot, row group, k warp, thread, 8]; one x vector at a time in registers
        smem, xs_shape, xl_shape, bf_size = "shared.dyn", (x_stages, m_groups, warps, WARP, 8), (8,), 8
    else:  # every x vector of `stages` batches in registers; no ring (a dummy never touched)
        smem, xs_shape, xl_shape, bf_size = "shared", (1,), (stages, unroll, m_groups, vec), m_groups * vec
    xs_scope = smem if x_stages else "local"
    mma = mma_m16n8k16()
    a_fragments = a_fragments_macro(fp8, row_tiles, mmas_per_step)

    @T.macro
    def load_batch(x, w, m, wl, xl, bx, ty, tx, mc, slot, batch):
        # every load of `unroll` k steps (weight, and x unless it goes through shared memory) before any mma
        for u in T.unroll(unroll):
            for rt in T.unroll(row_tiles):
                for h in T.unroll(2):
                    # rows past n (ragged last block) read row n-1: mma row i only feeds output row i; the
                    # vector's first element through the layout, the rest beside it (one tile row holds it)
                    wi = T.meta_var(
                        tile_index(
                            spec.tiles,
                            T.min(bx * block_rows + ty // warps * warp_rows + rt * 16 + h * 8 + tx // 4, n - 1),
                            (ty % warps * steps_per_warp + batch * unroll + u) * step_k + tx % 4 * vec,
                            spec.k,
                        )
                    )
                    for v in T.vectorized(vec):
                        wl[slot, u, rt, h, v] = w[wi[0], wi[1] + v]
            if x_stages == 0:
                for mg in T.unroll(m_groups):
                    if mc * m_tile + mg * 8 < m:  # warp-uniform: 8-row groups past m load nothing
                        for xv in T.unroll(x_vectors):
                            for v in T.vectorized(8):
                                # rows past m read row m-1: mma column j only feeds output row j, never stored
                                xl[slot, u, mg, xv * 8 + v] = x[
                                    T.min(mc * m_tile + mg * 8 + tx // 4, m - 1),
                                    (ty % warps * steps_per_warp + batch * unroll + u) * step_k
                                    + tx % 4 * vec
                                    + xv * 8
                                    + v,
                                ]

    @T.macro
    def stage_x(x, m, xs, ty, tx, mc, unit):
        # x vector `unit` of the warp's k range (step unit // x_vectors), one async 16-byte copy per row group
        # into ring slot unit % x_stages; the n warps of a k slice split the row groups (warp j copies
        # groups j, j + n_warps, ...), so with one n warp a thread copies exactly what it reads back
        if unit < x_units:
            for mi in T.unroll(m_groups // n_warps):
                if mc * m_tile + (mi * n_warps + ty // warps) * 8 < m:
                    T.evaluate(T.ptx["cp.async.ca.shared.global"](
                        T.address_of(xs[unit % x_stages, mi * n_warps + ty // warps, ty % warps, tx, 0]),
                        T.address_of(x[
                            mc * m_tile + (mi * n_warps + ty // warps) * 8 + tx // 4,
                            (ty % warps * steps_per_warp + unit // x_vectors) * step_k + tx % 4 * vec
                            + unit % x_vectors * 8,
                        ]),
                        16,
                        mc * m_tile + (mi * n_warps + ty // warps) * 8 + tx // 4 >= m,
                    ))  # fmt: skip
        T.evaluate(T.ptx["cp.async.commit_group"]())  # one group per unit, empty or not: wait_group counts them

    @T.macro
    def compute_batch(m, mc, wl, xl, af, bf, acc, slot):
        for u in T.unroll(unroll):
            # B fragments through a scalar copy (free in registers): TVM retypes a local buffer that is
            # only ever accessed as whole vectors (uint4 xl[]), which would break the mma's element offsets
            for mg in T.unroll(m_groups):
                for v in T.unroll(vec):
                    bf[mg * vec + v] = xl[slot, u, mg, v]
            a_fragments(wl, af, slot, u, 0, mmas_per_step)
            for mg in T.unroll(m_groups):
                if mc * m_tile + mg * 8 < m:
                    for rt in T.unroll(row_tiles):
                        for j in T.unroll(mmas_per_step):
                            mma(af, (rt * mmas_per_step + j) * 8, bf, mg * vec + 4 * j, acc, (rt * m_groups + mg) * 4)

    @T.macro
    def compute_batch_shared(x, m, ty, tx, mc, wl, xs, xl, af, bf, acc, slot, batch):
        # per x vector: start the copy x_ahead vectors ahead, wait for this one, then per row group read the
        # B fragments of its two mmas from shared memory (the weight's A fragments serve every group)
        for u in T.unroll(unroll):
            for xv in T.unroll(x_vectors):
                if n_warps == 1:
                    stage_x(x, m, xs, ty, tx, mc, (batch * unroll + u) * x_vectors + xv + x_ahead)
                    T.evaluate(T.ptx["cp.async.wait_group"](x_ahead))
                else:
                    # the vector was copied by the k slice's n warps: wait for this thread's share, meet the
                    # others (which also ends every read of the slot the next copy overwrites), then copy
                    T.evaluate(T.ptx["cp.async.wait_group"](x_ahead - 1))
                    T.tvm_storage_sync("shared")
                    stage_x(x, m, xs, ty, tx, mc, (batch * unroll + u) * x_vectors + xv + x_ahead)
                a_fragments(wl, af, slot, u, xv * 2, 2)
                for mg in T.unroll(m_groups):
                    if mc * m_tile + mg * 8 < m:
                        for v in T.vectorized(8):
                            xl[v] = xs[((batch * unroll + u) * x_vectors + xv) % x_stages, mg, ty % warps, tx, v]
                        for v in T.unroll(8):
                            bf[v] = xl[v]  # scalar copy: see compute_batch
                        for rt in T.unroll(row_tiles):
                            for jj in T.unroll(2):
                                mma(af, (rt * mmas_per_step + xv * 2 + jj) * 8, bf, 4 * jj, acc,
                                    (rt * m_groups + mg) * 4)  # fmt: skip

    @T.macro
    def compute(x, m, ty, tx, mc, wl, xs, xl, af, bf, acc, slot, batch):
        if x_stages == 0:
            compute_batch(m, mc, wl, xl, af, bf, acc, slot)
        else:
            compute_batch_shared(x, m, ty, tx, mc, wl, xs, xl, af, bf, acc, slot, batch)

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
    def chunk(x, w, scale, y, m, bx, ty, tx, mc, red, xs, wl, xl, af, bf, acc, total):
        for rt in T.unroll(row_tiles):
            for mg in T.unroll(m_groups):
                for e in T.unroll(4):
                    acc[rt, mg, e] = T.float32(0)
        if x_stages > 0:
            for i in T.unroll(x_ahead):
                stage_x(x, m, xs, ty, tx, mc, i)
        if stages == 1:
            for b in range(batches):
                load_batch(x, w, m, wl, xl, bx, ty, tx, mc, 0, b)
                compute(x, m, ty, tx, mc, wl, xs, xl, af, bf, acc, 0, b)
        else:
            # double buffer: the loads of batch b + 1 are in flight while batch b is multiplied
            load_batch(x, w, m, wl, xl, bx, ty, tx, mc, 0, 0)
            for b2 in range(batches // 2):
                load_batch(x, w, m, wl, xl, bx, ty, tx, mc, 1, 2 * b2 + 1)
                compute(x, m, ty, tx, mc, wl, xs, xl, af, bf, acc, 0, 2 * b2)
                if 2 * b2 + 2 < batches:
                    load_batch(x, w, m, wl, xl, bx, ty, tx, mc, 0, 2 * b2 + 2)
                compute(x, m, ty, tx, mc, wl, xs, xl, af, bf, acc, 1, 2 * b2 + 1)
            if batches % 2 == 1:
                compute(x, m, ty, tx, mc, wl, xs, xl, af, bf, acc, 0, batches - 1)
        if mc == T.ceildiv(m, m_tile) - 1:  # the last pass's weight is in: let the next grid in
            T.evaluate(T.call_extern("void", LAUNCH_DEPENDENTS))
        if x_stages > 0:
            # the partial sums lie over the x ring: every copy has landed and every warp is past its last read
            T.evaluate(T.ptx["cp.async.wait_all"]())
            T.tvm_storage_sync("shared")
        # accumulator e holds weight row g + 8 * (e // 2) times x row 2t + e % 2
        for rt in T.unroll(row_tiles):
            for mg in T.unroll(m_groups):
                if x_stages == 0 or mc * m_tile + mg * 8 < m:  # GEMM mode: most groups may lie past m
                    for e in T.unroll(4):
                        red[
                            ty % warps,
                            mg * 8 + tx % 4 * 2 + e % 2,
                            ty // warps * warp_rows + rt * 16 + e // 2 * 8 + tx // 4,
                        ] = acc[rt, mg, e]
        T.tvm_storage_sync("shared")
        if x_stages == 0:
            for r in range(out_rounds):
                store_output(scale, y, m, bx, mc, red, total, r * threads + ty * WARP + tx)
        else:
            for r in range(T.ceildiv(T.min(m - mc * m_tile, m_tile) * block_rows, threads)):  # the pass's rows
                store_output(scale, y, m, bx, mc, red, total, r * threads + ty * WARP + tx)
        T.tvm_storage_sync("shared")

    @T.macro
    def body(x, w, scale, y, m):
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for ty in T.thread_binding(warps * n_warps, thread="threadIdx.y"):
                for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                    with T.sblock("gemv"):
                        T.reads()
                        T.writes()
                        red = T.sblock_alloc_buffer((warps, m_tile, block_rows), "float32", scope=smem)
                        xs = T.sblock_alloc_buffer(xs_shape, "bfloat16", scope=xs_scope)
                        wl = T.sblock_alloc_buffer((stages, unroll, row_tiles, 2, vec), wdtype, scope="local")
                        xl = T.sblock_alloc_buffer(xl_shape, "bfloat16", scope="local")
                        bf = T.sblock_alloc_buffer((bf_size,), "bfloat16", scope="local")
                        af = T.sblock_alloc_buffer((frag_a,), "bfloat16", scope="local")
                        acc = T.sblock_alloc_buffer((row_tiles, m_groups, 4), "float32", scope="local")
                        total = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        # weights are never written by a kernel: fetch the first batches into L2 before
                        # waiting for the grid that writes x (dependent_launch.py)
                        for u in T.unroll(prefetch_steps):
                            for rt in T.unroll(row_tiles):
                                for h in T.unroll(2):
                                    T.evaluate(T.call_extern("void", PREFETCH_L2, T.address_of(w[tile_index(
                                        spec.tiles,
                                        T.min(bx * block_rows + ty // warps * warp_rows + rt * 16 + h * 8 + tx // 4,
                                              n - 1),
                                        (ty % warps * steps_per_warp + u) * step_k + tx % 4 * vec,
                                        spec.k,
                                    )])))  # fmt: skip
                        T.evaluate(T.call_extern("void", WAIT))
                        for mc in range(T.ceildiv(m, m_tile)):
                            chunk(x, w, scale, y, m, bx, ty, tx, mc, red, xs, wl, xl, af, bf, acc, total)

    return body
