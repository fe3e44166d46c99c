"""Block attention over a paged KV cache (`block_attention` nodes), flash-decoding style.

Each sequence's block of `block` query rows attends over its `cache_lens[s]` cached rows (positions
`0..len-1`, found through its page table) plus the block's own K/V rows (at `blk_positions`), with the
mask of `interpret.attention_mask` (non-causal full, causal, sliding window; a non-causal window is
symmetric), GQA (q head j reads kv head j // (heads/kv_heads)), scale 1/sqrt(head_dim), f32 softmax and
accumulation, bf16 output. The cache parameter is one layer's `[2, pages, page_size, kv_heads, head_dim]`
view of the graph's cache (`AttentionRule.views` gives {"kv": (layer,)}), so one kernel serves every layer.

Kernel 1 (`<name>_kernel`), one thread block per (split, kv head, sequence): the `block * group` query
rows of one kv head share every K/V read. A sequence's keys, from the first one a sliding window lets any
query see to the end of the block, are cut into `splits` equal spans (multiples of `chunk` keys); a
short sequence fills fewer spans and the blocks of the others exit at once. A span is walked chunk by chunk:
* the chunk's K/V rows, fetched into registers while the previous chunk was computed, go to shared
  memory as f32 (bf16 where f32 tiles would not fit the target);
* a register-tiled QK^T (Q staged once, pre-scaled by log2(e)/sqrt(d)) fills a masked score tile;
* online softmax in base 2: the running (max, sum) of each query row lives in the registers of the
  thread(s) owning the row, which write the chunk's weights and the rescale factor;
* a register-tiled P·V rescales and updates each thread's f32 output accumulators.
Each split leaves its unnormalised output and (max, sum) in host workspaces. Kernel 2 (`<name>_kernel_1`),
a few heads of one query row per thread block, merges the used splits with their log-sum-exp weights and
writes bf16; it, the spans and the PrimFunc around both kernels are `attention_merge.py`'s, shared by the
tensor-core rules.

The kernel is written once in TVMScript as a sequence of per-thread phases, each a loop over the block's
threads. `device=False` keeps those loops serial (the CPU oracle, built for llvm in tests); `device=True`
binds them to threadIdx.x, and TVM lifts them into one thread scope, compacts the per-thread buffers into
registers and inserts the barriers between phases. TVM plans barriers for dynamic shared memory as if
all its buffers were one, and cannot place a barrier inside a branch or a loop cheaply, so every phase
reads shared memory before it writes it, and phases that write it do so outside data-dependent branches
(rows with fewer owners than threads get identical duplicate owners instead of an `if`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dflash_compiler.dependent_launch import WAIT
from dflash_compiler.ir.graph import Node, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.targets import Target

from .attention_merge import DTYPE, NEG, attention_prim_func, span_count, split_span_macro
from .base import FamilyRule, KernelSpec, OpInstance, Param, ScheduleError, Tolerance

ROWS, PAGES, SEQS, MAX_PAGES = "m", "pages", "nb", "maxp"
_KEYS_PER_THREAD = 2  # score tile width: each thread scores 2 keys (interleaved, conflict-free K reads)
_VECTORS_PER_THREAD = 2  # P·V tile: each thread owns 2 float4 column groups of its rows


@dataclass(frozen=True)
class BlockAttentionSpec(KernelSpec):
    """What one block-attention kernel computes (static sizes and mask); rows `m` = `nb * block`."""

    block: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    window: int | None = None
    page_size: int = 16

    def __post_init__(self) -> None:
        for key in ("block", "heads", "kv_heads", "head_dim", "page_size"):
            if getattr(self, key) <= 0:
                raise ScheduleError(f"block_attention: {key} must be positive, found {getattr(self, key)}")
        if self.heads % self.kv_heads:
            raise ScheduleError(
                f"block_attention: heads {self.heads} must be a multiple of kv_heads {self.kv_heads} (GQA)"
            )
        if self.head_dim % 4:
            raise ScheduleError(f"block_attention: head_dim {self.head_dim} must be a multiple of 4 (float4 tiles)")
        if self.window is not None and self.window <= 0:
            raise ScheduleError(f"block_attention: window must be positive or None, found {self.window}")

    @property
    def name(self) -> str:
        mask = ("_causal" if self.causal else "") + ("" if self.window is None else f"_w{self.window}")
        page = "" if self.page_size == 16 else f"_p{self.page_size}"
        return f"block_attention_b{self.block}_h{self.heads}_kv{self.kv_heads}_d{self.head_dim}{mask}{page}"

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def params(self) -> tuple[Param, ...]:
        h, hkv, d = self.heads, self.kv_heads, self.head_dim
        return (
            Param("q", DTYPE, (ROWS, h * d)),
            Param("k", DTYPE, (ROWS, hkv * d)),
            Param("v", DTYPE, (ROWS, hkv * d)),
            Param("kv", DTYPE, (2, PAGES, self.page_size, hkv, d)),
            Param("block_table", "int32", (SEQS, MAX_PAGES)),
            Param("cache_lens", "int32", (SEQS,)),
            Param("blk_positions", "int32", (ROWS,)),
            Param("out", DTYPE, (ROWS, h * d), "out"),
        )

    def prim_func(self) -> Any:
        # Small chunks and several splits, so CPU tests at small sizes walk every path (many chunks per
        # split, empty splits, the merge); tests also build the CPU twin of the GPU layouts.
        return attention_func(self, cpu_layout(self), device=False)

    def node(self) -> Node:
        """The graph node this kernel implements, on a one-layer cache (the view), as the interpreter sees it."""
        return Node.make(
            Op.BLOCK_ATTENTION,
            [TensorType(DTYPE, (ROWS, self.heads * self.head_dim))],
            block=self.block,
            causal=self.causal,
            head_dim=self.head_dim,
            heads=self.heads,
            kv_heads=self.kv_heads,
            layer=0,
            page_size=self.page_size,
            window=self.window,
        )

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        args = [arrays["q"], arrays["k"], arrays["v"], arrays["kv"][None]]  # the view as layer 0
        args += [arrays["block_table"], arrays["cache_lens"], arrays["blk_positions"]]
        (out,) = evaluate_node(self.node(), args)
        return {"out": out}

    def tolerance(self, param: str) -> Tolerance:
        # atol: the worst case of the P rounding below; rtol: both outputs' rounding to bf16
        return Tolerance(rtol=8e-3, atol=2.0**-8)

    def error_scale(self, param: str, inputs: Mapping[str, Any] | None) -> np.ndarray:
        """Σ p·|v| / Σ p per output element: the same attention over |v|. The tensor-core kernel multiplies P
        by V with P rounded to bf16 (the mma's operand), each term p·v off by up to 2^-8 of itself, so the
        output's error follows the size of its terms, not its own: where large values cancel (a peaked
        softmax over random values), the output is small and the terms are not. On the H200 one element of a
        16-sequence check came out -0.04492 against -0.04315 exact; rounding P to bf16 in numpy gives -0.04504."""
        if inputs is None:
            raise ScheduleError(f"{self.name}: its tolerance scales with the inputs; pass the arrays it ran on")

        def magnitude(a: np.ndarray) -> np.ndarray:
            return np.abs(a.astype(np.float32)).astype(a.dtype)

        kv = np.array(inputs["kv"], copy=True)
        kv[1] = magnitude(kv[1])
        return self.reference({**inputs, "v": magnitude(np.asarray(inputs["v"])), "kv": kv})["out"].astype(np.float64)

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        """Sequences with lengths from 0 to the table's capacity (the first one full), distinct pages where
        the pool allows, block positions right after each sequence's cached rows."""
        import ml_dtypes

        rows, pages, nb, maxp = sizes[ROWS], sizes[PAGES], sizes[SEQS], sizes[MAX_PAGES]
        if rows != nb * self.block:
            raise ScheduleError(f"block_attention sample: m must be nb * block = {nb * self.block}, found {rows}")
        if pages < maxp:
            raise ScheduleError(f"block_attention sample: a full sequence needs {maxp} pages, the pool has {pages}")
        bf16 = ml_dtypes.bfloat16
        h, hkv, d = self.heads, self.kv_heads, self.head_dim
        capacity = maxp * self.page_size
        lens = rng.integers(0, capacity + 1, size=nb).astype(np.int32)
        if nb:
            lens[0] = capacity
        if pages >= nb * maxp:
            table = rng.permutation(pages)[: nb * maxp].reshape(nb, maxp)
        else:
            table = rng.integers(0, pages, size=(nb, maxp))
        positions = (lens[:, None] + np.arange(self.block)[None, :]).reshape(-1)
        f32 = np.float32
        return {
            "q": (rng.standard_normal((rows, h * d), f32) * 2).astype(bf16),  # peakier softmax than N(0, 1)
            "k": rng.standard_normal((rows, hkv * d), f32).astype(bf16),
            "v": rng.standard_normal((rows, hkv * d), f32).astype(bf16),
            "kv": rng.standard_normal((2, pages, self.page_size, hkv, d), f32).astype(bf16),
            "block_table": table.astype(np.int32),
            "cache_lens": lens,
            "blk_positions": positions.astype(np.int32),
            "out": np.zeros((rows, h * d), bf16),
        }


