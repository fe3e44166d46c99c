"""Tensor-core GEMM for many rows of `x` (64-256 block rows, or thousands of context rows): both operands
tiled through shared memory, each fragment feeding several `mma.sync.m16n8k16`.

`linear_mma.py`'s GEMM mode streams the weight from global memory straight into registers and reads x back
from shared memory once per mma: 256 bytes of shared-memory reads (and as many of `cp.async` writes) per
m16n8k16, which caps it near 4 clocks per mma per SM. Here a block computes a `block_n × block_m` tile of
`yᵀ = W · xᵀ` (weight rows as the mma's M, rows of x as its N, as in `linear_mma.py`): a pipeline of
`stages` shared-memory slots, each `k_steps` k steps (one k step is `4 · vector` logical k: 32 bf16, 64
e4m3) of the block's weight rows and x rows, filled with 16-byte `cp.async` copies `stages - 1` slots ahead
of the one multiplied. The weight slots and the x slots are carved out of one dynamic allocation. A warp
owns `n_tiles` 16-row weight tiles × `m_tiles` 8-row x tiles: per k step it reads its A fragments once
(two 16-byte loads per weight tile) and each x tile's B fragment once, then runs `n_tiles · m_tiles ·
vector / 4` mmas, so shared-memory reads per mma fall with the warp tile (about 96
bytes at 4 × 8 tiles).

Logical k is mapped onto memory as in `linear_mma.py`: within a k step, thread t of a lane quad takes the
contiguous elements [t·V, (t+1)·V) of every row (V = 16 bytes of weight), for the weight and for x alike, so
every fragment is one 16-byte shared-memory load per row (two for x under FP8, whose V is 16 e4m3 but whose
x share is 16 bf16). Eight lanes (two rows, four quads' threads) read one phase. With a slot row of 64
bytes (one bf16 or weight k step) they read 128 contiguous bytes: no bank conflict. Rows of 128 bytes or
more would put both rows on the same banks, so odd rows swizzle their 16-byte chunks: chunk c sits at
c xor 4 where a lane's chunks are adjacent, c xor 1 where they are two apart (FP8's x). `k_steps` is a
power of two, so the flipped chunk stays in its row.

The pipeline: `stages - 1` slots are in flight while one is multiplied; each slot waits for its own
copies (`cp.async.wait_group`), then a block barrier makes everyone's copies visible and ends every read of
the slot the next copy overwrites. With `k_warps > 1` the block has that many warps per (n, m) warp tile,
each multiplying its share of every slot's k steps; at the end they add their accumulators through shared
memory and the first stores. A block of one warp tile otherwise runs one dependent chain of mmas through
every slot, and with one or two blocks per SM that chain, not the bytes in flight, sets its pace.
Weight rows past n read row n - 1 and rows of x past m are zero-filled (ignore-src); neither is stored.
x tiles that lie wholly past m skip their mmas (warp-uniform). The first slots' weight copies are issued
before the wait for the grid that writes x (programmatic dependent launch, dependent_launch.py) and their
x copies after it; once a block has issued its last weight copies it lets the next grid in, which so
arrives for the stream's tail rather than sitting resident beside the whole stream.

The grid is (m tiles, n tiles, k splits): the m tiles of one weight tile are neighbours in launch order, so
the weight crosses from DRAM once and the other m tiles read it from L2. With `k_splits > 1` the k steps
are cut into that many ranges, one per block, which write f32 partial sums to a workspace
`[k_splits, m, n]`; a second kernel adds them (and applies the FP8 per-row scale). Narrow weights (qkv,
o_proj, down) have too few weight tiles to fill the GPU at 128-256 rows without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, WAIT
from dflash_compiler.weight_tiles import tile_index

from .base import ScheduleError
from .linear_argmax import pick_macro, pick_merge_macro
from .mma import a_fragments_macro, mma_m16n8k16

if TYPE_CHECKING:
    from .linear import LinearSpec

WARP = 32
MERGE_THREADS = 256
MERGE_VECTOR = 4  # outputs a merge thread adds: one 16-byte load of f32 partial sums per split
ROW_BYTES = 64  # one k step of a weight row in shared memory: 4 threads × 16 bytes
# the plan's knob fields (LinearMmaRule takes them as gemm_<name>)
TILED_KNOBS = ("n_warps", "m_warps", "n_tiles", "m_tiles", "stages", "k_splits", "k_steps", "k_warps")


@dataclass(frozen=True)
class TiledPlan:
    """The resolved shape of one tiled GEMM kernel."""

    n_warps: int  # warps along n (weight rows)
    m_warps: int  # warps along m (rows of x)
    n_tiles: int  # 16-row weight tiles per warp
    m_tiles: int  # 8-row x tiles per warp
    stages: int  # shared-memory slots of the copy pipeline
    k_splits: int  # blocks along k (> 1: partial sums through a workspace and a second kernel)
    vector: int  # weight elements per 16-byte load (8 bf16, 16 e4m3)
    k_steps: int = 1  # k steps per slot (one barrier and one wait per slot)
    k_warps: int = 1  # warps along k: each multiplies k_steps / k_warps of every slot; summed at the end

    @property
    def block_n(self) -> int:
        return 16 * self.n_tiles * self.n_warps

    @property
    def block_m(self) -> int:
        return 8 * self.m_tiles * self.m_warps

    @property
    def threads(self) -> int:
        return WARP * self.n_warps * self.m_warps * self.k_warps

    @property
    def step_k(self) -> int:
        return 4 * self.vector

    @property
    def x_vectors(self) -> int:
        """16-byte vectors of x (8 bf16) per thread, x row and k step."""
        return self.vector // 8

    def stage_bytes(self) -> int:
        return self.k_steps * (self.block_n * ROW_BYTES + self.block_m * ROW_BYTES * self.x_vectors)

    def shared_bytes(self) -> int:
        return max(self.stages * self.stage_bytes(), self.reduce_bytes())

    def reduce_bytes(self) -> int:
        """The f32 accumulators of the warps along k past the first, summed through shared memory."""
        return (self.k_warps - 1) * self.n_warps * self.m_warps * WARP * self.n_tiles * self.m_tiles * 4 * 4

    def knobs(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in TILED_KNOBS}

    def registers(self) -> int:
        """32-bit registers per thread: the accumulators, one k step's A fragments (the raw weight vectors,
        and as many again of bf16 pairs for FP8), one B fragment and ~30 of addresses and loop state; ptxas
        (NVRTC 13, sm_90a) used 194 at 4 x 8 tiles for bf16."""
        return 4 * self.n_tiles * self.m_tiles + 8 * self.n_tiles * self.x_vectors + 4 * self.x_vectors + 30


def tiled_body_macro(spec: LinearSpec, plan: TiledPlan) -> Any:
    """The kernel(s) of `plan` as a TVMScript macro `body(x, w, scale, y, m, part)`; `part` is the
    `[k_splits, m, n]` f32 workspace (read only when k_splits > 1)."""
    from tvm.script import tirx as T

    n, k, fp8, wdtype = spec.n, spec.k, spec.fp8, spec.weight_dtype
    vec, xvs, step_k = plan.vector, plan.x_vectors, plan.step_k
    bn_rows, bm_rows, threads, stages = plan.block_n, plan.block_m, plan.threads, plan.stages
    n_tiles, m_tiles, n_warps, m_warps = plan.n_tiles, plan.m_tiles, plan.n_warps, plan.m_warps
    k_splits, k_steps, k_warps = plan.k_splits, plan.k_steps, plan.k_warps
    tile_warps = n_warps * m_warps  # the warps of one k share; warp ty's k share is ty // tile_warps
    n_acc = n_tiles * m_tiles * 4
    per_split = k // step_k // k_splits // k_steps  # slots' worth of k per split
    mps = vec // 4  # mmas per k step and tile pair
    w_chunks_row, x_chunks_row = 4 * k_steps, 4 * xvs * k_steps  # 16-byte chunks of a row per slot
    w_chunks, x_chunks = bn_rows * w_chunks_row, bm_rows * x_chunks_row
    w_rounds, x_rounds = -(-w_chunks // threads), -(-x_chunks // threads)
    n_blocks = -(-n // bn_rows)
    mma = mma_m16n8k16()
    a_fragments = a_fragments_macro(fp8, n_tiles, mps)
    store = store_macro(spec, plan)
    row_scales = row_scales_macro(spec, plan)
    merge = merge_macro(spec, k_splits)
    picks = spec.picks
    # lm_head_argmax's epilogue, built only for it (every macro parses its source)
    pick, pick_merge = (pick_macro(spec, plan), pick_merge_macro(spec, plan)) if picks else (None, None)

    def swizzle(chunk: Any, row: Any, per_lane: int, chunks: int) -> Any:
        # eight lanes read rows r, r + 1 (r even), four chunks each (`per_lane` apart); rows of 128 bytes or
        # more would put both rows' chunks on the same banks, so odd rows flip the chunk bit that moves them
        # to the other half of the bank window: 4 for adjacent chunks, 1 for chunks two apart (FP8's x)
        if chunks < 8:
            return chunk
        return T.bitwise_xor(chunk, (row % 2) * (4 if per_lane == 1 else 1))

    @T.macro
    def load_w_stage(w, ws, bn, ks, tid, slot, step):
        if step < per_split:
            for i in T.unroll(w_rounds):
                c = T.meta_var(i * threads + tid)
                row = T.meta_var(c // w_chunks_row)
                if w_chunks % threads == 0 or c < w_chunks:
                    T.evaluate(T.ptx["cp.async.cg.shared.global"](
                        T.address_of(ws[slot, row, swizzle(c % w_chunks_row, row, 1, w_chunks_row) * vec]),
                        T.address_of(w[tile_index(
                            spec.tiles,
                            T.min(bn * bn_rows + row, n - 1),
                            (ks * per_split + step) * k_steps * step_k + c % w_chunks_row * vec,
                            spec.k,
                        )]),
                        16,
                    ))  # fmt: skip

    @T.macro
    def load_x_stage(x, m, xs, bm, ks, tid, slot, step):
        # closes the step's copy group: wait_group counts one group per step, empty or not
        if step < per_split:
            for i in T.unroll(x_rounds):
                c = T.meta_var(i * threads + tid)
                row = T.meta_var(c // x_chunks_row)
                if x_chunks % threads == 0 or c < x_chunks:
                    T.evaluate(T.ptx["cp.async.cg.shared.global"](
                        T.address_of(xs[slot, row, swizzle(c % x_chunks_row, row, xvs, x_chunks_row) * 8]),
                        T.address_of(x[T.min(bm * bm_rows + row, m - 1),
                                       (ks * per_split + step) * k_steps * step_k + c % x_chunks_row * 8]),
                        16,
                        bm * bm_rows + row >= m,
                    ))  # fmt: skip
        T.evaluate(T.ptx["cp.async.commit_group"]())

    @T.macro
    def compute_step(m, ws, xs, wl, af, xl, bf, acc, bm, wn, wm, g, t, slot, sub):
        for nt in T.unroll(n_tiles):
            for h in T.unroll(2):
                row = T.meta_var((wn * n_tiles + nt) * 16 + h * 8 + g)
                for v in T.vectorized(vec):
                    wl[0, 0, nt, h, v] = ws[slot, row, swizzle(sub * 4 + t, row, 1, w_chunks_row) * vec + v]
        a_fragments(wl, af, 0, 0, 0, mps)
        for mt in T.unroll(m_tiles):
            if bm * bm_rows + (wm * m_tiles + mt) * 8 < m:  # warp-uniform: x tiles past m do nothing
                for xv in T.unroll(xvs):
                    row = T.meta_var((wm * m_tiles + mt) * 8 + g)
                    for v in T.vectorized(8):
                        xl[v] = xs[slot, row, swizzle((sub * 4 + t) * xvs + xv, row, xvs, x_chunks_row) * 8 + v]
                    # B fragments through a scalar copy: TVM retypes a local buffer only ever accessed as
                    # whole vectors, which would break the mma's element offsets (as in linear_mma.py)
                    for v in T.unroll(8):
                        bf[xv * 8 + v] = xl[v]
                for nt in T.unroll(n_tiles):
                    for j in T.unroll(mps):
                        mma(af, (nt * mps + j) * 8, bf, 4 * j, acc, (nt * m_tiles + mt) * 4)

    @T.macro
    def body(x, w, scale, y, m, part):
        for bm in T.thread_binding(T.ceildiv(m, bm_rows), thread="blockIdx.x"):
            for bn in T.thread_binding(n_blocks, thread="blockIdx.y"):
                for ks in T.thread_binding(k_splits, thread="blockIdx.z"):
                    for ty in T.thread_binding(tile_warps * k_warps, thread="threadIdx.y"):
                        for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                            with T.sblock("tiled"):
                                T.reads()
                                T.writes()
                                # one allocation carved in two: the weight slots, then the x slots (TVM's
                                # merge of two dynamic buffers may overlap them where it sees no loop)
                                smem = T.sblock_alloc_buffer((plan.shared_bytes() // 2,), "bfloat16",
                                                             scope="shared.dyn")  # fmt: skip
                                ws = T.decl_buffer((stages, bn_rows, w_chunks_row * vec), wdtype, data=smem.data,
                                                   scope="shared.dyn")  # fmt: skip
                                xs = T.decl_buffer((stages, bm_rows, x_chunks_row * 8), "bfloat16", data=smem.data,
                                                   elem_offset=stages * bn_rows * w_chunks_row * 8,
                                                   scope="shared.dyn")  # fmt: skip
                                wl = T.sblock_alloc_buffer((1, 1, n_tiles, 2, vec), wdtype, scope="local")
                                af = T.sblock_alloc_buffer((n_tiles * mps * 8,), "bfloat16", scope="local")
                                xl = T.sblock_alloc_buffer((8,), "bfloat16", scope="local")
                                bf = T.sblock_alloc_buffer((8 * xvs,), "bfloat16", scope="local")
                                acc = T.sblock_alloc_buffer((n_acc,), "float32", scope="local")
                                sc = T.sblock_alloc_buffer((row_scale_count(plan),), "float32", scope="local")
                                red = T.decl_buffer((max(1, k_warps - 1), n_acc, tile_warps * WARP), "float32",
                                                    data=smem.data, scope="shared.dyn")  # fmt: skip
                                tid = T.meta_var(ty * WARP + tx)
                                wn = T.meta_var(ty % tile_warps // m_warps)
                                wm = T.meta_var(ty % m_warps)
                                kw = T.meta_var(ty // tile_warps)
                                for i in T.unroll(n_acc):
                                    acc[i] = T.float32(0)
                                # weights are never written by a kernel: the first slots' weight copies are in
                                # flight before the wait for the grid that writes x (dependent_launch.py); the
                                # first copy group then holds them all, which only makes its wait stricter
                                for s in T.unroll(stages - 1):
                                    load_w_stage(w, ws, bn, ks, tid, s, s)
                                row_scales(scale, sc, bn, wn, tx // 4)
                                T.evaluate(T.call_extern("void", WAIT))
                                for s in T.unroll(stages - 1):
                                    load_x_stage(x, m, xs, bm, ks, tid, s, s)
                                for kt in range(per_split):
                                    T.evaluate(T.ptx["cp.async.wait_group"](stages - 2))
                                    T.tvm_storage_sync("shared")
                                    load_w_stage(w, ws, bn, ks, tid, (kt + stages - 1) % stages, kt + stages - 1)
                                    load_x_stage(x, m, xs, bm, ks, tid, (kt + stages - 1) % stages, kt + stages - 1)
                                    if kt == max(per_split - stages, 0):  # the last weight copies are out
                                        T.evaluate(T.call_extern("void", LAUNCH_DEPENDENTS))
                                    for sub in T.unroll(k_steps // k_warps):
                                        compute_step(m, ws, xs, wl, af, xl, bf, acc, bm, wn, wm, tx // 4, tx % 4,
                                                     kt % stages, kw * (k_steps // k_warps) + sub)  # fmt: skip
                                if k_warps > 1:
                                    # the slots are free once every copy landed and every warp left its last one
                                    T.evaluate(T.ptx["cp.async.wait_group"](0))
                                    T.tvm_storage_sync("shared")
                                    if kw > 0:
                                        for i in T.unroll(n_acc):
                                            red[kw - 1, i, ty % tile_warps * WARP + tx] = acc[i]
                                    T.tvm_storage_sync("shared")
                                    if kw == 0:
                                        for j in T.unroll(k_warps - 1):
                                            for i in T.unroll(n_acc):
                                                acc[i] = acc[i] + red[j, i, ty * WARP + tx]
                                if picks:
                                    pick(sc, part, m, acc, smem, bm, bn, wn, wm, tx // 4, tx % 4, tid, kw == 0)
                                elif kw == 0:
                                    store(sc, y, part, m, acc, bm, bn, ks, wn, wm, tx // 4, tx % 4)
        if k_splits > 1:
            merge(scale, y, part, m)
        if picks:
            pick_merge(part, y, m)

    return body


def row_scale_count(plan: Any) -> int:
    """The FP8 row scales a thread's accumulators need (`row_scales_macro`): two weight rows per 16-row tile."""
    return 2 * plan.n_tiles