# ------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class AttentionLayout:
    """The kernel's shape: threads per block (both kernels), keys per chunk, splits per (sequence, kv head),
    and whether Q and K/V are staged in shared memory as f32 (else bf16, when f32 does not fit)."""

    threads: int
    chunk: int
    splits: int
    q_f32: bool = True
    kv_f32: bool = True
    slots: int = 0  # as in split_span_macro: > 0, the grid a batch's splits aim at


@dataclass(frozen=True)
class _Tiles:
    """Per-thread tiles derived from a spec and a layout (see `attention_func`)."""

    rows: int  # query rows per thread block: block * group
    score_cols: int  # threads across a chunk's keys in the score tile
    score_rows: int  # query rows per thread in the score tile
    q_rows: int  # Q rows staged (rows rounded up to the score tiling)
    pv_cols: int  # threads across head_dim in the P·V tile (a power of two)
    pv_groups: int  # float4 column groups per thread row: pv_cols of them, or fewer (the rest repeat the last)
    pv_vectors: int  # float4s per thread in the P·V tile
    pv_rows: int  # query rows per thread in the P·V tile
    padded_rows: int  # rows of the score / statistics buffers
    load_vector: int  # bf16 elements per global load

    def shared_bytes(self, spec: BlockAttentionSpec, layout: AttentionLayout) -> int:
        d, c = spec.head_dim, layout.chunk
        q_bytes, kv_bytes = (4 if layout.q_f32 else 2), (4 if layout.kv_f32 else 2)
        q = self.q_rows * (d + _pad(layout.q_f32)) * q_bytes
        kv = c * (d + _pad(layout.kv_f32)) * kv_bytes + c * d * kv_bytes
        scores = 2 * self.padded_rows * (c + 1) * 4 + 3 * self.padded_rows * 4  # scores, weights, statistics
        return q + kv + scores + self.q_rows * 4 + 2 * c * 4


def _pad(f32: bool) -> int:
    """Row padding of the Q/K tiles (elements): 16 bytes, so float4 reads of consecutive rows hit distinct banks."""
    return 4 if f32 else 8


def tiles(spec: BlockAttentionSpec, layout: AttentionLayout) -> _Tiles:
    rows, d, nt, c = spec.block * spec.group, spec.head_dim, layout.threads, layout.chunk
    score_cols = c // _KEYS_PER_THREAD
    score_rows = -(-rows // (nt // score_cols))
    pv_vectors, pv_groups, pv_cols = _pv_columns(d)
    pv_rows = -(-rows // (nt // pv_cols))
    q_rows = nt // score_cols * score_rows
    vector = 8
    while d % vector:
        vector //= 2
    return _Tiles(
        rows=rows,
        score_cols=score_cols,
        score_rows=score_rows,
        q_rows=q_rows,
        pv_cols=pv_cols,
        pv_groups=pv_groups,
        pv_vectors=pv_vectors,
        pv_rows=pv_rows,
        padded_rows=max(q_rows, nt // pv_cols * pv_rows),
        load_vector=vector,
    )


def _pv_columns(dim: int) -> tuple[int, int, int]:
    """(float4s per thread, float4 column groups, threads across them): a power of two of threads, so thread
    counts divide; a head_dim of e.g. 80 has 10 groups on 16 threads, the last 6 repeat group 9 unwritten."""
    vectors = _VECTORS_PER_THREAD if dim % (4 * _VECTORS_PER_THREAD) == 0 else 1
    groups = dim // (4 * vectors)
    return vectors, groups, 1 << (groups - 1).bit_length()


def cpu_layout(spec: BlockAttentionSpec) -> AttentionLayout:
    # slots for 3 splits of up to 2 sequences: a batch of 3 takes 2 splits each (the shrunken spans)
    return replace(fit_layout(spec, None, threads=64, chunk=16, splits=3), slots=6 * spec.kv_heads)


def fit_layout(
    spec: BlockAttentionSpec, target: Target | None, threads: int, chunk: int, splits: int
) -> AttentionLayout:
    """A layout for `spec` from knob values; ScheduleError when they cannot work on `target`.

    `threads` shrinks (by halves) while the tiles would leave whole thread rows idle, which happens for
    tiny heads; Q, then K/V, fall back to bf16 staging when the f32 tiles exceed the shared memory.
    """
    warp = target.warp_size if target else 32
    limit = target.max_threads_per_block if target else 1024
    where = f" on {target.name}" if target else ""
    if threads <= 0 or threads % warp or threads > limit:
        raise ScheduleError(
            f"block_attention knob threads={threads}: expected a multiple of {warp} up to {limit}{where}"
        )
    if chunk < 2 * _KEYS_PER_THREAD or chunk & (chunk - 1) or chunk > 256:
        raise ScheduleError(f"block_attention knob chunk={chunk}: expected a power of two from 4 to 256")
    if not 1 <= splits <= 256:
        raise ScheduleError(f"block_attention knob splits={splits}: expected 1 to 256")
    d = spec.head_dim
    pv_cols = _pv_columns(d)[2]
    score_cols = chunk // _KEYS_PER_THREAD
    rows = spec.block * spec.group
    for need in (score_cols, pv_cols):
        if threads % need:
            raise ScheduleError(
                f"block_attention: threads={threads} must be a multiple of {need} (the {score_cols} threads "
                f"across a chunk of {chunk} keys, {_KEYS_PER_THREAD} each, and the {pv_cols} across head_dim {d}). "
                "Fix: use a power-of-two thread count of at least both"
            )
    while threads > warp and threads // 2 % score_cols == 0 and threads // 2 % pv_cols == 0:
        if threads // pv_cols <= rows and threads // score_cols <= rows:
            break  # every thread row has a query row to work on
        threads //= 2
    budget = target.max_shared_memory_per_block if target else None
    for q_f32, kv_f32 in ((True, True), (False, True), (False, False)):
        layout = AttentionLayout(threads, chunk, splits, q_f32=q_f32, kv_f32=kv_f32)
        if budget is None or tiles(spec, layout).shared_bytes(spec, layout) <= budget:
            return layout
    need = tiles(spec, layout).shared_bytes(spec, layout)
    raise ScheduleError(
        f"{spec.name}: chunk {chunk} with threads {threads} needs {need} bytes of shared memory even with bf16 "
        f"staging; {target.name if target else 'the target'} allows {budget}. Fix: lower the chunk knob"
    )


# ------------------------------------------------------------------------ pieces both kernels share


# ------------------------------------------------------------------------------------------- kernel


def _visible(spec: BlockAttentionSpec, q_pos: Any, k_pos: Any) -> Any:
    """`attention_mask` for one (query, key) pair of absolute positions, as a TIR condition."""
    from tvm import tirx

    terms = []
    if spec.causal:
        terms.append(q_pos - k_pos >= 0)
    if spec.window is not None:
        terms.append(q_pos - k_pos < spec.window)
        if not spec.causal:
            terms.append(k_pos - q_pos < spec.window)
    return tirx.all(*terms) if terms else tirx.const(True, "bool")


def attention_func(spec: BlockAttentionSpec, layout: AttentionLayout, device: bool) -> Any:
    """The two-stage kernel as TVMScript (see the module docstring); `device` picks CPU oracle or CUDA."""
    from tvm import tirx
    from tvm.script import tirx as T

    tl = tiles(spec, layout)
    blk, hkv, dim, page, group = spec.block, spec.kv_heads, spec.head_dim, spec.page_size, spec.group
    nt, chunk, splits = layout.threads, layout.chunk, layout.splits
    rows, sr, sc, qr, pr, pc, rp = (
        tl.rows,
        tl.score_rows,
        tl.score_cols,
        tl.q_rows,
        tl.pv_rows,
        tl.pv_cols,
        tl.padded_rows,
    )
    lv = tl.load_vector
    rpt = -(-rp // nt)  # softmax rows per thread
    kv_iters = -(-(chunk * (dim // lv)) // nt)  # K (and V) vectors each thread fetches per chunk
    nvec, groups = tl.pv_vectors, tl.pv_groups
    span_d = dim // nvec  # P·V: a thread's column groups are span_d apart (consecutive threads, consecutive float4s)
    tk = _KEYS_PER_THREAD
    q_dtype = "float32" if layout.q_f32 else DTYPE
    kv_dtype = "float32" if layout.kv_f32 else DTYPE
    q_pitch, k_pitch, s_pitch = dim + _pad(layout.q_f32), dim + _pad(layout.kv_f32), chunk + 1
    q_scale = math.log2(math.e) / math.sqrt(dim)  # softmax in base 2: exp(x / sqrt(d)) = exp2(x * q_scale)
    masked = spec.causal or spec.window is not None  # positions matter (else only a key's existence does)
    shared = "shared.dyn" if device else "global"
    local = "local" if device else "global"
    q_loads, kv_loads = qr * (dim // lv), chunk * (dim // lv)
    split_span = split_span_macro(spec, splits, chunk, layout.slots)

    def grid(n: Any, tag: str) -> Any:
        return T.thread_binding(n, thread=tag) if device else T.serial(n)

    def lanes(n: int = nt) -> Any:
        return T.thread_binding(n, thread="threadIdx.x") if device else T.serial(n)

    def visible(q_pos: Any, k_pos: Any) -> Any:
        return _visible(spec, q_pos, k_pos)

    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    @T.macro
    def fetch_kv(
        t: Any, ch: Any, k_ld: Any, v_ld: Any, kv: Any, k: Any, v: Any, table: Any, s: Any, g: Any, span: Any, n: Any
    ) -> None:
        """Thread t's share of chunk ch's K/V rows into registers: cached rows through the page table, then
        the block's own rows; nothing past the split's end (span[0] is its start, span[2] its end)."""
        for it in T.serial(kv_iters):
            idx = T.meta_var(it * nt + t)
            c = T.meta_var(idx // (dim // lv))
            d0 = T.meta_var(idx % (dim // lv) * lv)
            key = T.meta_var(span[0] + ch * chunk + c)
            if idx < kv_loads and key < span[2]:
                if key < n:
                    slot: T.let[T.int32] = table[s, key // page]
                    for x in T.vectorized(lv):
                        k_ld[t, it, x] = kv[0, slot, key % page, g, d0 + x]
                    for x in T.vectorized(lv):
                        v_ld[t, it, x] = kv[1, slot, key % page, g, d0 + x]
                else:
                    for x in T.vectorized(lv):
                        k_ld[t, it, x] = k[s * blk + key - n, g * dim + d0 + x]
                    for x in T.vectorized(lv):
                        v_ld[t, it, x] = v[s * blk + key - n, g * dim + d0 + x]

    @T.macro
    def split(
        q: Any,
        k: Any,
        v: Any,
        kv: Any,
        block_table: Any,
        cache_lens: Any,
        blk_positions: Any,
        part_o: Any,
        part_ml: Any,
        nb: Any,
    ) -> None:
        for s in grid(nb, "blockIdx.z"):
            for g in grid(hkv, "blockIdx.y"):
                for p in grid(span_count(spec, splits, layout.slots, nb), "blockIdx.x"):
                    with T.sblock("split"):
                        T.reads()
                        T.writes()
                        # Padded tiles are flat: TVM compacts a 2-D buffer to the columns used, dropping the pad.
                        qs = T.sblock_alloc_buffer((qr * q_pitch,), q_dtype, scope=shared)
                        ks = T.sblock_alloc_buffer((chunk * k_pitch,), kv_dtype, scope=shared)
                        vs = T.sblock_alloc_buffer((chunk, dim), kv_dtype, scope=shared)
                        ps = T.sblock_alloc_buffer((rp * s_pitch,), "float32", scope=shared)
                        pw = T.sblock_alloc_buffer((rp * s_pitch,), "float32", scope=shared)
                        alpha = T.sblock_alloc_buffer((rp,), "float32", scope=shared)
                        q_pos = T.sblock_alloc_buffer((qr,), "int32", scope=shared)
                        k_pos = T.sblock_alloc_buffer((chunk,), "int32", scope=shared)
                        k_ok = T.sblock_alloc_buffer((chunk,), "int32", scope=shared)
                        span = T.sblock_alloc_buffer((4,), "int32", scope=local)
                        # per-thread state: the leading index is the thread (registers on the GPU)
                        acc = T.sblock_alloc_buffer((nt, pr, 4 * nvec), "float32", scope=local)
                        sacc = T.sblock_alloc_buffer((nt, sr, tk), "float32", scope=local)
                        q_reg = T.sblock_alloc_buffer((nt, sr, 4), "float32", scope=local)
                        k_reg = T.sblock_alloc_buffer((nt, tk, 4), "float32", scope=local)
                        p_reg = T.sblock_alloc_buffer((nt, pr), "float32", scope=local)
                        v_reg = T.sblock_alloc_buffer((nt, nvec, 4), "float32", scope=local)
                        q_ld = T.sblock_alloc_buffer((nt, lv), DTYPE, scope=local)
                        k_ld = T.sblock_alloc_buffer((nt, kv_iters, lv), DTYPE, scope=local)
                        v_ld = T.sblock_alloc_buffer((nt, kv_iters, lv), DTYPE, scope=local)
                        stat = T.sblock_alloc_buffer((nt, 3), "float32", scope=local)
                        m_run = T.sblock_alloc_buffer((nt, rpt), "float32", scope=local)  # running max per row
                        l_run = T.sblock_alloc_buffer((nt, rpt), "float32", scope=local)  # running sum per row
                        w_reg = T.sblock_alloc_buffer((nt, chunk), "float32", scope=local)
                        q_at = T.sblock_alloc_buffer((nt, sr), "int32", scope=local)
                        k_at = T.sblock_alloc_buffer((nt, tk), "int32", scope=local)
                        k_in = T.sblock_alloc_buffer((nt, tk), "int32", scope=local)

                        if device:  # waits first and never triggers: see dependent_launch.py
                            T.evaluate(T.call_extern("void", WAIT))
                        n: T.let[T.int32] = cache_lens[s]
                        # span[0] = first visible key, [1] = keys per split; then [0] = this split's start, [2] =
                        # its end, [3] = its chunk count. (A buffer, not lets: TVM refuses loads of allocated
                        # buffers in lets.)
                        split_span(span, s, n, blk_positions, nb)
                        span[0] = span[0] + p * span[1]
                        span[2] = T.min(span[0] + span[1], n + blk)
                        span[3] = T.if_then_else(span[0] < span[2], T.ceildiv(span[2] - span[0], chunk), 0)
                        start = T.meta_var(span[0])
                        end = T.meta_var(span[2])
                        chunks = T.meta_var(span[3])

                        # init running statistics and accumulators
                        for t in lanes():
                            for rr in T.serial(rpt):
                                m_run[t, rr] = T.float32(NEG)
                                l_run[t, rr] = T.float32(0)
                            for i, j in T.grid(pr, 4 * nvec):
                                acc[t, i, j] = T.float32(0)
                            if rp > qr:  # score rows no thread computes: never visible
                                for it in T.serial(cdiv((rp - qr) * s_pitch, nt)):
                                    if it * nt + t < (rp - qr) * s_pitch:
                                        ps[qr * s_pitch + it * nt + t] = T.float32(NEG)

                        # stage Q (scaled, rows past the block's zero) and the query positions; a split
                        # past a short sequence's end skips it
                        for t in lanes():
                            for it in T.serial(cdiv(q_loads, nt)):
                                idx = T.meta_var(it * nt + t)
                                r = T.meta_var(idx // (dim // lv))
                                d0 = T.meta_var(idx % (dim // lv) * lv)
                                if idx < q_loads and chunks > 0:
                                    if r < rows:
                                        for x in T.vectorized(lv):
                                            q_ld[t, x] = q[s * blk + r // group, (g * group + r % group) * dim + d0 + x]
                                        for x in T.unroll(lv):
                                            qs[r * q_pitch + d0 + x] = T.Cast(
                                                q_dtype, T.Cast("float32", q_ld[t, x]) * q_scale
                                            )
                                    else:
                                        for x in T.unroll(lv):
                                            qs[r * q_pitch + d0 + x] = T.Cast(q_dtype, T.float32(0))
                            for rr in T.serial(cdiv(qr, nt)):
                                if rr * nt + t < qr:
                                    q_pos[rr * nt + t] = T.if_then_else(
                                        rr * nt + t < rows, blk_positions[s * blk + (rr * nt + t) // group], 0
                                    )

                        # Chunk ch+1's K/V rows are loaded into registers while chunk ch is computed.
                        for t in lanes():
                            fetch_kv(t, 0, k_ld, v_ld, kv, k, v, block_table, s, g, span, n)
                        for ch in T.serial(chunks):
                            k0 = T.meta_var(start + ch * chunk)
                            # stage the fetched rows (zeros past the split's end) and their positions
                            for t in lanes():
                                for it in T.serial(kv_iters):
                                    idx = T.meta_var(it * nt + t)
                                    c = T.meta_var(idx // (dim // lv))
                                    d0 = T.meta_var(idx % (dim // lv) * lv)
                                    if idx < kv_loads:
                                        if k0 + c < end:
                                            for x in T.unroll(lv):
                                                ks[c * k_pitch + d0 + x] = T.Cast(kv_dtype, k_ld[t, it, x])
                                            for x in T.unroll(lv):
                                                vs[c, d0 + x] = T.Cast(kv_dtype, v_ld[t, it, x])
                                        else:
                                            for x in T.unroll(lv):
                                                ks[c * k_pitch + d0 + x] = T.Cast(kv_dtype, T.float32(0))
                                            for x in T.unroll(lv):
                                                vs[c, d0 + x] = T.Cast(kv_dtype, T.float32(0))
                                for cc in T.serial(cdiv(chunk, nt)):
                                    if cc * nt + t < chunk:
                                        k_ok[cc * nt + t] = T.if_then_else(k0 + cc * nt + t < end, 1, 0)
                                        k_pos[cc * nt + t] = T.if_then_else(
                                            k0 + cc * nt + t < n,
                                            k0 + cc * nt + t,
                                            T.if_then_else(
                                                k0 + cc * nt + t < end, blk_positions[s * blk + k0 + cc * nt + t - n], 0
                                            ),
                                        )

                            for t in lanes():
                                if ch + 1 < chunks:
                                    fetch_kv(t, ch + 1, k_ld, v_ld, kv, k, v, block_table, s, g, span, n)

                            # scores: thread (t // sc, t % sc) owns rows t//sc*sr.. and keys t%sc + j*sc
                            for t in lanes():
                                for i, j in T.grid(sr, tk):
                                    sacc[t, i, j] = T.float32(0)
                                if masked:
                                    for i in T.unroll(sr):
                                        q_at[t, i] = q_pos[t // sc * sr + i]
                                    for j in T.unroll(tk):
                                        k_at[t, j] = k_pos[j * sc + t % sc]
                                for j in T.unroll(tk):
                                    k_in[t, j] = k_ok[j * sc + t % sc]
                                for d4 in T.serial(dim // 4):
                                    for i in T.unroll(sr):
                                        for x in T.vectorized(4):
                                            q_reg[t, i, x] = T.Cast(
                                                "float32", qs[(t // sc * sr + i) * q_pitch + d4 * 4 + x]
                                            )
                                    for j in T.unroll(tk):
                                        for x in T.vectorized(4):
                                            k_reg[t, j, x] = T.Cast(
                                                "float32", ks[(j * sc + t % sc) * k_pitch + d4 * 4 + x]
                                            )
                                    for i in T.unroll(sr):
                                        for j in T.unroll(tk):
                                            for x in T.unroll(4):
                                                sacc[t, i, j] = sacc[t, i, j] + q_reg[t, i, x] * k_reg[t, j, x]
                                for i in T.unroll(sr):
                                    for j in T.unroll(tk):
                                        ps[(t // sc * sr + i) * s_pitch + j * sc + t % sc] = T.if_then_else(
                                            tirx.all(k_in[t, j] == 1, visible(q_at[t, i], k_at[t, j])),
                                            sacc[t, i, j],
                                            T.float32(NEG),
                                        )

                            # Online softmax. Thread t keeps the running (max, sum) of row (rr*nt + t) % rp in
                            # registers; rows have several identical copies when rp < nt, so this phase has no
                            # branch and reads shared memory before it writes (TVM plans barriers for dynamic
                            # shared memory as one buffer, and cannot place one inside a branch or per loop step).
                            for t in lanes():
                                for rr in T.serial(rpt):
                                    stat[t, 0] = m_run[t, rr]
                                    for c in T.serial(chunk):
                                        stat[t, 0] = T.max(stat[t, 0], ps[(rr * nt + t) % rp * s_pitch + c])
                                    stat[t, 1] = T.float32(0)
                                    for c in T.serial(chunk):
                                        w_reg[t, c] = T.if_then_else(
                                            ps[(rr * nt + t) % rp * s_pitch + c] > T.float32(NEG * 0.5),
                                            T.exp2(ps[(rr * nt + t) % rp * s_pitch + c] - stat[t, 0]),
                                            T.float32(0),
                                        )
                                        stat[t, 1] = stat[t, 1] + w_reg[t, c]
                                    stat[t, 2] = T.exp2(m_run[t, rr] - stat[t, 0])
                                    l_run[t, rr] = l_run[t, rr] * stat[t, 2] + stat[t, 1]
                                    m_run[t, rr] = stat[t, 0]
                                    for c in T.serial(chunk):
                                        pw[(rr * nt + t) % rp * s_pitch + c] = w_reg[t, c]
                                    alpha[(rr * nt + t) % rp] = stat[t, 2]

                            # P·V: thread (t // pc, t % pc) owns rows t//pc*pr.. and float4s at column group
                            # min(t % pc, groups - 1) of each of the nvec spans of span_d columns
                            for t in lanes():
                                for i in T.unroll(pr):
                                    for j in T.unroll(4 * nvec):
                                        acc[t, i, j] = acc[t, i, j] * alpha[t // pc * pr + i]
                                for c in T.serial(chunk):
                                    for i in T.unroll(pr):
                                        p_reg[t, i] = pw[(t // pc * pr + i) * s_pitch + c]
                                    for h in T.unroll(nvec):
                                        for x in T.vectorized(4):
                                            v_reg[t, h, x] = T.Cast(
                                                "float32", vs[c, h * span_d + T.min(t % pc, groups - 1) * 4 + x]
                                            )
                                    for i in T.unroll(pr):
                                        for h in T.unroll(nvec):
                                            for x in T.unroll(4):
                                                acc[t, i, h * 4 + x] = (
                                                    acc[t, i, h * 4 + x] + p_reg[t, i] * v_reg[t, h, x]
                                                )

                        # this split's unnormalised output and (max, sum); an empty split leaves sum 0
                        for t in lanes():
                            for i in T.serial(pr):
                                if t // pc * pr + i < rows and t % pc < groups and chunks > 0:
                                    for h in T.serial(nvec):
                                        for x in T.vectorized(4):
                                            part_o[s, g, p, t // pc * pr + i, h * span_d + t % pc * 4 + x] = acc[
                                                t, i, h * 4 + x
                                            ]
                            for rr in T.serial(cdiv(rows, nt)):
                                if rr * nt + t < rows:
                                    part_ml[s, g, p, rr * nt + t, 0] = m_run[t, rr]
                                    part_ml[s, g, p, rr * nt + t, 1] = l_run[t, rr]

    return attention_prim_func(spec, splits, chunk, device, split, layout.slots)


# --------------------------------------------------------------------------------------------- rule


def default_splits(target: Target) -> int:
    """The largest power of two of splits that puts one sequence's 8 kv heads (the Qwen3 drafters') on at
    most one block per SM: blocks sharing an SM set the pace."""
    splits = 1
    while splits * 2 * 8 <= target.sm_count:
        splits *= 2
    return splits


class BlockAttentionOp:
    """What every block-attention rule shares (this module's, `attention_mma.py`'s and
    `attention_wgmma.py`'s): the `block_attention` node it takes, as a BlockAttentionSpec, and the one layer
    of the cache each call reads."""

    def spec_of(self, subject: Any) -> BlockAttentionSpec | None:
        if isinstance(subject, BlockAttentionSpec):
            return subject
        if not isinstance(subject, OpInstance) or subject.op is not Op.BLOCK_ATTENTION or len(subject.inputs) != 7:
            return None
        q, k, v, cache, table, lens, pos = subject.inputs
        if any(x.dtype != DTYPE for x in (q, k, v, cache, *subject.outputs)):
            return None
        if any(x.dtype != "int32" for x in (table, lens, pos)) or len(cache.shape) != 6:
            return None
        try:
            spec = BlockAttentionSpec(
                block=int(subject.attr("block")),
                heads=int(subject.attr("heads")),
                kv_heads=int(subject.attr("kv_heads")),
                head_dim=int(subject.attr("head_dim")),
                causal=bool(subject.attr("causal")),
                window=None if subject.attr("window", None) is None else int(subject.attr("window")),
                page_size=int(subject.attr("page_size")),
            )
        except ScheduleError:
            return None
        if tuple(cache.shape[3:]) != (spec.page_size, spec.kv_heads, spec.head_dim) or cache.shape[1] != 2:
            return None
        if q.shape[-1] != spec.heads * spec.head_dim or k.shape[-1] != spec.kv_heads * spec.head_dim:
            return None
        return spec

    def views(self, op: OpInstance) -> dict[str, tuple[int, ...]]:
        return {"kv": (int(op.attr("layer")),)}


class AttentionRule(BlockAttentionOp, FamilyRule):
    """`block_attention` nodes over a bf16 paged cache (or a BlockAttentionSpec).

    Knobs: `threads` per block (both kernels), `chunk` keys staged per step (a power of two), `splits`
    (thread blocks one (sequence, kv head) is split across; spans adapt to each length).
    """

    name = "block_attention"
    knob_names = ("threads", "chunk", "splits")

    def default_knobs(self, target: Target) -> dict[str, int]:
        # 256 threads: 8 warps cover a 64 x 32 score tile at 8 scores per thread. Chunk 32 fits sm_120's
        # 99 KiB with f32 staging (64 was slower on an H200). On an H200 16 splits beat 32 (74 vs 81 us
        # at 4096 keys, 162 vs 188 us for 8 sequences): fewer partials to merge; finer spans balanced no better.
        return {"threads": min(256, target.max_threads_per_block), "chunk": 32, "splits": default_splits(target)}

    def schedule(self, spec: BlockAttentionSpec, target: Target, knobs: Mapping[str, int]) -> Any:
        layout = fit_layout(spec, target, knobs["threads"], knobs["chunk"], knobs["splits"])
        return attention_func(spec, layout, device=True).with_attr("tirx.is_scheduled", True)