def row_scales_macro(spec: LinearSpec, plan: Any) -> Any:
    """A TVMScript macro `row_scales(scale, sc, bn, wn, g)`: for e4m3 weights, the row scales of the weight
    rows a thread's accumulators hold into `sc` (local, `row_scale_count`): sc[2 nt + v] = scale[j] for row j
    = bn · block_n + (wn · n_tiles + nt) · 16 + 8 v + g (rows past n read row n - 1); bf16 weights: nothing.

    Scales are weights (no kernel writes them), so a kernel loads them with its first weight copies, before its
    wait for inputs, and its epilogue (`store_macro`, `linear_argmax.pick_macro`) finds them in registers. Read
    in the epilogue, after the k loop, they were one more round trip at the end of every block: in the machine
    code of the 16-row kernels the scales' loads sat between the last mma and the stores. H100, FP8 Qwen3-8B
    drafter step at nb = 1 (bench/propose.py --timeline, both builds in one run, with the argmax merge's loads
    issued first too), µs the calls add: o_proj 40.2 → 38.2, qkv 52.2 → 51.2, gate_up 187.7 → 184.7, fc 36.1
    → 34.6, ctx_kv 19.9 → 19.6, down 95.0 → 98.6; the timeline's span 748.7 → 740.5 µs, the step's median
    0.748 → 0.749 ms (within its noise)."""
    from tvm.script import tirx as T

    n, n_tiles, bn_rows = spec.n, plan.n_tiles, plan.block_n

    @T.macro
    def row_scales(scale, sc, bn, wn, g):
        if spec.fp8:
            for nt in T.unroll(n_tiles):
                for v in T.unroll(2):
                    sc[nt * 2 + v] = scale[T.min(bn * bn_rows + (wn * n_tiles + nt) * 16 + v * 8 + g, n - 1)]

    return row_scales


def store_macro(spec: LinearSpec, plan: Any) -> Any:
    """A TVMScript macro `store(sc, y, part, m, acc, bm, bn, ks, wn, wm, g, t)`: a warp's accumulators
    into y (FP8: times the row's scale, from the thread's `row_scales_macro` registers `sc`) or, with k splits,
    into the f32 workspace part[:, ks].

    `plan` has `n_tiles` 16-row weight tiles by `m_tiles` 8-row x tiles per warp, `block_n` × `block_m` per
    block and `k_splits`; accumulator (nt · m_tiles + mt) · 4 + e is mma.sync's m16n8 element e of the warp's
    tile pair (nt, mt): weight row g + 8 · (e // 2) of the 16-row tile, x row 2t + e % 2 of the 8-row tile.
    matmul_silu (`spec.silu`, one k split): a 16-row tile holds 8 features' gate rows, then their up rows
    (ir_passes/fuse_gate_up_silu.py), so elements e and e + 2 are one feature's gate and up and the thread
    stores silu(gate) · up at column tile · 8 + g.
    """
    from tvm.script import tirx as T

    n, fp8, out_dtype, silu = spec.n, spec.fp8, spec.out_dtype, spec.silu
    n_tiles, m_tiles, bn_rows, bm_rows, k_splits = plan.n_tiles, plan.m_tiles, plan.block_n, plan.block_m, plan.k_splits
    if silu and k_splits > 1:  # silu of partial sums is not silu of the sum
        raise ScheduleError(
            f"{spec.name}: the silu epilogue needs whole sums; found a plan with {k_splits} k splits. Fix: one k "
            "split (LinearSiluRule refuses the knobs that split k)"
        )

    def value(acc: Any, sc: Any, index: Any, nt: int, v: int) -> Any:
        return acc[index] * sc[nt * 2 + v] if fp8 else acc[index]

    @T.macro
    def store(sc, y, part, m, acc, bm, bn, ks, wn, wm, g, t):
        for nt in T.unroll(n_tiles):
            for mt in T.unroll(m_tiles):
                if silu:
                    for h in T.unroll(2):
                        i = T.meta_var(bm * bm_rows + (wm * m_tiles + mt) * 8 + t * 2 + h)
                        tile = T.meta_var((bn * bn_rows + (wn * n_tiles + nt) * 16) // 16)
                        if i < m and tile * 16 < n:
                            gate: T.let[T.float32] = value(acc, sc, (nt * m_tiles + mt) * 4 + h, nt, 0)
                            up: T.let[T.float32] = value(acc, sc, (nt * m_tiles + mt) * 4 + 2 + h, nt, 1)
                            y[i, tile * 8 + g] = T.Cast(out_dtype, gate / (T.float32(1) + T.exp(-gate)) * up)
                else:
                    for e in T.unroll(4):
                        i = T.meta_var(bm * bm_rows + (wm * m_tiles + mt) * 8 + t * 2 + e % 2)
                        j = T.meta_var(bn * bn_rows + (wn * n_tiles + nt) * 16 + e // 2 * 8 + g)
                        if i < m and j < n:
                            if k_splits > 1:
                                part[i, ks, j] = acc[(nt * m_tiles + mt) * 4 + e]
                            else:
                                y[i, j] = T.Cast(out_dtype, value(acc, sc, (nt * m_tiles + mt) * 4 + e, nt, e // 2))

    return store


def split_sum(part: Any, scale: Any, row: Any, col: Any, k_splits: int, fp8: bool) -> Any:
    """Output (row, col) of a k-split GEMM: its splits' partial sums part[row, 0 .. k_splits, col] added in split
    order (FP8: times the row's scale), as the merge kernel and the warpgroup GEMM's last block add them."""
    value = part[row, 0, col]
    for s in range(1, k_splits):
        value = value + part[row, s, col]
    return value * scale[col] if fp8 else value


def merge_macro(spec: LinearSpec, k_splits: int) -> Any:
    """A TVMScript macro `merge(scale, y, part, m)`: its own kernel, y = the sum of the k splits' partial
    sums part[:, 0 .. k_splits) (FP8: times the row's scale), added in split order. A thread adds
    MERGE_VECTOR neighbouring outputs (one 16-byte load per split, one store) where n is a multiple of it,
    else one. One output per thread over a `[splits, m, n]` workspace (whose symbolic split stride TVM cannot
    prove 16-byte aligned: its vector loads become four scalar ones) → this, on an H100 (bench/propose.py,
    both builds in one run, µs the five layers' qkv, o and down merges and append's two add at nb = 8,
    timeline): bf16 48.1 → 37.5, FP8 49.3 → 35.6; the step at nb = 4 / 8 / 16, bf16 1.547 / 1.823 / 2.544 →
    1.552 / 1.807 / 2.536 ms, FP8 1.187 / 1.514 / 2.603 → 1.182 / 1.485 / 2.567 ms."""
    from tvm.script import tirx as T

    n, fp8, out_dtype = spec.n, spec.fp8, spec.out_dtype
    vector = MERGE_VECTOR if n % MERGE_VECTOR == 0 else 1
    count = n // vector  # vectors per row

    @T.macro
    def merge(scale, y, part, m):
        for b in T.thread_binding(T.ceildiv(m * count, MERGE_THREADS), thread="blockIdx.x"):
            for tx in T.thread_binding(MERGE_THREADS, thread="threadIdx.x"):
                with T.sblock("tiled_merge"):
                    T.reads()
                    T.writes()
                    out = T.sblock_alloc_buffer((vector,), out_dtype, scope="local")
                    row = T.meta_var((b * MERGE_THREADS + tx) // count)
                    col = T.meta_var((b * MERGE_THREADS + tx) % count * vector)
                    if b * MERGE_THREADS + tx < m * count:
                        for v in T.vectorized(vector):
                            out[v] = T.Cast(out_dtype, split_sum(part, scale, row, col + v, k_splits, fp8))
                        for v in T.vectorized(vector):
                            y[row, col + v] = out[v]

    return merge
